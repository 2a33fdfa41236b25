"""Comparing two exported programs: where they differ, node by node (ops, names, arguments, metas),
in signature, state_dict, constants and module call graph. Folding checks its unfolding against a
real export with it.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import fx
from torch.export import ExportedProgram

__all__ = ["exported_differences"]


def exported_differences(a: ExportedProgram, b: ExportedProgram, limit: int = 10) -> list[str]:
    """Where two exported programs differ (empty if they are the same program): nodes (op, name,
    target, args, kwargs, every meta entry; values by shape/stride/dtype/device/requires_grad),
    sub-graphs, graph signature, state_dict and constants (by name, shape, dtype), module call
    graph. At most ``limit`` differences are listed."""
    found: list[str] = []
    checks = (_graph_differences(a.graph_module, b.graph_module),
              _signature_differences(a, b), _tensor_table_differences(a, b),
              _call_graph_differences(a, b))
    for diffs in checks:
        for diff in diffs:
            found.append(diff)
            if len(found) >= limit:
                return found
    return found


def _graph_differences(a: fx.GraphModule, b: fx.GraphModule, where: str = "") -> Iterable[str]:
    nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
    if len(nodes_a) != len(nodes_b):
        yield f"{where}graph has {len(nodes_a)} vs {len(nodes_b)} nodes"
    for x, y in zip(nodes_a, nodes_b):
        diff = _node_difference(x, y)
        if diff:
            yield f"{where}node {x.name!r} vs {y.name!r}: {diff}"
            return
        if x.op == "get_attr":
            sub_a, sub_b = getattr(a, x.target, None), getattr(b, y.target, None)
            if isinstance(sub_a, fx.GraphModule) and isinstance(sub_b, fx.GraphModule):
                yield from _graph_differences(sub_a, sub_b, f"{where}{x.name}/")


def _node_difference(x: fx.Node, y: fx.Node) -> str:
    if (x.op, x.name, x.target) != (y.op, y.name, y.target):
        return f"op/name/target {(x.op, x.name, x.target)} vs {(y.op, y.name, y.target)}"
    if _args_key((x.args, x.kwargs)) != _args_key((y.args, y.kwargs)):
        return f"args {x.args} {x.kwargs} vs {y.args} {y.kwargs}"
    if x.meta.keys() != y.meta.keys():
        return f"meta keys {sorted(x.meta)} vs {sorted(y.meta)}"
    for key in x.meta:
        same = (_val_key(x.meta[key]) == _val_key(y.meta[key]) if key == "val"
                else _items(x.meta[key]) == _items(y.meta[key]))
        if not same:
            return f"meta[{key!r}] {x.meta[key]!r} vs {y.meta[key]!r}"
    return ""


def _args_key(value: Any) -> Any:
    mapped = fx.node.map_arg(value, lambda n: ("%node", n.name))
    return _typed(mapped)


def _typed(value: Any) -> Any:
    """Constants with their types (1 and 1.0 and True differ in a graph)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_typed(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _typed(v)) for k, v in value.items()))
    return (type(value).__name__, value)


def _signature_differences(a: ExportedProgram, b: ExportedProgram) -> Iterable[str]:
    sa, sb = a.graph_signature, b.graph_signature
    if sa.input_specs != sb.input_specs:
        yield f"input specs differ: {_first_mismatch(sa.input_specs, sb.input_specs)}"
    if sa.output_specs != sb.output_specs:
        yield f"output specs differ: {_first_mismatch(sa.output_specs, sb.output_specs)}"
    if a.call_spec != b.call_spec:
        yield "call specs differ"


def _tensor_table_differences(a: ExportedProgram, b: ExportedProgram) -> Iterable[str]:
    for label, ta, tb in (("state_dict", a.state_dict, b.state_dict),
                          ("constants", a.constants, b.constants)):
        if list(ta) != list(tb):
            yield f"{label} keys differ: {_first_mismatch(list(ta), list(tb))}"
            continue
        for key in ta:
            if _val_key(ta[key]) != _val_key(tb[key]):
                yield f"{label}[{key!r}] differs"


def _call_graph_differences(a: ExportedProgram, b: ExportedProgram) -> Iterable[str]:
    ca = [(e.fqn, str(e.signature)) for e in a.module_call_graph]
    cb = [(e.fqn, str(e.signature)) for e in b.module_call_graph]
    if ca != cb:
        yield f"module call graphs differ: {_first_mismatch(ca, cb)}"


def _first_mismatch(a: Sequence[Any], b: Sequence[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"at {i}: {x} vs {y}"
    return f"lengths {len(a)} vs {len(b)}"


def _items(value: Any) -> Any:
    """Dicts compared in order (an ``nn_module_stack`` lists the outermost module first)."""
    return list(value.items()) if isinstance(value, dict) else value


def _val_key(val: Any) -> Any:
    """What identifies a node's value: shape, stride, dtype, device, requires_grad per tensor."""
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), val.storage_offset(), val.dtype,
                val.device.type, val.requires_grad)
    if isinstance(val, (list, tuple)):
        return tuple(_val_key(v) for v in val)
    return val if isinstance(val, (int, float, bool, str, type(None))) else type(val).__name__

