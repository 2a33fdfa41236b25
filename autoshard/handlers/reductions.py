"""Reductions and softmax.

Per mesh axis a reduction may shard any dim it keeps (the output shards the matching dim,
shifted down past the reduced dims unless ``keepdim``). Sharding a *reduced* dim leaves each
device a summand of the result, a partial output resolved by an all-reduce; that holds only for
sum-decomposable reductions: ``sum``, and ``mean`` whose local kernel divides the local mean by
the number of shards. ``amax``/``max``/``var``/``std``/``norm``/``prod``/``logsumexp``/``argmax``
are not sums of per-shard results, so they only shard kept dims.

Softmax and log-softmax shard every dim except the one they normalise over.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..opinfo import OpInfo
from ..strategy import PARTIAL, AxisOption, Strategy
from .registry import LocalKernel, default_kernel, register

aten = torch.ops.aten


def schema_arg(op: OpInfo, name: str) -> Any:
    """The value of the aten argument ``name`` as called, or its schema default."""
    for i, a in enumerate(op.target._schema.arguments):
        if a.name != name:
            continue
        if not a.kwarg_only and i < len(op.node.args):
            return op.node.args[i]
        if name in op.node.kwargs:
            return op.node.kwargs[name]
        return a.default_value if a.has_default_value() else None
    raise KeyError(f"{op.describe()} has no argument {name!r}")


@dataclass(frozen=True)
class Reduction:
    """Which input dims a node reduces, and whether they stay as size-1 dims."""

    dims: frozenset[int]
    keepdim: bool

    def out_dim(self, d: int) -> int:
        """Output dim of kept input dim ``d``."""
        return d if self.keepdim else d - sum(1 for r in self.dims if r < d)


def _dims(value: Any, ndim: int, *, empty_means_all: bool) -> frozenset[int]:
    """Normalise a ``dim`` argument (None, int or list) to non-negative dims."""
    if value is None or (empty_means_all and isinstance(value, (list, tuple)) and not value):
        return frozenset(range(ndim))
    items = value if isinstance(value, (list, tuple)) else [value]
    return frozenset(d % ndim for d in items) if ndim else frozenset()


def reduction_of(op: OpInfo) -> Reduction:
    """The reduced dims of a reduction node (ops without ``dim`` reduce everything)."""
    ndim = len(op.shape(0))
    names = {a.name for a in op.target._schema.arguments}
    keepdim = bool(schema_arg(op, "keepdim")) if "keepdim" in names else False
    if "dim" not in names:
        return Reduction(frozenset(range(ndim)), keepdim)
    # argmax/argmin with dim=None index the flattened tensor: handled as a reduction of all dims
    return Reduction(_dims(schema_arg(op, "dim"), ndim, empty_means_all=True), keepdim)


def reduction_rules(op: OpInfo, *, linear: bool) -> list[AxisOption]:
    """Shard a kept dim (output follows); with ``linear``, also a reduced dim (partial output)."""
    red = reduction_of(op)
    n_out = len(op.outputs)
    options = []
    for d in range(len(op.shape(0))):
        if d not in red.dims:
            options.append(AxisOption((d,), (red.out_dim(d),) * n_out, f"d{d}"))
        elif linear:
            options.append(AxisOption((d,), (PARTIAL,) * n_out, f"r{d}"))
    return options


SUM_OPS = (aten.sum.dim_IntList, aten.sum.default)
MEAN_OPS = (aten.mean.dim, aten.mean.default)
NONLINEAR_REDUCTIONS = (
    aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim, aten.max.default,
    aten.min.default, aten.var.correction, aten.var.dim, aten.var.default, aten.std.correction,
    aten.std.dim, aten.std.default, aten.prod.dim_int, aten.prod.default,
    aten.linalg_vector_norm.default, aten.logsumexp.default, aten.argmax.default, aten.argmin.default,
)


def local_mean_summand(target: Callable, shards: int, *args: Any, **kwargs: Any) -> torch.Tensor:
    """This device's summand of a mean whose reduced dims are split ``shards`` ways.

    The local mean divides by the local count; the all-reduce of the partial output sums
    ``shards`` of them, so each is scaled by ``1/shards`` to give the mean over the global count.
    """
    return target(*args, **kwargs) / shards


def mean_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """Divide by the number of shards of the reduced dims, when any is sharded."""
    red = reduction_of(op)
    spec, mesh = strategy.input_specs[0], op.mesh.shape
    shards = 1
    for d in red.dims:
        shards *= spec.shard_factor(d, mesh)
    if shards == 1:
        return default_kernel(op, strategy)
    return LocalKernel(local_mean_summand, (op.target, shards, *op.node.args), dict(op.node.kwargs))


@register(*SUM_OPS, family="reduction",
          doc="sum: shard a kept dim, or a reduced dim (partial output, all-reduced)")
def sum_rules(op: OpInfo) -> list[AxisOption]:
    return reduction_rules(op, linear=True)


@register(*MEAN_OPS, family="reduction", kernel=mean_kernel,
          doc="mean: shard a kept dim, or a reduced dim (local mean / shards -> partial, all-reduced)")
def mean_rules(op: OpInfo) -> list[AxisOption]:
    return reduction_rules(op, linear=True)


@register(*NONLINEAR_REDUCTIONS, family="reduction",
          doc="non-sum reduction (max, var, norm, ...): shard a kept dim only")
def nonlinear_reduction_rules(op: OpInfo) -> list[AxisOption]:
    return reduction_rules(op, linear=False)


SOFTMAX_OPS = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default,
               aten.log_softmax.int, aten._log_softmax.default)


@register(*SOFTMAX_OPS, family="softmax", doc="softmax over dim: shard any other dim")
def softmax_rules(op: OpInfo) -> list[AxisOption]:
    ndim = len(op.shape(0))
    dim = schema_arg(op, "dim") % ndim if ndim else 0
    return [AxisOption((d,), (d,), f"d{d}") for d in range(ndim) if d != dim]
