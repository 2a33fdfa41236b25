"""Building the cost graph (:func:`build_cost_graph`): one node per graph node with its strategies'
cost vectors, edges priced over the distinct producer/consumer specs with the optimal resharding,
followers (views, casts, unary pointwise ops) merged into their producer, and identical repeated
blocks aliased to share decision variables. The graph's types and what they mean are in
:mod:`.costgraph`."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ..capture import TensorMeta
from ..enumerate import StrategyTable
from ..opinfo import freeze_args, op_name
from ..phases import Phase
from ..reshard import ReshardTable, reshard_table
from ..specs import ShardSpec
from ..strategy import BWD, FWD, CommAction, MemoryCost, Strategy
from .costgraph import (FOLLOWER_FAMILIES, StrategyCosts, CGNode, CGEdge, CostGraph, block_of, _segment_name)
from .steptime import optimizer_seconds

if TYPE_CHECKING:
    from ..precision import MixedPrecision

__all__ = ["build_cost_graph"]


def build_cost_graph(table: StrategyTable, *, merge_followers: bool = True,
                     alias_blocks: bool = True, precision: "MixedPrecision | None" = None) -> CostGraph:
    """The cost graph of a strategy table.

    ``merge_followers``: fold single-operand view/cast/pointwise/getitem/assert nodes into their
    producer (same segment only; never into placeholders or the output). This is a *heuristic*:
    it fixes the follower's strategy per producer strategy (the one minimising resharding +
    the follower's own cost), which may exclude the global optimum. Off, the graph is exact:
    one CGNode per graph node with its full strategy list.

    ``alias_blocks``: nodes of identical repeated blocks (same ops, shapes, arguments, strategies
    and internal edges) share one decision group. Exact in cost: only identical blocks alias.

    ``precision``: the mixed-precision policy the graph (captured with parameters in its working
    dtype) runs under: a parameter placeholder's ``params``/``grads``/``optimizer`` then count its
    master shard, the gradient kept there and the optimizer step over it (master dtype), and
    ``sync_bytes`` the gradient all-reduces in the reduce dtype (see :mod:`autoshard.precision`).
    """
    start = time.perf_counter()
    b = _Builder(table, precision)
    b.base_nodes()
    t_nodes = time.perf_counter()
    if merge_followers:
        b.merge_followers()
    t_merge = time.perf_counter()
    edges = b.edges()
    t_edges = time.perf_counter()
    cg = CostGraph(table, b.nodes, edges, merged=merge_followers, aliased=alias_blocks, precision=precision)
    classes = _identical_blocks(cg, b)
    cg.identical_blocks = [blocks for _, blocks in classes]
    if alias_blocks:
        _alias_blocks(cg, classes)
    end = time.perf_counter()
    cg.build_seconds = end - start
    cg.timings = {"nodes_s": t_nodes - start, "merge_s": t_merge - t_nodes,
                  "edges_s": t_edges - t_merge, "alias_s": end - t_edges}
    return cg


class _Reshard:
    """One tensor's all-pairs resharding table, with its costs as a matrix over its states."""

    def __init__(self, table: ReshardTable) -> None:
        self.table = table
        states = table.states
        self.dist = _readonly(np.array([[table.cost(s, d) for d in states] for s in states]))
        self._nbytes: dict[tuple[int, int], int] = {}
        self._steps: dict[tuple[int, int], int] = {}

    def steps(self, src: int, dst: int) -> int:
        """Moves (splits and collectives) of the cheapest resharding from state ``src`` to ``dst``."""
        if src == dst:
            return 0
        key = (src, dst)
        hit = self._steps.get(key)
        if hit is None:
            hit = self._steps[key] = len(self.table.plan(self.table.states[src], self.table.states[dst]).steps)
        return hit

    def nbytes(self, src: int, dst: int) -> int:
        """Bytes per device moved by the cheapest resharding from state ``src`` to ``dst``."""
        key = (src, dst)
        if key not in self._nbytes:
            s, d = self.table.states[src], self.table.states[dst]
            self._nbytes[key] = 0 if src == dst else sum(c.nbytes for c in self.table.plan(s, d).collectives())
        return self._nbytes[key]


_RESHARDS: dict[int, _Reshard] = {}
"""id(ReshardTable) -> its matrix form; each entry holds its table, so the id stays valid."""


class _Builder:
    """The steps of :func:`build_cost_graph`, sharing the table and caches.

    Identical layers share strategy-list objects (the enumerator caches them by op signature), so
    per-list results (cost vectors, spec -> state indices, merges) are cached by list identity;
    each cache entry keeps its key objects alive so the ids stay valid.
    """

    def __init__(self, table: StrategyTable, precision: "MixedPrecision | None" = None) -> None:
        self.table = table
        self.precision = precision
        self.graph = table.graph
        self.fx = {n.name: n for n in table.graph.graph.nodes}
        self.blocks = {name: block_of(self.graph, n) for name, n in self.fx.items()}
        self.nodes: dict[str, CGNode] = {}
        self.node_of: dict[str, str] = {}
        self._reshards: dict[tuple, _Reshard] = {}
        self._cost_cache: dict[tuple[int, bool], tuple[StrategyCosts, list]] = {}
        self._state_cache: dict[tuple, tuple[np.ndarray, list]] = {}
        self._merges: dict[tuple, tuple] = {}
        self._matrices: dict[tuple, tuple[np.ndarray, ...]] = {}
        self._distinct_cache: dict[tuple, tuple[tuple[int, ...], np.ndarray]] = {}
        self._list_keys: dict[int, tuple[int, list]] = {}
        self._list_ids: dict[tuple, int] = {}
        mesh_shape, hw = table.mesh.shape, table.hardware
        live = [hw.axes[a].alpha for a in range(len(mesh_shape)) if mesh_shape[a] > 1]
        self._merge_slack = min(live, default=0.0)    # one collective step's latency (see _tie_break)

    # -- nodes -----------------------------------------------------------------------------------

    def base_nodes(self) -> None:
        """One CGNode per graph node, with the table's strategies."""
        for ns in self.table:
            self.nodes[ns.node] = CGNode(
                name=ns.node, kind=self.fx[ns.node].op, members=[ns.node], strategies=ns.strategies,
                member_index={ns.node: _readonly(np.arange(len(ns.strategies)))},
                member_strategies={ns.node: ns.strategies},
                costs=self._costs(ns.strategies, stores_params=self.fx[ns.node].op == "placeholder"),
                segment=_segment_name(self.blocks[ns.node]))
            self.node_of[ns.node] = ns.node

    def merge_followers(self) -> None:
        """Fold followers into their producer's CGNode, in graph order (chains merge transitively)."""
        for ns in self.table:
            producer = self._follower_producer(ns.node)
            if producer is None:
                continue
            host = self.nodes[self.node_of[producer]]
            self._merge(host, producer, ns.node)
            del self.nodes[ns.node]
            self.node_of[ns.node] = host.name

    def _follower_producer(self, name: str) -> str | None:
        """The producer ``name`` merges into, or None when it is not a mergeable follower: a
        call_function of a follower family with one tensor operand, produced by a call_function
        node (not a placeholder, not the output) of the same segment."""
        from ..handlers import handler_for

        ns = self.table[name]
        node = self.fx[name]
        if node.op != "call_function" or ns.fallback or len(ns.operand_nodes) != 1 or not ns.strategies:
            return None
        handler = handler_for(node.target)
        if handler is None or handler.family not in FOLLOWER_FAMILIES:
            return None
        producer = ns.operand_nodes[0]
        host = self.nodes[self.node_of[producer]]
        if host.kind != "call_function" or host.segment != self.nodes[name].segment:
            return None
        return producer

    def _merge(self, host: CGNode, producer: str, follower: str) -> None:
        """Add ``follower`` (consuming ``producer``, a member of ``host``) to ``host``."""
        f_strats = self.table[follower].strategies
        out_idx = self._src_output(follower, 0)
        meta = self._tensor(producer, out_idx)
        grad = self._grad_flows(meta, follower)
        p_index = host.member_index[producer]
        key = (id(host.strategies), id(host.member_strategies[producer]), p_index.tobytes(),
               id(f_strats), out_idx, grad, meta.shape, meta.dtype, len(host.members))
        merged = self._merges.get(key)
        if merged is None:
            merged = self._merges[key] = self._merged(host, producer, f_strats, out_idx, meta, grad)
        strategies, chosen, added = merged[:3]
        host.strategies = strategies
        host.costs = host.costs.plus(added)
        host.members.append(follower)
        host.member_index[follower] = chosen
        host.member_strategies[follower] = f_strats

    def _merged(self, host: CGNode, producer: str, f_strats: list[Strategy], out_idx: int,
                meta: TensorMeta, grad: bool) -> tuple:
        """Per host strategy, the follower strategy minimising resharding (fwd + bwd) from the
        producer's output spec plus the follower's own time; ties (within float rounding) go to
        :func:`_tie_break` (no resharding, then fewest resharding steps, then fewest sharded mesh
        axes, then the first index). Returns the combined strategies, the chosen follower indices
        and the costs they add (followed by the objects whose ids key the cache)."""
        f_costs = self._costs(f_strats)
        f_time = f_costs.time()
        rs = self._reshard(meta)
        f_in = self._states(rs, f_strats, "in", 0)
        p_out = self._states(rs, host.member_strategies[producer], "out", out_idx)
        p_of = host.member_index[producer]
        chosen = np.empty(len(host), dtype=np.int64)
        moved = np.zeros((2, len(host)))
        best: dict[int, tuple[int, float, float]] = {}
        for c, s in enumerate(p_out[p_of].tolist()):
            if s not in best:
                fwd = rs.dist[s, f_in]
                bwd = rs.dist[f_in, s] if grad else np.zeros(len(f_in))
                j = _tie_break(rs, s, f_in, fwd + bwd + f_time, grad, self._merge_slack)
                best[s] = (j, float(fwd[j]), float(bwd[j]))
            chosen[c], moved[0, c], moved[1, c] = best[s]
        label = f"reshard into member {len(host.members)}"
        states = rs.table.states
        strategies = [_combine(h, f_strats[j], rs.table, states[s], states[f_in[j]], grad, label)
                      for h, j, s in zip(host.strategies, chosen.tolist(), p_out[p_of].tolist())]
        added = f_costs.take(chosen)
        added.reshard_fwd = added.reshard_fwd + moved[0]
        added.reshard_bwd = added.reshard_bwd + moved[1]
        return (strategies, _readonly(chosen), added.readonly(),
                host.strategies, host.member_strategies[producer], f_strats)

    # -- edges -----------------------------------------------------------------------------------

    def edges(self) -> list[CGEdge]:
        """One CGEdge per (producer, consumer, operand) carrying a tensor between two CGNodes.

        An operand that every strategy of its consumer takes as produced (input spec None: the
        graph output of a plan with ``outputs="local"``) is no edge: it is never resharded and
        costs nothing."""
        out: list[CGEdge] = []
        for ns in self.table:
            dst = self.nodes[self.node_of[ns.node]]
            for j, producer in enumerate(ns.operand_nodes):
                src = self.nodes[self.node_of[producer]]
                if src is dst:          # a follower's merge edge: priced inside the node
                    continue
                if ns.strategies and all(s.input_specs[j] is None for s in ns.strategies):
                    continue
                out_idx = self._src_output(ns.node, j)
                meta = self._tensor(producer, out_idx)
                if meta is None:
                    continue
                rs = self._reshard(meta)
                src_specs, src_index = self._distinct(rs, src, producer, "out", out_idx)
                dst_specs, dst_index = self._distinct(rs, dst, ns.node, "in", j)
                grad = self._grad_flows(meta, ns.node)
                fwd, bwd, nb_fwd, nb_bwd = self._edge_matrices(rs, src_specs, dst_specs, grad)
                out.append(CGEdge(
                    src.name, dst.name, producer, ns.node, j, out_idx, meta, grad,
                    [rs.table.states[s] for s in src_specs], [rs.table.states[s] for s in dst_specs],
                    src_index, dst_index, fwd, bwd, nb_fwd, nb_bwd))
        return out

    def _distinct(self, rs: _Reshard, node: CGNode, member: str, side: str, k: int
                  ) -> tuple[tuple[int, ...], np.ndarray]:
        """The distinct states (first-seen order) of a member's spec over the node's strategies,
        and each strategy's position among them (cached; identical layers share the result)."""
        states = self._states(rs, node.member_strategies[member], side, k)
        index = node.member_index[member]
        key = (id(states), index.tobytes())
        hit = self._distinct_cache.get(key)
        if hit is None:
            positions: dict[int, int] = {}
            pos = [positions.setdefault(s, len(positions)) for s in states[index].tolist()]
            hit = self._distinct_cache[key] = (tuple(positions), _readonly(np.array(pos, dtype=np.int64)))
        return hit

    def _edge_matrices(self, rs: _Reshard, src: tuple[int, ...], dst: tuple[int, ...],
                       grad: bool) -> tuple[np.ndarray, ...]:
        """fwd/bwd seconds and bytes over the (src state, dst state) grid (cached, read-only)."""
        key = (id(rs), src, dst, grad)
        cached = self._matrices.get(key)
        if cached is None:
            s, d = np.array(src), np.array(dst)
            fwd = rs.dist[np.ix_(s, d)]
            nb_fwd = np.array([[rs.nbytes(a, b) for b in dst] for a in src], dtype=np.int64)
            if grad:
                bwd = rs.dist[np.ix_(d, s)].T
                nb_bwd = np.array([[rs.nbytes(b, a) for b in dst] for a in src], dtype=np.int64)
            else:
                bwd, nb_bwd = np.zeros_like(fwd), np.zeros_like(nb_fwd)
            cached = self._matrices[key] = tuple(_readonly(np.ascontiguousarray(m))
                                                 for m in (fwd, bwd, nb_fwd, nb_bwd))
        return cached

    # -- helpers -----------------------------------------------------------------------------------

    def _costs(self, strategies: list[Strategy], stores_params: bool = False) -> StrategyCosts:
        """Read-only cost vectors of a table strategy list (cached by list identity).

        Parameter and gradient memory is counted where it is stored, at the parameter's
        placeholder (its layout); an op's ``memory.params``/``grads`` (its view of a parameter
        operand, in its input spec) is not counted again, so those vectors are zero unless
        ``stores_params``, where the optimizer step of the local shard is priced too. Under mixed
        precision a placeholder's parameter and gradient bytes are its master shard's and the
        gradient all-reduce bytes are in the reduce dtype.
        """
        key = (id(strategies), stores_params)
        hit = self._cost_cache.get(key)
        if hit is None:
            costs = StrategyCosts.of(strategies)
            mp = self.precision
            if mp is not None:
                costs.sync_bytes = np.rint(costs.sync_bytes * mp.reduce_ratio).astype(np.int64)
            if stores_params:
                hw = self.table.hardware
                if mp is not None:
                    costs.params = np.rint(costs.params * mp.master_ratio).astype(np.int64)
                    costs.grads = np.rint(costs.grads * mp.master_ratio).astype(np.int64)
                costs.optimizer = np.array([optimizer_seconds(hw, float(g)) for g in costs.grads])
            else:
                costs.params = np.zeros_like(costs.params)
                costs.grads = np.zeros_like(costs.grads)
            hit = self._cost_cache[key] = (costs.readonly(), strategies)
        return hit[0]

    def _states(self, rs: _Reshard, strategies: list[Strategy], side: str, k: int) -> np.ndarray:
        """State index (in ``rs``) of input ``k`` (side "in") or output ``k`` ("out") of each
        strategy of a table strategy list (cached by list identity)."""
        key = (id(rs), id(strategies), side, k)
        hit = self._state_cache.get(key)
        if hit is None:
            specs = [s.input_specs[k] if side == "in" else s.output_specs[k] for s in strategies]
            if any(spec is None for spec in specs):
                raise ValueError(f"a strategy gives no spec for {side}put {k} of a tensor edge "
                                 f"(strategies {[s.name for s in strategies][:4]}...)")
            index = rs.table.index
            hit = self._state_cache[key] = (
                _readonly(np.array([index[spec] for spec in specs], dtype=np.int64)), strategies)
        return hit[0]

    def list_key(self, strategies: list[Strategy]) -> int:
        """A small int equal for equal strategy lists (compared by value once per list object)."""
        hit = self._list_keys.get(id(strategies))
        if hit is None:
            value = self._list_ids.setdefault(tuple(strategies), len(self._list_ids))
            hit = self._list_keys[id(strategies)] = (value, strategies)
        return hit[0]

    def _reshard(self, meta: TensorMeta) -> _Reshard:
        key = (meta.shape, meta.dtype)
        rs = self._reshards.get(key)
        if rs is None:
            rt = reshard_table(meta.shape, meta.dtype.itemsize, self.table.mesh.shape, self.table.hardware,
                               str(meta.dtype))
            rs = _RESHARDS.get(id(rt))
            if rs is None or rs.table is not rt:
                rs = _RESHARDS[id(rt)] = _Reshard(rt)
            self._reshards[key] = rs
        return rs

    def _src_output(self, consumer: str, operand: int) -> int:
        """Which element of the producer's outputs operand ``operand`` of ``consumer`` reads."""
        return self.graph.output_index(self.fx[consumer], self.table[consumer].operand_nodes[operand])

    def _tensor(self, producer: str, out_idx: int) -> TensorMeta | None:
        meta = self.graph.tensor_meta(producer)
        return meta[out_idx] if isinstance(meta, tuple) else meta

    def _grad_flows(self, meta: TensorMeta, consumer: str) -> bool:
        """Gradient of this tensor flows back from ``consumer``: the tensor requires grad and the
        consumer is differentiable (its value requires grad, or it is the graph output)."""
        if not meta.requires_grad:
            return False
        return self.fx[consumer].op == "output" or self.graph.requires_grad(consumer)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _reshard_parts(rt: ReshardTable, src: ShardSpec, dst: ShardSpec, phase: Phase,
                   label: str) -> tuple[tuple[CommAction, ...], float]:
    """The resharding from ``src`` to ``dst`` as its collectives (labelled ``label``) and the
    seconds of its local moves (a split's copy)."""
    if src == dst:
        return (), 0.0
    steps = rt.plan(src, dst).steps
    return (tuple(CommAction(step.kind, (step.axis,), step.nbytes, phase, label, step.cost)
                  for step in steps if step.collective is not None),
            sum(step.cost for step in steps if step.collective is None))


def _tie_break(rs: _Reshard, src: int, f_in: np.ndarray, total: np.ndarray, grad: bool,
               slack: float = 0.0) -> int:
    """Index of the follower strategy to merge: least ``total`` cost; among (near-)ties, the
    one whose input state is ``src`` (the producer's output, nothing to reshard), then fewest
    resharding steps (fwd, plus bwd when the gradient flows), then fewest sharded or partial mesh
    axes in its input spec, then the first index.

    Costs within ``slack`` seconds of the least tie: a follower that changes layout to save less
    than one collective's latency cannot pay for the collective that any consumer wanting the
    producer's layout would then need (a mask built from free splits, then gathered back), and
    the choice is made here, before the ILP sees the consumers.

    Free resharding steps (a local split) tie with none, but the first index is an arbitrary
    strategy order: picking a split there makes every consumer that wants the producer's layout
    gather it back (e.g. Llama's rotary cos/sin, split after ``wrap_with_set_grad_enabled`` and
    all-gathered again in every layer).
    """
    best = float(total.min())
    tied = np.flatnonzero(total <= best + max(abs(best) * 1e-9, 1e-15, slack))
    if len(tied) == 1:
        return int(tied[0])
    states = rs.table.states

    def key(j: int) -> tuple:
        d = int(f_in[j])
        steps = rs.steps(src, d) + (rs.steps(d, src) if grad else 0)
        return (d != src, steps, len(states[d].used_axes()), j)

    return min(tied.tolist(), key=key)


def _combine(host: Strategy, follower: Strategy, rt: ReshardTable, out_spec: ShardSpec,
             in_spec: ShardSpec, grad: bool, label: str) -> Strategy:
    """A host strategy with a follower strategy folded in: costs, collectives (with the
    resharding between them, labelled ``label``; its local moves' copies as compute) and memory
    added; inputs/outputs the host's."""
    moves, local_fwd = _reshard_parts(rt, out_spec, in_spec, FWD, label)
    back, local_bwd = _reshard_parts(rt, in_spec, out_spec, BWD, label) if grad else ((), 0.0)
    m, f = host.memory, follower.memory
    return Strategy(
        name=f"{host.name} | {follower.name}",
        input_specs=host.input_specs,
        output_specs=host.output_specs,
        compute_fwd=host.compute_fwd + follower.compute_fwd + local_fwd,
        compute_bwd=host.compute_bwd + follower.compute_bwd + local_bwd,
        comm=host.comm + moves + back + follower.comm,
        memory=MemoryCost(m.params + f.params, m.grads + f.grads, m.saved + f.saved,
                          m.outputs + f.outputs),
        split=host.split,
        tags=host.tags + follower.tags,
    )


# -- aliasing ----------------------------------------------------------------------------------------

def _identical_blocks(cg: CostGraph, b: _Builder) -> list[tuple[str, list[list[str]]]]:
    """Classes of identical blocks, each with its alias key prefix ``<prefix>.*`` (the first class
    of a prefix) or ``<prefix>.*<i>`` (a later class, ``i`` its first block index) and its blocks in
    order, each the list of its CGNodes (the k-th node of every block plays the same part)."""
    blocks: dict[str, dict[int, list[str]]] = {}
    for n in cg.nodes.values():
        blk = b.blocks[n.members[0]]
        if blk is not None:
            blocks.setdefault(blk[0], {}).setdefault(blk[1], []).append(n.name)
    in_edges: dict[str, list[CGEdge]] = {}
    for e in cg.edges:
        in_edges.setdefault(e.dst, []).append(e)
    out = []
    for prefix, by_index in blocks.items():
        classes: dict[tuple, list[int]] = {}
        for idx in sorted(by_index):
            sig = _block_signature(cg, b, by_index[idx], in_edges)
            classes.setdefault(sig, []).append(idx)
        ordered = sorted((v for v in classes.values() if len(v) > 1), key=lambda v: v[0])
        for rank, indices in enumerate(ordered):
            tag = "*" if rank == 0 and indices[0] == min(by_index) else f"*{indices[0]}"
            out.append((f"{prefix}.{tag}" if prefix else tag, [by_index[idx] for idx in indices]))
    return out


def _alias_blocks(cg: CostGraph, classes: list[tuple[str, list[list[str]]]]) -> None:
    """Give the k-th CGNode of every block of a class the key ``<class key>/<k>``."""
    for key, blocks in classes:
        for names in blocks:
            for k, name in enumerate(names):
                cg.nodes[name].alias = f"{key}/{k}"


def _block_signature(cg: CostGraph, b: _Builder, names: list[str],
                     in_edges: dict[str, list[CGEdge]]) -> tuple:
    """Everything the costs of a block's nodes and internal edges depend on, without names:
    per node its members (op, shapes, dtypes, non-tensor args, grad flags), strategies and
    member maps; per incoming edge its operand, and its source position when inside the block."""
    position = {n: k for k, n in enumerate(names)}
    sig = []
    for name in names:
        node = cg.nodes[name]
        members = tuple(_member_signature(b, m) for m in node.members)
        maps = tuple(tuple(node.member_index[m].tolist()) for m in node.members)
        edges = tuple(sorted(
            (node.members.index(e.dst_member), e.operand, e.src_output,
             position.get(e.src, -1),
             cg.nodes[e.src].members.index(e.src_member) if e.src in position else -1)
            for e in in_edges.get(name, ())))
        sig.append((members, b.list_key(node.strategies), maps, edges))
    return tuple(sig)


def _member_signature(b: _Builder, name: str) -> tuple:
    node = b.fx[name]
    graph = b.graph
    if node.op == "placeholder":
        head: tuple = ("placeholder", graph.is_param(name), graph.is_buffer(name), graph.is_user_input(name))
    elif node.op == "call_function":
        head = ("call_function", op_name(node.target), freeze_args(node.args), freeze_args(node.kwargs))
    else:
        head = (node.op, str(node.target))
    operands = tuple(b._tensor(p, b._src_output(name, j))
                     for j, p in enumerate(b.table[name].operand_nodes))
    out = graph.tensor_meta(name) if node.op != "output" else None
    return head + (out, operands, graph.requires_grad(name) if node.op != "output" else False)
