"""Scaled dot-product attention: ``out[..., Hq, L, Ev] = softmax(q k^T * scale + mask) v``.

q is ``[..., Hq, L, E]``, k ``[..., Hkv, S, E]``, v ``[..., Hkv, S, Ev]``, the optional mask
broadcasts to ``[..., Hq, L, S]``. Per mesh axis:

- ``b<d>``: any leading (batch or head) dim ``d``: q, k, v, the mask where it does not
  broadcast there, and the output. With grouped-query attention (``enable_gqa``, Hq != Hkv) the
  head dim shards q's Hq and k/v's Hkv heads alike: contiguous blocks of ``Hq / f`` query heads
  use exactly the kv block ``Hkv / f`` (query head ``h`` reads kv head ``h // (Hq / Hkv)``), so
  whole groups stay together whenever Hkv divides by ``f`` (a shape check);
- ``sq``: the query sequence L (q dim -2, the mask's row dim unless broadcast, output dim -2;
  k, v replicated, their gradients all-reduced). With ``is_causal`` the local op is given the
  explicit causal mask of its row block (offset from ``comm.shard_index``), since a causal flag
  on a local block would mask by local positions.

Not offered: the key sequence S (needs an online-softmax merge of partial results), the
contraction E (the softmax of a partial sum is not a sum), and the value dim Ev (exact, but every
device recomputes the whole score matrix, a cost the split compute model cannot express).
``dropout_p`` > 0 on a sharded op draws the single-device op's mask (:func:`dropout_row_block_sdpa`):
the unsharded op drops attention probabilities with ``dropout`` on a ``[..., Hq, L, S]`` tensor, so
every device draws that global mask the same way and keeps its block, and a seeded sharded run
equals the single-device one.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..opinfo import OpInfo
from ..strategy import AxisOption, Strategy
from .matmul import _broadcast_dim
from .nn_common import operand_slots, option
from .registry import LocalKernel, default_kernel, register

aten = torch.ops.aten


@register(aten.scaled_dot_product_attention.default, family="attention",
          kernel=lambda op, strategy: _sdpa_kernel(op, strategy),
          doc="attention: shard a batch/head dim (GQA: whole kv groups) or the query sequence "
              "(causal: offset mask); never the key sequence or head dims")
def sdpa_rules(op: OpInfo) -> list[AxisOption]:
    """scaled_dot_product_attention(q, k, v, attn_mask?, dropout_p, is_causal, scale, enable_gqa)"""
    slots = operand_slots(op)
    q, k, v, mask = slots["query"], slots["key"], slots["value"], slots.get("attn_mask")
    q_shape, k_shape = op.shape(q), op.shape(k)
    rank, n = len(q_shape), len(op.operands)
    gqa = (bool(op.arg(7, "enable_gqa", False)) and rank >= 3 and len(k_shape) >= 3
           and q_shape[-3] != k_shape[-3])

    def dims_for(out_dim: int) -> dict[int, int | None]:
        """Operand dims aligned with q's (= the output's) dim ``out_dim``, None where broadcast."""
        dims: dict[int, int | None] = {q: out_dim}
        for j in (k, v):
            dims[j] = _broadcast_dim(op.shape(j), rank, out_dim)
        if mask is not None:
            dims[mask] = _broadcast_dim(op.shape(mask), rank, out_dim)
        return dims

    options = []
    for d in range(rank - 2):
        dims = dims_for(d)
        if gqa and d == rank - 3:
            dims[k], dims[v] = len(k_shape) - 3, len(op.shape(v)) - 3
        options.append(option(n, dims, (d,), f"b{d}"))
    rows = {q: rank - 2}
    if mask is not None:
        rows[mask] = _broadcast_dim(op.shape(mask), rank, rank - 2)
    options.append(option(n, rows, (rank - 2,), "sq"))
    return options


def _sdpa_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    out = strategy.output_specs[0]
    if op.arg(4, "dropout_p", 0.0) and out is not None and any(out.dims):
        return _dropout_kernel(op, strategy)
    if "sq" not in strategy.tags or not op.arg(5, "is_causal", False):
        return default_kernel(op, strategy)
    q = operand_slots(op)["query"]
    row_axes = strategy.input_specs[q].dims[len(op.shape(q)) - 2]
    args = (op.arg(0, "query"), op.arg(1, "key"), op.arg(2, "value"), op.arg(4, "dropout_p", 0.0))
    kwargs = {"scale": op.arg(6, "scale"), "enable_gqa": op.arg(7, "enable_gqa", False),
              "row_axes": row_axes}
    return LocalKernel(causal_row_block_sdpa, args, kwargs, uses_comm=True)


def causal_row_block_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          dropout_p: float = 0.0, *, scale: float | None = None,
                          enable_gqa: bool = False, comm, row_axes: Sequence[int]) -> torch.Tensor:
    """Causal attention of this device's block of query rows (rows sharded over ``row_axes``):
    row ``i`` of block ``r`` is global row ``r * L_local + i`` and sees keys ``j <= r * L_local + i``
    (PyTorch's ``is_causal`` is the top-left aligned lower triangle)."""
    rows = query.shape[-2]
    start = comm.shard_index(row_axes) * rows
    mask = torch.ones(rows, key.shape[-2], dtype=torch.bool, device=query.device).tril(start)
    return aten.scaled_dot_product_attention.default(query, key, value, mask, dropout_p, False,
                                                     scale=scale, enable_gqa=enable_gqa)


def _dropout_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """Sharded attention with dropout: the single-device op's dropout draws (see the module docstring)."""
    q = operand_slots(op)["query"]
    out_dims = strategy.output_specs[0].dims
    noise_shape = (*op.outputs[0].shape[:-1], op.shape(operand_slots(op)["key"])[-2])
    mask = op.arg(3, "attn_mask")
    args = (op.arg(0, "query"), op.arg(1, "key"), op.arg(2, "value"), mask, op.arg(4, "dropout_p"))
    kwargs = {"is_causal": op.arg(5, "is_causal", False), "scale": op.arg(6, "scale"),
              "enable_gqa": op.arg(7, "enable_gqa", False), "noise_shape": tuple(noise_shape),
              "noise_dims": (*out_dims[:-1], ()), "row_axes": strategy.input_specs[q].dims[len(op.shape(q)) - 2]}
    return LocalKernel(dropout_row_block_sdpa, args, kwargs, uses_comm=True)


def dropout_row_block_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attn_mask: "torch.Tensor | None", dropout_p: float, *, is_causal: bool,
                           scale: float | None, enable_gqa: bool, noise_shape: Sequence[int],
                           noise_dims: Sequence[Sequence[int]], row_axes: Sequence[int], comm) -> torch.Tensor:
    """This device's block of ``softmax(q k^T * scale + mask) v`` with dropout on the probabilities:
    the mask is drawn over the global ``noise_shape`` ``[..., Hq, L, S]`` as the unsharded op draws
    it (``dropout`` of ones), and this device keeps its block (dim ``d`` split over mesh axes
    ``noise_dims[d]``). Causal rows are offset by this device's block of query rows
    (``row_axes``), as in :func:`causal_row_block_sdpa`."""
    noise = aten.dropout.default(torch.ones(tuple(noise_shape), dtype=query.dtype, device=query.device),
                                 dropout_p, True)
    for d, axes in enumerate(noise_dims):
        if axes:
            noise = noise.chunk(comm.shard_count(axes), d)[comm.shard_index(axes)]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, -3), value.repeat_interleave(group, -3)
    scores = (query @ key.transpose(-2, -1)) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        rows = query.shape[-2]
        start = comm.shard_index(row_axes) * rows if row_axes else 0
        visible = torch.ones(rows, key.shape[-2], dtype=torch.bool, device=query.device).tril(start)
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    return (scores.softmax(-1) * noise) @ value
