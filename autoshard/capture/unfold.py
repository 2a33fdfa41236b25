"""Unfolding: the ExportedProgram ``torch.export`` would produce at the full depth, written from a
shallow export's periodic layout (the template block repeated with shifted names, module paths and
placeholders; signature, state_dict and module call graph to match).
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry
from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputSpec,
                                          TensorArgument)

from .periodic import FoldError, _LayerList, _Layout, _shift_name


class _Unfolder:
    """Writes the graph of ``src``'s model at ``depth`` layers (``depth`` > ``src.depth``)."""

    def __init__(self, src: _Layout, depth: int) -> None:
        if depth <= src.depth:
            raise ValueError(f"unfold needs more than {src.depth} layers, got {depth}")
        self.src = src
        self.depth = depth
        self.steps = depth - src.depth                # how many layers are added
        self.graph = fx.Graph()
        self.env: dict[str, fx.Node] = {}             # source node name -> node in the new graph
        self.layer_ph: dict[tuple[int, int], fx.Node] = {}   # (layer, position) -> placeholder
        self.blocks: dict[int, list[fx.Node]] = {}    # new layers' nodes
        self.input_specs: list[InputSpec] = []
        self._stacks: dict[tuple[int, int], dict] = {}   # (id(template stack), layer) -> stack

    def run(self) -> fx.Graph:
        self._placeholders()
        self._body()
        self._output()
        return self.graph

    # placeholders: the last layer's run of inputs is followed by the new layers' runs

    def _placeholders(self) -> None:
        src = self.src
        specs = {s.arg.name: s for s in src.ep.graph_signature.input_specs}
        last = src.depth - 1
        pending: list[fx.Node] = []        # the current run of last-layer placeholders
        for node in src.placeholders:
            k = src.layer_ph.get(node.name, (None,))[0]
            if pending and k != last:
                self._new_layer_placeholders(pending, specs)
                pending = []
            self._copy(node)
            self.input_specs.append(specs[node.name])
            if k is not None:
                self.layer_ph[src.layer_ph[node.name]] = self.env[node.name]
            if k == last:
                pending.append(node)
        if pending:
            self._new_layer_placeholders(pending, specs)

    def _new_layer_placeholders(self, run: list[fx.Node], specs: Mapping[str, InputSpec]) -> None:
        src, last = self.src, self.src.depth - 1
        for layer in range(src.depth, self.depth):
            for node in run:
                spec = specs[node.name]
                name = src.layers.relabel_placeholder(node.name, last, layer)
                new = self._create(node, name, (), {})
                new.meta = dict(node.meta)
                target = src.layers.relabel(spec.target, last, layer)
                self.input_specs.append(InputSpec(spec.kind, TensorArgument(name), target,
                                                  spec.persistent))
                self.layer_ph[(layer, src.layer_ph[node.name][1])] = new

    # body: prefix and source blocks verbatim, new blocks from the template, shifted suffix

    def _body(self) -> None:
        src = self.src
        end_of_blocks = src.block_start[-1] + src.block_len
        for node in src.body[:end_of_blocks]:
            self._copy(node)
        for layer in range(src.depth, self.depth):
            self.blocks[layer] = []          # filled in order: a node reads earlier ones
            for template in src.template:
                self.blocks[layer].append(self._block_node(template, layer))
        for node in src.suffix:
            self._suffix_node(node)

    def _block_node(self, template: fx.Node, layer: int) -> fx.Node:
        src = self.src
        steps = layer - (src.depth - 1)
        args, kwargs = fx.node.map_arg((template.args, template.kwargs),
                                       lambda a: self._block_input(a, layer))
        node = self._create(template, _shift_name(template.name, src.name_deltas, steps),
                            args, kwargs)
        node.meta = self._shift_meta(template.meta, steps, relabel_to=layer)
        return node

    def _block_input(self, arg: fx.Node, layer: int) -> fx.Node:
        src, last = self.src, self.src.depth - 1
        if arg.name in src.in_block:
            k, p = src.in_block[arg.name]
            target = layer + (k - last)
            return self.blocks[target][p] if target >= src.depth else self.env[src.block(
                target)[p].name]
        if arg.name in src.layer_ph:
            return self.layer_ph[(layer, src.layer_ph[arg.name][1])]
        return self.env[arg.name]

    def _suffix_node(self, node: fx.Node) -> None:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self._suffix_input)
        new = self._create(node, _shift_name(node.name, self.src.name_deltas, self.steps),
                           args, kwargs)
        new.meta = self._shift_meta(node.meta, self.steps, relabel_to=None)
        self.env[node.name] = new

    def _suffix_input(self, arg: fx.Node) -> fx.Node:
        if arg.name in self.src.in_block:                 # the last layer's (checked)
            return self.blocks[self.depth - 1][self.src.in_block[arg.name][1]]
        if arg.name in self.src.layer_ph:
            return self.layer_ph[(self.depth - 1, self.src.layer_ph[arg.name][1])]
        return self.env[arg.name]

    def _output(self) -> None:
        out = self.src.output
        args = fx.node.map_arg(out.args, self._suffix_input)
        node = self.graph.output(args[0] if len(args) == 1 else args, type_expr=out.type)
        node.meta = dict(out.meta)
        self.env[out.name] = node

    # helpers

    def _copy(self, node: fx.Node) -> None:
        self.env[node.name] = self.graph.node_copy(node, lambda a: self.env[a.name])
        if self.env[node.name].name != node.name:
            raise FoldError(f"node name {node.name!r} could not be kept")

    def _create(self, like: fx.Node, name: str, args: Any, kwargs: Any) -> fx.Node:
        target = name if like.op == "placeholder" else like.target
        node = self.graph.create_node(like.op, target, args, kwargs, name=name,
                                      type_expr=like.type)
        if node.name != name:
            raise FoldError(f"node name {name!r} is taken: the counters are not periodic")
        return node

    def _shift_meta(self, meta: Mapping[str, Any], steps: int,
                    relabel_to: int | None) -> dict[str, Any]:
        src = self.src
        out = {}
        for key, value in meta.items():
            if key == "nn_module_stack" and relabel_to is not None:
                value = dict(self._relabelled_stack(value, relabel_to))
            elif key == "torch_fn":
                value = (_shift_name(value[0], src.fn_deltas, steps), value[1])
            elif isinstance(value, (dict, list)):
                value = copy.copy(value)
            out[key] = value
        return out

    def _relabelled_stack(self, stack: Mapping[str, tuple[str, Any]], layer: int) -> dict:
        key = (id(stack), layer)         # template stacks live as long as the source graph
        if key not in self._stacks:
            self._stacks[key] = self.src.layers.relabel_stack(stack, self.src.depth - 1, layer)
        return self._stacks[key]

    def output_specs(self) -> list[OutputSpec]:
        """The source's output specs, naming the new graph's output nodes."""
        outputs = {n.name: n for n in self.src.output.all_input_nodes}
        renamed = []
        for spec in self.src.ep.graph_signature.output_specs:
            arg = spec.arg
            if isinstance(arg, TensorArgument):
                if arg.name not in outputs:
                    raise FoldError(f"output {arg.name!r} is not an input of the output node")
                arg = TensorArgument(self._suffix_input(outputs[arg.name]).name)
            renamed.append(OutputSpec(spec.kind, arg, spec.target))
        return renamed

    def module_call_graph(self) -> list[ModuleCallEntry]:
        src, last = self.src, self.src.depth - 1
        entries = src.ep.module_call_graph
        out: list[ModuleCallEntry] = []
        pending: list[ModuleCallEntry] = []
        for entry in list(entries) + [None]:
            k = src.layers.layer_of(entry.fqn) if entry is not None else None
            if pending and k != last:
                for layer in range(src.depth, self.depth):
                    out += [ModuleCallEntry(src.layers.relabel(e.fqn, last, layer), None)
                            for e in pending]
                pending = []
            if entry is None:
                break
            if k is not None and entry.signature is not None:
                raise FoldError(f"module {entry.fqn!r} has a preserved call signature")
            out.append(copy.copy(entry))
            if k == last:
                pending.append(entry)
        return out


def _unfold(src: _Layout, depth: int, model: nn.Module) -> ExportedProgram:
    """The ExportedProgram export would produce for ``model`` (``src``'s model at ``depth``)."""
    unfolder = _Unfolder(src, depth)
    graph = unfolder.run()
    signature = ExportGraphSignature(unfolder.input_specs, unfolder.output_specs())
    state_dict, constants = _lifted_tensors(src.ep, signature, model, src.layers)
    _check_lifted(graph, signature, (state_dict, constants))
    return ExportedProgram(
        root=src.ep.graph_module, graph=graph, graph_signature=signature, state_dict=state_dict,
        range_constraints={}, module_call_graph=unfolder.module_call_graph(),
        example_inputs=src.ep.example_inputs, constants=constants, verifiers=src.ep.verifiers)


def _lifted_tensors(src: ExportedProgram, signature: ExportGraphSignature, model: nn.Module,
                    layers: _LayerList) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """state_dict (parameters, persistent buffers) and constants (non-persistent buffers, lifted
    constants) of the unfolded program, taken from the full-depth model as export does."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    state_dict: dict[str, torch.Tensor] = {}
    constants: dict[str, Any] = {}
    for spec in signature.input_specs:
        if spec.kind == InputKind.PARAMETER:
            state_dict[spec.target] = _lookup(params, spec.target, "parameter")
        elif spec.kind == InputKind.BUFFER:
            table = state_dict if spec.persistent else constants
            table[spec.target] = _lookup(buffers, spec.target, "buffer")
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            if layers.layer_of(spec.target) is not None or spec.target not in src.constants:
                raise FoldError(f"lifted constant {spec.target!r} cannot be folded")
            constants[spec.target] = src.constants[spec.target]
    lifted = set(state_dict) | set(constants)
    extra = sorted((set(params) | set(buffers)) - lifted)
    if extra:
        raise FoldError(f"the full model has tensors the folded graph lacks: {extra[:5]}")
    return state_dict, constants


def _check_lifted(graph: fx.Graph, signature: ExportGraphSignature,
                  tables: Sequence[Mapping[str, Any]]) -> None:
    """Every lifted tensor of the full model matches its placeholder's (template) value in
    shape, dtype and requires_grad: layers that differ beyond the probes (other widths, dtypes,
    frozen layers) are caught here."""
    vals = {n.name: n.meta.get("val") for n in graph.nodes if n.op == "placeholder"}
    for spec in signature.input_specs:
        tensor = next((t[spec.target] for t in tables if spec.target in t), None)
        val = vals.get(spec.arg.name)
        if not isinstance(tensor, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        mine = (tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
        theirs = (tuple(val.shape), val.dtype, val.requires_grad)
        if mine != theirs:
            raise FoldError(f"{spec.target!r} is {mine} in the full model but {theirs} in the "
                            "repeated layer: the layers are not identical")


def _lookup(table: Mapping[str, torch.Tensor], fqn: str, what: str) -> torch.Tensor:
    try:
        return table[fqn]
    except KeyError:
        raise FoldError(f"the full model has no {what} {fqn!r} that the folded graph "
                        "expects") from None

