"""Pointwise, dropout, reduction and softmax handlers: rules, and every strategy simulated."""
from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
from torch import nn

from autoshard.capture import CapturedGraph, capture
from autoshard.enumerate import UnsupportedOpError, node_strategies
from autoshard.handlers import REGISTRY, handler_for
from autoshard.handlers.pointwise import broadcast_rules
from autoshard.hardware import load_hardware
from autoshard.mesh import MeshSpec
from autoshard.models import build_model
from autoshard.opinfo import OpInfo
from autoshard.strategy import FWD, PARTIAL, AxisOption
from handler_utils import MESHES, case_exporter, check_all_strategies, export_nodes, find_node

aten = torch.ops.aten
HW = load_hardware("h100-nvlink")
OUR_FAMILIES = {"pointwise", "reduction", "softmax", "norm"}


class Fn(nn.Module):
    """A module whose forward is ``fn(*inputs)``: puts exactly the ops of ``fn`` in the graph."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _x(*shape, positive: bool = False, grad: bool = True) -> torch.Tensor:
    t = torch.rand(shape) + 0.5 if positive else torch.randn(shape)
    return t.requires_grad_(grad)


def _mask(*shape) -> torch.Tensor:
    return torch.rand(*shape) > 0.5


X = (4, 8, 4)

# id -> (aten target, fn, input factory). Shapes divide the 2x2/1x4/4x1 meshes where they may be
# sharded; broadcast operands (size-1 or missing dims, 0-dim tensors) and non-default arguments are
# mixed in. Every registered pointwise op is also checked on same-shape operands with default
# arguments by the generated cases (test_handlers_generated.py): only what those do not cover is here.
POINTWISE_CASES: dict[str, tuple] = {
    "add_bcast": (aten.add.Tensor, lambda x, y: x + y, lambda: (_x(*X), _x(8, 1))),
    "sub_alpha": (aten.sub.Tensor, lambda x, y: torch.sub(x, y, alpha=2), lambda: (_x(*X), _x(4))),
    "mul_0dim": (aten.mul.Tensor, lambda x, s: x * s, lambda: (_x(*X), _x())),
    "div_bcast": (aten.div.Tensor, lambda x, y: x / y, lambda: (_x(*X), _x(4, 1, 4, positive=True))),
    "div_floor": (aten.div.Tensor_mode, lambda x, y: torch.div(x, y, rounding_mode="floor"),
                  lambda: (_x(*X), _x(8, 4, positive=True))),
    "pow_tensor": (aten.pow.Tensor_Tensor, lambda x, y: x ** y,
                   lambda: (_x(*X, positive=True), _x(4))),
    "gelu_tanh": (aten.gelu.default, lambda x: nn.functional.gelu(x, approximate="tanh"), lambda: (_x(*X),)),
    "clamp_tensor": (aten.clamp.Tensor, lambda x, lo, hi: x.clamp(lo, hi),
                     lambda: (_x(*X), _x(4) - 1, _x(8, 4) + 1)),
    "where": (aten.where.self, torch.where, lambda: (_mask(*X), _x(*X), _x(4))),
    "masked_fill": (aten.masked_fill.Scalar, lambda x, m: x.masked_fill(m, 1.0),
                    lambda: (_x(*X), _mask(8, 1))),
    "masked_fill_tensor": (aten.masked_fill.Tensor, lambda x, m, v: x.masked_fill(m, v),
                           lambda: (_x(*X), _mask(4, 1, 4), _x())),
    "maximum": (aten.maximum.default, torch.maximum, lambda: (_x(*X), _x(8, 4))),
    "minimum": (aten.minimum.default, torch.minimum, lambda: (_x(*X), _x(4, 1, 1))),
    "addcmul": (aten.addcmul.default, lambda x, a, b: torch.addcmul(x, a, b, value=0.5),
                lambda: (_x(*X), _x(4), _x(8, 1))),
    "lerp": (aten.lerp.Tensor, torch.lerp, lambda: (_x(*X), _x(8, 4), _x(4).detach().sigmoid())),
    "dropout_eval": (aten.dropout.default, lambda x: nn.functional.dropout(x, 0.5, False), lambda: (_x(*X),)),
}


@pytest.fixture(scope="module")
def exported():
    return case_exporter(Fn)


@pytest.mark.parametrize("case", list(POINTWISE_CASES))
def test_pointwise_every_strategy_simulates(exported, case):
    graph, values, node = exported(POINTWISE_CASES, case)
    for mesh in MESHES:
        strategies = check_all_strategies(graph, node, values, mesh)
        out = strategies[0].output_specs[0]
        # every output dim can be sharded (all divide by 4 here), alone or over both axes
        sharded = {d for s in strategies for d in range(out.ndim) if s.output_specs[0].dims[d]}
        assert sharded == set(range(out.ndim)), f"{case} on {mesh}: sharded dims {sharded}"


def test_broadcast_rules_follow_right_aligned_non_broadcast_dims():
    graph, _ = export_nodes(Fn(lambda x, y, s: torch.where(x > 0, x * y, s)),
                            (_x(4, 8, 4), _x(8, 1), torch.tensor(0.5)))
    mul = OpInfo(find_node(graph, aten.mul.Tensor), graph, MeshSpec((2, 2)))
    assert broadcast_rules(mul) == [AxisOption((0, None), (0,), "d0"), AxisOption((1, 0), (1,), "d1"),
                                    AxisOption((2, None), (2,), "d2")]
    where = OpInfo(find_node(graph, aten.where.self), graph, MeshSpec((2, 2)))
    assert [o.inputs for o in broadcast_rules(where)] == [(d, d, None) for d in range(3)]


def test_broadcast_operand_gradient_is_all_reduced():
    graph, values = export_nodes(Fn(lambda x, y: x * y), (_x(4, 8), _x(1, 8)))
    ns = node_strategies(graph, find_node(graph, aten.mul.Tensor), MeshSpec((2, 2)), HW)
    s = ns.by_name("S01R = S01R, RR")
    assert [(c.phase, c.operand, c.axes) for c in s.comm] == [("bwd", "in1", (0, 1))]
    assert not ns.by_name("RS01 = RS01, RS01").comm


def test_dropout_with_p_offers_the_pointwise_options():
    graph, _ = export_nodes(Fn(lambda x: nn.functional.dropout(x, 0.5, True)), (_x(*X),))
    ns = node_strategies(graph, find_node(graph, aten.dropout.default), MeshSpec((2, 2)), HW)
    relu_graph, _ = export_nodes(Fn(torch.relu), (_x(*X),))
    relu = node_strategies(relu_graph, find_node(relu_graph, aten.relu.default), MeshSpec((2, 2)), HW)
    assert sorted(ns.names()) == sorted(relu.names()) and len(ns) == 16


def test_inplace_counter_add_is_replicated_and_updates_the_buffer():
    graph, values = export_nodes(nn.BatchNorm1d(4), (_x(8, 4),))
    node = find_node(graph, aten.add_.Tensor)
    for mesh in MESHES:
        (only,) = check_all_strategies(graph, node, values, mesh)
        assert only.input_specs[0].is_replicated() and not only.comm


def test_inplace_add_on_an_activation_is_refused():
    def fn(a, b):
        x = a * 2
        x.add_(b)
        return x

    # capture makes this add_ out-of-place (tests/test_capture_functional.py); the handler's
    # refusal is checked on the graph as torch.export gives it
    module, args = Fn(fn), (_x(4, 4, grad=False), _x(4, 4, grad=False))
    graph = CapturedGraph(torch.export.export(module, args, strict=False), module, args)
    with pytest.raises(UnsupportedOpError, match="out-of-place"):
        node_strategies(graph, find_node(graph, aten.add_.Tensor), MeshSpec((2, 2)), HW)


# -- reductions and softmax ------------------------------------------------------------------------

# id -> (target, fn, inputs, sum-decomposable: offers partial outputs)
REDUCTION_CASES: dict[str, tuple] = {
    "sum_dim": (aten.sum.dim_IntList, lambda x: x.sum(1), lambda: (_x(*X),), True),
    "sum_dims_keep": (aten.sum.dim_IntList, lambda x: x.sum((0, 2), keepdim=True), lambda: (_x(*X),), True),
    "sum_dim_none": (aten.sum.dim_IntList, lambda x: aten.sum.dim_IntList(x, None), lambda: (_x(*X),), True),
    "sum_all_dtype": (aten.sum.default, lambda x: x.sum(dtype=torch.float64), lambda: (_x(*X),), True),
    "mean_last_keep": (aten.mean.dim, lambda x: x.mean(-1, keepdim=True), lambda: (_x(*X),), True),
    "mean_dims": (aten.mean.dim, lambda x: x.mean((0, 1)), lambda: (_x(*X),), True),
    "mean_all": (aten.mean.default, torch.mean, lambda: (_x(*X),), True),
    "amax": (aten.amax.default, lambda x: x.amax(1), lambda: (_x(*X),), False),
    "amin_keep": (aten.amin.default, lambda x: x.amin((0, 2), keepdim=True), lambda: (_x(*X),), False),
    "max_dim": (aten.max.dim, lambda x: x.max(1)[0], lambda: (_x(*X),), False),
    "min_dim_keep": (aten.min.dim, lambda x: x.min(2, keepdim=True)[0], lambda: (_x(*X),), False),
    "max_all": (aten.max.default, torch.max, lambda: (_x(*X),), False),
    "var_dim": (aten.var.dim, lambda x: x.var(1), lambda: (_x(*X),), False),
    "var_correction": (aten.var.correction, lambda x: torch.var(x, 0, correction=0), lambda: (_x(*X),), False),
    "std_keep": (aten.std.dim, lambda x: x.std(2, keepdim=True), lambda: (_x(*X),), False),
    "prod": (aten.prod.dim_int, lambda x: x.prod(1), lambda: (_x(*X, positive=True),), False),
    "norm": (aten.linalg_vector_norm.default, lambda x: x.norm(dim=2), lambda: (_x(*X),), False),
    "logsumexp": (aten.logsumexp.default, lambda x: x.logsumexp(1), lambda: (_x(*X),), False),
    "argmax": (aten.argmax.default, lambda x: x.argmax(1), lambda: (_x(*X),), False),
    "argmax_flat": (aten.argmax.default, torch.argmax, lambda: (_x(*X),), False),
}


@pytest.mark.parametrize("case", list(REDUCTION_CASES))
def test_reduction_every_strategy_simulates(exported, case):
    graph, values, node = exported(REDUCTION_CASES, case)
    linear = REDUCTION_CASES[case][3]
    for mesh in MESHES:
        strategies = check_all_strategies(graph, node, values, mesh)
        partial = [s for s in strategies if any(c.phase == FWD and c.operand == "out0" for c in s.comm)]
        assert bool(partial) == linear, f"{case} on {mesh}: partial strategies {[s.name for s in partial]}"
    op = OpInfo(node, graph, MeshSpec((2, 2)))
    options = REGISTRY[node.target].rules(op)
    assert all(isinstance(d, int) for o in options for d in o.inputs)
    assert any(PARTIAL in o.outputs for o in options) == linear


def test_reduction_keeps_dims_and_partial_is_replicated_on_its_axis(exported):
    graph, _, node = exported(REDUCTION_CASES, "mean_last_keep")
    ns = node_strategies(graph, node, MeshSpec((2, 2)), HW)
    # batch on axis 0, reduced dim on axis 1: output S0RR, forward all-reduce over axis 1
    s = ns.by_name("S0RR+P1 = S0RS1")        # the name marks the pending sum
    assert [(c.phase, c.operand, c.axes) for c in s.comm] == [("fwd", "out0", (1,))]
    graph, _, node = exported(REDUCTION_CASES, "sum_dim")
    names = node_strategies(graph, node, MeshSpec((2, 2)), HW).names()
    assert "S0S1 = S0RS1" in names and "RR+P01 = RS01R" in names


SOFTMAX_CASES: dict[str, tuple] = {
    "softmax": (aten.softmax.int, lambda x: x.softmax(-1), lambda: (_x(*X),)),
    "log_softmax": (aten.log_softmax.int, lambda x: x.log_softmax(1), lambda: (_x(*X),)),
    "_softmax": (aten._softmax.default, lambda x: aten._softmax(x, 0, False), lambda: (_x(*X),)),
    "_log_softmax": (aten._log_softmax.default, lambda x: aten._log_softmax(x, 2, False), lambda: (_x(*X),)),
    "_safe_softmax": (aten._safe_softmax.default, lambda x: aten._safe_softmax(x, -1), lambda: (_x(*X),)),
}


@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
def test_softmax_every_strategy_simulates(exported, case):
    graph, values, node = exported(SOFTMAX_CASES, case)
    dim = node.args[1] % 3
    for mesh in MESHES:
        strategies = check_all_strategies(graph, node, values, mesh)
        assert all(not s.input_specs[0].dims[dim] for s in strategies)
        sharded = {d for s in strategies for d in range(3) if s.input_specs[0].dims[d]}
        assert sharded == set(range(3)) - {dim}


# -- whole models ----------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["mlp", "cnn", "gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_every_node_of_these_families_has_sharded_strategies(preset):
    model, args, kwargs = build_model(preset)
    graph = capture(model, args, kwargs)
    mesh = MeshSpec((2, 2))
    seen = 0
    for node in graph.nodes():
        handler = handler_for(node.target)
        if handler is None or handler.family not in OUR_FAMILIES:
            continue
        seen += 1
        ns = node_strategies(graph, node, mesh, HW)
        assert len(ns) >= 1
        if node.target is not aten.add_.Tensor:   # the step counter is replicate-only by design
            assert any(not s.output_spec.is_replicated() for s in ns), f"{preset}: {node.name} replicated only"
    assert seen > 0


def test_coordinated_random_keeps_this_devices_block_of_the_single_device_draw():
    """rand/randn sharded: every device draws the whole tensor as one device would and keeps its
    block, so a seeded sharded run sees the single-device numbers."""
    from autoshard.handlers.factory import coordinated_random

    class Comm:
        mesh_shape = (2, 2)

        def __init__(self, coord):
            self.coord = coord

        def shard_index(self, axes):
            index = 0
            for a in axes:
                index = index * self.mesh_shape[a] + self.coord[a]
            return index

        def shard_count(self, axes):
            return math.prod(self.mesh_shape[a] for a in axes)

    torch.manual_seed(3)
    whole = torch.ops.aten.rand.default([4, 6])
    for coord in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        torch.manual_seed(3)
        block = coordinated_random(torch.ops.aten.rand.default, ([4, 6],), {}, dims=((0,), (1,)), comm=Comm(coord))
        assert torch.equal(block, whole.chunk(2, 0)[coord[0]].chunk(2, 1)[coord[1]])
    assert torch.ops.aten.rand.default in REGISTRY and torch.ops.aten.randn.default in REGISTRY
