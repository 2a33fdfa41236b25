"""Memory segments: the repeated-block instances that each take one memory decision (keep /
recompute / offload / partitioned / selective, see :mod:`autoshard.decisions`), with their nodes,
checkpointed inputs and selective runs; and the post-segment nodes whose activations backward frees
before it reaches any segment. Shared by the ILP's memory rows (:mod:`.memory_model`), the evaluation
of a plan (:mod:`.evaluate`) and the plan builder (:mod:`autoshard.plans.build`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..decisions import Decision, partition_axes, stays_resident
from ..specs import ShardSpec, replicated_axes
from .costgraph import CGEdge, CGNode, CostGraph
from .selective import RecomputeRun, recompute_runs


@dataclass
class MemorySegment:
    name: str
    nodes: list[str]
    saved: np.ndarray | None = None
    ckpt_edges: list[CGEdge] = field(default_factory=list)
    runs: list[RecomputeRun] = field(default_factory=list)    # what 'selective' recomputes
    rerun_edges: list[CGEdge] = field(default_factory=list)   # into its nodes: resharded inside it
    hooked: int = 0                                           # tensors its forward saves for backward
    run_hooked: list[int] = field(default_factory=list)       # the same, per selective run

    def rerun_edges_for(self, decision: str) -> list[CGEdge]:
        """The edges whose forward resharding runs again in backward under ``decision``: every edge
        into the segment when it is recomputed or partitioned, the edges into its runs when it is
        selective, none otherwise."""
        if decision in (Decision.RECOMPUTE, Decision.PARTITIONED):
            return self.rerun_edges
        if decision == Decision.SELECTIVE:
            members = {n for run in self.runs for n in run.nodes}
            return [e for e in self.rerun_edges if e.dst_member in members]
        return []


def memory_segments(cg: CostGraph) -> list[MemorySegment]:
    """The segments that get a memory decision, with the edges whose tensors a checkpoint stores
    (inputs from outside the segment that are not parameters and not shared by several segments),
    the edges into its nodes (the runtime reshards an operand where its consumer runs, inside the
    consumer's checkpoint region, so recomputing the segment runs their forward resharding again)
    and the runs a selective recomputation re-runs (:func:`~.selective.recompute_runs`). Computed
    once per cost graph (the ILP, every ``predict`` and the plan builder read them); treat as read-only."""
    return cg.derived("memory_segments", lambda: _memory_segments(cg))


def _memory_segments(cg: CostGraph) -> list[MemorySegment]:
    by_seg: dict[str, MemorySegment] = {}
    for node in cg.nodes.values():
        if node.segment is not None and node.kind == "call_function":
            by_seg.setdefault(node.segment, MemorySegment(node.segment, [])).nodes.append(node.name)
    consumers_by_src: dict[str, set[str]] = {}
    for e in cg.edges:
        seg = cg.nodes[e.dst].segment
        if seg is not None:
            consumers_by_src.setdefault((e.src, e.src_member, e.src_output), set()).add(seg)
    seen: set = set()
    for e in cg.edges:
        src, dst = cg.nodes[e.src], cg.nodes[e.dst]
        if dst.segment is not None and dst.kind == "call_function":
            by_seg[dst.segment].rerun_edges.append(e)
        if dst.segment is None or src.segment == dst.segment or src.kind == "placeholder" and not _is_input(cg, src):
            continue
        key = (e.src, e.src_member, e.src_output)
        if stays_resident(src.segment, consumers_by_src[key]):
            continue
        if (dst.segment, key) in seen:
            continue
        seen.add((dst.segment, key))
        by_seg[dst.segment].ckpt_edges.append(e)
    for name, runs in recompute_runs(cg).items():
        by_seg[name].runs = runs
    for seg in by_seg.values():
        seg.hooked = sum(cg.table[m].hooked for n in seg.nodes for m in cg.nodes[n].members)
        seg.run_hooked = [sum(cg.table[m].hooked for m in run.nodes) for run in seg.runs]
    return list(by_seg.values())


def checkpoint_partition_axes(e: CGEdge, spec: ShardSpec, mesh_shape) -> tuple[int, ...]:
    """The mesh axes a partitioned checkpoint splits checkpoint edge ``e``'s tensor over when its
    producer gives it in ``spec`` (what the runtime's partitioned checkpoint does with it)."""
    return partition_axes(replicated_axes(spec, mesh_shape), mesh_shape, spec.local_numel(e.tensor.shape, mesh_shape),
                          e.tensor.dtype.is_floating_point)


def post_segment_nodes(cg: CostGraph) -> set[str]:
    """Unsegmented CGNodes later in graph order than every node of a memory segment (final norm, LM
    head, loss): their backward runs, and frees what they saved, before any segment's backward, so
    their saved activations are gone when a recomputed or offloaded segment is brought back. Empty
    when there are no segments."""
    names = list(cg.nodes)
    last = max((i for i, n in enumerate(names)
                if cg.nodes[n].segment is not None and cg.nodes[n].kind == "call_function"), default=None)
    if last is None:
        return set()
    return {n for n in names[last + 1:] if cg.nodes[n].segment is None}


def _is_input(cg: CostGraph, node: CGNode) -> bool:
    return cg.graph.is_user_input(node.members[0])
