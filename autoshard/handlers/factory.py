"""Factory ops, higher-order ops, mask-building ops and metadata asserts.

- Factory ops (arange, ones, zeros, full, empty, new_*): the output may be created directly
  sharded on any dim; the local kernel creates only the local block (arange from the device's
  block index). Random ``rand``/``randn`` draw the whole tensor (the single-device draws, so a
  seeded run equals one device) and keep the local block. ``*_like`` ops follow their input's layout. ``new_*`` read their ``self`` only for
  dtype/device, so it may be in any layout. ``scalar_tensor`` (0-d) is replicate-only.
- Higher-order ops that export emits for ``torch.no_grad()`` / ``torch.autocast`` regions
  (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``): replicate-only; the local kernel runs
  the wrapped sub-graph on the device of its operands. Their value is a tuple; ``getitem`` (identity.py) picks the elements.
- Mask-building ops: comparisons and logical/bitwise ops shard like broadcasting pointwise ops;
  ``cumsum``/``diff`` keep their scan dim replicated; ``pad`` keeps padded dims replicated;
  ``tril``/``triu`` shard any dim (a sharded row/column dim shifts the local diagonal).
- ``_assert_tensor_metadata``: free, no output; its operand may be in any layout (the local
  kernel checks the layout and the local size).
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled

from ..opinfo import OpInfo
from ..strategy import AxisOption, Strategy
from .dim_maps import (DimPairs, bound_args, free_operand_options, identity_pairs, local_out_shape,
                       norm_dim, pair_options, sized_kernel)
from .pointwise import broadcast_rules
from .registry import LocalKernel, default_kernel, register, register_replicate_only

aten = torch.ops.aten


# -- factory ops ---------------------------------------------------------------------------------

def _out_dims(op: OpInfo, n_inputs: int) -> list[AxisOption]:
    """The output may be sharded on any dim (inputs replicated)."""
    return [AxisOption((None,) * n_inputs, (d,), f"d{d}") for d, s in enumerate(op.out_shape) if s > 1]


def _local_size(op: OpInfo, strategy: Strategy) -> list[int]:
    return local_out_shape(op, strategy)


@register(aten.ones.default, aten.zeros.default, aten.empty.memory_format, aten.full.default,
          family="factory", kernel=sized_kernel(0, _local_size),
          doc="ones/zeros/empty/full(size): created sharded on any dim")
def new_tensor_rules(op: OpInfo) -> list[AxisOption]:
    return _out_dims(op, 0)


def _random_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """A sharded random tensor: drawn whole as the unsharded op draws it, this device's block kept
    (same RNG draws on every rank as on one device, like coordinated dropout)."""
    spec = strategy.output_specs[0]
    if spec is None or not any(spec.dims):
        return default_kernel(op, strategy)
    return LocalKernel(coordinated_random, (op.target, tuple(op.node.args), dict(op.node.kwargs)),
                       {"dims": spec.dims}, uses_comm=True)


def coordinated_random(target: Any, args: tuple, kwargs: dict, *, dims: Sequence[Sequence[int]], comm: Any
                       ) -> torch.Tensor:
    """``target(*args, **kwargs)`` (a random factory op) drawn whole; this device's block of it (dim
    ``d`` split over mesh axes ``dims[d]``)."""
    t = target(*args, **kwargs)
    for d, axes in enumerate(dims):
        if axes:
            t = t.chunk(comm.shard_count(axes), d)[comm.shard_index(axes)]
    return t.contiguous()


@register(aten.rand.default, aten.randn.default, family="factory", kernel=_random_kernel,
          doc="rand/randn(size): any dim sharded; drawn whole (the single-device draws), block kept")
def random_rules(op: OpInfo) -> list[AxisOption]:
    return _out_dims(op, 0)


@register(aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default,
          aten.new_full.default, family="factory", kernel=sized_kernel(1, _local_size),
          doc="new_*(self, size): created sharded on any dim; self (dtype/device only) in any layout")
def new_like_rules(op: OpInfo) -> list[AxisOption]:
    return free_operand_options(_out_dims(op, 1), {0: len(op.shape(0))}, 1, 1)


@register(aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
          aten.full_like.default, family="factory", doc="*_like(x): output follows x")
def like_rules(op: OpInfo) -> list[AxisOption]:
    return pair_options(identity_pairs(op))


register_replicate_only(aten.scalar_tensor.default, family="factory",
                        doc="scalar_tensor: a 0-d value, replicated")


def local_arange(start: Any, end: Any, step: Any, *, numel: int, axes: Sequence[int],
                 dtype: torch.dtype, device: Any = None, layout: Any = None, pin_memory: Any = None,
                 comm: Any) -> torch.Tensor:
    """This device's block of ``arange(start, end, step)`` (``numel`` values, sharded over ``axes``)."""
    block = numel // comm.shard_count(axes)
    first = comm.shard_index(axes) * block
    if not dtype.is_floating_point and isinstance(start, int) and isinstance(step, int):
        lo = start + first * step
        return torch.arange(lo, lo + block * step, step, dtype=dtype, device=device, layout=layout,
                            pin_memory=pin_memory)
    # Floating steps: take the block of the global range so values match it bit for bit.
    return torch.arange(start, end, step, dtype=dtype, device=device, layout=layout,
                        pin_memory=pin_memory).narrow(0, first, block)


def _arange_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    spec = strategy.output_specs[0]
    assert spec is not None
    if not spec.dims[0]:
        return default_kernel(op, strategy)
    a = bound_args(op)
    start = a.get("start", 0)
    step = a.get("step", 1)
    kwargs = {k: a[k] for k in ("device", "layout", "pin_memory")}
    return LocalKernel(local_arange, (start, a["end"], step),
                       {**kwargs, "numel": op.out_shape[0], "axes": spec.dims[0],
                        "dtype": op.outputs[0].dtype},  # type: ignore[union-attr]
                       uses_comm=True)


@register(aten.arange.default, aten.arange.start, aten.arange.start_step, family="factory",
          kernel=_arange_kernel, doc="arange: created sharded (each device makes its own block)")
def arange_rules(op: OpInfo) -> list[AxisOption]:
    return _out_dims(op, 0)


# -- higher-order ops ----------------------------------------------------------------------------

def _resolve_attr(x: Any) -> Any:
    """A get_attr node (a HOP's sub-graph) -> the module it names."""
    if isinstance(x, fx.Node) and x.op == "get_attr":
        return getattr(x.graph.owning_module, x.target)  # type: ignore[arg-type]
    return x


@functools.lru_cache(maxsize=None)
def _local_body(body: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A HOP body as one device runs it: captured devices (the capture's, often meta) become the
    local one, and export's metadata asserts are dropped (see ``_assert_kernel``)."""
    body = copy.deepcopy(body)
    for node in list(body.graph.nodes):
        if node.target is aten._assert_tensor_metadata.default:
            body.graph.erase_node(node)
            continue
        node.args, node.kwargs = pytree.tree_map(
            lambda v: device if isinstance(v, torch.device) else v, (node.args, node.kwargs))
    body.recompile()
    return body


def run_hop(hop: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a higher-order op with its body retargeted to the device of its tensor operands."""
    devices = [a.device for a in args if isinstance(a, torch.Tensor)]
    if devices:
        args = tuple(_local_body(a, devices[0]) if isinstance(a, fx.GraphModule) else a for a in args)
    return hop(*args, **kwargs)


def _hop_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    return LocalKernel(run_hop, (op.target, *(_resolve_attr(a) for a in op.args)),
                       {k: _resolve_attr(v) for k, v in op.node.kwargs.items()})


@register(wrap_with_set_grad_enabled, wrap_with_autocast, family="hop", replicate_only=True,
          kernel=_hop_kernel,
          doc="no_grad/autocast region exported as a higher-order op: replicate-only")
def hop_rules(op: OpInfo) -> list[AxisOption]:
    """Replicate-only (the framework adds the all-replicated strategy)."""
    return []


# -- mask-building ops ---------------------------------------------------------------------------

_COMPARISONS = tuple(getattr(getattr(aten, name), ov) for name in ("eq", "ne", "lt", "le", "gt", "ge")
                     for ov in ("Tensor", "Scalar"))
_LOGICAL = (
    aten.__and__.Tensor, aten.__and__.Scalar, aten.__or__.Tensor, aten.__or__.Scalar,
    aten.__xor__.Tensor, aten.__xor__.Scalar,
    aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.bitwise_or.Tensor, aten.bitwise_or.Scalar,
    aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, aten.bitwise_not.default,
    aten.logical_not.default, aten.logical_and.default, aten.logical_or.default,
    aten.logical_xor.default,
)


@register(*_COMPARISONS, *_LOGICAL, family="mask",
          doc="comparison/logical op: broadcasting elementwise, shard any output dim")
def compare_rules(op: OpInfo) -> list[AxisOption]:
    return broadcast_rules(op)


def _all_but(op: OpInfo, dims: Sequence[int]) -> DimPairs:
    return [(d, d) for d, s in enumerate(op.shape(0)) if s > 1 and d not in dims]


@register(aten.cumsum.default, family="mask", doc="cumsum: the scan dim stays replicated")
def cumsum_rules(op: OpInfo) -> list[AxisOption]:
    return pair_options(_all_but(op, [norm_dim(bound_args(op)["dim"], len(op.shape(0)))]))


@register(aten.diff.default, family="mask",
          doc="diff: the differenced dim stays replicated; prepend/append sharded like the input")
def diff_rules(op: OpInfo) -> list[AxisOption]:
    """diff(x, n, dim, prepend?, append?): prepend/append match x on every dim but dim."""
    dim = norm_dim(bound_args(op)["dim"], len(op.shape(0)))
    n = len(op.operands)
    return [AxisOption((d,) * n, (d,), f"d{d}") for d, _ in _all_but(op, [dim])]


def _padded_dims(op: OpInfo) -> list[int]:
    pad = list(bound_args(op)["pad"])
    ndim = len(op.shape(0))
    return [ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]]


@register(aten.pad.default, aten.constant_pad_nd.default, family="mask",
          doc="pad: padded dims stay replicated, the others follow the input")
def pad_rules(op: OpInfo) -> list[AxisOption]:
    return pair_options(_all_but(op, _padded_dims(op)))


def local_tril(x: torch.Tensor, diagonal: int = 0, *, upper: bool, rows: Sequence[int],
               cols: Sequence[int], comm: Any) -> torch.Tensor:
    """tril/triu of a block whose rows/columns start at the device's offsets: element (r, c) of
    the block is (r + r0, c + c0) globally, so the diagonal moves by r0 - c0."""
    r0 = comm.shard_index(rows) * x.shape[-2] if rows else 0
    c0 = comm.shard_index(cols) * x.shape[-1] if cols else 0
    fn = torch.triu if upper else torch.tril
    return fn(x, diagonal + r0 - c0)


def _tril_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    spec = strategy.input_specs[0]
    rows, cols = spec.dims[-2], spec.dims[-1]
    if not rows and not cols:
        return default_kernel(op, strategy)
    return LocalKernel(local_tril, (op.args[0], bound_args(op)["diagonal"]),
                       {"upper": op.target is aten.triu.default, "rows": rows, "cols": cols},
                       uses_comm=True)


@register(aten.tril.default, aten.triu.default, family="mask", kernel=_tril_kernel,
          doc="tril/triu: any dim; a sharded row/column dim shifts the local diagonal")
def tril_rules(op: OpInfo) -> list[AxisOption]:
    return pair_options(identity_pairs(op))


# -- metadata asserts ----------------------------------------------------------------------------

def _assert_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    a = bound_args(op)
    local = None
    if a.get("size") is not None:
        local = list(strategy.input_specs[0].local_shape(op.shape(0), op.mesh.shape))
    # Checked: the local size and the layout. Not checked: strides (a local block's differ from
    # the global tensor's), the device (the capture's, often meta) and the dtype (fixed by the
    # captured graph; the single-process checker runs in float64).
    return LocalKernel(op.target, (op.args[0],), {"size": local, "layout": a.get("layout")})


@register(aten._assert_tensor_metadata.default, family="meta", free=True, kernel=_assert_kernel,
          doc="metadata assert: no output, no cost; the operand may be in any layout")
def assert_metadata_rules(op: OpInfo) -> list[AxisOption]:
    if not op.operands:
        return []
    return [AxisOption((d,), (None,) * len(op.outputs), f"d{d}") for d, _ in identity_pairs(op)]
