"""Errors of the public API that more than one stage raises: a bad argument (of :func:`autoshard.plan`,
:func:`autoshard.parallelize` or the command line), a memory budget that cannot be read, and one no
plan fits. A module of its own, importing nothing, so that the runtime can raise them without loading
the planner (and the solver)."""
from __future__ import annotations

__all__ = ["ArgumentError", "BudgetError", "InfeasibleBudgetError"]


class BudgetError(ValueError):
    """A memory budget that cannot be read, is not a positive size, or exceeds the device's memory."""


class ArgumentError(ValueError):
    """An argument (of :func:`plan`, :func:`autoshard.parallelize` or the command line) of the wrong type,
    out of its range, or not one of the known names."""


class InfeasibleBudgetError(ValueError):
    """No plan fits the per-device memory budget."""
