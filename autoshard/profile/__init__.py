"""Measure a hardware profile of the running cluster (``autoshard profile``), under torchrun.

Every rank runs :func:`~autoshard.profile.measure.measure_profile`, and every measurement runs on
all ranks at once, as ranks compute and communicate together in training (ranks that share CPU
cores or a host's memory bandwidth slow each other down, and the profile must say so). One timing
helper, :func:`~autoshard.profile.timing._median_time`, times everything: each timed run starts
right after a barrier, the median over runs is kept, and then the maximum over ranks (the slowest
rank sets the pace of a step). Where ranks outnumber the CPU cores, a compute or optimizer run counts
as at least its process CPU time x local ranks / cores: a training step then runs at the pace of the
CPU all ranks need, while ranks timed side by side drift apart and the last ones run alone.

- **Links.** For each mesh axis with more than one device it times all-reduce at several message
  sizes (all groups of an axis at once, each between slices of compute as a step issues them, see
  :func:`~autoshard.profile.collectives._time_collective`) and fits the ring model of
  :mod:`autoshard.comm_cost`, ``t(B) = 2(n-1) * alpha + 2(n-1)/n * B * beta``, by least squares on
  relative error (so the small messages that pin down alpha weigh as much as the large ones that
  pin down beta).
- **Roofline.** FLOP/s of a large square matmul, memory bandwidth of a large copy (read + write
  bytes) and, on CUDA, pinned host<->device copies: the fallback for ops without a measured curve.
- **Compute curves** (``compute`` in the profile, see :mod:`autoshard.hardware`), float32 and on CUDA
  also bfloat16: forward and backward seconds of one op against its forward work, for the families
  ``matmul`` (``F.linear`` with bias, transformer-like tokens x in -> out shapes, thin and square),
  ``matmul_unaligned`` (the same with out features + 1, rows of no whole multiple of 16 bytes, as an
  odd vocabulary makes them: a GPU runs them on slower kernels), ``matmul_rows1``, ``matmul_rows2``,
  ``matmul_rows4`` and ``matmul_rows8`` (``F.linear`` on 1, 2, 4 and 8 rows, weights of 256 KiB to 16 MiB,
  by bytes: a linear on a few rows reads its whole weight for few FLOPs),
  ``conv`` (3x3 ``F.conv2d`` with bias, C -> C channels, 16 to 64 channels on 8x8 to 64x64 images),
  ``conv_unaligned`` (the same with channel counts of no whole multiple of 16, 4 to 40: oneDNN runs
  them outside its blocked layouts),
  ``attention`` (causal ``F.scaled_dot_product_attention``, head dims 32 to 64, on CUDA also 128),
  ``attention_narrow`` (the same batches, heads and sequences at head dim 16: per FLOP a narrow head
  costs more, the score matrix's softmax not shrinking with it; :data:`autoshard.hardware.NARROW_HEAD_DIM`), ``pointwise`` (the median of add and mul
  at equal bytes), ``transcendental`` (the median of tanh-GELU, SiLU, tanh and sigmoid), one curve for each
  of ``exp``, ``log``, ``tanh``, ``sigmoid``, ``silu``, ``gelu`` and ``gelu_tanh`` (their costs per byte are
  10x apart on a CPU; exp and log side by side, their chains would overflow), ``norm`` (``F.layer_norm``),
  ``batch_norm`` (training ``F.batch_norm`` on N, C, H, W images), ``sync_batch_norm`` (the runtime's
  sync-BN kernel on the same images, on a one-device mesh: its local compute), ``max_pool`` and ``avg_pool`` (2x2
  ``F.max_pool2d`` and ``F.avg_pool2d``), ``loss`` (``F.cross_entropy`` over tokens x vocabulary logits),
  ``copy_blocks`` (a copy reading runs of 16 elements: what laying a shard out along an inner dim
  costs, :meth:`autoshard.hardware.HardwareProfile.copy_seconds`) and ``view`` (a transpose of a
  square matrix and a reshape, which copy nothing: a view's dispatch and autograd node,
  :meth:`autoshard.hardware.HardwareProfile.view_seconds`). Work is counted exactly as autoshard counts it: FLOPs from
  ``FlopCounterMode`` on meta tensors of the same shapes (as :mod:`autoshard.opinfo` profiles a
  node), or bytes of the op's tensor inputs and outputs. An op is timed in a chain of ``k``
  identical ops, each one's output the next one's input, as ops follow each other in a model: the
  forward of the chain and its backward (one ``autograd.grad`` for the gradients of every float
  input) divided by ``k``; an op whose output cannot be the next one's input (the loss, a pool) runs
  ``k`` side by side instead, each on an input of its own. Small or fast ops get long chains (at least 2e8 FLOPs
  or 1.6e7 bytes of work, and 3 ms of forward + backward, at most 64 ops), so that the per-op dispatch
  and autograd overheads are those of a step, not those of a lone call (one ``autograd.grad`` call
  costs ~0.1 ms on an H100's host); large ops a chain of one. Forward and backward are
  timed over more instances, every output held, until they write twice the last-level cache (at
  most 512): a step's forward writes activations that live until backward to memory out of cache,
  and its backward reads them back from there, while a short chain timed again and again works in
  the same cached buffers (on a CPU, memory-bound ops in a GPT-2 forward ran 2-4x the short chain's
  time; the backward of exp, log, tanh and sigmoid took 1.2-2x over the cold chain).
- **Optimizer.** ``torch.optim.AdamW.step`` (torch's default implementation for the device) over
  parameter lists of several tensor counts and sizes, fitted to ``n * per_tensor + bytes * per_byte``
  (least squares on relative error, both coefficients >= 0).
- **Overlap.** How much of an async all-reduce over all ranks hides behind compute: a matmul loop
  alone (C), an all-reduce sized to take about as long alone (A), and the all-reduce launched with
  ``async_op=True`` while the loop runs (T); ``overlap = clamp((C + A - T) / min(C, A), 0, 1)``.

Rank 0 writes the YAML.


Modules, by job: ``timing.py`` (the process group and the one timing helper), ``collectives.py``
(links: collectives as a step issues them, overlap with compute), ``compute.py`` (roofline,
per-family compute curves, the optimizer step), ``fitting.py`` (the models fitted to the timings),
``measure.py`` (every measurement on all ranks, assembled into a HardwareProfile) and
``command.py`` (the ``autoshard profile`` command: options, the YAML rank 0 writes, its summary).
"""
from .collectives import MEASURED_KINDS
from .command import add_profile_arguments, main, run_profile
from .compute import COMPUTE_OPS, op_work
from .fitting import fit_alpha_beta, fit_optimizer, overlap_fraction
from .measure import DEFAULT_SIZES, measure_profile
from .timing import ProfileError

__all__ = ["COMPUTE_OPS", "DEFAULT_SIZES", "MEASURED_KINDS", "ProfileError", "add_profile_arguments", "fit_alpha_beta",
           "fit_optimizer", "main", "measure_profile", "op_work", "overlap_fraction", "run_profile"]
