"""A plan from a solver's solution: per node the chosen strategy with its specs and costs, the
reshardings on the edges with their steps, the memory decisions, the predicted memory, step time and
communication volume, and the call signature of the captured graph (:func:`plan_from_solution`).

This is the one plan module that needs the solver (its segments, gradient reduction and parameter
gathers); the runtime never imports it (see :mod:`autoshard.plans`).
"""
from __future__ import annotations

import dataclasses
import datetime
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable

from ..decisions import RECOMPUTING, Decision
from ..handlers.registry import op_info
from ..param_gather import gathered_bytes
from ..reshard import ReshardStep, reshard_plan
from ..solver.evaluate import gradient_reduction, gradient_sync, param_gathers
from ..solver.segments import checkpoint_partition_axes, memory_segments
from ..specs import ShardSpec
from ..strategy import BWD, FWD, Strategy, local_bytes
from ..version import __version__
from .jsonio import jsonable
from .schema import (PLAN_FORMAT_VERSION, RECOMPUTE, CollectiveEntry, CommEntry, NodePlan, Plan, ReshardEntry,
                     SolverReport, StepEntry, node_memory_regions)

if TYPE_CHECKING:
    import torch.fx as fx

    from ..capture import CapturedGraph
    from ..solver.costgraph import CostGraph
    from ..solver.results import Solution, SolverOptions

__all__ = ["input_signature", "plan_from_solution"]


def plan_from_solution(cg: CostGraph, solution: Solution, *, model_name: str, options: SolverOptions,
                       budget: int | None, timings: dict[str, float] | None = None) -> Plan:
    """The plan of an ILP ``solution`` over cost graph ``cg``.

    ``budget`` is the per-device memory budget in bytes the solution was asked to meet (None:
    unconstrained); ``timings`` the seconds of each planning stage.
    """
    choice = cg.graph_choice(solution.choice)
    nodes = {ns.node: _node_plan(cg, ns.node, _strategy(cg, ns.node, choice), choice) for ns in cg.table}
    reshards = _reshards(cg, choice)
    decisions = {seg: str(d) for seg, d in solution.decisions.items()}
    runs = _selective_runs(cg, decisions)
    memory = {k: float(v) for k, v in solution.memory.to_dict().items()}
    if Decision.OFFLOAD in decisions.values():
        memory["offloaded"] = float(_offloaded_bytes(cg, nodes.values(), decisions, reshards))
    return Plan(
        format_version=PLAN_FORMAT_VERSION,
        autoshard_version=__version__,
        model_name=model_name,
        fingerprint=cg.graph.fingerprint(),
        mesh_shape=[int(s) for s in cg.mesh.shape],
        hardware=jsonable(cg.hardware.to_dict()),
        memory_budget=None if budget is None else int(budget),
        solver_options=jsonable(dataclasses.asdict(options)),
        nodes=nodes,
        segments=decisions,
        reshards=reshards,
        memory=memory,
        time={k: float(v) for k, v in solution.time.to_dict().items()},
        comm=_comm_entries(nodes.values(), reshards, _recomputed(nodes.values(), decisions, runs),
                           _partition_gathers(cg, solution), _gradient_buckets(cg, solution),
                           _param_gathers(cg, solution)),
        solver=SolverReport(str(solution.status), float(solution.objective),
                            float(solution.build_seconds), float(solution.solve_seconds),
                            int(solution.n_variables), int(solution.n_constraints), str(solution.solver),
                            solution.gap, solution.stats.get("note")),
        timings={k: float(v) for k, v in (timings or {}).items()},
        fallbacks=list(cg.table.fallbacks),
        inputs=input_signature(cg.graph),
        recompute_runs=runs,
        outputs=cg.table.outputs,
        batch_norm=cg.table.batch_norm,
        loss=cg.table.loss,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        mixed_precision=cg.precision,
    )


def input_signature(graph: "CapturedGraph") -> dict[str, Any] | None:
    """The JSON form of the graph's call signature (see :attr:`Plan.inputs`), or None."""
    import torch.utils._pytree as pytree
    from torch.export.graph_signature import InputKind

    leaves: list[dict[str, Any]] = []
    for spec in graph.exported.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        name = spec.arg.name
        meta = graph.tensor_meta(name) if name not in graph.constant_inputs else None
        if meta is None or isinstance(meta, tuple):
            value = graph.constant_inputs.get(name)
            if not isinstance(value, (bool, int, float, str, type(None))):
                return None
            leaves.append({"value": value})
        else:
            leaves.append({"shape": [int(d) for d in meta.shape], "dtype": str(meta.dtype).removeprefix("torch.")})
    try:
        in_spec = pytree.treespec_dumps(graph.exported.call_spec.in_spec)
    except (TypeError, NotImplementedError):     # a container pytree cannot serialise
        return None
    return {"in_spec": in_spec, "leaves": leaves}


def _strategy(cg: "CostGraph", name: str, choice: dict[str, int]) -> Strategy:
    return cg.table[name].strategies[choice[name]]


def _stored(cg: "CostGraph", placeholder: str, nbytes: int) -> int:
    """Bytes of a placeholder's parameter (or gradient) as stored: the master dtype's under mixed precision."""
    meta = cg.graph.tensor_meta(placeholder)
    if not nbytes or meta is None:
        return int(nbytes)
    return int(nbytes) // meta.dtype.itemsize * cg.stored_itemsize(placeholder)


def _node_plan(cg: "CostGraph", name: str, s: Strategy, choice: dict[str, int]) -> NodePlan:
    graph = cg.graph
    ns = cg.table[name]
    kind = graph.node(name).op
    stores = kind == "placeholder"
    m = s.memory
    # An operand taken as produced (input spec None) is recorded in its producer's layout.
    inputs = [x if x is not None else _strategy(cg, producer, choice).output_specs[_output_index(cg, name, j)]
              for j, (x, producer) in enumerate(zip(s.input_specs, ns.operand_nodes))]
    return NodePlan(
        name=name, kind=kind, op=ns.op, module=ns.module_path, fqn=_fqn(graph, name),
        segment=cg.nodes[cg.node_of[name]].segment, strategy=s.name,
        inputs=[str(x) for x in inputs],
        outputs=[None if x is None else str(x) for x in s.output_specs],
        compute_fwd=float(s.compute_fwd), compute_bwd=float(s.compute_bwd),
        collectives=[CollectiveEntry(c.kind, [int(a) for a in c.axes], int(c.nbytes), str(c.phase), c.operand,
                                     float(c.cost), bool(c.bucketed)) for c in map(cg.as_run, s.comm)],
        memory={"params": _stored(cg, name, m.params) if stores else 0,
                "grads": _stored(cg, name, m.grads) if stores else 0,
                "saved": int(m.saved), "outputs": int(m.outputs)},
        operands=list(ns.operand_nodes), tags=[str(t) for t in s.tags], split=int(s.split),
    )


def _fqn(graph: "CapturedGraph", name: str) -> str | None:
    for table in (graph.param_fqn, graph.buffer_fqn, graph.constant_fqn, graph.user_input_specs):
        if name in table:
            return str(table[name])
    return None


def _tensor_edges(cg: "CostGraph") -> Iterable[tuple[str, str, int, int, Any, bool]]:
    """Every tensor edge of the graph as (producer, consumer, operand, producer output, tensor
    meta, gradient flows): the cost graph's edges and those inside merged nodes."""
    for e in cg.edges:
        yield e.src_member, e.dst_member, e.operand, e.src_output, e.tensor, e.grad
    graph = cg.graph
    for node in cg.nodes.values():
        for follower in node.members[1:]:
            producer = cg.table[follower].operand_nodes[0]
            out_idx = _output_index(cg, follower)
            meta = graph.tensor_meta(producer)
            meta = meta[out_idx] if isinstance(meta, tuple) else meta
            if meta is None:
                continue
            grad = bool(meta.requires_grad and graph.requires_grad(follower))
            yield producer, follower, 0, out_idx, meta, grad


def _output_index(cg: "CostGraph", consumer: str, operand: int = 0) -> int:
    """Which output of its producer operand ``operand`` of ``consumer`` reads (a getitem of a
    tuple reads element ``args[1]``, anything else output 0)."""
    return cg.graph.output_index(consumer, cg.table[consumer].operand_nodes[operand])


def _reshards(cg: "CostGraph", choice: dict[str, int]) -> list[ReshardEntry]:
    """The non-identity reshardings under ``choice``, in graph order of their consumer."""
    order = {ns.node: i for i, ns in enumerate(cg.table)}
    out = []
    for src, dst, operand, out_idx, meta, grad in _tensor_edges(cg):
        src_spec = _strategy(cg, src, choice).output_specs[out_idx]
        dst_spec = _strategy(cg, dst, choice).input_specs[operand]
        if src_spec is None or src_spec == dst_spec:
            continue
        out.append(_reshard_entry(cg, src, dst, operand, out_idx, meta, grad, src_spec, dst_spec))
    out.sort(key=lambda r: (order[r.dst], r.operand))
    return out


def _reshard_entry(cg: "CostGraph", src: str, dst: str, operand: int, out_idx: int, meta: Any,
                   grad: bool, src_spec: ShardSpec, dst_spec: ShardSpec) -> ReshardEntry:
    args = (meta.shape, meta.dtype.itemsize, cg.mesh.shape, cg.hardware, str(meta.dtype))
    fwd = reshard_plan(src_spec, dst_spec, *args)
    bwd = reshard_plan(dst_spec, src_spec, *args) if grad else None
    return ReshardEntry(
        src=src, dst=dst, operand=operand, src_output=out_idx, shape=[int(d) for d in meta.shape],
        dtype=str(meta.dtype).removeprefix("torch."), src_spec=str(src_spec), dst_spec=str(dst_spec),
        fwd=[_step_entry(s) for s in fwd.steps], bwd=[_step_entry(s) for s in bwd.steps] if bwd else [],
        cost_fwd=float(fwd.cost), cost_bwd=float(bwd.cost) if bwd else 0.0)


def _step_entry(step: ReshardStep) -> StepEntry:
    return StepEntry(step.kind, int(step.axis), [int(d) for d in step.dims], int(step.nbytes),
                     float(step.cost), str(step.after), str(step))


def _partition_gathers(cg: "CostGraph", solution: "Solution") -> list[tuple[str, list[int], int]]:
    """(segment, axes, bytes) of the all-gathers that rebuild partitioned checkpoints."""
    parted = {seg for seg, d in solution.decisions.items() if d == Decision.PARTITIONED}
    if not parted:
        return []
    mesh_shape = cg.mesh.shape
    out = []
    for seg in memory_segments(cg):
        if seg.name not in parted:
            continue
        for e in seg.ckpt_edges:
            spec = e.src_specs[e.src_index[solution.choice[e.src]]]
            axes = list(checkpoint_partition_axes(e, spec, mesh_shape))
            if axes:
                out.append((seg.name, axes, spec.local_numel(e.tensor.shape, mesh_shape) * e.tensor.dtype.itemsize))
    return out


def _offloaded_bytes(cg: "CostGraph", nodes: Iterable[NodePlan], decisions: dict[str, str],
                     reshards: list[ReshardEntry]) -> int:
    """Bytes per device that host offload copies away in a step: the saved activations of the
    offloaded segments' nodes, a tensor that several ops of one segment save (RMSNorm's input,
    saved by pow and mul; rotary tables) counted once, as the offload hooks copy it once.

    The ILP counts such a tensor once per op that saves it (an over-count, so its memory model errs
    on the safe side); this is the exact figure. A saved operand is the producer's tensor unless the
    plan reshards it into the consumer (then a tensor of its own); parameters are never offloaded.
    """
    graph, mesh = cg.graph, cg.mesh
    nodes = list(nodes)
    by_name = {n.name: n for n in nodes}
    resharded = {(r.dst, r.operand) for r in reshards}
    seen: dict[str, set[tuple]] = defaultdict(set)
    total = 0
    for node in nodes:
        if node.kind != "call_function" or decisions.get(node.segment or "") != Decision.OFFLOAD:
            continue
        total += node.memory["saved"]
        op = op_info(graph.node(node.name), graph, mesh)
        for saved in op.profile().saved:
            compact = None
            if saved.source == "input" and not op.operand_is_param(saved.index):
                key = _saved_operand_key(node.name, saved.index, op.operand_nodes[saved.index], resharded)
                if saved.scale != 1.0:      # a copy in another dtype (SDPA's additive mask): a tensor of its own
                    key = (*key, saved.scale)
                elif key[0] != "resharded":
                    compact = _broadcast_view_bytes(graph, by_name, resharded, op.operand_nodes[saved.index], mesh)
                meta, spec = op.operands[saved.index], node.inputs[saved.index]
            elif saved.source == "output":
                key, meta, spec = (node.name, saved.index), op.outputs[saved.index], node.outputs[saved.index]
            else:
                continue
            counted = round(local_bytes(meta, ShardSpec.parse(spec), mesh.shape) * saved.scale)
            if key in seen[str(node.segment)]:
                total -= counted
            elif compact is not None:       # the hooks copy a broadcast view as the memory it reads
                total -= counted - compact
            seen[str(node.segment)].add(key)
    return total


def _broadcast_view_bytes(graph: "CapturedGraph", nodes: dict[str, NodePlan], resharded: set[tuple[str, int]],
                          value: "fx.Node", mesh) -> int | None:
    """Bytes the offload hooks copy of ``value`` where, on each device, it is a view of a broadcast
    (an ``expand`` followed by reshapes, each read as produced: a grouped-query attention's key and
    value heads repeated, whose local shard keeps the repeat as a stride-0 dimension): the memory it
    reads (see :func:`autoshard.memory.host_offload.unbroadcast`). None where it is not one. The
    chain is replayed on meta tensors with each node's local shape, as the runtime runs it."""
    import torch

    from ..handlers.reshape import RESHAPES
    from ..memory.host_offload import unbroadcast

    chain = []
    while (value.target in RESHAPES and (value.name, 0) not in resharded
           and isinstance(value.args[0], torch.fx.Node)):
        chain.append(value)
        value = value.args[0]
    if str(value.target) != "aten.expand.default" or value.name not in nodes:
        return None
    chain.append(value)

    def local(name: str, spec: str) -> tuple[int, ...]:
        return ShardSpec.parse(spec).local_shape(graph.tensor_meta(name).shape, mesh.shape)

    source = value.args[0]
    t = torch.empty(local(source.name, nodes[value.name].inputs[0]), device="meta",
                    dtype=graph.tensor_meta(value.name).dtype)
    for n in reversed(chain):
        shape = local(n.name, nodes[n.name].outputs[0])
        t = t.expand(shape) if n is value else t.reshape(shape)
    compact = unbroadcast(t)
    return compact.numel() * compact.element_size() if compact is not t else None


def _saved_operand_key(consumer: str, index: int, operand: "fx.Node", resharded: set[tuple[str, int]]) -> tuple:
    """Identity of the tensor a consumer saves for operand ``index``: its own resharded copy, or the
    producer's output (an element of a multi-output node read through ``getitem`` is that node's
    output)."""
    import operator

    import torch.fx as fx

    if (consumer, index) in resharded:
        return ("resharded", consumer, index)
    if operand.target is operator.getitem and isinstance(operand.args[0], fx.Node):
        return (operand.args[0].name, int(operand.args[1]))
    return (operand.name, 0)


def _selective_runs(cg: "CostGraph", decisions: dict[str, str]) -> dict[str, list[list[str]]]:
    """Per selective segment, the graph nodes of each run it recomputes."""
    if Decision.SELECTIVE not in decisions.values():
        return {}
    return {seg.name: [list(run.nodes) for run in seg.runs] for seg in memory_segments(cg)
            if decisions.get(seg.name) == Decision.SELECTIVE}



def _recomputed(nodes: Iterable[NodePlan], decisions: dict[str, str], runs: dict[str, list[list[str]]]
                ) -> set[str]:
    """The call_function nodes whose forward runs again in backward (recomputed, partitioned, and
    the runs of selective segments)."""
    return {n for n, (_, d) in node_memory_regions(nodes, decisions, runs).items() if d in RECOMPUTING}


def _gradient_buckets(cg: "CostGraph", solution: "Solution") -> tuple[frozenset[tuple[str, int]], list[tuple[tuple[int, ...], int]]]:
    """The strategies' gradient all-reduces the runtime does not run inline ((node, operand) pairs:
    left to its buckets, summed by a block's reduce-scatter, or shared with another consumer of the
    value; :func:`~autoshard.solver.evaluate.gradient_sync`, which prices the same) and the bucketed
    parameter gradients ((axes, bytes per device) each), see :mod:`autoshard.grad_reduction`."""
    gathers = param_gathers(cg, solution.choice)
    reduction = gradient_reduction(cg, solution.choice)
    buckets = []
    for param, axes in {**reduction.bucketed, **gathers.leftover()}.items():
        host = cg.node_of[param]
        buckets.append((axes, cg.reduced_grad_bytes(param, cg.nodes[host].costs.grads[solution.choice[host]])))
    return gradient_sync(cg, solution.choice, gathers).skipped, buckets


def _param_gathers(cg: "CostGraph", solution: "Solution") -> tuple[frozenset[tuple[str, int]],
                                                                   list[tuple[tuple[int, ...], int, int]]]:
    """The (node, operand) pairs that read a parameter gathered with its block, and per gather
    group its mesh axes, bytes per device and bytes of its gradients' reduce-scatter (in the reduce
    dtype under mixed precision; see :mod:`autoshard.param_gather`)."""
    gathers = param_gathers(cg, solution.choice)
    ratio = cg.precision.reduce_ratio if cg.precision is not None else 1.0   # gradients in the reduce dtype
    return gathers.uses, [(g.axes, gathered_bytes(cg.graph, g), int(round(gathered_bytes(cg.graph, g) * ratio)))
                          for g in gathers.groups]


def _comm_entries(nodes: Iterable[NodePlan], reshards: list[ReshardEntry], recomputed: set[str],
                  gathers: list[tuple[str, list[int], int]],
                  grad_buckets: tuple[frozenset[tuple[str, int]], list[tuple[tuple[int, ...], int]]],
                  param_gathers: tuple[frozenset[tuple[str, int]], list[tuple[tuple[int, ...], int, int]]]
                  ) -> list[CommEntry]:
    """Bytes per device per step by (kind, axes, phase): every node's collectives and every
    resharding's collective steps, forward and backward, the gradient all-reduces left to the
    buckets counted once per parameter (``grad_buckets``: the (node, operand) pairs whose gradient
    all-reduce does not run inline, and the bucketed gradients), the parameters gathered per block
    (``param_gathers``: the uses they replace, whose resharding and gradient all-reduce do not run,
    and per group one all-gather forward and one reduce-scatter backward); plus, phase
    ``recompute``, what runs again in backward (the forward collectives of the ``recomputed`` nodes,
    the forward reshardings into them) and the all-gathers of partitioned checkpoints."""
    totals: dict[tuple[str, tuple[int, ...], str], list[int]] = defaultdict(lambda: [0, 0])

    def add(kind: str, axes: Iterable[int], phase: str, nbytes: int) -> None:
        t = totals[(kind, tuple(axes), phase)]
        t[0] += int(nbytes)
        t[1] += 1

    not_inline, buckets = grad_buckets
    gathered, groups = param_gathers
    for node in nodes:
        again = node.name in recomputed
        for c in node.collectives:
            if c.phase == BWD and c.operand.startswith("in") and (node.name, int(c.operand[2:])) in not_inline:
                continue
            add(c.kind, c.axes, c.phase, c.nbytes)
            if again and c.phase == FWD:
                add(c.kind, c.axes, RECOMPUTE, c.nbytes)
    for r in reshards:
        if (r.dst, r.operand) in gathered:
            continue
        again = r.dst in recomputed
        for phase, steps in ((FWD, r.fwd), (BWD, r.bwd)):
            for step in steps:
                if step.is_collective:
                    add(step.kind, [step.axis], phase, step.nbytes)
                    if again and phase == FWD:
                        add(step.kind, [step.axis], RECOMPUTE, step.nbytes)
    for axes, nbytes in buckets:
        add("all_reduce", axes, BWD, nbytes)
    for axes, nbytes, grad_bytes in groups:
        add("all_gather", axes, FWD, nbytes)
        add("reduce_scatter", axes, BWD, grad_bytes)
    for _, axes, nbytes in gathers:
        add("all_gather", axes, RECOMPUTE, nbytes)
    return [CommEntry(kind, list(axes), str(phase), n, count)
            for (kind, axes, phase), (n, count) in sorted(totals.items())]
