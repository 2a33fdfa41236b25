"""Selective recomputation: the memory-bound runs of a segment, recomputed while the rest is kept.

Recomputing a whole transformer layer frees all of its saved activations but re-runs its matmuls.
Most of a layer's saved bytes often come from cheap memory-bound ops instead (GPT-2's tanh GELU
saves four 4h-wide tensors, about half of a layer's activations, for under 5% of its forward
time). The ``selective`` memory decision checkpoints only those: each *run* (a maximal sequence of
consecutive nodes of one segment whose ops are memory-bound, see :data:`RECOMPUTABLE_FAMILIES`)
becomes a checkpoint region of its own, so backward recomputes the run from its inputs while the
outputs of the compute-bound ops around it (matmuls, attention, convolutions) stay saved. This is
Megatron-LM's selective activation recomputation, found from the graph instead of hand-picked.

A run is offered when, unsharded, what its ops save exceeds what the checkpoint must store (its
inputs from outside the run, parameters excluded), by more bytes per second of recompute than
recomputing the whole segment frees: a layer norm whose saved input is the very input the
checkpoint stores frees only its statistics, a GELU whose input is stored once instead of four
intermediates frees half a layer for a few percent of its time. The ILP then prices each run
exactly per strategy (:class:`RecomputeRun`'s vectors).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch.fx as fx

from ..strategy import FWD, local_bytes

if TYPE_CHECKING:
    from .costgraph import CostGraph

__all__ = ["RECOMPUTABLE_FAMILIES", "RecomputeRun", "memory_bound_runs", "recompute_runs"]

RECOMPUTABLE_FAMILIES = frozenset({
    "view", "cast", "pointwise", "meta", "norm", "softmax", "reduction", "mask", "index", "pooling", "factory",
})
"""Handler families whose ops are memory-bound (time ~ bytes moved, not FLOPs): cheap to recompute
relative to what they save. Matmul, attention, convolution, embedding and loss ops are not."""


@dataclass
class RecomputeRun:
    """One checkpoint region of a selectively recomputed segment.

    ``nodes``: graph nodes, consecutive in graph order. Per CGNode (key) and its strategy index:
    ``saved`` the bytes per device its members in the run save for backward (freed by the
    checkpoint), ``fwd`` the seconds of their forward (paid again in backward), ``stored`` the
    bytes per device of run inputs that the producing CGNode outputs and the checkpoint keeps.
    """

    nodes: list[str]
    saved: dict[str, np.ndarray] = field(default_factory=dict)
    fwd: dict[str, np.ndarray] = field(default_factory=dict)
    stored: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, table: dict[str, np.ndarray], cg_node: str, values: np.ndarray) -> None:
        table[cg_node] = table[cg_node] + values if cg_node in table else np.asarray(values, dtype=float)


def recompute_runs(cg: "CostGraph") -> dict[str, list[RecomputeRun]]:
    """Segment -> the runs the ``selective`` decision recomputes there (see the module docstring),
    in graph order; segments where no run is worth recomputing are left out."""
    members: dict[str, list[fx.Node]] = {}
    for node, seg in _segmented_nodes(cg):
        if seg is not None:
            members.setdefault(seg, []).append(node)
    whole = {seg: _unsharded(cg, nodes) for seg, nodes in members.items()}
    out: dict[str, list[RecomputeRun]] = {}
    for seg, seg_runs in memory_bound_runs(cg).items():
        for nodes in seg_runs:
            if _worth_it(*_unsharded(cg, nodes), whole[seg]):
                out.setdefault(seg, []).append(_priced(cg, nodes))
    return out


def memory_bound_runs(cg: "CostGraph") -> dict[str, list[list[fx.Node]]]:
    """Segment -> its maximal runs of consecutive memory-bound nodes, in graph order (every one, worth
    recomputing or not)."""
    runs: dict[str, list[list[fx.Node]]] = {}
    current: list[fx.Node] = []
    segment = None
    for node, seg in _segmented_nodes(cg):
        if seg != segment or seg is None or not _recomputable(cg, node):
            if current:
                runs.setdefault(segment, []).append(current)
            current = []
        segment = seg
        if seg is not None and _recomputable(cg, node):
            current.append(node)
    if current:
        runs.setdefault(segment, []).append(current)
    return runs


def _segmented_nodes(cg: "CostGraph") -> Iterable[tuple[fx.Node, str | None]]:
    """The graph's call_function nodes in graph order, each with its segment (None outside any)."""
    for node in cg.graph.graph.nodes:
        if node.op == "call_function" and node.name in cg.node_of:
            yield node, cg.nodes[cg.node_of[node.name]].segment


def _recomputable(cg: "CostGraph", node: fx.Node) -> bool:
    """A memory-bound op (by its handler's family); ``getitem`` goes with the node it unpacks, so
    a run never starts inside the outputs of a compute-bound op."""
    from ..handlers import handler_for

    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and _recomputable(cg, src)
    handler = handler_for(node.target)
    ns = cg.table[node.name]
    return handler is not None and not ns.fallback and handler.family in RECOMPUTABLE_FAMILIES


def _priced(cg: "CostGraph", nodes: list[fx.Node]) -> RecomputeRun:
    run = RecomputeRun([n.name for n in nodes])
    inside = set(run.nodes)
    for n in nodes:
        host = cg.nodes[cg.node_of[n.name]]
        per_strategy = [host.member_strategy(n.name, c) for c in range(len(host))]
        run.add(run.saved, host.name, np.array([s.memory.saved for s in per_strategy], dtype=float))
        run.add(run.fwd, host.name, np.array([s.compute_fwd + s.comm_time(FWD) for s in per_strategy]))
    for src in dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a.name not in inside):
        if _resident(cg, src) or cg.graph.tensor_meta(src) is None:
            continue
        host = cg.nodes[cg.node_of[src.name]]
        run.add(run.stored, host.name, np.array([_output_bytes(cg, host, src.name, c) for c in range(len(host))],
                                                 dtype=float))
    return run


def _resident(cg: "CostGraph", node: fx.Node) -> bool:
    """Parameters, buffers and constants stay on the device anyway: storing them costs nothing."""
    g = cg.graph
    return node.op == "get_attr" or node.op == "placeholder" and not g.is_user_input(node)


def _output_bytes(cg: "CostGraph", host, member: str, c: int) -> float:
    """Bytes per device of ``member``'s (single tensor) output under ``host``'s strategy ``c``."""
    meta = cg.graph.tensor_meta(member)
    metas = meta if isinstance(meta, tuple) else (meta,)   # a multi-output node read whole: every tensor
    specs = host.member_strategy(member, c).output_specs
    return float(sum(local_bytes(m, s, cg.mesh.shape) for m, s in zip(metas, specs)))


def _unsharded(cg: "CostGraph", nodes: list[fx.Node]) -> tuple[float, float]:
    """(bytes freed, forward seconds) of checkpointing ``nodes``, unsharded: what their ops save
    less what the checkpoint stores (inputs from outside, parameters excluded), and their forward
    time, each op at its largest over its strategies (the unsharded one)."""
    saved = fwd = 0.0
    for n in nodes:
        strategies = cg.nodes[cg.node_of[n.name]].member_strategies[n.name]
        saved += max(s.memory.saved for s in strategies)
        fwd += max(s.compute_fwd for s in strategies)
    inside = {n.name for n in nodes}
    for src in dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a.name not in inside):
        meta = cg.graph.tensor_meta(src)
        if _resident(cg, src) or meta is None:
            continue
        saved -= sum(math.prod(t.shape) * t.dtype.itemsize for t in (meta if isinstance(meta, tuple) else (meta,))
                     if t is not None)
    return saved, fwd


def _worth_it(freed: float, fwd: float, segment: tuple[float, float]) -> bool:
    """The run frees memory, and more of it per second of recompute than recomputing its whole
    segment would (else full recomputation is the better deal and the run only adds cost)."""
    seg_freed, seg_fwd = segment
    return freed > 0 and freed * seg_fwd >= seg_freed * fwd
