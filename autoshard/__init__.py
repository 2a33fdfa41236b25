"""autoshard: automatic sharding, recompute and offload planning for PyTorch models.

Pipeline: :func:`capture` (torch.export on meta tensors) -> per-op handlers enumerate sharding
strategies over a 2D mesh (:func:`enumerate_strategies`) -> solver -> plan -> runtime.
"""
from .capture import CapturedGraph, CaptureError, TensorMeta, capture
from .enumerate import NodeStrategies, StrategyTable, UnsupportedOpError, enumerate_strategies
from .hardware import HardwareError, HardwareProfile, available_profiles, load_hardware
from .mesh import MeshError, MeshSpec
from .reshard import reshard_cost, reshard_plan
from .specs import ShardSpec, SpecError
from .strategy import AxisOption, CommAction, MemoryCost, Strategy
from .plans import PLAN_FORMAT_VERSION, Plan, PlanError, PlanMismatchError
from .solver.ilp import InfeasibleBudgetError
from .api import ArgumentError, BudgetError, plan
from .modes import ModeError
from .runtime.inputs import InputError
from .runtime.replicas import ReplicaMismatchError
from .runtime.step_watch import SkippedBackwardError
from .runtime.plan_once import RemotePlanError, plan_once
from .runtime import (AutoChunkError, autochunk, offload_parameters, SavedTensorMeter, apply_memory_annotations, CommCounter, ParallelModule, PlanDisagreementError, init_mesh, load_checkpoint,
                      parallelize, save_checkpoint)

__version__ = "0.1.0"

__all__ = [
    "AxisOption", "CaptureError", "CapturedGraph", "CommAction", "HardwareError", "HardwareProfile",
    "MemoryCost", "MeshError", "MeshSpec", "NodeStrategies", "ShardSpec", "SpecError", "Strategy",
    "StrategyTable", "TensorMeta", "UnsupportedOpError", "available_profiles", "capture",
    "enumerate_strategies", "load_hardware", "reshard_cost", "reshard_plan",
    "BudgetError", "InfeasibleBudgetError", "PLAN_FORMAT_VERSION", "Plan", "PlanError", "PlanMismatchError",
    "plan", "CommCounter", "ParallelModule", "PlanDisagreementError", "init_mesh", "load_checkpoint",
    "parallelize", "save_checkpoint", "SavedTensorMeter", "apply_memory_annotations",
    "AutoChunkError", "autochunk", "offload_parameters",
    "ArgumentError", "InputError", "ModeError", "ReplicaMismatchError", "SkippedBackwardError", "RemotePlanError", "plan_once",
]
