"""Normalisation: layer_norm, rms_norm, batch_norm (with synchronised statistics).

``layer_norm``/``rms_norm`` normalise over their trailing ``normalized_shape`` dims: per mesh axis
any leading dim may be sharded; weight and bias stay replicated (their gradients are then partial
sums, all-reduced by the framework).

``batch_norm`` normalises each channel (input dim 1) over the batch and spatial dims:

* shard C: input dim 1 with weight/bias/running stats dim 0, no communication;
* shard N or a spatial dim: in training this is *sync batch-norm*: one all-reduce forward (every
  device's per-channel mean and sum of squared deviations, combined exactly) and one backward (the
  per-channel sums the input gradient needs) over the axes that split the reduced dims, so
  statistics, output, gradients and the running-stat update equal the single-device op. In eval (``training=False``) the op is
  per-channel affine with the running stats, and sharding any dim needs no communication.

Planned with ``batch_norm="per_rank"`` (``op.batch_norm_groups`` = mesh size), training batch norm
is torch DDP's: each of ``groups`` equal, consecutive slices of the batch is normalised with its own
statistics (:func:`grouped_batch_norm`), a function of the batch alone, whatever the plan. Sharding
N over ``k`` devices then leaves each device ``groups / k`` whole slices: no communication. The
running statistics move by the mean over the slices of their statistics; each device updates its
copy from its own slices, and the runtime averages the copies over the devices that split N before
anything reads them (``LocalKernel.state_axes``), which by linearity is the same update.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..kernel_comm import DeviceComm
from ..opinfo import OpInfo, UnsupportedOpError
from ..specs import ShardSpec
from ..strategy import BWD, FWD, ONE_CALL, AxisOption, ExtraComm, LocalCalls, Strategy, local_bytes
from .registry import LocalKernel, default_kernel, register

aten = torch.ops.aten


def _leading_dim_rules(op: OpInfo, normalized_ndim: int) -> list[AxisOption]:
    """Shard any dim before the normalised ones; other operands (weight, bias) replicated."""
    n_in = len(op.operands)
    lead = len(op.shape(0)) - normalized_ndim
    return [AxisOption((d,) + (None,) * (n_in - 1), (d,) * len(op.outputs), f"d{d}") for d in range(lead)]


@register(aten.layer_norm.default, family="norm",
          doc="layer_norm: shard a leading (non-normalised) dim; weight/bias replicated")
def layer_norm_rules(op: OpInfo) -> list[AxisOption]:
    """layer_norm(input, normalized_shape, weight?, bias?, eps, cudnn_enable)"""
    return _leading_dim_rules(op, len(op.arg(1, "normalized_shape")))


@register(aten.rms_norm.default, family="norm",
          doc="rms_norm: shard a leading (non-normalised) dim; weight replicated")
def rms_norm_rules(op: OpInfo) -> list[AxisOption]:
    """rms_norm(input, normalized_shape, weight?, eps?)"""
    return _leading_dim_rules(op, len(op.arg(1, "normalized_shape")))


# -- batch norm ----------------------------------------------------------------------------------

_BN_PER_CHANNEL = ((1, "weight"), (2, "bias"), (3, "running_mean"), (4, "running_var"))


def _per_channel_operands(op: OpInfo) -> list[int]:
    """Operand indices of batch_norm's per-channel [C] tensors that are present."""
    out = []
    for index, name in _BN_PER_CHANNEL:
        node = op.arg(index, name)
        if node is not None:
            out.append(op.operand_index(node))
    return out


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics accumulate in float32 for half-precision inputs, as the aten kernels do."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _shards(op: OpInfo, in_specs: Sequence[ShardSpec]) -> int:
    """Devices over which batch_norm's reduced (N, spatial) dims are split."""
    return math.prod(in_specs[0].shard_factor(d, op.mesh.shape) for d in range(len(op.shape(0))) if d != 1)


def _c_local_bytes(op: OpInfo, in_specs: Sequence[ShardSpec]) -> int:
    """Bytes of one per-channel statistics vector on one device: ``C_local`` values."""
    c_local = op.shape(0)[1] // in_specs[0].shard_factor(1, op.mesh.shape)
    return c_local * _stat_dtype(op.operands[0].dtype).itemsize


def _stats_nbytes(op: OpInfo, in_specs: Sequence[ShardSpec], _out_specs) -> int:
    """Forward: every device's (mean, M2) rows, exchanged as one all-reduce of a zero-filled table."""
    return _shards(op, in_specs) * 2 * _c_local_bytes(op, in_specs)


def _grad_sums_nbytes(op: OpInfo, in_specs: Sequence[ShardSpec], _out_specs) -> int:
    """Backward: (sum dy, sum dy * xhat) per channel; nothing when the input needs no gradient."""
    return 2 * _c_local_bytes(op, in_specs) if op.operand_requires_grad(0) else 0


_SYNC_STATS = (ExtraComm("all_reduce", FWD, _stats_nbytes, "bn-stats"),
               ExtraComm("all_reduce", BWD, _grad_sums_nbytes, "bn-grad-sums"))


def _batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance over N and the spatial dims: aten's fused kernel
    (``batch_norm_update_stats``) on real tensors; ``var_mean`` where that kernel has no
    implementation (meta and fake tensors, tracing under ``torch.compile``, where inductor fuses it)."""
    if torch.compiler.is_compiling() or x.is_meta or isinstance(x, FakeTensor):
        var, mean = torch.var_mean(x, [0, *range(2, x.ndim)], correction=0)
        return mean, var
    return torch.batch_norm_update_stats(x, None, None, 0.0)


class _SyncBatchNorm(torch.autograd.Function):
    """Training batch_norm on a shard of the reduced dims with global statistics: one all-reduce
    forward, one backward (as torch's SyncBatchNorm). The passes over the input are aten's fused
    kernels that exist on every device: the statistics by ``batch_norm_update_stats`` (3x faster than
    ``var_mean`` over N and the spatial dims on a CPU), the normalisation as an eval-mode
    ``batch_norm`` with the global statistics, backward's two sums by ``native_batch_norm_backward``
    (composed of elementwise ops, the kernel took 3-4x the op's time on a CPU; torch's own
    SyncBatchNorm kernels, ``batch_norm_stats`` and the like, are CUDA-only)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum: float, eps: float,  # type: ignore[override]
                comm: DeviceComm, axes: tuple[int, ...]):
        shards = comm.shard_count(axes)
        n_local = x.numel() // x.shape[1]
        count = n_local * shards
        xs = x.detach().to(_stat_dtype(x.dtype))
        mean_local, var_local = _batch_stats(xs)
        # Each device's (mean, M2) row, all-gathered as an all-reduce of a table zero elsewhere;
        # combined as Chan et al. do (no cancellation, unlike one sum of squares).
        rows = xs.new_zeros(shards, 2, x.shape[1])
        rows[comm.shard_index(axes)] = torch.stack([mean_local, var_local * n_local])
        rows = comm.all_reduce(rows, axes)
        means = rows[:, 0]
        mean = means.mean(0)
        var = (rows[:, 1].sum(0) + n_local * (means - mean).square().sum(0)) / count
        w = None if weight is None else weight.detach().to(xs.dtype)
        b = None if bias is None else bias.detach().to(xs.dtype)
        y = torch.batch_norm(xs, w, b, mean, var, False, 0.0, eps, False)   # (x - mean) / std * w + b
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:
                unbiased = var * (count / (count - 1)) if count > 1 else var
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(x, mean, var, weight)
        ctx.comm, ctx.axes, ctx.count, ctx.eps, ctx.has_bias = comm, axes, count, eps, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, mean, var, weight = ctx.saved_tensors
        xs, dys = x.to(mean.dtype), dy.to(mean.dtype)
        invstd = torch.rsqrt(var + ctx.eps)
        # With the global statistics saved: grad_weight = sum(dy * xhat), grad_bias = sum(dy) (the
        # local input gradient is not asked for: it would centre dy on this shard's means).
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dys, xs, torch.ones_like(mean), None, None, mean, invstd, True, ctx.eps, [False, True, True])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            totals = ctx.comm.all_reduce(torch.stack([sum_dy, sum_dy_xhat]), ctx.axes, phase=BWD)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            # dx = (dy - mean(dy) - xhat * mean(dy * xhat)) * scale: the xhat term and the constant as
            # one eval-mode batch_norm of x (mean subtracted first: no cancellation), then + dy * scale.
            dx = torch.batch_norm(xs, -scale * totals[1] / ctx.count, -scale * totals[0] / ctx.count,
                                  mean, var, False, 0.0, ctx.eps, False)
            view = [1, -1] + [1] * (x.ndim - 2)
            dx = dx.addcmul_(dys, scale.view(view)).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            dw = sum_dy_xhat.to(weight.dtype)        # partial over ``axes``: the gradient sync sums it
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = sum_dy.to(dy.dtype)
        return dx, dw, db, None, None, None, None, None, None


def sync_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    training: bool, momentum: float, eps: float, cudnn_enabled: bool = False, *,
                    comm: DeviceComm, axes: Sequence[int]) -> torch.Tensor:
    """Training batch_norm on a shard of the reduced (N, spatial) dims, statistics global over ``axes``.

    Forward: each device's per-channel mean and sum of squared deviations, exchanged in one
    all-reduce and combined exactly (Chan et al.). Backward: one all-reduce of the per-channel
    sums of ``dy`` and ``dy * xhat`` for the input gradient; the weight and bias gradients stay
    this device's partial sums, which the gradient sync all-reduces like any replicated
    parameter's. Running stats are updated in place as the single-device op does (unbiased
    variance with the global count); every device holds the same replica of its channels.
    """
    if not training:
        raise ValueError("sync_batch_norm is for training mode; eval batch_norm needs no communication")
    return _SyncBatchNorm.apply(input, weight, bias, running_mean, running_var, momentum, eps, comm, tuple(axes))


def grouped_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                       training: bool, momentum: float, eps: float, cudnn_enabled: bool = False, *,
                       groups: int) -> torch.Tensor:
    """Training batch_norm of each of ``groups`` equal, consecutive slices of the batch (dim 0) with
    that slice's statistics (``groups=1``: the op itself): one call per slice, on a view of it, and
    the outputs concatenated (backward: one concatenation of the input gradients). The running
    statistics move by the mean over the slices of each slice's statistics (mean, unbiased
    variance), as if each slice's update were applied to a copy and the copies averaged."""
    if groups == 1:
        return torch.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
    n = input.shape[0]
    if n % groups:
        raise ValueError(f"grouped_batch_norm: a batch of {n} does not split into {groups} equal slices")
    outs, updated = [], []
    for piece in input.split(n // groups):
        copies = [None if t is None else t.clone() for t in (running_mean, running_var)]
        outs.append(torch.batch_norm(piece, weight, bias, *copies, training, momentum, eps, cudnn_enabled))
        updated.append(copies)
    with torch.no_grad():
        for i, state in enumerate((running_mean, running_var)):
            if state is not None:
                state.copy_(torch.stack([u[i] for u in updated]).mean(0))
    return torch.cat(outs)


def _local_slices(op: OpInfo, x_spec: ShardSpec) -> int:
    """How many of the batch's per-rank slices a device holds under a strategy with input ``x_spec``
    (1 unless training with ``batch_norm='per_rank'``)."""
    if not (op.arg(5, "training") and op.batch_norm_groups > 1):
        return 1
    return op.batch_norm_groups // x_spec.shard_factor(0, op.mesh.shape)


def _sync_axes(op: OpInfo, x_spec: ShardSpec) -> tuple[int, ...]:
    """The mesh axes a strategy with input ``x_spec`` synchronises statistics over: those splitting
    N or a spatial dim when training with global statistics (``batch_norm='global'``); none else."""
    if not op.arg(5, "training") or op.batch_norm_groups > 1:
        return ()
    return tuple(sorted(a for d, dim_axes in enumerate(x_spec.dims) if d != 1 for a in dim_axes))


def batch_norm_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """Sync-BN when training with the batch or a spatial dim sharded; per-slice statistics when
    planned per rank; else the op itself."""
    x_spec = strategy.input_specs[0]
    if op.arg(5, "training") and op.batch_norm_groups > 1:
        state_axes = tuple(sorted(x_spec.dims[0]))
        return LocalKernel(grouped_batch_norm, tuple(op.node.args),
                           {**op.node.kwargs, "groups": _local_slices(op, x_spec)}, state_axes=state_axes)
    axes = _sync_axes(op, x_spec)
    if not axes:
        return default_kernel(op, strategy)
    return LocalKernel(sync_batch_norm, tuple(op.node.args), {**op.node.kwargs, "axes": axes}, uses_comm=True)


def _batch_norm_calls(op: OpInfo, in_specs: Sequence[ShardSpec], out_specs: Sequence[ShardSpec | None]
                      ) -> LocalCalls:
    """A device holding several per-rank slices runs one call each and concatenates the outputs
    (backward: the input gradients)."""
    slices = _local_slices(op, in_specs[0])
    if slices == 1:
        return ONE_CALL
    mesh = op.mesh.shape
    return LocalCalls(slices, copied_fwd=local_bytes(op.outputs[0], out_specs[0], mesh),
                      copied_bwd=local_bytes(op.operands[0], in_specs[0], mesh))


def _batch_norm_curve(op: OpInfo, in_specs: Sequence[ShardSpec], _out_specs) -> str:
    """Training batch norm reduces over N and the spatial dims per channel (about 1.5x a layer norm
    per byte on a CPU): its own curve; the sync-BN kernel (:func:`sync_batch_norm`: more passes and
    small ops than the one fused kernel, 1.1-1.5x its time on a CPU from 1 MB, 8-10x on a GPU at
    small sizes) another. Eval batch norm is a per-channel scale and shift."""
    if not op.arg(5, "training"):
        return "pointwise"
    return "sync_batch_norm" if _sync_axes(op, in_specs[0]) else "batch_norm"


@register(aten.batch_norm.default, family="norm", kernel=batch_norm_kernel, curve=_batch_norm_curve,
          local_calls=_batch_norm_calls,
          doc="batch_norm: shard C (per-channel, no comm), or N/spatial (sync-BN stats all-reduce in "
              "training, no comm in eval); planned per rank, N with no comm and no spatial split")
def batch_norm_rules(op: OpInfo) -> list[AxisOption]:
    """batch_norm(input, weight?, bias?, running_mean?, running_var?, training, momentum, eps, cudnn)"""
    ndim = len(op.shape(0))
    if ndim < 2:
        return []
    n_in = len(op.operands)
    channel = _per_channel_operands(op)
    training = bool(op.arg(5, "training"))
    groups = op.batch_norm_groups if training else 1
    if op.shape(0)[0] % groups:
        raise UnsupportedOpError(
            f"{op.describe()}: batch_norm='per_rank' normalises each of the mesh's {groups} devices' equal "
            f"share of the batch, but this batch norm's batch is {op.shape(0)[0]}; make the batch a multiple "
            f"of {groups} or plan with batch_norm='global'")

    def option(tag: str, x_dim: int, c_dim: int | None, extra: tuple[ExtraComm, ...] = ()) -> AxisOption:
        inputs: list = [None] * n_in
        inputs[0] = x_dim
        for j in channel:
            inputs[j] = c_dim
        return AxisOption(tuple(inputs), (x_dim,), tag, extra)

    options = [option("C", 1, 0)]
    if groups > 1:       # a device holds whole slices of the batch: their statistics are its own
        return options + [option("d0", 0, None)]
    for d in [0, *range(2, ndim)]:
        options.append(option(f"sync{d}" if training else f"d{d}", d, None, _SYNC_STATS if training else ()))
    return options
