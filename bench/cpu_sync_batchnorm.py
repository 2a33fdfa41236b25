"""Synchronised batch norm for CPU process groups: what ``torch.nn.SyncBatchNorm`` computes (whose
kernels run on GPUs only), so that a torch DDP reference of a model with batch norm computes the
same function on gloo ranks as autoshard's plans do (statistics of the global batch).

Forward: one all-reduce of the per-channel sums, sums of squares and counts; backward: one
all-reduce of the per-channel sums of the output gradient and of its product with the normalised
input (``torch.nn.SyncBatchNorm`` all-gathers the statistics forward and all-reduces the same two
sums backward). The weight and bias gradients stay local sums, which DDP then all-reduces.
Training mode only (eval uses the running statistics, as ``BatchNorm`` does).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, group):
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        dist.all_reduce(stats, group=group)
        c = x.shape[1]
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        invstd = torch.rsqrt(var + eps)
        shape = [1, c] + [1] * (x.dim() - 2)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.n, ctx.group, ctx.dims, ctx.shape = n, group, dims, shape
        return xhat * weight.view(shape) + bias.view(shape), mean, var * n / (n - 1)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, _dmean, _dvar):
        xhat, invstd, weight = ctx.saved_tensors
        dims, shape, c = ctx.dims, ctx.shape, xhat.shape[1]
        local = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)])
        sums = local.clone()
        dist.all_reduce(sums, group=ctx.group)
        sum_dy, sum_dy_xhat = sums[:c], sums[c:]
        dx = (weight * invstd).view(shape) / ctx.n * (
            ctx.n * dy - sum_dy.view(shape) - xhat * sum_dy_xhat.view(shape))
        return dx, local[c:], local[:c], None, None


class CPUSyncBatchNorm(nn.Module):
    """A drop-in for a ``BatchNorm1d/2d/3d`` (same parameters and buffers) whose training-mode
    statistics are those of the whole batch over ``group``."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, group=None) -> None:
        super().__init__()
        if not (bn.affine and bn.track_running_stats and bn.momentum is not None):
            raise ValueError("CPUSyncBatchNorm supports affine batch norm with running statistics and a momentum")
        self.weight, self.bias = bn.weight, bn.bias
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)
        self.eps, self.momentum, self.group = bn.eps, bn.momentum, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                            False, 0.0, self.eps)
        y, mean, unbiased_var = _SyncBatchNormFn.apply(x, self.weight, self.bias, self.eps, self.group)
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(unbiased_var, self.momentum)
            self.num_batches_tracked += 1
        return y


def convert_sync_batchnorm(module: nn.Module, group=None) -> nn.Module:
    """``module`` with every batch norm replaced by :class:`CPUSyncBatchNorm` (in place; returned)."""
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(module, name, CPUSyncBatchNorm(child, group))
        else:
            convert_sync_batchnorm(child, group)
    return module
