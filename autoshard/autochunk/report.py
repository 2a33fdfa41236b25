"""What AutoChunk tells its caller: the plan's report (loops, estimated peaks) and its error."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..units import format_bytes

__all__ = ["AutoChunkError", "ChunkReport", "LoopInfo"]


class AutoChunkError(RuntimeError):
    """The model cannot be captured or run in chunks within the requested memory."""


@dataclass
class LoopInfo:
    """One chunk loop of the plan, for reports."""

    first: str
    last: str
    nodes: int
    dim_size: int
    chunk: int
    iterations: int
    outputs: list[str]


@dataclass
class ChunkReport:
    """What autochunk decided, with estimated activation peaks in bytes."""

    budget: int | None
    estimated_peak_before: int
    estimated_peak_after: int
    lowest_peak: int | None
    loops: list[LoopInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"autochunk: estimated activation peak {format_bytes(self.estimated_peak_before)} -> "
                 f"{format_bytes(self.estimated_peak_after)}"
                 + (f" (budget {format_bytes(self.budget)})" if self.budget is not None else "")]
        for i, lp in enumerate(self.loops):
            lines.append(f"  loop {i}: {lp.nodes} nodes {lp.first}..{lp.last}, dim {lp.dim_size} "
                         f"in chunks of {lp.chunk} ({lp.iterations} iterations)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
