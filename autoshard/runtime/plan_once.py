"""Plan on one rank and hand the plan to every rank of a torchrun job.

Planning is deterministic but costs seconds to minutes; every rank needs the same plan. Solving
on one rank and broadcasting it saves the other ranks the work and guarantees they agree. A
failure on the planning rank is broadcast too, so that every rank raises instead of waiting
forever in the broadcast.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import torch.distributed as dist

from ..plans import Plan, PlanError


class RemotePlanError(PlanError):
    """Planning failed on the planning rank (the message is that rank's error)."""


def plan_once(model_or_graph: Any, args: Any = (), kwargs: Mapping[str, Any] | None = None, *,
              src: int = 0, group: "dist.ProcessGroup | None" = None, **options: Any) -> Plan:
    """:func:`autoshard.plan` on rank ``src`` only; every rank of ``group`` (default: the world)
    returns the same :class:`Plan`. Without an initialised process group (or with one rank) this
    is :func:`autoshard.plan`. If planning raises on ``src``, ``src`` re-raises it and every other
    rank raises :class:`RemotePlanError` with its message."""
    from ..api import plan

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return plan(model_or_graph, args, kwargs, **options)
    box: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == src:
        try:
            box = [{"plan": json.dumps(plan(model_or_graph, args, kwargs, **options).to_dict())}]
        except Exception as e:          # handed to the other ranks, then re-raised here
            error = e
            box = [{"error": f"{type(e).__name__}: {e}"}]
    dist.broadcast_object_list(box, src=src, group=group)
    if error is not None:
        raise error
    if "error" in box[0]:
        raise RemotePlanError(f"planning failed on rank {src}: {box[0]['error']}")
    return Plan.from_dict(json.loads(box[0]["plan"]))
