"""AutoChunk: exact chunked inference under a memory budget, measured on CPU."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoshard.autochunk import MIN_LOOP_BYTES, AutoChunkError, autochunk, measure_peak_memory
from autoshard.autochunk.flow import NotFree
from autoshard.autochunk.rules import backward, reshape_dim_map

MiB = 2**20


class Attention(nn.Module):
    """Pre-norm multi-head self-attention written out (scores are a [B, H, T, T] tensor)."""

    def __init__(self, d: int = 32, heads: int = 2, causal_len: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.causal = causal_len is not None
        if self.causal:
            self.register_buffer("keep", torch.tril(torch.ones(causal_len, causal_len, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        if self.causal:
            scores = scores.masked_fill(~self.keep, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return x + self.out(y)


class WideMLP(nn.Module):
    def __init__(self, d: int = 32, mult: int = 64) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, d * mult)
        self.down = nn.Linear(d * mult, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class GlobalSoftmax(nn.Module):
    """Softmax over every score at once: no dim of the score matrix is free."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        s = q @ k.t()
        return s.flatten().softmax(0).view_as(s) @ k


class SDPABlock(nn.Module):
    def __init__(self, d: int = 32, heads: int = 2, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        if self.causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _run(model: nn.Module, *args: torch.Tensor) -> tuple[torch.Tensor, int]:
    with torch.no_grad():
        out, mem = measure_peak_memory(model, *args)
    return out, mem.peak


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# --- the peak tracker -------------------------------------------------------------------------


def test_peak_tracker_sees_alloc_and_free_order() -> None:
    def fn() -> torch.Tensor:
        a = torch.empty(MiB, dtype=torch.uint8)
        del a
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        c = torch.empty(MiB, dtype=torch.uint8)
        del c
        return b

    out, mem = measure_peak_memory(fn)
    assert mem.peak == 3 * MiB  # b and c together, a was freed before
    assert mem.retained == 2 * MiB == out.numel()


def test_peak_tracker_chain_of_ops() -> None:
    x = torch.randn(256, 1024)  # 1 MiB

    def chain(x: torch.Tensor) -> torch.Tensor:
        a = x + x
        b = a + a  # a and b live together
        del a
        return b + b  # b and the result live together

    _, mem = measure_peak_memory(chain, x)
    assert mem.peak == 2 * MiB
    assert mem.retained == MiB


# --- chunking ---------------------------------------------------------------------------------


def test_attention_budget_is_met_and_outputs_match() -> None:
    model = Attention(d=32, heads=2).eval()
    x = torch.randn(2, 512, 32)
    ref, eager_peak = _run(model, x)
    budget = MiB
    chunked = autochunk(model, (x,), max_memory=budget)
    out, peak = _run(chunked, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert peak <= budget < eager_peak / 8
    assert re.search(r"for chunk_start in range\(0, 512, \d+\):", chunked.code)
    assert ".narrow(2, chunk_start, chunk_len)" in chunked.code  # query rows of q
    loop = chunked.report.loops[0]
    assert loop.dim_size == 512 and 1 < loop.chunk < 512
    # the estimate the plan is built on is the memory the code really takes
    assert abs(peak - chunked.report.estimated_peak_after) <= 4096


def test_wide_mlp_chunks_tokens_through_both_projections() -> None:
    model = WideMLP(d=32, mult=64).eval()  # hidden 2048: [2, 512, 2048] = 8 MiB per activation
    x = torch.randn(2, 512, 32)
    ref, eager_peak = _run(model, x)
    chunked = autochunk(model, (x,), max_memory="2MiB")
    out, peak = _run(chunked, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert peak <= 2 * MiB and eager_peak >= 16 * MiB
    (loop,) = chunked.report.loops
    assert loop.dim_size == 512  # tokens, not the hidden dim the down projection reduces
    body = chunked.code.split("for chunk_start")[1]
    assert "linear.default(layer_norm_c" in body and "gelu.default(linear_c)" in body
    assert "linear.default(gelu_c, p_down_weight" in body


def test_two_layers_get_one_loop_each() -> None:
    model = nn.Sequential(Attention(32, 2), Attention(32, 2)).eval()
    x = torch.randn(1, 512, 32)
    ref, _ = _run(model, x)
    chunked = autochunk(model, (x,), max_memory="600KiB")
    out, peak = _run(chunked, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert peak <= 600 * 1024
    assert len(chunked.report.loops) == 2
    assert chunked.code.count("for chunk_start in range") == 2


def test_default_budget_goes_near_the_lowest_peak() -> None:
    model = Attention(d=32, heads=2).eval()
    x = torch.randn(1, 512, 32)
    ref, eager_peak = _run(model, x)
    chunked = autochunk(model, (x,))  # max_memory=None, slack 0.25
    out, peak = _run(chunked, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    rep = chunked.report
    # lowest reachable + 25% slack, plus at most one MIN_LOOP_BYTES working set per loop
    assert rep.lowest_peak is not None
    assert rep.estimated_peak_after <= 1.25 * rep.lowest_peak + MIN_LOOP_BYTES
    assert abs(peak - rep.estimated_peak_after) <= 4096
    assert peak < eager_peak / 5
    assert rep.loops[0].chunk > 1  # chunks longer than one row


def test_causal_mask_buffer_is_sliced_per_chunk() -> None:
    model = Attention(d=32, heads=2, causal_len=512).eval()
    x = torch.randn(1, 512, 32)
    ref, _ = _run(model, x)
    chunked = autochunk(model, (x,), max_memory="1MiB")
    out, peak = _run(chunked, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert peak <= MiB
    # the [T, T] mask buffer carries the query dim as its dim 0: read one block of rows per chunk
    assert "b_keep_c = b_keep.narrow(0, chunk_start, chunk_len)" in chunked.code


def test_core_aten_graph_with_sdpa_decomposition() -> None:
    model = SDPABlock(32, 2).eval()
    x, mask = torch.randn(1, 256, 32), torch.randn(1, 1, 256, 256)
    ref, _ = _run(model, x, mask)
    chunked = autochunk(model, (x, mask), max_memory="400KiB", core_aten=True)
    out, peak = _run(chunked, x, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert peak <= 400 * 1024
    assert "torch.ops.aten.bmm.default" in chunked.code and "for chunk_start" in chunked.code
    assert "mask_c = mask.narrow(2, chunk_start, chunk_len)" in chunked.code


def test_impossible_budget_reports_the_lowest_reachable_peak() -> None:
    model = Attention(d=32, heads=2).eval()
    x = torch.randn(1, 512, 32)
    with pytest.raises(AutoChunkError, match="lowest this planner reaches") as err:
        autochunk(model, (x,), max_memory="64KiB")
    need = int(re.search(r"at least (\d+) bytes", str(err.value)).group(1))
    assert need > 64 * 1024
    chunked = autochunk(model, (x,), max_memory=need)  # the number in the message is reachable
    assert chunked.report.estimated_peak_after <= need


def test_model_without_free_dim() -> None:
    model = GlobalSoftmax().eval()
    q, k = torch.randn(512, 16), torch.randn(512, 16)
    ref, _ = _run(model, q, k)
    plain = autochunk(model, (q, k))  # no budget: returned without loops, report says why
    out, _ = _run(plain, q, k)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert not plain.report.loops and "for " not in plain.code
    assert "no free dim" in plain.report.notes[0] and "softmax" in plain.report.notes[0]
    with pytest.raises(AutoChunkError, match=r"no free dim.*aten\.softmax\.int"):
        autochunk(model, (q, k), max_memory="256KiB")


def test_tiny_model_without_budget_is_left_alone() -> None:
    model = Attention(8, 2).eval()
    x = torch.randn(1, 16, 8)
    chunked = autochunk(model, (x,))
    assert not chunked.report.loops and "less than" in chunked.report.notes[0]
    torch.testing.assert_close(chunked(x), model(x), atol=1e-5, rtol=0)


def test_budget_already_met_keeps_graph_unchunked() -> None:
    model = Attention(32, 2).eval()
    x = torch.randn(1, 128, 32)
    chunked = autochunk(model, (x,), max_memory="1GiB")
    assert not chunked.report.loops and "already fits" in chunked.report.notes[0]
    torch.testing.assert_close(chunked(x), model(x), atol=1e-5, rtol=0)


def test_wrong_inputs_and_training_mode_are_rejected() -> None:
    model = Attention(32, 2).eval()
    chunked = autochunk(model, (torch.randn(1, 128, 32),), max_memory="100KiB")
    with pytest.raises(AutoChunkError, match="differ from the example"):
        chunked(torch.randn(1, 64, 32))
    with pytest.raises(AutoChunkError, match="eval"):
        autochunk(Attention(32, 2).train(), (torch.randn(1, 64, 32),))


def test_parameters_stay_shared_with_the_model() -> None:
    model = WideMLP(16, 8).eval()
    x = torch.randn(1, 64, 16)
    chunked = autochunk(model, (x,), max_memory="20KiB")
    with torch.no_grad():
        model.down.bias.add_(1.0)
    torch.testing.assert_close(chunked(x), model(x), atol=1e-5, rtol=0)


# --- dim-flow rules ---------------------------------------------------------------------------


def _node(model: nn.Module, args: tuple, target: object) -> torch.fx.Node:
    ep = torch.export.export(model, args)
    return next(n for n in ep.graph.nodes if n.target is target)


def test_sdpa_rule_query_dim_free_unless_causal() -> None:
    x, mask = torch.randn(1, 64, 32), torch.randn(1, 1, 64, 64)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    node = _node(SDPABlock(32, 2).eval(), (x, mask), sdpa)
    q, k, v, m = node.args[:4]
    assert backward(node, 2, 64).inputs == {q: 2, k: None, v: None, m: 2}
    with pytest.raises(NotFree, match="head dim"):
        backward(node, 3, 16)
    causal = _node(SDPABlock(32, 2, causal=True).eval(), (x, mask), sdpa)
    with pytest.raises(NotFree, match="causal"):
        backward(causal, 2, 64)
    assert backward(causal, 1, 2).inputs[causal.args[1]] == 1  # heads stay free


def test_softmax_and_linear_rules() -> None:
    model = WideMLP(8, 4).eval()
    x = torch.randn(2, 16, 8)
    lin = [n for n in torch.export.export(model, (x,)).graph.nodes
           if n.target is torch.ops.aten.linear.default]
    up, down = lin
    assert backward(up, 1, 16).inputs == {up.args[0]: 1, up.args[1]: None, up.args[2]: None}
    assert backward(up, 2, 32).inputs == {up.args[0]: None, up.args[1]: 0, up.args[2]: 0}
    # the down projection's input hidden dim is contracted: no output dim maps to it
    assert all(backward(down, d, s).inputs[down.args[0]] != 2 for d, s in ((0, 2), (1, 16)))
    sm = _node(Attention(8, 2).eval(), (torch.randn(1, 16, 8),), torch.ops.aten.softmax.int)
    assert backward(sm, 2, 16).inputs == {sm.args[0]: 2}
    with pytest.raises(NotFree, match="mixes positions"):
        backward(sm, 3, 16)


def test_reshape_dim_map() -> None:
    assert reshape_dim_map((1, 512, 32), (1, 512, 2, 16)) == {1: 1}
    assert reshape_dim_map((1, 2, 512, 16), (2, 512, 16)) == {0: 1, 1: 2, 2: 3}
    assert reshape_dim_map((2, 512, 32), (1024, 32)) == {1: 2}
