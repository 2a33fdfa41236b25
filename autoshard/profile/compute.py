"""Compute measurements: the roofline fallback (a large matmul, a large copy, pinned host copies on
CUDA), per-family compute curves (forward and backward seconds per op against its forward work,
each op timed in a chain of identical ops) and the optimizer step.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ..hardware import (COMPUTE_FAMILIES, COPY_RUN, ELEMENTWISE_FUNCTIONS, FEW_ROWS, NARROW_HEAD_DIM, ComputeCurve,
                        HardwareProfile, OptimizerModel)
from ..progress import Progress
from .timing import ProfileError, _barrier, _device, _dtypes, _max_over_ranks, _median_time, _sync

__all__ = ["COMPUTE_OPS", "DRIFT_FAMILIES", "DRIFT_PROXY", "DriftPoint", "add_measured_curve", "drift_scaled", "op_work",
           "remeasure_drift"]

_COPY_BYTES = 64 * 2**20


def _matmul_seconds(dtype: torch.dtype, n: int, device: torch.device, iters: int, warmup: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return _median_time(lambda: torch.mm(a, b), device, iters, warmup)


def _copy_seconds(src: torch.Tensor, dst: torch.Tensor, device: torch.device, iters: int, warmup: int) -> float:
    return _median_time(lambda: dst.copy_(src, non_blocking=True), device, iters, warmup)


@dataclass(frozen=True)
class _Local:
    """This rank's local measurements, as seconds (so that the max over ranks is the slowest)."""

    matmul_n: int
    matmul_s: dict[str, float]
    copy_s: float
    host_copy_s: float | None


def _measure_local(device: torch.device, iters: int, warmup: int) -> _Local:
    cuda = device.type == "cuda"
    n = 8192 if cuda else 1024
    _barrier(None, device)  # all ranks measure together, as they compute together in training
    matmul = {name: _matmul_seconds(dt, n, device, iters, warmup) for name, dt in _dtypes(device).items()}
    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    copy = _copy_seconds(src, torch.empty_like(src), device, iters, warmup)
    host = None
    if cuda:
        pinned = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
        host = max(_copy_seconds(pinned, src, device, iters, warmup),
                   _copy_seconds(src, pinned, device, iters, warmup))
    return _Local(n, matmul, copy, host)


# -- compute curves -------------------------------------------------------------------------------------
# Sizes per family, smallest first; CUDA adds larger ones (a GPU reaches its rate much later).
# matmul: tokens, in, out: thin (fewer tokens than features), square and MLP-wide, 1.3e5 .. 9.7e9 FLOPs
MATMUL_SHAPES = ((16, 64, 64), (32, 128, 128), (64, 256, 256), (64, 512, 512), (512, 512, 512),
                 (1024, 768, 768), (512, 768, 3072), (2048, 768, 3072))
# the same with rows that are no whole multiple of 16 bytes (out features + 1; the chain alternates, so
# in features too), as an odd vocabulary makes them: GPUs run these on slower kernels
MATMUL_UNALIGNED_SHAPES = ((16, 64, 65), (64, 256, 257), (512, 512, 513), (1024, 768, 769), (2048, 768, 3073))
# linears on few rows (FEW_ROWS), one curve per row count, by bytes: weights of 256 KiB to 16 MiB
FEW_ROWS_WEIGHTS = ((256, 256), (512, 1024), (1024, 2048), (2048, 2048))       # in, out
IMAGE_SHAPES = ((1, 4, 16, 16), (2, 8, 32, 32), (2, 16, 64, 64), (4, 32, 64, 64), (8, 64, 64, 64))  # N, C, H, W
# convolutions: channel counts that are whole multiples of 16 (oneDNN's blocked layouts), and the same
# sizes with counts that are not (a first layer's 3 colours, a 16-channel layer split over 2 or 4
# devices), which oneDNN runs outside those layouts
CONV_SHAPES = ((1, 16, 8, 8), (2, 16, 16, 16), (2, 16, 64, 64), (4, 32, 64, 64), (8, 64, 64, 64))
CONV_UNALIGNED_SHAPES = ((1, 4, 16, 16), (2, 8, 32, 32), (2, 12, 64, 64), (4, 24, 64, 64), (8, 40, 64, 64))
ATTENTION_SHAPES = ((1, 2, 32, 32), (1, 4, 64, 32), (2, 4, 128, 64), (2, 12, 256, 64), (2, 12, 512, 64),
                    (2, 12, 1024, 64))                                              # batch, heads, seq, head dim
# the same batches, heads and sequences at head dim NARROW_HEAD_DIM (see autoshard.hardware.NARROW_HEAD_DIM)
ATTENTION_NARROW_SHAPES = tuple((b, h, n, NARROW_HEAD_DIM) for b, h, n, _ in ATTENTION_SHAPES)
POINTWISE_UNITS = (128, 1024, 8192, 65536, 524288, 4194304)   # unary ops get 3x, binary 2x this many elements
VIEW_UNITS = (1024, 1048576)     # elements (squares); a view's time does not grow with them (two sizes show it)
NORM_SHAPES = ((4, 64), (16, 256), (64, 768), (1024, 768), (4096, 1024), (16384, 1024))  # tokens, hidden
LOSS_SHAPES = ((4, 64), (16, 512), (64, 2048), (256, 8192), (1024, 32768))               # tokens, vocabulary
CUDA_SIZES = {"matmul": ((4096, 4096, 4096), (8192, 8192, 8192)),
              "matmul_unaligned": ((4096, 4096, 4097), (8192, 768, 50257)), "conv": ((32, 256, 56, 56),),
              "conv_unaligned": ((32, 200, 56, 56),),
              "attention": ((8, 16, 2048, 128),), "attention_narrow": ((8, 16, 2048, NARROW_HEAD_DIM),),
              "pointwise": (33554432,), "transcendental": (33554432,),
              "norm": ((65536, 4096),), "loss": ((8192, 131072),),
              "batch_norm": ((32, 256, 56, 56),), "sync_batch_norm": ((32, 256, 56, 56),),
              "max_pool": ((32, 256, 56, 56),), "avg_pool": ((32, 256, 56, 56),),
              **{f"matmul_rows{r}": ((r, 8192, 8192),) for r in FEW_ROWS},
              **{name: (33554432,) for name in (*ELEMENTWISE_FUNCTIONS, "copy_blocks")}, "view": ()}
OPTIMIZER_PARAMS = ((1, 2**10), (16, 2**10), (128, 2**10), (2, 2**20), (8, 2**20), (8, 2**21))  # tensors, numel
CUDA_OPTIMIZER_PARAMS = ((16, 2**22), (8, 2**24), (4, 2**26))   # a GPU's per-byte rate shows from ~100 MB
_CHAIN_WORK = {"FLOPs": 2e8, "bytes": 1.6e7}   # a chain of small ops has at least this much work ...
_CHAIN_S = 3e-3                                 # ... and takes at least this long, forward + backward ...
_MAX_CHAIN = 64                                 # ... or has this many ops
_MAX_COLD_CHAIN = 512                           # forward: at most this many instances to outgrow the cache ...
_MAX_COLD_CHAIN_S = 0.5                         # ... and at most this many seconds of forward + backward
_COLD_BYTES_FALLBACK = 64 * 2**20               # where the last-level cache's size cannot be read
_COMPUTE_TIMING = {"budget_s": 1.0,            # seconds per timing, about, at most (at least 3 runs)
                   "run_s": 0.03,               # seconds per timed run, at least (see _median_time)
                   "cpu_shared": True}          # CPU ranks sharing cores: their share of the CPU


@dataclass(frozen=True)
class _Op:
    """One op to time: ``fn(x, *params(i))`` is instance ``i``; its output is the next one's ``x``."""

    fn: Callable[..., torch.Tensor]
    x: torch.Tensor
    params: Callable[[int], tuple]
    chain: bool = True        # False: the output cannot feed the next instance (a scalar loss, a pool)


def _leaf(shape: Sequence[int], dtype: torch.dtype, device: torch.device, scale: float = 1.0,
          shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale + shift).to(dtype).requires_grad_()


def _linear(shape, dtype, device) -> _Op:
    t, n_in, n_out = shape

    def params(i: int) -> tuple:          # in -> out, then out -> in: the chain keeps its shapes
        a, b = (n_in, n_out) if i % 2 == 0 else (n_out, n_in)
        return _leaf((b, a), dtype, device, a ** -0.5), _leaf((b,), dtype, device, 0.1)

    return _Op(F.linear, _leaf((t, n_in), dtype, device), params)


def _conv2d(shape, dtype, device) -> _Op:
    """3x3 convolution, C -> C channels, padding 1 (the chain keeps its shape), with bias."""
    channels = shape[1]

    def params(i: int) -> tuple:
        return (_leaf((channels, channels, 3, 3), dtype, device, (9 * channels) ** -0.5),
                _leaf((channels,), dtype, device, 0.1))

    def conv(x, w, b):
        return F.conv2d(x, w, b, padding=1)

    return _Op(conv, _leaf(shape, dtype, device), params)


def _attention(shape, dtype, device) -> _Op:
    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return _Op(sdpa, _leaf(shape, dtype, device), lambda i: (_leaf(shape, dtype, device), _leaf(shape, dtype, device)))


def _unary(fn):
    def build(units, dtype, device) -> _Op:
        return _Op(fn, _leaf((3 * units,), dtype, device), lambda i: ())
    return build


def _unary_apart(fn, shift: float = 0.0):
    """A unary op whose repeated application leaves its domain or overflows (exp, log): instances
    side by side, each on an input of its own (``randn + shift``)."""
    def build(units, dtype, device) -> _Op:
        return _Op(fn, _leaf((3 * units,), dtype, device, 1.0, shift), lambda i: (), chain=False)
    return build


def _binary(fn):
    def build(units, dtype, device) -> _Op:       # the other operand near 1: a chain of muls stays normal
        return _Op(fn, _leaf((2 * units,), dtype, device), lambda i: (_leaf((2 * units,), dtype, device, 0.1, 1.0),))
    return build


def _copy_blocks(units, dtype, device) -> _Op:
    """A copy that reads its input in runs of :data:`~autoshard.hardware.COPY_RUN` elements (two
    halves interleaved run by run, as laying a shard out along an inner dim does); the chain keeps
    its shape."""
    def copy(x):
        return x.view(-1, 2, COPY_RUN).transpose(0, 1).contiguous().view(-1)

    return _Op(copy, _leaf((3 * units,), dtype, device), lambda i: ())


def _transpose(units, dtype, device) -> _Op:
    """A view: the transpose of a square matrix (the chain keeps its shape)."""
    side = max(1, round(math.sqrt(units)))
    return _Op(lambda x: x.transpose(0, 1), _leaf((side, side), dtype, device), lambda i: ())


def _reshape_view(units, dtype, device) -> _Op:
    """A view: a (2, n / 2) tensor viewed as (n / 2, 2), then back (the chain alternates)."""
    return _Op(lambda x: x.view(x.shape[1], x.shape[0]), _leaf((2, units // 2), dtype, device), lambda i: ())


def _layer_norm(shape, dtype, device) -> _Op:
    def norm(x, w, b):
        return F.layer_norm(x, x.shape[-1:], w, b)

    h = shape[-1]
    return _Op(norm, _leaf(shape, dtype, device), lambda i: (_leaf((h,), dtype, device, 0.1, 1.0),
                                                            _leaf((h,), dtype, device, 0.1)))


def _training_batch_norm(norm: Callable[..., torch.Tensor]):
    """Training-mode batch norm ``norm(x, running_mean, running_var, weight, bias)`` over N, H, W per
    channel (running statistics updated, as in training; the per-channel tensors in float32, as under
    autocast)."""
    def build(shape, dtype, device) -> _Op:
        c = shape[1]
        running = (torch.zeros(c, device=device), torch.ones(c, device=device))
        return _Op(norm, _leaf(shape, dtype, device),
                   lambda i: (*running, _leaf((c,), torch.float32, device, 0.1, 1.0), _leaf((c,), torch.float32, device, 0.1)))
    return build


def _sync_batch_norm_local(x, mean, var, w, b):
    """The runtime's sync-BN kernel (:func:`autoshard.handlers.norms.sync_batch_norm`) on a one-device
    mesh: its local compute (statistics, normalisation, backward's sums and input gradient); its
    all-reduces are priced apart."""
    from ..handlers.norms import sync_batch_norm
    from ..kernel_comm import LocalComm

    return sync_batch_norm(x, w, b, mean, var, True, 0.1, 1e-5, comm=LocalComm(), axes=(0,))


def _pool(fn):
    """A 2x2 window, stride 2: the output is a quarter of the input, so instances do not chain."""
    def build(shape, dtype, device) -> _Op:
        return _Op(lambda x: fn(x, 2), _leaf(shape, dtype, device), lambda i: (), chain=False)
    return build


def _cross_entropy(shape, dtype, device) -> _Op:
    tokens, vocab = shape
    target = torch.randint(0, vocab, (tokens,), device=device)
    return _Op(F.cross_entropy, _leaf(shape, dtype, device), lambda i: (target,), chain=False)


# family -> (sizes, the ops whose median is the family's time at a size)
COMPUTE_OPS: dict[str, tuple[tuple, tuple[Callable[..., _Op], ...]]] = {
    "matmul": (MATMUL_SHAPES, (_linear,)),
    "matmul_unaligned": (MATMUL_UNALIGNED_SHAPES, (_linear,)),
    **{f"matmul_rows{r}": (tuple((r, n_in, n_out) for n_in, n_out in FEW_ROWS_WEIGHTS), (_linear,)) for r in FEW_ROWS},
    "conv": (CONV_SHAPES, (_conv2d,)),
    "conv_unaligned": (CONV_UNALIGNED_SHAPES, (_conv2d,)),
    "attention": (ATTENTION_SHAPES, (_attention,)),
    "attention_narrow": (ATTENTION_NARROW_SHAPES, (_attention,)),
    "pointwise": (POINTWISE_UNITS, (_binary(torch.add), _binary(torch.mul))),
    "transcendental": (POINTWISE_UNITS, (_unary(lambda x: F.gelu(x, approximate="tanh")), _unary(F.silu),
                                         _unary(torch.tanh), _unary(torch.sigmoid))),
    "exp": (POINTWISE_UNITS, (_unary_apart(torch.exp),)),
    "log": (POINTWISE_UNITS, (_unary_apart(torch.log, shift=8.0),)),
    "tanh": (POINTWISE_UNITS, (_unary(torch.tanh),)),
    "sigmoid": (POINTWISE_UNITS, (_unary(torch.sigmoid),)),
    "silu": (POINTWISE_UNITS, (_unary(F.silu),)),
    "gelu": (POINTWISE_UNITS, (_unary(F.gelu),)),
    "gelu_tanh": (POINTWISE_UNITS, (_unary(lambda x: F.gelu(x, approximate="tanh")),)),
    "norm": (NORM_SHAPES, (_layer_norm,)),
    "batch_norm": (IMAGE_SHAPES, (_training_batch_norm(lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=True)),)),
    "sync_batch_norm": (IMAGE_SHAPES, (_training_batch_norm(_sync_batch_norm_local),)),
    "max_pool": (IMAGE_SHAPES, (_pool(F.max_pool2d),)),
    "avg_pool": (IMAGE_SHAPES, (_pool(F.avg_pool2d),)),
    "loss": (LOSS_SHAPES, (_cross_entropy,)),
    "copy_blocks": (POINTWISE_UNITS, (_copy_blocks,)),
    "view": (VIEW_UNITS, (_transpose, _reshape_view)),
}


def op_work(family: str, op: _Op) -> float:
    """Forward work of one instance as autoshard counts it: FlopCounterMode FLOPs on meta tensors of
    the same shapes (what :mod:`autoshard.opinfo` does), or bytes of tensor inputs + outputs."""
    args = [torch.empty(t.shape, dtype=t.dtype, device="meta", requires_grad=t.requires_grad)
            for t in (op.x, *op.params(0))]
    with FlopCounterMode(display=False) as counter:
        out = op.fn(*args)
    if COMPUTE_FAMILIES[family] == "FLOPs":
        return float(counter.get_total_flops())
    return float(sum(t.numel() * t.element_size() for t in (*args, out)))


def _last_level_cache_bytes(device: torch.device) -> int | None:
    """The size of the device's last-level cache: the GPU's L2, or the largest CPU cache sysfs lists."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or None
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=None)


def _cold_bytes(device: torch.device) -> int:
    """Bytes a timed forward writes before its memory is out of cache: twice the last-level cache."""
    llc = _last_level_cache_bytes(device)
    return 2 * llc if llc else _COLD_BYTES_FALLBACK


def _instances(op: _Op, k: int) -> tuple[list[tuple], list[torch.Tensor]]:
    """Parameters and inputs of ``k`` instances: a chain has one input, side-by-side ops one each."""
    params = [op.params(i) for i in range(k)]
    inputs = [op.x] if op.chain else [op.x] + [op.x.detach().clone().requires_grad_() for _ in range(k - 1)]
    return params, inputs


def _run(op: _Op, params: list[tuple], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every instance's output, all held (as a forward holds its activations for backward)."""
    if not op.chain:
        return [op.fn(x, *ps) for x, ps in zip(inputs, params)]
    outs, y = [], op.x
    for ps in params:
        y = op.fn(y, *ps)
        outs.append(y)
    return outs


def _chain_length(family: str, op: _Op, work: float, device: torch.device) -> int:
    """Instances of ``op`` in a timed chain: enough work (:data:`_CHAIN_WORK`) and enough time
    (:data:`_CHAIN_S`, forward + backward) that the fixed costs of one timed call vanish beside the
    ops, as they do in a step's one forward and one backward; at most :data:`_MAX_CHAIN`. Time
    matters where work does not tell: one ``autograd.grad`` call costs ~0.1 ms of engine start-up on
    an H100's host, as much as the backward of a 4096 x 1024 x 4096 bfloat16 matmul."""
    k = min(_MAX_CHAIN, max(1, math.ceil(_CHAIN_WORK[COMPUTE_FAMILIES[family]] / max(work, 1.0))))
    if k == _MAX_CHAIN:
        return k
    return min(_MAX_CHAIN, max(k, math.ceil(_CHAIN_S / _one_call_seconds(op, device))))


def _one_call_seconds(op: _Op, device: torch.device) -> float:
    """Forward + backward seconds of one instance, after one untimed call (a rough figure: it only
    sizes the chain)."""
    def call() -> None:
        out = op.fn(op.x, *op.params(0))
        torch.autograd.grad([out], [op.x], [torch.ones_like(out)])

    call()
    _sync(device)
    t0 = time.perf_counter()
    call()
    _sync(device)
    return max(time.perf_counter() - t0, 1e-9)


def _cold_chain_cap(op: _Op, device: torch.device) -> int:
    """Instances of ``op`` whose forward + backward take about :data:`_MAX_COLD_CHAIN_S`, at least 1.
    The cache a machine reports can be far more than its ranks get: a VM's 2 cores listed their
    host's 300 MiB L3, and chains writing twice that made the attention curve (6 sizes) take 21
    minutes of a 43-minute profile."""
    return max(1, int(_MAX_COLD_CHAIN_S / _one_call_seconds(op, device)))


def _time_op(family: str, op: _Op, device: torch.device, iters: int) -> tuple[float, float, float]:
    """(work, forward seconds, backward seconds) of one instance, timed over ``k`` instances: a
    chain, or (an op whose output cannot be the next one's input) ``k`` side by side, each on an
    input of its own (so that backward adds no gradients up), differentiated in one call.

    Both are timed over enough instances, every output held, that what the forward writes outgrows
    the last-level cache (up to :data:`_MAX_COLD_CHAIN`, and :func:`_cold_chain_cap`, never below the
    short chain): a training step's forward writes its
    activations to memory it has not touched since the last step (they live until backward), and
    its backward reads them back long after they left the cache, while a short chain timed again and
    again works in the same few cached buffers. On a CPU the short chain made memory-bound ops in a
    model's forward 2-4x faster than in the step (a GPT-2 forward's adds, muls and log-softmax); over
    the cold chain the backward of exp, log, tanh and sigmoid, which read a saved tensor, took
    1.2-2x the short chain's time (4 ranks on 2 cores), and the plans of the fidelity bench were
    modeled a median 4% slower, nearer their measured steps."""
    work = op_work(family, op)
    k = _chain_length(family, op, work, device)
    one = _run(op, *_instances(op, 1))
    fresh = sum(t.numel() * t.element_size() for t in one[:1] + ([] if op.chain else [op.x]))
    del one
    k = max(k, min(_MAX_COLD_CHAIN, _cold_chain_cap(op, device), math.ceil(_cold_bytes(device) / max(fresh, 1))))
    # one length on every rank: the lengths come from each rank's own timings, and a run's CPU time
    # is averaged over the ranks (see _median_time), which holds only where they do the same work
    k = int(_max_over_ranks([float(k)], device)[0])
    params, inputs = _instances(op, k)
    fwd = _median_time(lambda: _run(op, params, inputs), device, iters, 1, **_COMPUTE_TIMING)
    leaves = inputs + [p for ps in params for p in ps if p.requires_grad]
    outs = _run(op, params, inputs)
    tail = outs if not op.chain else outs[-1:]
    grads = [torch.ones_like(out) for out in tail]
    bwd = _median_time(lambda: torch.autograd.grad(tail, leaves, grads, retain_graph=True),
                       device, iters, 1, **_COMPUTE_TIMING)
    return work, fwd / k, bwd / k


def _compute_sizes(family: str, device: torch.device, points: int | None) -> tuple:
    sizes = COMPUTE_OPS[family][0] + (CUDA_SIZES[family] if device.type == "cuda" else ())
    return sizes if points is None else sizes[:points]


RECHECK_FASTER = 0.15
"""A compute curve is measured again when its middle point, timed once more after every family's
curve, takes this much less time than it did in the curve (see :func:`_measure_compute`)."""


REMEASURED = "remeasured"
"""Key of :func:`_measure_compute`'s flags (1.0 per family of :data:`COMPUTE_OPS` timed twice) per dtype."""


def measured_under_load(curve_s: float, recheck_s: float) -> bool:
    """Whether a curve's point of ``curve_s`` seconds, timed again at ``recheck_s``, was measured
    while something else slowed the machine: the recheck is :data:`RECHECK_FASTER` faster. Another
    load can only slow an op, so the faster figure is the machine's own; a slower recheck says the
    load is now, and the curve stays."""
    return recheck_s < (1.0 - RECHECK_FASTER) * curve_s


def faster_rows(first: Sequence[tuple[float, float, float]],
                second: Sequence[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """Per size, the faster forward and the faster backward of two timings of one curve
    (``(work, fwd s, bwd s)`` rows of the same sizes)."""
    if [w for w, _, _ in first] != [w for w, _, _ in second]:
        raise ProfileError("two timings of one compute curve differ in work")
    return [(w, min(f1, f2), min(b1, b2)) for (w, f1, b1), (_, f2, b2) in zip(first, second)]


def _measure_compute(device: torch.device, iters: int, points: int | None,
                     progress: Progress | None = None) -> dict[str, list[float]]:
    """This rank's compute timings: ``'<dtype>.<family>.<work|fwd|bwd>'`` -> one value per size.

    After every family's curve, each curve's middle point is timed once more; a curve whose point
    measures :func:`measured_under_load` then is timed again whole and keeps, per size, the faster
    of its two timings (:func:`faster_rows`). On a shared VM another tenant's load comes and goes
    within minutes: one profile's matmul curve, timed in such a minute, came out 1.15-2.4x the
    times the same ops took right after the profile (4 CPU ranks on 2 cores), and a BERT's plans
    were modeled 14-61% above their steps. The decision is taken on the slowest rank's times, the same on every rank."""
    out: dict[str, list[float]] = {}
    progress = progress or Progress(False)
    for dname, dtype in _dtypes(device).items():
        curves = {}
        for family, (_, builders) in COMPUTE_OPS.items():
            sizes = _compute_sizes(family, device, points)
            with progress.stage(f"timing {dname} {family} compute ({len(sizes)} sizes)"):
                curves[family] = _time_family(family, builders, sizes, dtype, device, iters)
        with progress.stage(f"timing the middle point of each {dname} compute curve again"):
            loaded = _families_measured_under_load(curves, dtype, device, iters, points)
        for family in loaded:
            sizes = _compute_sizes(family, device, points)
            with progress.stage(f"timing {dname} {family} compute again (its middle point measured "
                                f"{100 * RECHECK_FASTER:.0f}%+ faster after the curves: the machine was loaded)"):
                again = _time_family(family, COMPUTE_OPS[family][1], sizes, dtype, device, iters)
            curves[family] = faster_rows(curves[family], again)
        for family, rows in curves.items():
            for j, field in enumerate(("work", "fwd", "bwd")):
                out[f"{dname}.{family}.{field}"] = [r[j] for r in rows]
        out[f"{dname}.{REMEASURED}"] = [float(family in loaded) for family in curves]
    return out


def _families_measured_under_load(curves: Mapping[str, Sequence[tuple[float, float, float]]], dtype: torch.dtype,
                                  device: torch.device, iters: int, points: int | None) -> list[str]:
    """The families of ``curves`` whose middle point, timed again now, is :func:`measured_under_load`
    (the slowest rank's figures, so every rank decides alike)."""
    figures = []
    for family, rows in curves.items():
        sizes = _compute_sizes(family, device, points)
        mid = len(rows) // 2
        _, fwd, bwd = _time_family(family, COMPUTE_OPS[family][1], (sizes[mid],), dtype, device, iters)[0]
        figures += [rows[mid][1] + rows[mid][2], fwd + bwd]
    agreed = _max_over_ranks(figures, device)
    return [family for i, family in enumerate(curves) if measured_under_load(agreed[2 * i], agreed[2 * i + 1])]


def _time_family(family: str, builders, sizes, dtype: torch.dtype, device: torch.device,
                 iters: int) -> list[tuple[float, float, float]]:
    """(work, median forward s, median backward s) per size of one compute family."""
    rows = []
    for size in sizes:
        _barrier(None, device)
        timed = [_time_op(family, build(size, dtype, device), device, iters) for build in builders]
        works = {w for w, _, _ in timed}
        if len(works) != 1:
            raise ProfileError(f"the {family} ops at size {size} differ in work: {sorted(works)}")
        rows.append((works.pop(), statistics.median(f for _, f, _ in timed),
                     statistics.median(b for _, _, b in timed)))
    return rows


def _compute_curve(agreed: dict[str, list[float]], key: str) -> ComputeCurve:
    """The curve of one family: its times made non-decreasing in work (a time above that of a
    larger size is scheduling noise of ranks sharing cores, clipped to the larger size's time)."""
    def non_decreasing(times: list[float]) -> tuple[float, ...]:
        out = list(times)
        for i in range(len(out) - 2, -1, -1):
            out[i] = min(out[i], out[i + 1])
        return tuple(out)

    return ComputeCurve(tuple(agreed[f"{key}.work"]), non_decreasing(agreed[f"{key}.fwd"]),
                        non_decreasing(agreed[f"{key}.bwd"]))


def optimizer_params(device: torch.device) -> tuple[tuple[int, int], ...]:
    """The parameter lists (tensors, elements each) the optimizer step is timed over."""
    return OPTIMIZER_PARAMS + (CUDA_OPTIMIZER_PARAMS if device.type == "cuda" else ())


CHECKPOINT_CHAINS = (1, 4, 16)
"""Checkpointed chains timed: this many (linear, tanh) pairs in one region (3 saved tensors each)."""
_CHECKPOINT_SHAPE = (16, 64)        # rows x features: small, so the machinery shows beside the ops


def _measure_checkpoint(device: torch.device, iters: int) -> dict[str, list[float]]:
    """What ``torch.utils.checkpoint`` (non-reentrant, as the runtime runs a recomputed segment) adds
    to a training step beyond running the region's forward again: per chain of :data:`CHECKPOINT_CHAINS`
    (linear, tanh) pairs, checkpointed forward + backward less plain forward + backward less one more
    forward (at least 0), against the tensors the chain's forward saves (counted by autograd's
    saved-tensor hooks, as the planner counts them per node)."""
    from torch.utils.checkpoint import checkpoint

    rows, width = _CHECKPOINT_SHAPE
    saved, seconds = [], []
    for length in CHECKPOINT_CHAINS:
        x = torch.randn(rows, width, device=device, requires_grad=True)
        weights = [(torch.randn(width, width, device=device) / width**0.5).requires_grad_() for _ in range(length)]

        def chain(y: torch.Tensor) -> torch.Tensor:
            for w in weights:
                y = torch.tanh(F.linear(y, w))
            return y

        packed: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
            chain(x)

        def plain() -> None:
            chain(x).sum().backward()

        def checkpointed() -> None:
            checkpoint(chain, x, use_reentrant=False).sum().backward()

        times = [_median_time(fn, device, iters, 2, **_COMPUTE_TIMING)
                 for fn in (plain, checkpointed, lambda: chain(x))]
        saved.append(float(len(packed)))
        seconds.append(max(0.0, times[1] - times[0] - times[2]))
    return {"checkpoint.saved": saved, "checkpoint.seconds": seconds}


def _measure_optimizer(device: torch.device, iters: int) -> dict[str, list[float]]:
    """AdamW step seconds over each parameter list of :func:`optimizer_params` (float32)."""
    seconds = []
    lists = optimizer_params(device)
    for n, numel in lists:
        params = [torch.zeros(numel, device=device, requires_grad=True) for _ in range(n)]
        for p in params:
            p.grad = torch.randn(numel, device=device) * 1e-3
        opt = torch.optim.AdamW(params)
        opt.step()                                    # creates the state: not part of a step's time
        _barrier(None, device)
        seconds.append(_median_time(opt.step, device, iters, 1, **_COMPUTE_TIMING))
        del opt, params
    return {"optimizer.n_tensors": [float(n) for n, _ in lists],
            "optimizer.bytes": [float(4 * n * numel) for n, numel in lists],
            "optimizer.seconds": seconds}


# -- drift: the profile's own compute points, timed again ------------------------------------------------
DRIFT_FAMILIES = ("matmul", "attention", "pointwise", "norm", "conv", "conv_unaligned", "batch_norm", "view")
"""The families whose middle point :func:`remeasure_drift` times again. ``view`` is the one whose time
is all dispatch (a view moves no data): on a shared VM the per-op overhead that dominates a narrow
model's step may drift apart from the compute-bound middle points of the others (2026-12-07: the same
llama-40 plans measured 1.4x apart in runs ten minutes apart while those points moved by 7-15%)."""


@dataclass(frozen=True)
class DriftPoint:
    """One compute point of a profile timed again: ``now_s`` and ``profile_s`` are forward + backward
    seconds of one op of ``family`` at forward ``work`` (the middle size the profile measures)."""

    family: str
    work: float
    now_s: float
    profile_s: float

    @property
    def ratio(self) -> float:
        """Time now over the profile's: above 1, the machine is slower than when it was profiled."""
        return self.now_s / self.profile_s


def remeasure_drift(hw: HardwareProfile, iters: int = 5, families: Sequence[str] = DRIFT_FAMILIES,
                    dtype: str = "float32") -> list[DriftPoint]:
    """Time the middle size of each of ``families`` again, on every rank at once, exactly as the
    profile timed it (collective: call on all ranks), against ``hw``'s curve at the same work.

    A cost model can only be as right as the machine is still the one it measured: on a shared VM the
    same op's time moves by a third within minutes. A benchmark that compares modeled with measured
    steps calls this beside its measurements, so that a step measured far from its model on a machine
    that drifted is told apart from an error of the model. Families ``hw`` has no curve for are left
    out."""
    device = _device()
    torch_dtype = _dtypes(device)[dtype]
    points = []
    for family in families:
        sizes, builders = COMPUTE_OPS[family]
        if hw.op_seconds(family, 1.0, "fwd", dtype) is None:
            continue
        work, fwd, bwd = _time_family(family, builders, (sizes[len(sizes) // 2],), torch_dtype, device, iters)[0]
        fwd, bwd = _max_over_ranks([fwd, bwd], device)     # as the profile agrees its values
        profile_s = hw.op_seconds(family, work, "fwd", dtype) + hw.op_seconds(family, work, "bwd", dtype)
        points.append(DriftPoint(family, work, fwd + bwd, profile_s))
    return points


def add_measured_curve(hw: HardwareProfile, family: str, iters: int = 10, points: int | None = None,
                       dtype: str = "float32") -> HardwareProfile:
    """``hw`` with the ``family`` curve measured now, on every rank at once as ``autoshard profile``
    measures it (collective: call on all ranks), and brought to the moment ``hw`` was measured: its
    times divided by the drift of its :data:`DRIFT_PROXY` family (that family's middle point timed again
    against ``hw``'s curve, :func:`remeasure_drift`), so that it stands to ``hw``'s other curves as it
    did to the curves measured beside it. For a family added to autoshard after a shipped profile was
    measured (``scripts/add_compute_curve.py``); ``points``: only the smallest sizes (tests)."""
    proxy = DRIFT_PROXY.get(family, family)
    if hw.op_seconds(proxy, 1.0, "fwd", dtype) is None:
        raise ProfileError(f"profile {hw.name!r} has no {dtype} {proxy!r} curve to bring the {family!r} curve "
                           f"to its moment; measure the whole profile again (autoshard profile)")
    device = _device()
    sizes = _compute_sizes(family, device, points)
    rows = _time_family(family, COMPUTE_OPS[family][1], sizes, _dtypes(device)[dtype], device, iters)
    agreed = _max_over_ranks([v for row in rows for v in row], device)     # as the profile agrees its values
    key = f"{dtype}.{family}"
    curve = _compute_curve({f"{key}.{field}": agreed[j::3] for j, field in enumerate(("work", "fwd", "bwd"))}, key)
    (drift,) = remeasure_drift(hw, iters=iters, families=(proxy,), dtype=dtype)
    scaled = ComputeCurve(curve.work, tuple(t / drift.ratio for t in curve.fwd), tuple(t / drift.ratio for t in curve.bwd))
    note = (f" The {dtype} {family} curve was added on {time.strftime('%Y-%m-%d')} (measured then, times divided "
            f"by {drift.ratio:.3f}, the {proxy} curve's drift since the profile).")
    return replace(hw, compute={**hw.compute, dtype: {**hw.compute.get(dtype, {}), family: scaled}},
                   description=hw.description + note)


DRIFT_PROXY: Mapping[str, str] = {
    "matmul_unaligned": "matmul", **{f"matmul_rows{r}": "matmul" for r in FEW_ROWS}, "sync_batch_norm": "batch_norm",
    "attention_narrow": "attention",
    **{name: "pointwise" for name in ("transcendental", *ELEMENTWISE_FUNCTIONS, "max_pool", "avg_pool", "loss",
                                      "copy_blocks", "view")}}
"""The timed family whose drift a family :func:`remeasure_drift` does not time is taken to share: the
same kernel on other shapes, or (memory-bound ops) the pointwise pass."""


def drift_scaled(hw: HardwareProfile, points: Sequence[DriftPoint], dtype: str = "float32") -> HardwareProfile:
    """``hw`` with its ``dtype`` compute curves scaled to the machine as ``points`` found it: each
    family's forward and backward times multiplied by the geometric mean of its points' ratios (of its
    :data:`DRIFT_PROXY` family's where it was not timed), the optimizer step by the pointwise ratio (a
    memory-bound pass over the parameters). Curves of families with no ratio, other dtypes, and the
    links are left as measured (the drift probe times no collective).

    What a profile measured right now would predict, at the cost of a few ops: a benchmark that compares
    modeled with measured steps on a machine that drifts reports its errors under both profiles."""
    by_family: dict[str, list[float]] = {}
    for p in points:
        by_family.setdefault(p.family, []).append(p.ratio)
    ratio = {f: math.exp(statistics.fmean(math.log(r) for r in rs)) for f, rs in by_family.items()}

    def ratio_of(family: str) -> float | None:
        return ratio.get(family, ratio.get(DRIFT_PROXY.get(family, family)))

    curves = dict(hw.compute.get(dtype, {}))
    for family, curve in curves.items():
        r = ratio_of(family)
        if r is not None:
            curves[family] = ComputeCurve(curve.work, tuple(r * t for t in curve.fwd), tuple(r * t for t in curve.bwd))
    optimizer, r = hw.optimizer, ratio_of("pointwise")
    if optimizer is not None and r is not None:
        optimizer = OptimizerModel(r * optimizer.per_tensor, r * optimizer.per_byte)
    return replace(hw, compute={**hw.compute, dtype: curves}, optimizer=optimizer)
