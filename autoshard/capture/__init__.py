"""The capture stage: a model and example inputs -> an aten graph annotated for sharding.

:func:`capture` exports the model (``torch.export``, on meta, fake or real tensors) into a
:class:`CapturedGraph`; :func:`capture_meta` and :func:`capture_in_mode` capture on the meta
device, allocating nothing; :func:`capture_folded` and :func:`capture_preset` write a deep model's
graph from exports of two shallow copies of it.
"""
from .fold import FoldError, capture_folded, capture_module_folded, capture_preset, exported_differences
from .graph import (INLINED_FROM, INPLACE_REFUSAL, CapturedGraph, CaptureError, TensorMeta, capture,
                    functionalize_inplace, inline_custom_ops, op_name, repeated_block)
from .meta_device import capture_in_mode, capture_meta, meta_copy, to_meta

__all__ = ["INLINED_FROM", "INPLACE_REFUSAL", "CaptureError", "CapturedGraph", "FoldError", "TensorMeta", "capture",
           "capture_folded", "capture_in_mode", "capture_meta", "capture_module_folded", "capture_preset",
           "exported_differences", "functionalize_inplace", "inline_custom_ops", "meta_copy", "op_name",
           "repeated_block", "to_meta"]
