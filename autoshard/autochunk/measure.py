"""The measured activation peak of a call, to check AutoChunk's estimate (:mod:`.memory`) against.

:func:`measure_peak_memory` runs a function under ``torch.profiler`` with ``profile_memory=True``;
the CPU allocator reports every allocation and free (with its size) to the profiler, and the peak
is the highest running sum of those events, in time order, relative to the memory in use when the
call started. It sees every allocation the allocator makes on the calling thread, including
temporaries inside kernels that never become Python tensors; it does not see memory taken outside
the PyTorch allocator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["PeakMemory", "measure_peak_memory"]


@dataclass(frozen=True)
class PeakMemory:
    """Measured memory of one call: ``peak`` above the start, and what was still held at the end."""

    peak: int
    retained: int
    allocations: int


def _allocator_events(prof: Any) -> list[tuple[int, int]]:
    """(time, signed bytes) for every allocator event the profiler recorded, in time order."""
    raw = prof.profiler.kineto_results.events()
    mem = [(e.start_ns(), i, e.nbytes()) for i, e in enumerate(raw) if e.name() == "[memory]"]
    mem.sort()
    return [(t, b) for t, _, b in mem]


def measure_peak_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, PeakMemory]:
    """Run ``fn(*args, **kwargs)`` and measure its peak CPU memory from allocator events.

    Returns ``(result, PeakMemory)``. ``peak`` is the largest amount of memory (bytes) held at
    any moment during the call above what was held when it started; ``retained`` is what was
    still held when the call returned (normally the result). Only allocations made on the
    calling thread through PyTorch's CPU allocator are counted.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        result = fn(*args, **kwargs)
    running = peak = 0
    events = _allocator_events(prof)
    for _, b in events:
        running += b
        peak = max(peak, running)
    return result, PeakMemory(peak=peak, retained=running, allocations=sum(1 for _, b in events if b > 0))
