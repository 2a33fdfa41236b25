"""Link measurements: collectives timed as a training step issues them (between slices of compute,
all groups of a mesh axis at once), and how much of an async all-reduce hides behind compute.
"""
from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .timing import ProfileError, _interleaved_times, _max_over_ranks, _median_time

__all__ = ["MEASURED_KINDS"]

_ISSUED_RUN_S = 0.05
"""Seconds per timed run of the loops of :func:`_time_collective`."""


_SLICE_MATMULS = 4
"""Matmuls per compute slice between two collectives in :func:`_time_collective` (about 2.6 ms on 4
CPU ranks sharing 2 cores): the gap the collectives' prices hold the ranks' drift of."""

SYNC_WAIT_SLICES = (1, 2, 4, 8, 16)
"""Compute slices before a collective in :func:`_measure_sync_wait`, in multiples of the one the
collectives are priced after."""

MEASURED_KINDS = ("all_gather", "reduce_scatter")
"""Collective kinds timed besides the all-reduce, for their own links (a backend may run them quite
unlike a ring: gloo's reduce-scatter costs about an all-reduce whatever the size)."""


def _collective(kind: str, nbytes: int, group: "dist.ProcessGroup", device: torch.device,
                fewest_elements: bool = False) -> Callable[[], None]:
    """One ``kind`` collective of ``nbytes`` per device (the byte convention of :mod:`autoshard.comm_cost`:
    the gathered output, the scattered input, the reduced buffer) on ``group``, of float32 elements;
    ``fewest_elements``: an all-reduce of as few elements as make ``nbytes`` (float64 where it
    divides), as a step's small all-reduces are (a loss's float64 sum and count, an int64 count):
    below twice the ranks' number of elements gloo's ring costs by the elements, not the bytes."""
    n = dist.get_world_size(group)
    if kind == "all_reduce":
        dtype = torch.float64 if fewest_elements and nbytes % 8 == 0 else torch.float32
        itemsize = torch.empty((), dtype=dtype).element_size()
        buffer = torch.ones(max(1, nbytes // itemsize), dtype=dtype, device=device)
        return lambda: dist.all_reduce(buffer, group=group)
    whole = torch.ones(max(n, nbytes // 4 // n * n), dtype=torch.float32, device=device)
    piece = torch.ones(whole.numel() // n, dtype=torch.float32, device=device)
    if kind == "all_gather":
        return lambda: dist.all_gather_single(whole, piece, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(piece, whole, group=group)
    raise ProfileError(f"no timing for collective kind {kind!r}")


def _time_collective(kind: str, group: "dist.ProcessGroup", sizes: Sequence[int], device: torch.device,
                     iters: int, warmup: int, fewest_elements: bool = False) -> list[float]:
    """Seconds a ``kind`` collective adds to a step, issued as a step issues its collectives: a loop
    of a slice of compute and one collective, less the same loop without it, timed in the same round
    (:func:`_interleaved_times`: the median over rounds of the differences, so that another load on
    the machine for part of the measurement does not land in one of the two only). Every rank computes
    between collectives, so each collective pays for waking the ranks that wait in it while the
    others compute: where ranks share CPU cores that costs milliseconds that a lone
    barrier-synchronised all-reduce does not show (gloo, 4 ranks on 2 cores: 2-7 ms against ~0.5 ms).
    ``fewest_elements``: see :func:`_collective`."""
    compute = _matmul_slice(device, _SLICE_MATMULS)

    def step_with(collective: Callable[[], None]) -> Callable[[], None]:
        def step() -> None:
            compute()
            collective()
        return step

    steps = [step_with(_collective(kind, size, group, device, fewest_elements)) for size in sizes]
    rounds = _interleaved_times([compute, *steps], device, iters, max(warmup, 1), group, run_s=_ISSUED_RUN_S)
    out = []
    for i in range(len(sizes)):
        added = statistics.median(r[1 + i] - r[0] for r in rounds)
        with_comm = statistics.median(r[1 + i] for r in rounds)
        out.append(max(added, 0.05 * with_comm))      # noise must not make it vanish
    return out


def _matmul_slice(device: torch.device, count: int) -> Callable[[], None]:
    """A slice of compute: ``count`` square matmuls (256 on CPU, 1024 on GPU)."""
    n = 1024 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device)

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, a)
    return compute


def _measure_sync_wait(device: torch.device, iters: int, group: "dist.ProcessGroup") -> dict[str, list[float]]:
    """Seconds of compute slices of :data:`SYNC_WAIT_SLICES` lengths (``gap``) and what a small
    all-reduce on ``group`` after each adds to a loop of them (``added``), timed in the same rounds.
    Ranks sharing cores drift apart while they compute; the collective waits for the last one of its
    group, and the longer the slice the further they drift.

    Both loops are timed as the machine runs them: each round's seconds are the slowest rank's (every
    rank runs both loops at once, whatever ``group``). A rank's own loop without the collective can
    end well before the others' where ranks share cores (4 gloo ranks on 2 cores: a whole 43 ms slice
    apart), because the cores the others leave it are then its own; the work left is still the
    machine's. Against each rank's own loop the additions tripled with the slice (7.0 ms after 2.5
    ms of compute, 17.5 after 43); against the slowest rank's, 6.7 and 10.3."""
    probe = torch.ones(8, dtype=torch.float64, device=device)
    slices = [_matmul_slice(device, _SLICE_MATMULS * k) for k in SYNC_WAIT_SLICES]

    def synced(compute: Callable[[], None]) -> Callable[[], None]:
        def step() -> None:
            compute()
            dist.all_reduce(probe, group=group)
        return step

    rounds = _interleaved_times([f for c in slices for f in (c, synced(c))], device, iters, 1, run_s=2 * _ISSUED_RUN_S)
    rounds = [_max_over_ranks(r, device) for r in rounds]
    gaps = [statistics.median(r[2 * i] for r in rounds) for i in range(len(slices))]
    added = [statistics.median(r[2 * i + 1] - r[2 * i] for r in rounds) for i in range(len(slices))]
    return {"gap": gaps, "added": added}


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

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    rounds = _interleaved_times([compute, lambda: dist.all_reduce(buf), both], device, iters, 1)
    c, a_alone, t = (statistics.median(r[i] for r in rounds) for i in range(3))
    return {"overlap.seconds": [c, a_alone, t], "overlap.bytes": [4.0 * numel] * 3}
