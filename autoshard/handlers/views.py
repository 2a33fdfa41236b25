"""Views and shape ops: reshape/view, permutations, expand, slicing and indexing, split/cat, casts.

One mechanism serves the family: a *dim map* says which output dim each input dim becomes, and a
mesh axis may shard an input dim exactly when the dim map carries it to an output dim (the output
is then sharded there). Per op only the dim map differs:

- reshape-like ops (view, reshape, flatten, unflatten, squeeze, unsqueeze): an input dim may stay
  sharded when it is the outermost non-1 dim right after a boundary shared by input and output
  (the products of the dims before it agree): splitting it into k blocks then splits the flat
  remainder into the same k contiguous blocks on both sides, so the local reshape is correct.
  A dim inside a flattened/split group is never sharded (that would be a strided layout).
- permutations (permute, transpose, t, movedim, ...): the dim moves with the permutation.
- expand: kept dims carry their sharding; an expanded (broadcast) output dim may be sharded
  with the input replicated (the input's gradient is then a partial sum, all-reduced).
- slice/narrow/select/index/gather/split/cat: the dim that is cut, indexed, split or joined stays
  replicated (unless a slice covers it fully); every other dim carries its sharding. Index
  tensors may instead be sharded on their own (batch) dims, which shards the output there; an
  index that is an arange over the whole dim it addresses (Hugging Face's ``mask[batch_idx,
  kv_idx]``) lets that dim of x be sharded with it, block for block.

Local kernels rewrite size arguments to local sizes (view/reshape/expand/unflatten shapes).
Casts (``to.*``, ``type_as``) keep the local shard's device: the device captured in the graph is
the capture device (often ``meta``), never the rank's.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..opinfo import OpInfo
from ..strategy import AxisOption, Strategy
from .registry import LocalKernel, default_kernel, register

aten = torch.ops.aten

DimPairs = list[tuple[int, int]]


# -- helpers shared with factory.py --------------------------------------------------------------

def bound_args(op: OpInfo) -> dict[str, Any]:
    """The aten call's arguments by schema name, defaults filled in."""
    schema = op.target._schema
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(op.args):
            out[a.name] = op.args[i]
        elif a.name in op.node.kwargs:
            out[a.name] = op.node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def norm_dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def with_arg(op: OpInfo, index: int, value: Any) -> tuple[tuple, dict]:
    """The node's args/kwargs with schema argument ``index`` replaced by ``value``."""
    args, kwargs = list(op.args), dict(op.node.kwargs)
    name = op.target._schema.arguments[index].name
    if index < len(args):
        args[index] = value
    else:
        kwargs[name] = value
    return tuple(args), kwargs


def local_out_shape(op: OpInfo, strategy: Strategy, j: int = 0) -> list[int]:
    meta, spec = op.outputs[j], strategy.output_specs[j]
    assert meta is not None and spec is not None
    return list(spec.local_shape(meta.shape, op.mesh.shape))


def pair_options(pairs: DimPairs, n_outputs: int = 1, extra_inputs: int = 0) -> list[AxisOption]:
    """One option per (input dim, output dim) pair of a single-tensor op; every output follows.

    ``extra_inputs`` further operands stay replicated."""
    return [AxisOption((i,) + (None,) * extra_inputs, (o,) * n_outputs, f"d{i}") for i, o in pairs]


def free_operand_options(options: Sequence[AxisOption], free: dict[int, int], n_inputs: int,
                         n_outputs: int) -> list[AxisOption]:
    """Add variants where operands read only for metadata (dtype/device) take any layout.

    ``free`` maps operand index -> rank. Their layout never changes the result, so forcing them
    replicated would only charge a pointless resharding on their edge.
    """
    base = [AxisOption((None,) * n_inputs, (None,) * n_outputs, "R"), *options]
    out: list[AxisOption] = []
    seen = set()
    for opt in base:
        variants = [opt]
        for j, rank in free.items():
            variants = variants + [
                AxisOption(tuple(d if k == j else x for k, x in enumerate(v.inputs)), v.outputs,
                           f"{v.tag}+in{j}d{d}")
                for v in variants if v.inputs[j] is None for d in range(rank)]
        for v in variants:
            key = (v.inputs, v.outputs)
            if v.splits_compute and key not in seen:
                seen.add(key)
                out.append(v)
    return out


def sized_kernel(arg_index: int, sizes: Callable[[OpInfo, Strategy], Any]):
    """Kernel: the node's op with schema argument ``arg_index`` replaced by local sizes."""

    def kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
        args, kwargs = with_arg(op, arg_index, sizes(op, strategy))
        return LocalKernel(op.target, args, kwargs)

    return kernel


# -- reshape-like ops ----------------------------------------------------------------------------

def reshape_pairs(in_shape: Sequence[int], out_shape: Sequence[int]) -> DimPairs:
    """(input dim, output dim) pairs a reshape carries a sharding through (see module doc)."""
    if math.prod(in_shape) == 0:
        return []
    out_at_prefix = {}
    prefix = 1
    for e, s in enumerate(out_shape):
        if s > 1:
            out_at_prefix[prefix] = e
        prefix *= s
    pairs = []
    prefix = 1
    for d, s in enumerate(in_shape):
        if s > 1 and prefix in out_at_prefix:
            pairs.append((d, out_at_prefix[prefix]))
        prefix *= s
    return pairs


_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.default, aten.squeeze.dim,
             aten.squeeze.dims, aten.unsqueeze.default)


def _reshape_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    if op.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        args, kwargs = with_arg(op, 1, local_out_shape(op, strategy))
        return LocalKernel(op.target, args, kwargs)
    if op.target is aten.unflatten.int:
        a = bound_args(op)
        dim = norm_dim(a["dim"], len(op.shape(0)))
        args, kwargs = with_arg(op, 2, local_out_shape(op, strategy)[dim:dim + len(a["sizes"])])
        return LocalKernel(op.target, args, kwargs)
    if op.target in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims):
        # A sharded dim may be 1 locally: squeeze only the (asked-for) dims that are 1 globally.
        ndim = len(op.shape(0))
        asked = op.args[1] if len(op.args) > 1 else op.node.kwargs.get("dim", range(ndim))
        asked = {norm_dim(d, ndim) for d in ([asked] if isinstance(asked, int) else asked)}
        ones = [d for d, s in enumerate(op.shape(0)) if s == 1 and d in asked]
        return LocalKernel(aten.squeeze.dims, (op.args[0], ones), {})
    return default_kernel(op, strategy)


@register(*_RESHAPES, family="view", free=True, kernel=_reshape_kernel,
          doc="reshape-like: an input dim stays sharded when it leads a group shared with the output")
def reshape_rules(op: OpInfo) -> list[AxisOption]:
    """view/reshape/flatten/unflatten/squeeze/unsqueeze(x, ...)"""
    return pair_options(reshape_pairs(op.shape(0), op.out_shape))


@register(aten.view_as.default, family="view", free=True,
          doc="view_as(x, other): reshape rule; other (shape only) is laid out like the output")
def view_as_rules(op: OpInfo) -> list[AxisOption]:
    return [AxisOption((i, o), (o,), f"d{i}") for i, o in reshape_pairs(op.shape(0), op.out_shape)]


# -- permutations --------------------------------------------------------------------------------

_PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default, aten.numpy_T.default,
             aten.mT.default, aten.adjoint.default, aten.movedim.int, aten.movedim.intlist,
             aten.swapaxes.default, aten.swapdims.default)


def permutation_pairs(op: OpInfo) -> DimPairs:
    """Which input dim each output dim is, found by running the op on a meta tensor whose strides
    tag the dims (a permutation only reorders strides). One rule for every permuting view."""
    shape = op.shape(0)
    strides = [1 << d for d in range(len(shape))]
    x = torch.empty_strided(shape, strides, dtype=op.operands[0].dtype, device="meta")
    args = [x if isinstance(a, fx.Node) else a for a in op.args]
    out = op.target(*args, **op.node.kwargs)
    got = list(out.stride())
    if sorted(got) != sorted(strides):
        raise ValueError(f"{op.describe()} is not a permutation of its input dims (strides {got})")
    return [(strides.index(s), o) for o, s in enumerate(got) if shape[strides.index(s)] > 1]


@register(*_PERMUTES, family="view", free=True, doc="permutation: each dim keeps its sharding")
def permute_rules(op: OpInfo) -> list[AxisOption]:
    """permute/transpose/t/movedim/swapaxes(x, ...)"""
    return pair_options(permutation_pairs(op))


# -- expand --------------------------------------------------------------------------------------

def expand_options(in_shape: Sequence[int], out_shape: Sequence[int], n_inputs: int,
                   other: int | None = None) -> list[AxisOption]:
    """Kept dims carry their sharding; a broadcast output dim may be sharded from a replicated
    input. ``other`` (expand_as) is an operand shaped like the output, laid out like it."""
    lead = len(out_shape) - len(in_shape)
    options = []
    for o, size in enumerate(out_shape):
        if size <= 1:
            continue
        i = o - lead
        kept = i >= 0 and in_shape[i] == size
        inputs: list = [None] * n_inputs
        inputs[0] = i if kept else None
        if other is not None:
            inputs[other] = o
        options.append(AxisOption(tuple(inputs), (o,), f"d{o}" if kept else f"b{o}"))
    return options


@register(aten.expand.default, family="view", free=True, grad_copies=True,
          kernel=sized_kernel(1, lambda op, s: local_out_shape(op, s)),
          doc="expand: kept dims follow the input; broadcast dims may be sharded from a replicated input")
def expand_rules(op: OpInfo) -> list[AxisOption]:
    """expand(x, size)"""
    return expand_options(op.shape(0), op.out_shape, 1)


@register(aten.expand_as.default, family="view", free=True, grad_copies=True,
          doc="expand_as(x, other): as expand; other (shape only) is laid out like the output")
def expand_as_rules(op: OpInfo) -> list[AxisOption]:
    return expand_options(op.shape(0), op.out_shape, 2, other=1)


@register(aten.repeat.default, family="view",
          doc="repeat: only dims repeated once carry their sharding")
def repeat_rules(op: OpInfo) -> list[AxisOption]:
    """repeat(x, repeats): a repeated dim is [x, x, ...], not a blockwise function of x."""
    shape, reps = op.shape(0), list(bound_args(op)["repeats"])
    lead = len(reps) - len(shape)
    return pair_options([(i, i + lead) for i, s in enumerate(shape) if s > 1 and reps[i + lead] == 1])


def _repeat_interleave_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """``output_size``, when captured, is rewritten to the local output's size along the
    repeated dim (or the flat size when ``dim`` is None)."""
    a = bound_args(op)
    if a.get("output_size") is None:
        return default_kernel(op, strategy)
    local = local_out_shape(op, strategy)
    dim = a.get("dim")
    size = math.prod(local) if dim is None else local[norm_dim(dim, len(local))]
    return LocalKernel(op.target, tuple(op.args), {**op.node.kwargs, "output_size": size})


@register(aten.repeat_interleave.self_int, family="view", kernel=_repeat_interleave_kernel,
          doc="repeat_interleave(x, r, dim): every dim, the repeated one included, stays sharded")
def repeat_interleave_rules(op: OpInfo) -> list[AxisOption]:
    """repeat_interleave(x, repeats: int, dim): each element of ``dim`` becomes ``repeats``
    consecutive ones, so contiguous blocks of ``dim`` map to contiguous blocks of the output
    (block ``b`` of ``n/k`` elements -> block ``b`` of ``n*r/k``); other dims are untouched. With
    ``dim=None`` x is flattened first: only the leading dim whose blocks stay contiguous in the
    flat order (the reshape rule) carries its sharding to the output."""
    a = bound_args(op)
    if a.get("dim") is None:
        return pair_options(reshape_pairs(op.shape(0), (op.operands[0].numel,)))
    return pair_options(identity_pairs(op))


# -- slicing and indexing ------------------------------------------------------------------------

def _other_dims(ndim: int, dim: int, shift: int = 0) -> DimPairs:
    """Every dim but ``dim`` maps to itself; those after it move by ``shift``."""
    return [(d, d if d < dim else d + shift) for d in range(ndim) if d != dim]


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
    return pair_options(_other_dims(ndim, norm_dim(bound_args(op)["dim"], ndim), shift=-1))


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
    return [AxisOption((d, o), (d,), f"d{d}") for d, o in _other_dims(ndim, dim, shift)
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


# -- split / cat ---------------------------------------------------------------------------------

@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, family="view",
          free=True, grad_copies=True,
          doc="split/chunk: the split dim stays replicated; every piece follows the input")
def split_rules(op: OpInfo) -> list[AxisOption]:
    """split(x, size|sizes, dim) / chunk(x, chunks, dim) -> pieces"""
    ndim = len(op.shape(0))
    dim = norm_dim(bound_args(op)["dim"], ndim)
    return pair_options(_other_dims(ndim, dim), n_outputs=len(op.outputs))


@register(aten.unbind.int, family="view", free=True, grad_copies=True,
          doc="unbind: the unbound dim stays replicated; others follow the input")
def unbind_rules(op: OpInfo) -> list[AxisOption]:
    ndim = len(op.shape(0))
    dim = norm_dim(bound_args(op)["dim"], ndim)
    return pair_options(_other_dims(ndim, dim, shift=-1), n_outputs=len(op.outputs))


def _joined(op: OpInfo, new_dim: bool) -> list[AxisOption]:
    n = len(op.operands)
    if n == 0:
        return []
    ranks = {len(m.shape) for m in op.operands}
    if len(ranks) != 1:      # legacy cat of 1-D empty tensors with others: leave replicated
        return []
    ndim = ranks.pop()
    out_rank = len(op.out_shape)
    dim = norm_dim(bound_args(op)["dim"], out_rank)
    options = []
    for d in range(ndim):
        o = d + 1 if new_dim and d >= dim else d
        if new_dim or d != dim:
            options.append(AxisOption((d,) * n, (o,), f"d{d}"))
    return options


@register(aten.cat.default, family="view",
          doc="cat: the cat dim stays replicated; all inputs sharded alike on the others")
def cat_rules(op: OpInfo) -> list[AxisOption]:
    return _joined(op, new_dim=False)


@register(aten.stack.default, family="view",
          doc="stack: all inputs sharded alike; the new dim stays replicated")
def stack_rules(op: OpInfo) -> list[AxisOption]:
    return _joined(op, new_dim=True)


# -- identity-like ops and casts -----------------------------------------------------------------

def identity_pairs(op: OpInfo) -> DimPairs:
    return [(d, d) for d, s in enumerate(op.shape(0)) if s > 1]


@register(aten.alias.default, aten.detach.default, aten.detach_.default, family="view", free=True,
          doc="alias/detach: output follows the input")
def alias_rules(op: OpInfo) -> list[AxisOption]:
    return pair_options(identity_pairs(op))


@register(aten.contiguous.default, aten.clone.default, aten.lift_fresh_copy.default, family="view",
          doc="contiguous/clone: output follows the input")
def copy_rules(op: OpInfo) -> list[AxisOption]:
    return pair_options(identity_pairs(op))


def _cast(x: torch.Tensor, dtype: torch.dtype | None = None, copy: bool = False,
          memory_format: torch.memory_format | None = None) -> torch.Tensor:
    """The local cast: dtype/copy/memory format as captured, the device of the local shard."""
    return x.to(dtype=x.dtype if dtype is None else dtype, copy=copy,
                memory_format=memory_format or torch.preserve_format)


def _cast_like(x: torch.Tensor, other: torch.Tensor, copy: bool = False,
               memory_format: torch.memory_format | None = None) -> torch.Tensor:
    return _cast(x, other.dtype, copy, memory_format)


def _cast_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    a = bound_args(op)
    copy = op.target is aten._to_copy.default or bool(a.get("copy"))
    fmt = a.get("memory_format")
    if op.target in (aten.to.other, aten.type_as.default):
        return LocalKernel(_cast_like, (op.args[0], op.args[1]), {"copy": copy, "memory_format": fmt})
    return LocalKernel(_cast, (op.args[0],), {"dtype": a.get("dtype"), "copy": copy, "memory_format": fmt})


_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default)


@register(*_CASTS, family="cast", kernel=_cast_kernel,
          doc="cast: output follows the input (local shards keep their device)")
def cast_rules(op: OpInfo) -> list[AxisOption]:
    """to.dtype/to.dtype_layout/to.device/_to_copy(x, ...)"""
    return pair_options(identity_pairs(op))


@register(aten.to.other, aten.type_as.default, family="cast", kernel=_cast_kernel,
          doc="cast to other's dtype: output follows x; other (dtype only) may be in any layout")
def cast_like_rules(op: OpInfo) -> list[AxisOption]:
    """to.other(x, other) / type_as(x, other)"""
    return free_operand_options(pair_options(identity_pairs(op), extra_inputs=1),
                                {1: len(op.shape(1))}, 2, 1)


# -- getitem -------------------------------------------------------------------------------------

def select_element(value: Any, index: int) -> Any:
    """``value[index]`` of a multi-output node's local results. A bare tensor is taken to be that
    element already (the single-process checker feeds the element itself)."""
    return value if isinstance(value, torch.Tensor) else value[index]


def _getitem_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    return LocalKernel(select_element, tuple(op.args), {})


@register(operator.getitem, family="view", free=True, kernel=_getitem_kernel,
          doc="getitem of a multi-output node: output spec = the element's spec")
def getitem_rules(op: OpInfo) -> list[AxisOption]:
    """getitem(producer, i): the operand is element i of the producer."""
    if not op.operands or op.outputs[0] is None:
        return []
    return pair_options(identity_pairs(op))
