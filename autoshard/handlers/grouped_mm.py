"""Grouped matmul of mixture-of-experts layers: ``out[s] = input[s] @ weight[e(s)]``.

``input`` is ``[S, K]`` with its rows sorted by expert, ``weight`` is ``[E, K, N]`` and ``offs``
``[E]`` the cumulative row count at the end of each expert's group. transformers emits it as the
custom op ``transformers::grouped_mm_fallback`` (fp32, and whenever ``torch._grouped_mm`` cannot
run). ``aten._grouped_mm`` (bf16 on CPU) has no handler yet: it requires 16-byte aligned strides,
which the blocks of a sharded weight do not keep.

Per mesh axis one of:

- ``n``: the output features (``weight`` dim 2): no communication;
- ``k``: the contraction (``input`` dim 1, ``weight`` dim 1): partial output;
- ``e``: the experts (``weight`` dim 0; expert parallelism): each device multiplies the rows of its
  experts and leaves the others zero, a partial output;
- ``s``: the rows (``input`` dim 0): each device multiplies its contiguous block of rows with
  ``offs`` shifted and clamped to that block.

``e`` and ``s`` need the device's shard index, so their local kernel takes ``comm``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..kernel_comm import DeviceComm
from ..opinfo import OpInfo
from ..strategy import PARTIAL, AxisOption, Strategy
from .registry import LocalKernel, default_kernel, register

TRANSFORMERS_GROUPED_MM = "transformers.grouped_mm_fallback.default"


def _grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch.ops.transformers.grouped_mm_fallback(input, weight, offs)


def grouped_mm_shard(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, *, comm: DeviceComm,
                     row_axes: Sequence[int], expert_axes: Sequence[int]) -> torch.Tensor:
    """This device's block of a grouped matmul whose rows are split over ``row_axes`` and/or whose
    experts are split over ``expert_axes`` (rows of other devices' experts come out zero: the
    output is partial over ``expert_axes``)."""
    rows = input.shape[0]
    if row_axes:
        start = comm.shard_index(row_axes) * rows
        offs = (offs - start).clamp(0, rows).to(offs.dtype)
    if not expert_axes:
        return _grouped_mm(input, weight, offs)
    local_experts = weight.shape[0]
    first = comm.shard_index(expert_axes) * local_experts
    ends = offs[first:first + local_experts]
    lo = int(offs[first - 1]) if first > 0 else 0
    hi = int(ends[-1])
    block = _grouped_mm(input[lo:hi], weight, (ends - lo).to(offs.dtype))
    zeros = block.new_zeros
    return torch.cat([zeros(lo, block.shape[1]), block, zeros(rows - hi, block.shape[1])])


def _axes_with(strategy: Strategy, tag: str) -> tuple[int, ...]:
    return tuple(a for a, t in enumerate(strategy.tags) if t == tag)


def grouped_mm_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    row_axes, expert_axes = _axes_with(strategy, "s"), _axes_with(strategy, "e")
    if not row_axes and not expert_axes:
        return default_kernel(op, strategy)
    input, weight, offs = op.node.args[:3]
    return LocalKernel(grouped_mm_shard, (input, weight, offs),
                       {"row_axes": row_axes, "expert_axes": expert_axes}, uses_comm=True)


def _grouped_mm_rules(op: OpInfo) -> list[AxisOption]:
    """(input[S, K], weight[E, K, N], offs[E], ...): the rows, the contraction, the experts or the
    output features."""
    if len(op.shape(0)) != 2 or len(op.shape(1)) != 3 or len(op.operands) != 3:
        raise ValueError(f"{op.describe()}: expected input [S, K], weight [E, K, N], offs [E]")

    def opt(tag: str, input_dim, weight_dim, out_dim, partial_grads: tuple[int, ...] = ()) -> AxisOption:
        inputs: list = [None] * len(op.operands)
        inputs[0], inputs[1] = input_dim, weight_dim
        return AxisOption(tuple(inputs), (out_dim,), tag, partial_grads=partial_grads)

    # e: each device back-propagates into the rows of its own experts only
    return [opt("s", 0, None, 0), opt("k", 1, 1, PARTIAL), opt("e", None, 0, PARTIAL, partial_grads=(0,)),
            opt("n", None, 2, 1)]


register(TRANSFORMERS_GROUPED_MM, family="matmul", kernel=grouped_mm_kernel,
         doc="grouped matmul of MoE experts: shard the rows, the contraction (partial), the experts (expert "
             "parallel, partial) or the output features")(_grouped_mm_rules)
