"""How the ILP prices the edges out of parameters: per-block gathers and the copies they hold.

The runtime gathers a block's sharded parameters in one all-gather and reduce-scatters their
gradients in one collective (:mod:`autoshard.param_gather`); priced per resharded edge, each
parameter would pay the collectives' latency of its own (on a 2D mesh, one per axis), and ZeRO-3
looked two times dearer to the ILP than it runs. Here an edge whose producer is a parameter that
carries a gradient, stored with one dim sharded over the live mesh axes ``G``, and whose consumer
reads it replicated (a *gatherable* pair of specs) costs the bandwidth part of an all-gather and
a reduce-scatter over ``G`` of its bytes, and the local copies around them
(:func:`gather_copy_seconds`, its share of :func:`gather_flatten_seconds`); the latency of one all-gather and one reduce-scatter is
paid once per (block, ``G``) in which any such pair is chosen. Every other pair keeps its
resharding cost. The gradient of a gathered parameter stays priced by its consumer as a bucketed
all-reduce over the axes its computation is split over (the runtime reduce-scatters it over ``G``
instead, and buckets what is left): a small over-count that :func:`~.ilp.predict` does not share.

A parameter read resharded in any other way has its gradient all-reduced inline, in backward,
before it is resharded back (:mod:`autoshard.grad_reduction`: a resharded use stops the deferral to
the buckets), where its consumer's strategy priced that all-reduce as bucketed: ``inline[c]`` is
what the consumer's strategy ``c`` then pays on the critical path, owed whenever a ``resharded``
pair is chosen.

Memory: a parameter read in a layout larger than it is stored (gathered, or resharded for one use)
is a copy; where its consumer saves that operand for backward (a matmul's weight, a norm's scale;
not a bias, not an embedding table: the op's profile says which) the copy is held until backward,
and ``held`` prices it (bytes per device), as static memory. A parameter read twice in one block
is counted per read (the runtime gathers it once): an over-count on the safe side. Under mixed
precision every read is a copy, the parameter cast to the working dtype (the low-precision working
copy), held likewise when the consumer saves it (the runtime casts it before the first use, outside
any memory region, so a recomputed segment does not free it); a cast that is not saved (an
embedding table's, or a gathered parameter's shard before its all-gather) is transient and not
counted.

One description, used by the ILP's terms and by :func:`~.ilp.predict` / :func:`~.ilp.objective_of`
to evaluate an assignment exactly as the ILP does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from ..comm_cost import ALL_GATHER, REDUCE_SCATTER, collective_cost
from ..grad_reduction import Axes, live
from ..handlers.registry import op_info
from ..param_gather import gather_block, gather_blocks
from ..specs import ShardSpec
from ..strategy import BWD
from .costgraph import CGEdge, CostGraph

if TYPE_CHECKING:
    import torch

    from ..hardware import HardwareProfile
    from ..precision import MixedPrecision


@dataclass(frozen=True)
class ParamEdgePrice:
    """The ILP's price of one edge out of a parameter, over its (src spec, dst spec) grid.

    ``seconds``: what each pair costs (fwd + bwd; gatherable pairs without their latency);
    ``gather_axes``: per pair the axes ``G`` of a gatherable pair, else None; ``held``: bytes per
    device of the copy the consumer holds until backward; ``resharded``: the pairs read resharded
    but not gathered per block; ``inline``: per strategy of the consumer's CGNode, the seconds of
    the operand's gradient all-reduce that then runs inline; ``blocks``: the block of each of the
    edge group's edges (where the latency of their gathers is shared)."""

    seconds: np.ndarray
    gather_axes: np.ndarray
    held: np.ndarray
    resharded: np.ndarray
    inline: np.ndarray
    blocks: tuple[str, ...]


class ParamEdgeCost(NamedTuple):
    """The parameter edges of one assignment as the ILP prices them: ``seconds`` (resharding,
    gathers with their latencies, inline gradient all-reduces), ``held`` bytes per device, and
    ``replaced``, the plain edge resharding seconds they stand for."""

    seconds: float
    held: float
    replaced: float


def gather_latency(axes: Axes, mesh_shape: Sequence[int], hw) -> float:
    """Seconds of latency of one block's gather: an all-gather and a reduce-scatter of 0 bytes."""
    return sum(collective_cost(kind, 0, axes, mesh_shape, hw) for kind in (ALL_GATHER, REDUCE_SCATTER))


def gather_copy_seconds(shape: Sequence[int], dim: int, n: int, dtype: "torch.dtype", hw: "HardwareProfile",
                        precision: "MixedPrecision | None" = None, view: bool = False) -> float:
    """The local copies the runtime makes of one parameter around its block's gather over ``n``
    devices (:class:`autoshard.runtime.collectives._GatherParams`), ``shape`` the whole parameter
    in the working ``dtype``, sharded along ``dim``: forward, the whole tensor out of the gathered
    blocks (no copy where that is a ``view``) and, under mixed precision, its shard cast from the
    master dtype; backward, the whole gradient into the reduce-scatter's blocks in the reduce dtype
    (and this device's block back to the master dtype where that differs). The copies that lay
    blocks out move runs of the shard's ``dim`` and the dims inside it. The block's shards are
    copied into the all-gather's buffer in one more copy (:func:`gather_flatten_seconds`)."""
    numel = math.prod(shape)
    local = list(shape)
    local[dim] //= n
    run = math.prod(local[dim:])
    seconds = 0.0 if view else hw.copy_seconds(numel * dtype.itemsize, str(dtype), run)
    grad_dtype = dtype if precision is None else precision.reduce
    seconds += hw.copy_seconds(numel * grad_dtype.itemsize, str(grad_dtype), run)
    if precision is not None:
        master = precision.master
        seconds += hw.copy_seconds(numel / n * master.itemsize, str(master))
        if grad_dtype != master:
            seconds += hw.copy_seconds(numel / n * master.itemsize, str(master))
    return seconds


def gather_flatten_seconds(nbytes: float, dtype: "torch.dtype", hw: "HardwareProfile", marginal: bool = False) -> float:
    """The one copy of a block's shards (``nbytes`` per device) into its all-gather's flat buffer;
    ``marginal``: what ``nbytes`` more adds to a larger copy (a parameter's share of its block's,
    as the ILP prices it per parameter)."""
    if marginal:
        return hw.copy_seconds(2 * nbytes, str(dtype)) - hw.copy_seconds(nbytes, str(dtype))
    return hw.copy_seconds(nbytes, str(dtype))


def param_edge_prices(cg: CostGraph) -> dict[int, ParamEdgePrice]:
    """``id(edge)`` of every edge group's representative edge out of a parameter placeholder ->
    its price (edges of one group share it; see :meth:`CostGraph.edge_groups`)."""
    graph = cg.graph
    out: dict[int, ParamEdgePrice] = {}
    stacked = gather_blocks(graph.module_classes())
    for eg in cg.edge_groups():
        e = eg.edge
        if cg.nodes[e.src].kind != "placeholder" or e.src_member not in graph.param_fqn:
            continue
        blocks = tuple(gather_block(graph.module_path(x.dst_member), stacked) for x in eg.edges)
        out[id(e)] = _price(cg, e, blocks)
    return out


def _price(cg: CostGraph, e: CGEdge, blocks: tuple[str, ...]) -> ParamEdgePrice:
    mesh_shape, hw = cg.mesh.shape, cg.hardware
    shape, item = e.tensor.shape, e.tensor.dtype.itemsize
    full = float(np.prod(shape, dtype=np.int64)) * item
    carries_grad = e.grad and cg.graph.requires_grad(e.src_member)
    seconds = (e.fwd + (e.bwd if e.grad else 0.0)).astype(float)
    gather_axes = np.full(seconds.shape, None, dtype=object)
    held = np.zeros(seconds.shape)
    resharded = np.zeros(seconds.shape, dtype=bool)
    saved = _saved_by_consumer(cg, e)
    # Under mixed precision every read is a copy (the parameter cast to the working dtype, the
    # dtype of the graph), and a gradient is reduce-scattered in the reduce dtype.
    cast = cg.precision is not None and e.tensor.dtype.is_floating_point
    grad_full = full * (cg.precision.reduce_ratio if cast else 1.0)   # type: ignore[union-attr]
    for a, src in enumerate(e.src_specs):
        src_bytes = src.local_numel(shape, mesh_shape) * item
        axes = _gather_axes(src, mesh_shape) if carries_grad else None
        copies = 0.0
        if axes is not None:
            n = math.prod(mesh_shape[x] for x in axes)
            copies = (gather_copy_seconds(shape, _gathered_dim(src, mesh_shape), n, e.tensor.dtype, hw,
                                          cg.precision if cast else None)
                      + gather_flatten_seconds(full / n, e.tensor.dtype, hw, marginal=True))
        for b, dst in enumerate(e.dst_specs):
            dst_bytes = dst.local_numel(shape, mesh_shape) * item
            if saved and (cast or dst_bytes > src_bytes):
                held[a, b] = dst_bytes
            if axes is not None and dst.is_replicated():
                gather_axes[a, b] = axes
                seconds[a, b] = sum(collective_cost(kind, nbytes, axes, mesh_shape, hw)
                                    - collective_cost(kind, 0, axes, mesh_shape, hw)
                                    for kind, nbytes in ((ALL_GATHER, full), (REDUCE_SCATTER, grad_full))) + copies
            else:
                resharded[a, b] = carries_grad and src != dst
    consumer = cg.nodes[e.dst]
    inline = np.array([sum(cg.as_run(c).cost for c in consumer.member_strategy(e.dst_member, k).comm
                           if c.phase == BWD and c.bucketed and c.operand == f"in{e.operand}")
                       for k in range(len(e.dst_index))])
    return ParamEdgePrice(seconds, gather_axes, held, resharded, inline, blocks)


def _saved_by_consumer(cg: CostGraph, e: CGEdge) -> bool:
    """Whether the consumer keeps operand ``e.operand`` for its backward (its op profile's saved
    inputs, the list the strategies' saved-activation bytes come from)."""
    node = cg.graph.node(e.dst_member)
    if node.op != "call_function":
        return False
    profile = op_info(node, cg.graph, cg.mesh).profile()
    return any(s.source == "input" and s.index == e.operand for s in profile.saved)


def _gather_axes(spec: ShardSpec, mesh_shape: Sequence[int]) -> Axes | None:
    """The live axes ``G`` of a spec with exactly one dim sharded over live axes and nothing
    partial (a layout the runtime can gather per block), else None."""
    if spec.partial:
        return None
    sharded = [d for d in spec.dims if live(d, mesh_shape)]
    if len(sharded) != 1:
        return None
    return live(sharded[0], mesh_shape)


def _gathered_dim(spec: ShardSpec, mesh_shape: Sequence[int]) -> int:
    """The dim of a gatherable spec (:func:`_gather_axes`) sharded over live axes."""
    return next(d for d, axes in enumerate(spec.dims) if live(axes, mesh_shape))


def chosen_param_edges(cg: CostGraph, choice: dict[str, int],
                       prices: dict[int, ParamEdgePrice] | None = None) -> ParamEdgeCost:
    """The parameter edges under ``choice``, priced as the ILP prices them (latency once per
    block and gather axes)."""
    prices = param_edge_prices(cg) if prices is None else prices
    seconds = held = replaced = 0.0
    latencies: set[tuple[str, Axes]] = set()
    for eg in cg.edge_groups():
        price = prices.get(id(eg.edge))
        if price is None:
            continue
        for e, block in zip(eg.edges, price.blocks):
            a, b = e.src_index[choice[e.src]], e.dst_index[choice[e.dst]]
            seconds += float(price.seconds[a, b])
            held += float(price.held[a, b])
            replaced += float(e.fwd[a, b] + (e.bwd[a, b] if e.grad else 0.0))
            if price.resharded[a, b]:
                seconds += float(price.inline[choice[e.dst]])
            if price.gather_axes[a, b] is not None:
                latencies.add((block, price.gather_axes[a, b]))
    seconds += sum(gather_latency(axes, cg.mesh.shape, cg.hardware) for _, axes in latencies)
    return ParamEdgeCost(seconds, held, replaced)
