"""Convolution family: conv1d/2d/3d (both padding overloads), conv_transpose1d/2d/3d, convolution.

Per mesh axis, ``Y[N, Cout, *sp] = conv(X[N, Cin, *sp], W)`` may shard:

- ``n``: the batch (input dim 0 -> output dim 0; the weight is replicated and its gradient
  all-reduced);
- ``cout`` (groups == 1): the output channels (weight out-channel dim, bias, output dim 1);
- ``cin`` (groups == 1): the input channels (input dim 1, weight in-channel dim) -> partial
  output; the bias is added once, after the all-reduce;
- ``g`` (groups > 1): whole groups: input channels, weight dim 0, bias and output channels are
  split into blocks of ``groups / f`` groups each and the local op runs with ``groups / f``
  groups. Valid only when the group count divides by the shard factor ``f``: the per-axis rule
  cannot see which axes combine, so the option is offered only when ``groups`` divides by every
  factor the mesh can form (each axis and both together). This covers depthwise convolutions
  (input channels, weight dim 0 and output channels sharded alike).

Not offered: spatial sharding (a window straddles shard borders: needs halo exchange), and for
groups > 1 out-channels alone or in-channels within a group (a device's channels would not be
whole groups of its input block).

The weight is ``[Cout, Cin/groups, *k]``, or ``[Cin, Cout/groups, *k]`` when transposed.
Unbatched inputs (``[Cin, *sp]``) have no ``n`` option. Names use the logical notation
``OUT = IN x W`` with IN/OUT as ``[N, C]`` and the weight as ``[in, out]``; a ``_g`` suffix
marks group sharding.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..mesh import MeshSpec
from ..opinfo import OpInfo
from ..specs import ShardSpec
from ..strategy import PARTIAL, AxisOption, Strategy
from .matmul import _logical
from .nn_common import operand_slots, option, set_arg
from .registry import LocalKernel, register

aten = torch.ops.aten


class _ConvArgs:
    """Where a conv overload keeps ``transposed`` and ``groups``."""

    def __init__(self, groups_index: int, transposed: bool | int):
        self.groups_index = groups_index
        self.transposed = transposed     # a bool, or the index of the ``transposed`` argument

    def is_transposed(self, op: OpInfo) -> bool:
        if isinstance(self.transposed, bool):
            return self.transposed
        return bool(op.arg(self.transposed, "transposed", False))

    def groups(self, op: OpInfo) -> int:
        return int(op.arg(self.groups_index, "groups", 1))


_CONV = _ConvArgs(groups_index=6, transposed=False)
_CONV_T = _ConvArgs(groups_index=6, transposed=True)
_CONVOLUTION = _ConvArgs(groups_index=8, transposed=6)


class _Layout:
    """Operand indices and channel dims of one conv node."""

    def __init__(self, op: OpInfo, conv: _ConvArgs):
        slots = operand_slots(op)
        self.x, self.w, self.b = slots["input"], slots["weight"], slots.get("bias")
        self.batched = len(op.shape(self.x)) == len(op.shape(self.w))
        self.cdim = 1 if self.batched else 0
        transposed = conv.is_transposed(op)
        self.w_in, self.w_out = (0, 1) if transposed else (1, 0)
        self.groups = conv.groups(op)


def _groups_divide(groups: int, mesh: MeshSpec) -> bool:
    """Whether every shard factor the mesh can form for one dim divides ``groups``."""
    sizes = [n for n in mesh.shape if n > 1]
    return all(groups % f == 0 for f in [*sizes, math.prod(sizes)])


def _conv_rules(conv: _ConvArgs):
    def rules(op: OpInfo) -> list[AxisOption]:
        lay = _Layout(op, conv)
        n = len(op.operands)

        def opt(tag: str, x, w, b, y) -> AxisOption:
            dims = {lay.x: x, lay.w: w}
            if lay.b is not None:
                dims[lay.b] = b
            return option(n, dims, (y,), tag)

        options = [opt("n", 0, None, None, 0)] if lay.batched else []
        if lay.groups == 1:
            options.append(opt("cout", None, lay.w_out, 0, lay.cdim))
            options.append(opt("cin", lay.cdim, lay.w_in, None, PARTIAL))
        elif _groups_divide(lay.groups, op.mesh):
            options.append(opt("g", lay.cdim, 0, 0, lay.cdim))
        return options

    return rules


def _conv_kernel(conv: _ConvArgs):
    """Local conv: ``groups / f`` groups under group sharding; with in-channels sharded the bias
    is dropped from the local op and added once after the partial output is reduced."""

    def kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
        lay = _Layout(op, conv)
        args, kwargs = tuple(op.node.args), dict(op.node.kwargs)
        if "g" in strategy.tags:
            f = strategy.input_specs[lay.x].shard_factor(lay.cdim, op.mesh.shape)
            args, kwargs = set_arg(args, kwargs, conv.groups_index, "groups", lay.groups // f)
        epilogue = None
        if "cin" in strategy.tags and lay.b is not None:
            args, kwargs = set_arg(args, kwargs, 2, "bias", None)
            b, trailing = lay.b, len(op.out_shape) - lay.cdim - 1

            def epilogue(outs, local):
                return (outs[0] + local[b].view((-1,) + (1,) * trailing),)
        return LocalKernel(op.target, args, kwargs, epilogue)

    return kernel


CHANNEL_BLOCK = 16
"""Channels per block of oneDNN's blocked convolution layouts: a convolution whose local input or
output channels are no whole multiple of this runs outside them, slower per FLOP (4 CPU ranks: C -> C
convs at 40-62 GFLOP/s forward against 58-101 aligned; one process: a 3 -> 32 channel weight gradient
at 8-54 GFLOP/s, 16 -> 32 at 155-175), and is priced by the ``conv_unaligned`` curve where the
profile has one."""


def _conv_curve(conv: _ConvArgs):
    def curve(op: OpInfo, in_specs: Sequence[ShardSpec], out_specs: Sequence[ShardSpec | None]) -> str:
        lay = _Layout(op, conv)
        mesh_shape = op.mesh.shape
        out_spec, out_shape = out_specs[0], op.out_shape
        channels = (in_specs[lay.x].local_shape(op.shape(lay.x), mesh_shape)[lay.cdim],
                    (out_shape if out_spec is None else out_spec.local_shape(out_shape, mesh_shape))[lay.cdim])
        return "conv" if all(c % CHANNEL_BLOCK == 0 for c in channels) else "conv_unaligned"

    return curve


def _conv_namer(conv: _ConvArgs):
    def name(op: OpInfo, ins: Sequence[ShardSpec], outs: Sequence[ShardSpec | None],
             opts: Sequence[AxisOption]) -> str:
        lay = _Layout(op, conv)
        act = [[0], [1]] if lay.batched else [[0]]
        y = outs[0]
        assert y is not None
        text = (f"{_logical(y, act)} = {_logical(ins[lay.x], act)} x "
                f"{_logical(ins[lay.w], [[lay.w_in], [lay.w_out]])}")
        return text + ("_g" if any(o.tag == "g" for o in opts) else "")

    return name


_DOC = ("convolution: shard batch (n), out-channels (cout), in-channels (cin -> partial, bias "
        "after the reduction), or whole groups (g, groups > 1); never spatial dims (halos)")

for _targets, _conv in (
    ((aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.conv1d.padding,
      aten.conv2d.padding, aten.conv3d.padding), _CONV),
    ((aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input),
     _CONV_T),
    ((aten.convolution.default,), _CONVOLUTION),
):
    register(*_targets, family="conv", curve=_conv_curve(_conv), namer=_conv_namer(_conv),
             kernel=_conv_kernel(_conv), doc=_DOC)(_conv_rules(_conv))
