"""The memory decisions a plan gives a repeated-block segment: the shared vocabulary of the solver
(which chooses them), the plan (which records them) and the runtime (which carries them out).

``keep`` its saved activations; ``recompute`` its forward in backward from its checkpointed input;
``offload`` its saved activations to host memory; ``partitioned``: recompute from a checkpoint held
1/n per device of the n holding copies (all-gathered in backward); ``selective``: recompute only its
memory-bound runs (see :mod:`autoshard.solver.selective`).
"""
from __future__ import annotations

import math
from typing import Sequence

from .phases import StrEnum

__all__ = ["DECISIONS", "Decision", "RECOMPUTING", "partition_axes", "stays_resident"]


class Decision(StrEnum):
    """A segment's memory decision; a member equals its string (``Decision.KEEP == "keep"``), so
    plans keep plain strings in JSON."""

    KEEP = "keep"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"
    PARTITIONED = "partitioned"
    SELECTIVE = "selective"


DECISIONS: tuple[Decision, ...] = tuple(Decision)
"""Every memory decision, in the order the solver and plan list them."""

RECOMPUTING: tuple[Decision, ...] = (Decision.RECOMPUTE, Decision.PARTITIONED, Decision.SELECTIVE)
"""The decisions whose segment's forward (or part of it) runs again in backward."""


def stays_resident(producer_segment: str | None, consumer_segments: set[str]) -> bool:
    """Whether a segment's input stays in memory whatever the segment's decision: an activation
    produced outside every segment and read by several (an attention mask, rotary tables) is held
    for all of them, so checkpointing one segment neither frees nor partitions it. The solver counts
    no checkpoint for such an input and the runtime partitions none."""
    return producer_segment is None and len(consumer_segments) > 1


def partition_axes(replicated: Sequence[int], mesh_shape: Sequence[int], numel: int, floating: bool) -> tuple[int, ...]:
    """The mesh axes a partitioned checkpoint splits one of its inputs over: the axes it is
    replicated over (``numel`` local elements), when it is floating point and its elements split
    evenly among their devices; none otherwise (the input is kept whole)."""
    n = math.prod(mesh_shape[a] for a in replicated)
    return tuple(replicated) if floating and n > 1 and numel % n == 0 else ()
