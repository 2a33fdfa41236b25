"""Matmul family: the seed's linear strategy names, completeness, and simulated numerics."""
import pytest
import torch
from torch import nn

from autoshard.enumerate import node_strategies
from autoshard.hardware import load_hardware
from autoshard.mesh import MeshSpec
from handler_utils import MESHES, check_all_strategies, export_nodes, find_node

aten = torch.ops.aten

SEED_NAMES = [
    "S0S1 = S0R x RS1_0", "S0S1 = S0R x RS1_1", "S0S1 = S0R x RS1_2",
    "S1S0 = S1R x RS0_0", "S1S0 = S1R x RS0_1", "S1S0 = S1R x RS0_2",
    "S0R = S0S1 x S1R_0", "S0R = S0S1 x S1R_1", "S0R = S0S1 x S1R_2",
    "S1R = S1S0 x S0R_0", "S1R = S1S0 x S0R_1", "S1R = S1S0 x S0R_2",
    "RS0 = RS1 x S1S0", "RS1 = RS0 x S0S1",
    "RR = RS0 x S0R", "RR = RS1 x S1R",
    "RS0 = RR x RS0", "RS1 = RR x RS1",
    "S01R = S01R x RR_0", "S01R = S01R x RR_1", "S01R = S01R x RR_2",
    "RR = RS01 x S01R", "RS01 = RR x RS01", "RR = RR x RR",
]


class Linear(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.linear = nn.Linear(16, 32, bias=bias)

    def forward(self, x):
        return self.linear(x)


@pytest.fixture(scope="module", params=[True, False], ids=["bias", "nobias"])
def linear_graph(request):
    torch.manual_seed(0)
    model = Linear(request.param)
    return export_nodes(model, (torch.rand(4, 4, 4, 16),))


def test_linear_seed_names_and_completeness(linear_graph):
    graph, _ = linear_graph
    node = find_node(graph, aten.linear.default)
    ns = node_strategies(graph, node, MeshSpec((2, 2)), load_hardware("a100-nvlink"))
    names = ns.names()
    missing = [n for n in SEED_NAMES if n not in names]
    assert not missing, f"missing strategies: {missing}"
    # per axis: m on one of 3 leading dims, n, k, or replicate = 6 options; all 36 pairs divide
    assert len(names) == 36 and len(set(names)) == 36
    for s in ns.strategies:
        x, w, y = s.input_specs[0], s.input_specs[1], s.output_specs[0]
        assert x.dims[:-1] == y.dims[:-1]          # leading dims follow the input
        assert w.dims[1] == x.dims[-1]             # weight in-features = input k
        assert w.dims[0] == y.dims[-1]             # weight out-features = output n


def test_linear_costs_are_consistent(linear_graph):
    graph, _ = linear_graph
    node = find_node(graph, aten.linear.default)
    ns = node_strategies(graph, node, MeshSpec((2, 2)), load_hardware("a100-nvlink"))
    rep = ns.by_name("RR = RR x RR")
    dp = ns.by_name("S01R = S01R x RR_0")
    row = ns.by_name("RR = RS01 x S01R")
    assert dp.compute_fwd < rep.compute_fwd and dp.split == 4
    assert not rep.comm
    # data parallel: only backward gradient all-reduces of the replicated weight (and bias)
    assert dp.comm and all(c.phase == "bwd" and c.kind == "all_reduce" and c.axes == (0, 1) for c in dp.comm)
    # k sharded over both axes: a forward all-reduce of the partial output
    assert [c.phase for c in row.comm if c.operand == "out0"] == ["fwd"]
    assert row.memory.params < rep.memory.params


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_linear_every_strategy_simulates(linear_graph, mesh):
    graph, values = linear_graph
    strategies = check_all_strategies(graph, find_node(graph, aten.linear.default), values, mesh)
    assert len(strategies) == (36 if mesh == (2, 2) else 6)


class Batched(nn.Module):
    def forward(self, a, b, c, d, e):
        x = torch.bmm(a, b)
        y = torch.baddbmm(c, a, b)
        z = torch.matmul(d, e)
        return x, y, z


@pytest.fixture(scope="module")
def batched_graph():
    torch.manual_seed(0)
    a, b = torch.randn(4, 8, 4), torch.randn(4, 4, 8)
    c = torch.randn(1, 8, 8)
    d, e = torch.randn(4, 2, 8, 4), torch.randn(2, 4, 8)
    args = tuple(t.requires_grad_() for t in (a, b, c, d, e))
    return export_nodes(Batched(), args)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("target", [aten.bmm.default, aten.baddbmm.default, aten.matmul.default],
                         ids=["bmm", "baddbmm", "matmul"])
def test_batched_matmul_every_strategy_simulates(batched_graph, mesh, target):
    graph, values = batched_graph
    nodes = [n for n in graph.graph.nodes if n.target == target]
    if not nodes:
        pytest.skip(f"export decomposed {target} in this torch version")
    strategies = check_all_strategies(graph, nodes[0], values, mesh)
    assert len(strategies) > 1


def test_gpt2_addmm_every_strategy_simulates():
    from autoshard.models import build_model

    model, args, kwargs = build_model("gpt2-tiny", device="cpu")
    graph, values = export_nodes(model, args, kwargs)
    node = find_node(graph, aten.addmm.default)
    strategies = check_all_strategies(graph, node, values, (2, 2))
    names = [s.name for s in strategies]
    assert "RR = RS01 x S01R" in names and "S01R = S01R x RR" in names
