"""Embedding lookup: ``out[*idx, H] = weight[V, H][indices[*idx]]``.

Per mesh axis:

- ``i<d>``: shard dim ``d`` of the indices; the output follows (the weight is replicated and
  its gradient all-reduced);
- ``h``: shard the hidden dim (weight dim 1 -> output last dim);
- ``v``: vocab-parallel: shard the vocabulary (weight dim 0) -> partial output. Each device
  looks up only the indices inside its vocab block (its offset comes from
  ``comm.shard_index``), zeroes the other rows, and the all-reduce sums the blocks. The
  padding row keeps a zero gradient: the local op gets the local padding index when the block
  holds it, none otherwise.

With ``scale_grad_by_freq`` the gradient divides by each index's count in the whole batch, so
only ``h`` (indices replicated, counts global) is offered.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..opinfo import OpInfo
from ..strategy import PARTIAL, AxisOption, Strategy
from .nn_common import operand_slots, option
from .registry import LocalKernel, default_kernel, register

aten = torch.ops.aten


@register(aten.embedding.default, family="embedding",
          kernel=lambda op, strategy: _embedding_kernel(op, strategy),
          doc="embedding: shard an index dim (output follows), hidden (weight dim 1), or the "
              "vocabulary (weight dim 0 -> partial, masked local lookup)")
def embedding_rules(op: OpInfo) -> list[AxisOption]:
    """embedding(weight[V, H], indices[*idx], padding_idx, scale_grad_by_freq, sparse)"""
    slots = operand_slots(op)
    w, idx = slots["weight"], slots["indices"]
    n = len(op.operands)
    options = [option(n, {w: 1}, (-1,), "h")]
    if op.arg(3, "scale_grad_by_freq", False):
        return options
    options += [option(n, {idx: d}, (d,), f"i{d}") for d in range(len(op.shape(idx)))]
    options.append(option(n, {w: 0}, (PARTIAL,), "v"))
    return options


def _embedding_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    if "v" not in strategy.tags:
        return default_kernel(op, strategy)
    w = operand_slots(op)["weight"]
    vocab_axes = strategy.input_specs[w].dims[0]
    args = (op.arg(0, "weight"), op.arg(1, "indices"), op.arg(2, "padding_idx", -1),
            op.arg(3, "scale_grad_by_freq", False), op.arg(4, "sparse", False))
    return LocalKernel(vocab_parallel_embedding, args, {"vocab_axes": vocab_axes}, uses_comm=True)


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                             scale_grad_by_freq: bool = False, sparse: bool = False, *,
                             comm, vocab_axes: Sequence[int]) -> torch.Tensor:
    """This device's summand of ``embedding(full_weight, indices)``: rows of its vocab block,
    zeros for indices outside it (the vocab dim of ``weight`` is sharded over ``vocab_axes``)."""
    rows = weight.shape[0]
    start = comm.shard_index(vocab_axes) * rows
    local = indices - start
    inside = (local >= 0) & (local < rows)
    local_pad = padding_idx - start if 0 <= padding_idx - start < rows and padding_idx >= 0 else -1
    out = aten.embedding.default(weight, torch.where(inside, local, 0), local_pad,
                                 scale_grad_by_freq, sparse)
    return out.masked_fill(~inside.unsqueeze(-1), 0)
