"""Small helpers shared by the nn-op handlers (conv, embedding, attention, loss, pooling)."""
from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx
from torch.utils import _pytree as pytree

from ..opinfo import OpInfo
from ..strategy import AxisOption


def operand_slots(op: OpInfo) -> dict[str, int]:
    """Schema argument name -> index in ``op.operands`` of each tensor operand the node passes.

    Operands are numbered in the order of the fx.Node leaves of ``node.args`` then
    ``node.kwargs`` (see :class:`OpInfo`); this names them by the aten schema, whether an
    argument was passed positionally or by keyword, and whatever optional tensors are absent.
    """
    names = [a.name for a in op.target._schema.arguments]
    pairs = list(zip(names, op.node.args)) + list(op.node.kwargs.items())
    slots: dict[str, int] = {}
    j = 0
    for name, value in pairs:
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, fx.Node) and j < len(op.operand_nodes) and op.operand_nodes[j] is leaf:
                slots.setdefault(name, j)
                j += 1
    return slots


def option(n_operands: int, dims: dict[int, int | None], outputs: Sequence[int | str | None],
           tag: str, extra: tuple = (), combine: str = "") -> AxisOption:
    """An :class:`AxisOption` from ``{operand index: dim}`` (unlisted operands replicated)."""
    inputs: list[int | None] = [None] * n_operands
    for j, d in dims.items():
        inputs[j] = d
    return AxisOption(tuple(inputs), tuple(outputs), tag, extra, combine)


def set_arg(args: Sequence, kwargs: dict, index: int, name: str, value: Any) -> tuple[tuple, dict]:
    """Copies of a call's args/kwargs with schema argument ``name`` (position ``index``) set."""
    a, k = list(args), dict(kwargs)
    if len(a) > index:
        a[index] = value
    else:
        k[name] = value
    return tuple(a), k
