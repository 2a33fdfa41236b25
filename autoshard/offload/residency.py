"""Residency accounting of parameter offload: how many slices have device copies at once.

A :class:`ResidencyTracker` is told whenever a slice's device copies are made (load or
prefetch) and released, per phase (forward/backward), and keeps the maximum number of
resident slices and bytes. On CPU the "device" copies are real copies (``clone``), so the
numbers mean what they mean on a GPU. ``OffloadedModule.planned_max_resident`` is the bound
the plan promises (1, or 2 with prefetch).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ResidencyEvent", "ResidencyTracker"]


@dataclass
class ResidencyEvent:
    phase: str            # "forward" | "backward"
    action: str           # "load" | "prefetch" | "release"
    slice: int
    resident_slices: int  # after the event
    resident_bytes: int


@dataclass
class ResidencyTracker:
    """Counts the slices whose parameters have device copies at the same time.

    ``loaded``/``released`` are called by the runtime; ``max_slices``/``max_bytes`` are the
    high-water marks since the last :meth:`reset`; ``events`` the full history (bounded by
    ``keep_events``)."""

    keep_events: int = 10_000
    resident: dict[tuple[int, str], int] = field(default_factory=dict)
    max_slices: int = 0
    max_bytes: int = 0
    loads: int = 0
    events: list[ResidencyEvent] = field(default_factory=list)

    @property
    def resident_slices(self) -> int:
        return len(self.resident)

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    def loaded(self, slice_index: int, nbytes: int, phase: str, action: str = "load") -> None:
        self.resident[(slice_index, phase)] = nbytes
        self.loads += 1
        self.max_slices = max(self.max_slices, self.resident_slices)
        self.max_bytes = max(self.max_bytes, self.resident_bytes)
        self._log(phase, action, slice_index)

    def released(self, slice_index: int, phase: str) -> None:
        if self.resident.pop((slice_index, phase), None) is not None:
            self._log(phase, "release", slice_index)

    def reset(self) -> None:
        """Forget the high-water marks and history (resident copies stay counted)."""
        self.max_slices, self.max_bytes = self.resident_slices, self.resident_bytes
        self.loads = 0
        self.events.clear()

    def _log(self, phase: str, action: str, slice_index: int) -> None:
        if len(self.events) < self.keep_events:
            self.events.append(ResidencyEvent(phase, action, slice_index, self.resident_slices,
                                              self.resident_bytes))
