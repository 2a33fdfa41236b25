"""Parameters all-gathered per block before use and their gradients reduce-scattered, as FSDP does.

A parameter stored sharded (one dim split over mesh axes ``G``) that its consumers read replicated
must be all-gathered before use. Per use and per mesh axis that is one collective each step (two
on a 2D mesh), and the gradient of the gathered copy, a partial sum over the axes ``A`` its
consumer's computation is split over, is then all-reduced inline and split back. Where every use
of the parameter reads it replicated and ``A`` covers ``G``, the runtime instead gathers the
parameters of one *block* together (a layer of a stack of layers, ``model.layers.3``: see
:func:`gather_blocks`; the parameters used outside any block form one root group), in one
all-gather over ``G``, just before the first use of any of them; in backward their gradients are
reduce-scattered over ``G`` together, in one collective that both sums them and leaves each rank
its shard. What ``A`` has
beyond ``G`` (a parameter stored ``S0`` read by a computation split over both axes) is summed
after backward with the bucketed gradients.

One analysis, used by the runtime (:mod:`autoshard.runtime.lower` generates the gathers from it),
the step model (:func:`autoshard.solver.evaluate.predict`) and the plan's communication
(:attr:`autoshard.Plan.comm`), so that they agree.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Sequence

from torch import fx

from .grad_reduction import Axes, live
from .strategy import BWD

if TYPE_CHECKING:
    from .capture import CapturedGraph
    from .specs import ShardSpec
    from .strategy import Strategy


@dataclass(frozen=True)
class ParamUse:
    """One read of a parameter: by operand ``operand`` of ``consumer``, in layout ``read``, with the
    gradient all-reduced over the (live) mesh axes ``sync`` by that consumer's strategy; ``block``:
    the consumer's :func:`gather_block`."""

    param: str
    consumer: str
    operand: int
    read: "ShardSpec | None"
    sync: Axes
    block: str


@dataclass(frozen=True)
class GatheredParam:
    """A parameter of a gather group: its sharded ``dim``, and ``leftover``, the mesh axes its
    gradient is still summed over after the reduce-scatter (bucketed after backward)."""

    name: str
    dim: int
    leftover: Axes


@dataclass(frozen=True)
class GatherGroup:
    """Parameters gathered in one all-gather over ``axes`` before ``first_use`` (a graph node)."""

    block: str
    axes: Axes
    params: tuple[GatheredParam, ...]
    first_use: str


@dataclass(frozen=True)
class ParamGathers:
    """``groups`` in order of first use; ``uses``: the (consumer, operand) pairs that read a
    gathered parameter (no resharding, no inline gradient all-reduce of their own)."""

    groups: tuple[GatherGroup, ...] = ()
    uses: frozenset[tuple[str, int]] = frozenset()

    def leftover(self) -> dict[str, Axes]:
        """Parameter -> the axes of its bucketed gradient all-reduce, where some remain."""
        return {p.name: p.leftover for g in self.groups for p in g.params if p.leftover}


def gather_blocks(module_classes: Mapping[str, str]) -> frozenset[str]:
    """The module paths whose parameters are gathered together as one block: the entries
    ``prefix.i`` of a container that have submodules of their own and whose class another entry of
    the same container shares (a layer of a stack of layers, as FSDP is applied per transformer
    block). The entries of a heterogeneous ``nn.Sequential`` (a convolution, its batch norm, the
    next convolution) are single layers, not blocks: FSDP2 wraps such a model whole.
    ``module_classes`` maps module FQNs to class names
    (:meth:`autoshard.capture.CapturedGraph.module_classes`)."""
    entries = {path: (path.rpartition(".")[0], kind) for path, kind in module_classes.items()
               if path.rpartition(".")[2].isdecimal()}              # path -> (container, class)
    per_class = Counter(entries.values())
    with_submodules = {path.rpartition(".")[0] for path in module_classes if "." in path}
    return frozenset(path for path, key in entries.items() if path in with_submodules and per_class[key] >= 2)


def gather_block(module_path: str, blocks: frozenset[str]) -> str:
    """The block (of :func:`gather_blocks`) a module's parameters are gathered with, the outermost
    one it is in (``model.layers.3.mlp.up_proj`` -> ``model.layers.3``); ``""`` (the root group)
    outside any."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdecimal() and ".".join(parts[:i + 1]) in blocks:
            return ".".join(parts[:i + 1])
    return ""


class StoredParam(NamedTuple):
    """A parameter's stored layout and dtype (parameters of one gather are of one dtype)."""

    spec: "ShardSpec"
    dtype: str


def plan_param_gathers(stored: dict[str, StoredParam], uses: Sequence[ParamUse],
                       mesh_shape: Sequence[int]) -> ParamGathers:
    """The gather groups of one graph: ``stored`` maps every parameter that carries a gradient to
    its stored layout; ``uses`` lists every read of a parameter in graph order."""
    by_param: dict[str, list[ParamUse]] = {}
    for u in uses:
        by_param.setdefault(u.param, []).append(u)
    groups: dict[tuple[str, Axes, str], list[tuple[GatheredParam, str]]] = {}
    for name, reads in by_param.items():
        member = _member(stored[name].spec if name in stored else None, reads, mesh_shape)
        if member is None:
            continue
        first = reads[0]
        key = (first.block, _gather_axes(stored[name].spec, mesh_shape), stored[name].dtype)
        groups.setdefault(key, []).append((member, first.consumer))
    ordered = sorted(groups.items(), key=lambda kv: _position(kv[1][0][1], uses))
    out = tuple(GatherGroup(block, axes, tuple(m for m, _ in members), members[0][1])
                for (block, axes, _), members in ordered)
    taken = {m.name for g in out for m in g.params}
    return ParamGathers(out, frozenset((u.consumer, u.operand) for u in uses if u.param in taken))


def _position(consumer: str, uses: Sequence[ParamUse]) -> int:
    return next(i for i, u in enumerate(uses) if u.consumer == consumer)


def _gather_axes(spec: "ShardSpec", mesh_shape: Sequence[int]) -> Axes:
    return live((a for d in spec.dims for a in d), mesh_shape)


def _member(spec: "ShardSpec | None", reads: list[ParamUse], mesh_shape: Sequence[int]) -> GatheredParam | None:
    """The parameter as a group member, or None where it is not gathered as a whole per step:
    stored with one dim sharded (over live axes ``G``, nothing partial), every use reading it
    replicated, every use's gradient partial over the same axes ``A`` with ``G`` within ``A``."""
    if spec is None or spec.partial:
        return None
    sharded = [d for d, axes in enumerate(spec.dims) if live(axes, mesh_shape)]
    if len(sharded) != 1:
        return None
    gather = _gather_axes(spec, mesh_shape)
    if any(r.read is None or not r.read.is_replicated() for r in reads):
        return None
    syncs = {r.sync for r in reads}
    if len(syncs) != 1 or not set(gather) <= set(next(iter(syncs))):
        return None
    leftover = tuple(a for a in next(iter(syncs)) if a not in gather)
    return GatheredParam(reads[0].param, sharded[0], leftover)


def param_uses(graph: "CapturedGraph", operands_of: Callable[[fx.Node], Sequence[str]],
               strategy_of: Callable[[fx.Node], "Strategy"], stored_of: Callable[[str], "ShardSpec | None"],
               mesh_shape: Sequence[int]) -> tuple[dict[str, StoredParam], list[ParamUse]]:
    """The stored layout (``stored_of``) of every parameter that carries a gradient, and every
    read of one by a call node (its operands and chosen strategy from ``operands_of`` and
    ``strategy_of``), in graph order: the inputs of :func:`plan_param_gathers`."""
    stored: dict[str, StoredParam] = {}
    uses: list[ParamUse] = []
    blocks = gather_blocks(graph.module_classes())
    for node in graph.graph.nodes:
        if node.op == "placeholder" and node.name in graph.param_fqn and graph.requires_grad(node):
            spec = stored_of(node.name)
            if spec is not None:
                stored[node.name] = StoredParam(spec, str(graph.tensor_meta(node).dtype))
        elif node.op == "call_function":
            s = strategy_of(node)
            for j, src in enumerate(operands_of(node)):
                if src in stored:
                    sync = live((a for c in s.comm if c.phase == BWD and c.kind == "all_reduce"
                                 and c.operand == f"in{j}" for a in c.axes), mesh_shape)
                    block = gather_block(graph.module_path(node), blocks)
                    uses.append(ParamUse(src, node.name, j, s.input_specs[j], sync, block))
        elif node.op == "output":
            for src in node.all_input_nodes:
                if src.name in stored:        # a parameter returned as it is: not gathered as a whole
                    uses.append(ParamUse(src.name, node.name, -1, None, (), ""))
    return stored, uses


def gathered_bytes(graph: "CapturedGraph", group: GatherGroup) -> int:
    """Bytes per device of a group's all-gather output (= its reduce-scatter input): the full
    parameters, one after another."""
    return sum(graph.tensor_meta(p.name).nbytes for p in group.params)

