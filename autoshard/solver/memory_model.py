"""The ILP's memory rows and memory-decision costs (see :mod:`.ilp` for the whole formulation).

Per class of identical segments, integer counts of each memory decision; the static memory
(parameters, gradients, optimizer state, held parameter copies), the activations held at the start
of backward and the working set of the largest rebuilt segment, each a linear form over the
strategies, with the products of counts and strategy choices linearised in disaggregated form;
the recompute, offload and partitioned-checkpoint time terms of the objective."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import pulp

from ..comm_cost import collective_cost
from ..decisions import DECISIONS, RECOMPUTING, Decision
from ..hardware import HardwareProfile
from .costgraph import CGEdge, CostGraph
from .formulation import T, Model, forward_time, held_param_copies, weighted_sum
from .param_edges import param_edge_prices
from .results import SolverOptions
from .segments import MemorySegment, checkpoint_partition_axes, memory_segments, post_segment_nodes


def _spec_bytes(e: CGEdge, mesh_shape) -> np.ndarray:
    item = e.tensor.dtype.itemsize
    return np.array([s.local_numel(e.tensor.shape, mesh_shape) * item for s in e.src_specs], dtype=float)


def memory_and_recompute(m: Model, objective_terms: list,
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
    must_drop = budget is not None and keep_all.lower(m) > budget / m.M + 1e-6
    _designated_working_set(m, not_kept, working, must_drop)
    held = static.expr(m) + held_param_copies(m) + nonseg_act.expr(m) + pulp.lpSum(seg_act)
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
        allowed = [d for d in allowed if d != Decision.OFFLOAD]
    return allowed


def _static_bytes(cg: CostGraph, node, opts: SolverOptions) -> np.ndarray:
    """Per strategy of ``node``: bytes per device of its parameters, gradients and optimizer state,
    and of the gradient bucket slices of the parameter gradients it all-reduces in buckets (the
    runtime keeps a bucket's buffer from step to step, as DDP does)."""
    c = node.costs
    held = (c.params + c.grads + c.sync_bytes.sum(axis=1)).astype(float)
    if node.kind == "placeholder" and np.any(c.params):
        held += c.params / cg.stored_itemsize(node.members[0]) * opts.optimizer_bytes_per_param
    return held


def static_floor(cg: CostGraph, opts: SolverOptions, allowed: dict[str, Iterable[int]] | None = None) -> float:
    """Bytes per device every plan (under ``allowed``, see :func:`~.ilp.solve`) holds at least: each
    node's parameters, gradients and optimizer state at the cheapest strategy it may take. A lower
    bound on the peak, without an ILP: a budget below it is infeasible."""
    allowed = allowed or {}
    total = 0.0
    for g in cg.variable_groups():
        held = _static_bytes(cg, cg.nodes[g.nodes[0]], opts)
        if not np.any(held):
            continue
        keep = [set(allowed[n]) for n in g.nodes if n in allowed]
        rows = sorted(set.intersection(*keep)) if keep else range(len(held))
        total += g.count * min(float(held[s]) for s in rows)
    return total


def _static_and_unsegmented_memory(m: Model) -> tuple["_Form", "_Form", "_Form"]:
    """Parameters + gradients + optimizer state, activations saved outside segments, and the part
    of those saved after the last segment (:func:`post_segment_nodes`), in GiB."""
    cg, opts = m.cg, m.options
    post = post_segment_nodes(cg)
    static, nonseg_act, post_act = _Form(), _Form(), _Form()
    for g in cg.variable_groups():
        node = cg.nodes[g.nodes[0]]
        c = node.costs
        held = _static_bytes(cg, node, opts)
        if np.any(held):
            static.add(g.key, g.count * held / m.M)
        if node.segment is None and np.any(c.saved):
            nonseg_act.add(g.key, g.count * c.saved / m.M)
            n_post = sum(n in post for n in g.nodes)
            if n_post:
                post_act.add(g.key, n_post * c.saved / m.M)
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

    def lower(self, m: Model) -> float:
        """The minimum over the strategies each group may still take (restrictions excluded)."""
        return self.constant + sum(min(float(c) for x, c in zip(m.x[g], v) if x.upBound != 0)
                                   for g, v in self.coef.items())

    def expr(self, m: Model) -> pulp.LpAffineExpression:
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


def _segment_forms(m: Model, seg: MemorySegment) -> _SegmentForms:
    cg, mesh_shape, hw = m.cg, m.cg.mesh.shape, m.cg.hardware
    f = _SegmentForms(*(_Form() for _ in range(6)))
    for n in seg.nodes:
        c, g = cg.nodes[n].costs, m.group_of[n]
        f.saved.add(g, c.saved / m.M)
        f.fwd.add(g, forward_time(c) * T)
        f.bwd.add(g, c.compute_bwd * T)
    for e in seg.ckpt_edges:
        full_bytes = _spec_bytes(e, mesh_shape)
        axes = [checkpoint_partition_axes(e, s, mesh_shape) for s in e.src_specs]
        full = full_bytes / m.M
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
                saved.add(m.group_of[node], values / m.M)
                f.selective_held.add(m.group_of[node], -values / m.M)
            for node, values in run.fwd.items():
                f.selective_fwd.add(m.group_of[node], values * T)
            for node, values in run.stored.items():
                f.selective_held.add(m.group_of[node], values / m.M)
            f.run_saved.append(saved)
    return f


def _segment_classes(m: Model, segments: list[MemorySegment]) -> list[list[MemorySegment]]:
    """Segments grouped by :func:`_segment_class`, each group in block order."""
    classes: dict[tuple, list[MemorySegment]] = {}
    for seg in segments:
        classes.setdefault(_segment_class(m, seg), []).append(seg)
    return list(classes.values())


def _segment_class(m: Model, seg: MemorySegment) -> tuple:
    """Segments with equal keys have identical costs for every assignment of the shared variables."""
    nodes = tuple(m.group_of[n] for n in seg.nodes)
    ckpt = tuple((m.group_of[e.src], m.cg.nodes[e.src].members.index(e.src_member), e.src_output,
                  m.group_of[e.dst], e.operand) for e in seg.ckpt_edges)
    return nodes, ckpt


def _decision_counts(m: Model, n: int, allowed: list[str]) -> dict[str, object]:
    """How many of a class's ``n`` segments take each decision: integers summing to ``n`` (binaries
    when n == 1), or the constant ``n`` when only one decision is allowed."""
    if len(allowed) == 1:
        return {allowed[0]: n}
    cat = pulp.LpBinary if n == 1 else pulp.LpInteger
    counts = {k: m.var(0, n, cat, name=f"n_{k}_") for k in allowed}
    m.prob += pulp.lpSum(counts.values()) == n
    return counts


def _class_decisions(m: Model, segs: list[MemorySegment], allowed: list[str],
                     working) -> tuple[dict, list, list, list[tuple], _SegmentForms]:
    """Decision counts of one class of identical segments, with their memory (GiB) and time (us)
    terms. Also bounds the working set ``working`` by what a segment of the class brings back in
    its backward (all its saved activations when recomputed, partitioned or offloaded; one run's
    when selective), and returns those bounds as (u, form) pairs, u the 0/1 indicator 'some
    segment of the class takes such a decision'; last, the forms of its first segment."""
    n, f = len(segs), _segment_forms(m, segs[0])
    if not f.run_saved and Decision.SELECTIVE in allowed:   # nothing a selective recomputation frees here
        if allowed == [Decision.SELECTIVE]:
            raise ValueError(f"segment {segs[0].name!r} has no memory-bound run worth recomputing, so it "
                             "cannot be selective; fix another decision or let the solver choose")
        allowed = [k for k in allowed if k != Decision.SELECTIVE]
    counts = _decision_counts(m, n, allowed)
    separate = m.cg.hardware.device_memory_separate
    hooks = {k: _Form(checkpoint_overhead(m.cg.hardware, segs[0], k) * T)
             for k in (Decision.RECOMPUTE, Decision.PARTITIONED, Decision.SELECTIVE)}
    forms = {Decision.KEEP: [f.saved], Decision.RECOMPUTE: [f.ckpt, f.fwd + hooks[Decision.RECOMPUTE]],
             Decision.PARTITIONED: [f.ckpt_part, f.fwd + f.gather + hooks[Decision.PARTITIONED]],
             Decision.OFFLOAD: [f.saved, f.fwd, f.bwd] if separate else [f.saved],
             Decision.SELECTIVE: [f.selective_held, f.selective_fwd + hooks[Decision.SELECTIVE]]}
    prods = _decision_products(m, counts, n, {k: forms[k] for k in counts})
    memory, time_terms = [], []
    keep_saved = None
    if Decision.KEEP in counts:
        (keep_saved,) = prods[Decision.KEEP]
        memory.append(keep_saved)
    for k in RECOMPUTING:
        if k in counts:
            held, rec = prods[k]
            memory.append(held)
            time_terms.append(rec)
    time_terms += _rerun_reshard_terms(m, segs[0], counts, n)
    resident = {Decision.KEEP, Decision.SELECTIVE}   # decisions that bring no whole segment back in backward
    if Decision.OFFLOAD in counts:
        per_unit = m.M / m.cg.hardware.host_device_bandwidth * T     # microseconds to move one memory unit
        if separate:
            saved, fwd, bwd = prods[Decision.OFFLOAD]
            for phase_compute in (fwd, bwd):   # device->host in forward, host->device in backward
                exposed = m.var(name="off")    # n * max(0, transfer - compute) = max(0, n*transfer - n*compute)
                m.prob += exposed >= per_unit * saved - phase_compute
                time_terms.append(exposed)
        else:
            # Host memory is device memory: the copy frees nothing and nothing hides it. Only
            # offered alone (see _allowed_decisions), so it never shares a class with keep.
            (saved,) = prods[Decision.OFFLOAD]
            memory.append(saved)
            time_terms.append(per_unit * saved)
            resident.add(Decision.OFFLOAD)
    bounds = []
    whole = [k for k in counts if k not in resident]
    if whole and f.saved.upper() > 0:
        u = _indicator(m, counts, n, whole)
        bounds.append((u, f.saved))
        m.prob += working >= _whole_working_set(m, u, f.saved, keep_saved, counts, whole)
    if Decision.SELECTIVE in counts:
        u = _indicator(m, counts, n, [Decision.SELECTIVE])
        for run in f.run_saved:
            bounds.append((u, run))
            m.prob += working >= _products(m, u, 1, [run])[0]
    return counts, memory, time_terms, bounds, f


def checkpoint_overhead(hw: HardwareProfile, seg: MemorySegment, decision: str) -> float:
    """Seconds the checkpoint machinery adds to a segment under ``decision``, beyond its recomputed
    forward (:meth:`~autoshard.hardware.HardwareProfile.checkpoint_seconds`): one region that packs
    every tensor its forward saves when recomputed (``torch.utils.checkpoint``), one region per run
    when selective, one region that packs nothing when partitioned (the runtime's own autograd
    function keeps its input slices and recomputes in backward)."""
    if decision == Decision.RECOMPUTE:
        return hw.checkpoint_seconds(seg.hooked)
    if decision == Decision.PARTITIONED:
        return hw.checkpoint_seconds(0)
    if decision == Decision.SELECTIVE:
        return sum(hw.checkpoint_seconds(n) for n in seg.run_hooked)
    return 0.0


def rerun_cost(cg: CostGraph, edge: CGEdge) -> np.ndarray:
    """Seconds of the forward resharding of ``edge`` over its (src spec, dst spec) grid, as the ILP
    prices running it again in a recomputed segment: pairs that read a parameter gatherable per
    block cost nothing there (the runtime gathers before the region, once)."""
    e = _representative(cg, edge)
    price = cg.derived("param_edge_prices", lambda: param_edge_prices(cg)).get(id(e))
    cost = np.asarray(e.fwd, dtype=float)
    if price is not None:
        cost = np.where(price.gather_axes != None, 0.0, cost)  # noqa: E711 (object array)
    return cost


def _representative(cg: CostGraph, edge: CGEdge) -> CGEdge:
    """The edge of ``edge``'s group that the ILP's pair variables and parameter prices are keyed by."""
    return cg.derived("edge_representatives", lambda: {
        id(e): eg.edge for eg in cg.edge_groups() for e in eg.edges})[id(edge)]


def _rerun_reshard_terms(m: Model, seg: MemorySegment, counts: dict, n: int) -> list:
    """The forward resharding ``seg`` runs again in backward (priced by :func:`rerun_cost`), once
    per segment of the class whose decision re-runs it (:meth:`~.segments.MemorySegment.rerun_edges_for`):
    per edge, ``count * sum_ab cost[a, b] * pair(a, b)`` with ``count`` the number of such segments,
    exact at integer points.

    A single segment (``count`` 0 or 1) pays ``r >= sum_ab cost[a, b] * pair(a, b) - max(cost) * (1 - count)``:
    one variable per edge. A class of ``n`` identical segments needs the product itself: one K per
    distinct price c stands for count * (the pairs priced c), with sum_c K = count and
    K_c <= n * sum of those pairs. Pairs of one price share one K (most pairs of an edge move the
    same bytes the same way): the LP relaxation is that of one K per pair, which any K_c splits into
    in proportion to its pairs. One K per pair made the ILP 2-10x slower to solve (GPT-2 124M on 2x2
    unaliased, 42k rows: not closed in 60 s; 14k with these terms, 5.6 s. The 70B-wide Llama on 4x8,
    12 aliased layers: 17k rows, 4.1 s; 8k, 1.9 s)."""
    per_edge: dict[int, tuple[CGEdge, list]] = {}
    for k in (Decision.RECOMPUTE, Decision.PARTITIONED, Decision.SELECTIVE):
        if k in counts:
            for e in seg.rerun_edges_for(k):
                per_edge.setdefault(id(e), (e, []))[1].append(counts[k])
    terms = []
    for edge, rerun in per_edge.values():
        cost = rerun_cost(m.cg, edge) * T
        if not np.any(cost):
            continue
        e = _representative(m.cg, edge)
        grid = [(int(a), int(b)) for a in range(cost.shape[0]) for b in range(cost.shape[1])]
        if not any(isinstance(c, pulp.LpVariable) for c in rerun):
            mult = float(sum(rerun))
            terms.append(weighted_sum((m.pair(e, a, b), mult * float(cost[a, b])) for a, b in grid if cost[a, b]))
            continue
        if n == 1:
            r = m.var(0, None, name="R")
            m.prob += r >= weighted_sum((m.pair(e, a, b), float(cost[a, b])) for a, b in grid if cost[a, b] > 0) \
                - float(max(cost.max(), 0.0)) * (1 - pulp.lpSum(rerun))
            terms.append(r)
            continue
        by_price: dict[float, list[tuple[int, int]]] = {}
        for a, b in grid:
            by_price.setdefault(max(float(cost[a, b]), 0.0), []).append((a, b))
        ks = {price: m.var(0, n, name="R") for price in by_price}
        m.prob += pulp.lpSum(ks.values()) == pulp.lpSum(rerun)
        for price, pairs in by_price.items():
            m.prob += ks[price] <= n * pulp.lpSum(m.pair(e, a, b) for a, b in pairs)
        terms.append(pulp.lpSum(price * k for price, k in ks.items() if price > 0))
    return terms


def _indicator(m: Model, counts: dict, n: int, decisions: list[str]):
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


def _whole_working_set(m: Model, u, saved: _Form, keep_saved, counts: dict, whole: list[str]
                       ) -> pulp.LpAffineExpression:
    """``u * saved``, with u from :func:`_indicator` over the decisions ``whole``."""
    if isinstance(u, pulp.LpVariable):
        (u_saved,) = _products(m, u, 1, [saved])
        return u_saved
    if not isinstance(u, pulp.LpAffineExpression):   # u = 1
        return saved.expr(m)
    if keep_saved is not None and set(counts) == {Decision.KEEP, *whole}:
        return saved.expr(m) - keep_saved   # one segment: u = 1 - keep, and keep * saved is at hand
    return pulp.lpSum(_products(m, counts[k], 1, [saved])[0] for k in whole)


def _designated_working_set(m: Model, not_kept: list[tuple], working, must_drop: bool) -> None:
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


def _decision_products(m: Model, counts: dict, scale: int,
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


def _products(m: Model, mult, scale: int, forms: list[_Form]) -> list[pulp.LpAffineExpression]:
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


def _strategy_buckets(m: Model, forms: list[_Form]) -> Iterable[tuple]:
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
