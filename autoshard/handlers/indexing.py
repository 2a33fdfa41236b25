"""Slicing and indexing: slice/narrow/select, their scatters, index/index_put/index_select/gather.

The dim that is cut or indexed stays replicated (unless a slice covers it fully); every other dim
carries its sharding. Index tensors may instead be sharded on their own (batch) dims, which shards
the output there; an index that is an arange over the whole dim it addresses (Hugging Face's
``mask[batch_idx, kv_idx]``) lets that dim of x be sharded with it, block for block.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.fx as fx

from ..opinfo import OpInfo
from ..strategy import AxisOption, Strategy
from .dim_maps import bound_args, norm_dim, other_dims, pair_options
from .registry import LocalKernel, default_kernel, register

aten = torch.ops.aten


# -- slicing and indexing ------------------------------------------------------------------------

def _slice_is_full(size: int, start: int | None, end: int | None, step: int) -> bool:
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return step == 1 and max(start, 0) == 0 and end >= size


def _sliced_dim(op: OpInfo) -> tuple[int, bool]:
    """(the dim a slice/narrow cuts, whether it keeps the whole dim)."""
    a = bound_args(op)
    size_of = op.shape(0)
    dim = norm_dim(a["dim"], len(size_of))
    if op.target is aten.narrow.default:
        full = _slice_is_full(size_of[dim], a["start"], a["start"] + a["length"], 1)
    else:
        full = _slice_is_full(size_of[dim], a["start"], a["end"], a["step"])
    return dim, full


def _slice_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    dim, full = _sliced_dim(op)
    if full and strategy.input_specs[0].dims[dim]:
        return LocalKernel(aten.alias.default, (op.args[0],), {})   # whole dim: the local shard
    return default_kernel(op, strategy)


@register(aten.slice.Tensor, aten.narrow.default, family="view", free=True, grad_copies=True,
          kernel=_slice_kernel,
          doc="slice/narrow: the sliced dim stays replicated unless the slice keeps all of it")
def slice_rules(op: OpInfo) -> list[AxisOption]:
    """slice(x, dim, start, end, step) / narrow(x, dim, start, length)"""
    dim, full = _sliced_dim(op)
    ndim = len(op.shape(0))
    keep = range(ndim) if full else [d for d in range(ndim) if d != dim]
    return pair_options([(d, d) for d in keep if op.shape(0)[d] > 1])


@register(aten.select.int, family="view", free=True, grad_copies=True,
          doc="select: the selected dim stays replicated")
def select_rules(op: OpInfo) -> list[AxisOption]:
    """select(x, dim, index)"""
    ndim = len(op.shape(0))
    return pair_options(other_dims(ndim, norm_dim(bound_args(op)["dim"], ndim), shift=-1))


@register(aten.slice_scatter.default, aten.select_scatter.default, family="view",
          doc="slice_scatter/select_scatter(x, src, dim, ...): the written dim stays replicated; "
              "x and src sharded alike on the others")
def scatter_into_view_rules(op: OpInfo) -> list[AxisOption]:
    """slice_scatter(x, src, dim, start, end, step) / select_scatter(x, src, dim, index): ``x`` with
    a slice (a selected index) of ``dim`` replaced by ``src`` (what capture makes of a write into a
    view, ``x[:, 1:] = v``). Every other dim of x is src's matching dim (one fewer for select), so
    a device writes its block of src into its block of x."""
    ndim = len(op.shape(0))
    dim = norm_dim(bound_args(op)["dim"], ndim)
    shift = -1 if op.target is aten.select_scatter.default else 0
    return [AxisOption((d, o), (d,), f"d{d}") for d, o in other_dims(ndim, dim, shift)
            if op.shape(0)[d] > 1]


@register(aten.index_put.default, family="index",
          doc="index_put(x, indices, values): dims after the indexed ones shard x, values (where it "
              "carries them) and the output alike; indices replicated")
def index_put_rules(op: OpInfo) -> list[AxisOption]:
    """index_put(x, indices, values, accumulate): x with the positions ``indices`` address over its
    leading dims (one per index tensor, or as many as a boolean mask has) set to (or, accumulating, incremented by) ``values``, which is
    broadcast against ``x[indices]`` (right-aligned). A trailing dim ``d >= len(indices)`` is
    whole in every indexed position, so a device updates its block of it from its block of
    ``values`` (``values`` replicated where it broadcasts along ``d``). What capture makes of
    ``x[mask] = v`` / ``x.index_put_(...)`` on a computed value."""
    shape = op.shape(0)
    k = 0                      # dims of x the indices address: a boolean mask covers its ndim
    for index in bound_args(op)["indices"]:
        meta = op.graph.tensor_meta(index) if isinstance(index, fx.Node) else None
        k += meta.ndim if meta is not None and meta.dtype in (torch.bool, torch.uint8) else 1
    n = len(op.operands)
    values = op.shape(n - 1)
    options = []
    for d in range(k, len(shape)):
        if shape[d] <= 1:
            continue
        v = len(values) - (len(shape) - d)
        v_dim = v if v >= 0 and values[v] == shape[d] else None
        options.append(AxisOption((d, *(None,) * (n - 2), v_dim), (d,), f"d{d}"))
    return options


@register(aten.index_select.default, family="index",
          doc="index_select: shard a dim other than dim, or shard the index (x replicated)")
def index_select_rules(op: OpInfo) -> list[AxisOption]:
    """index_select(x, dim, index[n]) -> x with dim replaced by n"""
    ndim = len(op.shape(0))
    dim = norm_dim(bound_args(op)["dim"], ndim)
    options = [AxisOption((d, None), (d,), f"d{d}") for d in range(ndim) if d != dim]
    if op.shape(1) and op.shape(1)[0] > 1:
        options.append(AxisOption((None, 0), (dim,), "index"))
    return options


@register(aten.gather.default, family="index",
          doc="gather: shard a non-gathered dim of x, index and output alike, or the index on dim")
def gather_rules(op: OpInfo) -> list[AxisOption]:
    """gather(x, dim, index) -> shape of index; out[..i..] = x[..index[..i..]..] along dim."""
    x_shape, idx_shape = op.shape(0), op.shape(1)
    dim = norm_dim(bound_args(op)["dim"], len(x_shape))
    # On other dims index may be shorter than x: the blocks only line up when the sizes agree.
    options = [AxisOption((d, d), (d,), f"d{d}") for d in range(len(x_shape))
               if d != dim and x_shape[d] == idx_shape[d]]
    options.append(AxisOption((None, dim), (dim,), "index"))
    return options


def index_layout(op: OpInfo) -> tuple[dict[int, int], list[tuple[int, list[int | None]]]]:
    """For ``x[indices]``: where each non-indexed dim of x lands in the output, and for each dim
    of the broadcast index shape, its output dim and each index operand's matching dim (None
    where that index broadcasts)."""
    x_shape = op.shape(0)
    indices = list(op.args[1])
    positions = [i for i, t in enumerate(indices) if t is not None]
    shapes = [op.shape(1 + k) for k in range(len(positions))]
    b_rank = max(len(s) for s in shapes)
    b_shape = [max([s[d - (b_rank - len(s))] for s in shapes if d - (b_rank - len(s)) >= 0])
               for d in range(b_rank)]
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    start = positions[0] if adjacent else 0
    kept = [d for d in range(len(x_shape)) if d not in positions]
    x_map = {}
    for d in kept:
        if adjacent:
            x_map[d] = d if d < start else d - len(positions) + b_rank
        else:
            x_map[d] = b_rank + kept.index(d)
    batch = []
    for b in range(b_rank):
        dims = []
        for s in shapes:
            a = b - (b_rank - len(s))
            dims.append(a if a >= 0 and s[a] == b_shape[b] and s[a] > 1 else None)
        batch.append((start + b, dims))
    expected = [0] * (len(x_shape) - len(positions) + b_rank)
    for d, o in x_map.items():
        expected[o] = x_shape[d]
    for (o, _), size in zip(batch, b_shape):
        expected[o] = size
    if tuple(expected) != op.out_shape:
        raise ValueError(f"{op.describe()}: cannot place the dims of x{list(x_shape)} indexed at "
                         f"{positions} in the output {op.out_shape}; this indexing form is unsupported")
    return x_map, batch


def _aligned_indices(op: OpInfo) -> list[tuple[int, int, int]]:
    """``(k, d, b)``: index operand ``k`` (of ``x[indices]``) indexes dim ``d`` of x with the
    positions ``0..n-1`` of its own dim ``b``, ``n`` being the size of that dim (an arange, see
    :func:`autoshard.opinfo.arange_dim`). Then block ``j`` of that index dim addresses exactly
    block ``j`` of x's dim ``d``."""
    positions = [i for i, t in enumerate(op.args[1]) if t is not None]
    out = []
    for k, d in enumerate(positions):
        b = op.operand_arange_dim(1 + k)
        if b is not None and op.shape(1 + k)[b] == op.shape(0)[d]:
            out.append((k, d, b))
    return out


def local_index(x: torch.Tensor, indices: Sequence[Any], *, rebase: Sequence[tuple[int, tuple[int, ...], int]],
                comm: Any) -> torch.Tensor:
    """``x[indices]`` on a block of x: ``rebase`` lists ``(position, axes, block)`` for each index
    that addresses a dim of x sharded over ``axes`` in blocks of ``block`` - its global values are
    made local by subtracting this device's first position."""
    indices = list(indices)
    for pos, axes, block in rebase:
        indices[pos] = indices[pos] - comm.shard_index(axes) * block
    return aten.index.Tensor(x, indices)


def _index_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """Indices address x's own dims, so a non-indexed dim of x may be cut as it is (the default
    kernel); an indexed dim of x is only ever sharded together with its aligned index, whose
    global values are then moved to the local block."""
    x_spec = strategy.input_specs[0]
    indices = op.args[1]
    rebase = []
    for pos, t in enumerate(indices):
        if t is not None and x_spec.dims[pos]:
            axes = tuple(x_spec.dims[pos])
            block = op.shape(0)[pos] // math.prod(op.mesh.shape[a] for a in axes)
            rebase.append((pos, axes, block))
    if not rebase:
        return default_kernel(op, strategy)
    return LocalKernel(local_index, (op.args[0], indices), {"rebase": tuple(rebase)}, uses_comm=True)


@register(aten.index.Tensor, family="index", kernel=_index_kernel,
          doc="x[i0, i1, ...]: shard a non-indexed dim of x; or an index batch dim (x replicated, or "
              "cut on the dim an arange index addresses)")
def index_rules(op: OpInfo) -> list[AxisOption]:
    """index(x, [idx or None, ...]). Per mesh axis, one of:

    - a dim of x no index addresses (a None entry, or past the last index), the output cut on the
      dim it lands on (in place when the indexed dims are adjacent, after the index block when
      they are not); the indices replicated;
    - a dim of the broadcast index shape: every index that does not broadcast there is cut on
      it, and so is the output; x replicated (indices address all of it) - or, when an index
      is an arange along that dim over the whole of the dim ``d`` of x it addresses, x cut on
      ``d`` too: block ``j`` of the index then addresses exactly block ``j`` of x (the kernel
      subtracts the block's first position from the index).

    Where such an arange index exists, its form is the only one offered for that index dim:
    mixed over two mesh axes, x replicated on the outer axis and cut on the inner one, a device
    would hold an index block whose positions lie outside its block of x (likewise two arange
    indices cutting two dims of x). Cutting x loses nothing: from a replicated x it is a local
    slice, and x's gradient then comes back sharded instead of as a partial sum.

    Boolean masks (data-dependent shapes) are replicate-only.
    """
    n = len(op.operands)
    if n == 1 or any(m.dtype == torch.bool for m in op.operands[1:]):
        return []
    x_map, batch = index_layout(op)
    options = [AxisOption((d,) + (None,) * (n - 1), (o,), f"d{d}") for d, o in x_map.items()
               if op.shape(0)[d] > 1]
    start, b_rank = batch[0][0], len(batch)
    aligned: dict[int, int] = {}                  # output dim -> the x dim its arange index cuts
    for k, d, b in _aligned_indices(op):
        aligned.setdefault(start + b + b_rank - len(op.shape(1 + k)), d)
    for o, dims in batch:
        if o in aligned:
            options.append(AxisOption((aligned[o], *dims), (o,), f"x{aligned[o]}i{o}"))
        elif any(d is not None for d in dims):
            options.append(AxisOption((None, *dims), (o,), f"i{o}"))
    return options


