"""Every rank holds the same plan for the same graph on the same mesh, checked in one exchange
before the first step (:class:`PlanDisagreementError` on every rank otherwise); the exchange also
gives each parallel model a serial number every rank agrees on.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch.distributed as dist

from ..capture import CapturedGraph
from ..plans import Plan, PlanError

__all__ = ["PlanDisagreementError", "agree_across_ranks"]


class PlanDisagreementError(PlanError):
    """Ranks hold different plans, models or meshes (checked before the first step)."""


_DECIDING_FIELDS = ("fingerprint", "mesh_shape", "hardware", "memory_budget", "solver_options", "nodes",
                    "segments", "reshards", "inputs", "outputs", "training", "other_mode",
                    "mixed_precision")


def _plan_digest(plan: Plan) -> str:
    """Hash of what a plan decides (not of when or how fast it was solved: ranks that each solve the
    same problem agree)."""
    full = plan.to_dict()
    data = {k: full[k] for k in _DECIDING_FIELDS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


_next_serial = 0            # the serial number this process proposes for its next parallel model


def agree_across_ranks(plan: Plan, graph: CapturedGraph, device_mesh) -> int:
    """Every rank must hold the same plan for the same graph on the same mesh; a difference is an
    error on every rank (never a hang: all ranks reach this exchange). Returns the model's serial
    number, the same on every rank and new in this process (the largest any rank proposes)."""
    global _next_serial
    mine = {"plan": _plan_digest(plan), "graph": graph.fingerprint(), "mesh": list(device_mesh.shape)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {**mine, "serial": _next_serial})
    serial = max(theirs.pop("serial") for theirs in everyone)
    _next_serial = serial + 1
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        what = sorted({k for r in differ for k in mine if everyone[r][k] != everyone[0][k]})
        raise PlanDisagreementError(f"ranks {differ} differ from rank 0 in {', '.join(what)}: every rank must "
                                    f"load the same plan for the same model (save it once, load it everywhere)")
    return serial
