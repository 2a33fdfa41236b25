"""Pointwise family: elementwise arithmetic, activations, ``where``/``masked_fill``, clamps, dropout.

One general broadcasting rule covers them all (:func:`broadcast_rules`): per mesh axis, any output
dim may be sharded, together with the matching (right-aligned) dim of every operand that has it
and does not broadcast along it; broadcast (size-1) dims and 0-dim operands stay replicated on
that axis, so their gradients come out as partial sums that the framework all-reduces.

Dropout offers the same options. Sharded dropout draws its mask per device, so it equals the
single-device op in distribution only; it is bitwise identical only when ``p == 0`` or
``train=False`` (which is what the simulated checks use).

Inputs are never partial: an op linear in a partial input (add, neg, mul by a replicated factor)
could take one, but partial outputs are resolved in the node that produces them, so no option here
carries a partial operand.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..enumerate import UnsupportedOpError
from ..opinfo import OpInfo
from ..strategy import AxisOption
from .registry import register

aten = torch.ops.aten

__all__ = ["broadcast_rules", "broadcast_dim", "POINTWISE_OPS", "DROPOUT_OPS"]


def broadcast_dim(shape: Sequence[int], out_shape: Sequence[int], out_dim: int) -> int | None:
    """The dim of a right-aligned broadcast operand that carries ``out_dim``; None where it
    broadcasts (absent or size 1 against a larger output)."""
    d = out_dim - (len(out_shape) - len(shape))
    if d < 0 or shape[d] != out_shape[out_dim] or shape[d] == 1:
        return None
    return d


def broadcast_rules(op: OpInfo) -> list[AxisOption]:
    """Per output dim ``d``: shard ``d`` in the output and in every operand that carries it.

    Every output of the op must have the first output's shape (as for ``native_dropout``'s
    output and mask); an output of another shape makes the op replicate-only.
    """
    outputs = op.outputs
    first = outputs[0]
    if first is None or any(o is not None and o.shape != first.shape for o in outputs):
        return []
    out_shape = first.shape
    options = []
    for d in range(len(out_shape)):
        inputs = tuple(broadcast_dim(m.shape, out_shape, d) for m in op.operands)
        if all(i is None for i in inputs):   # nothing carries d: the output could not be cut locally
            continue
        options.append(AxisOption(inputs, tuple(None if o is None else d for o in outputs), f"d{d}"))
    return options


POINTWISE_OPS = (
    # arithmetic (Tensor and Scalar overloads), broadcasting between tensor operands
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar,
    aten.rsub.Tensor, aten.rsub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar,
    aten.maximum.default, aten.minimum.default, aten.remainder.Tensor, aten.remainder.Scalar,
    aten.fmod.Tensor, aten.fmod.Scalar, aten.lerp.Scalar, aten.lerp.Tensor,
    aten.addcmul.default, aten.addcdiv.default,
    # selection and clamping
    aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor,
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_min.Tensor,
    aten.clamp_max.default, aten.clamp_max.Tensor,
    # unary math
    aten.neg.default, aten.abs.default, aten.sign.default, aten.reciprocal.default,
    aten.sqrt.default, aten.rsqrt.default, aten.square.default, aten.exp.default, aten.exp2.default,
    aten.expm1.default, aten.log.default, aten.log2.default, aten.log1p.default,
    aten.sin.default, aten.cos.default, aten.tanh.default, aten.erf.default,
    aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default,
    # activations (gelu: both approximate modes)
    aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default,
    aten.softplus.default, aten.hardtanh.default, aten.leaky_relu.default, aten.elu.default,
    aten.hardswish.default, aten.hardsigmoid.default, aten.mish.default,
)

DROPOUT_OPS = (aten.dropout.default, aten.native_dropout.default)


register(*POINTWISE_OPS, family="pointwise",
         doc="elementwise: shard any output dim with the operands that carry it (broadcast dims replicated)"
         )(broadcast_rules)

register(*DROPOUT_OPS, family="pointwise",
         doc="dropout: shard any dim; matches single-device numerics only with p=0 or train=False "
             "(per-device masks otherwise: equal in distribution)")(broadcast_rules)


@register(aten.add_.Tensor, family="pointwise",
          doc="in-place add: only on a one-element buffer (BatchNorm's num_batches_tracked), replicated")
def inplace_buffer_add_rules(op: OpInfo) -> list[AxisOption]:
    """A buffer counter update: replicated on every device, so each keeps the same count.

    A one-element buffer can only be held replicated, so the tensor mutated here is the buffer
    itself. An in-place add on anything else (an activation, or a buffer that could be held
    sharded) would mutate only the resharded copy this node receives, so it is refused.
    """
    self_meta = op.operands[0]
    if not op.graph.is_buffer(op.operand_nodes[0]) or self_meta.numel != 1:
        raise UnsupportedOpError(
            f"{op.describe()}: in-place add is supported only on a one-element buffer (a step "
            f"counter); write the model with an out-of-place add (x = x + y) instead")
    return []
