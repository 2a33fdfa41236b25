"""Activation memory as code: checkpoint (recompute) and activation offload regions of an FX graph,
generated from ``node.meta`` annotations, and the host-offload hooks the generated code runs."""
from .codegen import (CHECKPOINT_META, HOST_OFFLOAD_COUNTER, OFFLOAD_META, HostOffloadCounter, HostOffloadHooks,
                      HostOffloadRegion, MemoryAnnotationError, apply_memory_annotations, delegate_pack, delegate_unpack,
                      outer_saved_tensors_hooks)
from .param_flag import is_parameter_like

__all__ = ["CHECKPOINT_META", "HOST_OFFLOAD_COUNTER", "OFFLOAD_META", "HostOffloadCounter", "HostOffloadHooks",
           "HostOffloadRegion", "MemoryAnnotationError", "apply_memory_annotations", "delegate_pack", "delegate_unpack",
           "is_parameter_like", "outer_saved_tensors_hooks"]
