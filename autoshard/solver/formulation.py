"""The ILP's variables and its time terms (see :mod:`.ilp` for the whole formulation).

:class:`Model` holds the problem: one-hot strategy variables per decision group, the product
variables of each edge group on its distinct-spec grid and the marginals that tie them to the
strategies, and the linear expressions of per-node costs. The terms here are seconds per step in
ILP units (:data:`T` microseconds per second, ``Model.M`` bytes: see :func:`memory_unit`): node compute and
collectives (one gradient all-reduce for the consumers of a value that share it), the gradient
synchronisation as the runtime buckets and overlaps it, edge resharding
(parameter edges priced by :mod:`.param_edges`), and the copies of parameters held until backward."""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import pulp

from ..grad_reduction import Axes
from .costgraph import SYNC_AXES, CGEdge, CostGraph
from .param_edges import gather_latency, param_edge_prices
from .results import Reshard, SolverOptions
from .shared_sync import shared_sync_classes
from .steptime import SyncPricing, bucket_copy_seconds, overlap_fraction


T = 1e6          # ILP time unit: microseconds per second
M = float(2**30) # the memory unit of a model with no scale to go by: bytes per GiB (see memory_unit)
RESHARD_PENALTY = 1e3  # solve(reshard=False): edge resharding weighs this much more than its time


def memory_unit(scale: float) -> float:
    """The ILP's memory unit (bytes) for memory of about ``scale`` bytes (the budget, or what the
    graph could hold): a power of two that puts ``scale`` near 1024 units. Memory rows then keep
    their coefficients near 1 (byte-valued rows next to binaries make HiGHS report false
    infeasibility), and the solvers' feasibility tolerance (1e-6 units) stays a millionth of a KiB
    of a 1 GiB budget's unit and a fraction of a byte of a 1 KiB one: with a fixed GiB unit it was
    ~1 KiB, the whole of a toy budget."""
    if not scale > 0:
        return M
    return float(2.0 ** max(0, round(math.log2(scale)) - 10))


def _memory_scale(cg: CostGraph) -> float:
    """Bytes per device the graph could hold at most: every node's largest parameters, gradients
    and saved activations (a scale for :func:`memory_unit`, not a prediction)."""
    return float(sum(np.max(n.costs.params + n.costs.grads + n.costs.saved) for n in cg.nodes.values()))


class Model:
    """The PuLP problem plus helpers to express per-strategy quantities linearly. ``M``: its memory
    unit (:func:`memory_unit` of the budget, or of the graph's scale without one)."""

    def __init__(self, cg: CostGraph, options: SolverOptions, sense=pulp.LpMinimize,
                 allowed: dict[str, Iterable[int]] | None = None, reshard: Reshard = True):
        self.cg = cg
        self.options = options
        self.reshard = reshard       # see Reshard: where resharding on edges is not penalised
        self.unreported: list = []   # objective terms left out of the reported objective (tie-breaks)
        self.prob = pulp.LpProblem("autoshard", sense)
        self.x: dict[str, list] = {}              # group key -> list of binaries (or None if fixed)
        self.group_of: dict[str, str] = {}        # CGNode name -> group key
        self.param_prices = cg.derived("param_edge_prices", lambda: param_edge_prices(cg))  # id(edge) -> price
        self.pairs: dict[int, dict[tuple[int, int], object]] = {}   # id(edge) -> (a, b) -> expression
        self.M = memory_unit(float(options.memory_budget) if options.memory_budget else _memory_scale(cg))
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


def node_time_terms(m: Model) -> list:
    """Objective terms of node strategies: compute, own collectives, resharding inside merged nodes."""
    terms = []
    for g in m.cg.variable_groups():
        node = m.cg.nodes[g.nodes[0]]
        per_strategy = node.costs.time()
        if np.any(per_strategy):
            terms.append(g.count * m.choice_expr(node.name, per_strategy * T))
    return terms


def shared_sync_terms(m: Model) -> list:
    """Gradient all-reduces that consumers of one value share (:mod:`.shared_sync`): per value and
    mesh axes, ``z >=`` each consumer's chosen price, and the objective pays ``z`` in place of the
    prices :func:`node_time_terms` counts each."""
    terms = []
    for count, consumers in shared_sync_classes(m.cg):    # aliased blocks' values: one z for all
        z = m.var(name="shared_sync")
        for node, prices in consumers:
            price = m.choice_expr(node, prices * T)
            m.prob += z >= price
            terms.append(-count * price)
        terms.append(count * z)
    return terms


def grad_sync_terms(m: Model) -> list:
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
    copies = _bucket_copy_terms(m)
    eta = overlap_fraction(hw)
    backward = pulp.lpSum(g.count * m.choice_expr(g.nodes[0], backward_time(cg.nodes[g.nodes[0]].costs) * T)
                          for g in cg.variable_groups()) if eta > 0 else 0.0
    m.prob += exposed >= pulp.lpSum(sync) - eta * backward
    m.prob += exposed >= pulp.lpSum(latencies)
    return [exposed, *copies]


def _bucket_copy_terms(m: Model) -> list:
    """The runtime's copies of bucketed gradients, on the compute stream (see
    :mod:`.steptime`): per synced byte the flatten into a full bucket, and per strategy the copy of
    its gradient back out."""
    cg = m.cg
    hw, dtype = cg.hardware, cg.grad_sync_dtype()
    terms = []
    for g in cg.variable_groups():
        node = cg.nodes[g.nodes[0]]
        per_strategy = node.costs.sync_bytes.sum(axis=1)
        if np.any(per_strategy):
            seconds = np.array([bucket_copy_seconds(hw, b, dtype) for b in per_strategy])
            terms.append(g.count * m.choice_expr(node.name, seconds * T))
    return terms


def backward_time(c) -> np.ndarray:
    """A node's time on the compute stream in backward."""
    return c.compute_bwd + c.comm_bwd + c.reshard_bwd


def forward_time(c) -> np.ndarray:
    """What recomputing a node costs: its forward compute, collectives and internal resharding."""
    return c.compute_fwd + c.comm_fwd + c.reshard_fwd


def edge_time_terms(m: Model) -> list:
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
        term = weighted_sum((m.pair(e, a, b), eg.count * float(cost[a, b])) for a, b in zip(*np.nonzero(cost)))
        terms.append(term)
        if _penalised(m.reshard, e, m.cg):
            m.unreported.append((RESHARD_PENALTY - 1.0) * term)
    return terms + _gather_latency_terms(m, gathers)


def _inline_grad_terms(m: Model, count: int, e: CGEdge, price) -> list:
    """The consumer's gradient all-reduce of a parameter read resharded runs inline, costing what
    the consumer's strategy ``c`` prices it at (``price.inline[c]``). Per spec ``b`` the consumer
    reads the parameter in, the cheapest such cost of the strategies reading ``b``, ``k_b``, is owed
    on the mass of the resharded pairs of column ``b`` of ``y`` (linear, and exact where those
    strategies agree); what a strategy costs beyond ``k_b`` is owed through ``w_c >= x_c -
    sum(y[a, b] over the specs a read without resharding)``, exact at integer points. (The plain
    product ``w >= x_c + resharded - 1`` left HiGHS a weak relaxation: Llama-7B on 2x4 under 80 GiB
    solved in 18 s instead of 1.5.)"""
    if not np.any(price.inline) or not np.any(price.resharded):
        return []
    xs = m.x[m.group_of[e.dst]]
    by_spec: dict[int, list[int]] = {}
    for c in range(len(price.inline)):
        by_spec.setdefault(int(e.dst_index[c]), []).append(c)
    terms = []
    for b, strategies in by_spec.items():
        resharded = [a for a in range(len(e.src_specs)) if price.resharded[a, b]]
        if not resharded:
            continue
        floor = min(float(price.inline[c]) for c in strategies)
        if floor > 0:
            terms.append(count * floor * T * pulp.lpSum(m.pair(e, a, b) for a in resharded))
        kept = [a for a in range(len(e.src_specs)) if not price.resharded[a, b]]
        for c in strategies:
            extra = float(price.inline[c]) - floor
            if extra <= 0:
                continue
            x_c = xs[c] if len(xs) > 1 else 1.0
            if not kept:                           # every layout it could come from is resharded
                terms.append(count * extra * T * x_c)
                continue
            w = m.var(0.0, 1.0, name="inline")
            m.prob += w >= x_c - pulp.lpSum(m.pair(e, a, b) for a in kept)
            terms.append(count * extra * T * w)
    return terms


def _gather_latency_terms(m: Model, gathers: dict[tuple[str, Axes], set[tuple[int, int, int]]]) -> list:
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


def held_param_copies(m: Model) -> pulp.LpAffineExpression:
    """Parameter copies read larger than stored, held until backward (memory units per device)."""
    out = []
    for eg in m.cg.edge_groups():
        price = m.param_prices.get(id(eg.edge))
        if price is not None and np.any(price.held):
            out += [(m.pair(eg.edge, a, b), eg.count * float(price.held[a, b]) / m.M)
                    for a, b in zip(*np.nonzero(price.held))]
    return weighted_sum(out)


def _penalised(reshard: Reshard, e: CGEdge, cg: CostGraph) -> bool:
    """Whether resharding on edge ``e`` weighs ``RESHARD_PENALTY`` times its time (see Reshard)."""
    if reshard is True or cg.nodes[e.dst].kind == "output":
        return False
    return reshard is False or e.src not in reshard


def weighted_sum(terms: Iterable[tuple[object, float]]) -> pulp.LpAffineExpression:
    """sum(coefficient * expression) over ``(expression, coefficient)`` pairs, built in one dict:
    ``pulp.lpSum`` of products makes an expression per term, which dominated building the ILP."""
    out = pulp.LpAffineExpression()
    constant = 0.0
    for expr, coef in terms:
        if isinstance(expr, pulp.LpVariable):
            out[expr] = out.get(expr, 0.0) + coef
        elif isinstance(expr, pulp.LpAffineExpression):
            for v, k in expr.items():
                out[v] = out.get(v, 0.0) + coef * k
            constant += coef * float(expr.constant)
        else:
            constant += coef * float(expr)
    out.constant = constant
    return out


def _marginals(m: Model, node: str, index: np.ndarray, n: int) -> list[pulp.LpAffineExpression]:
    """For each distinct spec, the (0/1) expression 'the node chose a strategy with this spec'."""
    xs = m.x[m.group_of[node]]
    out = [pulp.LpAffineExpression() for _ in range(n)]
    if len(xs) == 1:
        out[int(index[0])] = pulp.LpAffineExpression(constant=1.0)
        return out
    for s, a in enumerate(index):
        out[int(a)] += xs[s]
    return out
