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
Objective (seconds per training step): node compute + collectives (per value and mesh axes whose
  gradient several consumers all-reduce, the dearest consumer's price in place of their sum, as
  the runtime runs one: :mod:`.shared_sync`), resharding on edges (out of
  parameters as :mod:`.param_edges` prices them: a parameter the runtime gathers with its block
  pays bandwidth per edge and the collectives' latency once per block), recomputation (the segment's forward again, or its runs' forward when selective, with the
  resharding of every operand read inside them: the runtime reshards where the consumer runs, inside
  its checkpoint region; the count x edge-pair products are exact at integer points), offload transfers that the segment's compute
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

Modules: this one builds the problem, solves it and reads the solution out (:func:`solve`,
:func:`minimum_budget`); :mod:`.results` holds what goes in and comes out (:class:`SolverOptions`,
:class:`Solution`); :mod:`.formulation` the variables and time terms; :mod:`.memory_model` the
memory rows and memory-decision costs; :mod:`.segments` the memory segments; :mod:`.evaluate` the
pricing of a given assignment (:func:`predict`, :func:`objective_of`, gradient sync). The names
tests and benches use are re-exported here.
"""
from __future__ import annotations

import time
from typing import Iterable

import numpy as np
import pulp

from ..decisions import DECISIONS, Decision
from ..errors import InfeasibleBudgetError
from ..specs import replicated_axes
from ..units import format_bytes
from .costgraph import CostGraph
from .evaluate import (GradientSync, gradient_reduction, gradient_sync, objective_of, param_gather_seconds,
                       param_gathers, predict)
from .formulation import (M, RESHARD_PENALTY, T, Model, edge_time_terms, grad_sync_terms, node_time_terms,
                          shared_sync_terms)
from .memory_model import memory_and_recompute
from .results import MemoryPrediction, Reshard, Solution, SolverOptions, TimePrediction
from .segments import MemorySegment, memory_segments, post_segment_nodes
from .symmetry import order_identical_blocks

__all__ = [
    "DECISIONS", "GradientSync", "InfeasibleBudgetError", "M", "MemoryPrediction", "MemorySegment", "READOUT_ORDER",
    "RESHARD_PENALTY", "Reshard", "Solution", "SolverOptions", "T", "TimePrediction", "gradient_reduction",
    "gradient_sync", "memory_segments", "minimum_budget", "objective_of", "param_gather_seconds", "param_gathers",
    "post_segment_nodes", "predict", "replicated_axes", "solve",
]

READOUT_ORDER = (Decision.RECOMPUTE, Decision.PARTITIONED, Decision.OFFLOAD, Decision.SELECTIVE, Decision.KEEP)
"""Where decisions of a class of identical blocks go along the block sequence: the largest
rebuilds first. A block's saved activations come back in its backward while only the blocks before
it still hold theirs, so the earliest blocks rebuild with the least memory live."""


KEEP_TIE_US = 1e-3   # ILP objective (us) per segment not kept: breaks exact ties toward keep
# ... and a partitioned checkpoint ties with recompute where nothing is replicated (a 1x1 mesh):
# prefer the plain checkpoint then.
_TIE_WEIGHT = {Decision.RECOMPUTE: 1.0, Decision.OFFLOAD: 1.0, Decision.PARTITIONED: 2.0, Decision.SELECTIVE: 1.0}


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
          allowed: dict[str, Iterable[int]] | None = None, reshard: Reshard = True,
          name_minimum: bool = True) -> Solution:
    """Solve the joint strategy + memory ILP; raises InfeasibleBudgetError with the minimum budget.

    ``allowed`` restricts CGNodes to some strategy indices (how baseline plans are expressed:
    e.g. parameters replicated and the batch sharded is data parallelism); a restriction on one
    node of an alias group applies to the whole group. ``reshard=False`` makes resharding on
    edges (except into the graph's outputs) weigh ``RESHARD_PENALTY`` times its time, so that
    every op reads its operands as produced wherever any plan allows it (the reported objective
    and times are the plain model's); a set of CGNode names exempts the edges out of those
    nodes (see :data:`Reshard`). ``name_minimum=False`` raises the budget error
    without solving again for the smallest feasible budget (for callers that only skip the plan).
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
                raise InfeasibleBudgetError(_infeasible_message(cg, options, allowed, reshard) if name_minimum else
                                            f"no plan fits the memory budget of "
                                            f"{format_bytes(options.memory_budget)} per device")
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
           reshard: Reshard = True, margin: float = 0.0) -> tuple[Model, dict]:
    """The full model: step-time objective, and the peak-memory row when there is a budget (less
    ``margin`` bytes)."""
    m = Model(cg, options, allowed=allowed, reshard=reshard)
    objective_terms = node_time_terms(m)
    objective_terms += shared_sync_terms(m)
    objective_terms += edge_time_terms(m)
    objective_terms += grad_sync_terms(m)
    peaks, handles = memory_and_recompute(m, objective_terms, options.memory_budget)
    handles["tie"] = _keep_tie_break(handles["classes"]) + pulp.lpSum(m.unreported)
    handles["symmetry_rows"] = _break_block_symmetry(m, handles) if options.break_symmetry else 0
    m.prob += pulp.lpSum(objective_terms) + handles["tie"]
    if options.memory_budget is not None:
        for peak in peaks:
            m.prob += peak <= (float(options.memory_budget) - margin) / m.M
    handles["peaks"] = peaks                 # the peak is their max
    return m, handles


def _break_block_symmetry(m: Model, handles: dict) -> int:
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
                      for i, (_, counts) in enumerate(classes) if Decision.KEEP in counts
                      for k, v in counts.items() if k != Decision.KEEP and isinstance(v, pulp.LpVariable))


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
    m = Model(cg, options, allowed=allowed, reshard=reshard)
    peaks, handles = memory_and_recompute(m, [], budget=None)   # no budget row here
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
             "gathered parameters": mem.param_copies, "gradient buckets": mem.grad_buckets,
             "activations": mem.bound - mem.static}
    top = max(parts, key=parts.get)  # type: ignore[arg-type]
    return (f"no plan fits the memory budget of {format_bytes(options.memory_budget or 0)} per device on mesh "
            f"{cg.mesh}: the smallest feasible budget is {format_bytes(need, round_up=True)} "
            f"({', '.join(f'{k} {format_bytes(v)}' for k, v in parts.items())}; {top} dominate). "
            "Raise the budget, use a larger mesh, or a smaller batch.")


def _value(v) -> float:
    if isinstance(v, (int, float)):
        return float(v)
    return float(pulp.value(v) or 0.0)


def _readout(m: Model, handles: dict, status: str, build: float, solve_s: float) -> Solution:
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
