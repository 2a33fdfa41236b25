"""Handlers for topk/sort, histc, repeat_interleave, min/max.other, floor_divide, copy/fill and
slice_scatter/select_scatter: rules, and
every strategy simulated on real values (2x2, 1x4, 4x1 meshes)."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from autoshard.enumerate import node_strategies
from autoshard.hardware import load_hardware
from autoshard.mesh import MeshSpec
from autoshard.strategy import FWD
from handler_utils import Fn, MESHES, case_exporter, check_all_strategies, export_nodes, find_node

aten = torch.ops.aten
HW = load_hardware("h100-nvlink")


def _x(*shape, grad: bool = True) -> torch.Tensor:
    return torch.randn(shape).requires_grad_(grad)


def _sharded_dims(strategies, j: int = 0, side: str = "out") -> set[int]:
    specs = [s.output_specs[j] if side == "out" else s.input_specs[j] for s in strategies]
    return {d for spec in specs for d in range(spec.ndim) if spec.dims[d]}


# id -> (target, fn, inputs, dims of input 0 that must be sharded by some strategy)
CASES: dict[str, tuple] = {
    "min_other": (aten.min.other, lambda m, x, y: torch.min(x, y), lambda: (_x(4, 8, 4), _x(8, 4)), {0, 1, 2}),
    "max_other_bcast": (aten.max.other, lambda m, x, y: torch.max(x, y), lambda: (_x(4, 8, 4), _x(4, 1, 4)),
                        {0, 1, 2}),
    "floor_divide": (aten.floor_divide.default, lambda m, x, y: torch.floor_divide(x, y),
                     lambda: (_x(4, 8, grad=False) * 10, _x(8, grad=False).abs() + 0.5), {0, 1}),
    "floor_divide_int": (aten.floor_divide.default, lambda m, i: torch.floor_divide(i, 3),
                         lambda: (torch.randint(0, 50, (4, 8)),), {0, 1}),
    # aten.copy has no autograd formula (capture writes copy_ with differentiable ops instead)
    "copy_bcast": (aten.copy.default, lambda m, x, y: aten.copy.default(x * 2, y),
                   lambda: (_x(4, 8, 4, grad=False), _x(8, 1, grad=False)), {0, 1, 2}),
    "fill": (aten.fill.Tensor, lambda m, x, v: aten.fill.Tensor(x * 2, v),
             lambda: (_x(4, 8, grad=False), _x(grad=False)), {0, 1}),
    "slice_scatter": (aten.slice_scatter.default,
                      lambda m, x, v: aten.slice_scatter.default(x, v, 1, 2, 6),
                      lambda: (_x(4, 8, 4), _x(4, 4, 4)), {0, 2}),
    "select_scatter": (aten.select_scatter.default,
                       lambda m, x, v: aten.select_scatter.default(x, v, 2, 1),
                       lambda: (_x(4, 8, 4), _x(4, 8)), {0, 1}),
    "index_put_mask": (aten.index_put.default,
                       lambda m, x, i, v: aten.index_put.default(x * 1.0, [i], v),
                       lambda: (_x(4, 8, 4), torch.rand(4, 8) > 0.5, _x(4)), {2}),
    "index_put_accumulate": (aten.index_put.default,
                             lambda m, x, i, v: aten.index_put.default(x * 1.0, [i], v, True),
                             lambda: (_x(8, 4, 8), torch.tensor([1, 3, 1, 6]), _x(4, 4, 8)), {1, 2}),
    "topk_last": (aten.topk.default, lambda m, x: torch.topk(x, 3, dim=-1), lambda: (_x(4, 8, 8),), {0, 1}),
    "topk_mid_smallest": (aten.topk.default, lambda m, x: torch.topk(x, 2, dim=1, largest=False),
                          lambda: (_x(4, 8, 4),), {0, 2}),
    "sort": (aten.sort.default, lambda m, x: torch.sort(x, dim=0, descending=True),
             lambda: (_x(8, 4, 8),), {1, 2}),
    "sort_stable": (aten.sort.stable, lambda m, x: torch.sort(x, dim=-1, stable=True),
                    lambda: (torch.randint(0, 3, (4, 8)).float().requires_grad_(),), {0}),
    "histc": (aten.histc.default, lambda m, x: torch.histc(x.detach(), bins=8, min=-2.0, max=2.0),
              lambda: (_x(4, 8, 4),), {0, 1, 2}),
    "repeat_interleave": (aten.repeat_interleave.self_int, lambda m, x: x.repeat_interleave(2, dim=1),
                          lambda: (_x(4, 8, 4),), {0, 1, 2}),
    "repeat_interleave_flat": (aten.repeat_interleave.self_int, lambda m, x: x.repeat_interleave(3),
                               lambda: (_x(8, 4),), {0}),
}


@pytest.fixture(scope="module")
def exported():
    return case_exporter()


@pytest.mark.parametrize("case", list(CASES))
def test_every_strategy_simulates(exported, case):
    graph, values, node = exported(CASES, case)
    want = CASES[case][3]
    for mesh in MESHES:
        strategies = check_all_strategies(graph, node, values, mesh)
        assert _sharded_dims(strategies, 0, "in") == want, f"{case} on {mesh}"


def test_topk_and_sort_keep_their_dim_replicated(exported):
    for case, dim in (("topk_last", 2), ("topk_mid_smallest", 1), ("sort", 0), ("sort_stable", 1)):
        graph, _, node = exported(CASES, case)
        ns = node_strategies(graph, node, MeshSpec((2, 2)), HW)
        for s in ns:
            assert not s.input_specs[0].dims[dim], f"{case}: {s.name}"
            # values and indices are laid out alike
            assert s.output_specs[0] == s.output_specs[1], f"{case}: {s.name}"
            assert not any(c.phase == FWD for c in s.comm)


def test_histc_sharded_input_gives_partial_counts_all_reduced(exported):
    graph, _, node = exported(CASES, "histc")
    ns = node_strategies(graph, node, MeshSpec((2, 2)), HW)
    sharded = [s for s in ns if not s.input_specs[0].is_replicated()]
    assert sharded
    for s in sharded:
        assert s.output_specs[0].is_replicated()
        axes = {a for c in s.comm if c.phase == FWD and c.kind == "all_reduce" and c.operand == "out0"
                for a in c.axes}
        assert axes == s.input_specs[0].used_axes(), s.name
    assert not graph.requires_grad(node)   # histc has no gradient


def test_histc_of_integers_runs_on_cpu_through_float64():
    """A meta capture may hold histc of an int tensor (transformers' MoE routing off CPU); torch's
    CPU kernel refuses ints, the local kernel counts them exactly."""
    from autoshard.handlers.sorting import histc_any_dtype

    ids = torch.randint(0, 4, (64,), dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not implemented for 'Int'"):
        torch.histc(ids, bins=4, min=0, max=3)
    got = histc_any_dtype(ids, 4, 0, 3)
    assert got.dtype == torch.int32 and got.tolist() == torch.bincount(ids, minlength=4).tolist()


def test_histc_with_data_range_is_replicate_only():
    graph, _ = export_nodes(Fn(lambda m, x: torch.histc(x.detach(), bins=4)), (_x(4, 8),))
    (only,) = node_strategies(graph, find_node(graph, aten.histc.default), MeshSpec((2, 2)), HW)
    assert only.input_specs[0].is_replicated()


def test_repeat_interleave_shards_the_repeated_dim_block_for_block(exported):
    graph, _, node = exported(CASES, "repeat_interleave")
    ns = node_strategies(graph, node, MeshSpec((2, 2)), HW)
    s = ns.by_name("RS01R = RS01R")
    assert s.output_specs[0].dims[1] == (0, 1) and not s.comm


def test_repeat_interleave_output_size_is_localised():
    graph, values = export_nodes(
        Fn(lambda m, x: aten.repeat_interleave.self_int(x, 2, 1, output_size=16)), (_x(4, 8),))
    node = find_node(graph, aten.repeat_interleave.self_int)
    for mesh in MESHES:
        assert len(check_all_strategies(graph, node, values, mesh)) > 1
