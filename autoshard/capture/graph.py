"""The captured graph: an exported aten graph plus, per node, what the sharding planner asks of it.

:class:`CapturedGraph` answers shapes and dtypes (:class:`~autoshard.capture.nodes.TensorMeta`),
parameter/buffer FQNs, module path and type, whether the value requires grad, which output of a
multi-output node a consumer reads, and a process-stable fingerprint of the graph. Shapes are
static: a symbolic size is an error.
"""
from __future__ import annotations

import dataclasses
import hashlib
import operator
import re
from collections import Counter
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument
# The higher-order op export uses for `with torch.no_grad():` regions (e.g. rotary embeddings).
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

from .nodes import CaptureError, Meta, NodeRef, TensorMeta, op_name

__all__ = ["CapturedGraph"]

aten = torch.ops.aten

# Ops whose floating output never requires grad, whatever their inputs (autograd gives them no
# grad_fn). Ops with integer/bool outputs (argmax, comparisons, ...) are caught by dtype instead.
_NON_DIFFERENTIABLE = frozenset({
    aten.detach, aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like,
    aten.randn_like, aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full,
    aten.new_empty_strided, aten.histc,
})
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class _SymbolicShape(Exception):
    """Internal: a node's value has a symbolic size."""


class CapturedGraph:
    """An exported aten graph plus per-node facts the sharding planner needs.

    Attributes: ``exported`` (the ExportedProgram), ``graph_module``/``graph`` (its fx objects),
    ``param_fqn``/``buffer_fqn``/``constant_fqn`` (placeholder name -> FQN; one placeholder per
    tensor, tied tensors under their first name), ``tied_params`` (canonical FQN -> all names),
    ``tied_placeholders`` (unused duplicate placeholder -> the one used), ``user_inputs`` (tensor
    input placeholders, in order), ``user_input_specs`` (placeholder -> ``args[0]`` /
    ``kwargs['x']``), ``constant_inputs`` (non-tensor inputs export baked in), ``outputs`` (user
    output node names), ``timings`` (seconds spent in export and in post-processing).
    Node arguments of the query methods may be an ``fx.Node`` or a node name.
    """

    def __init__(self, exported: ExportedProgram, model: nn.Module, args: tuple = (),
                 kwargs: Mapping[str, Any] | None = None, *, name: str | None = None) -> None:
        self.name = name or type(model).__name__
        self.exported = exported
        self.graph_module: fx.GraphModule = exported.graph_module
        self.graph: fx.Graph = exported.graph_module.graph
        self.timings: dict[str, float] = {}
        self._by_name = {n.name: n for n in self.graph.nodes}
        self._root_type = type(model).__name__
        self._read_signature(model)
        self._read_user_inputs(args, dict(kwargs or {}))
        self._meta, self._requires_grad = self._annotate()
        self._fingerprint: str | None = None
        self._module_classes: dict[str, str] | None = None

    # -- construction steps --------------------------------------------------------------------

    def _read_signature(self, model: nn.Module) -> None:
        """Placeholder -> FQN maps. Tied weights are reported under their first name in
        ``model.named_parameters()``; all names of a tied tensor are in ``tied_params``."""
        canonical_param = _canonical_names(model.named_parameters(remove_duplicate=False))
        canonical_buffer = _canonical_names(model.named_buffers(remove_duplicate=False))
        self.param_fqn: dict[str, str] = {}
        self.buffer_fqn: dict[str, str] = {}
        self.constant_fqn: dict[str, str] = {}
        self.user_inputs: list[str] = []
        self._param_requires_grad: dict[str, bool] = {}
        for spec in self.exported.graph_signature.input_specs:
            if spec.kind == InputKind.PARAMETER:
                param = model.get_parameter(spec.target)
                self.param_fqn[spec.arg.name] = canonical_param[id(param)][0]
                self._param_requires_grad[spec.arg.name] = param.requires_grad
            elif spec.kind == InputKind.BUFFER:
                buffer = model.get_buffer(spec.target)
                self.buffer_fqn[spec.arg.name] = canonical_buffer[id(buffer)][0]
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                self.constant_fqn[spec.arg.name] = spec.target
            elif spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, TensorArgument):
                self.user_inputs.append(spec.arg.name)
        self.tied_params: dict[str, tuple[str, ...]] = {
            names[0]: names for names in canonical_param.values() if len(names) > 1}
        self.tied_placeholders: dict[str, str] = {}
        self._drop_unused_aliases(self.param_fqn)
        self._drop_unused_aliases(self.buffer_fqn)
        self.outputs: list[str] = [
            s.arg.name for s in self.exported.graph_signature.output_specs
            if s.kind == OutputKind.USER_OUTPUT and isinstance(s.arg, TensorArgument)]

    def _drop_unused_aliases(self, fqns: dict[str, str]) -> None:
        """export lifts a tied tensor once per name but routes every use through one placeholder;
        the others stay unused. Keep one placeholder per tensor; record the rest in
        ``tied_placeholders`` (unused placeholder -> the one that is used)."""
        by_fqn: dict[str, list[str]] = {}
        for placeholder, fqn in fqns.items():
            by_fqn.setdefault(fqn, []).append(placeholder)
        for placeholders in by_fqn.values():
            if len(placeholders) < 2:
                continue
            used = [p for p in placeholders if self._by_name[p].users] or placeholders[:1]
            for placeholder in placeholders:
                if placeholder not in used:
                    self.tied_placeholders[placeholder] = used[0]
                    del fqns[placeholder]

    def _read_user_inputs(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Where each user-input placeholder came from (``args[0]``, ``kwargs['labels']``) and
        whether its example tensor requires grad. Non-tensor inputs are specialised by export;
        they are kept in ``constant_inputs``."""
        self.user_input_specs: dict[str, str] = {}
        self.constant_inputs: dict[str, Any] = {}
        self._input_requires_grad: dict[str, bool] = {}
        leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
        user_specs = [s for s in self.exported.graph_signature.input_specs
                      if s.kind == InputKind.USER_INPUT]
        recoverable = spec == self.exported.call_spec.in_spec and len(leaves) == len(user_specs)
        for i, input_spec in enumerate(user_specs):
            placeholder = input_spec.arg.name
            value = leaves[i][1] if recoverable else None
            if not isinstance(input_spec.arg, TensorArgument):
                self.constant_inputs[placeholder] = getattr(input_spec.arg, "value", None)
                continue
            if recoverable:
                self.user_input_specs[placeholder] = _describe_path(leaves[i][0])
            if not isinstance(value, torch.Tensor):  # source unknown: export's fake value knows
                value = self._by_name[placeholder].meta.get("val")
            self._input_requires_grad[placeholder] = bool(getattr(value, "requires_grad", False))

    def _annotate(self) -> tuple[dict[str, Meta], dict[str, bool]]:
        """One topological pass: static TensorMeta and requires-grad flag of every node."""
        metas: dict[str, Meta] = {}
        grads: dict[str, bool] = {}
        for node in self.graph.nodes:
            if node.op == "output":
                continue
            try:
                meta = _static_meta(node.meta.get("val"))
            except _SymbolicShape:
                raise CaptureError(self._symbolic_message(node)) from None
            grads[node.name] = self._node_requires_grad(node, meta, grads)
            metas[node.name] = _with_grad(meta) if grads[node.name] else meta
        return metas, grads

    def _node_requires_grad(self, node: fx.Node, meta: Meta, grads: Mapping[str, bool]) -> bool:
        if node.op == "placeholder":
            return (self._param_requires_grad.get(node.name, False)
                    or self._input_requires_grad.get(node.name, False))
        if node.op != "call_function" or not _is_floating(meta):
            return False
        target = node.target
        if target is operator.getitem:
            return grads[node.args[0].name]
        if getattr(target, "overloadpacket", None) in _NON_DIFFERENTIABLE:
            return False
        if target is wrap_with_set_grad_enabled and not node.args[0]:
            return False
        return any(grads[i.name] for i in node.all_input_nodes)

    def _symbolic_message(self, node: fx.Node) -> str:
        val = node.meta.get("val")
        shape = tuple(getattr(val, "shape", ())) or val
        return (f"capture of {self.name!r}: node {node.name!r} ({op_name(node)} in module "
                f"{self.module_path(node) or '<root>'!r}) has a symbolic size {shape}. "
                "Dynamic shapes are not supported: capture with static example shapes, and avoid "
                "ops whose output size depends on tensor values (nonzero, masked_select, unique, "
                "boolean-mask indexing, .item()).")

    # -- node queries ----------------------------------------------------------------------------

    def node(self, ref: NodeRef) -> fx.Node:
        """The node with this name (or the node itself)."""
        if isinstance(ref, fx.Node):
            return ref
        try:
            return self._by_name[ref]
        except KeyError:
            raise KeyError(f"no node named {ref!r} in the graph of {self.name!r}") from None

    def nodes(self) -> Iterator[fx.Node]:
        """The call_function nodes, in topological order."""
        return (n for n in self.graph.nodes if n.op == "call_function")

    def is_param(self, ref: NodeRef) -> bool:
        return _name(ref) in self.param_fqn

    def is_buffer(self, ref: NodeRef) -> bool:
        return _name(ref) in self.buffer_fqn

    def is_user_input(self, ref: NodeRef) -> bool:
        """True for placeholders of tensor user inputs (non-tensor inputs are constants)."""
        return _name(ref) in self._input_requires_grad

    def tensor_meta(self, ref: NodeRef) -> Meta:
        """Shape/dtype/requires_grad of the node's value; a tuple for multi-output nodes; None for
        non-tensor values."""
        return self._meta.get(self.node(ref).name)

    def requires_grad(self, ref: NodeRef) -> bool:
        """Whether the node's value (any of its outputs) carries gradient in training."""
        return self._requires_grad.get(self.node(ref).name, False)

    def output_index(self, consumer: NodeRef, producer: NodeRef) -> int:
        """Which output of ``producer`` (an operand of ``consumer``) ``consumer`` reads: element ``i``
        of a multi-output producer for ``getitem(producer, i)``, else output 0."""
        node = self.node(consumer)
        if node.target is operator.getitem and isinstance(self.tensor_meta(producer), tuple):
            return int(node.args[1])
        return 0

    def module_path(self, ref: NodeRef) -> str:
        """FQN of the innermost module the node was traced in; '' at the root."""
        entry = _innermost_module(self.node(ref))
        return entry[0] if entry else ""

    def module_type(self, ref: NodeRef) -> str:
        """Class name of the innermost module the node was traced in."""
        entry = _innermost_module(self.node(ref))
        return self._root_type if entry is None else _class_name(entry[1])

    def module_classes(self) -> dict[str, str]:
        """FQN -> class name of every module some node was traced in (directly or in a
        submodule), the root under ``""``."""
        if self._module_classes is None:
            classes = {"": self._root_type}
            for node in self.graph.nodes:
                for path, kind in (node.meta.get("nn_module_stack") or {}).values():
                    classes.setdefault(path, _class_name(kind))
            self._module_classes = classes
        return self._module_classes

    # -- whole-graph views -----------------------------------------------------------------------

    def summary(self) -> dict[str, int]:
        """Count of call_function nodes per op, most frequent first."""
        return dict(Counter(op_name(n) for n in self.nodes()).most_common())

    def fingerprint(self) -> str:
        """sha256 of a canonical description of the graph (ops, inputs, constants, shapes, dtypes,
        FQNs, requires-grad of inputs): the same model structure and input shapes give the same
        value in any process; any op or shape change changes it. Device names are left out, but
        torch.export may record a different graph on another device type (on meta it keeps an
        ``aten.contiguous`` that real CPU tensors elide), so compare captures made on the same
        device type (meta is cheapest)."""
        if self._fingerprint is None:
            lines = [f"placeholder-info {self._placeholder_info(n)}" for n in self.graph.nodes
                     if n.op == "placeholder"]
            lines += _describe_graph(self.graph_module)
            self._fingerprint = hashlib.sha256("\n".join(lines).encode()).hexdigest()
        return self._fingerprint

    def _placeholder_info(self, node: fx.Node) -> str:
        name = node.name
        for kind, table in (("param", self.param_fqn), ("buffer", self.buffer_fqn),
                            ("constant", self.constant_fqn), ("input", self.user_input_specs),
                            ("tied-to", self.tied_placeholders)):
            if name in table:
                return f"{name} {kind}:{table[name]} grad={self.requires_grad(name)}"
        return f"{name} other grad={self.requires_grad(name)}"

    def __repr__(self) -> str:
        return (f"CapturedGraph({self.name!r}: {sum(1 for _ in self.nodes())} ops, "
                f"{len(self.param_fqn)} params, inputs {self.user_inputs}, outputs {self.outputs})")


# -- helpers -------------------------------------------------------------------------------------

def _name(ref: NodeRef) -> str:
    return ref.name if isinstance(ref, fx.Node) else ref


def _canonical_names(named: Iterator[tuple[str, torch.Tensor]]) -> dict[int, tuple[str, ...]]:
    """id(tensor) -> all its names, first (canonical) one first."""
    names: dict[int, list[str]] = {}
    for fqn, tensor in named:
        names.setdefault(id(tensor), []).append(fqn)
    return {k: tuple(v) for k, v in names.items()}


def _describe_path(path: Sequence[Any]) -> str:
    """pytree path of (args, kwargs) -> ``args[0]`` / ``kwargs['labels']``."""
    head = "args" if path[0].idx == 0 else "kwargs"
    return head + pytree.keystr(tuple(path[1:]))


def _static_meta(val: Any) -> Meta:
    """TensorMeta (requires_grad False) of a node's ``meta['val']``; raises _SymbolicShape."""
    if isinstance(val, torch.Tensor):
        shape = tuple(val.shape)
        if any(type(d) is not int for d in shape):
            raise _SymbolicShape
        return TensorMeta(shape, val.dtype, False)
    if isinstance(val, (list, tuple)):
        return tuple(_static_meta(v) for v in val)  # type: ignore[misc]
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _SymbolicShape
    return None


def _is_floating(meta: Meta) -> bool:
    if isinstance(meta, tuple):
        return any(_is_floating(m) for m in meta)
    return meta is not None and meta.is_floating


def _with_grad(meta: Meta) -> Meta:
    """The meta of a node that requires grad: its floating outputs do, integer/bool ones not."""
    if isinstance(meta, tuple):
        return tuple(_with_grad(m) for m in meta)  # type: ignore[misc]
    if meta is None or not meta.is_floating:
        return meta
    return dataclasses.replace(meta, requires_grad=True)


def _class_name(kind: Any) -> str:
    """A module class as ``nn_module_stack`` records it (a type, or its qualified name)."""
    return kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]


def _innermost_module(node: fx.Node) -> tuple[str, Any] | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return next(reversed(stack.values()))


def _describe_graph(gm: fx.GraphModule, prefix: str = "") -> list[str]:
    """One line per node (op, target, inputs, constants, output meta); sub-graphs (bodies of
    higher-order ops) are described inline under their get_attr node."""
    lines = []
    for node in gm.graph.nodes:
        args = _canonical(node.args)
        kwargs = _canonical(dict(sorted(node.kwargs.items())))
        out = _canonical_val(node.meta.get("val"))
        lines.append(f"{prefix}{node.op} {node.name} {op_name(node)} {args} {kwargs} -> {out}")
        if node.op == "get_attr":
            sub = getattr(gm, node.target, None)
            if isinstance(sub, fx.GraphModule):
                lines += _describe_graph(sub, prefix=f"{prefix}{node.name}/")
    return lines


def _canonical(value: Any) -> str:
    """Stable text for node arguments. Devices are left out on purpose: a plan made on meta
    tensors must match the same model captured on GPUs."""
    if isinstance(value, fx.Node):
        return f"%{value.name}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_canonical(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.device):
        return "<device>"
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return repr(value)
    return _ADDRESS.sub("", f"{type(value).__name__}:{value!r}")


def _canonical_val(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype)}{list(val.shape)}"
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(_canonical_val(v) for v in val) + ")"
    return "-" if val is None else type(val).__name__
