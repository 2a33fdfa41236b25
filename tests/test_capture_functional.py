"""Capture makes in-place ops on intermediate values out-of-place (functionalize_inplace), and
refuses, by name, the in-place ops it cannot rewrite exactly."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autoshard.capture import INPLACE_REFUSAL, capture
from autoshard.enumerate import UnsupportedOpError, enumerate_strategies
from handler_utils import Fn
from inplace_models import ResidualBlock

aten = torch.ops.aten


class MaskedFill(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        scores.masked_fill_(mask, -1e4)
        return scores.softmax(-1)


def _inplace_targets(graph) -> list[str]:
    return [str(n.target) for n in graph.nodes() if n.target._schema.is_mutable]


def _run(graph, *args):
    return graph.exported.module()(*args)


def test_residual_block_inplace_adds_become_out_of_place_and_compute_the_same():
    torch.manual_seed(0)
    model, x = ResidualBlock(halve_inplace=True), torch.randn(4, 4, 6, 6)
    graph = capture(model, (x,))
    # only BatchNorm's step counters stay in place (buffer mutations keep their own path)
    assert _inplace_targets(graph) == ["aten.add_.Tensor"] * 2
    assert all(graph.is_buffer(n.args[0]) for n in graph.nodes() if n.target == aten.add_.Tensor)
    ops = set(graph.summary())
    assert {"aten.add.Tensor", "aten.relu.default", "aten.div.Tensor"} <= ops
    ref = ResidualBlock(halve_inplace=True)
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(_run(graph, x), ref(x), rtol=0, atol=0)
    enumerate_strategies(graph)        # every node has a handler


def test_masked_fill_inplace_becomes_masked_fill_and_outputs_are_renamed():
    torch.manual_seed(0)
    model, x, mask = MaskedFill(), torch.randn(2, 4, 8), torch.rand(2, 4, 4) > 0.5
    graph = capture(model, (x, mask))
    assert _inplace_targets(graph) == []
    assert "aten.masked_fill.Scalar" in graph.summary()
    torch.testing.assert_close(_run(graph, x, mask), model(x, mask), rtol=0, atol=0)
    out = graph.exported.graph_signature.output_specs[0].arg.name
    assert out in graph.outputs and graph.node(out).op == "call_function"


def test_mutated_value_used_before_the_mutation_keeps_its_old_value():
    def fn(m, x):
        y = x * 2
        before = y * 3               # reads y before the add_
        y.add_(1.0)
        return before + y

    x = torch.randn(4, 8)
    graph = capture(Fn(fn), (x,))
    assert _inplace_targets(graph) == []
    torch.testing.assert_close(_run(graph, x), fn(None, x))


def test_copy_into_a_fresh_value_becomes_differentiable_ops():
    def fn(m, x, y):
        buf = torch.empty(4, 8, dtype=torch.float64, device=x.device)
        buf.copy_(y)                 # broadcast and cast: aten.copy has no autograd formula
        return (buf * x).float()

    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    graph = capture(Fn(fn), (x, y))
    assert _inplace_targets(graph) == [] and "aten.copy.default" not in graph.summary()
    got = _run(graph, x, y)
    torch.testing.assert_close(got, fn(None, x, y))
    (gy,) = torch.autograd.grad(got.sum(), [y])
    torch.testing.assert_close(gy, x.sum(0).detach())


def test_writes_into_views_are_scattered_back_into_their_base():
    """Hugging Face's shift_tokens_right (encoder-decoders), and a float version with gradients."""
    def shift(m, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 7
        shifted.masked_fill_(shifted == 3, 0)
        return shifted

    def write(m, x, v):
        y = x * 2
        y[:, 1:3] = v                      # slice + copy_ (broadcast v)
        y.view(4, 2, 4)[:, 0].mul_(0.5)    # view -> select -> mul_
        y.t()[0].add_(1.0)                 # t -> select -> add_
        y.unsqueeze(0).permute(2, 0, 1)[1:3].sub_(1.0)   # unsqueeze -> permute -> slice -> sub_
        return y * x

    ids = torch.randint(0, 5, (4, 8))
    graph = capture(Fn(shift), (ids,))
    assert _inplace_targets(graph) == []
    assert {"aten.slice_scatter.default", "aten.select_scatter.default"} <= set(graph.summary())
    assert torch.equal(_run(graph, ids), shift(None, ids))
    enumerate_strategies(graph)

    x, v = torch.randn(4, 8, requires_grad=True), torch.randn(2, requires_grad=True)
    graph = capture(Fn(write), (x, v))
    assert _inplace_targets(graph) == []
    got, want = _run(graph, x, v), write(None, x, v)
    torch.testing.assert_close(got, want)
    w = torch.randn(4, 8)
    torch.testing.assert_close(torch.autograd.grad((got * w).sum(), [x, v]),
                               torch.autograd.grad((want * w).sum(), [x, v]))
    enumerate_strategies(graph)


@pytest.mark.parametrize("case", ["unbind_piece", "split_piece", "late_view", "late_view_of_view_write", "user_input", "promotes"])
def test_inplace_ops_that_cannot_be_rewritten_are_refused_by_name_even_with_fallback(case):
    def unbind_piece(m, x):
        y = x * 2
        y.unbind(0)[1].add_(1.0)     # no inverse for unbind here: the base would change too
        return y

    def split_piece(m, x):
        y = x * 2
        a, b = y.split(4, dim=1)
        a.mul_(3.0)
        return y

    def late_view(m, x):
        y = x * 2
        v = y.view(-1)
        y.add_(1.0)
        return v * 2                 # the view sees the mutation

    def late_view_of_view_write(m, x):
        y = x * 2
        v = y.view(-1)
        y[:, 0] = 1.0                # select + fill_: y's storage, which v shares, changes
        return v * 2

    def user_input(m, x):
        x.mul_(2.0)
        return x * 1.0

    def promotes(m, x):
        h = (x * 2).to(torch.float16)
        h.add_(x)                    # stays float16; add() would give float32
        return h.float()

    fn = {"unbind_piece": unbind_piece, "split_piece": split_piece, "late_view": late_view,
          "late_view_of_view_write": late_view_of_view_write, "user_input": user_input,
          "promotes": promotes}[case]
    x = torch.randn(4, 8)
    graph = capture(Fn(fn), (x,))
    refused = [n for n in graph.nodes() if INPLACE_REFUSAL in n.meta]
    assert refused, graph.graph
    node = refused[0]
    for fallback in ("error", "replicate"):
        with pytest.raises(UnsupportedOpError, match=f"node '{node.name}'.*out-of-place"):
            enumerate_strategies(graph, fallback=fallback)
