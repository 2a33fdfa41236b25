"""Capture: a model and example inputs -> an aten graph annotated for sharding.

:func:`capture` runs ``torch.export`` (non-strict, training IR: ``aten.linear``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention`` stay whole) on meta, fake or real
tensors, and wraps the result in a :class:`CapturedGraph` that answers, per node: shapes and
dtypes (:class:`TensorMeta`), parameter/buffer FQNs, module path and type, and whether the value
requires grad. Shapes are static: a symbolic size is an error.
"""
from __future__ import annotations

import dataclasses
import hashlib
import operator
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument
# The higher-order op export uses for `with torch.no_grad():` regions (e.g. rotary embeddings).
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

__all__ = ["CaptureError", "CapturedGraph", "TensorMeta", "capture", "op_name"]

aten = torch.ops.aten

# Ops whose floating output never requires grad, whatever their inputs (autograd gives them no
# grad_fn). Ops with integer/bool outputs (argmax, comparisons, ...) are caught by dtype instead.
_NON_DIFFERENTIABLE = frozenset({
    aten.detach, aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like,
    aten.randn_like, aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full,
    aten.new_empty_strided, aten.histc,
})
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class CaptureError(ValueError):
    """The model could not be captured as a static aten graph."""


@dataclass(frozen=True)
class TensorMeta:
    """Static shape, dtype and (propagated) requires-grad flag of one tensor in the graph."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_floating(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


Meta = TensorMeta | tuple[TensorMeta | None, ...] | None   # what tensor_meta() returns
NodeRef = fx.Node | str                                     # a node or its name


class _SymbolicShape(Exception):
    """Internal: a node's value has a symbolic size."""


def repeated_block(module_path: str) -> tuple[str, int] | None:
    """``(prefix, index)`` of the repeated block (a ModuleList/Sequential entry) a module path is
    in: its first numeric component (``model.layers.3.mlp`` -> ``("model.layers", 3)``); None
    outside any block."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdecimal():
            return ".".join(parts[:i]), int(part)
    return None


def op_name(node: fx.Node) -> str:
    """Readable, process-stable name of a node's target: ``aten.linear.default``, ``getitem``."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", None) or str(target)


# -- capture -------------------------------------------------------------------------------------


def capture(model: nn.Module, args: Any = (), kwargs: Mapping[str, Any] | None = None, *,
            name: str | None = None) -> CapturedGraph:
    """Export ``model(*args, **kwargs)`` to an annotated aten graph.

    Works on meta tensors (nothing is allocated) and on real ones. Raises :class:`CaptureError`
    with the cause and what to try when ``torch.export`` fails or a shape is not static.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture needs an nn.Module, got {type(model).__name__}")
    label = name or type(model).__name__
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    start = time.perf_counter()
    try:
        exported = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # export raises many unrelated types; all mean "cannot capture"
        raise CaptureError(_export_failure_message(label, model, e)) from e
    exported_at = time.perf_counter()
    renamed = inline_custom_ops(exported.graph_module)
    renamed.update(functionalize_inplace(exported.graph_module, {
        s.arg.name for s in exported.graph_signature.input_specs if s.kind == InputKind.BUFFER}))
    for spec in exported.graph_signature.output_specs:   # an output may be a rewritten node
        if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
            spec.arg.name = renamed[spec.arg.name]
    graph = CapturedGraph(exported, model, args, kwargs, name=label)
    check_operand_dtypes(graph)
    graph.timings = {"export_s": exported_at - start,
                     "postprocess_s": time.perf_counter() - exported_at}
    return graph


# Ops whose tensor operands must all have one dtype: meta tensors do not check it, so a mismatch
# (int64 inputs to an fp32 Linear) would be planned and fail only on real ranks.
# Value: how many leading arguments must agree (attention masks may be bool).
_SAME_DTYPE_OPS = {
    aten.linear.default: 3, aten.mm.default: 2, aten.addmm.default: 3, aten.bmm.default: 2,
    aten.baddbmm.default: 3, aten.matmul.default: 2, aten.conv1d.default: 3, aten.conv2d.default: 3,
    aten.conv3d.default: 3, aten.convolution.default: 3, aten.scaled_dot_product_attention.default: 3,
}


def check_operand_dtypes(graph: "CapturedGraph") -> None:
    """:class:`CaptureError` when a matmul-family op reads tensors of different dtypes (an integer
    input to a float Linear, a float64 input to float32 weights): it would fail on real tensors."""
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.target not in _SAME_DTYPE_OPS:
            continue
        operands = [a for a in node.args[:_SAME_DTYPE_OPS[node.target]] if isinstance(a, fx.Node)]
        dtypes = {}
        for a in operands:
            meta = graph.tensor_meta(a)
            if isinstance(meta, TensorMeta):
                dtypes[a.name] = meta.dtype
        if len(set(dtypes.values())) > 1:
            listed = ", ".join(f"{n}: {str(d).removeprefix('torch.')}" for n, d in dtypes.items())
            inputs = [n for n in dtypes if n in graph.user_input_specs]
            hint = (f"pass example input {graph.user_input_specs[inputs[0]]} in the dtype the model computes in "
                    f"(e.g. x.float()), or convert the model" if inputs
                    else "cast the operands to one dtype in the model")
            raise CaptureError(f"node '{node.name}' ({op_name(node)}, module '{graph.module_path(node) or '<root>'}') "
                               f"reads tensors of different dtypes ({listed}); it would fail on real tensors: {hint}")


# -- custom ops ----------------------------------------------------------------------------------

INLINED_FROM = "autoshard_inlined_from"
"""``node.meta`` key of the nodes a custom op's decomposition was inlined as: the op's name."""


def custom_op_decomposition(target: Any) -> Any:
    """How to inline a custom (non-aten) op: its registered decomposition
    (``torch._decomp.register_decomposition``), else its CompositeImplicitAutograd kernel; None
    when it has neither (an opaque ``torch.library.custom_op``)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace == "aten":
        return None
    from torch._decomp import decomposition_table

    if target in decomposition_table:
        return decomposition_table[target]
    if torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
        return target.decompose
    return None


def inline_custom_ops(gm: fx.GraphModule) -> dict[str, str]:
    """Replace every custom-op node that has a decomposition by the aten ops of that decomposition
    (traced on meta tensors of the node's shapes), so that the ops' own handlers shard it.
    Custom ops without one stay: the enumerator names them (or runs them replicated, reported,
    under ``fallback="replicate"``). Returns ``{old node name: new node name}`` for nodes whose
    value is now another node's (the caller renames graph outputs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = gm.graph
    renamed: dict[str, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        decomp = custom_op_decomposition(node.target)
        if decomp is None:
            continue
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        slots = [i for i, x in enumerate(leaves) if isinstance(x, fx.Node)]
        vals = [leaves[i].meta.get("val") for i in slots]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            continue          # a non-tensor graph value as argument: left to the enumerator
        device = vals[0].device if vals else torch.device("cpu")

        def call(*tensors: torch.Tensor, _leaves=leaves, _slots=slots, _spec=spec, _decomp=decomp) -> Any:
            filled = list(_leaves)
            for i, t in zip(_slots, tensors):
                filled[i] = t
            args, kwargs = pytree.tree_unflatten(filled, _spec)
            return _decomp(*args, **kwargs)

        examples = [torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for v in vals]
        sub = make_fx(call, pre_dispatch=True)(*examples)
        for n in sub.graph.nodes:       # traced on meta: the captured device is the node's
            n.args, n.kwargs = pytree.tree_map(
                lambda v: device if isinstance(v, torch.device) else v, (n.args, n.kwargs))
        inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        before = set(graph.nodes)
        with graph.inserting_before(node):
            out = graph.graph_copy(sub.graph, {ph: leaves[i] for ph, i in zip(inputs, slots)})
        for n in graph.nodes:           # the inlined ops belong to the custom op's module
            if n not in before:
                n.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
                n.meta[INLINED_FROM] = str(node.target)
        if isinstance(out, fx.Node):
            node.replace_all_uses_with(out)
            renamed[node.name] = out.name
        else:
            for user in list(node.users):
                if user.target is not operator.getitem:
                    raise CaptureError(f"custom op {node.target} at node '{node.name}' returns a tuple "
                                       f"that '{user.name}' uses whole; autoshard cannot inline it")
                user.replace_all_uses_with(out[user.args[1]])
                renamed[user.name] = out[user.args[1]].name
                graph.erase_node(user)
        graph.erase_node(node)
    if renamed:
        graph.lint()
        gm.recompile()
    return renamed


# -- functionalization of in-place ops -----------------------------------------------------------

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


def _export_failure_message(label: str, model: nn.Module, error: Exception) -> str:
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else "(no message)"
    hints = _hints_for(model, error, text)
    bullets = "\n".join(f"  - {h}" for h in hints)
    return (f"capture of {label!r} failed in torch.export: {type(error).__name__}: {first_line}\n"
            f"What to try:\n{bullets}")


def _hints_for(model: nn.Module, error: Exception, text: str) -> list[str]:
    hints = []
    lowered = text.lower()
    if "data-dependent" in lowered or "data dependent" in lowered:
        hints.append("remove Python control flow that depends on tensor values (e.g. "
                     "`if x.sum() > 0:`, `.item()`, `.tolist()`); use torch.where or torch.cond")
    if type(model).__module__.startswith("transformers.") or "cache" in lowered:
        hints.append("for Hugging Face models pass use_cache=False (config.use_cache = False)")
    if isinstance(error, TypeError):
        hints.append("check that args/kwargs match the signature of the model's forward()")
    hints.append("check the example input shapes and dtypes (run the model on them once)")
    hints.append("pass tensors as inputs, not Python objects (lists, dataclasses, strings)")
    return hints


# -- the captured graph --------------------------------------------------------------------------


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

    def module_path(self, ref: NodeRef) -> str:
        """FQN of the innermost module the node was traced in; '' at the root."""
        entry = _innermost_module(self.node(ref))
        return entry[0] if entry else ""

    def module_type(self, ref: NodeRef) -> str:
        """Class name of the innermost module the node was traced in."""
        entry = _innermost_module(self.node(ref))
        if entry is None:
            return self._root_type
        kind = entry[1]
        return kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]

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
