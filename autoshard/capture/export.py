"""Capture: a model and example inputs -> an aten graph annotated for sharding.

:func:`capture` runs ``torch.export`` (non-strict, training IR: ``aten.linear``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention`` stay whole) on meta, fake or real
tensors, rewrites the exported graph (custom ops inlined, in-place ops on intermediate values made
out-of-place), checks that matmul-family ops read one dtype, and wraps the result in a
:class:`~autoshard.capture.graph.CapturedGraph`. Export failures become a :class:`CaptureError`
that names the cause and what to try.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, TensorArgument

from .custom_ops import inline_custom_ops
from .graph import CapturedGraph
from .inplace import functionalize_inplace
from .nodes import CaptureError, TensorMeta, op_name

__all__ = ["capture", "check_operand_dtypes"]

aten = torch.ops.aten


def capture(model: nn.Module, args: Any = (), kwargs: Mapping[str, Any] | None = None, *,
            name: str | None = None) -> CapturedGraph:
    """Export ``model(*args, **kwargs)`` to an annotated aten graph.

    Works on meta tensors (nothing is allocated) and on real ones. Raises :class:`CaptureError`
    with the cause and what to try when ``torch.export`` fails or a shape is not static.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture needs an nn.Module, got {type(model).__name__}")
    label = name or type(model).__name__
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    start = time.perf_counter()
    try:
        exported = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # export raises many unrelated types; all mean "cannot capture"
        raise CaptureError(_export_failure_message(label, model, e)) from e
    exported_at = time.perf_counter()
    renamed = inline_custom_ops(exported.graph_module)
    renamed.update(functionalize_inplace(exported.graph_module, {
        s.arg.name for s in exported.graph_signature.input_specs if s.kind == InputKind.BUFFER}))
    for spec in exported.graph_signature.output_specs:   # an output may be a rewritten node
        if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
            spec.arg.name = renamed[spec.arg.name]
    graph = CapturedGraph(exported, model, args, kwargs, name=label)
    check_operand_dtypes(graph)
    graph.timings = {"export_s": exported_at - start,
                     "postprocess_s": time.perf_counter() - exported_at}
    return graph


# Ops whose tensor operands must all have one dtype: meta tensors do not check it, so a mismatch
# (int64 inputs to an fp32 Linear) would be planned and fail only on real ranks.
# Value: how many leading arguments must agree (attention masks may be bool).
_SAME_DTYPE_OPS = {
    aten.linear.default: 3, aten.mm.default: 2, aten.addmm.default: 3, aten.bmm.default: 2,
    aten.baddbmm.default: 3, aten.matmul.default: 2, aten.conv1d.default: 3, aten.conv2d.default: 3,
    aten.conv3d.default: 3, aten.convolution.default: 3, aten.scaled_dot_product_attention.default: 3,
}


def check_operand_dtypes(graph: "CapturedGraph") -> None:
    """:class:`CaptureError` when a matmul-family op reads tensors of different dtypes (an integer
    input to a float Linear, a float64 input to float32 weights): it would fail on real tensors."""
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.target not in _SAME_DTYPE_OPS:
            continue
        operands = [a for a in node.args[:_SAME_DTYPE_OPS[node.target]] if isinstance(a, fx.Node)]
        dtypes = {}
        for a in operands:
            meta = graph.tensor_meta(a)
            if isinstance(meta, TensorMeta):
                dtypes[a.name] = meta.dtype
        if len(set(dtypes.values())) > 1:
            listed = ", ".join(f"{n}: {str(d).removeprefix('torch.')}" for n, d in dtypes.items())
            inputs = [n for n in dtypes if n in graph.user_input_specs]
            hint = (f"pass example input {graph.user_input_specs[inputs[0]]} in the dtype the model computes in "
                    f"(e.g. x.float()), or convert the model" if inputs
                    else "cast the operands to one dtype in the model")
            raise CaptureError(f"node '{node.name}' ({op_name(node)}, module '{graph.module_path(node) or '<root>'}') "
                               f"reads tensors of different dtypes ({listed}); it would fail on real tensors: {hint}")


def _export_failure_message(label: str, model: nn.Module, error: Exception) -> str:
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else "(no message)"
    hints = _hints_for(model, error, text)
    bullets = "\n".join(f"  - {h}" for h in hints)
    return (f"capture of {label!r} failed in torch.export: {type(error).__name__}: {first_line}\n"
            f"What to try:\n{bullets}")


def _hints_for(model: nn.Module, error: Exception, text: str) -> list[str]:
    hints = []
    lowered = text.lower()
    if "data-dependent" in lowered or "data dependent" in lowered:
        hints.append("remove Python control flow that depends on tensor values (e.g. "
                     "`if x.sum() > 0:`, `.item()`, `.tolist()`); use torch.where or torch.cond")
    if type(model).__module__.startswith("transformers.") or "cache" in lowered:
        hints.append("for Hugging Face models pass use_cache=False (config.use_cache = False)")
    if isinstance(error, TypeError):
        hints.append("check that args/kwargs match the signature of the model's forward()")
    hints.append("check the example input shapes and dtypes (run the model on them once)")
    hints.append("pass tensors as inputs, not Python objects (lists, dataclasses, strings)")
    return hints
