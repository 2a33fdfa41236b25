"""Ops whose output is laid out as their input: alias/detach, contiguous/clone, casts, and getitem
of a multi-output node (its element's layout).

Casts (``to.*``, ``type_as``) keep the local shard's device: the device captured in the graph is
the capture device (often ``meta``), never the rank's.
"""
from __future__ import annotations

import operator
from typing import Any

import torch

from ..opinfo import OpInfo
from ..strategy import AxisOption, Strategy
from .dim_maps import bound_args, free_operand_options, identity_pairs, pair_options
from .registry import LocalKernel, register

aten = torch.ops.aten


# -- identity-like ops and casts -----------------------------------------------------------------


@register(aten.alias.default, aten.detach.default, aten.detach_.default, family="view", free=True,
          doc="alias/detach: output follows the input")
def alias_rules(op: OpInfo) -> list[AxisOption]:
    return pair_options(identity_pairs(op))


@register(aten.contiguous.default, aten.clone.default, aten.lift_fresh_copy.default, family="view",
          doc="contiguous/clone: output follows the input")
def copy_rules(op: OpInfo) -> list[AxisOption]:
    return pair_options(identity_pairs(op))


def _cast(x: torch.Tensor, dtype: torch.dtype | None = None, copy: bool = False,
          memory_format: torch.memory_format | None = None) -> torch.Tensor:
    """The local cast: dtype/copy/memory format as captured, the device of the local shard."""
    return x.to(dtype=x.dtype if dtype is None else dtype, copy=copy,
                memory_format=memory_format or torch.preserve_format)


def _cast_like(x: torch.Tensor, other: torch.Tensor, copy: bool = False,
               memory_format: torch.memory_format | None = None) -> torch.Tensor:
    return _cast(x, other.dtype, copy, memory_format)


def _cast_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    a = bound_args(op)
    copy = op.target is aten._to_copy.default or bool(a.get("copy"))
    fmt = a.get("memory_format")
    if op.target in (aten.to.other, aten.type_as.default):
        return LocalKernel(_cast_like, (op.args[0], op.args[1]), {"copy": copy, "memory_format": fmt})
    return LocalKernel(_cast, (op.args[0],), {"dtype": a.get("dtype"), "copy": copy, "memory_format": fmt})


_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default)


@register(*_CASTS, family="cast", kernel=_cast_kernel,
          doc="cast: output follows the input (local shards keep their device)")
def cast_rules(op: OpInfo) -> list[AxisOption]:
    """to.dtype/to.dtype_layout/to.device/_to_copy(x, ...)"""
    return pair_options(identity_pairs(op))


@register(aten.to.other, aten.type_as.default, family="cast", kernel=_cast_kernel,
          doc="cast to other's dtype: output follows x; other (dtype only) may be in any layout")
def cast_like_rules(op: OpInfo) -> list[AxisOption]:
    """to.other(x, other) / type_as(x, other)"""
    return free_operand_options(pair_options(identity_pairs(op), extra_inputs=1),
                                {1: len(op.shape(1))}, 2, 1)


# -- getitem -------------------------------------------------------------------------------------

def select_element(value: Any, index: int) -> Any:
    """``value[index]`` of a multi-output node's local results. A bare tensor is taken to be that
    element already (the single-process checker feeds the element itself)."""
    return value if isinstance(value, torch.Tensor) else value[index]


def _getitem_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    return LocalKernel(select_element, tuple(op.args), {})


@register(operator.getitem, family="view", free=True, kernel=_getitem_kernel,
          doc="getitem of a multi-output node: output spec = the element's spec")
def getitem_rules(op: OpInfo) -> list[AxisOption]:
    """getitem(producer, i): the operand is element i of the producer."""
    if not op.operands or op.outputs[0] is None:
        return []
    return pair_options(identity_pairs(op))
