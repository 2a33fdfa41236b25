"""The op profiler (FLOPs and saved tensors measured on meta tensors) on in-place ops."""
from __future__ import annotations

import torch
from torch import nn

from autoshard.capture import CapturedGraph
from autoshard.mesh import MeshSpec
from autoshard.opinfo import OpInfo, clear_profile_cache
from handler_utils import Fn, find_node

aten = torch.ops.aten


def _graph(fn, *inputs) -> CapturedGraph:
    """The export as it comes (not functionalized): in-place ops stay in the graph."""
    module = Fn(fn)
    return CapturedGraph(torch.export.export(module, inputs, strict=False), module, inputs)


def _profile(graph: CapturedGraph, target):
    return OpInfo(find_node(graph, target), graph, MeshSpec((2, 2))).profile()


def test_inplace_op_on_an_operand_that_requires_grad_is_profiled_like_its_out_of_place_twin():
    clear_profile_cache()
    x = torch.randn(4, 8, requires_grad=True)
    a, b = torch.randn(4, 6, requires_grad=True), torch.randn(6, 8, requires_grad=True)

    def inplace(m, x, a, b):
        y = x * 2
        y.masked_fill_(x > 0, 0.0)
        z = x * 3
        z.addmm_(a, b)
        return y + z

    def out_of_place(m, x, a, b):
        return (x * 2).masked_fill(x > 0, 0.0) + torch.addmm(x * 3, a, b)

    g_in, g_out = _graph(inplace, x, a, b), _graph(out_of_place, x, a, b)
    fill_in, fill_out = _profile(g_in, aten.masked_fill_.Scalar), _profile(g_out, aten.masked_fill.Scalar)
    assert fill_in == fill_out
    mm_in, mm_out = _profile(g_in, aten.addmm_.default), _profile(g_out, aten.addmm.default)
    # backward: grads of a and of b (the mutated operand's is the identity, no FLOPs), and the
    # same tensors saved. (torch's FLOP counter has no formula for addmm_'s forward; capture
    # functionalizes in-place ops, so the planner prices addmm.)
    assert mm_in.bwd_flops == mm_out.bwd_flops == 2 * (2 * 4 * 6 * 8)
    assert mm_in.saved == mm_out.saved
