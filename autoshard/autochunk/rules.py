"""Per-op dim-flow rules of AutoChunk: which input dims carry a given output dim of an aten op.

Each rule answers the question of :mod:`.flow` for one op family (pointwise ops with broadcasting,
reductions, normalisations, matmuls, attention, views and shape ops, ...); :data:`RULES` maps aten
ops to them and :func:`backward` asks the one for a node. Ops with no rule are not free in any
dim, so an unknown op always ends a region.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch
from torch import fx

from ..opinfo import op_name
from .flow import Flow, NotFree, bound_args, broadcast_dim, input_nodes, merge, norm_dim, tensors_of, value

aten = torch.ops.aten

Rule = Callable[[fx.Node, int, int], Flow]


def pointwise(node: fx.Node, d: int, size: int) -> Flow:
    """Elementwise ops with broadcasting: each operand keeps the dim that lines up with ``d``."""
    n = value(node).ndim
    flow: dict[fx.Node, int | None] = {}
    for a in input_nodes(node):
        merge(flow, a, broadcast_dim(a, n, d, size))
    return Flow(flow)


def _first_only(node: fx.Node, d: int, size: int) -> Flow:
    """Ops that follow their first input and only read the others' dtype (``type_as``)."""
    ins = list(input_nodes(node))
    flow: dict[fx.Node, int | None] = {ins[0]: d}
    for a in ins[1:]:
        merge(flow, a, None)
    return Flow(flow)


def _same_dim_except(dim_name: str) -> Rule:
    """Ops that mix positions along one dim argument (softmax, cumsum): free everywhere else."""

    def rule(node: fx.Node, d: int, size: int) -> Flow:
        inp = node.args[0]
        dim = norm_dim(bound_args(node)[dim_name], value(inp).ndim)
        if dim == d:
            raise NotFree(f"{node.target} mixes positions along dim {dim}")
        return Flow({inp: d})

    return rule


def _reduction(dim_name: str, keepdim_name: str = "keepdim") -> Rule:
    """Reductions over listed dims: free in the kept dims, mapped past the removed ones."""

    def rule(node: fx.Node, d: int, size: int) -> Flow:
        b = bound_args(node)
        inp = node.args[0]
        ndim = value(inp).ndim
        dims = b[dim_name]
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            raise NotFree(f"{node.target} reduces over every dim")
        dims = [dims] if isinstance(dims, int) else list(dims)
        reduced = {norm_dim(x, ndim) for x in dims}
        kept = list(range(ndim)) if b.get(keepdim_name) else [i for i in range(ndim) if i not in reduced]
        src = kept[d]
        if src in reduced:
            raise NotFree(f"{node.target} reduces dim {src}")
        return Flow({inp: src})

    return rule


def _norm_over_last(shape_name: str) -> Rule:
    """layer_norm / rms_norm: statistics over the trailing ``normalized_shape`` dims only."""

    def rule(node: fx.Node, d: int, size: int) -> Flow:
        b = bound_args(node)
        inp = node.args[0]
        ndim = value(inp).ndim
        if d >= ndim - len(b[shape_name]):
            raise NotFree(f"{node.target} normalises over dim {d}")
        return _first_input_flows(node, d)

    return rule


def _batch_norm_eval(training_name: str | None) -> Rule:
    """Batch norm with running statistics: free in every dim except channels (dim 1)."""

    def rule(node: fx.Node, d: int, size: int) -> Flow:
        if training_name is not None and bound_args(node)[training_name]:
            raise NotFree("batch norm in training mode uses batch statistics")
        if d == 1:
            raise NotFree("batch norm parameters run along the channel dim")
        return _first_input_flows(node, d)

    return rule


def _first_input_flows(node: fx.Node, d: int) -> Flow:
    """Dim ``d`` flows through the first input; the other inputs (weights, statistics) are whole."""
    inp = node.args[0]
    flow: dict[fx.Node, int | None] = {inp: d}
    for a in input_nodes(node):
        if a is not inp:
            merge(flow, a, None)
    return Flow(flow)


def _mm(node: fx.Node, d: int, size: int) -> Flow:
    a, b = node.args[0], node.args[1]
    return Flow({a: 0, b: None} if d == 0 else {a: None, b: 1})


def _addmm(node: fx.Node, d: int, size: int) -> Flow:
    bias, a, b = node.args[0], node.args[1], node.args[2]
    flow: dict[fx.Node, int | None] = {a: 0, b: None} if d == 0 else {a: None, b: 1}
    merge(flow, bias, broadcast_dim(bias, 2, d, size))
    return Flow(flow)


def _bmm(node: fx.Node, d: int, size: int) -> Flow:
    a, b = node.args[0], node.args[1]
    if d == 0:
        flow: dict[fx.Node, int | None] = {a: 0}
        merge(flow, b, 0)
        return Flow(flow)
    return Flow({a: 1, b: None} if d == 1 else {a: None, b: 2})


def _matmul(node: fx.Node, d: int, size: int) -> Flow:
    """torch.matmul with 1-D operands and broadcast batch dims."""
    a, b = node.args[0], node.args[1]
    na, nb, n = value(a).ndim, value(b).ndim, value(node).ndim
    if na == 1 and nb == 1:
        raise NotFree("a dot product has no free dim")
    has_m, has_n = na >= 2, nb >= 2
    m_dim = n - 2 if has_n and has_m else (n - 1 if has_m else None)
    n_dim = n - 1 if has_n else None
    if d == m_dim:
        return Flow({a: na - 2, b: None})
    if d == n_dim:
        return Flow({a: None, b: nb - 1})
    batch = n - int(has_m) - int(has_n)  # number of batch dims of the output
    flow: dict[fx.Node, int | None] = {}
    for x, nx in ((a, na), (b, nb)):
        xb = nx - 2 if nx >= 2 else 0
        xd = d - (batch - xb)
        if xd < 0 or value(x).shape[xd] == 1:
            merge(flow, x, None)
        elif value(x).shape[xd] != size:
            raise NotFree(f"{x.name} batch dim {xd} does not match")
        else:
            merge(flow, x, xd)
    return Flow(flow)


def _linear(node: fx.Node, d: int, size: int) -> Flow:
    """linear(x, W, b): free in x's leading dims; the out-feature dim slices W and b rows."""
    x = node.args[0]
    w = node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    n = value(node).ndim
    if d < n - 1:
        flow: dict[fx.Node, int | None] = {x: d, w: None}
        if isinstance(bias, fx.Node):
            flow[bias] = None
        return Flow(flow)
    flow = {x: None, w: 0}
    if isinstance(bias, fx.Node):
        flow[bias] = 0
    return Flow(flow)


def _attention(mask_name: str) -> Rule:
    """SDPA: free over the query dim and the batch dims; the keys/values are read whole."""

    def rule(node: fx.Node, d: int, size: int) -> Flow:
        b = bound_args(node)
        q, k, v, mask = b["query"], b["key"], b["value"], b.get(mask_name)
        n = value(q).ndim
        if b.get("dropout_p"):
            raise NotFree("attention dropout is random")
        if d == n - 1:
            raise NotFree("the head dim of attention is contracted")
        if d == n - 2:
            if b.get("is_causal"):
                raise NotFree("a causal mask depends on the query position")
            flow: dict[fx.Node, int | None] = {q: d, k: None, v: None}
            if isinstance(mask, fx.Node):
                merge(flow, mask, broadcast_dim(mask, n, d, size))
            return Flow(flow)
        if b.get("enable_gqa"):
            raise NotFree("grouped-query attention maps heads unevenly")
        flow = {}
        for x in (q, k, v):
            merge(flow, x, broadcast_dim(x, n, d, size))
        if isinstance(mask, fx.Node):
            merge(flow, mask, broadcast_dim(mask, n, d, size))
        return Flow(flow)

    return rule


def reshape_dim_map(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Map dst dims to src dims that a reshape keeps as a whole dim (size-1 dims ignored)."""
    ia = [i for i, s in enumerate(src) if s != 1]
    ib = [i for i, s in enumerate(dst) if s != 1]
    out: dict[int, int] = {}
    x = y = 0
    while x < len(ia) and y < len(ib):
        ga, gb = [ia[x]], [ib[y]]
        pa, pb = src[ia[x]], dst[ib[y]]
        x, y = x + 1, y + 1
        while pa != pb:
            if pa < pb and x < len(ia):
                ga.append(ia[x])
                pa *= src[ia[x]]
                x += 1
            elif pb < pa and y < len(ib):
                gb.append(ib[y])
                pb *= dst[ib[y]]
                y += 1
            else:
                return out
        if len(ga) == 1 and len(gb) == 1:
            out[gb[0]] = ga[0]
    return out


def _reshape(node: fx.Node, d: int, size: int) -> Flow:
    inp = node.args[0]
    mapping = reshape_dim_map(value(inp).shape, value(node).shape)
    if d not in mapping:
        raise NotFree(f"reshape merges or splits dim {d}")
    return Flow({inp: mapping[d]}, size_arg=1)


def _expand(node: fx.Node, d: int, size: int) -> Flow:
    inp = node.args[0]
    return Flow({inp: broadcast_dim(inp, value(node).ndim, d, size)}, size_arg=1)


def _transpose(node: fx.Node, d: int, size: int) -> Flow:
    inp = node.args[0]
    ndim = value(inp).ndim
    if node.target is aten.t.default:
        d0, d1 = 0, 1
    else:
        d0, d1 = norm_dim(node.args[1], ndim), norm_dim(node.args[2], ndim)
    src = d1 if d == d0 else d0 if d == d1 else d
    return Flow({node.args[0]: src})


def _permute(node: fx.Node, d: int, size: int) -> Flow:
    inp = node.args[0]
    perm = [norm_dim(p, value(inp).ndim) for p in node.args[1]]
    return Flow({inp: perm[d]})


def _unsqueeze(node: fx.Node, d: int, size: int) -> Flow:
    dim = norm_dim(node.args[1], value(node).ndim)
    if d == dim:
        raise NotFree("an unsqueezed dim has size 1")
    return Flow({node.args[0]: d if d < dim else d - 1})


def _squeeze(node: fx.Node, d: int, size: int) -> Flow:
    inp = node.args[0]
    shape = value(inp).shape
    if node.target is aten.squeeze.default:
        gone = {i for i, s in enumerate(shape) if s == 1}
    else:
        dims = node.args[1]
        dims = [dims] if isinstance(dims, int) else dims
        gone = {norm_dim(x, len(shape)) for x in dims if shape[norm_dim(x, len(shape))] == 1}
    kept = [i for i in range(len(shape)) if i not in gone]
    return Flow({inp: kept[d]})


def _slice(node: fx.Node, d: int, size: int) -> Flow:
    b = bound_args(node)
    inp = node.args[0]
    shape = value(inp).shape
    dim = norm_dim(b["dim"], len(shape))
    if dim == d and (b["start"] not in (None, 0) or b["step"] != 1
                     or (b["end"] is not None and b["end"] < shape[dim])):
        raise NotFree("slicing along the chunked dim")
    return Flow({inp: d})


def _select(node: fx.Node, d: int, size: int) -> Flow:
    dim = norm_dim(node.args[1], value(node.args[0]).ndim)
    return Flow({node.args[0]: d if d < dim else d + 1})


def _split(node: fx.Node, d: int, size: int) -> Flow:
    inp = node.args[0]
    b = bound_args(node)
    if norm_dim(b["dim"], value(inp).ndim) == d:
        raise NotFree("splitting along the chunked dim")
    return Flow({inp: d})


def _unbind(node: fx.Node, d: int, size: int) -> Flow:
    dim = norm_dim(bound_args(node)["dim"], value(node.args[0]).ndim)
    return Flow({node.args[0]: d if d < dim else d + 1})


def _getitem(node: fx.Node, d: int, size: int) -> Flow:
    src = node.args[0]
    if not isinstance(src, fx.Node) or not isinstance(src.meta.get("val"), (list, tuple)):
        raise NotFree("getitem on a non-tuple value")
    return Flow({src: d})


def _cat(stack: bool) -> Rule:
    def rule(node: fx.Node, d: int, size: int) -> Flow:
        tensors = node.args[0]
        out_ndim = value(node).ndim
        dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, out_ndim)
        if dim == d:
            raise NotFree("concatenating along the chunked dim")
        src = d if not stack or d < dim else d - 1
        flow: dict[fx.Node, int | None] = {}
        for t in tensors:
            merge(flow, t, src)
        return Flow(flow)

    return rule


def _embedding(node: fx.Node, d: int, size: int) -> Flow:
    weight, idx = node.args[0], node.args[1]
    if d == value(node).ndim - 1:
        raise NotFree("the embedding dim comes from the table")
    return Flow({weight: None, idx: d})


def _tri(node: fx.Node, d: int, size: int) -> Flow:
    if d >= value(node).ndim - 2:
        raise NotFree("tril/triu depend on the row and column position")
    return Flow({node.args[0]: d})


def _dropout(node: fx.Node, d: int, size: int) -> Flow:
    if bound_args(node)["train"]:
        raise NotFree("dropout in training mode is random")
    return Flow({node.args[0]: d})


RULES: dict[Any, Rule] = {
    operator.getitem: _getitem,
    aten.type_as.default: _first_only,
    aten.softmax.int: _same_dim_except("dim"),
    aten._softmax.default: _same_dim_except("dim"),
    aten.log_softmax.int: _same_dim_except("dim"),
    aten._log_softmax.default: _same_dim_except("dim"),
    aten.cumsum.default: _same_dim_except("dim"),
    aten.sum.dim_IntList: _reduction("dim"),
    aten.mean.dim: _reduction("dim"),
    aten.amax.default: _reduction("dim"),
    aten.amin.default: _reduction("dim"),
    aten.max.dim: _reduction("dim"),
    aten.min.dim: _reduction("dim"),
    aten.argmax.default: _reduction("dim"),
    aten.argmin.default: _reduction("dim"),
    aten.logsumexp.default: _reduction("dim"),
    aten.any.dim: _reduction("dim"),
    aten.any.dims: _reduction("dim"),
    aten.all.dim: _reduction("dim"),
    aten.all.dims: _reduction("dim"),
    aten.prod.dim_int: _reduction("dim"),
    aten.var.correction: _reduction("dim"),
    aten.std.correction: _reduction("dim"),
    aten.var_mean.correction: _reduction("dim"),
    aten.linalg_vector_norm.default: _reduction("dim"),
    aten.layer_norm.default: _norm_over_last("normalized_shape"),
    aten.native_layer_norm.default: _norm_over_last("normalized_shape"),
    aten.rms_norm.default: _norm_over_last("normalized_shape"),
    aten.batch_norm.default: _batch_norm_eval("training"),
    aten._native_batch_norm_legit_no_training.default: _batch_norm_eval(None),
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten.matmul.default: _matmul,
    aten.linear.default: _linear,
    aten.scaled_dot_product_attention.default: _attention("attn_mask"),
    aten._scaled_dot_product_flash_attention_for_cpu.default: _attention("attn_mask"),
    aten.view.default: _reshape,
    aten.reshape.default: _reshape,
    aten._unsafe_view.default: _reshape,
    aten.view_copy.default: _reshape,
    aten.expand.default: _expand,
    aten.expand_copy.default: _expand,
    aten.transpose.int: _transpose,
    aten.t.default: _transpose,
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.default: _squeeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.chunk.default: _split,
    aten.unbind.int: _unbind,
    aten.cat.default: _cat(stack=False),
    aten.stack.default: _cat(stack=True),
    aten.embedding.default: _embedding,
    aten.tril.default: _tri,
    aten.triu.default: _tri,
    aten.dropout.default: _dropout,
}

_POINTWISE_EXTRA = {
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.alias.default,
    aten.detach.default, aten.contiguous.default, aten.clone.default, aten.masked_fill.Tensor,
    aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar, aten.lift_fresh_copy.default,
    # same shape as the input, values not read
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
}


def rule_for(node: fx.Node) -> Rule | None:
    """The flow rule for a call_function node, or None when its op has none."""
    if node.op != "call_function":
        return None
    target = node.target
    if target in RULES:
        return RULES[target]
    if target in _POINTWISE_EXTRA:
        return pointwise
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        if target._schema.is_mutable:
            return None
        return pointwise
    return None


def backward(node: fx.Node, d: int, size: int) -> Flow:
    """Input dims for chunking output dim ``d`` (of size ``size``) of ``node``; raises NotFree."""
    rule = rule_for(node)
    if rule is None:
        raise NotFree(f"no dim-flow rule for {op_name(node.target)}")
    ts = tensors_of(node)
    if not ts or any(t.ndim <= d or t.shape[d] != size for t in ts):
        raise NotFree(f"{node.name} has no dim {d} of size {size}")
    try:
        return rule(node, d, size)
    except (IndexError, KeyError, TypeError, AttributeError) as e:  # odd arity: treat as not free
        raise NotFree(f"{op_name(node.target)}: {e}") from e
