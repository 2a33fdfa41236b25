"""Run a plan: per-rank parallel modules over a torch DeviceMesh (see :func:`parallelize`)."""
from .activation_codegen import (CHECKPOINT_META, HOST_OFFLOAD_COUNTER, OFFLOAD_META, MemoryAnnotationError,
                                 apply_memory_annotations)
from .autochunk import AutoChunkError, ChunkedModule, ChunkReport, autochunk
from .autochunk_memory import PeakMemory, measure_peak_memory
from .collectives import CommCounter, MeshComm
from .param_offload import OffloadedModule, OffloadError, ResidencyTracker, SlicePlan, offload_parameters
from .partition import partitioned_checkpoint
from .memory_meter import SavedTensorMeter, SavedTensorReport
from .init import init_mesh
from ..capture import capture_meta
from .arguments import example_inputs
from .parallel import ParallelModule, parallelize
from .plan_agreement import PlanDisagreementError
from .state import load_checkpoint, save_checkpoint

__all__ = ["OffloadError", "OffloadedModule", "ResidencyTracker", "SlicePlan", "offload_parameters", "AutoChunkError", "ChunkReport", "ChunkedModule", "PeakMemory", "autochunk", "measure_peak_memory",
           "partitioned_checkpoint", "CHECKPOINT_META", "HOST_OFFLOAD_COUNTER", "OFFLOAD_META", "MemoryAnnotationError",
           "SavedTensorMeter", "SavedTensorReport", "apply_memory_annotations",
           "CommCounter", "MeshComm", "ParallelModule", "PlanDisagreementError", "capture_meta", "example_inputs", "init_mesh",
           "load_checkpoint", "parallelize", "save_checkpoint"]
