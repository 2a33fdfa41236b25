"""Measure a hardware profile of the running cluster (``autoshard profile``), under torchrun.

Every rank runs :func:`measure_profile`, and every measurement runs on all ranks at once, as ranks
compute and communicate together in training (ranks that share CPU cores or a host's memory
bandwidth slow each other down, and the profile must say so). One timing helper,
:func:`_median_time`, times everything: each timed run starts right after a barrier, the median over
runs is kept, and then the maximum over ranks (the slowest rank sets the pace of a step).

- **Links.** For each mesh axis with more than one device it times all-reduce at several message
  sizes (all groups of an axis at once, each between slices of compute as a step issues them, see
  :func:`_time_collective`) and fits the ring model of :mod:`autoshard.comm`,
  ``t(B) = 2(n-1) * alpha + 2(n-1)/n * B * beta``, by least squares on relative error (so the small
  messages that pin down alpha weigh as much as the large ones that pin down beta).
- **Roofline.** FLOP/s of a large square matmul, memory bandwidth of a large copy (read + write
  bytes) and, on CUDA, pinned host<->device copies: the fallback for ops without a measured curve.
- **Compute curves** (``compute`` in the profile, see :mod:`autoshard.hardware`), float32 and on CUDA
  also bfloat16: forward and backward seconds of one op against its forward work, for the families
  ``matmul`` (``F.linear`` with bias, transformer-like tokens x in -> out shapes, thin and square),
  ``conv`` (3x3 ``F.conv2d`` with bias, C -> C channels, from 4 channels on 16x16 to 64 on 64x64),
  ``attention`` (causal ``F.scaled_dot_product_attention``), ``pointwise`` (the median of add, mul,
  tanh-GELU and SiLU at equal bytes), ``norm`` (``F.layer_norm``) and ``loss`` (``F.cross_entropy``
  over tokens x vocabulary logits). Work is counted exactly as autoshard counts it: FLOPs from
  ``FlopCounterMode`` on meta tensors of the same shapes (as :mod:`autoshard.opinfo` profiles a
  node), or bytes of the op's tensor inputs and outputs. An op is timed in a chain of ``k``
  identical ops, each one's output the next one's input, as ops follow each other in a model: the
  forward of the chain and its backward (one ``autograd.grad`` for the gradients of every float
  input) divided by ``k``. Small ops get long chains, so that the per-op dispatch and autograd
  overheads are those of a step, not those of a lone call; large ops a chain of one.
- **Optimizer.** ``torch.optim.AdamW.step`` (torch's default implementation for the device) over
  parameter lists of several tensor counts and sizes, fitted to ``n * per_tensor + bytes * per_byte``
  (least squares on relative error, both coefficients >= 0).
- **Overlap.** How much of an async all-reduce over all ranks hides behind compute: a matmul loop
  alone (C), an all-reduce sized to take about as long alone (A), and the all-reduce launched with
  ``async_op=True`` while the loop runs (T); ``overlap = clamp((C + A - T) / min(C, A), 0, 1)``.

Rank 0 writes the YAML.

    torchrun --nproc_per_node=4 -m autoshard.profile --mesh 2x2 --name cpu-gloo --out cpu-gloo.yaml
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ..hardware import COMPUTE_FAMILIES, ComputeCurve, HardwareProfile, LinkModel, OptimizerModel, load_hardware
from ..mesh import MeshError, MeshSpec
from ..progress import Progress
from ..units import format_bytes, parse_bytes

DEFAULT_SIZES = tuple(4096 * 4**k for k in range(7))  # 4 KiB .. 16 MiB
_COPY_BYTES = 64 * 2**20
_INIT_TIMEOUT = datetime.timedelta(minutes=5)  # a dead rank fails the run instead of hanging it


class ProfileError(RuntimeError):
    """The measurement cannot run (not under torchrun, mesh/world mismatch) or gave unusable data."""


# -- fitting -------------------------------------------------------------------------------------------
def _fit_affine(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(c0, c1)`` minimising sum(((c0 + c1*x - y) / y)^2), with ``c0 >= 0``."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    swx = sum(wi * x for wi, x in zip(w, xs))
    swxx = sum(wi * x * x for wi, x in zip(w, xs))
    swy = sum(wi * y for wi, y in zip(w, ys))
    swxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * swxx - swx * swx
    c0 = (swy * swxx - swx * swxy) / det
    if c0 < 0:  # latency below the noise: fit the bandwidth term alone
        return 0.0, swxy / swxx
    return c0, (sw * swxy - swx * swy) / det


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], n: int, kind: str = "all_reduce",
                   fallback: LinkModel | None = None) -> LinkModel:
    """Alpha-beta link from timings of a ``kind`` collective on a group of ``n`` devices (ring model
    of comm.py: an all-reduce is two rings, the other kinds one). Where the time does not grow with
    the size (a backend that runs the collective as something else), ``fallback``'s beta is kept
    and alpha fitted to the times."""
    if n < 2:
        raise ProfileError(f"an axis of {n} device(s) has no communication to fit")
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ProfileError("need timings at two or more distinct message sizes to fit alpha and beta")
    if min(seconds) <= 0:
        raise ProfileError(f"non-positive timing in {list(seconds)}")
    rings = 2 if kind == "all_reduce" else 1
    c0, c1 = _fit_affine(nbytes, seconds)
    if c1 <= 0 and fallback is not None:
        c1 = fallback.beta * rings * (n - 1) / n
        c0 = statistics.median(t - c1 * b for b, t in zip(nbytes, seconds))
    if c1 <= 0:
        raise ProfileError(f"{kind} time does not grow with message size ({list(seconds)} s for "
                           f"{list(nbytes)} B); measure larger messages (--sizes) or more --iters")
    return LinkModel(alpha=max(c0, 0.0) / (rings * (n - 1)), beta=c1 / (rings * (n - 1) / n))


def fit_optimizer(n_tensors: Sequence[int], nbytes: Sequence[float], seconds: Sequence[float]) -> OptimizerModel:
    """``t = n * per_tensor + bytes * per_byte`` by least squares on relative error, both >= 0."""
    if not len(n_tensors) == len(nbytes) == len(seconds) or len(seconds) < 2 or min(seconds) <= 0:
        raise ProfileError(f"need two or more positive optimizer timings, got {list(seconds)}")
    w = [1.0 / (t * t) for t in seconds]
    a11 = sum(wi * n * n for wi, n in zip(w, n_tensors))
    a12 = sum(wi * n * b for wi, n, b in zip(w, n_tensors, nbytes))
    a22 = sum(wi * b * b for wi, b in zip(w, nbytes))
    r1 = sum(wi * n * t for wi, n, t in zip(w, n_tensors, seconds))
    r2 = sum(wi * b * t for wi, b, t in zip(w, nbytes, seconds))
    det = a11 * a22 - a12 * a12

    def error(pt: float, pb: float) -> float:
        return sum(wi * (pt * n + pb * b - t) ** 2 for wi, n, b, t in zip(w, n_tensors, nbytes, seconds))

    candidates = [(r1 / a11, 0.0), (0.0, r2 / a22)]       # one coefficient at its bound
    if det > 0:
        pt, pb = (r1 * a22 - r2 * a12) / det, (r2 * a11 - r1 * a12) / det
        if pt >= 0 and pb >= 0:
            candidates.append((pt, pb))
    return OptimizerModel(*min(candidates, key=lambda c: error(*c)))


# -- process group ---------------------------------------------------------------------------------------
def _ensure_initialised() -> bool:
    """Initialise torch.distributed from torchrun's environment; True if this call did it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ProfileError("autoshard profile must run under torchrun on every rank, e.g. "
                           "`torchrun --nproc_per_node=4 -m autoshard.profile --mesh 2x2`")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", timeout=_INIT_TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=_INIT_TIMEOUT)
    return True


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(group: "dist.ProcessGroup | None", device: torch.device) -> None:
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def _max_over_ranks(values: list[float], device: torch.device,
                    group: "dist.ProcessGroup | None" = None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


# -- timing -------------------------------------------------------------------------------------------
def _median_time(fn: Callable[[], object], device: torch.device, iters: int, warmup: int,
                 group: "dist.ProcessGroup | None" = None, *, budget_s: float | None = None,
                 run_s: float = 0.0) -> float:
    """Median seconds of one call of ``fn`` over ``iters`` runs, each started right after a barrier on
    ``group``.

    With ``run_s``, a run calls ``fn`` back to back for at least that long: ranks that share CPU cores
    take turns in scheduler time slices of milliseconds, and a shorter run would be timed while the
    others wait (as if alone). With ``budget_s``, fewer runs (at least 3) are made where ``iters``
    would take longer than that. Both counts come from the slowest rank's fastest warm-up call, so
    that every rank makes the same number of calls (the barriers are collective).
    """
    fastest = math.inf
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        fastest = min(fastest, time.perf_counter() - t0)
    calls = 1
    if (budget_s is not None or run_s > 0) and warmup:
        slowest = _max_over_ranks([fastest], device, group)[0]
        calls = max(1, math.ceil(run_s / slowest))
        if budget_s is not None:
            iters = min(iters, max(3, int(budget_s / (calls * slowest))))
    times = []
    for _ in range(iters):
        _barrier(group, device)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


_ISSUED_RUN_S = 0.05
"""Seconds per timed run of the loops of :func:`_time_collective`."""


MEASURED_KINDS = ("all_gather", "reduce_scatter")
"""Collective kinds timed besides the all-reduce, for their own links (a backend may run them quite
unlike a ring: gloo's reduce-scatter costs about an all-reduce whatever the size)."""


def _collective(kind: str, nbytes: int, group: "dist.ProcessGroup", device: torch.device) -> Callable[[], None]:
    """One ``kind`` collective of ``nbytes`` per device (the byte convention of :mod:`autoshard.comm`:
    the gathered output, the scattered input, the reduced buffer) on ``group``."""
    n = dist.get_world_size(group)
    whole = torch.ones(max(n, nbytes // 4 // n * n), dtype=torch.float32, device=device)
    piece = torch.ones(whole.numel() // n, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group)
    if kind == "all_gather":
        return lambda: dist.all_gather_single(whole, piece, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(piece, whole, group=group)
    raise ProfileError(f"no timing for collective kind {kind!r}")


def _time_collective(kind: str, group: "dist.ProcessGroup", sizes: Sequence[int], device: torch.device,
                     iters: int, warmup: int) -> list[float]:
    """Seconds a ``kind`` collective adds to a step, issued as a step issues its collectives: a loop
    of a slice of compute and one collective, less the same loop without it. Every rank computes
    between collectives, so each collective pays for waking the ranks that wait in it while the
    others compute: where ranks share CPU cores that costs milliseconds that a lone
    barrier-synchronised all-reduce does not show (gloo, 4 ranks on 2 cores: 2-7 ms against ~0.5 ms)."""
    n = 1024 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device)

    def compute() -> None:
        for _ in range(4):
            torch.mm(a, a)

    alone = _median_time(compute, device, iters, max(warmup, 1), group, run_s=_ISSUED_RUN_S)
    out = []
    for size in sizes:
        collective = _collective(kind, size, group, device)

        def step() -> None:
            compute()
            collective()

        with_comm = _median_time(step, device, iters, max(warmup, 1), group, run_s=_ISSUED_RUN_S)
        out.append(max(with_comm - alone, 0.05 * with_comm))      # noise must not make it vanish
    return out


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


def _dtypes(device: torch.device) -> dict[str, torch.dtype]:
    return {"float32": torch.float32, **({"bfloat16": torch.bfloat16} if device.type == "cuda" else {})}


# -- compute curves -------------------------------------------------------------------------------------
# Sizes per family, smallest first; CUDA adds larger ones (a GPU reaches its rate much later).
# matmul: tokens, in, out: thin (fewer tokens than features), square and MLP-wide, 1.3e5 .. 9.7e9 FLOPs
MATMUL_SHAPES = ((16, 64, 64), (32, 128, 128), (64, 256, 256), (64, 512, 512), (512, 512, 512),
                 (1024, 768, 768), (512, 768, 3072), (2048, 768, 3072))
CONV_SHAPES = ((1, 4, 16, 16), (2, 8, 32, 32), (2, 16, 64, 64), (4, 32, 64, 64), (8, 64, 64, 64))  # N, C, H, W
ATTENTION_SHAPES = ((1, 2, 32, 32), (1, 4, 64, 32), (2, 4, 128, 64), (2, 12, 256, 64), (2, 12, 512, 64),
                    (2, 12, 1024, 64))                                              # batch, heads, seq, head dim
POINTWISE_UNITS = (128, 1024, 8192, 65536, 524288, 4194304)   # unary ops get 3x, binary 2x this many elements
NORM_SHAPES = ((4, 64), (16, 256), (64, 768), (1024, 768), (4096, 1024), (16384, 1024))  # tokens, hidden
LOSS_SHAPES = ((4, 64), (16, 512), (64, 2048), (256, 8192), (1024, 32768))               # tokens, vocabulary
CUDA_SIZES = {"matmul": ((4096, 4096, 4096), (8192, 8192, 8192)), "conv": ((32, 256, 56, 56),), "attention": ((8, 16, 2048, 128),),
              "pointwise": (33554432,), "norm": ((65536, 4096),), "loss": ((8192, 131072),)}
OPTIMIZER_PARAMS = ((1, 2**10), (16, 2**10), (128, 2**10), (2, 2**20), (8, 2**20), (8, 2**21))  # tensors, numel
_CHAIN_WORK = {"FLOPs": 2e8, "bytes": 1.6e7}   # a chain of small ops has at least this much work ...
_MAX_CHAIN = 64                                 # ... or this many ops
_COMPUTE_TIMING = {"budget_s": 1.0,            # seconds per timing, about, at most (at least 3 runs)
                   "run_s": 0.03}               # seconds per timed run, at least (see _median_time)


@dataclass(frozen=True)
class _Op:
    """One op to time: ``fn(x, *params(i))`` is instance ``i``; its output is the next one's ``x``."""

    fn: Callable[..., torch.Tensor]
    x: torch.Tensor
    params: Callable[[int], tuple]
    chain: bool = True        # False: the output cannot feed the next instance (a scalar loss)


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


def _binary(fn):
    def build(units, dtype, device) -> _Op:       # the other operand near 1: a chain of muls stays normal
        return _Op(fn, _leaf((2 * units,), dtype, device), lambda i: (_leaf((2 * units,), dtype, device, 0.1, 1.0),))
    return build


def _layer_norm(shape, dtype, device) -> _Op:
    def norm(x, w, b):
        return F.layer_norm(x, x.shape[-1:], w, b)

    h = shape[-1]
    return _Op(norm, _leaf(shape, dtype, device), lambda i: (_leaf((h,), dtype, device, 0.1, 1.0),
                                                            _leaf((h,), dtype, device, 0.1)))


def _cross_entropy(shape, dtype, device) -> _Op:
    tokens, vocab = shape
    target = torch.randint(0, vocab, (tokens,), device=device)
    return _Op(F.cross_entropy, _leaf(shape, dtype, device), lambda i: (target,), chain=False)


# family -> (sizes, the ops whose median is the family's time at a size)
COMPUTE_OPS: dict[str, tuple[tuple, tuple[Callable[..., _Op], ...]]] = {
    "matmul": (MATMUL_SHAPES, (_linear,)),
    "conv": (CONV_SHAPES, (_conv2d,)),
    "attention": (ATTENTION_SHAPES, (_attention,)),
    "pointwise": (POINTWISE_UNITS, (_binary(torch.add), _binary(torch.mul),
                                    _unary(lambda x: F.gelu(x, approximate="tanh")), _unary(F.silu))),
    "norm": (NORM_SHAPES, (_layer_norm,)),
    "loss": (LOSS_SHAPES, (_cross_entropy,)),
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


def _time_op(family: str, op: _Op, device: torch.device, iters: int) -> tuple[float, float, float]:
    """(work, forward seconds, backward seconds) of one instance, timed in a chain."""
    work = op_work(family, op)
    k = min(_MAX_CHAIN, max(1, math.ceil(_CHAIN_WORK[COMPUTE_FAMILIES[family]] / max(work, 1.0)))) if op.chain else 1
    params = [op.params(i) for i in range(k)]
    leaves = [op.x] + [p for ps in params for p in ps if p.requires_grad]

    def forward() -> torch.Tensor:
        y = op.x
        for ps in params:
            y = op.fn(y, *ps)
        return y

    out = forward()
    grad = torch.ones_like(out)
    fwd = _median_time(forward, device, iters, 1, **_COMPUTE_TIMING)
    bwd = _median_time(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True),
                       device, iters, 1, **_COMPUTE_TIMING)
    return work, fwd / k, bwd / k


def _compute_sizes(family: str, device: torch.device, points: int | None) -> tuple:
    sizes = COMPUTE_OPS[family][0] + (CUDA_SIZES[family] if device.type == "cuda" else ())
    return sizes if points is None else sizes[:points]


def _measure_compute(device: torch.device, iters: int, points: int | None,
                     progress: Progress | None = None) -> dict[str, list[float]]:
    """This rank's compute timings: ``'<dtype>.<family>.<work|fwd|bwd>'`` -> one value per size."""
    out: dict[str, list[float]] = {}
    progress = progress or Progress(False)
    for dname, dtype in _dtypes(device).items():
        for family, (_, builders) in COMPUTE_OPS.items():
            sizes = _compute_sizes(family, device, points)
            with progress.stage(f"timing {dname} {family} compute ({len(sizes)} sizes)"):
                rows = _time_family(family, builders, sizes, dtype, device, iters)
            for j, field in enumerate(("work", "fwd", "bwd")):
                out[f"{dname}.{family}.{field}"] = [r[j] for r in rows]
    return out


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


def _measure_optimizer(device: torch.device, iters: int) -> dict[str, list[float]]:
    """AdamW step seconds over each parameter list of :data:`OPTIMIZER_PARAMS` (float32)."""
    seconds = []
    for n, numel in OPTIMIZER_PARAMS:
        params = [torch.zeros(numel, device=device, requires_grad=True) for _ in range(n)]
        for p in params:
            p.grad = torch.randn(numel, device=device) * 1e-3
        opt = torch.optim.AdamW(params)
        opt.step()                                    # creates the state: not part of a step's time
        _barrier(None, device)
        seconds.append(_median_time(opt.step, device, iters, 1, **_COMPUTE_TIMING))
    return {"optimizer.n_tensors": [float(n) for n, _ in OPTIMIZER_PARAMS],
            "optimizer.bytes": [float(4 * n * numel) for n, numel in OPTIMIZER_PARAMS],
            "optimizer.seconds": seconds}


def _measure_overlap(device: torch.device, iters: int) -> dict[str, list[float]]:
    """Seconds of a matmul loop alone (C), an all-reduce over all ranks of about as long alone (A), and
    the all-reduce launched asynchronously while the loop runs (T)."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device)
    one = _max_over_ranks([_median_time(lambda: torch.mm(a, a), device, iters, 2)], device)[0]
    reps = max(1, math.ceil(0.05 / one))                # a loop of about 50 ms

    def compute() -> None:
        for _ in range(reps):
            torch.mm(a, a)

    c = _median_time(compute, device, iters, 1)
    probe = torch.ones(2**20, device=device)            # 4 MiB: scale the message to A ~ C
    a_probe = _max_over_ranks([_median_time(lambda: dist.all_reduce(probe), device, iters, 1)], device)[0]
    c_all = _max_over_ranks([c], device)[0]
    numel = int(min(2**26, max(2**14, probe.numel() * c_all / a_probe)))
    buf = torch.ones(numel, device=device)
    a_alone = _median_time(lambda: dist.all_reduce(buf), device, iters, 1)

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t = _median_time(both, device, iters, 1)
    return {"overlap.seconds": [c, a_alone, t], "overlap.bytes": [4.0 * numel] * 3}


def overlap_fraction(compute_s: float, comm_s: float, both_s: float) -> float:
    """The share of the shorter of compute and communication hidden when both run at once, in [0, 1]."""
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / min(compute_s, comm_s)))


# -- the profile ----------------------------------------------------------------------------------------
def _physical_memory_per_rank() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def measure_profile(mesh_shape: "MeshSpec | Sequence[int] | str", *, name: str = "measured",
                    sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 30, warmup: int = 5,
                    base: HardwareProfile | None = None, compute_iters: int = 10,
                    compute_points: int | None = None, progress: bool = False) -> HardwareProfile:
    """Measure this cluster as a HardwareProfile; collective, so call it on every rank.

    ``base`` supplies what is not measured: the link of a size-1 axis (without ``base`` it copies
    the other axis) and FLOP/s of dtypes other than those timed. ``compute_iters`` bounds the timed
    runs of each compute, optimizer and overlap measurement (fewer where they would exceed about a
    second, at least 3); ``compute_points`` keeps only the that many smallest sizes of each compute
    family (a quick measurement; None: all). ``progress``: report each stage on stderr (rank 0 only).
    """
    mesh = MeshSpec.of(mesh_shape)
    if len(sizes) < 2 or min(sizes) < 4:
        raise ProfileError(f"need two or more message sizes of at least 4 bytes, got {list(sizes)}")
    if compute_iters < 1 or (compute_points is not None and compute_points < 1):
        raise ProfileError(f"compute_iters and compute_points must be at least 1, got {compute_iters} "
                           f"and {compute_points}")
    created = _ensure_initialised()
    try:
        if dist.get_world_size() != mesh.size:
            raise MeshError(f"mesh {mesh} needs {mesh.size} ranks but torchrun started {dist.get_world_size()}; "
                            f"pass --nproc_per_node={mesh.size} or another --mesh")
        return _measure(mesh, name, sorted(int(s) for s in sizes), iters, warmup, base,
                        compute_iters, compute_points, Progress(progress and dist.get_rank() == 0))
    finally:
        if created:
            dist.destroy_process_group()


def _agree(local: dict[str, list[float]], device: torch.device) -> dict[str, list[float]]:
    """Every value replaced by its maximum over ranks (every rank has the same keys, in order)."""
    flat = _max_over_ranks([v for values in local.values() for v in values], device)
    out, i = {}, 0
    for key, values in local.items():
        out[key] = flat[i:i + len(values)]
        i += len(values)
    return out


def _measure(mesh: MeshSpec, name: str, sizes: list[int], iters: int, warmup: int,
             base: HardwareProfile | None, compute_iters: int, compute_points: int | None,
             progress: Progress) -> HardwareProfile:
    from torch.distributed.device_mesh import init_device_mesh

    device = _device()
    dmesh = init_device_mesh(device.type, mesh.shape, mesh_dim_names=("a0", "a1"))
    measured_axes = [a for a in range(2) if mesh.shape[a] > 1]
    local: dict[str, list[float]] = {}
    both_axes = len(measured_axes) == 2          # collectives over both axes run on the world group
    groups = {str(a): dmesh.get_group(a) for a in measured_axes} | ({"world": dist.group.WORLD} if both_axes else {})
    for kind in ("all_reduce", *MEASURED_KINDS):
        for key, group in groups.items():
            where = "all devices" if key == "world" else f"mesh axis {key}"
            with progress.stage(f"timing {kind} on {where} ({len(sizes)} sizes x {iters} runs)"):
                local[f"{kind}.{key}"] = _time_collective(kind, group, sizes, device, iters, warmup)
    with progress.stage("timing matmul peak and memory copies"):
        roof = _measure_local(device, iters, warmup)
    local["matmul"] = list(roof.matmul_s.values())
    local["copy"] = [roof.copy_s] + ([roof.host_copy_s] if roof.host_copy_s is not None else [])
    local.update(_measure_compute(device, compute_iters, compute_points, progress))
    with progress.stage("timing the optimizer step (AdamW)"):
        local.update(_measure_optimizer(device, compute_iters))
    with progress.stage("timing all-reduce overlap with compute"):
        local.update(_measure_overlap(device, compute_iters))
    agreed = _agree(local, device)

    nbytes = [4 * (s // 4) for s in sizes]
    ar_times = {a: agreed[f"all_reduce.{a}"] for a in measured_axes}
    links = {a: fit_alpha_beta(nbytes, ar_times[a], mesh.shape[a]) for a in measured_axes}
    world = fit_alpha_beta(nbytes, agreed["all_reduce.world"], mesh.size) if both_axes else None
    all_reduce_links = {str(a): links[a] for a in measured_axes} | ({"world": world} if both_axes else {})
    kinds = {kind: {(key if key == "world" else f"axis{key}"): fit_alpha_beta(
                        nbytes, agreed[f"{kind}.{key}"], mesh.size if key == "world" else mesh.shape[int(key)],
                        kind=kind, fallback=all_reduce_links[key])
                    for key in groups} for kind in MEASURED_KINDS}
    flops = {k: 2 * roof.matmul_n**3 / t for k, t in zip(roof.matmul_s, agreed["matmul"])}
    mem_bw = 2 * _COPY_BYTES / agreed["copy"][0]
    host_bw = _COPY_BYTES / agreed["copy"][1] if roof.host_copy_s is not None else mem_bw
    compute = {dname: {family: _compute_curve(agreed, f"{dname}.{family}") for family in COMPUTE_OPS}
               for dname in _dtypes(device)}
    optimizer = fit_optimizer(agreed["optimizer.n_tensors"], agreed["optimizer.bytes"], agreed["optimizer.seconds"])
    overlap = overlap_fraction(*agreed["overlap.seconds"])
    return HardwareProfile(
        name=name,
        axes=_complete_axes(links, base),
        peak_flops={**(dict(base.peak_flops) if base else {}), **flops},
        memory_bandwidth=mem_bw,
        memory_per_device=(torch.cuda.get_device_properties(device).total_memory
                           if device.type == "cuda" else _physical_memory_per_rank()),
        host_device_bandwidth=host_bw,
        device_memory_separate=device.type == "cuda",     # CPU ranks: "device" memory is host memory
        description=_describe(mesh, device, sizes, iters, roof.matmul_n, links, base, compute_iters),
        compute=compute,
        optimizer=optimizer,
        overlap=overlap,
        world=world,
        kinds=kinds,
        extra={"measured": {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
                            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": str(torch.__version__),
                            "all_reduce_bytes": nbytes,
                            **{f"all_reduce_seconds_axis{a}": ar_times[a] for a in measured_axes},
                            **({"all_reduce_seconds_world": agreed["all_reduce.world"]} if both_axes else {}),
                            **{f"{kind}_seconds_{key if key == 'world' else 'axis' + key}": agreed[f"{kind}.{key}"]
                               for kind in MEASURED_KINDS for key in groups},
                            "compute_sizes": {f: [list(s) if isinstance(s, tuple) else s
                                                  for s in _compute_sizes(f, device, compute_points)]
                                              for f in COMPUTE_OPS},
                            "optimizer_params": [list(p) for p in OPTIMIZER_PARAMS],
                            "optimizer_seconds": agreed["optimizer.seconds"],
                            "overlap_bytes": agreed["overlap.bytes"][0],
                            "overlap_seconds": dict(zip(("compute", "all_reduce", "both"),
                                                        agreed["overlap.seconds"]))}},
    )


def _complete_axes(links: dict[int, LinkModel], base: HardwareProfile | None) -> tuple[LinkModel, LinkModel]:
    """Both axes: measured ones, else ``base``'s, else a copy of the other measured axis."""
    if not links and base is None:
        raise ProfileError("a 1x1 mesh has no communication to measure; use a mesh with 2+ ranks or pass a base")
    out = []
    for a in range(2):
        if a in links:
            out.append(links[a])
        elif base is not None:
            out.append(base.axes[a])
        else:
            out.append(next(iter(links.values())))
    return out[0], out[1]


def _describe(mesh: MeshSpec, device: torch.device, sizes: list[int], iters: int, matmul_n: int,
              links: dict[int, LinkModel], base: HardwareProfile | None, compute_iters: int) -> str:
    world, cores = dist.get_world_size(), os.cpu_count()
    unmeasured = [a for a in range(2) if a not in links]
    lines = [
        f"Measured by `autoshard profile` on {platform.node()} at "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}: mesh {mesh}, backend {dist.get_backend()}, "
        f"{world} ranks on {cores} CPU cores ({torch.get_num_threads()} torch threads per rank), "
        f"torch {torch.__version__}.",
        f"Axes: all-reduce of {format_bytes(sizes[0])} .. {format_bytes(sizes[-1])}, median of {iters} "
        f"runs of {_ISSUED_RUN_S * 1e3:.0f} ms of (compute slice, all-reduce) less the compute alone (as a "
        f"step issues them), max over ranks, fitted to 2(n-1)*alpha + 2(n-1)/n*bytes*beta by "
        f"least squares on relative error. All-gather and reduce-scatter (kinds) timed the same way on "
        f"each axis and the all-device group, fitted to one ring, (n-1)*alpha + (n-1)/n*bytes*beta (where "
        f"the time does not grow with size, the all-reduce's beta and alpha to the times).",
        f"Roofline fallback: FLOP/s from {matmul_n}^3 matmuls, memory bandwidth from a "
        f"{format_bytes(_COPY_BYTES)} copy (read + write), all ranks at once, slowest rank kept.",
        f"Compute curves ({', '.join(_dtypes(device))}): forward and backward seconds per op of F.linear "
        f"(matmul), 3x3 F.conv2d (conv), causal F.scaled_dot_product_attention (attention), the median of add, mul, tanh-GELU "
        f"and SiLU (pointwise), F.layer_norm (norm) and F.cross_entropy (loss) against forward FLOPs "
        f"(FlopCounterMode) or bytes in + out; each op timed in a chain of up to {_MAX_CHAIN} identical "
        f"ops (per-op time = chain time / length), median of up to {compute_iters} barrier-synchronised "
        f"runs, all ranks at once, max over ranks; sizes in extra.measured.compute_sizes.",
        "Optimizer: torch.optim.AdamW step (default implementation) over the parameter lists in "
        "extra.measured.optimizer_params (tensors, elements; float32), fitted to n*per_tensor + "
        "bytes*per_byte. Overlap: (C + A - T) / min(C, A) for a matmul loop (C), an all-reduce over all "
        "ranks of about the same time (A) and both at once with async_op=True (T).",
    ]
    if unmeasured:
        src = f"profile {base.name!r}" if base else "the measured axis"
        lines.append(f"Axis {unmeasured[0]} has size 1 here and was copied from {src}.")
    if device.type == "cpu":
        lines.append("CPU devices: host_device_bandwidth is set equal to memory_bandwidth (no separate "
                     "device memory); memory_per_device is physical RAM divided by the local ranks.")
    return " ".join(lines)


# -- command line ---------------------------------------------------------------------------------------
def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``autoshard profile``."""
    parser.add_argument("--mesh", required=True, help="mesh shape, e.g. 2x4; its size must equal the world size")
    parser.add_argument("--name", default="measured", help="profile name (default: measured)")
    parser.add_argument("--out", help="YAML file to write (default: <name>.yaml)")
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                        help="comma-separated all-reduce message sizes, e.g. 4KiB,1MiB,16MiB")
    parser.add_argument("--iters", type=int, default=30, help="timed runs per collective measurement (median kept)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before each collective measurement")
    parser.add_argument("--compute-iters", type=int, default=10,
                        help="timed runs per compute/optimizer/overlap measurement, at most (median kept)")
    parser.add_argument("--compute-points", type=int, default=None,
                        help="measure only the N smallest sizes of each compute family (quick; default: all)")
    parser.add_argument("--base", help="profile (name or YAML) supplying what is not measured")


def run_profile(args: argparse.Namespace) -> int:
    """Run the measurement on every rank; rank 0 writes ``args.out`` and prints a summary."""
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    base = load_hardware(args.base) if args.base else None
    start = time.perf_counter()
    profile = measure_profile(args.mesh, name=args.name, sizes=sizes, iters=args.iters,
                              warmup=args.warmup, base=base, compute_iters=args.compute_iters,
                              compute_points=args.compute_points, progress=True)
    if int(os.environ.get("RANK", 0)) == 0:
        out = args.out or f"{args.name}.yaml"
        profile.save(out)
        print(_summary(profile, out, time.perf_counter() - start))
    return 0


def _summary(p: HardwareProfile, out: str, seconds: float) -> str:
    lines = [f"wrote {out} (measured in {seconds:.0f} s)"]
    for a, link in enumerate(p.axes):
        lines.append(f"  axis {a}: alpha {link.alpha * 1e6:.1f} us, bandwidth {1 / link.beta / 1e9:.2f} GB/s")
    if p.world is not None:
        lines.append(f"  all devices (both axes): alpha {p.world.alpha * 1e6:.1f} us, "
                     f"bandwidth {1 / p.world.beta / 1e9:.2f} GB/s")
    lines += [f"  {k}: {v / 1e9:.1f} GFLOP/s (roofline fallback)" for k, v in p.peak_flops.items()]
    lines.append(f"  memory bandwidth {p.memory_bandwidth / 1e9:.1f} GB/s, "
                 f"memory per device {format_bytes(p.memory_per_device)}")
    for dtype, families in p.compute.items():
        for family, c in families.items():
            unit = COMPUTE_FAMILIES[family]
            rate = "GFLOP/s" if unit == "FLOPs" else "GB/s"
            lines.append(f"  {dtype} {family}: floor fwd {c.fwd[0] * 1e6:.1f} us / bwd {c.bwd[0] * 1e6:.1f} us "
                         f"at {c.work[0]:.3g} {unit}; largest {c.work[-1]:.3g} {unit}: fwd "
                         f"{c.work[-1] / c.fwd[-1] / 1e9:.2f} {rate}, bwd {c.work[-1] / c.bwd[-1] / 1e9:.2f} "
                         f"{rate} (of forward work)")
    if p.optimizer is not None:
        lines.append(f"  optimizer (AdamW): {p.optimizer.per_tensor * 1e6:.1f} us per tensor + "
                     f"{p.optimizer.per_byte * 1e9:.3f} ns per byte")
    if p.overlap is not None:
        lines.append(f"  overlap of an async all-reduce with compute: {p.overlap:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoshard profile", description=__doc__.split("\n")[0])
    add_profile_arguments(parser)
    return run_profile(parser.parse_args(argv))

