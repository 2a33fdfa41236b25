"""The cost graph's reference sum: every node's and edge's costs under one full assignment added up,
with no schedule (the step itself is :func:`autoshard.solver.evaluate.predict`'s). The tests check
with it that follower merging, block aliasing and the ILP's grouped sums keep costs, and
``bench/solver_optimality.py`` that ``predict`` is this sum plus the scheduled gradient sync."""
from __future__ import annotations

from dataclasses import dataclass, field

from .costgraph import CostGraph, StrategyCosts


@dataclass
class CostBreakdown:
    """Modeled step time (seconds) and memory (bytes per device) of one full assignment."""

    compute_fwd: float = 0.0
    compute_bwd: float = 0.0
    comm_fwd: float = 0.0
    comm_bwd: float = 0.0
    reshard_fwd: float = 0.0
    reshard_bwd: float = 0.0
    optimizer: float = 0.0
    params: int = 0
    grads: int = 0
    saved: int = 0
    outputs: int = 0
    sync_bytes: int = 0                # bytes of bucketed gradient all-reduces (all mesh axes)
    saved_by_segment: dict[str | None, int] = field(default_factory=dict)

    @property
    def compute(self) -> float:
        return self.compute_fwd + self.compute_bwd

    @property
    def comm(self) -> float:
        return self.comm_fwd + self.comm_bwd

    @property
    def reshard(self) -> float:
        return self.reshard_fwd + self.reshard_bwd

    @property
    def total(self) -> float:
        """Compute + inline collectives + resharding + optimizer: the step without its bucketed
        gradient sync, which :func:`~autoshard.solver.evaluate.predict` schedules (see :mod:`.steptime`)."""
        return self.compute + self.comm + self.reshard + self.optimizer

    def __str__(self) -> str:
        ms = 1e3
        return (f"step {self.total * ms:.3f} ms = compute {self.compute * ms:.3f} + comm "
                f"{self.comm * ms:.3f} + reshard {self.reshard * ms:.3f}; memory/device: params "
                f"{self.params} B, grads {self.grads} B, saved {self.saved} B")


def reference_costs(cg: CostGraph, choice: dict[str, int]) -> CostBreakdown:
    """The reference cost of a full assignment (CGNode name -> strategy index).

    Time = sum over nodes of compute + own collectives + internal resharding (fwd and bwd)
    + sum over edges of resharding fwd/bwd. Memory per device = sums of the strategies'
    saved activations (also per segment) and outputs, and of the parameters and gradients
    in their placeholders' layouts.
    """
    _check_choice(cg, choice)
    out = CostBreakdown()
    for n in cg.nodes.values():
        c = choice[n.name]
        for f in StrategyCosts.TIME_FIELDS + StrategyCosts.MEMORY_FIELDS:
            setattr(out, f, getattr(out, f) + getattr(n.costs, f)[c].sum().item())
        saved = int(n.costs.saved[c])
        out.saved_by_segment[n.segment] = out.saved_by_segment.get(n.segment, 0) + saved
    for e in cg.edges:
        a, b = e.src_index[choice[e.src]], e.dst_index[choice[e.dst]]
        out.reshard_fwd += e.fwd[a, b].item()
        out.reshard_bwd += e.bwd[a, b].item()
    return out


def _check_choice(cg: CostGraph, choice: dict[str, int]) -> None:
    missing = [n for n in cg.nodes if n not in choice]
    if missing:
        raise KeyError(f"choice has no strategy for {len(missing)} node(s), e.g. {missing[:3]}")
    for name, c in choice.items():
        node = cg.nodes.get(name)
        if node is None:
            raise KeyError(f"choice names {name!r}, which is not a node of the cost graph")
        if not 0 <= c < len(node):
            raise IndexError(f"node {name!r} has {len(node)} strategies, choice is {c}")
