"""One ILP: a sharding strategy per node AND an activation-memory decision per segment.

Variables
  x[g, s]      binary, one-hot per decision group g (a node, or all aliased copies of one)
  y[e, a, b]   continuous in [0, 1] on the distinct-spec grid of an edge group: the product of the
               producer choosing output spec a and the consumer input spec b (the marginals tie it
               to x, and for one-hot x the only feasible y is that product)
  n[c, k]      integer in [0, |c|] per class c of identical segments (same decision groups and
               checkpoint edges, so the same costs for every x; without aliasing each segment is its
               own class and n is binary): how many of its segments take memory decision k, over
               keep / recompute / offload / partitioned / selective, summing to |c|. Which segments of a class
               take which decision cannot change cost or memory, so counts replace per-segment
               binaries and remove that symmetry altogether (readout hands the decisions out along
               the block sequence in READOUT_ORDER, which lowers the real peak below the bound).
Objective (seconds per training step): node compute + collectives, resharding on edges (out of
  parameters as :mod:`.param_edges` prices them: a parameter the runtime gathers with its block
  pays bandwidth per edge and the collectives' latency once per block), recomputation (the segment's forward again, or its runs' forward when selective), offload transfers that the segment's compute
  cannot hide, and the all-gather of partitioned checkpoints.
Memory (bytes per device): static = parameters + gradients + optimizer state + the copies of
  parameters read larger than stored (gathered), held until backward; activations (held
  at the start of backward) = activations saved outside segments, + per segment: saved activations
  if kept, its checkpointed input if recomputed (1/n of it if partitioned over the n devices
  holding copies), nothing if offloaded, if selective (:mod:`.selective`: only its memory-bound
  runs recomputed) its saved activations less the runs' plus the runs' stored inputs; working
  set = the saved activations of the largest segment that is recomputed or offloaded (brought back
  in its backward), or of the largest run of a selective segment. The backward frees the
  activations saved after the last segment ("post-segment": unsegmented nodes later in graph order
  than every segment's nodes, e.g. final norm, LM head, loss) before it reaches any segment, so
  peak <= static + max(activations, activations - post_segment + working_set): two rows, both
  linear, each bounded by the budget (see :func:`post_segment_nodes`). The bound counts every
  segment as holding its activations while the largest working set is rebuilt; in fact a
  segment's backward runs after those of every later segment, so only the earlier ones still hold
  theirs. The counts cannot say where a decision sits, so the ILP keeps the bound, the readout puts
  the largest rebuilds on the earliest blocks (READOUT_ORDER), and :func:`predict` reports the
  peak of that placement (``MemoryPrediction.peak``, at most ``.bound``).
Offload: with device memory separate from the host (``HardwareProfile.device_memory_separate``,
  GPUs), the device->host copy of a segment's saved activations A runs on a side stream during
  the rest of the forward and the host->device copy during the backward, so it costs
  max(0, A/host_bw - F) + max(0, A/host_bw - B) (F, B: the segment's forward / backward time) and
  frees A until the segment's backward (then counted in the working set). Without separate device
  memory (CPU ranks, ``cpu-gloo``) the "host" IS the device memory: offloading frees nothing (A
  stays resident, no working set) and the copy is on the critical path (A/host_bw in the forward;
  restoring hands the host copy back without a copy). Such an offload is never better than keep,
  so the solver is not offered it (it would only add variables); a forced one (``fixed_decision``
  or ``decisions=("offload",)``, or a plan's segments priced by :func:`predict`) is priced that way.
Ties: every segment not kept adds ``KEEP_TIE_US`` (a nanosecond; twice that for partitioned;
  growing to twice that along the block sequence, so that equal-cost rebuilds go to the earliest
  blocks, whose rebuild peaks lowest) to
  the ILP objective, so among plans of equal modeled time the solver keeps activations, and
  recomputes plainly rather than partitioned where both cost the same (e.g. with no memory pressure an
  offload the compute hides completely is not chosen over keep); it is left out of the reported
  objective.

Products of a count n (integer in [0, N]) with a linear function of the strategy choices
E = sum_g sum_s c[g, s] x[g, s] are linearised per decision group, in disaggregated form:
K[g, s] = n * x[g, s] with sum_s K[g, s] = n and 0 <= K[g, s] <= N x[g, s], so n * E =
sum c[g, s] K[g, s]. At integer points K is unique (exact whatever the sign of the term), and per
group it is the convex hull of the product. The decision counts of one class share one such
disaggregation (:func:`_decision_products`): sum_k K[k, g, s] = N x[g, s] over the decisions k,
since the counts sum to N; per group that is the convex hull of (decision, strategy) pairs, where
separate bounds K[k, g, s] <= N x[g, s] let keep and recompute both sit on one strategy. The
earlier big-M form z >= E - U (1 - b) let a fractional b shed most of E in the LP relaxation (root
gaps of ~12% under tight budgets, 20 s solves for Llama-70B at 80 GiB).

The working set is a max over non-kept segments: working >= u_c * saved_c per class (u_c: some
segment of c is not kept), plus the designated-segment inequality of _designated_working_set,
which makes the LP pay for whole segments once the budget rules out keeping every segment.

Without aliasing, identical blocks carry their own variables and any plan has equal-cost copies
with block configurations swapped; :mod:`.symmetry` adds rows that order the blocks' decisions
where their boundaries agree (``SolverOptions.break_symmetry``), so branch-and-bound proves one copy.

Units inside the ILP are microseconds and GiB, so that coefficients stay within a few orders of
magnitude of 1 (byte-valued big-M rows next to binaries make HiGHS report false infeasibility);
everything outside is seconds and bytes.
"""
from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, NamedTuple

import numpy as np
import pulp

from ..comm import collective_cost
from ..grad_reduction import Axes, GradReduction, grad_nodes, plan_gradient_reduction
from ..param_gather import ParamGathers, gathered_bytes, param_uses, plan_param_gathers
from ..decisions import DECISIONS
from ..errors import InfeasibleBudgetError
from ..specs import ShardSpec, replicated_axes
from ..strategy import BWD, Strategy
from ..units import format_bytes
from .costgraph import SYNC_AXES, CGEdge, CGNode, CostGraph
from .param_edges import chosen_param_edges, gather_latency, param_edge_prices
from .selective import RecomputeRun, recompute_runs
from .steptime import SyncedGradient, SyncPricing, exposed_grad_sync, overlap_fraction
from .symmetry import order_identical_blocks

if TYPE_CHECKING:
    from torch import fx

READOUT_ORDER = ("recompute", "partitioned", "offload", "selective", "keep")
"""Where decisions of a class of identical blocks go along the block sequence: the largest
rebuilds first. A block's saved activations come back in its backward while only the blocks before
it still hold theirs, so the earliest blocks rebuild with the least memory live."""
T = 1e6          # ILP time unit: microseconds per second
M = float(2**30) # ILP memory unit: bytes per GiB
KEEP_TIE_US = 1e-3   # ILP objective (us) per segment not kept: breaks exact ties toward keep
RESHARD_PENALTY = 1e3  # solve(reshard=False): edge resharding weighs this much more than its time

Reshard = bool | frozenset[str]
"""Where edges may reshard (``solve(reshard=...)``): True everywhere; False nowhere but into the
graph's outputs (penalised); a set of CGNode names: only out of those nodes and into the outputs."""
# ... and a partitioned checkpoint ties with recompute where nothing is replicated (a 1x1 mesh):
# prefer the plain checkpoint then.
_TIE_WEIGHT = {"recompute": 1.0, "offload": 1.0, "partitioned": 2.0, "selective": 1.0}


@dataclass(frozen=True)
class SolverOptions:
    memory_budget: int | None = None          # bytes per device; None = unconstrained
    optimizer_bytes_per_param: float = 8.0    # AdamW fp32: exp_avg + exp_avg_sq
    decisions: tuple[str, ...] = DECISIONS    # memory decisions the solver may use
    solver: str = "highs"                     # "highs" (highspy) or "cbc"
    time_limit: float = 60.0
    gap_rel: float = 0.0
    threads: int | None = None
    fixed_decision: str | None = None         # force one memory decision on every segment (baselines)
    break_symmetry: bool = True               # order decisions of identical unaliased blocks (.symmetry)


@dataclass
class MemoryPrediction:
    """Bytes per device at the training peak."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    param_copies: float = 0.0     # parameters read larger than stored (gathered), held until backward
    activations: float = 0.0      # kept activations incl. checkpoints
    working_set: float = 0.0      # largest recomputed/offloaded segment brought back
    post_segment: float = 0.0     # part of activations saved after the last segment: freed by the
                                  # backward before any segment's working set is brought back
    backward_peak: float = 0.0    # activations live at the worst rebuild in backward, given where
                                  # each decision sits in the block sequence (0: nothing rebuilt)

    @property
    def bound(self) -> float:
        """The position-free peak the ILP bounds by the budget: every segment's held activations
        are counted as live while the largest working set is rebuilt."""
        return self.static + max(self.activations, self.activations - self.post_segment + self.working_set)

    @property
    def peak(self) -> float:
        """The modeled peak: the end of forward, or the worst rebuild in backward, when a segment's
        working set comes back while only the segments before it still hold activations (at most
        :attr:`bound`)."""
        return self.static + max(self.activations, self.backward_peak)

    @property
    def static(self) -> float:
        """What is held for the whole step: parameters, gradients, optimizer state, and the
        parameter copies read until backward."""
        return self.params + self.grads + self.optimizer + self.param_copies

    def to_dict(self) -> dict:
        return {**self.__dict__, "peak": self.peak, "bound": self.bound}


@dataclass
class TimePrediction:
    """Seconds of one training step, by kind."""

    compute: float = 0.0
    comm: float = 0.0
    reshard: float = 0.0
    recompute: float = 0.0
    offload: float = 0.0
    grad_sync: float = 0.0        # bucketed gradient all-reduces the step waits for (not hidden)
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        return (self.compute + self.comm + self.reshard + self.recompute + self.offload + self.grad_sync
                + self.optimizer)

    def to_dict(self) -> dict:
        return {**self.__dict__, "total": self.total}


@dataclass
class Solution:
    choice: dict[str, int]                     # CGNode name -> strategy index
    decisions: dict[str, str]                  # segment -> memory decision
    time: TimePrediction
    memory: MemoryPrediction
    status: str
    objective: float
    build_seconds: float
    solve_seconds: float
    n_variables: int
    n_constraints: int
    solver: str
    stats: dict = field(default_factory=dict)
    bound: float | None = None     # proven lower bound on the objective (seconds), when the solver reports one

    @property
    def gap(self) -> float | None:
        """Relative distance to the proven bound: 0 when optimal; how far a time-limited solve may be off."""
        if self.bound is None or self.objective <= 0:
            return None
        return max(0.0, (self.objective - self.bound) / self.objective)


# -- linear expressions over strategy choices ------------------------------------------------------------

class _Model:
    """The PuLP problem plus helpers to express per-strategy quantities linearly."""

    def __init__(self, cg: CostGraph, options: SolverOptions, sense=pulp.LpMinimize,
                 allowed: dict[str, Iterable[int]] | None = None, reshard: Reshard = True):
        self.cg = cg
        self.options = options
        self.reshard = reshard       # see Reshard: where resharding on edges is not penalised
        self.unreported: list = []   # objective terms left out of the reported objective (tie-breaks)
        self.prob = pulp.LpProblem("autoshard", sense)
        self.x: dict[str, list] = {}              # group key -> list of binaries (or None if fixed)
        self.group_of: dict[str, str] = {}        # CGNode name -> group key
        self.param_prices = param_edge_prices(cg)  # id(edge) -> ParamEdgePrice
        self.pairs: dict[int, dict[tuple[int, int], object]] = {}   # id(edge) -> (a, b) -> expression
        self._n = 0
        for g in cg.variable_groups():
            for node in g.nodes:
                self.group_of[node] = g.key
            if g.n_strategies == 1:
                self.x[g.key] = [1]
            else:
                vs = [self.prob.add_variable(f"x{self._id()}_{s}", cat=pulp.LpBinary) for s in range(g.n_strategies)]
                self.prob += pulp.lpSum(vs) == 1
                self.x[g.key] = vs
        for node, indices in (allowed or {}).items():
            keep = set(indices)
            xs = self.x[self.group_of[node]]
            if not keep:
                raise ValueError(f"restriction leaves node {node!r} without any strategy")
            if len(xs) > 1:
                for s, v in enumerate(xs):
                    if s not in keep:
                        v.upBound = 0
            elif 0 not in keep:
                raise ValueError(f"restriction forbids the only strategy of node {node!r}")

    def _id(self) -> int:
        self._n += 1
        return self._n

    def var(self, low: float | None = 0.0, up: float | None = None, cat=pulp.LpContinuous, name: str = "v"):
        return self.prob.add_variable(f"{name}{self._id()}", low, up, cat=cat)

    def pair(self, e: CGEdge, a: int, b: int):
        """The 0/1 expression 'edge ``e`` carries src spec ``a`` into dst spec ``b``': a marginal
        where one side has one spec, else a transport variable ``y[a, b]`` (made once per edge,
        its rows and columns summing to the two marginals)."""
        grid = self.pairs.get(id(e))
        if grid is None:
            grid = self.pairs[id(e)] = self._pair_grid(e)
        return grid[int(a), int(b)]

    def _pair_grid(self, e: CGEdge) -> dict[tuple[int, int], object]:
        src_marg = _marginals(self, e.src, e.src_index, len(e.src_specs))
        dst_marg = _marginals(self, e.dst, e.dst_index, len(e.dst_specs))
        if len(e.src_specs) == 1:
            return {(0, b): dst_marg[b] for b in range(len(e.dst_specs))}
        if len(e.dst_specs) == 1:
            return {(a, 0): src_marg[a] for a in range(len(e.src_specs))}
        y = {(a, b): self.var(0.0, 1.0, name="y") for a in range(len(e.src_specs)) for b in range(len(e.dst_specs))}
        for a in range(len(e.src_specs)):
            self.prob += pulp.lpSum(y[a, b] for b in range(len(e.dst_specs))) == src_marg[a]
        for b in range(len(e.dst_specs)):
            self.prob += pulp.lpSum(y[a, b] for a in range(len(e.src_specs))) == dst_marg[b]
        return y

    def choice_expr(self, node: str, values: np.ndarray) -> pulp.LpAffineExpression:
        """sum_s values[s] * x[node, s] (a constant for fixed nodes)."""
        xs = self.x[self.group_of[node]]
        if len(xs) == 1:
            return pulp.LpAffineExpression(constant=float(values[0]))
        return pulp.LpAffineExpression([(v, float(c)) for v, c in zip(xs, values) if c != 0.0])


# -- the formulation ------------------------------------------------------------------------------------

def _node_time_terms(m: _Model) -> list:
    """Objective terms of node strategies: compute, own collectives, resharding inside merged nodes."""
    terms = []
    for g in m.cg.variable_groups():
        node = m.cg.nodes[g.nodes[0]]
        per_strategy = node.costs.time()
        if np.any(per_strategy):
            terms.append(g.count * m.choice_expr(node.name, per_strategy * T))
    return terms


def _grad_sync_terms(m: _Model) -> list:
    """The exposed bucketed gradient sync, linearised (see :mod:`.steptime`): per mesh-axis set,
    bytes at the bucket rate plus one bucket latency when any gradient syncs there; exposed >=
    that sum less ``overlap`` times the backward's time, and >= the bucket latencies."""
    cg = m.cg
    mesh_shape, hw = cg.mesh.shape, cg.hardware
    sync, latencies = [], []
    for k, axes in enumerate(SYNC_AXES):
        price = SyncPricing.of(axes, mesh_shape, hw)
        per_byte = price.seconds_per_byte() * T
        seconds, any_sync = [], None
        for g in cg.variable_groups():
            node = cg.nodes[g.nodes[0]]
            column = node.costs.sync_bytes[:, k]
            if not np.any(column):
                continue
            seconds.append(g.count * m.choice_expr(node.name, column * per_byte))
            any_sync = any_sync if any_sync is not None else m.var(0.0, 1.0, name="sync_any")
            xs = m.x[m.group_of[node.name]]
            for v, b in zip(xs, column):
                if b:
                    m.prob += any_sync >= v
        if any_sync is not None:
            sync.append(pulp.lpSum(seconds) + price.latency * T * any_sync)
            latencies.append(price.latency * T * any_sync)
    if not sync:
        return []
    exposed = m.var(name="sync_exposed")
    eta = overlap_fraction(hw)
    backward = pulp.lpSum(g.count * m.choice_expr(g.nodes[0], _backward_time(cg.nodes[g.nodes[0]].costs) * T)
                          for g in cg.variable_groups()) if eta > 0 else 0.0
    m.prob += exposed >= pulp.lpSum(sync) - eta * backward
    m.prob += exposed >= pulp.lpSum(latencies)
    return [exposed]


def _backward_time(c) -> np.ndarray:
    """A node's time on the compute stream in backward."""
    return c.compute_bwd + c.comm_bwd + c.reshard_bwd


def _forward_time(c) -> np.ndarray:
    """What recomputing a node costs: its forward compute, collectives and internal resharding."""
    return c.compute_fwd + c.comm_fwd + c.reshard_fwd


def _edge_time_terms(m: _Model) -> list:
    """Resharding on edges; out of parameters as :mod:`.param_edges` prices it (per-block
    gathers: bandwidth per edge, latency once per block and gather axes)."""
    terms = []
    gathers: dict[tuple[str, Axes], set[tuple[int, int, int]]] = {}
    for eg in m.cg.edge_groups():
        e = eg.edge
        price = m.param_prices.get(id(e))
        cost = (price.seconds if price is not None else e.fwd + (e.bwd if e.grad else 0.0)) * T
        if price is not None:
            for a, b in zip(*np.nonzero(price.gather_axes != None)):  # noqa: E711 (object array)
                for block in price.blocks:
                    gathers.setdefault((block, price.gather_axes[a, b]), set()).add((id(e), int(a), int(b)))
            terms += _inline_grad_terms(m, eg.count, e, price)
        if not np.any(cost):
            continue
        term = eg.count * pulp.lpSum(float(cost[a, b]) * m.pair(e, a, b) for a, b in zip(*np.nonzero(cost)))
        terms.append(term)
        if _penalised(m.reshard, e, m.cg):
            m.unreported.append((RESHARD_PENALTY - 1.0) * term)
    return terms + _gather_latency_terms(m, gathers)


def _inline_grad_terms(m: _Model, count: int, e: CGEdge, price) -> list:
    """The consumer's gradient all-reduce of a parameter read resharded runs inline: ``w >= x_c +
    resharded - 1`` per consumer strategy ``c`` that has one, costing ``price.inline[c]``."""
    if not np.any(price.inline) or not np.any(price.resharded):
        return []
    resharded = pulp.lpSum(m.pair(e, a, b) for a, b in zip(*np.nonzero(price.resharded)))
    xs = m.x[m.group_of[e.dst]]
    if len(xs) == 1:
        return [count * float(price.inline[0]) * T * resharded]
    terms = []
    for c, seconds in enumerate(price.inline):
        if seconds > 0:
            w = m.var(0.0, 1.0, name="inline")
            m.prob += w >= xs[c] + resharded - 1
            terms.append(count * float(seconds) * T * w)
    return terms


def _gather_latency_terms(m: _Model, gathers: dict[tuple[str, Axes], set[tuple[int, int, int]]]) -> list:
    """One gather latency per (block, axes) with a gatherable pair (edge id, a, b) chosen. Blocks
    whose edges share their pair variables (identical aliased blocks) share one 0..1 variable,
    counted once per block."""
    atoms: dict[tuple, list[str]] = {}
    for (block, axes), pairs in gathers.items():
        atoms.setdefault((axes, frozenset(pairs)), []).append(block)
    terms = []
    for (axes, pairs), blocks in atoms.items():
        z = m.var(0.0, 1.0, name="gather")
        for edge, a, b in pairs:
            m.prob += z >= m.pairs[edge][a, b]
        terms.append(len(blocks) * gather_latency(axes, m.cg.mesh.shape, m.cg.hardware) * T * z)
    return terms


def _held_param_copies(m: _Model) -> pulp.LpAffineExpression:
    """GiB per device of parameter copies read larger than stored, held until backward."""
    out = []
    for eg in m.cg.edge_groups():
        price = m.param_prices.get(id(eg.edge))
        if price is not None and np.any(price.held):
            out += [eg.count * float(price.held[a, b]) / M * m.pair(eg.edge, a, b)
                    for a, b in zip(*np.nonzero(price.held))]
    return pulp.lpSum(out)


def _penalised(reshard: Reshard, e: CGEdge, cg: CostGraph) -> bool:
    """Whether resharding on edge ``e`` weighs ``RESHARD_PENALTY`` times its time (see Reshard)."""
    if reshard is True or cg.nodes[e.dst].kind == "output":
        return False
    return reshard is False or e.src not in reshard


def _marginals(m: _Model, node: str, index: np.ndarray, n: int) -> list[pulp.LpAffineExpression]:
    """For each distinct spec, the (0/1) expression 'the node chose a strategy with this spec'."""
    xs = m.x[m.group_of[node]]
    out = [pulp.LpAffineExpression() for _ in range(n)]
    if len(xs) == 1:
        out[int(index[0])] = pulp.LpAffineExpression(constant=1.0)
        return out
    for s, a in enumerate(index):
        out[int(a)] += xs[s]
    return out


@dataclass
class MemorySegment:
    name: str
    nodes: list[str]
    saved: np.ndarray | None = None
    ckpt_edges: list[CGEdge] = field(default_factory=list)
    runs: list[RecomputeRun] = field(default_factory=list)    # what 'selective' recomputes


def memory_segments(cg: CostGraph) -> list[MemorySegment]:
    """The segments that get a memory decision, with the edges whose tensors a checkpoint stores
    (inputs from outside the segment that are not parameters and not shared by several segments)
    and the runs a selective recomputation re-runs (:func:`~.selective.recompute_runs`)."""
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
        if dst.segment is None or src.segment == dst.segment or src.kind == "placeholder" and not _is_input(cg, src):
            continue
        key = (e.src, e.src_member, e.src_output)
        # inputs shared by several segments (masks, rotary tables) stay resident anyway
        if len(consumers_by_src[key]) > 1 and src.segment is None:
            continue
        if (dst.segment, key) in seen:
            continue
        seen.add((dst.segment, key))
        by_seg[dst.segment].ckpt_edges.append(e)
    for name, runs in recompute_runs(cg).items():
        by_seg[name].runs = runs
    return list(by_seg.values())


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


def _spec_bytes(e: CGEdge, mesh_shape) -> np.ndarray:
    item = e.tensor.dtype.itemsize
    return np.array([s.local_numel(e.tensor.shape, mesh_shape) * item for s in e.src_specs], dtype=float)


def _memory_and_recompute(m: _Model, objective_terms: list,
                          budget: float | None) -> tuple[list[pulp.LpAffineExpression], dict]:
    """Add memory expressions and segment decisions; returns (peak terms, handles for readout): the
    peak is the max of the terms, static + activations and static + activations - post_segment +
    working set (one term, static + activations + working set, when nothing is saved after the
    last segment).

    ``budget`` (bytes) is the bound the caller puts on the peak, or None when it puts none; it only
    serves to prove that some segment cannot be kept (see :func:`_designated_working_set`)."""
    static, nonseg_act, post_act = _static_and_unsegmented_memory(m)
    allowed = _allowed_decisions(m.options, m.cg.hardware.device_memory_separate)
    working = m.var(name="W")
    keep_all = static + nonseg_act           # the memory of keeping every segment
    seg_act, classes, not_kept = [], [], []
    segment_forms: dict[str, _SegmentForms] = {}
    for segs in _segment_classes(m, memory_segments(m.cg)):
        counts, memory, time_terms, bounds, forms = _class_decisions(m, segs, allowed, working)
        seg_act += memory
        objective_terms += time_terms
        classes.append(([s.name for s in segs], counts))
        keep_all = keep_all + forms.saved.scaled(len(segs))
        segment_forms[segs[0].name] = forms
        not_kept += bounds
    must_drop = budget is not None and keep_all.lower(m) > budget / M + 1e-6
    _designated_working_set(m, not_kept, working, must_drop)
    held = static.expr(m) + _held_param_copies(m) + nonseg_act.expr(m) + pulp.lpSum(seg_act)
    if post_act.upper() <= 0:
        peaks = [held + working]
    else:
        peaks = [held, held - post_act.expr(m) + working]
    return peaks, {"classes": classes, "allowed": allowed, "working": working, "static": static.expr(m),
                   "segment_forms": segment_forms}


def _allowed_decisions(options: SolverOptions, device_memory_separate: bool) -> list[str]:
    """The memory decisions the ILP chooses among: ``fixed_decision`` alone, else ``decisions``
    in DECISIONS order, less offload when device memory is host memory (it frees nothing and
    only adds a copy, so keep dominates it) unless offload is all that is left."""
    if options.fixed_decision:
        return [options.fixed_decision]
    allowed = [d for d in DECISIONS if d in options.decisions]
    if not device_memory_separate and len(allowed) > 1:
        allowed = [d for d in allowed if d != "offload"]
    return allowed


def _static_and_unsegmented_memory(m: _Model) -> tuple["_Form", "_Form", "_Form"]:
    """Parameters + gradients + optimizer state, activations saved outside segments, and the part
    of those saved after the last segment (:func:`post_segment_nodes`), in GiB."""
    cg, opts = m.cg, m.options
    post = post_segment_nodes(cg)
    static, nonseg_act, post_act = _Form(), _Form(), _Form()
    for g in cg.variable_groups():
        node = cg.nodes[g.nodes[0]]
        c = node.costs
        opt_state = np.zeros_like(c.params)
        if node.kind == "placeholder" and np.any(c.params):
            item = cg.graph.tensor_meta(node.members[0]).dtype.itemsize
            opt_state = c.params / item * opts.optimizer_bytes_per_param
        if np.any(c.params + c.grads + opt_state):
            static.add(g.key, g.count * (c.params + c.grads + opt_state) / M)
        if node.segment is None and np.any(c.saved):
            nonseg_act.add(g.key, g.count * c.saved / M)
            n_post = sum(n in post for n in g.nodes)
            if n_post:
                post_act.add(g.key, n_post * c.saved / M)
    return static, nonseg_act, post_act


@dataclass
class _Form:
    """A linear function of the strategy choices, ``constant + sum_g sum_s coef[g][s] * x[g, s]``,
    kept per decision group so that its product with a decision count can be linearised group by
    group (see :func:`_products`)."""

    constant: float = 0.0
    coef: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, group: str, values: np.ndarray) -> None:
        if len(values) == 1:                      # a group with one strategy: a constant
            self.constant += float(values[0])
            return
        values = np.asarray(values, dtype=float)
        self.coef[group] = values if group not in self.coef else self.coef[group] + values

    def __add__(self, other: "_Form") -> "_Form":
        out = _Form(self.constant, dict(self.coef))
        for g, v in other.coef.items():
            out.add(g, v)
        out.constant += other.constant
        return out

    def scaled(self, factor: float) -> "_Form":
        return _Form(self.constant * factor, {g: v * factor for g, v in self.coef.items()})

    def upper(self) -> float:
        return self.constant + sum(float(np.max(v)) for v in self.coef.values())

    def lower(self, m: _Model) -> float:
        """The minimum over the strategies each group may still take (restrictions excluded)."""
        return self.constant + sum(min(float(c) for x, c in zip(m.x[g], v) if x.upBound != 0)
                                   for g, v in self.coef.items())

    def expr(self, m: _Model) -> pulp.LpAffineExpression:
        return pulp.LpAffineExpression([(x, float(c)) for g, v in self.coef.items()
                                        for x, c in zip(m.x[g], v) if c != 0.0], constant=self.constant)


@dataclass
class _SegmentForms:
    """A segment's linear quantities (ILP units): saved activations, forward (recompute) and
    backward compute time, its checkpoint in full and partitioned form, and the all-gather time of
    a partitioned checkpoint; under selective recomputation, what stays held (saved activations
    outside the runs, and the runs' stored inputs), the runs' forward time and each run's saved
    activations (one is brought back at a time)."""

    saved: _Form
    fwd: _Form
    bwd: _Form
    ckpt: _Form
    ckpt_part: _Form
    gather: _Form
    selective_held: _Form = field(default_factory=_Form)
    selective_fwd: _Form = field(default_factory=_Form)
    run_saved: list[_Form] = field(default_factory=list)


def _segment_forms(m: _Model, seg: MemorySegment) -> _SegmentForms:
    cg, mesh_shape, hw = m.cg, m.cg.mesh.shape, m.cg.hardware
    f = _SegmentForms(*(_Form() for _ in range(6)))
    for n in seg.nodes:
        c, g = cg.nodes[n].costs, m.group_of[n]
        f.saved.add(g, c.saved / M)
        f.fwd.add(g, _forward_time(c) * T)
        f.bwd.add(g, c.compute_bwd * T)
    for e in seg.ckpt_edges:
        full_bytes = _spec_bytes(e, mesh_shape)
        axes = [replicated_axes(s, mesh_shape) for s in e.src_specs]
        full = full_bytes / M
        part = full / np.array([math.prod(mesh_shape[a] for a in ax) for ax in axes], dtype=float)
        gather = T * np.array([collective_cost("all_gather", b, ax, mesh_shape, hw) for b, ax in zip(full_bytes, axes)])
        g, index = m.group_of[e.src], np.asarray(e.src_index)   # per distinct spec -> per strategy
        f.ckpt.add(g, full[index])
        f.ckpt_part.add(g, part[index])
        f.gather.add(g, gather[index])
    if seg.runs:
        f.selective_held = f.saved + _Form()
        for run in seg.runs:
            saved = _Form()
            for node, values in run.saved.items():
                saved.add(m.group_of[node], values / M)
                f.selective_held.add(m.group_of[node], -values / M)
            for node, values in run.fwd.items():
                f.selective_fwd.add(m.group_of[node], values * T)
            for node, values in run.stored.items():
                f.selective_held.add(m.group_of[node], values / M)
            f.run_saved.append(saved)
    return f


def _segment_classes(m: _Model, segments: list[MemorySegment]) -> list[list[MemorySegment]]:
    """Segments grouped by :func:`_segment_class`, each group in block order."""
    classes: dict[tuple, list[MemorySegment]] = {}
    for seg in segments:
        classes.setdefault(_segment_class(m, seg), []).append(seg)
    return list(classes.values())


def _segment_class(m: _Model, seg: MemorySegment) -> tuple:
    """Segments with equal keys have identical costs for every assignment of the shared variables."""
    nodes = tuple(m.group_of[n] for n in seg.nodes)
    ckpt = tuple((m.group_of[e.src], m.cg.nodes[e.src].members.index(e.src_member), e.src_output,
                  m.group_of[e.dst], e.operand) for e in seg.ckpt_edges)
    return nodes, ckpt


def _decision_counts(m: _Model, n: int, allowed: list[str]) -> dict[str, object]:
    """How many of a class's ``n`` segments take each decision: integers summing to ``n`` (binaries
    when n == 1), or the constant ``n`` when only one decision is allowed."""
    if len(allowed) == 1:
        return {allowed[0]: n}
    cat = pulp.LpBinary if n == 1 else pulp.LpInteger
    counts = {k: m.var(0, n, cat, name=f"n_{k}_") for k in allowed}
    m.prob += pulp.lpSum(counts.values()) == n
    return counts


def _class_decisions(m: _Model, segs: list[MemorySegment], allowed: list[str],
                     working) -> tuple[dict, list, list, list[tuple], _SegmentForms]:
    """Decision counts of one class of identical segments, with their memory (GiB) and time (us)
    terms. Also bounds the working set ``working`` by what a segment of the class brings back in
    its backward (all its saved activations when recomputed, partitioned or offloaded; one run's
    when selective), and returns those bounds as (u, form) pairs, u the 0/1 indicator 'some
    segment of the class takes such a decision'; last, the forms of its first segment."""
    n, f = len(segs), _segment_forms(m, segs[0])
    if not f.run_saved and "selective" in allowed:   # nothing a selective recomputation could free here
        if allowed == ["selective"]:
            raise ValueError(f"segment {segs[0].name!r} has no memory-bound run worth recomputing, so it "
                             "cannot be selective; fix another decision or let the solver choose")
        allowed = [k for k in allowed if k != "selective"]
    counts = _decision_counts(m, n, allowed)
    separate = m.cg.hardware.device_memory_separate
    forms = {"keep": [f.saved], "recompute": [f.ckpt, f.fwd], "partitioned": [f.ckpt_part, f.fwd + f.gather],
             "offload": [f.saved, f.fwd, f.bwd] if separate else [f.saved],
             "selective": [f.selective_held, f.selective_fwd]}
    prods = _decision_products(m, counts, n, {k: forms[k] for k in counts})
    memory, time_terms = [], []
    keep_saved = None
    if "keep" in counts:
        (keep_saved,) = prods["keep"]
        memory.append(keep_saved)
    for k in ("recompute", "partitioned", "selective"):
        if k in counts:
            held, rec = prods[k]
            memory.append(held)
            time_terms.append(rec)
    resident = {"keep", "selective"}       # decisions that bring no whole segment back in backward
    if "offload" in counts:
        per_gib = M / m.cg.hardware.host_device_bandwidth * T     # microseconds to move one GiB
        if separate:
            saved, fwd, bwd = prods["offload"]
            for phase_compute in (fwd, bwd):   # device->host in forward, host->device in backward
                exposed = m.var(name="off")    # n * max(0, transfer - compute) = max(0, n*transfer - n*compute)
                m.prob += exposed >= per_gib * saved - phase_compute
                time_terms.append(exposed)
        else:
            # Host memory is device memory: the copy frees nothing and nothing hides it. Only
            # offered alone (see _allowed_decisions), so it never shares a class with keep.
            (saved,) = prods["offload"]
            memory.append(saved)
            time_terms.append(per_gib * saved)
            resident.add("offload")
    bounds = []
    whole = [k for k in counts if k not in resident]
    if whole and f.saved.upper() > 0:
        u = _indicator(m, counts, n, whole)
        bounds.append((u, f.saved))
        m.prob += working >= _whole_working_set(m, u, f.saved, keep_saved, counts, whole)
    if "selective" in counts:
        u = _indicator(m, counts, n, ["selective"])
        for run in f.run_saved:
            bounds.append((u, run))
            m.prob += working >= _products(m, u, 1, [run])[0]
    return counts, memory, time_terms, bounds, f


def _indicator(m: _Model, counts: dict, n: int, decisions: list[str]):
    """1 if some segment of the class takes one of ``decisions``: the constant 1 when the class
    allows no other, the (binary) count itself for a single segment taking one decision, the sum
    of the binary counts for a single segment, else a binary ``u`` (u = 0 forces none)."""
    if set(counts) <= set(decisions):
        return 1
    if n == 1:
        return counts[decisions[0]] if len(decisions) == 1 else pulp.lpSum(counts[k] for k in decisions)
    u = m.var(0, 1, pulp.LpBinary, name="u")
    m.prob += pulp.lpSum(counts[k] for k in decisions) <= n * u
    return u


def _whole_working_set(m: _Model, u, saved: _Form, keep_saved, counts: dict, whole: list[str]
                       ) -> pulp.LpAffineExpression:
    """``u * saved``, with u from :func:`_indicator` over the decisions ``whole``."""
    if isinstance(u, pulp.LpVariable):
        (u_saved,) = _products(m, u, 1, [saved])
        return u_saved
    if not isinstance(u, pulp.LpAffineExpression):   # u = 1
        return saved.expr(m)
    if keep_saved is not None and set(counts) == {"keep", *whole}:
        return saved.expr(m) - keep_saved   # one segment: u = 1 - keep, and keep * saved is at hand
    return pulp.lpSum(_products(m, counts[k], 1, [saved])[0] for k in whole)


def _designated_working_set(m: _Model, not_kept: list[tuple], working, must_drop: bool) -> None:
    """A valid inequality that the per-class bounds ``working >= u_c * saved_c`` miss in the LP.

    The LP relaxation spreads a fractional 'not kept' over all segments (keep = 0.46 on each of 12
    blocks), so every ``u_c * saved_c`` and hence the working set is about half a block while any
    integer plan that recomputes pays a whole one. Here ``z`` says 'some segment is not kept' and
    weights ``w_c`` (0 <= w_c <= u_c, sum w_c = z) designate the class whose saved activations
    bound the working set: ``working >= sum_c w_c * saved_c``. At integer points this is at most
    the max of the per-class bounds (w can pick any one non-kept class), so it removes no plan.
    ``must_drop`` (keeping every segment cannot fit the budget, by the per-group minima) fixes
    z = 1, and the LP must then pay a convex combination of whole segments instead of fractions
    of them (HiGHS's probing does not find this: the memory row sees the products, not x).
    """
    if not not_kept or (len(not_kept) == 1 and not must_drop):
        return
    z = 1 if must_drop else m.var(0, 1, pulp.LpBinary, name="z")
    weights, bound = [], []
    for u, saved in not_kept:
        w = m.var(0, 1, name="w")
        m.prob += w <= u
        if not must_drop:
            m.prob += z >= u
        weights.append(w)
        bound += _products(m, w, 1, [saved])
    m.prob += pulp.lpSum(weights) == z
    m.prob += working >= pulp.lpSum(bound)


def _decision_products(m: _Model, counts: dict, scale: int,
                       forms: dict[str, list[_Form]]) -> dict[str, list[pulp.LpAffineExpression]]:
    """``counts[k] * form`` for each decision k and each of its forms, exactly, where the counts
    are integer variables summing to ``scale`` (or one constant, ``scale``) and each form is a
    linear function of one-hot strategy choices.

    As in :func:`_products`, per decision group g a variable K[k, g, s] stands for
    counts[k] * x[g, s], with sum_s K[k, g, s] = counts[k]; but the decisions share one
    disaggregation, tied to the strategy choice by sum_k K[k, g, s] = scale * x[g, s] (valid
    because the counts sum to ``scale``; it implies K[k, g, s] <= scale * x[g, s]). At integer
    points K is still the product. Per group the LP can now only mix integer points: at scale 1 a
    feasible K is a joint distribution with marginals (counts, x), i.e. the convex combination
    sum K[k, s] (e_k, e_s, e_k e_s^T) of products, so this is the convex hull of the product of
    the two one-hot vectors. Bounding each decision's K by scale * x separately (one
    :func:`_products` per decision) let the LP price keep and recompute on the same cheap strategy
    while x sat elsewhere (GPT-2 2x2, tight budget, unaliased: from a 0.07% gap at the 300 s limit
    to optimal in 11 s). Strategies with equal coefficients in every form of every decision share
    one K."""
    if not any(isinstance(v, pulp.LpVariable) for v in counts.values()):
        return {k: _products(m, counts[k], scale, fs) for k, fs in forms.items()}
    rows = [(k, j) for k in forms for j in range(len(forms[k]))]   # one row per (decision, form)
    out = {k: [f.constant * counts[k] for f in fs] for k, fs in forms.items()}
    for low, columns, bucket_x in _strategy_buckets(m, [forms[k][j] for k, j in rows]):
        for (k, j), c in zip(rows, low):
            out[k][j] += float(c) * counts[k]
        if columns is None:
            continue
        ks = {k: [m.var(0, scale, name="K") for _ in columns] for k in forms}
        for k in forms:
            m.prob += pulp.lpSum(ks[k]) == counts[k]
        for b, x in enumerate(bucket_x):
            m.prob += pulp.lpSum(ks[k][b] for k in forms) == scale * x
        for i, (k, j) in enumerate(rows):
            out[k][j] += pulp.lpSum(float(c) * v for c, v in zip(columns[:, i], ks[k]) if c != 0.0)
    return out


def _products(m: _Model, mult, scale: int, forms: list[_Form]) -> list[pulp.LpAffineExpression]:
    """``mult * form`` for each form, exactly, where ``mult`` is an integer variable in [0, scale]
    (or a constant) and each form a linear function of one-hot strategy choices.

    Per decision group g the product ``mult * x[g, s]`` is a variable K[g, s] with
    ``sum_s K[g, s] = mult`` and ``0 <= K[g, s] <= scale * x[g, s]``: at integer points only the
    chosen strategy's K is non-zero and it equals mult, and for each group this is the convex hull
    of the product (the big-M form ``z >= E - U (1 - b)`` lets a fractional b drop most of E in the
    LP relaxation, which left a ~12% root gap). Strategies with equal coefficients in every form
    share one K (their x summed), so K only tells apart what the forms can.
    """
    if not isinstance(mult, pulp.LpVariable):
        return [mult * f.expr(m) for f in forms]
    out = [f.constant * mult for f in forms]
    for low, columns, bucket_x in _strategy_buckets(m, forms):
        for i, c in enumerate(low):
            out[i] += float(c) * mult
        if columns is None:
            continue
        ks = [m.var(0, scale, name="K") for _ in columns]
        m.prob += pulp.lpSum(ks) == mult
        for k, x in zip(ks, bucket_x):
            m.prob += k <= scale * x
        for i in range(len(forms)):
            out[i] += pulp.lpSum(float(c) * k for c, k in zip(columns[:, i], ks) if c != 0.0)
    return out


def _strategy_buckets(m: _Model, forms: list[_Form]) -> Iterable[tuple]:
    """Per decision group some form depends on, what a product with it needs: ``low[i]``, form i's
    minimum over the group's strategies; ``columns[b, i]``, form i's coefficient above that minimum
    for the strategies of bucket b (strategies with equal coefficients in every form share one);
    ``bucket_x[b]``, the sum of their x. ``columns`` and ``bucket_x`` are None where every form is
    constant over the group's strategies."""
    for g in sorted(set().union(*(f.coef for f in forms))):
        xs = m.x[g]
        mat = np.stack([f.coef.get(g, np.zeros(len(xs))) for f in forms])
        low = mat.min(axis=1)
        mat = mat - low[:, None]
        if not mat.any():
            yield low, None, None
            continue
        columns, bucket = np.unique(mat.T, axis=0, return_inverse=True)
        bucket = bucket.ravel()
        yield low, columns, [pulp.lpSum(xs[s] for s in np.flatnonzero(bucket == b)) for b in range(len(columns))]


def _pulp_solver(options: SolverOptions, msg: bool = False):
    if options.solver == "highs":
        if "HiGHS" not in pulp.listSolvers(onlyAvailable=True):
            raise RuntimeError("HiGHS (highspy) is not available: pip install highspy, or pass solver='cbc'")
        return pulp.HiGHS(msg=msg, timeLimit=options.time_limit, gapRel=options.gap_rel,
                          threads=options.threads)
    if options.solver == "cbc":
        return pulp.PULP_CBC_CMD(msg=msg, timeLimit=options.time_limit, gapRel=options.gap_rel)
    raise ValueError(f"unknown solver {options.solver!r}: use 'highs' or 'cbc'")


def solve(cg: CostGraph, options: SolverOptions = SolverOptions(),
          allowed: dict[str, Iterable[int]] | None = None, reshard: Reshard = True) -> Solution:
    """Solve the joint strategy + memory ILP; raises InfeasibleBudgetError with the minimum budget.

    ``allowed`` restricts CGNodes to some strategy indices (how baseline plans are expressed:
    e.g. parameters replicated and the batch sharded is data parallelism); a restriction on one
    node of an alias group applies to the whole group. ``reshard=False`` makes resharding on
    edges (except into the graph's outputs) weigh ``RESHARD_PENALTY`` times its time, so that
    every op reads its operands as produced wherever any plan allows it (the reported objective
    and times are the plain model's); a set of CGNode names exempts the edges out of those
    nodes (see :data:`Reshard`).
    """
    margin = 0.0
    while True:
        t0 = time.perf_counter()
        m, handles = _build(cg, options, allowed, reshard, margin)
        build = time.perf_counter() - t0
        t1 = time.perf_counter()
        m.prob.solve(_pulp_solver(options))
        solve_s = time.perf_counter() - t1
        status = _status(m.prob)
        if status not in ("optimal", "feasible"):
            if options.memory_budget is not None and status == "infeasible":
                raise InfeasibleBudgetError(_infeasible_message(cg, options, allowed, reshard))
            raise RuntimeError(f"the ILP solver returned status {status!r} (solver {options.solver}); "
                               "try a longer time_limit or solver='cbc'")
        solution = _readout(m, handles, status, build, solve_s)
        over = 0.0 if options.memory_budget is None else solution.memory.bound - options.memory_budget
        if over <= 0:
            return solution
        # The solver accepts a row violated by up to its feasibility tolerance (1e-6 in GiB units,
        # ~1 KiB): solve again with the budget row tightened by what it took, until none is.
        margin += 2 * over


def _build(cg: CostGraph, options: SolverOptions, allowed: dict[str, Iterable[int]] | None = None,
           reshard: Reshard = True, margin: float = 0.0) -> tuple[_Model, dict]:
    """The full model: step-time objective, and the peak-memory row when there is a budget (less
    ``margin`` bytes)."""
    m = _Model(cg, options, allowed=allowed, reshard=reshard)
    objective_terms = _node_time_terms(m)
    objective_terms += _edge_time_terms(m)
    objective_terms += _grad_sync_terms(m)
    peaks, handles = _memory_and_recompute(m, objective_terms, options.memory_budget)
    handles["tie"] = _keep_tie_break(handles["classes"]) + pulp.lpSum(m.unreported)
    handles["symmetry_rows"] = _break_block_symmetry(m, handles) if options.break_symmetry else 0
    m.prob += pulp.lpSum(objective_terms) + handles["tie"]
    if options.memory_budget is not None:
        for peak in peaks:
            m.prob += peak <= (float(options.memory_budget) - margin) / M
    handles["peaks"] = peaks                 # the peak is their max
    return m, handles


def _break_block_symmetry(m: _Model, handles: dict) -> int:
    """Order the memory decisions of identical blocks that do not share variables (aliasing off):
    see :mod:`.symmetry`. Only where every class is a single segment (no aliasing anywhere), so
    that every segment's forms are at hand. Returns the number of rows added."""
    classes = handles["classes"]
    if any(len(names) > 1 for names, _ in classes) or not m.cg.identical_blocks:
        return 0
    counts = {names[0]: c for names, c in classes if any(isinstance(v, pulp.LpVariable) for v in c.values())}
    rank = {k: len(READOUT_ORDER) - i for i, k in enumerate(READOUT_ORDER)}
    return order_identical_blocks(m, handles["segment_forms"], counts, rank)


def _keep_tie_break(classes: list) -> pulp.LpAffineExpression:
    """``KEEP_TIE_US`` per segment not kept, over the classes that may keep (see the module
    docstring): equal modeled time then goes to keep; up to twice that on the last class, so that
    among classes of equal cost the earliest blocks rebuild (their rebuild peaks lowest, while
    the fewest blocks before them hold activations)."""
    n = len(classes)      # classes come in the block order of their first segments
    return pulp.lpSum(KEEP_TIE_US * _TIE_WEIGHT[k] * (1.0 + i / n) * v
                      for i, (_, counts) in enumerate(classes) if "keep" in counts
                      for k, v in counts.items() if k != "keep" and isinstance(v, pulp.LpVariable))


def _status(prob: pulp.LpProblem) -> str:
    """'optimal' only when the solver proved it; 'feasible' when it stopped early (time limit, gap)
    with an integer solution. PuLP reports both as LpStatusOptimal; sol_status tells them apart."""
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "feasible"
    return pulp.LpStatus[prob.status].lower()


def minimum_budget(cg: CostGraph, options: SolverOptions = SolverOptions(),
                   allowed: dict[str, Iterable[int]] | None = None,
                   reshard: Reshard = True) -> tuple[float, MemoryPrediction]:
    """The smallest per-device budget any plan meets under ``options``, ``allowed`` and
    ``reshard`` (see :func:`solve`; the ILP's bound on the peak, :attr:`MemoryPrediction.bound`),
    with that plan's memory."""
    m = _Model(cg, options, allowed=allowed, reshard=reshard)
    peaks, handles = _memory_and_recompute(m, [], budget=None)   # no budget row here
    peak = m.var(name="peak")
    for p in peaks:
        m.prob += peak >= p
    m.prob += peak
    m.prob.solve(_pulp_solver(options))
    sol = _readout(m, handles, _status(m.prob), 0.0, 0.0)
    return sol.memory.bound, sol.memory


def _infeasible_message(cg: CostGraph, options: SolverOptions, allowed=None, reshard: Reshard = True) -> str:
    need, mem = minimum_budget(cg, options, allowed, reshard)
    parts = {"parameters": mem.params, "gradients": mem.grads, "optimizer state": mem.optimizer,
             "gathered parameters": mem.param_copies, "activations": mem.bound - mem.static}
    top = max(parts, key=parts.get)  # type: ignore[arg-type]
    return (f"no plan fits the memory budget of {format_bytes(options.memory_budget or 0)} per device on mesh "
            f"{cg.mesh}: the smallest feasible budget is {format_bytes(need)} "
            f"({', '.join(f'{k} {format_bytes(v)}' for k, v in parts.items())}; {top} dominate). "
            "Raise the budget, use a larger mesh, or a smaller batch.")


def _value(v) -> float:
    if isinstance(v, (int, float)):
        return float(v)
    return float(pulp.value(v) or 0.0)


def _readout(m: _Model, handles: dict, status: str, build: float, solve_s: float) -> Solution:
    cg = m.cg
    choice: dict[str, int] = {}
    for key, xs in m.x.items():
        idx = 0 if len(xs) == 1 else int(np.argmax([_value(v) for v in xs]))
        for g in cg.variable_groups():
            if g.key == key:
                for node in g.nodes:
                    choice[node] = idx
                break
    decisions = _read_decisions(handles)
    time_pred, mem = predict(cg, choice, decisions, m.options)
    objective = (_value(m.prob.objective) - _value(handles.get("tie", 0.0))) / T   # without the tie-break
    return Solution(choice, decisions, time_pred, mem, status, objective, build, solve_s,
                    m.prob.numVariables(), m.prob.numConstraints(), m.options.solver, bound=_dual_bound(m.prob))


def _read_decisions(handles: dict) -> dict[str, str]:
    """Segment -> decision from the per-class counts: within a class (identical segments, so any
    order has the same cost and bound) the decisions go along the block sequence in
    ``READOUT_ORDER``."""
    decisions: dict[str, str] = {}
    for names, counts in handles["classes"]:
        seq = [k for k in READOUT_ORDER if k in counts for _ in range(round(_value(counts[k])))]
        if len(seq) != len(names):
            raise RuntimeError(f"decision counts {seq} do not cover the {len(names)} segments {names}")
        decisions.update(zip(names, seq))
    return decisions


def _dual_bound(prob: pulp.LpProblem) -> float | None:
    """HiGHS's proven MIP lower bound, converted to seconds (None for other solvers)."""
    model = getattr(prob, "solverModel", None)
    if model is None or not hasattr(model, "getInfo"):
        return None
    bound = model.getInfo().mip_dual_bound
    return None if not np.isfinite(bound) else float(bound) / T


def predict(cg: CostGraph, choice: dict[str, int], decisions: dict[str, str],
            options: SolverOptions) -> tuple[TimePrediction, MemoryPrediction]:
    """Modeled step time and per-device memory of one full assignment (the ILP's objective terms,
    and its memory: ``mem.bound`` is what the ILP's peak rows give; ``mem.peak`` also knows where
    each decision sits in the block sequence, see :class:`MemoryPrediction`)."""
    t, mem = TimePrediction(), MemoryPrediction()
    post = post_segment_nodes(cg)
    for node in cg.nodes.values():
        s = choice[node.name]
        c = node.costs
        t.compute += c.compute_fwd[s] + c.compute_bwd[s]
        t.comm += c.comm_fwd[s] + c.comm_bwd[s]
        t.reshard += c.reshard_fwd[s] + c.reshard_bwd[s]
        t.optimizer += c.optimizer[s]
        mem.params += c.params[s]
        mem.grads += c.grads[s]
        if node.kind == "placeholder" and c.params[s]:
            item = cg.graph.tensor_meta(node.members[0]).dtype.itemsize
            mem.optimizer += c.params[s] / item * options.optimizer_bytes_per_param
        if node.segment is None:
            mem.activations += c.saved[s]
            if node.name in post:
                mem.post_segment += c.saved[s]
    for e in cg.edges:
        t.reshard += _edge_seconds(e, choice)
    gathers = param_gathers(cg, choice)
    per_edge, grouped = _gather_seconds(cg, choice, gathers)
    t.reshard -= per_edge
    t.comm += grouped
    mem.param_copies = chosen_param_edges(cg, choice).held
    sync = gradient_sync(cg, choice, gathers)
    t.comm += sync.inline - sync.deferred
    t.grad_sync = exposed_grad_sync(sync.synced, sync.backward_end, cg.mesh.shape, cg.hardware)[0]
    nonsegmented = mem.activations
    per_segment: list[tuple[float, float]] = []     # (held at the end of forward, rebuilt in backward)
    for seg in memory_segments(cg):
        held_before = mem.activations
        dec = decisions.get(seg.name, "keep")
        rebuilt = _segment_prediction(cg, seg, dec, choice, t, mem)
        per_segment.append((mem.activations - held_before, rebuilt))
    live = nonsegmented - mem.post_segment           # held until the end of backward
    rebuilds = []
    for held, rebuilt in per_segment:
        live += held
        if rebuilt:
            rebuilds.append(live + rebuilt)
    mem.backward_peak = max(rebuilds, default=0.0)
    return t, mem


def objective_of(cg: CostGraph, choice: dict[str, int], decisions: dict[str, str],
                 options: SolverOptions) -> float:
    """The ILP's objective (seconds) at one assignment: :func:`predict`'s step time with the
    scheduled gradient sync replaced by the ILP's linear form of it (see :mod:`.steptime`), every
    parameter-gradient all-reduce priced there as if bucketed."""
    t, _ = predict(cg, choice, decisions, options)
    gathers = param_gathers(cg, choice)
    sync = gradient_sync(cg, choice, gathers)
    per_edge, grouped = _gather_seconds(cg, choice, gathers)
    param_edges = chosen_param_edges(cg, choice)
    return (t.total - t.grad_sync - sync.inline + sync.deferred + _linear_grad_sync(cg, choice)
            + per_edge - grouped + param_edges.seconds - param_edges.replaced)


def _edge_seconds(e: CGEdge, choice: dict[str, int]) -> float:
    a, b = e.src_index[choice[e.src]], e.dst_index[choice[e.dst]]
    return float(e.fwd[a, b] + (e.bwd[a, b] if e.grad else 0.0))


def _gather_seconds(cg: CostGraph, choice: dict[str, int], gathers: ParamGathers) -> tuple[float, float]:
    """What the parameters gathered per block cost: priced per edge (the ILP's terms), and as the
    runtime runs them (one all-gather and one reduce-scatter per group)."""
    per_edge = sum(_edge_seconds(e, choice) for e in cg.edges if (e.dst_member, e.operand) in gathers.uses)
    grouped = 0.0
    for group in gathers.groups:
        nbytes = gathered_bytes(cg.graph, group)
        grouped += sum(collective_cost(kind, nbytes, group.axes, cg.mesh.shape, cg.hardware)
                       for kind in ("all_gather", "reduce_scatter"))
    return per_edge, grouped


def _linear_grad_sync(cg: CostGraph, choice: dict[str, int]) -> float:
    """What :func:`_grad_sync_terms` makes of an assignment."""
    mesh_shape, hw = cg.mesh.shape, cg.hardware
    backward_end = sum(_backward_time(n.costs)[choice[n.name]] for n in cg.nodes.values())
    total = floor = 0.0
    for k, axes in enumerate(SYNC_AXES):
        nbytes = sum(int(n.costs.sync_bytes[choice[n.name], k]) for n in cg.nodes.values())
        if nbytes:
            price = SyncPricing.of(axes, mesh_shape, hw)
            total += nbytes * price.seconds_per_byte() + price.latency
            floor += price.latency
    return max(total - overlap_fraction(hw) * backward_end, floor)


def gradient_reduction(cg: CostGraph, choice: dict[str, int]) -> GradReduction:
    """Which gradients the runtime all-reduces in buckets under ``choice``, and which inline
    all-reduces that spares (:func:`autoshard.grad_reduction.plan_gradient_reduction` on the
    chosen strategy of every graph node)."""
    graph = cg.graph
    fx_nodes = {n.name: n for n in graph.graph.nodes}
    strategy_of = _chosen_strategy(cg, choice)

    def resharded(name: str, j: int) -> bool:
        node = fx_nodes[name]
        producer = cg.table[name].operand_nodes[j]
        if producer not in cg.node_of:
            return False
        wanted = strategy_of(name).input_specs[j]
        out = (int(node.args[1]) if node.target is operator.getitem and isinstance(graph.tensor_meta(producer), tuple)
               else 0)
        return wanted is not None and strategy_of(producer).output_specs[out] != wanted

    return plan_gradient_reduction(grad_nodes(graph, lambda n: cg.table[n.name].operand_nodes, strategy_of,
                                              resharded, cg.mesh.shape))


def _chosen_strategy(cg: CostGraph, choice: dict[str, int]):
    """Graph node (or its name) -> the strategy it runs under ``choice`` (its CGNode's member)."""
    def strategy_of(node: "fx.Node | str") -> Strategy:
        name = node if isinstance(node, str) else node.name
        host = cg.node_of[name]
        return cg.nodes[host].member_strategy(name, choice[host])

    return strategy_of


def param_gather_seconds(cg: CostGraph, choice: dict[str, int]) -> tuple[float, float]:
    """Seconds of the parameters gathered per block under ``choice``: (as the ILP prices them, per
    resharded edge; as :func:`predict` and the runtime run them, per block)."""
    return _gather_seconds(cg, choice, param_gathers(cg, choice))


def param_gathers(cg: CostGraph, choice: dict[str, int]) -> ParamGathers:
    """The parameters the runtime all-gathers per block under ``choice`` (one all-gather forward,
    one reduce-scatter backward per group; :mod:`autoshard.param_gather`)."""
    strategy_of = _chosen_strategy(cg, choice)
    stored, uses = param_uses(cg.graph, lambda n: cg.table[n.name].operand_nodes, strategy_of,
                              lambda name: strategy_of(name).output_specs[0], cg.mesh.shape)
    return plan_param_gathers(stored, uses, cg.mesh.shape)


class GradientSync(NamedTuple):
    """The gradient all-reduces of one assignment, as the runtime runs them.

    ``synced``: the parameter gradients synchronised in buckets, in order of first use, each with
    the backward time at which it is complete. ``inline``: seconds of the parameter-gradient
    all-reduces that run inline per use (priced as bucketed by the strategies, so not in their
    ``comm``). ``deferred``: seconds of the activation-gradient all-reduces that the strategies
    price inline but the runtime leaves to the buckets (see :mod:`autoshard.grad_reduction`).
    ``backward_end``: the backward's length on the compute stream."""

    synced: list[SyncedGradient]
    inline: float
    deferred: float
    backward_end: float


def gradient_sync(cg: CostGraph, choice: dict[str, int], gathers: ParamGathers | None = None) -> GradientSync:
    """How the runtime synchronises gradients under ``choice`` (:func:`plan_gradient_reduction`
    on the chosen strategies of every graph node; the parameters gathered per block, ``gathers``
    (computed when None), have their gradients reduce-scattered, and what is left of their sums
    bucketed), with the backward times the buckets wait for."""
    gathers = param_gathers(cg, choice) if gathers is None else gathers
    finish: dict[str, float] = {}
    clock = 0.0
    into: dict[str, list[CGEdge]] = {}
    for e in cg.edges:
        into.setdefault(e.dst, []).append(e)
    for node in reversed(list(cg.nodes.values())):
        c, s = node.costs, choice[node.name]
        clock += _backward_time(c)[s] + sum(e.bwd[e.src_index[choice[e.src]], e.dst_index[s]]
                                            for e in into.get(node.name, ()) if e.grad)
        finish[node.name] = clock
    graph = cg.graph
    fx_nodes = {n.name: n for n in graph.graph.nodes}
    reduction = gradient_reduction(cg, choice)
    position = {n.name: i for i, n in enumerate(graph.graph.nodes)}
    synced: list[tuple[int, SyncedGradient]] = []
    for param, axes in {**reduction.bucketed, **gathers.leftover()}.items():
        users = [u.name for u in fx_nodes[param].users if u.op == "call_function"]
        host = cg.node_of[param]
        meta = graph.tensor_meta(fx_nodes[param])
        synced.append((min(position[u] for u in users), SyncedGradient(
            axes, str(meta.dtype), int(cg.nodes[host].costs.grads[choice[host]]),
            max(finish[cg.node_of[u]] for u in users))))
    synced.sort(key=lambda item: item[0])
    inline = deferred = 0.0
    for node in cg.nodes.values():
        for member in node.members:
            strategy = node.member_strategy(member, choice[node.name])
            for a in strategy.comm:
                if a.phase != BWD or not a.operand.startswith("in"):
                    continue
                j = int(a.operand[2:])
                operand = cg.table[member].operand_nodes[j]
                if (member, j) in gathers.uses:             # summed by its group's reduce-scatter
                    continue
                if a.bucketed and operand not in reduction.bucketed:
                    inline += a.cost
                elif not a.bucketed and (member, j) in reduction.deferred:
                    deferred += a.cost
    return GradientSync([g for _, g in synced], inline, deferred, clock)



def _segment_prediction(cg: CostGraph, seg: MemorySegment, dec: str, choice: dict[str, int],
                        t: TimePrediction, mem: MemoryPrediction) -> float:
    """Add one segment's held activations and time under decision ``dec`` to ``t`` and ``mem``;
    returns the bytes its backward brings back (recomputed or restored), 0 when none."""
    mesh_shape, hw = cg.mesh.shape, cg.hardware
    A = sum(cg.nodes[n].costs.saved[choice[n]] for n in seg.nodes)
    if dec == "keep":
        mem.activations += A
        return 0.0
    if dec == "selective":
        if not seg.runs:
            raise ValueError(f"segment {seg.name!r} has no memory-bound run that selective "
                             "recomputation could free; keep or recompute it instead")
        run_saved = [_at(run.saved, choice) for run in seg.runs]
        mem.activations += A - sum(run_saved) + sum(_at(run.stored, choice) for run in seg.runs)
        mem.working_set = max(mem.working_set, *run_saved)
        t.recompute += sum(_at(run.fwd, choice) for run in seg.runs)
        return max(run_saved)
    if dec == "offload" and not hw.device_memory_separate:
        mem.activations += A               # host memory is device memory: nothing freed
        t.offload += A / hw.host_device_bandwidth   # one copy, not hidden; restore copies nothing
        return 0.0
    F = sum(_forward_time(cg.nodes[n].costs)[choice[n]] for n in seg.nodes)
    mem.working_set = max(mem.working_set, A)
    if dec == "offload":
        B = sum(cg.nodes[n].costs.compute_bwd[choice[n]] for n in seg.nodes)
        bw = hw.host_device_bandwidth
        t.offload += max(0.0, A / bw - F) + max(0.0, A / bw - B)
        return A
    full = part = gather = 0.0
    for e in seg.ckpt_edges:
        spec = e.src_specs[e.src_index[choice[e.src]]]
        nbytes = spec.local_numel(e.tensor.shape, mesh_shape) * e.tensor.dtype.itemsize
        axes = replicated_axes(spec, mesh_shape)
        full += nbytes
        part += nbytes / math.prod(mesh_shape[x] for x in axes)
        gather += collective_cost("all_gather", nbytes, axes, mesh_shape, hw)
    if dec == "recompute":
        mem.activations += full
        t.recompute += F
    elif dec == "partitioned":
        mem.activations += part
        t.recompute += F + gather
    else:
        raise ValueError(f"segment {seg.name!r}: unknown memory decision {dec!r}; use one of {', '.join(DECISIONS)}")
    return A


def _at(per_node: dict[str, np.ndarray], choice: dict[str, int]) -> float:
    """A run's per-CGNode vector (see :class:`~.selective.RecomputeRun`) at the chosen strategies."""
    return float(sum(values[choice[node]] for node, values in per_node.items()))
