"""Run a plan: per-rank parallel modules over a torch DeviceMesh (see :func:`parallelize`)."""
from .activation_codegen import (CHECKPOINT_META, HOST_OFFLOAD_COUNTER, OFFLOAD_META, MemoryAnnotationError,
                                 apply_memory_annotations)
from .collectives import CommCounter, MeshComm
from .partition import partitioned_checkpoint
from .memory_meter import SavedTensorMeter, SavedTensorReport
from .init import init_mesh
from .parallel import ParallelModule, PlanDisagreementError, capture_meta, example_inputs, parallelize
from .state import load_checkpoint, save_checkpoint

__all__ = ["partitioned_checkpoint", "CHECKPOINT_META", "HOST_OFFLOAD_COUNTER", "OFFLOAD_META", "MemoryAnnotationError",
           "SavedTensorMeter", "SavedTensorReport", "apply_memory_annotations",
           "CommCounter", "MeshComm", "ParallelModule", "PlanDisagreementError", "capture_meta", "example_inputs", "init_mesh",
           "load_checkpoint", "parallelize", "save_checkpoint"]
