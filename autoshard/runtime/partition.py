"""Partitioned activation checkpoints (DeepSpeed/OSLO ``partition_activations``) on the mesh.

A checkpointed region normally keeps its inputs until backward recomputes it. An input that is
replicated over mesh axes holds the same values on every device of those axes, so each device can
keep only its 1/n slice (flattened, split evenly) and the full input is all-gathered right before
recomputation. Gradients are exactly those of plain recomputation: the region runs again on the
same values. An input that stays in memory anyway is kept whole (the lowering marks it with no
axes): one produced outside every segment and read by several, such as rotary tables or a mask
(:func:`autoshard.decisions.stays_resident`); partitioning it would free nothing and add an
all-gather per region, and the solver prices none.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..decisions import partition_axes
from .collectives import RECOMPUTE, MeshComm

PARTITION_META = "activation_partition"
"""Node meta key: on a checkpointed node, keep the region's replicated inputs partitioned."""


def _can_partition(x: Any, axes: Sequence[int], comm: MeshComm) -> bool:
    return isinstance(x, torch.Tensor) and bool(partition_axes(axes, comm.mesh_shape, x.numel(), x.is_floating_point()))


class _PartitionedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, comm: MeshComm, partition_axes: tuple, *inputs):  # type: ignore[override]
        ctx.fn, ctx.comm = fn, comm
        ctx.layout = []                       # per input: (axes, shape) when partitioned, else None
        kept = []
        for x, axes in zip(inputs, partition_axes):
            if axes and _can_partition(x, axes, comm):
                n = 1
                for a in axes:
                    n *= comm.mesh_shape[a]
                piece = x.detach().reshape(-1).chunk(n)[comm.shard_index(axes)].clone()
                ctx.layout.append((tuple(axes), tuple(x.shape), x.requires_grad))
                kept.append(piece)
            else:
                ctx.layout.append(None)
                kept.append(x.detach() if isinstance(x, torch.Tensor) else x)
        ctx.kept = kept
        ctx.grad_flags = [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
        with torch.no_grad():
            out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.single = not isinstance(out, tuple)
        ctx.mark_non_differentiable(*[o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()])
        return out

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        comm: MeshComm = ctx.comm
        inputs = []
        for kept, layout, flag in zip(ctx.kept, ctx.layout, ctx.grad_flags):
            if layout is not None:
                axes, shape, _ = layout
                full = comm.gather_flat(kept, axes, RECOMPUTE).view(shape)
                kept = full
            if isinstance(kept, torch.Tensor):
                kept = kept.detach().requires_grad_(flag)
            inputs.append(kept)
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        need = [x for x, f in zip(inputs, ctx.grad_flags) if f]
        got = iter(torch.autograd.grad([o for o, _ in pairs], need, [g for _, g in pairs], allow_unused=True)
                   if pairs and need else [None] * len(need))
        input_grads = [next(got) if f else None for f in ctx.grad_flags]
        return (None, None, None, *input_grads)


def partitioned_checkpoint(fn: Callable, comm: MeshComm, partition_axes: tuple, *inputs: Any) -> Any:
    """Run ``fn(*inputs)`` keeping nothing for backward but 1/n slices of the inputs replicated over
    ``partition_axes[i]``; backward all-gathers them and recomputes ``fn``."""
    return _PartitionedCheckpoint.apply(fn, comm, partition_axes, *inputs)
