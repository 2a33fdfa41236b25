"""Activation memory as code: checkpoint (recompute) and activation offload regions of an FX graph.

:func:`apply_memory_annotations` turns ``node.meta`` annotations into regenerated, readable code. The
modules are the steps: :mod:`.annotations` (the keys and what they may hold), :mod:`.regions` (the
runs of nodes they mark), :mod:`.codegen` (the regenerated graph), :mod:`.with_blocks` (``with``
statements in FX code), :mod:`.host_offload` (the saved-tensor hooks offload regions run),
:mod:`.module_state` (in-place-updated state inside checkpoint regions) and :mod:`.param_flag`
(tensors that stand for parameters, which offload leaves in place).
"""
from .annotations import CHECKPOINT_META, OFFLOAD_META, MemoryAnnotationError
from .codegen import apply_memory_annotations
from .host_offload import (HOST_OFFLOAD_COUNTER, HostOffloadCounter, HostOffloadHooks, HostOffloadRegion, delegate_pack,
                           delegate_unpack, outer_saved_tensors_hooks)
from .param_flag import is_parameter_like

__all__ = ["CHECKPOINT_META", "HOST_OFFLOAD_COUNTER", "OFFLOAD_META", "HostOffloadCounter", "HostOffloadHooks",
           "HostOffloadRegion", "MemoryAnnotationError", "apply_memory_annotations", "delegate_pack", "delegate_unpack",
           "is_parameter_like", "outer_saved_tensors_hooks"]
