"""The plan: the one contract between planning and running.

A plan is plain, versioned, JSON-serialisable data (:class:`Plan`, see :mod:`.schema`). Planning
builds one from the solver's solution (:mod:`.build`, the only module here that imports the solver);
the runtime only reads it. Modules, one job each:

- :mod:`.schema`      the plan's fields and entries, save/load, queries
- :mod:`.jsonio`      JSON files and typed loading of plain data (nothing plan-specific)
- :mod:`.validation`  cross-field consistency of a loaded plan, against its graph, across modes
- :mod:`.explain`     the plan in words (summary and per-node table)
- :mod:`.build`       a plan from a solution (:func:`~.build.plan_from_solution`)
- :mod:`.errors`      :class:`PlanError`, :class:`PlanMismatchError`, :class:`ModeError`

``import autoshard.plans`` loads neither the solver nor PuLP.
"""
from .errors import ModeError, PlanError, PlanMismatchError
from .jsonio import MAX_PLAN_BYTES
from .schema import (PLAN_FORMAT_VERSION, RECOMPUTE, CollectiveEntry, CommEntry, NodePlan, Plan, ReshardEntry,
                     SolverReport, StepEntry)

__all__ = [
    "CollectiveEntry", "CommEntry", "MAX_PLAN_BYTES", "ModeError", "NodePlan", "PLAN_FORMAT_VERSION", "Plan",
    "PlanError", "PlanMismatchError", "RECOMPUTE", "ReshardEntry", "SolverReport", "StepEntry",
]
