"""Gradient all-reduces that consumers of one value share, as the ILP prices them.

Several consumers of one value (a tensor-parallel block's q, k and v projections reading one
normalised activation) may each need that value's gradient all-reduced over the same mesh axes.
The runtime runs one all-reduce for all that read the value as produced: autograd sums their
partial gradients first (:mod:`autoshard.runtime.lower`; :func:`.evaluate.gradient_sync` prices
exactly that). Each strategy prices its own all-reduce, so the ILP pays, per such value and axes,
the dearest consumer's price in place of their sum (:func:`shared_sync_prices` lists them,
:func:`.formulation.shared_sync_terms` makes the terms, :func:`shared_sync_credit` is what that
takes off an assignment's sum). The ILP does not see whether a consumer reads the value resharded
(the runtime then runs that consumer's all-reduce on its own) or leaves it to the buckets; the
exact model does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..strategy import BWD

if TYPE_CHECKING:
    from .costgraph import CostGraph

__all__ = ["shared_sync_classes", "shared_sync_credit", "shared_sync_prices", "synced_value"]

SharedSync = list[tuple[str, np.ndarray]]
"""One value's consumers on one set of mesh axes: (CGNode, seconds of its all-reduce of the value's
gradient per strategy, 0 where the strategy runs none)."""


def synced_value(cg: "CostGraph", member: str, j: int, axes) -> tuple[str, int, tuple[int, ...]]:
    """What graph node ``member``'s gradient all-reduce of operand ``j`` over ``axes`` reduces: the
    value (producer, its output read) and the axes; consumers with the same one may share it."""
    operand = cg.table[member].operand_nodes[j]
    return operand, cg.graph.output_index(member, operand), tuple(axes)


def shared_sync_prices(cg: "CostGraph") -> list[SharedSync]:
    """Per (value, mesh axes) that two or more decision nodes may all-reduce the gradient of inline:
    each node's price per strategy (its members' summed). Computed once per graph."""
    return cg.derived("shared_sync_prices", lambda: _prices(cg))


def shared_sync_classes(cg: "CostGraph") -> list[tuple[int, SharedSync]]:
    """:func:`shared_sync_prices` grouped where the consumers are of the same decision groups with
    the same prices (a value of each of a stack of aliased blocks): (how many, one of them). Every
    member of a class takes the same choice, so the ILP needs one term per class."""
    def signature(shared: SharedSync) -> tuple:
        return tuple((cg.nodes[node].group, prices.tobytes()) for node, prices in shared)

    return cg.derived("shared_sync_classes", lambda: _classes(shared_sync_prices(cg), signature))


def _classes(items: list[SharedSync], signature) -> list[tuple[int, SharedSync]]:
    classes: dict[tuple, list] = {}
    for shared in items:
        entry = classes.setdefault(signature(shared), [0, shared])
        entry[0] += 1
    return [(count, shared) for count, shared in classes.values()]


def _prices(cg: "CostGraph") -> list[SharedSync]:
    by_value: dict[tuple[str, int, tuple[int, ...]], dict[str, np.ndarray]] = {}
    for node in cg.nodes.values():
        for member in node.members:
            for s in range(len(node)):
                for a in node.member_strategy(member, s).comm:
                    if a.phase != BWD or a.kind != "all_reduce" or a.bucketed or not a.operand.startswith("in"):
                        continue
                    key = synced_value(cg, member, int(a.operand[2:]), a.axes)
                    prices = by_value.setdefault(key, {}).setdefault(node.name, np.zeros(len(node)))
                    prices[s] += a.cost
    return [list(consumers.items()) for consumers in by_value.values() if len(consumers) > 1]


def shared_sync_credit(cg: "CostGraph", choice: dict[str, int]) -> float:
    """Seconds :func:`.formulation.shared_sync_terms` take off the per-strategy prices at ``choice``:
    per shared value and axes, the chosen prices' sum less their maximum."""
    total = 0.0
    for consumers in shared_sync_prices(cg):
        chosen = [float(prices[choice[node]]) for node, prices in consumers]
        total += sum(chosen) - max(chosen)
    return total
