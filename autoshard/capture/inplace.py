"""Functionalization: in-place ops on intermediate values rewritten as their out-of-place twins
(a write through a chain of invertible views carried back to the base), or left in place with
the reason recorded for the enumerator to name.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx

__all__ = ["INPLACE_REFUSAL", "functionalize_inplace"]

aten = torch.ops.aten

INPLACE_REFUSAL = "autoshard_inplace_refusal"
"""``node.meta`` key: why an in-place node was left in place (the enumerator's error says it)."""


def _written_arg(target: Any) -> int | None:
    """Schema index of the argument an in-place aten op writes (``self`` of ``add_``), else None."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return None
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    return written[0] if len(written) == 1 else None


def _out_of_place(target: Any) -> Any:
    """The functional twin of an in-place overload (``add_.Tensor`` -> ``add.Tensor``), or None."""
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if not name.endswith("_") or name.endswith("__"):
        return None
    twin = getattr(getattr(aten, name[:-1], None), target._overloadname, None)
    if twin is None or twin._schema.is_mutable or len(twin._schema.returns) != 1:
        return None
    return twin


def _aliases_input(node: fx.Node) -> bool:
    """Whether ``node``'s value may share storage with one of its inputs (a view, a split piece,
    detach/alias, the result of an in-place op)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and _aliases_input(src)
    schema = getattr(target, "_schema", None)
    return schema is not None and any(a.alias_info is not None for a in schema.arguments)


def _views_of(node: fx.Node) -> list[fx.Node]:
    """Every node whose value is a view of ``node``'s storage (transitively), ``node`` excluded."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        for user in n.users:
            if _aliases_input(user) and user.args and user.args[0] is n and user not in out:
                out.append(user)
                todo.append(user)
    return out


def _twin_mismatch(node: fx.Node, twin: Any) -> str | None:
    """Why the out-of-place ``twin`` would not give the in-place node's value (another dtype:
    ``half.add_(float)`` stays half, ``add`` promotes; another shape: broadcasting), or None."""
    want = node.meta.get("val")

    def meta(x: Any) -> Any:
        v = x.meta.get("val") if isinstance(x, fx.Node) else x
        if isinstance(v, torch.Tensor):
            return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
        return torch.device("meta") if isinstance(x, torch.device) else v

    args, kwargs = pytree.tree_map(meta, (node.args, node.kwargs))
    try:
        got = twin(*args, **kwargs)
    except Exception as e:   # the twin refuses these arguments: keep the node, say why
        return f"its out-of-place twin {twin} fails on the captured shapes ({type(e).__name__}: {e})"
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return "its value is not a tensor"
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return (f"its out-of-place twin {twin} gives {got.dtype}{list(got.shape)}, the in-place op "
                f"{want.dtype}{list(want.shape)}")
    return None


def _copy_as_differentiable_ops(graph: fx.Graph, node: fx.Node, dst: fx.Node) -> fx.Node:
    """``dst.copy_(src)`` as a fresh value: ``src`` cast to dst's dtype, expanded to its shape, copied.
    (``aten.copy``, copy_'s functional twin, has no autograd formula; these ops do.)"""
    src = node.args[1]
    want, have = dst.meta["val"], src.meta["val"]
    cur = src

    def add(target: Any, args: tuple, kwargs: dict, shape: Sequence[int], dtype: torch.dtype) -> fx.Node:
        n = graph.create_node("call_function", target, args, kwargs, name=f"{node.name.rstrip('_')}_functional")
        n.meta = {**node.meta, "val": torch.empty(tuple(shape), dtype=dtype, device="meta")}
        return n

    if have.dtype != want.dtype:
        cur = add(aten._to_copy.default, (cur,), {"dtype": want.dtype}, have.shape, want.dtype)
    if tuple(have.shape) != tuple(want.shape):
        cur = add(aten.expand.default, (cur, list(want.shape)), {}, want.shape, want.dtype)
    if cur is src or cur.target is aten.expand.default:   # never alias src: copy_ gives a new value
        cur = add(aten.clone.default, (cur,), {}, want.shape, want.dtype)
    return cur


def _view_chain(value: fx.Node, values: Mapping[fx.Node, Any]) -> list[fx.Node] | None:
    """``[base, v1, ..., value]`` when ``value`` is a chain of invertible views (:data:`_SCATTER`)
    of a fresh ``base`` (a computed value, not a graph input or another view; ``values``, the new
    values earlier rewrites gave a base, count as fresh); None otherwise."""
    chain = [value]
    while chain[0] not in values and _aliases_input(chain[0]):
        head = chain[0]
        if head.target not in _SCATTER or not isinstance(head.args[0], fx.Node):
            return None
        chain.insert(0, head.args[0])
    return chain if chain[0].op == "call_function" else None


def _scatter_back(graph: fx.Graph, view: fx.Node, base: fx.Node, new_view: fx.Node, meta: dict) -> fx.Node:
    """The new value of ``base`` after its view ``view`` (``view = op(base, ...)``) became ``new_view``."""
    kind = _SCATTER[view.target]
    rest = tuple(view.args[1:])
    if kind == "slice":
        target, args = aten.slice_scatter.default, (base, new_view, *rest)
    elif kind == "select":
        target, args = aten.select_scatter.default, (base, new_view, *rest)
    elif kind == "reshape":
        target, args = aten.reshape.default, (new_view, list(base.meta["val"].shape))
    elif kind == "transpose":      # transpose(d0, d1) and t() are their own inverses
        target, args = view.target, (new_view, *rest)
    elif kind == "permute":
        perm = [d % len(rest[0]) for d in rest[0]]
        target, args = aten.permute.default, (new_view, [perm.index(d) for d in range(len(perm))])
    else:                          # alias / detach: the same elements
        return new_view
    val = base.meta["val"]
    n = graph.create_node("call_function", target, args, {}, name=f"{base.name}_updated")
    n.meta = {**meta, "val": torch.empty(tuple(val.shape), dtype=val.dtype, device="meta")}
    return n


# View ops through which an in-place write is propagated back to the base, and how.
_SCATTER = {
    aten.slice.Tensor: "slice", aten.select.int: "select",
    aten.view.default: "reshape", aten.reshape.default: "reshape", aten._unsafe_view.default: "reshape",
    aten.unsqueeze.default: "reshape", aten.squeeze.dim: "reshape", aten.squeeze.dims: "reshape",
    aten.squeeze.default: "reshape", aten.flatten.using_ints: "reshape", aten.unflatten.int: "reshape",
    aten.transpose.int: "transpose", aten.t.default: "transpose", aten.permute.default: "permute",
    aten.alias.default: "alias",
}


def functionalize_inplace(gm: fx.GraphModule, buffers: set[str] | frozenset[str] = frozenset()
                          ) -> dict[str, str]:
    """Rewrite in-place ops on intermediate values as their out-of-place twins, in place in ``gm``.

    ``y = f(x); y.add_(z); g(y)`` becomes ``y2 = add(y, z); g(y2)``: the in-place node is replaced
    by its functional twin, and every later use of the mutated value reads the new one. A write
    through a chain of views of a computed value (``x[:, 1:] = v`` is ``slice`` then ``copy_``;
    ``x[:, 0] = 7`` is ``select`` then ``fill_``) is applied to the view out-of-place and carried
    back to the base by the inverse of each view (``slice_scatter``, ``select_scatter``, a reshape,
    transpose or permute back); later uses of the base read the result. That is exact when nothing else
    sees the storage: no view of the base taken before the write (the chain included) is read after
    it. Left in place, with the reason in ``node.meta[INPLACE_REFUSAL]`` (the enumerator refuses
    them, naming it): mutations of graph inputs (buffers keep their own path: a batch-norm step
    counter is a replicated in-place add), through views with no inverse here (``split``,
    ``expand``, ``diagonal``, ...), of values whose earlier views are read later, and where the
    out-of-place twin would give another dtype. Returns ``{old name: new name}`` of the in-place
    nodes rewritten (the caller renames graph outputs). ``buffers``: the placeholder names of the
    module's buffers.
    """
    graph = gm.graph
    rewritten: dict[str, str] = {}
    # A value and the new values rewrites give it share one storage in the model: root -> values.
    root_of: dict[fx.Node, fx.Node] = {}
    family: dict[fx.Node, list[fx.Node]] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        w = _written_arg(node.target)
        if w is None:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        is_copy = node.target is aten.copy_.default
        twin = aten.copy.default if is_copy else _out_of_place(node.target)
        mutated = node.args[w] if w < len(node.args) else node.kwargs.get(node.target._schema.arguments[w].name)
        reason, chain = None, None
        if twin is None:
            reason = "it has no out-of-place twin autoshard can use"
        elif not isinstance(mutated, fx.Node):
            reason = "its mutated operand is not a graph value"
        elif mutated.op == "placeholder":
            if mutated.name in buffers:
                continue          # buffer mutation: handled where it is (see the docstring)
            reason = f"it mutates the graph input '{mutated.name}'"
        else:
            chain = _view_chain(mutated, root_of)
            if chain is None:
                reason = (f"it mutates '{mutated.name}', a view of another value through a view op "
                          f"autoshard cannot invert, or of a graph input (the base would change too)")
            else:
                members = family.get(root_of.get(chain[0], chain[0]), [chain[0]])
                late = [v.name for m in members for v in _views_of(m) if v not in root_of
                        and order[v] < order[node]
                        and any(u is not node and order[u] > order[node] for u in v.users)]
                if late:
                    reason = f"views of '{chain[0].name}' taken before it ({', '.join(late)}) are read after it"
        if reason is None and not is_copy:
            reason = _twin_mismatch(node, twin)
        if reason is not None:
            node.meta[INPLACE_REFUSAL] = reason
            continue
        assert chain is not None
        base = chain[0]
        later = [u for u in base.users if u is not node and order[u] > order[node]]
        with graph.inserting_before(node):
            if is_copy:
                new = _copy_as_differentiable_ops(graph, node, mutated)
            else:
                new = graph.create_node("call_function", twin, node.args, dict(node.kwargs),
                                        name=f"{node.name.rstrip('_')}_functional")
            new.meta = dict(node.meta)
            new_base = new
            for view, parent in zip(reversed(chain[1:]), reversed(chain[:-1])):
                new_base = _scatter_back(graph, view, parent, new_base, node.meta)
        for user in later:
            user.replace_input_with(base, new_base)
        root = root_of.get(base, base)
        root_of[new_base] = root
        family.setdefault(root, [root]).append(new_base)
        node.replace_all_uses_with(new)
        rewritten[node.name] = new.name
        graph.erase_node(node)
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten
