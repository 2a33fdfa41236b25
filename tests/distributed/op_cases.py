"""Small modules that exercise every handler's rules, for the per-strategy runtime checks.

Each case is ``name -> (module factory, input factory)``; inputs are built from a seed derived from
the name, so every rank builds the same values. Float inputs require grad, integer inputs are
indices/targets. Shapes divide by 4 wherever a dim may be sharded, so every mesh of 4 devices
offers its full set of strategies.
"""
from __future__ import annotations

import zlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from handler_utils import Fn


def _p(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape))


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_()


def _i(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape)


def _transformers_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def _expert_offsets() -> torch.Tensor:
    """Rows 0-1 to expert 0, none to expert 1 (an empty group), 2-5 to expert 2, 6-7 to expert 3."""
    return torch.tensor([2, 2, 6, 8], dtype=torch.int32)


def _no_grad_center(m, x):
    with torch.no_grad():
        mean = x.mean()
    return x - mean


def _write_into_views(m, x):
    """capture: slice + copy_ -> slice_scatter, select + mul_ -> select_scatter"""
    y = x * 2
    y[:, 2:6] = m.w
    y[:, :, 1].mul_(0.5)
    return y


def _index_put(m, x, i):
    """capture: index_put_ on a computed value -> index_put"""
    y = x * 2
    y[i] = m.w                       # boolean mask over dims 0-1, values broadcast along dim 2
    return y


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]] = {
    # matmul family
    "linear": (lambda: Fn(lambda m, x: m.fc(x), fc=nn.Linear(8, 16)), lambda: (_x(4, 4, 8),)),
    "mm": (lambda: Fn(lambda m, x: torch.mm(x, m.w), w=_p(8, 16)), lambda: (_x(8, 8),)),
    "addmm": (lambda: Fn(lambda m, x: torch.addmm(m.b, x, m.w), w=_p(8, 16), b=_p(16)), lambda: (_x(8, 8),)),
    "bmm": (lambda: Fn(lambda m, a, b: torch.bmm(a, b)), lambda: (_x(4, 8, 8), _x(4, 8, 4))),
    "baddbmm": (lambda: Fn(lambda m, c, a, b: torch.baddbmm(c, a, b)), lambda: (_x(4, 8, 4), _x(4, 8, 8), _x(4, 8, 4))),
    "matmul": (lambda: Fn(lambda m, a: torch.matmul(a, m.w), w=_p(8, 4)), lambda: (_x(4, 4, 8),)),
    "sdpa_causal": (lambda: Fn(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                    lambda: (_x(4, 4, 8, 8), _x(4, 4, 8, 8), _x(4, 4, 8, 8))),
    # casts and metadata
    "cast": (lambda: Fn(lambda m, x: (x.to(torch.float64) * 2).to(torch.float32)), lambda: (_x(4, 8),)),
    "cast_like": (lambda: Fn(lambda m, x: x.type_as(m.w) * m.w, w=nn.Parameter(torch.randn(4, 8, dtype=torch.float64))),
                  lambda: (_x(4, 8),)),
    "to_same_dtype": (lambda: Fn(lambda m, x: x.to(torch.float32) * 2), lambda: (_x(4, 8),)),
    # convolution, pooling, norms
    "conv2d": (lambda: Fn(lambda m, x: m.conv(x), conv=nn.Conv2d(4, 8, 3, padding=1)), lambda: (_x(4, 4, 6, 6),)),
    "max_pool2d": (lambda: Fn(lambda m, x: F.max_pool2d(x, 2)), lambda: (_x(4, 4, 8, 8),)),
    "adaptive_avg_pool2d": (lambda: Fn(lambda m, x: F.adaptive_avg_pool2d(x, 2)), lambda: (_x(4, 4, 8, 8),)),
    "batch_norm": (lambda: Fn(lambda m, x: m.bn(x), bn=nn.BatchNorm2d(4)), lambda: (_x(4, 4, 4, 4),)),
    "layer_norm": (lambda: Fn(lambda m, x: m.ln(x), ln=nn.LayerNorm(8)), lambda: (_x(4, 4, 8),)),
    "rms_norm": (lambda: Fn(lambda m, x: m.norm(x), norm=nn.RMSNorm(8)), lambda: (_x(4, 4, 8),)),
    # embedding, indexing, loss
    "embedding": (lambda: Fn(lambda m, i: m.emb(i), emb=nn.Embedding(16, 8)), lambda: (_i(16, 4, 4),)),
    "gather": (lambda: Fn(lambda m, x, i: torch.gather(x, 1, i)), lambda: (_x(4, 8), _i(8, 4, 4))),
    "index": (lambda: Fn(lambda m, x, i: x[i]), lambda: (_x(8, 8), _i(8, 4))),
    "index_arange": (lambda: Fn(lambda m, x, i: x[torch.arange(8, device=x.device)[:, None], :, i[None, :]]),
                     lambda: (_x(8, 4, 8), _i(8, 4))),
    "index_select": (lambda: Fn(lambda m, x, i: torch.index_select(x, 0, i)), lambda: (_x(8, 8), _i(8, 4))),
    "cross_entropy": (lambda: Fn(lambda m, x, t: F.cross_entropy(x, t)), lambda: (_x(8, 16), _i(16, 8))),
    # pointwise, masks, factories
    "broadcast_pointwise": (lambda: Fn(lambda m, x: torch.tanh(x * m.w + m.b), w=_p(8), b=_p(4, 1)),
                            lambda: (_x(4, 8),)),
    "compare_where": (lambda: Fn(lambda m, x: torch.where(x > 0, x, x * 0.1)), lambda: (_x(4, 8),)),
    "cumsum": (lambda: Fn(lambda m, x: torch.cumsum(x, 1)), lambda: (_x(4, 8),)),
    "diff": (lambda: Fn(lambda m, x: torch.diff(x, dim=1)), lambda: (_x(4, 8),)),
    "pad": (lambda: Fn(lambda m, x: F.pad(x, (1, 1))), lambda: (_x(4, 8),)),
    "tril": (lambda: Fn(lambda m, x: torch.tril(x)), lambda: (_x(8, 8),)),
    "arange": (lambda: Fn(lambda m, x: x * torch.arange(8, device=x.device)), lambda: (_x(4, 8),)),
    "rand": (lambda: Fn(lambda m, x: x * torch.rand(4, 8, device=x.device) + torch.randn(4, 8, device=x.device)),
             lambda: (_x(4, 8),)),
    "like": (lambda: Fn(lambda m, x: x * torch.full_like(x, 2.0) + torch.zeros_like(x)), lambda: (_x(4, 8),)),
    "new_like": (lambda: Fn(lambda m, x: x + x.new_ones((4, 8))), lambda: (_x(4, 8),)),
    "new_tensor": (lambda: Fn(lambda m, x: x + torch.ones(4, 8, device=x.device)), lambda: (_x(4, 8),)),
    "scalar_tensor": (lambda: Fn(lambda m, x: x * torch.scalar_tensor(3.0, device=x.device)), lambda: (_x(4, 8),)),
    "no_grad_region": (lambda: Fn(_no_grad_center), lambda: (_x(4, 8),)),
    # ordering, binning and elementwise selection (handlers/sorting.py), repeat_interleave
    "min_max_other": (lambda: Fn(lambda m, x, y: torch.min(x, y) * torch.max(x, m.w), w=_p(8)),
                      lambda: (_x(4, 8), _x(4, 8))),
    "floor_divide": (lambda: Fn(lambda m, x, i: x * torch.floor_divide(i, 3).to(x.dtype)),
                     lambda: (_x(4, 8), _i(50, 4, 8))),
    "copy_inplace": (lambda: Fn(lambda m, x, y: torch.empty_like(x).copy_(y) * x), lambda: (_x(4, 8), _x(8))),
    "write_into_views": (lambda: Fn(_write_into_views, w=_p(4)), lambda: (_x(4, 8, 4),)),
    "index_put": (lambda: Fn(_index_put, w=_p(4)), lambda: (_x(4, 8, 4), torch.rand(4, 8) > 0.5)),
    "topk": (lambda: Fn(lambda m, x: torch.topk(x * m.w, 3, dim=-1), w=_p(8)), lambda: (_x(4, 4, 8),)),
    "sort": (lambda: Fn(lambda m, x: torch.sort(x, dim=1, descending=True)), lambda: (_x(4, 8, 4),)),
    "histc": (lambda: Fn(lambda m, x: x * torch.histc(x.detach(), bins=8, min=-2.0, max=2.0).sum()),
              lambda: (_x(4, 8),)),
    # mixture-of-experts grouped matmul (handlers/grouped_mm.py): rows sorted by expert
    "transformers_grouped_mm": (lambda: Fn(lambda m, x, offs: _transformers_grouped_mm(x, m.w, offs), w=_p(4, 8, 4)),
                                lambda: (_x(8, 8), _expert_offsets())),
    "repeat_interleave": (lambda: Fn(lambda m, x: x.repeat_interleave(2, dim=1) * 2), lambda: (_x(4, 4, 4),)),
    # reductions, softmax
    "mean": (lambda: Fn(lambda m, x: x.mean(1)), lambda: (_x(4, 8, 4),)),
    "sum": (lambda: Fn(lambda m, x: x.sum(1)), lambda: (_x(4, 8, 4),)),
    "amax": (lambda: Fn(lambda m, x: x.amax(1)), lambda: (_x(4, 8, 4),)),
    "max_dim": (lambda: Fn(lambda m, x: x.max(dim=1)), lambda: (_x(4, 8, 4),)),
    "softmax": (lambda: Fn(lambda m, x: x.softmax(-1)), lambda: (_x(4, 8),)),
    "log_softmax": (lambda: Fn(lambda m, x: x.log_softmax(0)), lambda: (_x(4, 8),)),
    # views and data movement
    "detach_alias": (lambda: Fn(lambda m, x: x * x.detach()), lambda: (_x(4, 8),)),
    "cat": (lambda: Fn(lambda m, x, y: torch.cat([x, y], 1)), lambda: (_x(4, 8), _x(4, 4))),
    "clone": (lambda: Fn(lambda m, x: x.clone() * 2), lambda: (_x(4, 8),)),
    "expand_as": (lambda: Fn(lambda m, x: m.w.expand_as(x) * x, w=_p(1, 8)), lambda: (_x(4, 8),)),
    "expand": (lambda: Fn(lambda m, x: m.w.expand(4, 8) * x, w=_p(1, 8)), lambda: (_x(4, 8),)),
    "permute": (lambda: Fn(lambda m, x: x.permute(0, 2, 1) * 2), lambda: (_x(4, 8, 4),)),
    "transpose_t": (lambda: Fn(lambda m, x: x.t() * 2), lambda: (_x(4, 8),)),
    "repeat": (lambda: Fn(lambda m, x: x.repeat(1, 2)), lambda: (_x(4, 8),)),
    "view": (lambda: Fn(lambda m, x: x.view(4, 2, 4) * 2), lambda: (_x(4, 8),)),
    "select": (lambda: Fn(lambda m, x: x[:, 0] * 2), lambda: (_x(4, 8, 4),)),
    "slice": (lambda: Fn(lambda m, x: x[:, 2:6] * 2), lambda: (_x(4, 8),)),
    "split": (lambda: Fn(lambda m, x: torch.split(x, 4, dim=1)), lambda: (_x(4, 8),)),
    "stack": (lambda: Fn(lambda m, x, y: torch.stack([x, y])), lambda: (_x(4, 8), _x(4, 8))),
    "unbind": (lambda: Fn(lambda m, x: x.unbind(0)), lambda: (_x(4, 8),)),
    "view_as": (lambda: Fn(lambda m, x, y: x.view_as(y) * y), lambda: (_x(4, 8), _x(32))),
}


def build_case(name: str) -> tuple[nn.Module, tuple]:
    """The case's module and inputs, identical on every rank."""
    make_module, make_inputs = CASES[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    return make_module(), make_inputs()
