"""Permutations, expand and repeat: dim maps that move, broadcast or repeat dims.

- permutations (permute, transpose, t, movedim, ...): the dim moves with the permutation.
- expand: kept dims carry their sharding; an expanded (broadcast) output dim may be sharded
  with the input replicated (the input's gradient is then a partial sum, all-reduced).
- repeat: only dims repeated once carry their sharding; repeat_interleave keeps every dim's.

Local kernels rewrite expand sizes and repeat_interleave's ``output_size`` to local sizes.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.fx as fx

from ..opinfo import OpInfo
from ..strategy import AxisOption, Strategy
from .dim_maps import (DimPairs, bound_args, identity_pairs, local_out_shape, norm_dim, pair_options,
                       sized_kernel)
from .registry import LocalKernel, default_kernel, register
from .reshape import reshape_pairs

aten = torch.ops.aten


# -- permutations --------------------------------------------------------------------------------

_PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default, aten.numpy_T.default,
             aten.mT.default, aten.adjoint.default, aten.movedim.int, aten.movedim.intlist,
             aten.swapaxes.default, aten.swapdims.default)


def permutation_pairs(op: OpInfo) -> DimPairs:
    """Which input dim each output dim is, found by running the op on a meta tensor whose strides
    tag the dims (a permutation only reorders strides). One rule for every permuting view."""
    shape = op.shape(0)
    strides = [1 << d for d in range(len(shape))]
    x = torch.empty_strided(shape, strides, dtype=op.operands[0].dtype, device="meta")
    args = [x if isinstance(a, fx.Node) else a for a in op.args]
    out = op.target(*args, **op.node.kwargs)
    got = list(out.stride())
    if sorted(got) != sorted(strides):
        raise ValueError(f"{op.describe()} is not a permutation of its input dims (strides {got})")
    return [(strides.index(s), o) for o, s in enumerate(got) if shape[strides.index(s)] > 1]


@register(*_PERMUTES, family="view", free=True, doc="permutation: each dim keeps its sharding")
def permute_rules(op: OpInfo) -> list[AxisOption]:
    """permute/transpose/t/movedim/swapaxes(x, ...)"""
    return pair_options(permutation_pairs(op))


# -- expand --------------------------------------------------------------------------------------

def expand_options(in_shape: Sequence[int], out_shape: Sequence[int], n_inputs: int,
                   other: int | None = None) -> list[AxisOption]:
    """Kept dims carry their sharding; a broadcast output dim may be sharded from a replicated
    input. ``other`` (expand_as) is an operand shaped like the output, laid out like it."""
    lead = len(out_shape) - len(in_shape)
    options = []
    for o, size in enumerate(out_shape):
        if size <= 1:
            continue
        i = o - lead
        kept = i >= 0 and in_shape[i] == size
        inputs: list = [None] * n_inputs
        inputs[0] = i if kept else None
        if other is not None:
            inputs[other] = o
        options.append(AxisOption(tuple(inputs), (o,), f"d{o}" if kept else f"b{o}"))
    return options


@register(aten.expand.default, family="view", free=True, grad_copies=True,
          kernel=sized_kernel(1, lambda op, s: local_out_shape(op, s)),
          doc="expand: kept dims follow the input; broadcast dims may be sharded from a replicated input")
def expand_rules(op: OpInfo) -> list[AxisOption]:
    """expand(x, size)"""
    return expand_options(op.shape(0), op.out_shape, 1)


@register(aten.expand_as.default, family="view", free=True, grad_copies=True,
          doc="expand_as(x, other): as expand; other (shape only) is laid out like the output")
def expand_as_rules(op: OpInfo) -> list[AxisOption]:
    return expand_options(op.shape(0), op.out_shape, 2, other=1)


@register(aten.repeat.default, family="view",
          doc="repeat: only dims repeated once carry their sharding")
def repeat_rules(op: OpInfo) -> list[AxisOption]:
    """repeat(x, repeats): a repeated dim is [x, x, ...], not a blockwise function of x."""
    shape, reps = op.shape(0), list(bound_args(op)["repeats"])
    lead = len(reps) - len(shape)
    return pair_options([(i, i + lead) for i, s in enumerate(shape) if s > 1 and reps[i + lead] == 1])


def _repeat_interleave_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """``output_size``, when captured, is rewritten to the local output's size along the
    repeated dim (or the flat size when ``dim`` is None)."""
    a = bound_args(op)
    if a.get("output_size") is None:
        return default_kernel(op, strategy)
    local = local_out_shape(op, strategy)
    dim = a.get("dim")
    size = math.prod(local) if dim is None else local[norm_dim(dim, len(local))]
    return LocalKernel(op.target, tuple(op.args), {**op.node.kwargs, "output_size": size})


@register(aten.repeat_interleave.self_int, family="view", kernel=_repeat_interleave_kernel,
          doc="repeat_interleave(x, r, dim): every dim, the repeated one included, stays sharded")
def repeat_interleave_rules(op: OpInfo) -> list[AxisOption]:
    """repeat_interleave(x, repeats: int, dim): each element of ``dim`` becomes ``repeats``
    consecutive ones, so contiguous blocks of ``dim`` map to contiguous blocks of the output
    (block ``b`` of ``n/k`` elements -> block ``b`` of ``n*r/k``); other dims are untouched. With
    ``dim=None`` x is flattened first: only the leading dim whose blocks stay contiguous in the
    flat order (the reshape rule) carries its sharding to the output."""
    a = bound_args(op)
    if a.get("dim") is None:
        return pair_options(reshape_pairs(op.shape(0), (op.operands[0].numel,)))
    return pair_options(identity_pairs(op))


