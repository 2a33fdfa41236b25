"""Matmul family: linear, addmm, mm, bmm, baddbmm, matmul.

Per mesh axis, ``Y[m, n] = X[m, k] @ W[k, n]`` may shard m (any leading/batch dim of X),
n (the output features), or k (the contraction, leaving a partial output resolved by an
all-reduce), or replicate. Names use the logical notation ``OUT = IN x W`` with the weight as
``[in, out]``; a ``_d`` suffix says which physical leading dim carries the sharded m (one entry
per mesh axis when two axes shard different leading dims, e.g. ``_0_1``).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..hardware import few_rows_family
from ..opinfo import OpInfo
from ..specs import ShardSpec
from ..strategy import PARTIAL, AxisOption
from .registry import LocalKernel, default_kernel, register

aten = torch.ops.aten


def _logical(spec: ShardSpec, groups: Sequence[Sequence[int]]) -> str:
    """Compact logical spec: each logical dim is the union of the axes of its physical dims."""
    out = []
    for group in groups:
        axes = sorted(a for d in group for a in spec.dims[d])
        out.append("R" if not axes else "S" + "".join(map(str, axes)))
    return "".join(out)


def _batch_suffix(spec: ShardSpec, batch_dims: Sequence[int]) -> str:
    """Which physical batch dim each sharding mesh axis uses, ``_d`` or ``_d0_d1``."""
    per_axis = sorted((a, d) for d in batch_dims for a in spec.dims[d])
    if len(batch_dims) <= 1 or not per_axis:
        return ""
    dims = [d for _, d in per_axis]
    if len(set(dims)) == 1:
        return f"_{dims[0]}"
    return "".join(f"_{d}" for d in dims)


def _matmul_namer(x_idx: int, w_idx: int, w_groups: Sequence[Sequence[int]]):
    """Name ``Y = X x W`` where X's leading dims form m and its last dim is k."""

    def name(op: OpInfo, ins: Sequence[ShardSpec], outs: Sequence[ShardSpec | None], _opts) -> str:
        x_rank = len(op.shape(x_idx))
        lead = list(range(x_rank - 1))
        y = outs[0]
        assert y is not None
        y_rank = len(op.out_shape)
        x_name = _logical(ins[x_idx], [lead, [x_rank - 1]])
        w_name = _logical(ins[w_idx], w_groups)
        y_name = _logical(y, [list(range(y_rank - 1)), [y_rank - 1]])
        return f"{y_name} = {x_name} x {w_name}{_batch_suffix(y, list(range(y_rank - 1)))}"

    return name


def _mk_kn_rules(x_rank: int, n_operands: int, x: int, w: int, w_k: int, w_n: int,
                 bias: int | None) -> list[AxisOption]:
    """Options for ``Y[..., n] = X[..., k] @ W`` with X's leading dims as m."""

    def opt(tag: str, xd, wd, bd, yd) -> AxisOption:
        inputs: list = [None] * n_operands
        inputs[x], inputs[w] = xd, wd
        if bias is not None:
            inputs[bias] = bd
        return AxisOption(tuple(inputs), (yd,), tag)

    options = [opt(f"m{i}", i, None, None, i) for i in range(x_rank - 1)]
    options.append(opt("n", None, w_n, -1, -1))
    # k sharded: the bias stays replicated and is added once, after the partial sum is reduced.
    options.append(opt("k", -1, w_k, None, PARTIAL))
    return options


def _bias_after_reduce(bias_operand: int, bias_arg: int):
    """Kernel for ops with a bias: when k is sharded (partial output), add the bias once, after the
    all-reduce, instead of on every device."""

    def kernel(op: OpInfo, strategy) -> LocalKernel:
        if bias_operand >= len(op.operands) or "k" not in strategy.tags:
            return default_kernel(op, strategy)
        args = list(op.node.args)
        if op.target is aten.addmm.default:
            return LocalKernel(aten.mm.default, (args[1], args[2]), {},
                               lambda outs, local: (outs[0] + local[bias_operand],))
        args[bias_arg] = None
        return LocalKernel(op.target, tuple(args), dict(op.node.kwargs),
                           lambda outs, local: (outs[0] + local[bias_operand],))

    return kernel


def _matmul_curve(op: OpInfo, in_specs: Sequence[ShardSpec], out_specs: Sequence[ShardSpec | None]) -> str:
    """A matmul whose local tensors' rows are not whole multiples of 16 bytes (an odd vocabulary:
    GPT-2's 50257) runs on a GPU's slower kernels (a bfloat16 LM head on an H100: 96 TFLOP/s, aligned
    matmuls 750): it is priced by a curve of its own, ``matmul_unaligned``, where the profile has one.
    The rows are the shard's: splitting a 4104-wide dim over 2 devices leaves rows of 2052 elements."""
    mesh_shape = op.mesh.shape
    for meta, spec in zip((*op.operands, *op.outputs), (*in_specs, *out_specs)):
        if meta is None or not meta.dtype.is_floating_point or not meta.shape:
            continue
        row = meta.shape[-1] if spec is None else spec.local_shape(meta.shape, mesh_shape)[-1]
        if row * meta.dtype.itemsize % 16:
            return "matmul_unaligned"
    return "matmul"


def _weight_matmul_curve(op: OpInfo, in_specs: Sequence[ShardSpec], out_specs: Sequence[ShardSpec | None]) -> str:
    """A matmul by a 2-D weight (linear, addmm, mm) on fewer local rows than the ``matmul`` curve is
    timed on goes by the ``matmul_rows<r>`` curve of its rows (:func:`few_rows_family`; priced by
    bytes where the profile has it, else by the ``matmul`` curve): it reads its whole weight for few
    FLOPs, on kernels of their own. Otherwise as :func:`_matmul_curve`."""
    out, spec = op.outputs[0], out_specs[0]
    if out is not None and len(out.shape) >= 2:
        local = out.shape if spec is None else spec.local_shape(out.shape, op.mesh.shape)
        few = few_rows_family(math.prod(local[:-1]))
        if few is not None:
            return few
    return _matmul_curve(op, in_specs, out_specs)


@register(aten.linear.default, family="matmul", curve=_weight_matmul_curve, namer=_matmul_namer(0, 1, [[1], [0]]),
          kernel=_bias_after_reduce(bias_operand=2, bias_arg=2),
          doc="Y = X W^T + b: shard a leading dim of X (m), out features (n), or in features (k -> partial)")
def linear_rules(op: OpInfo) -> list[AxisOption]:
    """linear(x[..., k], w[n, k], b[n]?)"""
    has_bias = len(op.operands) == 3
    return _mk_kn_rules(len(op.shape(0)), len(op.operands), x=0, w=1, w_k=1, w_n=0,
                        bias=2 if has_bias else None)


@register(aten.addmm.default, family="matmul", curve=_weight_matmul_curve, namer=_matmul_namer(1, 2, [[0], [1]]),
          kernel=_bias_after_reduce(bias_operand=0, bias_arg=0),
          doc="Y = b + X W (W as [in, out]): shard m, n, or k -> partial")
def addmm_rules(op: OpInfo) -> list[AxisOption]:
    """addmm(b, x[m, k], w[k, n]) where b broadcasts to [m, n] (usually the bias [n])."""
    b_shape = op.shape(0)
    options = _mk_kn_rules(2, 3, x=1, w=2, w_k=0, w_n=1, bias=None)
    aligned = [_broadcast_dim(b_shape, 2, 0), _broadcast_dim(b_shape, 2, 1)]
    return [AxisOption((aligned[o.outputs[0] % 2] if isinstance(o.outputs[0], int) else None,)
                       + o.inputs[1:], o.outputs, o.tag) for o in options]


def _broadcast_dim(shape: Sequence[int], out_rank: int, out_dim: int) -> int | None:
    """The dim of a right-aligned broadcast operand matching ``out_dim``; None if it broadcasts."""
    d = out_dim - (out_rank - len(shape))
    return d if d >= 0 and shape[d] != 1 else None


@register(aten.mm.default, family="matmul", curve=_weight_matmul_curve, namer=_matmul_namer(0, 1, [[0], [1]]),
          doc="Y = X W: shard m, n, or k -> partial")
def mm_rules(op: OpInfo) -> list[AxisOption]:
    """mm(x[m, k], w[k, n])"""
    return _mk_kn_rules(2, 2, x=0, w=1, w_k=0, w_n=1, bias=None)


def _bmm_namer(a_idx: int, b_idx: int):
    def name(op: OpInfo, ins: Sequence[ShardSpec], outs: Sequence[ShardSpec | None], _opts) -> str:
        y = outs[0]
        assert y is not None
        return f"{y} = {ins[a_idx]} x {ins[b_idx]}"

    return name


def _batched_rules(a_shape: Sequence[int], b_shape: Sequence[int], out_rank: int,
                   n_operands: int, a: int, b: int, extra: dict[int, Sequence[int]] | None = None
                   ) -> list[AxisOption]:
    """Broadcasting batched matmul ``[..., m, k] @ [..., k, n]``: shard a batch dim, m, n or k.

    ``extra`` maps further operand indices (e.g. baddbmm's added term) to their shapes; they are
    broadcast against the output and sharded with it.
    """
    extra = extra or {}

    def dim_of(shape: Sequence[int], out_dim: int) -> int | None:
        return _broadcast_dim(shape, out_rank, out_dim)

    options = []
    for od in range(out_rank - 2):
        inputs: list = [None] * n_operands
        inputs[a], inputs[b] = dim_of(a_shape, od), dim_of(b_shape, od)
        for j, shape in extra.items():
            inputs[j] = dim_of(shape, od)
        if inputs[a] is None and inputs[b] is None:
            continue
        options.append(AxisOption(tuple(inputs), (od,), f"b{od}"))
    m, n = out_rank - 2, out_rank - 1
    for tag, ad, bd, od in (("m", len(a_shape) - 2, None, m), ("n", None, len(b_shape) - 1, n)):
        inputs = [None] * n_operands
        inputs[a], inputs[b] = ad, bd
        for j, shape in extra.items():
            inputs[j] = dim_of(shape, od)
        options.append(AxisOption(tuple(inputs), (od,), tag))
    if not extra:
        inputs = [None] * n_operands
        inputs[a], inputs[b] = len(a_shape) - 1, len(b_shape) - 2
        options.append(AxisOption(tuple(inputs), (PARTIAL,), "k"))
    return options


@register(aten.bmm.default, family="matmul", curve=_matmul_curve, namer=_bmm_namer(0, 1),
          doc="Y[b] = A[b] B[b]: shard b, m, n, or k -> partial")
def bmm_rules(op: OpInfo) -> list[AxisOption]:
    """bmm(a[b, m, k], c[b, k, n])"""
    return _batched_rules(op.shape(0), op.shape(1), 3, 2, a=0, b=1)


@register(aten.baddbmm.default, family="matmul", curve=_matmul_curve, namer=_bmm_namer(1, 2),
          doc="Y[b] = beta*C[b] + alpha*A[b] B[b]: shard b, m or n (the added term follows the output)")
def baddbmm_rules(op: OpInfo) -> list[AxisOption]:
    """baddbmm(self[b?, m?, n?], a[b, m, k], c[b, k, n])"""
    return _batched_rules(op.shape(1), op.shape(2), 3, 3, a=1, b=2, extra={0: op.shape(0)})


@register(aten.matmul.default, family="matmul", curve=_matmul_curve, namer=_bmm_namer(0, 1),
          doc="broadcasting matmul of rank >= 2 operands: shard a batch dim, m, n, or k -> partial")
def matmul_rules(op: OpInfo) -> list[AxisOption]:
    """matmul(a[..., m, k], b[..., k, n]); 1-D operands are left replicated."""
    a_shape, b_shape = op.shape(0), op.shape(1)
    if len(a_shape) < 2 or len(b_shape) < 2:
        return []
    return _batched_rules(a_shape, b_shape, len(op.out_shape), 2, a=0, b=1)
