"""The periodic layout of a shallow export: its graph cut into prefix, one block per layer and
suffix, the layer list the blocks come from, export's per-layer node-name steps, and the check that
consecutive blocks are the same block up to the layer index (:class:`FoldError` otherwise).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputSpec

from .compare import _items, _val_key

__all__ = ["FoldError"]

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

