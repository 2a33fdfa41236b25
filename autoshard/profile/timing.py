"""Timing on all ranks at once: the process group (from torchrun's environment), barriers, the
maximum over ranks, and :func:`_median_time`, the one helper every measurement is timed with.
"""
from __future__ import annotations

import datetime
import math
import os
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["ProfileError"]

_INIT_TIMEOUT = datetime.timedelta(minutes=5)  # a dead rank fails the run instead of hanging it


class ProfileError(RuntimeError):
    """The measurement cannot run (not under torchrun, mesh/world mismatch) or gave unusable data."""


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


def _mean_over_ranks(value: float, device: torch.device, group: "dist.ProcessGroup | None" = None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)


# -- timing -------------------------------------------------------------------------------------------
def _median_time(fn: Callable[[], object], device: torch.device, iters: int, warmup: int,
                 group: "dist.ProcessGroup | None" = None, *, budget_s: float | None = None,
                 run_s: float = 0.0, cpu_shared: bool = False) -> float:
    """Median seconds of one call of ``fn`` over ``iters`` runs, each started right after a barrier on
    ``group``.

    With ``run_s``, a run calls ``fn`` back to back for at least that long: ranks that share CPU cores
    take turns in scheduler time slices of milliseconds, and a shorter run would be timed while the
    others wait (as if alone). With ``budget_s``, fewer runs (at least 3) are made where ``iters``
    would take longer than that. Both counts come from the slowest rank's fastest warm-up call, so
    that every rank makes the same number of calls (the barriers are collective).

    With ``cpu_shared`` (compute on CPU ranks), a run counts as at least the ranks' mean process CPU
    time x local ranks / cores: when ranks outnumber cores a training step is bound by the CPU all
    ranks need (a step's wall time is about the sum of the ranks' CPU time over the cores), while
    ranks timed side by side drift out of phase and the last ones run alone, faster than in a step.
    The mean, not each rank's own: ranks sharing cores spend unequal CPU on the same op (one rank's
    6.8 ms where another's is 10.0), and each rank's own time, whose maximum over ranks the profile
    keeps, put the curves a median 9% (1-26%) above what the ranks needed together (4 gloo ranks on
    2 cores, matmul, pointwise and layer norm).
    """
    shared = _ranks_over_cores() if cpu_shared and device.type == "cpu" else 0.0
    fastest = _fastest_call(fn, device, warmup)
    calls = 1
    if (budget_s is not None or run_s > 0) and warmup:
        slowest = _max_over_ranks([fastest], device, group)[0]
        calls = max(1, math.ceil(run_s / slowest))
        if budget_s is not None:
            iters = min(iters, max(3, int(budget_s / (calls * slowest))))
    times = []
    for _ in range(iters):
        wall, cpu = _timed_run(fn, calls, device, group)
        if shared:
            cpu = _mean_over_ranks(cpu, device, group)
        times.append(max(wall, cpu * shared) / calls)
    return statistics.median(times)


def _fastest_call(fn: Callable[[], object], device: torch.device, warmup: int) -> float:
    """The fastest of ``warmup`` untimed calls of ``fn`` on this rank (inf for none)."""
    fastest = math.inf
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        fastest = min(fastest, time.perf_counter() - t0)
    return fastest


def _timed_run(fn: Callable[[], object], calls: int, device: torch.device,
               group: "dist.ProcessGroup | None") -> tuple[float, float]:
    """Wall and process CPU seconds of ``calls`` back-to-back calls of ``fn``, started after a barrier."""
    _barrier(group, device)
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def _interleaved_times(fns: Sequence[Callable[[], object]], device: torch.device, iters: int, warmup: int,
                       group: "dist.ProcessGroup | None" = None, *, run_s: float = 0.0) -> list[list[float]]:
    """Seconds of one call of each of ``fns``, timed in turn: each of ``iters`` rounds runs every
    function once (a run after a barrier on ``group``, calling it back to back for at least
    ``run_s``, the count from the slowest rank's fastest warm-up call), so that ``times[r][i]`` and
    ``times[r][j]`` saw the same machine. A difference of two functions is then taken per round: a
    load that comes and goes while they are timed (another process on a shared machine) reaches both,
    where timing one function's runs and then the other's put it in one of them only."""
    fastest = [_fastest_call(fn, device, max(warmup, 1)) for fn in fns]
    calls = [max(1, math.ceil(run_s / slowest)) for slowest in _max_over_ranks(fastest, device, group)]
    return [[_timed_run(fn, n, device, group)[0] / n for fn, n in zip(fns, calls)] for _ in range(iters)]


def _ranks_over_cores() -> float:
    """Local ranks (torchrun's ``LOCAL_WORLD_SIZE``) per core available to this process: the CPU
    time all ranks need, over the cores, is at least ``process CPU time x this`` of wall time."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1)) / cores


def _dtypes(device: torch.device) -> dict[str, torch.dtype]:
    return {"float32": torch.float32, **({"bfloat16": torch.bfloat16} if device.type == "cuda" else {})}
