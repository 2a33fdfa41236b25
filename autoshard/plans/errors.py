"""The errors a plan raises: a file or data that cannot be used, a plan for another model, and a
plan whose other mode cannot hold the main plan's layouts."""
from __future__ import annotations

__all__ = ["ModeError", "PlanError", "PlanMismatchError", "REPLAN"]

REPLAN = "Re-create the plan"
"""How every plan error ends: the fix is to plan again."""


class PlanError(ValueError):
    """A plan file that cannot be used: corrupt, truncated, of another format version, or
    missing fields."""


class PlanMismatchError(PlanError):
    """A plan made for a different model (graph fingerprints differ)."""


class ModeError(ValueError):
    """The other mode (eval for a plan made in training, or the reverse) cannot run with the main
    plan's parameter layouts."""
