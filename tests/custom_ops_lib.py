"""Custom ops registered with torch.library for the custom-op tests (unit and distributed).

- ``astest::opaque_scaled_mm(x, w, s)``: ``(x @ w) * s`` as an opaque custom op (fake kernel and
  autograd formula, like ``transformers::grouped_mm_fallback``), no decomposition.
- ``astest::decomposed_scaled_mm(x, w, s)``: the same, with a decomposition registered
  (``torch._decomp.register_decomposition``) that capture inlines.
"""
from __future__ import annotations

import torch
from torch._decomp import register_decomposition


def _define(name: str):
    @torch.library.custom_op(f"astest::{name}", mutates_args=())
    def op(x: torch.Tensor, w: torch.Tensor, s: float) -> torch.Tensor:
        return (x @ w) * s

    @op.register_fake
    def _(x, w, s):
        return x.new_empty(*x.shape[:-1], w.shape[1])

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.s = inputs[2]

    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gw = (x.reshape(-1, x.shape[-1]).t() @ grad.reshape(-1, grad.shape[-1])) * ctx.s
        return (grad @ w.t()) * ctx.s, gw, None

    op.register_autograd(backward, setup_context=setup_context)
    return op


opaque_scaled_mm = _define("opaque_scaled_mm")
decomposed_scaled_mm = _define("decomposed_scaled_mm")


@register_decomposition(torch.ops.astest.decomposed_scaled_mm.default)
def _decomposed_scaled_mm(x: torch.Tensor, w: torch.Tensor, s: float) -> torch.Tensor:
    return torch.matmul(x, w) * s


class CustomOpModel(torch.nn.Module):
    """Linear -> custom scaled matmul (in a sub-module) -> GELU -> linear head; loss in the graph."""

    def __init__(self, op_name: str, d: int = 8):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.expert = Expert(op_name, d)
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x, y):
        h = torch.nn.functional.gelu(self.expert(self.fc(x)))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class Expert(torch.nn.Module):
    def __init__(self, op_name: str, d: int):
        super().__init__()
        self.op = getattr(torch.ops.astest, op_name).default
        self.w = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, h):
        return self.op(h, self.w, 0.5)


def example(op_name: str):
    torch.manual_seed(0)
    return CustomOpModel(op_name), (torch.randn(8, 4, 8), torch.randint(0, 4, (8, 4)))
