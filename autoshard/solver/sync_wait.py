"""The waits a step's collectives add where ranks drift apart between them.

Every blocking collective waits for the last rank of its group to reach it. The profile's collective
prices were timed after short slices of compute, so they hold the drift of such a slice; after a
longer stretch the ranks have drifted further (ranks sharing CPU cores are scheduled unevenly) and
the collective waits longer, by the profile's :class:`~autoshard.hardware.SyncWait` for its group
(measured by ``autoshard profile`` on each mesh axis's groups and on all devices; absent, as in the
shipped GPU profiles, it is 0). :func:`sync_gaps` walks the step as the runtime runs it and lists,
per point where a group's ranks meet, the group and the seconds of compute since its ranks last met
(on it, or on all devices; in the steady state of repeated steps, so the step's last stretch runs
into the next step's first collectives); :func:`sync_wait_seconds` prices them.
:func:`~.evaluate.predict` reports the sum (``TimePrediction.sync_wait``).

The ILP leaves this term out: the gap before a collective depends on the strategies of every node
since the collective before, which no per-node or per-edge term holds. It is small beside what the
ILP weighs (a few ms per step on 4 CPU ranks sharing 2 cores), and the plans it separates run
within a few percent of each other.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from ..comm_cost import collective_group
from ..decisions import Decision
from ..hardware import KIND_GROUPS
from ..phases import Phase
from ..reshard import reshard_plan
from .segments import checkpoint_partition_axes, memory_segments

if TYPE_CHECKING:
    from ..param_gather import ParamGathers
    from .costgraph import CGEdge, CGNode, CostGraph
    from .evaluate import GradientSync

__all__ = ["sync_gaps", "sync_wait_seconds"]

WORLD = "world"


class _Step:
    """One step as a sequence of compute (seconds) and meetings (a group name), replayed to the
    gaps before each meeting."""

    def __init__(self, mesh_shape: tuple[int, ...]) -> None:
        self.mesh_shape = mesh_shape
        self.events: list[float | str] = []

    def compute(self, seconds: float) -> None:
        self.events.append(float(seconds))

    def meet(self, axes: Iterable[int]) -> None:
        group = collective_group(tuple(axes), self.mesh_shape)
        if group is not None:
            self.events.append(group)

    def gaps(self) -> list[tuple[str, float]]:
        """(group, seconds of compute since its ranks last met) per meeting of the second of two
        steps run back to back: a meeting on all devices brings every group together, one on a mesh
        axis's groups only those."""
        since = dict.fromkeys(KIND_GROUPS, 0.0)
        out: list[tuple[str, float]] = []
        for second in (False, True):
            for event in self.events:
                if isinstance(event, float):
                    since = {g: t + event for g, t in since.items()}
                    continue
                if second:
                    out.append((event, since[event]))
                for g in (KIND_GROUPS if event == WORLD else (event,)):
                    since[g] = 0.0
        return out



def sync_gaps(cg: "CostGraph", choice: dict[str, int], decisions: dict[str, str], gathers: "ParamGathers",
              sync: "GradientSync", optimizer_s: float) -> list[tuple[str, float]]:
    """The group and the seconds of compute since its ranks last met, for each point of a step
    where a group's ranks wait for each other, in the order the runtime reaches them: a block's
    parameter all-gather (forward) and gradient reduce-scatter (backward), a resharding's
    collectives, a strategy's own collectives (those the runtime runs: not a gradient all-reduce left
    to the buckets or shared with another consumer), a recomputed segment's collectives again, and the
    wait for the gradient buckets after backward. The optimizer step and what follows the last
    collective run into the next step's first ones."""
    mesh_shape = tuple(cg.mesh.shape)
    into: dict[str, list["CGEdge"]] = {}
    for e in cg.edges:
        into.setdefault(e.dst, []).append(e)
    gathered_at: dict[str, list[tuple[int, ...]]] = {}
    for g in gathers.groups:
        gathered_at.setdefault(g.first_use, []).append(g.axes)
    step = _Step(mesh_shape)

    def reshard_into(node: "CGNode", backward: bool) -> None:
        """The resharding of the node's operands (backward: of their gradients, back): its
        collectives where it moves bytes between ranks, compute where it is a local copy.
        Parameters gathered per block are not resharded here."""
        for e in into.get(node.name, ()):
            if (backward and not e.grad) or (e.dst_member, e.operand) in gathers.uses:
                continue
            a, b = e.src_index[choice[e.src]], e.dst_index[choice[e.dst]]
            moved, seconds = (e.nbytes_bwd, e.bwd) if backward else (e.nbytes_fwd, e.fwd)
            if moved[a, b] == 0:
                step.compute(float(seconds[a, b]))
                continue
            src, dst = (e.dst_specs[b], e.src_specs[a]) if backward else (e.src_specs[a], e.dst_specs[b])
            plan = reshard_plan(src, dst, e.tensor.shape, e.tensor.dtype.itemsize, mesh_shape, cg.hardware,
                                str(e.tensor.dtype))
            for c in plan.collectives():
                step.meet(c.axes)

    def own_collectives(node: "CGNode", phase: Phase) -> None:
        s = choice[node.name]
        for member in node.members:
            for c in node.member_strategy(member, s).comm:
                if c.phase == phase and not c.bucketed and not _skipped(member, c.operand, sync):
                    step.meet(c.axes)

    def block_collectives(node: "CGNode") -> None:
        for member in node.members:
            for axes in gathered_at.get(member, ()):
                step.meet(axes)

    def forward(node: "CGNode", gather: bool) -> None:
        s, c = choice[node.name], node.costs
        if gather:
            block_collectives(node)
        reshard_into(node, backward=False)
        step.compute(c.compute_fwd[s] + c.reshard_fwd[s])
        own_collectives(node, Phase.FWD)

    def backward(node: "CGNode") -> None:
        s, c = choice[node.name], node.costs
        step.compute(c.compute_bwd[s] + c.reshard_bwd[s])
        own_collectives(node, Phase.BWD)
        reshard_into(node, backward=True)
        block_collectives(node)

    rerun_before: dict[str, tuple[list[str], str, list[tuple[int, ...]]]] = {}  # last node -> run again
    for seg in memory_segments(cg):
        decision = decisions.get(seg.name, Decision.KEEP)
        if decision in (Decision.RECOMPUTE, Decision.PARTITIONED):
            gathered = [checkpoint_partition_axes(e, e.src_specs[e.src_index[choice[e.src]]], mesh_shape)
                        for e in seg.ckpt_edges] if decision == Decision.PARTITIONED else []
            rerun_before[seg.nodes[-1]] = (seg.nodes, decision, gathered)
    for node in cg.nodes.values():
        forward(node, gather=True)
    for node in reversed(list(cg.nodes.values())):
        if node.name in rerun_before:
            names, decision, gathered = rerun_before[node.name]
            for axes in gathered:                   # a partitioned segment's checkpoints, gathered first
                step.meet(axes)
            for name in names:
                forward(cg.nodes[name], gather=False)
        backward(node)
    for axes in dict.fromkeys(g.axes for g in sync.synced):
        step.meet(axes)
    step.compute(optimizer_s)
    return step.gaps()


def _skipped(member: str, operand: str, sync: "GradientSync") -> bool:
    """Whether a strategy's inline gradient all-reduce on ``operand`` (``"in<j>"``) does not run: left
    to the buckets or shared with an earlier consumer of the value (``sync.skipped``)."""
    return operand.startswith("in") and (member, int(operand[2:])) in sync.skipped


def sync_wait_seconds(cg: "CostGraph", choice: dict[str, int], decisions: dict[str, str], gathers: "ParamGathers",
                      sync: "GradientSync", optimizer_s: float) -> float:
    """The waits beyond the collectives' prices of one step (:func:`sync_gaps`, each priced by the
    profile's :class:`~autoshard.hardware.SyncWait` for its group); 0 for a profile without one."""
    hw = cg.hardware
    if not hw.sync_wait:
        return 0.0
    return sum(hw.sync_wait_seconds(group, gap)
               for group, gap in sync_gaps(cg, choice, decisions, gathers, sync, optimizer_s))
