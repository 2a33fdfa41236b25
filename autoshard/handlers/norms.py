"""Normalisation: layer_norm, rms_norm, batch_norm (with synchronised statistics).

``layer_norm``/``rms_norm`` normalise over their trailing ``normalized_shape`` dims: per mesh axis
any leading dim may be sharded; weight and bias stay replicated (their gradients are then partial
sums, all-reduced by the framework).

``batch_norm`` normalises each channel (input dim 1) over the batch and spatial dims:

* shard C: input dim 1 with weight/bias/running stats dim 0, no communication;
* shard N or a spatial dim: in training this is *sync batch-norm*: the per-channel sum and the
  sum of squared deviations are all-reduced over the axes that split the reduced dims (two
  all-reduces of ``C_local`` values, forward and backward), so statistics, output, gradients and
  the running-stat update equal the single-device op. In eval (``training=False``) the op is
  per-channel affine with the running stats, and sharding any dim needs no communication.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..comm_api import DeviceComm
from ..opinfo import OpInfo
from ..specs import ShardSpec
from ..strategy import BWD, FWD, AxisOption, ExtraComm, Strategy
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


def _stats_nbytes(op: OpInfo, in_specs: Sequence[ShardSpec], _out_specs) -> int:
    """Bytes of one per-channel statistics vector on one device: ``C_local`` values."""
    shape = op.shape(0)
    c_local = shape[1] // in_specs[0].shard_factor(1, op.mesh.shape)
    return c_local * _stat_dtype(op.operands[0].dtype).itemsize


_SYNC_STATS = tuple(ExtraComm("all_reduce", phase, _stats_nbytes, f"bn-{stat}")
                    for phase in (FWD, BWD) for stat in ("sum", "sqdev"))


def sync_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    training: bool, momentum: float, eps: float, cudnn_enabled: bool = False, *,
                    comm: DeviceComm, axes: Sequence[int]) -> torch.Tensor:
    """Training batch_norm on a shard of the reduced (N, spatial) dims, statistics global over ``axes``.

    The mean is formed first, then the sum of squared deviations from it (two all-reduces rather
    than one of sum and sum of squares, which cancels catastrophically in low precision). Both
    all-reduces sum their gradients in backward, since every device's output depends on the global
    statistics. Running stats are updated in place as the single-device op does (unbiased
    variance with the global count); every device holds the same replica of its channels.
    """
    if not training:
        raise ValueError("sync_batch_norm is for training mode; eval batch_norm needs no communication")
    reduce = [0, *range(2, input.ndim)]
    view = [1, -1] + [1] * (input.ndim - 2)
    shards = math.prod(comm.mesh_shape[a] for a in axes)
    count = input.numel() // input.shape[1] * shards
    x = input.to(_stat_dtype(input.dtype))
    mean = comm.all_reduce(x.sum(reduce), axes, backward="sum") / count
    centred = x - mean.view(view)
    var = comm.all_reduce((centred * centred).sum(reduce), axes, backward="sum") / count
    y = centred * torch.rsqrt(var + eps).view(view)
    if weight is not None:
        y = y * weight.view(view)
    if bias is not None:
        y = y + bias.view(view)
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * (count / (count - 1)) if count > 1 else var
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return y.to(input.dtype)


def batch_norm_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """Sync-BN when training with the batch or a spatial dim sharded; else the op itself."""
    x_spec = strategy.input_specs[0]
    axes = sorted(a for d, dim_axes in enumerate(x_spec.dims) if d != 1 for a in dim_axes)
    if not op.arg(5, "training") or not axes:
        return default_kernel(op, strategy)
    return LocalKernel(sync_batch_norm, tuple(op.node.args), {**op.node.kwargs, "axes": tuple(axes)},
                       uses_comm=True)


@register(aten.batch_norm.default, family="norm", kernel=batch_norm_kernel,
          doc="batch_norm: shard C (per-channel, no comm), or N/spatial (sync-BN stats all-reduce in "
              "training, no comm in eval)")
def batch_norm_rules(op: OpInfo) -> list[AxisOption]:
    """batch_norm(input, weight?, bias?, running_mean?, running_var?, training, momentum, eps, cudnn)"""
    ndim = len(op.shape(0))
    if ndim < 2:
        return []
    n_in = len(op.operands)
    channel = _per_channel_operands(op)
    training = bool(op.arg(5, "training"))

    def option(tag: str, x_dim: int, c_dim: int | None, extra: tuple[ExtraComm, ...] = ()) -> AxisOption:
        inputs: list = [None] * n_in
        inputs[0] = x_dim
        for j in channel:
            inputs[j] = c_dim
        return AxisOption(tuple(inputs), (x_dim,), tag, extra)

    options = [option("C", 1, 0)]
    for d in [0, *range(2, ndim)]:
        options.append(option(f"sync{d}" if training else f"d{d}", d, None, _SYNC_STATS if training else ()))
    return options
