"""The waits a step's collectives add where ranks drift apart between them.

Every blocking collective waits for the last rank to reach it. The profile's collective prices were
timed after short slices of compute, so they hold the drift of such a slice; after a longer stretch
the ranks have drifted further (ranks sharing CPU cores are scheduled unevenly) and the collective
waits longer, by :class:`~autoshard.hardware.SyncWait` (measured by ``autoshard profile``; absent,
as in the shipped GPU profiles, it is 0). :func:`sync_gaps` walks one step as the runtime runs it
and lists, per point where the ranks meet, the seconds of compute since the one before (the step's
last stretch, after its last collective, runs into the next step's first one); :func:`sync_wait_seconds`
prices them. :func:`~.evaluate.predict` reports the sum (``TimePrediction.sync_wait``).

The ILP leaves this term out: the gap before a collective depends on the strategies of every node
since the collective before, which no per-node or per-edge term holds. It is small beside what the
ILP weighs (a few ms per step on 4 CPU ranks sharing 2 cores), and the plans it separates run
within a few percent of each other.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..decisions import Decision
from .segments import memory_segments

if TYPE_CHECKING:
    from ..param_gather import ParamGathers
    from .costgraph import CGEdge, CGNode, CostGraph
    from .evaluate import GradientSync

__all__ = ["sync_gaps", "sync_wait_seconds"]


class _Walk:
    """Seconds of compute since the ranks last met, and the gaps closed so far."""

    def __init__(self) -> None:
        self.gap = 0.0
        self.gaps: list[float] = []

    def compute(self, seconds: float) -> None:
        self.gap += seconds

    def meet(self) -> None:
        self.gaps.append(self.gap)
        self.gap = 0.0


def sync_gaps(cg: "CostGraph", choice: dict[str, int], decisions: dict[str, str], gathers: "ParamGathers",
              sync: "GradientSync", optimizer_s: float) -> list[float]:
    """Seconds of compute before each point of one step where every rank waits for the others, in
    the order the runtime reaches them: a block's parameter all-gather (forward) and gradient
    reduce-scatter (backward), a resharding that communicates, a strategy's own collective, a
    recomputed segment's collectives again, and the wait for the gradient buckets after backward.
    The optimizer step and what follows the last collective count before the first one."""
    into: dict[str, list["CGEdge"]] = {}
    for e in cg.edges:
        into.setdefault(e.dst, []).append(e)
    first_use = {g.first_use for g in gathers.groups}
    walk = _Walk()

    def reshard_into(node: "CGNode", backward: bool) -> None:
        """The resharding of the node's operands (backward: of their gradients, back): a meeting
        point where it moves bytes between ranks, compute where it is a local copy. Parameters
        gathered per block are not resharded here."""
        for e in into.get(node.name, ()):
            if (backward and not e.grad) or (e.dst_member, e.operand) in gathers.uses:
                continue
            a, b = e.src_index[choice[e.src]], e.dst_index[choice[e.dst]]
            moved, seconds = (e.nbytes_bwd, e.bwd) if backward else (e.nbytes_fwd, e.fwd)
            if moved[a, b] > 0:
                walk.meet()
            else:
                walk.compute(float(seconds[a, b]))

    def forward(node: "CGNode", gather: bool) -> None:
        s, c = choice[node.name], node.costs
        if gather and first_use & set(node.members):
            walk.meet()
        reshard_into(node, backward=False)
        walk.compute(float(c.compute_fwd[s] + c.reshard_fwd[s]))
        if c.comm_fwd[s] > 0:
            walk.meet()

    def backward(node: "CGNode") -> None:
        s, c = choice[node.name], node.costs
        walk.compute(float(c.compute_bwd[s] + c.reshard_bwd[s]))
        if c.comm_bwd[s] > 0:
            walk.meet()
        reshard_into(node, backward=True)
        if first_use & set(node.members):
            walk.meet()

    rerun_before: dict[str, tuple[list[str], str]] = {}   # a segment's last node -> its nodes, run again
    for seg in memory_segments(cg):
        decision = decisions.get(seg.name, Decision.KEEP)
        if decision in (Decision.RECOMPUTE, Decision.PARTITIONED):
            rerun_before[seg.nodes[-1]] = (seg.nodes, decision)
    for node in cg.nodes.values():
        forward(node, gather=True)
    for node in reversed(list(cg.nodes.values())):
        if node.name in rerun_before:
            names, decision = rerun_before[node.name]
            if decision == Decision.PARTITIONED:      # its checkpoints all-gathered first
                walk.meet()
            for name in names:
                forward(cg.nodes[name], gather=False)
        backward(node)
    if sync.synced:
        walk.meet()
    walk.compute(optimizer_s)
    if not walk.gaps:
        return []
    walk.gaps[0] += walk.gap
    return walk.gaps


def sync_wait_seconds(cg: "CostGraph", choice: dict[str, int], decisions: dict[str, str], gathers: "ParamGathers",
                      sync: "GradientSync", optimizer_s: float) -> float:
    """The waits beyond the collectives' prices of one step (:func:`sync_gaps` priced by the
    profile's :class:`~autoshard.hardware.SyncWait`); 0 for a profile without one."""
    table = cg.hardware.sync_wait
    if table is None:
        return 0.0
    return sum(table.seconds_after(g) for g in sync_gaps(cg, choice, decisions, gathers, sync, optimizer_s))
