"""autoshard: automatic sharding, recompute and offload planning for PyTorch models.

Pipeline: :func:`capture` (torch.export on meta tensors) -> per-op handlers enumerate sharding
strategies over a 2D mesh (:func:`enumerate_strategies`) -> cost graph -> solver (one ILP) -> plan
(:mod:`autoshard.plans`) -> runtime (:mod:`autoshard.runtime`).

The planning call :func:`plan` is loaded on first use (PEP 562 ``__getattr__``): ``import
autoshard.runtime`` and :meth:`Plan.load` on a training rank import neither the solver nor PuLP.
"""
from .capture import CapturedGraph, CaptureError, TensorMeta, capture
from .enumerate import NodeStrategies, StrategyTable, UnsupportedOpError, enumerate_strategies
from .hardware import HardwareError, HardwareProfile, available_profiles, load_hardware
from .mesh import MeshError, MeshSpec
from .reshard import reshard_cost, reshard_plan
from .specs import ShardSpec, SpecError
from .strategy import AxisOption, CommAction, MemoryCost, Strategy
from .plans import PLAN_FORMAT_VERSION, ModeError, Plan, PlanError, PlanMismatchError
from .errors import ArgumentError, BudgetError, InfeasibleBudgetError
from .runtime.inputs import InputError
from .runtime.replicas import ReplicaMismatchError
from .runtime.compiled import CompileError
from .runtime.step_watch import SkippedBackwardError
from .runtime.plan_once import RemotePlanError, plan_once
from .autochunk import AutoChunkError, autochunk
from .offload import offload_parameters
from .memory import apply_memory_annotations
from .runtime import (SavedTensorMeter, CommCounter, ParallelModule, PlanDisagreementError, init_mesh, load_checkpoint,
                      parallelize, save_checkpoint)

from .version import __version__

__all__ = [
    "AxisOption", "CaptureError", "CapturedGraph", "CommAction", "HardwareError", "HardwareProfile",
    "MemoryCost", "MeshError", "MeshSpec", "NodeStrategies", "ShardSpec", "SpecError", "Strategy",
    "StrategyTable", "TensorMeta", "UnsupportedOpError", "available_profiles", "capture",
    "enumerate_strategies", "load_hardware", "reshard_cost", "reshard_plan",
    "BudgetError", "InfeasibleBudgetError", "PLAN_FORMAT_VERSION", "Plan", "PlanError", "PlanMismatchError",
    "plan", "CommCounter", "ParallelModule", "PlanDisagreementError", "init_mesh", "load_checkpoint",
    "parallelize", "save_checkpoint", "SavedTensorMeter", "apply_memory_annotations",
    "AutoChunkError", "autochunk", "offload_parameters",
    "ArgumentError", "CompileError", "InputError", "ModeError", "ReplicaMismatchError", "SkippedBackwardError", "RemotePlanError", "plan_once",
]


_LAZY = {"plan": "api"}      # name -> module (of this package) that defines it, imported on first use


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
    from . import api

    value = getattr(api, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
