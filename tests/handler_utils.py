"""Shared helpers for handler tests: real per-node values, and checking every strategy of a node."""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Sequence

import pytest

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

import autoshard.enumerate
import autoshard.strategy
from autoshard.capture import CapturedGraph, capture
from autoshard.enumerate import node_strategies
from autoshard.handlers import handler_for
from autoshard.handlers.registry import REGISTRY
from autoshard.hardware import load_hardware
from autoshard.mesh import MeshSpec
from autoshard.opinfo import OpInfo
from autoshard.strategy import Strategy
from autoshard.verify import check_strategy

MESHES = [(2, 2), (1, 4), (4, 1)]

# verify simulates each device as a thread: torch's intra-op pool on top of them oversubscribes
# the cores and makes the checks ~8x slower (a conv3d node: 7.5 s -> 0.9 s).
torch.set_num_threads(1)


class Fn(torch.nn.Module):
    """Wraps a function of the inputs (and of the module's own layers, if any)."""

    def __init__(self, fn, **layers):
        super().__init__()
        self.fn = fn
        for k, v in layers.items():
            setattr(self, k, v)

    def forward(self, *args):
        return self.fn(self, *args)


def export_nodes(module: torch.nn.Module, args: Sequence = (), kwargs: dict | None = None
                 ) -> tuple[CapturedGraph, dict[str, Any]]:
    """Capture ``module`` on real tensors and record every node's real value."""
    graph = capture(module, tuple(args), kwargs)
    ep = graph.exported
    state = {**dict(module.named_parameters(remove_duplicate=False)),
             **dict(module.named_buffers(remove_duplicate=False))}
    user_leaves = iter(pytree.tree_leaves((tuple(args), dict(kwargs or {}))))
    feed = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            feed.append(state[spec.target].detach().clone())
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            feed.append(ep.constants[spec.target])
        else:
            feed.append(next(user_leaves))
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.no_grad():
        Recorder(ep.graph_module).run(*feed)
    return graph, values


def find_node(graph: CapturedGraph, target: Any, index: int = 0) -> fx.Node:
    nodes = [n for n in graph.graph.nodes if n.op == "call_function" and n.target == target]
    if len(nodes) <= index:
        raise LookupError(f"no node #{index} with target {target} in graph")
    return nodes[index]


def case_exporter(wrap: Callable[[Callable], torch.nn.Module] = Fn
                  ) -> Callable[[dict, str], tuple[CapturedGraph, dict[str, Any], fx.Node]]:
    """``get(cases, name)``: the graph, values and node of case ``name`` of a case table
    (``name -> (target op, fn, make_args, ...)``, ``fn`` run as ``wrap(fn)``'s forward), exported
    once (seeded by name)."""
    cache: dict[str, tuple] = {}

    def get(cases: dict, case: str) -> tuple[CapturedGraph, dict[str, Any], fx.Node]:
        if case not in cache:
            torch.manual_seed(zlib.crc32(case.encode()))
            target, fn, make = cases[case][:3]
            graph, values = export_nodes(wrap(fn), make())
            cache[case] = (graph, values, find_node(graph, target))
        return cache[case]

    return get


def operand_values(op: OpInfo, values: dict[str, Any]) -> list[torch.Tensor]:
    """Real values of a node's tensor operands (getitem: the selected element)."""
    import operator

    out = []
    for n in op.operand_nodes:
        v = values[n.name]
        if op.node.target is operator.getitem and isinstance(v, (tuple, list)):
            v = v[op.node.args[1]]
        out.append(v)
    return out


def check_all_strategies(graph: CapturedGraph, node: fx.Node, values: dict[str, Any],
                         mesh_shape: Sequence[int], hardware: str = "h100-nvlink") -> list[Strategy]:
    """Enumerate the node's strategies on ``mesh_shape`` and simulate every one (raises on mismatch)."""
    mesh = MeshSpec.of(mesh_shape)
    ns = node_strategies(graph, node, mesh, load_hardware(hardware))
    handler = handler_for(node.target)
    op = OpInfo(node, graph, mesh, free=handler.free)
    vals = operand_values(op, values)
    for s in ns.strategies:
        check_strategy(op, handler, s, vals)
    return ns.strategies


def no_enumeration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every way to enumerate strategies raise (the enumerator, the expander, each handler's
    per-axis rules): what runs afterwards must work from a plan alone."""
    def refuse(what: str) -> Callable:
        def raiser(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"strategies were enumerated after planning: {what} was called")
        return raiser

    monkeypatch.setattr(autoshard.enumerate, "node_strategies", refuse("enumerate.node_strategies"))
    monkeypatch.setattr(autoshard.enumerate, "enumerate_strategies", refuse("enumerate.enumerate_strategies"))
    monkeypatch.setattr(autoshard.enumerate, "expand", refuse("strategy.expand"))
    monkeypatch.setattr(autoshard.strategy, "expand", refuse("strategy.expand"))
    for target, handler in list(REGISTRY.items()):
        monkeypatch.setitem(REGISTRY, target, dataclasses.replace(handler, rules=refuse(f"the {handler.family} rules")))
