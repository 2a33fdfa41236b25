"""What :func:`~autoshard.runtime.parallel.parallelize` is given, checked and completed: its
arguments' types and values, the model's master dtype under a mixed-precision plan, example
inputs from the plan's recorded shapes, and the model captured as it was planned (mode, precision).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..capture import CapturedGraph, capture_in_mode, capture_meta
from ..errors import ArgumentError
from ..plans import Plan, PlanError, PlanMismatchError
from ..precision import cast_inputs, precision_copy
from .replicas import INPUT_CHECKS, REPLICA_MODES

__all__ = ["capture_as_planned", "check_arguments", "check_master_dtype", "example_inputs"]


def example_inputs(plan: Plan) -> tuple[tuple, dict]:
    """Meta tensors shaped like the inputs the plan was captured with."""
    sig = plan.inputs
    if sig is None:
        raise PlanError("this plan does not record its input shapes; pass args=/kwargs= (example inputs, meta "
                        "tensors are fine) to parallelize")
    leaves = [torch.empty(leaf["shape"], dtype=getattr(torch, leaf["dtype"]), device="meta") if "shape" in leaf
              else leaf["value"] for leaf in sig["leaves"]]
    args, kwargs = pytree.tree_unflatten(leaves, pytree.treespec_loads(sig["in_spec"]))
    return tuple(args), dict(kwargs)


def capture_as_planned(model: nn.Module, plan: Plan, args: Any, kwargs: Mapping[str, Any] | None) -> CapturedGraph:
    """The graph of ``model`` in the mode the plan was made in (the model's own per-module modes when
    its root is in that mode)."""
    if plan.mixed_precision is not None:       # captured as planned: parameters and float inputs in param_dtype
        model = precision_copy(model, plan.mixed_precision)
        args, kwargs = cast_inputs(args, kwargs, plan.mixed_precision)
    if model.training == plan.training:
        return capture_meta(model, args, kwargs, name=plan.model_name)
    return capture_in_mode(model, args, kwargs, plan.training, name=plan.model_name)


def check_master_dtype(model: nn.Module, plan: Plan) -> None:
    """A mixed-precision plan keeps the model's parameters as master weights: they must be in the
    master dtype the plan was made with (PlanMismatchError otherwise)."""
    mp = plan.mixed_precision
    assert mp is not None
    found = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    if found and found != [mp.master_dtype]:
        raise PlanMismatchError(f"the plan keeps {mp.master_dtype} master weights ({mp}), but the model's parameters "
                                f"are {', '.join(found)}; pass the model in {mp.master_dtype} (e.g. model.float()), "
                                f"as it was planned")


def check_arguments(model: Any, plan: Any, device_mesh: Any, input_mode: Any, bucket_bytes: Any, replicas: Any,
                     check_inputs: Any) -> None:
    """ArgumentError for an argument of :func:`parallelize` of the wrong type or not a known value."""
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"parallelize needs the nn.Module the plan was made for, got {type(model).__name__}")
    if not isinstance(plan, Plan):
        raise ArgumentError(f"parallelize needs a Plan (autoshard.plan(...) or Plan.load(path)), got "
                            f"{type(plan).__name__}")
    if not hasattr(device_mesh, "shape") or not hasattr(device_mesh, "device_type"):
        raise ArgumentError(f"parallelize needs the DeviceMesh of autoshard.init_mesh({tuple(plan.mesh_shape)}), "
                            f"got {type(device_mesh).__name__}")
    for label, value, allowed in (("input_mode", input_mode, ("global", "local")), ("replicas", replicas, REPLICA_MODES),
                                  ("check_inputs", check_inputs, INPUT_CHECKS)):
        if value not in allowed:
            raise ArgumentError(f"{label} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ArgumentError(f"bucket_bytes must be an int >= 1 (bytes per gradient all-reduce bucket, e.g. 25 * 2**20), "
                            f"got {bucket_bytes!r}")

