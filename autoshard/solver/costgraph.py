"""The cost graph: graph nodes x strategies, data edges x resharding costs.

:func:`~autoshard.solver.costgraph_build.build_cost_graph` turns a
:class:`~autoshard.enumerate.StrategyTable` into what the ILP optimises over (this module holds
the graph's types; building, follower merging and block aliasing live in :mod:`.costgraph_build`):

- **Nodes** (:class:`CGNode`): one per graph node (placeholders, call_function nodes, the output),
  or, with follower merging, one per producer with its followers folded in. Each node has a list
  of strategies and, per strategy, its costs as numpy vectors (:class:`StrategyCosts`).
- **Edges** (:class:`CGEdge`): one per (producer, consumer, operand) that carries a tensor. An
  edge is priced over the *distinct* specs on each side (``src_specs`` x ``dst_specs``), not over
  strategy pairs; ``src_index``/``dst_index`` map each strategy to its spec. The ILP's edge
  variables live on that small spec grid.
- **Segments**: the repeated-block instance (``model.layers.3``) a node belongs to, for the
  per-segment activation-memory decisions.
- **Aliases**: identical repeated blocks share decision variables (:meth:`CostGraph.variable_groups`,
  :meth:`CostGraph.edge_groups`).

Cost model (all seconds per training step, memory bytes per device):

- a node's strategy costs its compute (fwd + bwd), its own collectives (fwd + bwd: e.g. the
  all-reduce of a partial output, or of a partial input gradient) and, for merged nodes, the
  resharding between its members;
- an edge costs, forward, the cheapest resharding of the tensor from the producer's output spec
  to the consumer's input spec (an operand its consumer takes as produced, input spec None, is
  no edge: the graph output's tensors of rank >= 1 when the plan returns them local). Backward,
  when the tensor requires grad and gradient flows through the consumer, the consumer delivers
  the gradient of its input in its *input* spec (strategies already include the all-reduce that
  resolves a partial gradient), and it is resharded back to the producer's *output* spec:
  ``reshard_cost(dst -> src)``.

The sum of every node's and edge's costs under one full assignment is the reference the ILP must
reproduce (:func:`.reference.reference_costs` adds it up). It does with this formulation: per
variable group ``g`` one-hot ``x[g][c]``, costing
``g.count * costs.time()[c]`` (all nodes of a group have identical costs); per edge group ``eg``
``y[eg][a, b] >= 0`` on the spec grid with ``sum_b y[a, b] = sum(x[src_group][c] for c with
src_index[c] == a)`` and ``sum_a y[a, b] = sum(x[dst_group][c] for c with dst_index[c] == b)``,
costing ``eg.count * (fwd + bwd)[a, b]``. With one-hot ``x`` both marginals are one-hot, so
``y`` is exactly the chosen spec pair.

Shared arrays (cost vectors, index maps, edge matrices) are read-only: identical nodes share them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch.fx as fx

from ..comm_cost import collective_cost
from ..capture import CapturedGraph, TensorMeta, repeated_block
from ..enumerate import StrategyTable
from ..hardware import HardwareProfile
from ..mesh import MeshSpec
from ..specs import ShardSpec
from ..strategy import BWD, FWD, CommAction, Strategy

if TYPE_CHECKING:
    from ..precision import MixedPrecision

__all__ = [
    "CGEdge", "CGNode", "CostGraph", "EdgeGroup", "FOLLOWER_FAMILIES",
    "StrategyCosts", "VariableGroup", "block_of",
]

FOLLOWER_FAMILIES = frozenset({"view", "cast", "pointwise", "meta"})
"""Handler families whose single-operand nodes may be merged into their producer."""



# -- data --------------------------------------------------------------------------------------------

@dataclass
class StrategyCosts:
    """Per-strategy costs of a node as vectors (index = strategy index).

    Times in seconds: ``compute_*`` (measured rates or the roofline), ``comm_*`` (the
    strategies' own inline collectives), ``reshard_*`` (resharding between the members of a merged
    node; zero otherwise), ``optimizer`` (the optimizer step of a parameter placeholder's local
    shard; zero elsewhere). ``sync_bytes[s, k]``: bytes of parameter-gradient all-reduces over
    mesh axes ``SYNC_AXES[k]`` that the runtime runs in buckets after backward (priced as buckets
    by :mod:`.steptime`, not per use). Memory in bytes per device; ``params``/``grads`` are
    nonzero only at placeholders (parameters are counted where they are stored, not again at
    each op that reads them).
    """

    compute_fwd: np.ndarray
    compute_bwd: np.ndarray
    comm_fwd: np.ndarray
    comm_bwd: np.ndarray
    reshard_fwd: np.ndarray
    reshard_bwd: np.ndarray
    params: np.ndarray
    grads: np.ndarray
    saved: np.ndarray
    outputs: np.ndarray
    optimizer: np.ndarray
    sync_bytes: np.ndarray

    TIME_FIELDS = ("compute_fwd", "compute_bwd", "comm_fwd", "comm_bwd", "reshard_fwd", "reshard_bwd",
                   "optimizer")
    MEMORY_FIELDS = ("params", "grads", "saved", "outputs", "sync_bytes")

    @staticmethod
    def of(strategies: Sequence[Strategy]) -> "StrategyCosts":
        """Costs of plain (unmerged) strategies."""
        n = len(strategies)
        return StrategyCosts(
            compute_fwd=np.array([s.compute_fwd for s in strategies], dtype=float),
            compute_bwd=np.array([s.compute_bwd for s in strategies], dtype=float),
            comm_fwd=np.array([s.blocking_comm_time(FWD) for s in strategies], dtype=float),
            comm_bwd=np.array([s.blocking_comm_time(BWD) for s in strategies], dtype=float),
            reshard_fwd=np.zeros(n), reshard_bwd=np.zeros(n),
            params=np.array([s.memory.params for s in strategies], dtype=np.int64),
            grads=np.array([s.memory.grads for s in strategies], dtype=np.int64),
            saved=np.array([s.memory.saved for s in strategies], dtype=np.int64),
            outputs=np.array([s.memory.outputs for s in strategies], dtype=np.int64),
            optimizer=np.zeros(n),
            sync_bytes=np.array([_sync_bytes(s) for s in strategies], dtype=np.int64).reshape(n, len(SYNC_AXES)),
        )

    def time(self) -> np.ndarray:
        """Total seconds per strategy (compute + comm + internal resharding, fwd + bwd)."""
        return sum((getattr(self, f) for f in self.TIME_FIELDS), np.zeros(len(self.compute_fwd)))

    def take(self, rows: np.ndarray) -> "StrategyCosts":
        """The costs of strategies ``rows`` (new arrays)."""
        return StrategyCosts(**{f: getattr(self, f)[rows] for f in self.TIME_FIELDS + self.MEMORY_FIELDS})

    def plus(self, other: "StrategyCosts") -> "StrategyCosts":
        """Element-wise sum (new arrays)."""
        return StrategyCosts(**{f: getattr(self, f) + getattr(other, f)
                                for f in self.TIME_FIELDS + self.MEMORY_FIELDS})

    def readonly(self) -> "StrategyCosts":
        """Mark the arrays read-only (they may be shared between nodes) and return self."""
        for f in self.TIME_FIELDS + self.MEMORY_FIELDS:
            getattr(self, f).flags.writeable = False
        return self


SYNC_AXES: tuple[tuple[int, ...], ...] = ((0,), (1,), (0, 1))
"""The mesh-axis sets a gradient all-reduce can run over on a 2D mesh (columns of ``sync_bytes``)."""


def _sync_bytes(s: Strategy) -> list[int]:
    """Bytes of a strategy's bucketed gradient all-reduces, per entry of :data:`SYNC_AXES`."""
    out = [0] * len(SYNC_AXES)
    for c in s.comm:
        if c.bucketed:
            out[SYNC_AXES.index(tuple(c.axes))] += c.nbytes
    return out


@dataclass
class CGNode:
    """A decision node: one graph node, or a producer with its merged followers.

    ``members`` are the graph nodes it covers, representative first. ``member_index[m][c]`` is the
    index, in the strategy table, of member ``m``'s strategy when this node runs its strategy
    ``c``; ``member_strategies[m]`` is that member's strategy list in the table.
    """

    name: str
    kind: str                                   # "placeholder" | "call_function" | "output" | ...
    members: list[str]
    strategies: list[Strategy]
    member_index: dict[str, np.ndarray]
    member_strategies: dict[str, list[Strategy]]
    costs: StrategyCosts
    segment: str | None = None
    alias: str | None = None

    def __len__(self) -> int:
        return len(self.strategies)

    def member_strategy(self, member: str, c: int) -> Strategy:
        """The table strategy member ``member`` runs under this node's strategy ``c``."""
        return self.member_strategies[member][int(self.member_index[member][c])]

    def output_spec(self, member: str, c: int, output: int = 0) -> ShardSpec | None:
        """Spec of output ``output`` of ``member`` under strategy ``c``."""
        return self.member_strategy(member, c).output_specs[output]

    @property
    def group(self) -> str:
        """Key of the decision group (its alias class, or its own name)."""
        return self.alias or self.name


@dataclass
class CGEdge:
    """A tensor flowing from ``src_member`` (in CGNode ``src``) into operand ``operand`` of
    ``dst_member`` (in ``dst``), priced on the grid of distinct specs.

    ``fwd[a, b]``: seconds to reshard ``src_specs[a]`` into ``dst_specs[b]``. ``bwd[a, b]``: seconds
    to reshard the gradient, delivered by the consumer in ``dst_specs[b]``, back into
    ``src_specs[a]`` (zero when no gradient flows). ``nbytes_*``: bytes per device moved by those
    reshardings (sum over their collectives). ``src_index[c]`` / ``dst_index[c]``: the spec
    position of strategy ``c`` of ``src`` / ``dst``.
    """

    src: str
    dst: str
    src_member: str
    dst_member: str
    operand: int
    src_output: int
    tensor: TensorMeta
    grad: bool
    src_specs: list[ShardSpec]
    dst_specs: list[ShardSpec]
    src_index: np.ndarray
    dst_index: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    nbytes_fwd: np.ndarray
    nbytes_bwd: np.ndarray

    @property
    def cost(self) -> np.ndarray:
        """fwd + bwd seconds per (src spec, dst spec)."""
        return self.fwd + self.bwd

    def cost_of(self, src_choice: int, dst_choice: int) -> float:
        """Seconds (fwd + bwd) of this edge when its endpoints run these strategies."""
        a, b = self.src_index[src_choice], self.dst_index[dst_choice]
        return float(self.fwd[a, b] + self.bwd[a, b])


@dataclass
class VariableGroup:
    """CGNodes that must choose the same strategy index (an alias class, or a single node)."""

    key: str
    nodes: list[str]
    n_strategies: int

    @property
    def count(self) -> int:
        return len(self.nodes)


@dataclass
class EdgeGroup:
    """Edges whose endpoints lie in the same pair of variable groups (same members, operand and
    output): they always see the same spec pair, so they share edge variables. ``edge`` is the
    representative (all have identical matrices); its cost counts ``count`` times."""

    key: tuple
    src_group: str
    dst_group: str
    edges: list[CGEdge]

    @property
    def edge(self) -> CGEdge:
        return self.edges[0]

    @property
    def count(self) -> int:
        return len(self.edges)


# -- the graph ---------------------------------------------------------------------------------------

class CostGraph:
    """Nodes x strategies and edges x resharding costs of one captured graph on one mesh.

    ``nodes`` (CGNode name -> CGNode, graph order), ``edges``, ``node_of`` (graph node -> CGNode
    name), ``build_seconds``. Build it with :func:`build_cost_graph`.
    """

    def __init__(self, table: StrategyTable, nodes: dict[str, CGNode], edges: list[CGEdge], *,
                 merged: bool, aliased: bool, precision: "MixedPrecision | None" = None) -> None:
        self.table = table
        self.precision = precision      # the mixed-precision policy priced, None: the graph's dtypes
        self.nodes = nodes
        self.edges = edges
        self.merged = merged
        self.aliased = aliased
        self.node_of = {m: n.name for n in nodes.values() for m in n.members}
        self.build_seconds = 0.0
        self.timings: dict[str, float] = {}
        # classes of identical blocks (aliased or not), each its blocks in order, each its CGNodes
        self.identical_blocks: list[list[list[str]]] = []
        self._derived: dict[str, Any] = {}

    def derived(self, key: str, compute: Callable[[], Any]) -> Any:
        """A fact derived from the finished graph (e.g. its memory segments), computed on first use
        and kept: the graph does not change once built."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    @property
    def graph(self) -> CapturedGraph:
        return self.table.graph

    @property
    def mesh(self) -> MeshSpec:
        return self.table.mesh

    @property
    def hardware(self) -> HardwareProfile:
        return self.table.hardware

    def __getitem__(self, name: str) -> CGNode:
        return self.nodes[name]

    def stored_itemsize(self, placeholder: str) -> int:
        """Bytes per element of a parameter placeholder as the runtime stores it: its graph dtype's,
        or under mixed precision the master dtype's (a floating-point parameter)."""
        dtype = self.graph.tensor_meta(placeholder).dtype
        if self.precision is not None and dtype.is_floating_point:
            return self.precision.master.itemsize
        return dtype.itemsize

    def as_run(self, c: CommAction) -> CommAction:
        """A strategy's collective as the runtime runs it: a parameter-gradient all-reduce (``bucketed``)
        is, under mixed precision, sized and priced in the reduce dtype; anything else as it is."""
        if self.precision is None or not c.bucketed or self.precision.reduce_ratio == 1.0:
            return c
        nbytes = int(round(c.nbytes * self.precision.reduce_ratio))
        return dataclasses.replace(c, nbytes=nbytes,
                                   cost=collective_cost(c.kind, nbytes, c.axes, self.mesh.shape, self.hardware))

    def reduced_grad_bytes(self, placeholder: str, stored_bytes: float) -> int:
        """Bytes of a parameter's gradient all-reduce, given its stored gradient's bytes: the same,
        or under mixed precision re-counted in the reduce dtype."""
        if self.precision is None or not self.graph.tensor_meta(placeholder).dtype.is_floating_point:
            return int(stored_bytes)
        return int(round(stored_bytes / self.precision.master.itemsize * self.precision.reduce.itemsize))

    def grad_sync_dtype(self) -> str:
        """The dtype name bucketed gradients are all-reduced in: the mixed-precision policy's reduce
        dtype, else the first floating-point parameter's (float32 for a graph without one)."""
        if self.precision is not None:
            return self.precision.reduce_dtype
        for p in self.graph.param_fqn:
            dtype = self.graph.tensor_meta(p).dtype
            if dtype.is_floating_point:
                return str(dtype).removeprefix("torch.")
        return "float32"

    def __len__(self) -> int:
        return len(self.nodes)

    # -- decision groups -------------------------------------------------------------------------

    def alias_classes(self) -> dict[str, list[str]]:
        """Alias key -> the CGNodes sharing it (block 0's node first); only aliased nodes."""
        out: dict[str, list[str]] = {}
        for n in self.nodes.values():
            if n.alias is not None:
                out.setdefault(n.alias, []).append(n.name)
        return out

    def variable_groups(self) -> list[VariableGroup]:
        """The ILP's decision groups, in graph order: every CGNode of a group takes the same
        strategy index (one group per alias class, one per non-aliased node)."""
        groups: dict[str, VariableGroup] = {}
        for n in self.nodes.values():
            g = groups.get(n.group)
            if g is None:
                groups[n.group] = VariableGroup(n.group, [n.name], len(n))
            else:
                g.nodes.append(n.name)
        return list(groups.values())

    def edge_groups(self) -> list[EdgeGroup]:
        """Edges grouped by (src group, dst group, member positions, operand, output): edges in
        one group always see the same (src spec, dst spec) pair, so they share the ILP's edge
        variables and their cost counts ``count`` times. Without aliasing every group has one
        edge; with it, e.g. the rotary cos/sin edge into every layer is one group of n_layers."""
        groups: dict[tuple, EdgeGroup] = {}
        for e in self.edges:
            src, dst = self.nodes[e.src], self.nodes[e.dst]
            key = (src.group, dst.group, src.members.index(e.src_member),
                   dst.members.index(e.dst_member), e.operand, e.src_output)
            g = groups.get(key)
            if g is None:
                groups[key] = EdgeGroup(key, src.group, dst.group, [e])
            else:
                _check_same_grid(g.edge, e)
                g.edges.append(e)
        return list(groups.values())

    # -- choices -----------------------------------------------------------------------------------

    def expand_groups(self, group_choice: dict[str, int]) -> dict[str, int]:
        """Variable-group key -> index  ==>  CGNode name -> index."""
        return {n.name: int(group_choice[n.group]) for n in self.nodes.values()}

    def graph_choice(self, choice: dict[str, int]) -> dict[str, int]:
        """CGNode choice ==> the table strategy index of every graph node (merged members too)."""
        out: dict[str, int] = {}
        for n in self.nodes.values():
            c = choice[n.name]
            for m in n.members:
                out[m] = int(n.member_index[m][c])
        return out

    # -- summary ------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Sizes of the ILP this graph implies, and the build time."""
        groups = self.variable_groups()
        egroups = self.edge_groups()
        return {
            "graph_nodes": len(self.node_of),
            "nodes": len(self.nodes),
            "merged_followers": len(self.node_of) - len(self.nodes),
            "aliased_nodes": sum(len(v) - 1 for v in self.alias_classes().values()),
            "strategies": sum(len(n) for n in self.nodes.values()),
            "edges": len(self.edges),
            "variable_groups": len(groups),
            "strategy_variables": sum(g.n_strategies for g in groups),
            "edge_groups": len(egroups),
            "edge_variables": sum(g.edge.fwd.size for g in egroups),
            "edge_variables_nontrivial": sum(g.edge.fwd.size for g in egroups
                                             if min(g.edge.fwd.shape) > 1),
            "segments": len({n.segment for n in self.nodes.values() if n.segment is not None}),
            "build_seconds": self.build_seconds,
        }

    def __repr__(self) -> str:
        s = self.stats()
        return (f"CostGraph({s['nodes']} nodes ({s['graph_nodes']} graph nodes), {s['edges']} edges, "
                f"{s['variable_groups']} variable groups, {s['edge_variables']} edge variables)")


def _check_same_grid(a: CGEdge, b: CGEdge) -> None:
    if a.src_specs != b.src_specs or a.dst_specs != b.dst_specs:
        raise AssertionError(f"edges {a.src_member}->{a.dst_member} and {b.src_member}->{b.dst_member} "
                             "share variables but differ in specs (aliasing bug)")


# -- segments ----------------------------------------------------------------------------------------

def block_of(graph: CapturedGraph, node: fx.Node) -> tuple[str, int] | None:
    """``(prefix, index)`` of the repeated block (a ModuleList/Sequential entry) holding ``node``.

    The block is found from the module path (call_function nodes) or the FQN (parameters and
    buffers): the first numeric path component gives the shortest prefix, e.g.
    ``model.layers.3.self_attn.q_proj`` -> ``("model.layers", 3)``. None outside any block.
    """
    if node.op == "placeholder":
        fqn = graph.param_fqn.get(node.name) or graph.buffer_fqn.get(node.name)
        path = fqn.rsplit(".", 1)[0] if fqn and "." in fqn else ""
    elif node.op == "output":
        path = ""
    else:
        path = graph.module_path(node)
    return repeated_block(path)


def _segment_name(block: tuple[str, int] | None) -> str | None:
    if block is None:
        return None
    prefix, idx = block
    return f"{prefix}.{idx}" if prefix else str(idx)


# -- build ---------------------------------------------------------------------------------------------
