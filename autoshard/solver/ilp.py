"""One ILP: a sharding strategy per node AND an activation-memory decision per segment.

Variables
  x[g, s]      binary, one-hot per decision group g (a node, or all aliased copies of one)
  y[e, a, b]   continuous in [0, 1] on the distinct-spec grid of an edge group: the product of the
               producer choosing output spec a and the consumer input spec b (the marginals tie it
               to x, and for one-hot x the only feasible y is that product)
  d[seg, k]    binary, one-hot per segment over the memory decisions
               keep / recompute / offload / partitioned
Objective (seconds per training step): node compute + collectives, resharding on edges,
  recomputation (the segment's forward again), offload transfers that the segment's compute
  cannot hide, and the all-gather of partitioned checkpoints.
Memory (bytes per device, at the start of backward): parameters + gradients + optimizer state,
  + activations saved outside segments, + per segment: saved activations if kept, its checkpointed
  input if recomputed (1/n of it if partitioned over the n devices holding copies), nothing if
  offloaded, + the working set of the largest segment that is recomputed or offloaded.

Products of a binary decision with a linear expression E (0 <= E <= U) are linearised exactly by
a variable z >= E - U (1 - b), z >= 0: z only appears with a positive coefficient in a minimised
objective or on the left of a <= constraint, so it settles at b * E.

Units inside the ILP are microseconds and GiB, so that coefficients stay within a few orders of
magnitude of 1 (byte-valued big-M rows next to binaries make HiGHS report false infeasibility);
everything outside is seconds and bytes.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import pulp

from ..comm import collective_cost
from ..specs import ShardSpec
from ..units import format_bytes
from .costgraph import CGEdge, CGNode, CostGraph

DECISIONS = ("keep", "recompute", "offload", "partitioned")
T = 1e6          # ILP time unit: microseconds per second
M = float(2**30) # ILP memory unit: bytes per GiB


class InfeasibleBudgetError(ValueError):
    """No plan fits the per-device memory budget."""


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


@dataclass
class MemoryPrediction:
    """Bytes per device at the training peak."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0      # kept activations incl. checkpoints
    working_set: float = 0.0      # largest recomputed/offloaded segment brought back

    @property
    def peak(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.working_set

    def to_dict(self) -> dict:
        return {**self.__dict__, "peak": self.peak}


@dataclass
class TimePrediction:
    """Seconds of one training step, by kind."""

    compute: float = 0.0
    comm: float = 0.0
    reshard: float = 0.0
    recompute: float = 0.0
    offload: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.reshard + self.recompute + self.offload

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
                 allowed: dict[str, Iterable[int]] | None = None):
        self.cg = cg
        self.options = options
        self.prob = pulp.LpProblem("autoshard", sense)
        self.x: dict[str, list] = {}              # group key -> list of binaries (or None if fixed)
        self.group_of: dict[str, str] = {}        # CGNode name -> group key
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

    def choice_expr(self, node: str, values: np.ndarray) -> pulp.LpAffineExpression:
        """sum_s values[s] * x[node, s] (a constant for fixed nodes)."""
        xs = self.x[self.group_of[node]]
        if len(xs) == 1:
            return pulp.LpAffineExpression(constant=float(values[0]))
        return pulp.LpAffineExpression([(v, float(c)) for v, c in zip(xs, values) if c != 0.0])

    def product(self, b, expr: pulp.LpAffineExpression, bounds: tuple[float, float], name: str = "z"):
        """A variable equal to b * expr at the optimum (see module docstring), for lower <= expr <= upper.

        ``z >= lower * b`` is implied at integer points but tightens the LP relaxation a lot: without
        it a fractional b below 1 - expr/upper makes z free of cost.
        """
        lower, upper = bounds
        z = self.var(name=name)
        if upper > 0:
            self.prob += z >= expr - upper * (1 - b)
        if lower > 0:
            self.prob += z >= lower * b
        return z


def _lower(values: np.ndarray) -> float:
    return float(np.min(values)) if len(values) else 0.0


def _upper(values: np.ndarray) -> float:
    return float(np.max(values)) if len(values) else 0.0


def _bounds(values: np.ndarray) -> np.ndarray:
    return np.array([_lower(values), _upper(values)])


def _sum_bounds(arrays: Iterable[np.ndarray]) -> tuple[float, float]:
    """Bounds of a sum of one-hot choices: the sums of the minima and of the maxima."""
    total = sum((_bounds(a) for a in arrays), np.zeros(2))
    return float(total[0]), float(total[1])


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


def _forward_time(c) -> np.ndarray:
    """What recomputing a node costs: its forward compute, collectives and internal resharding."""
    return c.compute_fwd + c.comm_fwd + c.reshard_fwd


def _edge_time_terms(m: _Model) -> list:
    terms = []
    for eg in m.cg.edge_groups():
        e = eg.edge
        cost = (e.fwd + (e.bwd if e.grad else 0.0)) * T
        if not np.any(cost):
            continue
        src_marg = _marginals(m, e.src, e.src_index, len(e.src_specs))
        dst_marg = _marginals(m, e.dst, e.dst_index, len(e.dst_specs))
        if len(e.src_specs) == 1:
            terms.append(eg.count * pulp.lpSum(float(cost[0, b]) * dst_marg[b] for b in range(len(e.dst_specs))))
            continue
        if len(e.dst_specs) == 1:
            terms.append(eg.count * pulp.lpSum(float(cost[a, 0]) * src_marg[a] for a in range(len(e.src_specs))))
            continue
        y = [[m.var(0.0, 1.0, name="y") for _ in e.dst_specs] for _ in e.src_specs]
        for a in range(len(e.src_specs)):
            m.prob += pulp.lpSum(y[a]) == src_marg[a]
        for b in range(len(e.dst_specs)):
            m.prob += pulp.lpSum(y[a][b] for a in range(len(e.src_specs))) == dst_marg[b]
        terms.append(eg.count * pulp.lpSum(float(cost[a, b]) * y[a][b]
                                           for a in range(len(e.src_specs)) for b in range(len(e.dst_specs))
                                           if cost[a, b] != 0.0))
    return terms


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


def memory_segments(cg: CostGraph) -> list[MemorySegment]:
    """The segments that get a memory decision, with the edges whose tensors a checkpoint stores
    (inputs from outside the segment that are not parameters and not shared by several segments)."""
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
    return list(by_seg.values())


def _is_input(cg: CostGraph, node: CGNode) -> bool:
    return cg.graph.is_user_input(node.members[0])


def _spec_bytes(e: CGEdge, mesh_shape) -> np.ndarray:
    item = e.tensor.dtype.itemsize
    return np.array([s.local_numel(e.tensor.shape, mesh_shape) * item for s in e.src_specs], dtype=float)


def replicated_axes(spec: ShardSpec, mesh_shape) -> tuple[int, ...]:
    """Mesh axes (of size > 1) over which a tensor in ``spec`` has full copies."""
    return tuple(a for a in range(len(mesh_shape)) if a not in spec.used_axes() and mesh_shape[a] > 1)


def _memory_and_recompute(m: _Model, objective_terms: list) -> tuple[pulp.LpAffineExpression, dict]:
    """Add memory expressions and segment decisions; returns (peak memory expr, handles for readout)."""
    cg, opts = m.cg, m.options
    mesh_shape = cg.mesh.shape
    hw = cg.hardware
    static = []
    nonseg_act = []
    for g in cg.variable_groups():
        node = cg.nodes[g.nodes[0]]
        c = node.costs
        opt_state = np.zeros_like(c.params)
        if node.kind == "placeholder" and np.any(c.params):
            item = cg.graph.tensor_meta(node.members[0]).dtype.itemsize
            opt_state = c.params / item * opts.optimizer_bytes_per_param
        if np.any(c.params + c.grads + opt_state):
            static.append(g.count * m.choice_expr(node.name, (c.params + c.grads + opt_state) / M))
        if node.segment is None and np.any(c.saved):
            nonseg_act.append(g.count * m.choice_expr(node.name, c.saved / M))
    segments = memory_segments(cg)
    allowed = [opts.fixed_decision] if opts.fixed_decision else [d for d in DECISIONS if d in opts.decisions]
    working = m.var(name="W")
    seg_act, handles = [], {"segments": {}, "working": working}
    classes: dict[tuple, list] = {}
    shared: dict[tuple, _SegmentTerms] = {}
    for seg in segments:
        key = _segment_class(m, seg)
        if key not in shared:
            shared[key] = _segment_terms(m, seg)
        st = shared[key]
        A, F, B = st.saved, st.fwd, st.bwd
        d = {k: m.var(0, 1, pulp.LpBinary, name=f"d_{k}_") for k in allowed}
        m.prob += pulp.lpSum(d.values()) == 1
        keep = d.get("keep", 0)
        seg_act.append(m.product(keep, A, st.saved_b, "keep"))
        if st.saved_b[1] > 0:   # working set: the largest segment that is not kept is rebuilt/brought back
            m.prob += working >= A - st.saved_b[1] * keep
            m.prob += working >= st.saved_b[0] * (1 - keep)
        if "recompute" in d:
            seg_act.append(m.product(d["recompute"], st.ckpt, st.ckpt_b, "ck"))
            objective_terms.append(m.product(d["recompute"], F, st.fwd_b, "rec"))
        if "partitioned" in d:
            seg_act.append(m.product(d["partitioned"], st.ckpt_part, st.ckpt_part_b, "ckp"))
            objective_terms.append(m.product(d["partitioned"], F + st.gather,
                                             (st.fwd_b[0] + st.gather_b[0], st.fwd_b[1] + st.gather_b[1]), "recp"))
        if "offload" in d:
            per_gib = M / hw.host_device_bandwidth * T     # microseconds to move one GiB
            for phase_compute in (F, B):   # device->host in forward, host->device in backward
                exposed = m.var(name="off")
                m.prob += exposed >= per_gib * A - phase_compute - per_gib * st.saved_b[1] * (1 - d["offload"])
                objective_terms.append(exposed)
        handles["segments"][seg.name] = d
        _order_identical_segments(m, seg, d, allowed, classes)
    peak = pulp.lpSum(static) + pulp.lpSum(nonseg_act) + pulp.lpSum(seg_act) + working
    handles["static"] = pulp.lpSum(static)
    return peak, handles


@dataclass
class _SegmentTerms:
    """Linear quantities of a segment (ILP units), each held by one variable shared by every
    segment of the same class, with its upper bound for the exact products."""

    saved: object
    saved_b: tuple[float, float]
    fwd: object
    fwd_b: tuple[float, float]
    bwd: object
    ckpt: object
    ckpt_b: tuple[float, float]
    ckpt_part: object
    ckpt_part_b: tuple[float, float]
    gather: object
    gather_b: tuple[float, float]


def _segment_terms(m: _Model, seg: MemorySegment) -> _SegmentTerms:
    """Saved activations (GiB), forward/backward time (us), checkpoint size in full and
    partitioned form (GiB) and the all-gather time of a partitioned checkpoint (us)."""
    cg, mesh_shape, hw = m.cg, m.cg.mesh.shape, m.cg.hardware
    costs = [cg.nodes[n].costs for n in seg.nodes]
    ck_full, ck_part, ck_gather = [], [], []
    ck_b, ck_part_b, gather_b = np.zeros(2), np.zeros(2), np.zeros(2)
    for e in seg.ckpt_edges:
        full_bytes = _spec_bytes(e, mesh_shape)
        axes = [replicated_axes(s, mesh_shape) for s in e.src_specs]
        full = full_bytes / M
        part = full / np.array([math.prod(mesh_shape[a] for a in ax) for ax in axes], dtype=float)
        gather = T * np.array([collective_cost("all_gather", b, ax, mesh_shape, hw) for b, ax in zip(full_bytes, axes)])
        marg = _marginals(m, e.src, e.src_index, len(e.src_specs))
        ck_full.append(pulp.lpSum(float(v) * marg[a] for a, v in enumerate(full)))
        ck_part.append(pulp.lpSum(float(v) * marg[a] for a, v in enumerate(part)))
        ck_gather.append(pulp.lpSum(float(v) * marg[a] for a, v in enumerate(gather)))
        ck_b += _bounds(full)
        ck_part_b += _bounds(part)
        gather_b += _bounds(gather)

    def held(expr) -> object:
        v = m.var(name="seg")
        m.prob += v == expr
        return v

    return _SegmentTerms(
        saved=held(pulp.lpSum(m.choice_expr(n, c.saved / M) for n, c in zip(seg.nodes, costs))),
        saved_b=_sum_bounds(c.saved / M for c in costs),
        fwd=held(pulp.lpSum(m.choice_expr(n, _forward_time(c) * T) for n, c in zip(seg.nodes, costs))),
        fwd_b=_sum_bounds(_forward_time(c) * T for c in costs),
        bwd=held(pulp.lpSum(m.choice_expr(n, c.compute_bwd * T) for n, c in zip(seg.nodes, costs))),
        ckpt=held(pulp.lpSum(ck_full)), ckpt_b=tuple(ck_b),
        ckpt_part=held(pulp.lpSum(ck_part)), ckpt_part_b=tuple(ck_part_b),
        gather=held(pulp.lpSum(ck_gather)), gather_b=tuple(gather_b),
    )


def _segment_class(m: _Model, seg: MemorySegment) -> tuple:
    """Segments with equal keys have identical costs for every assignment of the shared variables."""
    nodes = tuple(m.group_of[n] for n in seg.nodes)
    ckpt = tuple((m.group_of[e.src], m.cg.nodes[e.src].members.index(e.src_member), e.src_output,
                  m.group_of[e.dst], e.operand) for e in seg.ckpt_edges)
    return nodes, ckpt


def _order_identical_segments(m: _Model, seg: MemorySegment, d: dict, allowed: list[str], classes: dict) -> None:
    """Symmetry breaking: identical segments take their decisions in a fixed order (rank is
    non-decreasing along the block sequence). Any permutation of decisions among identical
    segments has the same objective and memory, so this removes no objective value."""
    key = _segment_class(m, seg)
    rank = pulp.lpSum(i * d[k] for i, k in enumerate(allowed))
    previous = classes.get(key)
    if previous is not None:
        m.prob += previous[-1] <= rank
        previous.append(rank)
    else:
        classes[key] = [rank]


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
          allowed: dict[str, Iterable[int]] | None = None) -> Solution:
    """Solve the joint strategy + memory ILP; raises InfeasibleBudgetError with the minimum budget.

    ``allowed`` restricts CGNodes to some strategy indices (how baseline plans are expressed:
    e.g. parameters replicated and the batch sharded is data parallelism); a restriction on one
    node of an alias group applies to the whole group.
    """
    t0 = time.perf_counter()
    m = _Model(cg, options, allowed=allowed)
    objective_terms = _node_time_terms(m)
    objective_terms += _edge_time_terms(m)
    peak, handles = _memory_and_recompute(m, objective_terms)
    m.prob += pulp.lpSum(objective_terms)
    if options.memory_budget is not None:
        m.prob += peak <= float(options.memory_budget) / M
    build = time.perf_counter() - t0
    t1 = time.perf_counter()
    m.prob.solve(_pulp_solver(options))
    solve_s = time.perf_counter() - t1
    status = _status(m.prob)
    if status not in ("optimal", "feasible"):
        if options.memory_budget is not None and status == "infeasible":
            raise InfeasibleBudgetError(_infeasible_message(cg, options, allowed))
        raise RuntimeError(f"the ILP solver returned status {status!r} (solver {options.solver}); "
                           "try a longer time_limit or solver='cbc'")
    return _readout(m, handles, status, build, solve_s)


def _status(prob: pulp.LpProblem) -> str:
    """'optimal' only when the solver proved it; 'feasible' when it stopped early (time limit, gap)
    with an integer solution. PuLP reports both as LpStatusOptimal; sol_status tells them apart."""
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "feasible"
    return pulp.LpStatus[prob.status].lower()


def minimum_budget(cg: CostGraph, options: SolverOptions = SolverOptions(),
                   allowed: dict[str, Iterable[int]] | None = None) -> tuple[float, MemoryPrediction]:
    """The smallest per-device peak any plan reaches under ``options`` and ``allowed``."""
    m = _Model(cg, options, allowed=allowed)
    peak, handles = _memory_and_recompute(m, [])
    m.prob += peak
    m.prob.solve(_pulp_solver(options))
    sol = _readout(m, handles, _status(m.prob), 0.0, 0.0)
    return sol.memory.peak, sol.memory


def _infeasible_message(cg: CostGraph, options: SolverOptions, allowed=None) -> str:
    need, mem = minimum_budget(cg, options, allowed)
    parts = {"parameters": mem.params, "gradients": mem.grads, "optimizer state": mem.optimizer,
             "activations": mem.activations + mem.working_set}
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
    decisions = {seg: max(d, key=lambda k: _value(d[k])) for seg, d in handles["segments"].items()}
    time_pred, mem = predict(cg, choice, decisions, m.options)
    return Solution(choice, decisions, time_pred, mem, status, _value(m.prob.objective) / T, build, solve_s,
                    m.prob.numVariables(), m.prob.numConstraints(), m.options.solver, bound=_dual_bound(m.prob))


def _dual_bound(prob: pulp.LpProblem) -> float | None:
    """HiGHS's proven MIP lower bound, converted to seconds (None for other solvers)."""
    model = getattr(prob, "solverModel", None)
    if model is None or not hasattr(model, "getInfo"):
        return None
    bound = model.getInfo().mip_dual_bound
    return None if not np.isfinite(bound) else float(bound) / T


def predict(cg: CostGraph, choice: dict[str, int], decisions: dict[str, str],
            options: SolverOptions) -> tuple[TimePrediction, MemoryPrediction]:
    """Modeled step time and per-device memory of one full assignment (the ILP's objective terms)."""
    mesh_shape, hw = cg.mesh.shape, cg.hardware
    t, mem = TimePrediction(), MemoryPrediction()
    for node in cg.nodes.values():
        s = choice[node.name]
        c = node.costs
        t.compute += c.compute_fwd[s] + c.compute_bwd[s]
        t.comm += c.comm_fwd[s] + c.comm_bwd[s]
        t.reshard += c.reshard_fwd[s] + c.reshard_bwd[s]
        mem.params += c.params[s]
        mem.grads += c.grads[s]
        if node.kind == "placeholder" and c.params[s]:
            item = cg.graph.tensor_meta(node.members[0]).dtype.itemsize
            mem.optimizer += c.params[s] / item * options.optimizer_bytes_per_param
        if node.segment is None:
            mem.activations += c.saved[s]
    for e in cg.edges:
        a, b = e.src_index[choice[e.src]], e.dst_index[choice[e.dst]]
        t.reshard += e.fwd[a, b] + (e.bwd[a, b] if e.grad else 0.0)
    for seg in memory_segments(cg):
        dec = decisions.get(seg.name, "keep")
        A = sum(cg.nodes[n].costs.saved[choice[n]] for n in seg.nodes)
        F = sum(_forward_time(cg.nodes[n].costs)[choice[n]] for n in seg.nodes)
        B = sum(cg.nodes[n].costs.compute_bwd[choice[n]] for n in seg.nodes)
        full = part = gather = 0.0
        for e in seg.ckpt_edges:
            spec = e.src_specs[e.src_index[choice[e.src]]]
            nbytes = spec.local_numel(e.tensor.shape, mesh_shape) * e.tensor.dtype.itemsize
            axes = replicated_axes(spec, mesh_shape)
            full += nbytes
            part += nbytes / math.prod(mesh_shape[x] for x in axes)
            gather += collective_cost("all_gather", nbytes, axes, mesh_shape, hw)
        if dec == "keep":
            mem.activations += A
            continue
        mem.working_set = max(mem.working_set, A)
        if dec == "recompute":
            mem.activations += full
            t.recompute += F
        elif dec == "partitioned":
            mem.activations += part
            t.recompute += F + gather
        elif dec == "offload":
            bw = hw.host_device_bandwidth
            t.offload += max(0.0, A / bw - F) + max(0.0, A / bw - B)
    return t, mem
