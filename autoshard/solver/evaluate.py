"""A given assignment priced as the ILP prices it, outside the ILP: :func:`predict` (the modeled
step time and peak memory of a strategy choice and memory decisions, what a :class:`Solution`
reports), :func:`objective_of` (the ILP's objective there), and the gradient synchronisation
(:func:`gradient_reduction`, :func:`gradient_sync`) and per-block parameter gathers
(:func:`param_gathers`, :func:`param_gather_seconds`) the runtime runs for a choice."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from ..comm_cost import collective_cost
from ..decisions import DECISIONS, Decision
from ..grad_reduction import GradReduction, grad_nodes, plan_gradient_reduction
from ..param_gather import ParamGathers, gathered_bytes, param_uses, plan_param_gathers
from ..strategy import BWD, Strategy
from .costgraph import SYNC_AXES, CGEdge, CostGraph
from .formulation import backward_time, forward_time
from .memory_model import checkpoint_overhead, rerun_cost
from .param_edges import chosen_param_edges, gather_copy_seconds, gather_flatten_seconds
from .results import MemoryPrediction, SolverOptions, TimePrediction
from .segments import MemorySegment, checkpoint_partition_axes, memory_segments, post_segment_nodes
from .shared_sync import shared_sync_credit, synced_value
from .steptime import SyncedGradient, SyncPricing, bucket_copy_seconds, exposed_grad_sync, overlap_fraction
from .sync_wait import sync_wait_seconds

if TYPE_CHECKING:
    from torch import fx


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
        mem.grad_buckets += c.sync_bytes[s].sum()     # as the ILP counts them (see memory_model._static_bytes)
        if node.kind == "placeholder" and c.params[s]:
            item = cg.stored_itemsize(node.members[0])
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
    t.comm += sync.inline - sync.deferred - sync.shared
    t.grad_sync = exposed_grad_sync(sync.synced, sync.backward_end, cg.mesh.shape, cg.hardware)[0]
    nonsegmented = mem.activations
    per_segment: list[tuple[float, float]] = []     # (held at the end of forward, rebuilt in backward)
    for seg in memory_segments(cg):
        held_before = mem.activations
        dec = decisions.get(seg.name, Decision.KEEP)
        rebuilt = _segment_prediction(cg, seg, dec, choice, t, mem, gathers)
        per_segment.append((mem.activations - held_before, rebuilt))
    live = nonsegmented - mem.post_segment           # held until the end of backward
    rebuilds = []
    for held, rebuilt in per_segment:
        live += held
        if rebuilt:
            rebuilds.append(live + rebuilt)
    mem.backward_peak = max(rebuilds, default=0.0)
    t.sync_wait = sync_wait_seconds(cg, choice, decisions, gathers, sync, t.optimizer)
    return t, mem


def objective_of(cg: CostGraph, choice: dict[str, int], decisions: dict[str, str],
                 options: SolverOptions) -> float:
    """The ILP's objective (seconds) at one assignment: :func:`predict`'s step time with the
    scheduled gradient sync replaced by the ILP's linear form of it (see :mod:`.steptime`), every
    parameter-gradient all-reduce priced there as if bucketed, and without the collectives' waits for
    drifted ranks (:mod:`.sync_wait`: no ILP term holds them), and the gradient all-reduces that
    consumers of a value share priced as :mod:`.shared_sync` prices them (whether or not a consumer
    reads the value resharded or leaves it to the buckets)."""
    t, _ = predict(cg, choice, decisions, options)
    gathers = param_gathers(cg, choice)
    sync = gradient_sync(cg, choice, gathers)
    per_edge, grouped = _gather_seconds(cg, choice, gathers)
    param_edges = chosen_param_edges(cg, choice)
    return (t.total - t.sync_wait - t.grad_sync - sync.inline + sync.deferred
            + sync.shared - shared_sync_credit(cg, choice) + _linear_grad_sync(cg, choice)
            + per_edge - grouped + param_edges.seconds - param_edges.replaced
            + _rerun_as_priced(cg, choice, decisions, gathers))


def _rerun_as_priced(cg: CostGraph, choice: dict[str, int], decisions: dict[str, str],
                     gathers: ParamGathers) -> float:
    """What the ILP's resharding re-run by recomputed segments (:func:`~.memory_model.rerun_cost`:
    every gatherable parameter pair taken as gathered) differs by from what :func:`predict` counts
    (the parameters the runtime gathers, ``gathers``)."""
    out = 0.0
    for seg in memory_segments(cg):
        decision = decisions.get(seg.name, Decision.KEEP)
        priced = sum(float(rerun_cost(cg, e)[e.src_index[choice[e.src]], e.dst_index[choice[e.dst]]])
                     for e in seg.rerun_edges_for(decision))
        out += priced - rerun_reshard_seconds(seg, decision, choice, gathers)
    return out


def _edge_seconds(e: CGEdge, choice: dict[str, int]) -> float:
    a, b = e.src_index[choice[e.src]], e.dst_index[choice[e.dst]]
    return float(e.fwd[a, b] + (e.bwd[a, b] if e.grad else 0.0))


def _gather_seconds(cg: CostGraph, choice: dict[str, int], gathers: ParamGathers) -> tuple[float, float]:
    """What the parameters gathered per block cost: priced per edge (the ILP's terms), and as the
    runtime runs them (one all-gather and one reduce-scatter per group)."""
    per_edge = sum(_edge_seconds(e, choice) for e in cg.edges if (e.dst_member, e.operand) in gathers.uses)
    grouped = 0.0
    for group in gathers.groups:
        nbytes = gathered_bytes(cg.graph, group)      # all-gathered in the working dtype
        grads = nbytes * (cg.precision.reduce_ratio if cg.precision is not None else 1.0)
        grouped += collective_cost("all_gather", nbytes, group.axes, cg.mesh.shape, cg.hardware) + \
            collective_cost("reduce_scatter", grads, group.axes, cg.mesh.shape, cg.hardware)
        n = math.prod(cg.mesh.shape[a] for a in group.axes)
        metas = [cg.graph.tensor_meta(p.name) for p in group.params]
        grouped += gather_flatten_seconds(nbytes / n, metas[0].dtype, cg.hardware)
        for p, meta in zip(group.params, metas):
            view = len(group.params) == 1 and math.prod(meta.shape[:p.dim]) == 1   # unflattened as a view
            grouped += gather_copy_seconds(meta.shape, p.dim, n, meta.dtype, cg.hardware, cg.precision, view)
    return per_edge, grouped


def _linear_grad_sync(cg: CostGraph, choice: dict[str, int]) -> float:
    """What :func:`grad_sync_terms` makes of an assignment."""
    mesh_shape, hw = cg.mesh.shape, cg.hardware
    backward_end = sum(backward_time(n.costs)[choice[n.name]] for n in cg.nodes.values())
    total = floor = 0.0
    for k, axes in enumerate(SYNC_AXES):
        nbytes = sum(int(n.costs.sync_bytes[choice[n.name], k]) for n in cg.nodes.values())
        if nbytes:
            price = SyncPricing.of(axes, mesh_shape, hw)
            total += nbytes * price.seconds_per_byte() + price.latency
            floor += price.latency
    dtype = cg.grad_sync_dtype()
    copies = sum(bucket_copy_seconds(hw, float(n.costs.sync_bytes[choice[n.name]].sum()), dtype)
                 for n in cg.nodes.values())
    return max(total - overlap_fraction(hw) * backward_end, floor) + copies


def gradient_reduction(cg: CostGraph, choice: dict[str, int]) -> GradReduction:
    """Which gradients the runtime all-reduces in buckets under ``choice``, and which inline
    all-reduces that spares (:func:`autoshard.grad_reduction.plan_gradient_reduction` on the
    chosen strategy of every graph node)."""
    return plan_gradient_reduction(grad_nodes(cg.graph, lambda n: cg.table[n.name].operand_nodes,
                                              _chosen_strategy(cg, choice), _resharded(cg, choice), cg.mesh.shape))


def _resharded(cg: CostGraph, choice: dict[str, int]) -> Callable[[str, int], bool]:
    """Whether node ``name`` reads its operand ``j`` resharded under ``choice`` (the producer's chosen
    output spec is not the one the node's strategy wants)."""
    graph = cg.graph
    fx_nodes = {n.name: n for n in graph.graph.nodes}
    strategy_of = _chosen_strategy(cg, choice)

    def resharded(name: str, j: int) -> bool:
        producer = cg.table[name].operand_nodes[j]
        if producer not in cg.node_of:
            return False
        wanted = strategy_of(name).input_specs[j]
        out = graph.output_index(fx_nodes[name], producer)
        return wanted is not None and strategy_of(producer).output_specs[out] != wanted

    return resharded


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
    ``backward_end``: the backward's length on the compute stream. ``shared``: seconds of the
    activation-gradient all-reduces that the strategies price per consumer where the runtime runs
    one for all consumers that read the value as produced (autograd sums their partial gradients
    first; the q, k and v projections of a tensor-parallel attention block share one). ``skipped``:
    the (graph node, operand index) pairs whose strategy's gradient all-reduce the runtime does not
    run inline (summed by a block's reduce-scatter, left to the buckets, or shared with an earlier
    consumer)."""

    synced: list[SyncedGradient]
    inline: float
    deferred: float
    backward_end: float
    shared: float = 0.0
    skipped: frozenset[tuple[str, int]] = frozenset()


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
        clock += backward_time(c)[s] + sum(e.bwd[e.src_index[choice[e.src]], e.dst_index[s]]
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
            axes, str(meta.dtype), cg.reduced_grad_bytes(param, cg.nodes[host].costs.grads[choice[host]]),
            max(finish[cg.node_of[u]] for u in users))))
    synced.sort(key=lambda item: item[0])
    inline = deferred = shared = 0.0
    skipped: set[tuple[str, int]] = set()
    resharded = _resharded(cg, choice)
    run_once: set[tuple[str, int, tuple[int, ...]]] = set()   # (value, its output, axes) all-reduced inline
    for node in cg.nodes.values():
        for member in node.members:
            strategy = node.member_strategy(member, choice[node.name])
            for a in strategy.comm:
                if a.phase != BWD or not a.operand.startswith("in"):
                    continue
                j = int(a.operand[2:])
                if (member, j) in gathers.uses or (member, j) in reduction.deferred:
                    skipped.add((member, j))                # its group's reduce-scatter, or the buckets
                    if not a.bucketed and (member, j) not in gathers.uses:
                        deferred += a.cost
                    continue
                # read as produced, consumers share the value's one all-reduce (see runtime.lower)
                key = None if resharded(member, j) else synced_value(cg, member, j, a.axes)
                if key in run_once:
                    shared += 0.0 if a.bucketed else a.cost
                    skipped.add((member, j))
                    continue
                if key is not None:
                    run_once.add(key)
                if a.bucketed:
                    inline += cg.as_run(a).cost
    return GradientSync([g for _, g in synced], inline, deferred, clock, shared, frozenset(skipped))


def _segment_prediction(cg: CostGraph, seg: MemorySegment, dec: str, choice: dict[str, int],
                        t: TimePrediction, mem: MemoryPrediction, gathers: ParamGathers) -> float:
    """Add one segment's held activations and time under decision ``dec`` to ``t`` and ``mem``;
    returns the bytes its backward brings back (recomputed or restored), 0 when none. A recomputed
    (or partitioned) segment runs its nodes' forward again, with the resharding of every operand
    read inside it (``gathers``: the parameters gathered per block, before the region, are not),
    and pays the checkpoint machinery (:func:`~.memory_model.checkpoint_overhead`)."""
    mesh_shape, hw = cg.mesh.shape, cg.hardware
    A = sum(cg.nodes[n].costs.saved[choice[n]] for n in seg.nodes)
    if dec == Decision.KEEP:
        mem.activations += A
        return 0.0
    if dec == Decision.SELECTIVE:
        if not seg.runs:
            raise ValueError(f"segment {seg.name!r} has no memory-bound run that selective "
                             "recomputation could free; keep or recompute it instead")
        run_saved = [_at(run.saved, choice) for run in seg.runs]
        mem.activations += A - sum(run_saved) + sum(_at(run.stored, choice) for run in seg.runs)
        mem.working_set = max(mem.working_set, *run_saved)
        t.recompute += (sum(_at(run.fwd, choice) for run in seg.runs) + rerun_reshard_seconds(seg, dec, choice, gathers)
                        + checkpoint_overhead(hw, seg, dec))
        return max(run_saved)
    if dec == Decision.OFFLOAD and not hw.device_memory_separate:
        mem.activations += A               # host memory is device memory: nothing freed
        t.offload += A / hw.host_device_bandwidth   # one copy, not hidden; restore copies nothing
        return 0.0
    F = sum(forward_time(cg.nodes[n].costs)[choice[n]] for n in seg.nodes)
    mem.working_set = max(mem.working_set, A)
    if dec == Decision.OFFLOAD:
        B = sum(cg.nodes[n].costs.compute_bwd[choice[n]] for n in seg.nodes)
        bw = hw.host_device_bandwidth
        t.offload += max(0.0, A / bw - F) + max(0.0, A / bw - B)
        return A
    full = part = gather = 0.0
    for e in seg.ckpt_edges:
        spec = e.src_specs[e.src_index[choice[e.src]]]
        nbytes = spec.local_numel(e.tensor.shape, mesh_shape) * e.tensor.dtype.itemsize
        axes = checkpoint_partition_axes(e, spec, mesh_shape)
        full += nbytes
        part += nbytes / math.prod(mesh_shape[x] for x in axes)
        gather += collective_cost("all_gather", nbytes, axes, mesh_shape, hw)
    F += rerun_reshard_seconds(seg, dec, choice, gathers) + checkpoint_overhead(hw, seg, dec)
    if dec == Decision.RECOMPUTE:
        mem.activations += full
        t.recompute += F
    elif dec == Decision.PARTITIONED:
        mem.activations += part
        t.recompute += F + gather
    else:
        raise ValueError(f"segment {seg.name!r}: unknown memory decision {dec!r}; use one of {', '.join(DECISIONS)}")
    return A


def rerun_reshard_seconds(seg: MemorySegment, decision: str, choice: dict[str, int],
                          gathers: ParamGathers) -> float:
    """Seconds of the forward resharding that ``seg`` runs again in backward under ``decision``
    (:meth:`~.segments.MemorySegment.rerun_edges_for`) and ``choice``; the parameters the runtime
    gathers per block (``gathers``) are gathered before the region, once."""
    return sum(float(e.fwd[e.src_index[choice[e.src]], e.dst_index[choice[e.dst]]])
               for e in seg.rerun_edges_for(decision) if (e.dst_member, e.operand) not in gathers.uses)


def _at(per_node: dict[str, np.ndarray], choice: dict[str, int]) -> float:
    """A run's per-CGNode vector (see :class:`~.selective.RecomputeRun`) at the chosen strategies."""
    return float(sum(values[choice[node]] for node, values in per_node.items()))
