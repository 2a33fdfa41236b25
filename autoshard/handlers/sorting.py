"""Ops that order or bin values along a dim: ``topk``, ``sort``, ``histc``; and the elementwise
binary ops that select or round (``min.other``/``max.other``, ``floor_divide``).

- ``topk``/``sort`` select or order along ONE dim: every other dim may be sharded (values and
  indices both follow the input); the selected/sorted dim stays replicated, since a device
  holding part of it could not know the global order. Indices are positions along that unsharded
  dim, so the local ones are the global ones.
- ``histc(x, bins, min, max)`` with an explicit range (``min < max``): each device counts the values
  of its shard into the same bins, so the histogram of ``x`` sharded on any dim is the sum of the
  local ones: a partial output, resolved by an all-reduce. With ``min == max`` the range is taken
  from the data (each shard would pick its own), so it is replicate-only.
- ``min.other``/``max.other``/``floor_divide``, and ``copy``/``fill`` (what capture makes of a
  ``copy_``/``fill_``): broadcasting elementwise, the pointwise rule
  (:func:`autoshard.handlers.pointwise.broadcast_rules`) applies unchanged.
"""
from __future__ import annotations

import torch

from ..opinfo import OpInfo
from ..strategy import PARTIAL, AxisOption, Strategy
from .pointwise import broadcast_rules
from .registry import LocalKernel, register
from .dim_maps import bound_args, norm_dim

aten = torch.ops.aten

BINARY_SELECT_OPS = (aten.min.other, aten.max.other, aten.floor_divide.default,
                     aten.floor_divide.Scalar)

register(*BINARY_SELECT_OPS, family="pointwise",
         doc="min/max(x, other), floor_divide: elementwise, shard any output dim with the operands "
             "that carry it (broadcast dims replicated)")(broadcast_rules)


register(aten.copy.default, aten.fill.Scalar, aten.fill.Tensor, family="pointwise",
         doc="copy(self, src)/fill(self, value) (out-of-place copy_/fill_): src broadcast into self's "
             "shape and dtype, shard any output dim with the operands that carry it")(broadcast_rules)


SORT_OPS = (aten.topk.default, aten.sort.default, aten.sort.stable)


@register(*SORT_OPS, family="sort",
          doc="topk/sort along dim: shard any other dim (values and indices follow the input)")
def sort_rules(op: OpInfo) -> list[AxisOption]:
    """topk(x, k, dim=-1, ...) / sort(x, dim=-1, ...) -> (values, indices)"""
    shape = op.shape(0)
    ndim = len(shape)
    if ndim == 0:
        return []
    dim = norm_dim(bound_args(op)["dim"], ndim)
    n_out = len(op.outputs)
    return [AxisOption((d,), (d,) * n_out, f"d{d}") for d, s in enumerate(shape) if d != dim and s > 1]


def histc_any_dtype(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``torch.histc``, also for integer input on devices whose kernel takes floats only (CPU, MPS).

    A graph captured on meta tensors may hold ``histc`` of an integer tensor (transformers' MoE
    routing picks ``.int()`` when the device is not CPU/MPS, and meta is neither); on CPU it is
    computed on the values as float64 (exact for integers below 2**53) and the counts cast back
    to the input's dtype, which is histc's output dtype."""
    if x.dtype.is_floating_point or x.device.type not in ("cpu", "mps"):
        return torch.histc(x, bins, min, max)
    return torch.histc(x.to(torch.float64), bins, min, max).to(x.dtype)


def _histc_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    return LocalKernel(histc_any_dtype, tuple(op.node.args), dict(op.node.kwargs))


@register(aten.histc.default, family="reduction", kernel=_histc_kernel,
          doc="histc with an explicit range: shard any dim of the input (partial counts, all-reduced)")
def histc_rules(op: OpInfo) -> list[AxisOption]:
    """histc(x, bins, min, max): the counts of a shard sum to the counts of x. With min == max
    (range taken from the data) the shards would bin differently: replicate-only."""
    a = bound_args(op)
    if float(a["min"]) >= float(a["max"]):
        return []
    return [AxisOption((d,), (PARTIAL,), f"d{d}") for d, s in enumerate(op.shape(0)) if s > 1]
