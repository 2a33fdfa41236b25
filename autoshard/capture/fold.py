"""Folded capture: the exported graph of a deep model without tracing every layer.

``torch.export`` traces every layer, so capture time grows linearly with depth (Llama-2-70B: 80
layers, 11-16 s on meta). A stack of identical layers exports to a periodic graph: a prefix, one
copy of the block per layer, a suffix. :func:`capture_folded` exports the model at two small depths
(2 and 3 layers by default), cuts the shallow graph into prefix / blocks / suffix, and writes the
graph export WOULD produce at the full depth: the same nodes, node names (export names nodes by op
with global counters, ``linear``, ``linear_1``, ...; the counters are reproduced), arguments,
``meta['val']``, ``nn_module_stack`` with the right layer indices, one placeholder per parameter
and buffer with the right FQN, graph signature, state_dict and module call graph. The result is a
real :class:`torch.export.ExportedProgram` wrapped in a :class:`~autoshard.capture.CapturedGraph`.

Nothing is assumed silently. The shallow graph must be periodic (block ``n-1`` = block ``n-2``
with every layer index, node-name counter and module path shifted by one layer); the unfolding of
the shallow graph to the second probe depth must equal that depth's real export exactly (nodes,
names, args, metas, signature, state_dict, module call graph); and the full-depth model's parameters
must be exactly the unfolded signature's, in shape, dtype and requires_grad. The per-layer step
of ``meta['torch_fn']`` counters after the layers is read off the two probes (those count Python
calls that may leave no node). Anything else raises :class:`FoldError` and callers fall
back to a full capture (:func:`capture_preset` does so, with a warning).

Fake tensors (``meta['val']``) of the synthesised layers are shared with the template layer of the
shallow export (they are equal in shape, stride, dtype and device; treat them as read-only).
"""
from __future__ import annotations

import copy
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry
from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputSpec,
                                          TensorArgument)

from .graph import CapturedGraph, capture

__all__ = ["FoldError", "capture_folded", "capture_module_folded", "capture_preset", "exported_differences"]

log = logging.getLogger(__name__)

Built = tuple[nn.Module, tuple, dict]
Builder = Callable[[int], Built]

_NAME = re.compile(r"^(.*?)(?:_(\d+))?$")


class FoldError(ValueError):
    """The model's exported graph is not a periodic stack of identical blocks (or folding cannot
    reproduce export exactly); capture it in full instead."""


# -- names ----------------------------------------------------------------------------------------


def _split_name(name: str) -> tuple[str, int | None]:
    """``linear_12`` -> (``linear``, 12); ``linear`` -> (``linear``, None)."""
    match = _NAME.match(name)
    assert match is not None  # the pattern matches every string
    base, num = match.group(1, 2)
    return base, None if num is None else int(num)


def _shift_name(name: str, deltas: Mapping[str, int], steps: int) -> str:
    """The name export gives this node ``steps`` layers later: its counter advances by
    ``steps * deltas[base]`` (the number of same-base names one layer uses)."""
    base, num = _split_name(name)
    shift = deltas.get(base, 0) * steps
    if shift == 0:
        return name
    return f"{base}_{(num or 0) + shift}"


def _name_deltas(template: Sequence[str], previous: Sequence[str], what: str) -> dict[str, int]:
    """Per-base counter step between two consecutive layers, position by position; one base must
    always step by the same amount (export's counters are global)."""
    deltas: dict[str, int] = {}
    for now, before in zip(template, previous):
        (base, num), (base0, num0) = _split_name(now), _split_name(before)
        if base != base0:
            raise FoldError(f"{what} {before!r} and {now!r} at the same place of consecutive "
                            "layers do not share a base name")
        step = (num or 0) - (num0 or 0)
        if deltas.setdefault(base, step) != step:
            raise FoldError(f"{what} counters of {base!r} do not advance uniformly between layers "
                            f"({deltas[base]} and {step})")
    return deltas


# -- the repeated module list ---------------------------------------------------------------------


@dataclass(frozen=True)
class _LayerList:
    """The ModuleList holding the repeated layers (e.g. ``model.layers``)."""

    path: str

    def layer_of(self, fqn: str | None) -> int | None:
        """Layer index of a parameter/module FQN under this list, else None."""
        if not fqn or not fqn.startswith(self.path + "."):
            return None
        head = fqn[len(self.path) + 1:].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def relabel(self, fqn: str, old: int, new: int) -> str:
        """``<path>.<old>...`` -> ``<path>.<new>...``; other FQNs unchanged."""
        if self.layer_of(fqn) != old:
            return fqn
        cut = len(self.path) + 1 + len(str(old))
        return f"{self.path}.{new}{fqn[cut:]}"

    def relabel_placeholder(self, name: str, old: int, new: int) -> str:
        """Placeholder names are sanitised, lower-cased FQNs (``p_model_layers_3_mlp_weight``)."""
        token = f"{self.path.replace('.', '_')}_{old}_".lower()
        at = name.lower().find(token)
        if at < 0 or name.lower().find(token, at + 1) >= 0:
            raise FoldError(f"cannot locate layer {old} in placeholder name {name!r}")
        cut = at + len(token) - len(str(old)) - 1
        return f"{name[:cut]}{new}_{name[at + len(token):]}"

    def relabel_stack(self, stack: Mapping[str, tuple[str, Any]], old: int,
                      new: int) -> dict[str, tuple[str, Any]]:
        """An ``nn_module_stack`` with layer ``old``'s modules renamed to layer ``new``'s."""
        out = {}
        for key, (path, kind) in stack.items():
            moved = self.relabel(path, old, new)
            if moved != path:
                at = key.rfind(path)
                if at < 0 or not re.fullmatch(r"(@\d+)?", key[at + len(path):]):
                    raise FoldError(f"unexpected nn_module_stack key {key!r} for module {path!r}")
                key = key[:at] + moved + key[at + len(path):]
            out[key] = (moved, kind)
        return out


def _find_layer_list(small: ExportedProgram, big: ExportedProgram, depth: int) -> _LayerList:
    """The ModuleList whose extra children the deeper export adds (module paths and parameters of
    the deeper graph that the shallower one lacks all live under ``<path>.<k>`` with k >= depth)."""
    new = _fqns(big) - _fqns(small)
    if not new:
        raise FoldError("the deeper probe adds no modules or parameters: the num_layers option "
                        "does not change the model")
    candidates: set[str] | None = None
    for fqn in new:
        parts = fqn.split(".")
        mine = {".".join(parts[:i]) for i in range(1, len(parts))
                if parts[i].isdigit() and int(parts[i]) >= depth}
        candidates = mine if candidates is None else candidates & mine
    if not candidates or len(candidates) != 1:
        raise FoldError("the layers added by a deeper model are not the children of one "
                        f"ModuleList (candidates: {sorted(candidates or [])}); new: "
                        f"{sorted(new)[:5]}")
    return _LayerList(candidates.pop())


def _fqns(ep: ExportedProgram) -> set[str]:
    names = {s.target for s in ep.graph_signature.input_specs if s.target}
    for node in ep.graph.nodes:
        names.update(path for path, _ in (node.meta.get("nn_module_stack") or {}).values())
    return names


# -- the periodic layout of one real export -------------------------------------------------------


@dataclass
class _Layout:
    """A real export at ``depth`` layers cut into prefix, blocks and suffix."""

    ep: ExportedProgram
    layers: _LayerList
    depth: int
    placeholders: list[fx.Node]
    layer_ph: dict[str, tuple[int, int]]       # placeholder -> (layer, position in its layer)
    body: list[fx.Node]                        # call_function / get_attr nodes, in order
    block_start: list[int]                     # index in body of each block's first node
    block_len: int
    output: fx.Node
    in_block: dict[str, tuple[int, int]] = field(default_factory=dict)   # node -> (layer, pos)
    name_deltas: dict[str, int] = field(default_factory=dict)
    fn_deltas: dict[str, int] = field(default_factory=dict)

    def block(self, k: int) -> list[fx.Node]:
        start = self.block_start[k]
        return self.body[start:start + self.block_len]

    @property
    def suffix(self) -> list[fx.Node]:
        return self.body[self.block_start[-1] + self.block_len:]

    @property
    def template(self) -> list[fx.Node]:
        return self.block(self.depth - 1)


def _layout(ep: ExportedProgram, layers: _LayerList, depth: int) -> _Layout:
    """Cut a real export into its periodic parts and check that the last two blocks agree."""
    if depth < 2:
        raise FoldError(f"the shallow probe needs at least 2 layers, got {depth}")
    nodes = list(ep.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    body = [n for n in nodes if n.op in ("call_function", "get_attr")]
    other = [n for n in nodes if n.op not in ("placeholder", "call_function", "get_attr")]
    if len(other) != 1 or other[0].op != "output" or nodes[-1] is not other[0]:
        raise FoldError(f"unexpected node kinds {[n.op for n in other]}")
    layer_ph = _layer_placeholders(ep, layers, depth)
    starts, length = _blocks(body, layers, depth)
    out = _Layout(ep, layers, depth, placeholders, layer_ph, body, starts, length, nodes[-1])
    for k in range(depth):
        for p, node in enumerate(out.block(k)):
            out.in_block[node.name] = (k, p)
    _check_periodic(out)
    return out


def _layer_placeholders(ep: ExportedProgram, layers: _LayerList,
                        depth: int) -> dict[str, tuple[int, int]]:
    """Which placeholders belong to which layer; every layer must have the same inputs, in the
    same order (FQNs equal up to the layer index)."""
    per_layer: list[list[InputSpec]] = [[] for _ in range(depth)]
    for spec in ep.graph_signature.input_specs:
        k = layers.layer_of(spec.target)
        if k is not None:
            if k >= depth:
                raise FoldError(f"input {spec.target!r} names layer {k} of a {depth}-layer model")
            per_layer[k].append(spec)
    first = [(s.kind, layers.relabel(s.target, 0, 1), s.persistent) for s in per_layer[0]]
    for k in range(1, depth):
        now = [(s.kind, layers.relabel(s.target, k, 1), s.persistent) for s in per_layer[k]]
        if now != first:
            raise FoldError(f"layers 0 and {k} have different parameters/buffers")
    return {s.arg.name: (k, i) for k, specs in enumerate(per_layer) for i, s in enumerate(specs)}


def _blocks(body: list[fx.Node], layers: _LayerList, depth: int) -> tuple[list[int], int]:
    """Block k runs from the first node traced in layer k to the first node of layer k+1 (nodes
    of the parent module in between belong to block k); all blocks have the same length."""
    owner = [layers.layer_of(_module_path(n)) for n in body]
    starts = []
    for k in range(depth):
        if k not in owner:
            raise FoldError(f"no graph node was traced in layer {k}")
        starts.append(owner.index(k))
    length = starts[1] - starts[0]
    if any(b - a != length for a, b in zip(starts, starts[1:])):
        raise FoldError("the layers' blocks differ in length")
    for i, k in enumerate(owner):
        if k is not None and not starts[k] <= i < starts[k] + length:
            raise FoldError(f"node {body[i].name!r} of layer {k} lies outside that layer's block "
                            "(the layers are not traced one after the other)")
    if starts[-1] + length > len(body):
        raise FoldError("the last block is shorter than the others")
    return starts, length


def _module_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    return next(reversed(stack.values()))[0] if stack else None


# -- periodicity of the shallow export ------------------------------------------------------------


def _check_periodic(out: _Layout) -> None:
    """The last block equals the one before it up to the layer index: ops, argument roles,
    constants, metas; fills the per-base name-counter steps."""
    n = out.depth
    template, previous = out.template, out.block(n - 2)
    for node in template:
        if node.op != "call_function":
            raise FoldError(f"node {node.name!r} ({node.op}) in a repeated block: blocks with "
                            "higher-order-op sub-graphs are not folded")
    out.name_deltas = _name_deltas([t.name for t in template], [p.name for p in previous], "node")
    fns = [(t.meta.get("torch_fn"), p.meta.get("torch_fn")) for t, p in zip(template, previous)]
    out.fn_deltas = _name_deltas([t[0] for t, _ in fns if t], [p[0] for _, p in fns if p],
                                 "torch_fn")
    for now, before in zip(template, previous):
        where = f"node {now.name!r} (layer {n - 1}) vs {before.name!r} (layer {n - 2})"
        if now.target != before.target or now.op != before.op:
            raise FoldError(f"{where}: different ops {now.target} and {before.target}")
        if not _same_roles(_roles(out, now, n - 1), _roles(out, before, n - 2), n - 2 == 0):
            raise FoldError(f"{where}: arguments are not the same up to the layer index")
        _check_meta_periodic(out, now, before, where)
    for node in out.suffix + [out.output]:
        for arg in node.all_input_nodes:
            k = out.in_block.get(arg.name, out.layer_ph.get(arg.name, (None,)))[0]
            if k is not None and k != n - 1:
                raise FoldError(f"node {node.name!r} after the layers reads {arg.name!r} of layer "
                                f"{k}, not only the last layer")


def _roles(out: _Layout, node: fx.Node, layer: int) -> Any:
    """The node's (args, kwargs) with each input replaced by its role relative to ``layer``:
    ('block', layer offset, position), ('input', layer offset, position) or ('node', name)."""
    def role(arg: fx.Node) -> Any:
        if arg.name in out.in_block:
            k, p = out.in_block[arg.name]
            return _Role("block", k - layer, p)
        if arg.name in out.layer_ph:
            k, p = out.layer_ph[arg.name]
            return _Role("input", k - layer, p)
        return _Role("node", 0, arg.name)
    return fx.node.map_arg((node.args, node.kwargs), role)


@dataclass(frozen=True)
class _Role:
    kind: str           # block | input | node
    offset: int         # layer of the input minus the layer of the reader
    where: Any          # position in the block / in the layer's inputs; node name


def _same_roles(now: Any, before: Any, first_block: bool) -> bool:
    """Arguments agree up to the layer index. The first block reads from the prefix what later
    blocks read from the previous block (the carried hidden state)."""
    if isinstance(now, _Role) and isinstance(before, _Role):
        carried = first_block and before.kind == "node" and (now.kind, now.offset) == ("block", -1)
        return now == before or carried
    if isinstance(now, (list, tuple)) and isinstance(before, (list, tuple)):
        return (type(now) is type(before) and len(now) == len(before)
                and all(_same_roles(a, b, first_block) for a, b in zip(now, before)))
    if isinstance(now, dict) and isinstance(before, dict):
        return now.keys() == before.keys() and all(
            _same_roles(now[k], before[k], first_block) for k in now)
    return type(now) is type(before) and now == before


def _check_meta_periodic(out: _Layout, now: fx.Node, before: fx.Node, where: str) -> None:
    """Metas of consecutive layers agree: same values, module stacks up to the layer index."""
    if now.meta.keys() != before.meta.keys():
        raise FoldError(f"{where}: different meta keys")
    n = out.depth
    for key, value in now.meta.items():
        other = before.meta[key]
        if key == "val":
            same = _val_key(value) == _val_key(other)
        elif key == "nn_module_stack":
            same = _items(out.layers.relabel_stack(other, n - 2, n - 1)) == _items(value)
        elif key == "torch_fn":
            same = value[1] == other[1]
        else:
            same = value == other
        if not same:
            raise FoldError(f"{where}: meta[{key!r}] differs between layers")


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


def _learn_suffix_fn_steps(src: _Layout, deep: ExportedProgram, depth: int) -> None:
    """Per-layer steps of the ``torch_fn`` counters of the suffix, from the two probes.

    ``meta['torch_fn']`` names count Python-level calls, including calls that leave no node in the
    graph (e.g. a ``.contiguous()`` elided on real tensors), so the blocks' nodes do not tell how
    far a suffix node's counter moves per layer; the two probe depths do. Steps the blocks also
    show must agree."""
    suffix = src.suffix
    deep_body = [n for n in deep.graph.nodes if n.op in ("call_function", "get_attr")]
    if len(deep_body) < len(suffix):
        raise FoldError("the deeper probe has a shorter graph than the shallow one")
    layers = depth - src.depth
    for shallow_node, deep_node in zip(suffix, deep_body[len(deep_body) - len(suffix):]):
        fn_a, fn_b = shallow_node.meta.get("torch_fn"), deep_node.meta.get("torch_fn")
        if fn_a is None or fn_b is None:
            continue
        (base, num), (base_b, num_b) = _split_name(fn_a[0]), _split_name(fn_b[0])
        moved = (num_b or 0) - (num or 0)
        if base != base_b or moved % layers:
            raise FoldError(f"torch_fn {fn_a[0]!r} of {shallow_node.name!r} does not move "
                            f"periodically with depth ({fn_b[0]!r} at {depth} layers)")
        if src.fn_deltas.setdefault(base, moved // layers) != moved // layers:
            raise FoldError(f"torch_fn counters of {base!r} do not advance uniformly per layer")


# -- unfolding ------------------------------------------------------------------------------------


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


# -- comparing two exported programs --------------------------------------------------------------


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


# -- public entry points --------------------------------------------------------------------------


def capture_folded(build: Builder, num_layers: int, *, name: str | None = None,
                   probes: tuple[int, int] = (2, 3)) -> CapturedGraph:
    """Capture the model ``build(num_layers)`` builds, exporting only shallow copies of it.

    ``build(depth)`` returns ``(model, args, kwargs)`` for the same model with ``depth`` repeated
    layers (build on ``meta`` to allocate nothing). The models at the two ``probes`` depths are
    exported; the shallow graph is unfolded to the deeper probe's depth and must equal that real
    export exactly, then it is unfolded to ``num_layers``. Raises :class:`FoldError` when the
    model is not a periodic stack of identical layers (callers then capture in full) and
    :class:`~autoshard.capture.CaptureError` when a probe cannot be exported at all.
    At ``num_layers`` <= the deeper probe this is a plain :func:`~autoshard.capture.capture`.
    ``graph.timings`` has ``export_s`` (both probes), ``verify_s``, ``fold_s`` (building the
    full-depth model and program) and ``postprocess_s`` (CapturedGraph's annotation).
    """
    shallow, deep = probes
    if not 2 <= shallow < deep:
        raise ValueError(f"probes must be two depths 2 <= a < b, got {probes}")
    if num_layers <= deep:
        return capture(*build(num_layers), name=name)
    start = time.perf_counter()
    small_model, small = _export(build, shallow, name)
    deep_model, check = _export(build, deep, name)
    exported = time.perf_counter()
    layers = _find_layer_list(small.exported, check.exported, shallow)
    src = _layout(small.exported, layers, shallow)
    _learn_suffix_fn_steps(src, check.exported, deep)
    _verify(src, deep, deep_model, check.exported)
    verified = time.perf_counter()
    model, args, kwargs = build(num_layers)
    program = _unfold(src, num_layers, model)
    unfolded = time.perf_counter()
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    graph = CapturedGraph(program, model, args, kwargs, name=name or type(model).__name__)
    graph.timings = {"export_s": exported - start, "verify_s": verified - exported,
                     "fold_s": unfolded - verified,
                     "postprocess_s": time.perf_counter() - unfolded}
    return graph


def _export(build: Builder, depth: int, name: str | None) -> tuple[nn.Module, CapturedGraph]:
    model, args, kwargs = build(depth)
    return model, capture(model, args, kwargs, name=name)


def _verify(src: _Layout, depth: int, model: nn.Module, real: ExportedProgram) -> None:
    """The unfolding to ``depth`` (the deeper probe's) must be that probe's real export."""
    diffs = exported_differences(_unfold(src, depth, model), real)
    if diffs:
        raise FoldError(f"unfolding the {src.depth}-layer graph to {depth} layers does not "
                        "reproduce the real export:\n  " + "\n  ".join(diffs))


def capture_module_folded(model: nn.Module, args: Any = (), kwargs: Mapping[str, Any] | None = None, *,
                          name: str | None = None) -> CapturedGraph | None:
    """A model's folded capture on meta tensors, from the model itself (what
    :func:`autoshard.plan` uses): a Hugging Face model (``config.num_hidden_layers`` > 3) whose
    layers are the one ``nn.ModuleList`` of that length. The probes are copies of the model with
    that list cut to 2 and 3 layers (and ``config.num_hidden_layers``, ``config.layer_types`` to
    match), so whatever the user changed in the model (dtype, replaced modules, attributes) is in
    them; the full-depth model is the model's own meta copy, whose parameters the unfolded
    signature must match exactly. None when the model does not qualify; :class:`FoldError` when
    folding cannot reproduce export (capture in full then)."""
    from .meta_device import meta_copy, to_meta

    config = getattr(model, "config", None)
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth <= 3:
        return None
    lists = [path for path, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
    if len(lists) != 1:
        return None
    parent_path, _, attr = lists[0].rpartition(".")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    meta_args, meta_kwargs = to_meta(args), to_meta(dict(kwargs or {}))
    with torch.device("meta"):
        full = meta_copy(model)

    def build(layers: int) -> Built:
        if layers == depth:
            return full, meta_args, meta_kwargs
        parent = full.get_submodule(parent_path)
        every = getattr(parent, attr)
        setattr(parent, attr, nn.ModuleList(list(every)[:layers]))
        try:
            probe = copy.deepcopy(full)       # meta: allocates nothing; the config is copied with it
        finally:
            setattr(parent, attr, every)
        probe.config.num_hidden_layers = layers
        if isinstance(getattr(probe.config, "layer_types", None), list):
            probe.config.layer_types = probe.config.layer_types[:layers]
        return probe, meta_args, meta_kwargs

    return capture_folded(build, depth, name=name)


def capture_preset(name: str, *, device: "str | torch.device" = "meta", batch: int | None = None,
                   seq: int | None = None, num_layers: int | None = None, fold: bool = True,
                   before_capture: "Callable[[tuple, dict], None] | None" = None,
                   **overrides: Any) -> CapturedGraph:
    """Build a model-zoo preset (see :func:`autoshard.models.build_model`) and capture it.

    Hugging Face presets (anything whose config has ``num_hidden_layers``) are captured folded
    (:func:`capture_folded`) unless ``fold=False``; a :class:`FoldError` falls back to a full
    capture with a warning. Other presets and ``file.py:factory`` models are captured in full.
    ``before_capture(args, kwargs)`` sees the example inputs once the model is built, before the
    capture (which can take minutes): a check that raises there saves it.
    """
    from ..models import build_model

    options = dict(overrides, device=device, batch=batch, seq=seq)
    if num_layers is not None:
        options["num_layers"] = num_layers
    model, args, kwargs = build_model(name, **options)
    if before_capture is not None:
        before_capture(tuple(args), dict(kwargs or {}))
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not fold or not isinstance(depth, int):
        if torch.device(device).type == "meta":
            # a factory without device= builds where it likes; capture it on meta as parallelize does
            from .meta_device import capture_meta

            return capture_meta(model, args, kwargs, name=name)
        return capture(model, args, kwargs, name=name)

    def build(layers: int) -> Built:
        if layers == depth:
            return model, args, kwargs
        return build_model(name, **dict(options, num_layers=layers))

    try:
        return capture_folded(build, depth, name=name)
    except FoldError as e:
        log.warning("folded capture of %s failed, capturing all %d layers: %s", name, depth, e)
        return capture(model, args, kwargs, name=name)
