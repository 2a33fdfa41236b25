"""What a dim-flow rule of AutoChunk answers, and the readers of aten nodes the rules share.

A *free dimension* of a region is a dim that every node in the region computes independently:
slicing it on the inputs and running the ops on the slice gives exactly the same slice of the
outputs. A rule (:mod:`.rules`) answers one question for one op: "if I chunk dim ``d`` of this
node's output into pieces of the dim's full size ``size``, which dim of every tensor input must be
sliced the same way (an int), and which inputs are needed whole (``None``)?" The answer is a
:class:`Flow`; a rule raises :class:`NotFree` when the dim mixes across positions in that op (a
reduction or normalisation over ``d``, a matmul's contracted dim, a causal mask over the query
dim, ...).

Rules read shapes from ``node.meta['val']`` (fake tensors recorded by ``torch.export``) through
the readers here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import fx


class NotFree(Exception):
    """The requested dim does not flow through this node independently."""


@dataclass(frozen=True)
class Flow:
    """Result of a rule: input dims for one chunked output dim.

    ``inputs`` maps each tensor input node to the dim sliced on it, or ``None`` when the input is
    used whole (broadcast, a weight, the keys of attention). ``size_arg`` names the argument that
    holds a shape list (``view``/``expand``) whose entry at the output dim must become the chunk
    length inside the loop.
    """

    inputs: dict[fx.Node, int | None] = field(default_factory=dict)
    size_arg: int | None = None


def tensors_of(node: fx.Node) -> list[torch.Tensor]:
    """All tensors in a node's recorded value (one for most ops, several for tuple ops)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def value(node: fx.Node) -> torch.Tensor:
    """The (first) tensor of a node's value; raises :class:`NotFree` for non-tensor nodes."""
    ts = tensors_of(node)
    if not ts:
        raise NotFree(f"{node.name} has no tensor value")
    return ts[0]


def input_nodes(node: fx.Node) -> Iterator[fx.Node]:
    """Tensor-valued input nodes in argument order (nested lists included)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    for n in found:
        if tensors_of(n):
            yield n


def bound_args(node: fx.Node) -> dict[str, Any]:
    """Arguments of an aten call by schema name, defaults filled in."""
    schema = node.target._schema  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def merge(flow: dict[fx.Node, int | None], node: fx.Node, dim: int | None) -> None:
    """Record ``dim`` for ``node``; one node read two ways (sliced and whole, or two dims) fails."""
    if node in flow and flow[node] != dim:
        raise NotFree(f"{node.name} is read at dim {flow[node]} and at dim {dim}")
    flow[node] = dim


def broadcast_dim(arg: fx.Node, out_ndim: int, d: int, size: int) -> int | None:
    """Dim of ``arg`` that lines up with output dim ``d`` under broadcasting (None: broadcast)."""
    t = value(arg)
    ad = d - (out_ndim - t.ndim)
    if ad < 0 or t.shape[ad] == 1:
        return None
    if t.shape[ad] != size:
        raise NotFree(f"{arg.name} has size {t.shape[ad]} at dim {ad}, not {size}")
    return ad
