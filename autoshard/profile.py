"""Measure a hardware profile of the running cluster (``autoshard profile``), under torchrun.

Every rank runs :func:`measure_profile`. For each mesh axis with more than one device it times
all-reduce at several message sizes (each timing barrier-synchronised over the axis group; median
over iterations; then the maximum over all ranks) and fits the ring model of :mod:`autoshard.comm`,
``t(B) = 2(n-1) * alpha + 2(n-1)/n * B * beta``, by least squares on relative error (so the
small messages that pin down alpha weigh as much as the large ones that pin down beta). All groups
of an axis run at once, as they do in training. Locally it times a float32 matmul (FLOP/s), a large
copy (memory bandwidth, read + write bytes) and, on CUDA, pinned host<->device copies; every rank
measures at the same time and the slowest rank's rate is kept. Rank 0 writes the YAML.

    torchrun --nproc_per_node=4 -m autoshard.profile --mesh 2x2 --name cpu-gloo --out cpu-gloo.yaml
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .hardware import HardwareProfile, LinkModel, load_hardware
from .mesh import MeshError, MeshSpec
from .units import format_bytes, parse_bytes

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


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], n: int) -> LinkModel:
    """Alpha-beta link from all-reduce timings on an axis of ``n`` devices (ring model of comm.py)."""
    if n < 2:
        raise ProfileError(f"an axis of {n} device(s) has no communication to fit")
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ProfileError("need timings at two or more distinct message sizes to fit alpha and beta")
    if min(seconds) <= 0:
        raise ProfileError(f"non-positive timing in {list(seconds)}")
    c0, c1 = _fit_affine(nbytes, seconds)
    if c1 <= 0:
        raise ProfileError(f"all-reduce time does not grow with message size ({list(seconds)} s for "
                           f"{list(nbytes)} B); measure larger messages (--sizes) or more --iters")
    return LinkModel(alpha=c0 / (2 * (n - 1)), beta=c1 / (2 * (n - 1) / n))


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


# -- timing -------------------------------------------------------------------------------------------
def _median_time(fn: Callable[[], object], device: torch.device, iters: int, warmup: int,
                 group: "dist.ProcessGroup | None" = None) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, each started right after a barrier on ``group``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        _barrier(group, device)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_all_reduce(group: "dist.ProcessGroup", sizes: Sequence[int], device: torch.device,
                     iters: int, warmup: int) -> list[float]:
    out = []
    for size in sizes:
        buf = torch.ones(size // 4, dtype=torch.float32, device=device)
        out.append(_median_time(lambda: dist.all_reduce(buf, group=group), device, iters, warmup, group))
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
    dtypes = {"float32": torch.float32, **({"bfloat16": torch.bfloat16} if cuda else {})}
    _barrier(None, device)  # all ranks measure together, as they compute together in training
    matmul = {name: _matmul_seconds(dt, n, device, iters, warmup) for name, dt in dtypes.items()}
    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    copy = _copy_seconds(src, torch.empty_like(src), device, iters, warmup)
    host = None
    if cuda:
        pinned = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
        host = max(_copy_seconds(pinned, src, device, iters, warmup),
                   _copy_seconds(src, pinned, device, iters, warmup))
    return _Local(n, matmul, copy, host)


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# -- the profile ----------------------------------------------------------------------------------------
def _physical_memory_per_rank() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def measure_profile(mesh_shape: "MeshSpec | Sequence[int] | str", *, name: str = "measured",
                    sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 30, warmup: int = 5,
                    base: HardwareProfile | None = None) -> HardwareProfile:
    """Measure this cluster as a HardwareProfile; collective, so call it on every rank.

    ``base`` supplies what is not measured: the link of a size-1 axis (without ``base`` it copies
    the other axis) and FLOP/s of dtypes other than those timed.
    """
    mesh = MeshSpec.of(mesh_shape)
    if len(sizes) < 2 or min(sizes) < 4:
        raise ProfileError(f"need two or more message sizes of at least 4 bytes, got {list(sizes)}")
    created = _ensure_initialised()
    try:
        if dist.get_world_size() != mesh.size:
            raise MeshError(f"mesh {mesh} needs {mesh.size} ranks but torchrun started {dist.get_world_size()}; "
                            f"pass --nproc_per_node={mesh.size} or another --mesh")
        return _measure(mesh, name, sorted(int(s) for s in sizes), iters, warmup, base)
    finally:
        if created:
            dist.destroy_process_group()


def _measure(mesh: MeshSpec, name: str, sizes: list[int], iters: int, warmup: int,
             base: HardwareProfile | None) -> HardwareProfile:
    from torch.distributed.device_mesh import init_device_mesh

    device = _device()
    dmesh = init_device_mesh(device.type, mesh.shape, mesh_dim_names=("a0", "a1"))
    measured_axes = [a for a in range(2) if mesh.shape[a] > 1]
    raw = []
    for a in measured_axes:
        raw += _time_all_reduce(dmesh.get_group(a), sizes, device, iters, warmup)
    local = _measure_local(device, iters, warmup)
    local_values = list(local.matmul_s.values()) + [local.copy_s] + (
        [local.host_copy_s] if local.host_copy_s is not None else [])
    agreed = _max_over_ranks(raw + local_values, device)
    nbytes = [4 * (s // 4) for s in sizes]
    ar_times = {a: agreed[i * len(sizes):(i + 1) * len(sizes)] for i, a in enumerate(measured_axes)}
    links = {a: fit_alpha_beta(nbytes, ar_times[a], mesh.shape[a]) for a in measured_axes}
    rest = agreed[len(raw):]
    flops = {k: 2 * local.matmul_n**3 / t for k, t in zip(local.matmul_s, rest)}
    copy_s = rest[len(flops)]
    mem_bw = 2 * _COPY_BYTES / copy_s
    host_bw = _COPY_BYTES / rest[len(flops) + 1] if local.host_copy_s is not None else mem_bw
    return HardwareProfile(
        name=name,
        axes=_complete_axes(links, base),
        peak_flops={**(dict(base.peak_flops) if base else {}), **flops},
        memory_bandwidth=mem_bw,
        memory_per_device=(torch.cuda.get_device_properties(device).total_memory
                           if device.type == "cuda" else _physical_memory_per_rank()),
        host_device_bandwidth=host_bw,
        device_memory_separate=device.type == "cuda",     # CPU ranks: "device" memory is host memory
        description=_describe(mesh, device, sizes, iters, local.matmul_n, links, base),
        extra={"measured": {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
                            "cpu_count": os.cpu_count(), "torch": str(torch.__version__),
                            "all_reduce_bytes": nbytes,
                            **{f"all_reduce_seconds_axis{a}": ar_times[a] for a in measured_axes}}},
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
              links: dict[int, LinkModel], base: HardwareProfile | None) -> str:
    world, cores = dist.get_world_size(), os.cpu_count()
    unmeasured = [a for a in range(2) if a not in links]
    lines = [
        f"Measured by `autoshard profile` on {platform.node()} at "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}: mesh {mesh}, backend {dist.get_backend()}, "
        f"{world} ranks on {cores} CPU cores, torch {torch.__version__}.",
        f"Axes: all-reduce of {format_bytes(sizes[0])} .. {format_bytes(sizes[-1])}, median of {iters} "
        f"barrier-synchronised runs, max over ranks, fitted to 2(n-1)*alpha + 2(n-1)/n*bytes*beta by "
        f"least squares on relative error.",
        f"FLOP/s from {matmul_n}^3 matmuls, memory bandwidth from a {format_bytes(_COPY_BYTES)} copy "
        f"(read + write), all ranks at once, slowest rank kept.",
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
    parser.add_argument("--iters", type=int, default=30, help="timed runs per measurement (median kept)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before each measurement")
    parser.add_argument("--base", help="profile (name or YAML) supplying what is not measured")


def run_profile(args: argparse.Namespace) -> int:
    """Run the measurement on every rank; rank 0 writes ``args.out`` and prints a summary."""
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    base = load_hardware(args.base) if args.base else None
    profile = measure_profile(args.mesh, name=args.name, sizes=sizes, iters=args.iters,
                              warmup=args.warmup, base=base)
    if int(os.environ.get("RANK", 0)) == 0:
        out = args.out or f"{args.name}.yaml"
        profile.save(out)
        print(_summary(profile, out))
    return 0


def _summary(p: HardwareProfile, out: str) -> str:
    lines = [f"wrote {out}"]
    for a, link in enumerate(p.axes):
        lines.append(f"  axis {a}: alpha {link.alpha * 1e6:.1f} us, bandwidth {1 / link.beta / 1e9:.2f} GB/s")
    lines += [f"  {k}: {v / 1e9:.1f} GFLOP/s" for k, v in p.peak_flops.items()]
    lines.append(f"  memory bandwidth {p.memory_bandwidth / 1e9:.1f} GB/s, "
                 f"memory per device {format_bytes(p.memory_per_device)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoshard profile", description=__doc__.split("\n")[0])
    add_profile_arguments(parser)
    return run_profile(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
