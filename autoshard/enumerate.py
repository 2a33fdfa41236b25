"""Strategy enumeration over a whole captured graph."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch.fx as fx

from .batch_norm_modes import op_function_args, returns_per_rank
from .capture import CapturedGraph, capture
from .hardware import HardwareProfile, load_hardware
from .mesh import MeshSpec
from .opinfo import UnsupportedOpError, op_name
from .specs import ShardSpec, all_specs
from .strategy import MemoryCost, Strategy, expand

OUTPUT_MODES = ("global", "local")
"""How a parallelized model returns its graph outputs (``outputs=`` of :func:`autoshard.plan`):
``"global"``, every tensor output whole on every rank; ``"local"``, a tensor output of rank >= 1
as this rank's shard in the layout its producer computes it in (0-dim outputs stay global)."""


@dataclass
class NodeStrategies:
    """The strategies of one graph node."""

    node: str
    op: str
    module_path: str
    strategies: list[Strategy]
    operand_nodes: list[str]
    fallback: bool = False       # replicated only because fallback="replicate" was asked for
    hooked: int = 0              # tensors its forward saves for backward (through saved-tensor hooks)

    def __iter__(self) -> Iterator[Strategy]:
        return iter(self.strategies)

    def __len__(self) -> int:
        return len(self.strategies)

    def names(self) -> list[str]:
        return [s.name for s in self.strategies]

    def by_name(self, name: str) -> Strategy:
        for s in self.strategies:
            if s.name == name:
                return s
        raise KeyError(f"node {self.node} has no strategy named {name!r}; it has {self.names()}")


@dataclass
class StrategyTable:
    """Per-node strategies of a captured graph on a mesh (ordered as the graph)."""

    graph: CapturedGraph
    mesh: MeshSpec
    hardware: HardwareProfile
    nodes: dict[str, NodeStrategies]
    seconds: float = 0.0
    fallbacks: list[str] = field(default_factory=list)
    outputs: str = "global"      # one of OUTPUT_MODES
    batch_norm: str = "global"   # one of autoshard.batch_norm_modes.BATCH_NORM_MODES
    loss: str = "global"         # one of autoshard.batch_norm_modes.LOSS_MODES

    def __getitem__(self, node_name: str) -> NodeStrategies:
        return self.nodes[node_name]

    def __iter__(self) -> Iterator[NodeStrategies]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    def total_strategies(self) -> int:
        return sum(len(n) for n in self.nodes.values())


def _placeholder_strategies(graph: CapturedGraph, node: fx.Node, mesh: MeshSpec) -> list[Strategy]:
    """A parameter, buffer or input may be held in any layout that divides its shape."""
    meta = graph.tensor_meta(node)
    if meta is None or isinstance(meta, tuple):
        return [Strategy("()", (), (None,), 0.0, 0.0, (), MemoryCost())]
    out = []
    item = meta.dtype.itemsize
    for spec in all_specs(len(meta.shape), 2):
        if not spec.fits(meta.shape, mesh.shape) or any(mesh.shape[a] == 1 for a in spec.used_axes()):
            continue
        local = spec.local_numel(meta.shape, mesh.shape) * item
        is_param = graph.is_param(node)
        grads = local if is_param and graph.requires_grad(node) else 0
        out.append(Strategy(str(spec), (), (spec,), 0.0, 0.0, (),
                            MemoryCost(params=local if is_param else 0, grads=grads, outputs=local)))
    return out


def _output_strategies(graph: CapturedGraph, node: fx.Node, outputs: str = "global", loss: str = "global"
                       ) -> tuple[list[Strategy], list[str]]:
    """The graph output's one strategy. ``outputs="global"``: every tensor output is consumed
    replicated. ``"local"``: a tensor output of rank >= 1 is consumed as produced (input spec
    None: no resharding, the caller gets the producer's local shard); 0-dim outputs replicated,
    unless ``loss="per_rank"``: then they too are consumed as produced (a pending sum is returned
    as each rank's value, whose mean over the ranks is the output, as a DDP rank's loss)."""
    check_outputs(outputs)
    operands = [n for n in node.all_input_nodes
                if graph.tensor_meta(n) is not None and not isinstance(graph.tensor_meta(n), tuple)]
    ranks = [len(graph.tensor_meta(n).shape) for n in operands]  # type: ignore[union-attr]
    specs = tuple(None if (outputs == "local" and r) or returns_per_rank(outputs, loss) else ShardSpec.replicate(r)
                  for r in ranks)
    name = "return replicated" if all(s is not None for s in specs) else "return local"
    return [Strategy(name, specs, (), 0.0, 0.0, (), MemoryCost())], [n.name for n in operands]


def check_outputs(outputs: str) -> None:
    """ValueError naming the accepted values unless ``outputs`` is one of :data:`OUTPUT_MODES`."""
    if outputs not in OUTPUT_MODES:
        raise ValueError(f"outputs must be one of {', '.join(repr(m) for m in OUTPUT_MODES)}, got {outputs!r}")


def node_strategies(graph: CapturedGraph, node: fx.Node, mesh: MeshSpec, hw: HardwareProfile,
                    *, fallback: str = "error", cache: dict | None = None,
                    outputs: str = "global", batch_norm: str = "global", loss: str = "global") -> NodeStrategies:
    """Strategies of one node; raises UnsupportedOpError for an op with no handler. ``outputs``
    (see :data:`OUTPUT_MODES`) says how the graph's output node consumes its tensors,
    ``batch_norm`` (see :data:`autoshard.batch_norm_modes.BATCH_NORM_MODES`) which statistics
    training batch norm uses, ``loss`` (:data:`~autoshard.batch_norm_modes.LOSS_MODES`) what a
    mean loss divides by."""
    from .handlers import handler_for
    from .handlers.registry import op_info

    path = graph.module_path(node)
    if node.op in ("placeholder", "get_attr"):   # get_attr: e.g. the body of a higher-order op
        return NodeStrategies(node.name, node.op, path, _placeholder_strategies(graph, node, mesh), [])
    if node.op == "output":
        strategies, operands = _output_strategies(graph, node, outputs, loss)
        return NodeStrategies(node.name, "output", path, strategies, operands)
    handler = handler_for(node.target)
    is_fallback = False
    if handler is None:
        _refuse_inplace(graph, node, path)
        if fallback != "replicate":
            custom = getattr(node.target, "namespace", "aten") != "aten"
            hint = (" It is a custom op with no decomposition autoshard can inline: register one "
                    "(torch._decomp.register_decomposition) so its aten ops are sharded, register a "
                    "handler (autoshard.handlers.register), or" if custom else
                    " Add a handler in autoshard/handlers/, or")
            raise UnsupportedOpError(
                f"no sharding handler for {op_name(node.target)} at node '{node.name}' "
                f"(module '{path or '<root>'}').{hint} pass fallback='replicate' to run this node "
                f"replicated (it will be reported).")
        is_fallback = True
    op = op_info(node, graph, mesh, **op_function_args(mesh, outputs, batch_norm, loss))
    key = op.signature()
    if cache is not None and key in cache:
        strategies = cache[key]
    else:
        from .strategy import default_name

        rules = () if handler is None or handler.replicate_only else tuple(handler.rules(op))
        namer = handler.namer if handler is not None else default_name
        family = functools.partial(handler.cost_family, op) if handler is not None else None
        calls = functools.partial(handler.local_calls, op) if handler is not None and handler.local_calls else None
        strategies = expand(op, rules, hw, namer, family=family, local_calls=calls)
        if not strategies:
            raise UnsupportedOpError(f"{op.describe()} has no valid strategy on mesh {mesh}")
        if cache is not None:
            cache[key] = strategies
    return NodeStrategies(node.name, op_name(node.target), path, strategies,
                          [n.name for n in op.operand_nodes], fallback=is_fallback, hooked=op.profile().hooked)


def _refuse_inplace(graph: CapturedGraph, node: fx.Node, path: str) -> None:
    """An in-place op that capture left in place (see :func:`autoshard.capture.functionalize_inplace`)
    cannot run even replicated: it would mutate a resharded copy of its operand, not the value."""
    from .capture.inplace import INPLACE_REFUSAL, _written_arg

    if node.op != "call_function" or _written_arg(node.target) is None:
        return
    reason = node.meta.get(INPLACE_REFUSAL, "it is an in-place op with no handler")
    raise UnsupportedOpError(
        f"in-place {op_name(node.target)} at node '{node.name}' (module '{path or '<root>'}') could not "
        f"be made out-of-place: {reason}. Write this line of the model out-of-place (x = x.add(y) "
        f"instead of x.add_(y) / x += y; torch.where or torch.cat instead of slice assignment). "
        f"fallback='replicate' cannot run it either: replicated, it would mutate a copy of its operand.")


def enumerate_strategies(model_or_graph: Any, args: Sequence = (), kwargs: dict | None = None, *,
                         mesh_shape: Any = (2, 2), hardware: Any = "h100-nvlink",
                         fallback: str = "error", outputs: str = "global",
                         batch_norm: str = "global", loss: str = "global") -> StrategyTable:
    """Every sharding strategy of every node of a model (captured here) or of a CapturedGraph.

    ``fallback="replicate"`` runs nodes whose op has no handler replicated and lists them in
    ``table.fallbacks``; the default raises :class:`UnsupportedOpError`. ``outputs``: ``"global"``
    (the graph output consumes every tensor replicated) or ``"local"`` (tensors of rank >= 1 as
    produced; see :data:`OUTPUT_MODES`). ``batch_norm``: the statistics training batch norm
    normalises with, ``"global"`` or ``"per_rank"`` (see :mod:`autoshard.batch_norm_modes`);
    ``loss`` likewise what a mean classification loss divides by.
    """
    if fallback not in ("error", "replicate"):
        raise ValueError(f"fallback must be 'error' or 'replicate', got {fallback!r}")
    check_outputs(outputs)
    graph = model_or_graph if isinstance(model_or_graph, CapturedGraph) else capture(model_or_graph, args, kwargs)
    mesh = MeshSpec.of(mesh_shape)
    op_function_args(mesh, outputs, batch_norm, loss)       # ValueError for an unknown mode
    hw = load_hardware(hardware)
    start = time.perf_counter()
    cache: dict = {}
    nodes: dict[str, NodeStrategies] = {}
    fallbacks = []
    for node in graph.graph.nodes:
        ns = node_strategies(graph, node, mesh, hw, fallback=fallback, cache=cache, outputs=outputs,
                             batch_norm=batch_norm, loss=loss)
        nodes[node.name] = ns
        if ns.fallback:
            fallbacks.append(f"{ns.op} at node '{node.name}' (module '{ns.module_path or '<root>'}')")
    return StrategyTable(graph, mesh, hw, nodes, time.perf_counter() - start, fallbacks, outputs, batch_norm, loss)
