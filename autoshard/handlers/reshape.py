"""Reshape-like ops, split and join: dim maps that regroup dims.

- reshape-like ops (view, reshape, flatten, unflatten, squeeze, unsqueeze): an input dim may stay
  sharded when it is the outermost non-1 dim right after a boundary shared by input and output
  (the products of the dims before it agree): splitting it into k blocks then splits the flat
  remainder into the same k contiguous blocks on both sides, so the local reshape is correct.
  A dim inside a flattened/split group is never sharded (that would be a strided layout).
- split/chunk/unbind/cat/stack: the dim that is split or joined stays replicated; every other dim
  carries its sharding.

Local kernels rewrite view/reshape/unflatten shapes to local sizes.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..opinfo import OpInfo
from ..strategy import AxisOption, Strategy
from .dim_maps import DimPairs, bound_args, local_out_shape, norm_dim, other_dims, pair_options, with_arg
from .registry import LocalKernel, default_kernel, register

aten = torch.ops.aten


# -- reshape-like ops ----------------------------------------------------------------------------

def reshape_pairs(in_shape: Sequence[int], out_shape: Sequence[int]) -> DimPairs:
    """(input dim, output dim) pairs a reshape carries a sharding through (see module doc)."""
    if math.prod(in_shape) == 0:
        return []
    out_at_prefix = {}
    prefix = 1
    for e, s in enumerate(out_shape):
        if s > 1:
            out_at_prefix[prefix] = e
        prefix *= s
    pairs = []
    prefix = 1
    for d, s in enumerate(in_shape):
        if s > 1 and prefix in out_at_prefix:
            pairs.append((d, out_at_prefix[prefix]))
        prefix *= s
    return pairs


RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.default, aten.squeeze.dim,
             aten.squeeze.dims, aten.unsqueeze.default)
"""Ops whose output is their input with another shape, same elements in the same order."""


def _reshape_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    if op.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        args, kwargs = with_arg(op, 1, local_out_shape(op, strategy))
        return LocalKernel(op.target, args, kwargs)
    if op.target is aten.unflatten.int:
        a = bound_args(op)
        dim = norm_dim(a["dim"], len(op.shape(0)))
        args, kwargs = with_arg(op, 2, local_out_shape(op, strategy)[dim:dim + len(a["sizes"])])
        return LocalKernel(op.target, args, kwargs)
    if op.target in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims):
        # A sharded dim may be 1 locally: squeeze only the (asked-for) dims that are 1 globally.
        ndim = len(op.shape(0))
        asked = op.args[1] if len(op.args) > 1 else op.node.kwargs.get("dim", range(ndim))
        asked = {norm_dim(d, ndim) for d in ([asked] if isinstance(asked, int) else asked)}
        ones = [d for d, s in enumerate(op.shape(0)) if s == 1 and d in asked]
        return LocalKernel(aten.squeeze.dims, (op.args[0], ones), {})
    return default_kernel(op, strategy)


@register(*RESHAPES, family="view", free=True, kernel=_reshape_kernel,
          doc="reshape-like: an input dim stays sharded when it leads a group shared with the output")
def reshape_rules(op: OpInfo) -> list[AxisOption]:
    """view/reshape/flatten/unflatten/squeeze/unsqueeze(x, ...)"""
    return pair_options(reshape_pairs(op.shape(0), op.out_shape))


@register(aten.view_as.default, family="view", free=True,
          doc="view_as(x, other): reshape rule; other (shape only) is laid out like the output")
def view_as_rules(op: OpInfo) -> list[AxisOption]:
    return [AxisOption((i, o), (o,), f"d{i}") for i, o in reshape_pairs(op.shape(0), op.out_shape)]


# -- split / cat ---------------------------------------------------------------------------------

@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, family="view",
          free=True, grad_copies=True,
          doc="split/chunk: the split dim stays replicated; every piece follows the input")
def split_rules(op: OpInfo) -> list[AxisOption]:
    """split(x, size|sizes, dim) / chunk(x, chunks, dim) -> pieces"""
    ndim = len(op.shape(0))
    dim = norm_dim(bound_args(op)["dim"], ndim)
    return pair_options(other_dims(ndim, dim), n_outputs=len(op.outputs))


@register(aten.unbind.int, family="view", free=True, grad_copies=True,
          doc="unbind: the unbound dim stays replicated; others follow the input")
def unbind_rules(op: OpInfo) -> list[AxisOption]:
    ndim = len(op.shape(0))
    dim = norm_dim(bound_args(op)["dim"], ndim)
    return pair_options(other_dims(ndim, dim, shift=-1), n_outputs=len(op.outputs))


def _joined(op: OpInfo, new_dim: bool) -> list[AxisOption]:
    n = len(op.operands)
    if n == 0:
        return []
    ranks = {len(m.shape) for m in op.operands}
    if len(ranks) != 1:      # legacy cat of 1-D empty tensors with others: leave replicated
        return []
    ndim = ranks.pop()
    out_rank = len(op.out_shape)
    dim = norm_dim(bound_args(op)["dim"], out_rank)
    options = []
    for d in range(ndim):
        o = d + 1 if new_dim and d >= dim else d
        if new_dim or d != dim:
            options.append(AxisOption((d,) * n, (o,), f"d{d}"))
    return options


@register(aten.cat.default, family="view",
          doc="cat: the cat dim stays replicated; all inputs sharded alike on the others")
def cat_rules(op: OpInfo) -> list[AxisOption]:
    return _joined(op, new_dim=False)


@register(aten.stack.default, family="view",
          doc="stack: all inputs sharded alike; the new dim stays replicated")
def stack_rules(op: OpInfo) -> list[AxisOption]:
    return _joined(op, new_dim=True)


