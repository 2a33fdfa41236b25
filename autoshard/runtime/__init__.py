"""Run a plan: per-rank parallel modules over a torch DeviceMesh (see :func:`parallelize`)."""
from .collectives import CommCounter, MeshComm
from .partition import partitioned_checkpoint
from .memory_meter import SavedTensorMeter, SavedTensorReport
from .init import init_mesh
from ..capture import capture_meta
from .arguments import example_inputs
from .grad_sync import GradBucket
from .parallel import ParallelModule, parallelize
from .plan_agreement import PlanDisagreementError
from .state import load_checkpoint, save_checkpoint

__all__ = ["partitioned_checkpoint", "SavedTensorMeter", "SavedTensorReport",
           "CommCounter", "GradBucket", "MeshComm", "ParallelModule", "PlanDisagreementError", "capture_meta", "example_inputs", "init_mesh",
           "load_checkpoint", "parallelize", "save_checkpoint"]
