"""Pointwise family: elementwise arithmetic, activations, ``where``/``masked_fill``, clamps, dropout.

One general broadcasting rule covers them all (:func:`broadcast_rules`): per mesh axis, any output
dim may be sharded, together with the matching (right-aligned) dim of every operand that has it
and does not broadcast along it; broadcast (size-1) dims and 0-dim operands stay replicated on
that axis, so their gradients come out as partial sums that the framework all-reduces.

Dropout offers the same options and draws its mask coordinated (:func:`coordinated_dropout`): every
device draws the mask of the whole tensor, exactly as the single-device op does, and keeps its
block, so a sharded run equals one device bit for bit when every rank starts from the same RNG
state (:func:`autoshard.parallelize` checks that on the first step), and the ranks' RNG states stay
equal. The price is one full-size mask drawn per device (transient; what is saved for backward is
the local block).

Inputs are never partial: an op linear in a partial input (add, neg, mul by a replicated factor)
could take one, but partial outputs are resolved in the node that produces them, so no option here
carries a partial operand.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..opinfo import OpInfo, UnsupportedOpError
from ..kernel_comm import DeviceComm
from ..strategy import AxisOption, Strategy
from .registry import LocalKernel, default_kernel, register

aten = torch.ops.aten

__all__ = ["broadcast_rules", "broadcast_dim", "coordinated_dropout", "POINTWISE_OPS", "DROPOUT_OPS"]


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
    aten.sqrt.default, aten.rsqrt.default, aten.square.default,
    aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default,
    # piecewise-linear activations
    aten.relu.default, aten.hardtanh.default, aten.leaky_relu.default,
    aten.hardswish.default, aten.hardsigmoid.default,
)

# Elementwise ops that evaluate a transcendental function: priced by their own measured curve
# (``transcendental``), several times an add's time per byte on a CPU. gelu: both approximate modes.
TRANSCENDENTAL_OPS = (
    aten.exp.default, aten.exp2.default, aten.expm1.default, aten.log.default, aten.log2.default,
    aten.log1p.default, aten.sin.default, aten.cos.default, aten.tanh.default, aten.erf.default,
    aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.softplus.default, aten.elu.default,
    aten.mish.default,
)

DROPOUT_OPS = (aten.dropout.default, aten.native_dropout.default)


_ELEMENTWISE_DOC = "elementwise: shard any output dim with the operands that carry it (broadcast dims replicated)"
_OWN_CURVE = {aten.exp.default: "exp", aten.log.default: "log", aten.tanh.default: "tanh",
              aten.sigmoid.default: "sigmoid", aten.silu.default: "silu"}


def _transcendental_curve(op: OpInfo, *_specs) -> str:
    """The function's own measured curve (see :data:`autoshard.hardware.ELEMENTWISE_FUNCTIONS`; GELU's
    depends on ``approximate``), else the median ``transcendental`` one."""
    if op.node.target is aten.gelu.default:
        return "gelu_tanh" if op.arg(1, "approximate", "none") == "tanh" else "gelu"
    return _OWN_CURVE.get(op.node.target, "transcendental")


register(*POINTWISE_OPS, family="pointwise", doc=_ELEMENTWISE_DOC)(broadcast_rules)
register(*TRANSCENDENTAL_OPS, family="pointwise", curve=_transcendental_curve, doc=_ELEMENTWISE_DOC)(broadcast_rules)

def coordinated_dropout(input: torch.Tensor, p: float, train: "bool | None", *, op: str,
                        global_shape: Sequence[int], dims: tuple[tuple[int, ...], ...],
                        comm: DeviceComm) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
    """Dropout of this device's block of a tensor of ``global_shape`` (dim ``d`` split over mesh axes
    ``dims[d]``), with the mask the single-device op would draw: the op runs on a global tensor of
    ones (same RNG draws, same kernel), and this device multiplies its block by its block of the
    result. ``op``: ``'dropout'`` (returns the output) or ``'native_dropout'`` (output and mask)."""
    ones = torch.ones(global_shape, dtype=input.dtype, device=input.device)
    if op == "native_dropout":
        noise, mask = aten.native_dropout.default(ones, p, train)
    else:
        noise, mask = aten.dropout.default(ones, p, bool(train)), None

    def block(t: torch.Tensor) -> torch.Tensor:
        for d, axes in enumerate(dims):
            if axes:
                t = t.chunk(comm.shard_count(axes), d)[comm.shard_index(axes)]  # type: ignore[attr-defined]
        return t.clone()           # its own storage: the global mask is freed, only the block is saved

    out = input * block(noise)
    return out if mask is None else (out, block(mask))


def dropout_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """Random dropout on a sharded tensor draws the global mask (:func:`coordinated_dropout`); dropout
    that draws nothing (eval, p = 0) or on a whole tensor is the op itself."""
    p, train = float(op.arg(1, "p")), op.arg(2, "train")
    spec = strategy.output_specs[0]
    if train is False or p == 0.0 or spec is None or not any(spec.dims):
        return default_kernel(op, strategy)
    name = "native_dropout" if op.target is aten.native_dropout.default else "dropout"
    return LocalKernel(coordinated_dropout, (op.node.args[0], p, train),
                       {"op": name, "global_shape": tuple(op.outputs[0].shape), "dims": spec.dims},
                       uses_comm=True)


register(*DROPOUT_OPS, family="pointwise", kernel=dropout_kernel,
         doc="dropout: shard any dim; the mask is drawn for the whole tensor on every device and each keeps "
             "its block (equal to one device given equal RNG states)")(broadcast_rules)


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
