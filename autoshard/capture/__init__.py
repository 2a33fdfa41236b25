"""The capture stage: a model and example inputs -> an aten graph annotated for sharding.

Modules, by job:

- ``export.py``: :func:`capture`, ``torch.export`` of the model and the rewrites below, export
  failures explained (:class:`CaptureError`);
- ``custom_ops.py``: custom ops inlined as their decomposition's aten ops;
- ``inplace.py``: in-place ops on intermediate values made out-of-place;
- ``graph.py``: :class:`CapturedGraph`, the exported graph and what the planner asks of each node;
- ``nodes.py``: :class:`TensorMeta`, :func:`op_name`, :func:`repeated_block`, :class:`CaptureError`;
- ``meta_device.py``: capture on the meta device (:func:`capture_meta`, :func:`capture_in_mode`);
- folded capture of deep models (:func:`capture_folded`, :func:`capture_preset`): ``fold.py``
  (the entry points), ``periodic.py`` (a shallow export cut into its repeated blocks),
  ``unfold.py`` (the full-depth program written from them), ``compare.py``
  (:func:`exported_differences`, the check against a real export).
"""
from .compare import exported_differences
from .custom_ops import INLINED_FROM, inline_custom_ops
from .export import capture
from .fold import capture_folded, capture_module_folded, capture_preset
from .graph import CapturedGraph
from .inplace import INPLACE_REFUSAL, functionalize_inplace
from .meta_device import capture_in_mode, capture_meta, meta_copy, to_meta
from .nodes import CaptureError, TensorMeta, op_name, repeated_block
from .periodic import FoldError

__all__ = ["INLINED_FROM", "INPLACE_REFUSAL", "CaptureError", "CapturedGraph", "FoldError", "TensorMeta", "capture",
           "capture_folded", "capture_in_mode", "capture_meta", "capture_module_folded", "capture_preset",
           "exported_differences", "functionalize_inplace", "inline_custom_ops", "meta_copy", "op_name",
           "repeated_block", "to_meta"]
