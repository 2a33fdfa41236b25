"""The memory decisions a plan gives a repeated-block segment: the shared vocabulary of the solver
(which chooses them), the plan (which records them) and the runtime (which carries them out).

``keep`` its saved activations; ``recompute`` its forward in backward from its checkpointed input;
``offload`` its saved activations to host memory; ``partitioned``: recompute from a checkpoint held
1/n per device of the n holding copies (all-gathered in backward); ``selective``: recompute only its
memory-bound runs (see :mod:`autoshard.solver.selective`).
"""
from __future__ import annotations

from .phases import StrEnum

__all__ = ["DECISIONS", "Decision", "RECOMPUTING"]


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
