"""Normalisation handlers: layer_norm, rms_norm, batch_norm (sync-BN), and Llama's decomposed RMSNorm."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from autoshard.capture import capture
from autoshard.enumerate import node_strategies
from autoshard.handlers import REGISTRY, handler_for
from autoshard.hardware import load_hardware
from autoshard.mesh import MeshSpec
from autoshard.models import build_model
from autoshard.opinfo import OpInfo, UnsupportedOpError
from autoshard.strategy import BWD, FWD
from autoshard.verify import run_on_simulated_mesh, shard_of
from handler_utils import MESHES, check_all_strategies, export_nodes, find_node

aten = torch.ops.aten
HW = load_hardware("h100-nvlink")


def _x(*shape) -> torch.Tensor:
    return torch.randn(shape).requires_grad_()


class Rms(nn.Module):
    def __init__(self, shape, weight: bool):
        super().__init__()
        self.shape = shape
        self.weight = nn.Parameter(torch.rand(shape) + 0.5) if weight else None

    def forward(self, x):
        return nn.functional.rms_norm(x, self.shape, self.weight, 1e-6)


def _ln(shape, **kw) -> nn.Module:
    m = nn.LayerNorm(shape, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(0.5, 1.5)
    return m


# id -> (module, input shape, number of leading dims that may be sharded)
LEADING_NORM_CASES = {
    "layer_norm": (lambda: _ln(4), (4, 8, 4), 2),
    "layer_norm_2d": (lambda: _ln((8, 4)), (4, 8, 4), 1),
    "layer_norm_no_affine": (lambda: _ln(4, elementwise_affine=False), (4, 8, 4), 2),
    "layer_norm_no_bias": (lambda: _ln(4, bias=False), (8, 4), 1),
    "rms_norm": (lambda: Rms((4,), True), (4, 8, 4), 2),
    "rms_norm_no_weight": (lambda: Rms((8, 4), False), (4, 8, 4), 1),
}


@pytest.mark.parametrize("case", list(LEADING_NORM_CASES))
def test_leading_dim_norms_every_strategy_simulates(case):
    torch.manual_seed(0)
    make, shape, lead = LEADING_NORM_CASES[case]
    graph, values = export_nodes(make(), (_x(*shape),))
    node = next(n for n in graph.nodes() if n.target in (aten.layer_norm.default, aten.rms_norm.default))
    for mesh in MESHES:
        strategies = check_all_strategies(graph, node, values, mesh)
        x_specs = [s.input_specs[0] for s in strategies]
        assert {d for x in x_specs for d in range(x.ndim) if x.dims[d]} == set(range(lead))
        assert all(s.is_replicated() for st in strategies for s in st.input_specs[1:])


# -- batch norm ------------------------------------------------------------------------------------

def _bn(cls, c: int, train: bool = True, **kw) -> nn.Module:
    m = cls(c, **kw)
    with torch.no_grad():
        if m.affine:
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.5, 0.5)
        if m.track_running_stats:
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    return m.train(train)


# id -> (module, input shape)
BN_CASES = {
    "bn2d_train": (lambda: _bn(nn.BatchNorm2d, 8), (4, 8, 4, 4)),
    "bn1d_train_2d_input": (lambda: _bn(nn.BatchNorm1d, 8), (8, 8)),
    "bn1d_train_3d_input": (lambda: _bn(nn.BatchNorm1d, 4, momentum=0.3), (4, 4, 8)),
    "bn2d_eval": (lambda: _bn(nn.BatchNorm2d, 8, train=False), (4, 8, 4, 4)),
    "bn2d_no_running_stats": (lambda: _bn(nn.BatchNorm2d, 4, track_running_stats=False), (4, 4, 4, 4)),
    "bn2d_no_affine": (lambda: _bn(nn.BatchNorm2d, 4, affine=False), (4, 4, 4, 4)),
}


@pytest.mark.parametrize("case", list(BN_CASES))
def test_batch_norm_every_strategy_simulates(case):
    """Forward, gradients and the in-place running-stat update (compared by check_strategy)."""
    torch.manual_seed(1)
    make, shape = BN_CASES[case]
    graph, values = export_nodes(make(), (_x(*shape),))
    node = find_node(graph, aten.batch_norm.default)
    for mesh in MESHES:
        strategies = check_all_strategies(graph, node, values, mesh)
        x_dims = {d for s in strategies for d in range(len(shape)) if s.input_specs[0].dims[d]}
        assert x_dims == set(range(len(shape)))


def _bn_strategies(shape=(4, 8, 4, 4), train: bool = True):
    graph, _ = export_nodes(_bn(nn.BatchNorm2d, shape[1], train), (_x(*shape),))
    node = find_node(graph, aten.batch_norm.default)
    return graph, node, node_strategies(graph, node, MeshSpec((2, 2)), HW)


def _extra(strategy) -> list[tuple[str, str, tuple[int, ...], int]]:
    return sorted((c.phase, c.operand, c.axes, c.nbytes) for c in strategy.comm if c.operand.startswith("bn-"))


def test_sync_batch_norm_prices_its_statistics_all_reduces():
    _, _, ns = _bn_strategies()
    channel = ns.by_name("RS01RR = RS01RR, S01, S01, S01, S01")
    assert not channel.comm                      # per-channel: nothing to communicate
    # batch over axis 0, channels over axis 1: 8/2 = 4 channels of float32 per statistic; forward,
    # the (mean, M2) rows of the 2 batch shards; backward, the two per-channel gradient sums
    mixed = ns.by_name("S0S1RR = S0S1RR, S1, S1, S1, S1")
    assert _extra(mixed) == sorted([(FWD, "bn-stats", (0,), 2 * 2 * 16), (BWD, "bn-grad-sums", (0,), 2 * 16)])
    # batch and height over both axes: all 8 channels, one all-reduce over both sharding axes
    # (what the kernel runs, and what the runtime's collective counter sees)
    spatial = ns.by_name("S0RS1R = S0RS1R, R, R, R, R")
    assert _extra(spatial) == sorted([(FWD, "bn-stats", (0, 1), 4 * 2 * 32), (BWD, "bn-grad-sums", (0, 1), 2 * 32)])
    # weight and bias are replicated under a batch-sharded output: their gradients are all-reduced
    assert sorted(c.operand for c in spatial.comm if not c.operand.startswith("bn-")) == ["in1", "in2"]


def test_eval_batch_norm_needs_no_statistics_comm():
    _, _, ns = _bn_strategies(train=False)
    assert all(not c.operand.startswith("bn-") for s in ns for c in s.comm)
    assert len(ns) == 25   # per axis: N, C, H, W or replicated; N (4) and C (8) divide by 4 too


def test_sync_batch_norm_matches_the_module_and_updates_running_stats_in_float32():
    """The sync-BN kernel on a 2x2 mesh (batch on axis 0, height on axis 1) against nn.BatchNorm2d:
    output shards, input gradient shards, and every device's running stats after one step."""
    torch.manual_seed(2)
    x = torch.randn(4, 8, 4, 4)
    module = _bn(nn.BatchNorm2d, 8)
    graph, _ = export_nodes(module, (x.clone().requires_grad_(),))
    node = find_node(graph, aten.batch_norm.default)
    mesh = (2, 2)
    strategy = node_strategies(graph, node, MeshSpec(mesh), HW).by_name("S0RS1R = S0RS1R, R, R, R, R")
    op = OpInfo(node, graph, MeshSpec(mesh))
    kernel = handler_for(node.target).kernel(op, strategy)
    assert kernel.uses_comm

    start = {k: v.detach().clone() for k, v in module.state_dict().items()}
    ref_x = x.clone().requires_grad_()
    ref_y = module(ref_x)
    grad_y = torch.randn_like(ref_y)
    ref_y.backward(grad_y)

    def device(coord, comm):
        local = {n: start[graph.param_fqn.get(n.name) or graph.buffer_fqn[n.name]].clone()
                 for n in op.operand_nodes[1:]}
        lx = shard_of(x, strategy.input_specs[0], mesh, coord).clone().requires_grad_()
        by_node = {op.operand_nodes[0]: lx, **local}
        args, kwargs = pytree.tree_map(lambda a: by_node.get(a, a) if isinstance(a, torch.fx.Node) else a,
                                       (kernel.args, kernel.kwargs))
        y = kernel.target(*args, **kwargs, comm=comm)
        y.backward(shard_of(grad_y, strategy.output_specs[0], mesh, coord))
        return y.detach(), lx.grad, {graph.buffer_fqn[n.name]: t for n, t in local.items() if graph.is_buffer(n)}

    for coord, (y, gx, state) in run_on_simulated_mesh(mesh, device).items():
        torch.testing.assert_close(y, shard_of(ref_y.detach(), strategy.output_specs[0], mesh, coord))
        torch.testing.assert_close(gx, shard_of(ref_x.grad, strategy.input_specs[0], mesh, coord))
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(state[name], getattr(module, name), msg=f"{name} on {coord}")
            assert not torch.equal(state[name], start[name])


def _per_rank_reference(module: nn.Module, x: torch.Tensor, groups: int):
    """torch DDP's batch norm: each of ``groups`` consecutive slices of the batch through its own
    copy of the module; the running statistics, the mean of the copies'."""
    copies = [copy.deepcopy(module) for _ in range(groups)]
    y = torch.cat([m(chunk) for m, chunk in zip(copies, x.chunk(groups))])
    state = {name: torch.stack([getattr(m, name) for m in copies]).mean(0) for name in ("running_mean", "running_var")}
    return y, state


@pytest.mark.parametrize("mesh", MESHES)
def test_per_rank_batch_norm_is_ddps_function_under_every_strategy_with_no_comm(mesh):
    """Planned batch_norm="per_rank", every strategy's kernel on a simulated mesh gives each
    device's block of the per-slice function (output, input gradient); the devices' running
    statistics, averaged over the kernel's ``state_axes`` as the runtime does, equal the mean of the
    slices' updates. No strategy communicates statistics, none splits a spatial dim."""
    torch.manual_seed(3)
    x = torch.randn(8, 4, 3, 3) * 2 + 1
    module = _bn(nn.BatchNorm2d, 4)
    graph, _ = export_nodes(module, (x.clone().requires_grad_(),))
    node = find_node(graph, aten.batch_norm.default)
    start = {k: v.detach().clone() for k, v in module.state_dict().items()}
    ref_x = x.clone().requires_grad_()
    ref_y, ref_state = _per_rank_reference(module, ref_x, 4)
    grad_y = torch.randn_like(ref_y)
    ref_y.backward(grad_y)

    spec_mesh = MeshSpec(mesh)
    strategies = node_strategies(graph, node, spec_mesh, HW, batch_norm="per_rank").strategies
    assert {d for s in strategies for d in range(4) if s.input_specs[0].dims[d]} <= {0, 1}
    assert any(s.input_specs[0].dims[0] for s in strategies)
    op = OpInfo(node, graph, spec_mesh, batch_norm_groups=4)
    for strategy in strategies:
        assert not strategy.comm or all(not c.operand.startswith("bn-") for c in strategy.comm)
        kernel = handler_for(node.target).kernel(op, strategy)
        assert not kernel.uses_comm
        assert kernel.state_axes == tuple(sorted(strategy.input_specs[0].dims[0]))

        def device(coord, comm, strategy=strategy, kernel=kernel):
            local = {n: shard_of(start[graph.param_fqn.get(n.name) or graph.buffer_fqn[n.name]],
                                 strategy.input_specs[j + 1], mesh, coord).clone()
                     for j, n in enumerate(op.operand_nodes[1:])}
            for n, t in local.items():
                t.requires_grad_(graph.param_fqn.get(n.name) is not None)
            lx = shard_of(x, strategy.input_specs[0], mesh, coord).clone().requires_grad_()
            by_node = {op.operand_nodes[0]: lx, **local}
            args, kwargs = pytree.tree_map(lambda a: by_node.get(a, a) if isinstance(a, torch.fx.Node) else a,
                                           (kernel.args, kernel.kwargs))
            y = kernel.target(*args, **kwargs)
            y.backward(shard_of(grad_y, strategy.output_specs[0], mesh, coord))
            return y.detach(), lx.grad, {graph.buffer_fqn[n.name]: t for n, t in local.items() if graph.is_buffer(n)}

        results = run_on_simulated_mesh(mesh, device)
        for coord, (y, gx, state) in results.items():
            label = f"{strategy.name} on {coord}"
            torch.testing.assert_close(y, shard_of(ref_y.detach(), strategy.output_specs[0], mesh, coord), msg=label)
            torch.testing.assert_close(gx, shard_of(ref_x.grad, strategy.input_specs[0], mesh, coord), msg=label)
            for name in ("running_mean", "running_var"):
                # the copies of the devices that differ from this one only along state_axes
                peers = [results[c][2][name] for c in results
                         if all(c[a] == coord[a] for a in range(2) if a not in kernel.state_axes)]
                spec = strategy.input_specs[3 if name == "running_mean" else 4]
                torch.testing.assert_close(torch.stack(peers).mean(0), shard_of(ref_state[name], spec, mesh, coord),
                                           msg=f"{name}: {label}")


def test_per_rank_batch_norm_prices_one_call_per_slice_and_the_concatenation():
    """A device that holds k of the batch's per-rank slices runs k batch norms, each priced as the
    op on one slice (the same op captured on a quarter of the batch), and concatenates the outputs
    (backward: the input gradients), one memory-bound pass each; one slice, one call, no copy."""
    hw = load_hardware("cpu-gloo")                      # measured curves: small calls cost more per byte
    mesh = MeshSpec((2, 2))

    def strategies(batch: int, **kw):
        graph, _ = export_nodes(_bn(nn.BatchNorm2d, 4), (_x(batch, 4, 6, 6),))
        node = find_node(graph, aten.batch_norm.default)
        return {str(s.input_specs[0]): s for s in node_strategies(graph, node, mesh, hw, **kw).strategies}

    per_rank, quarter = strategies(8, batch_norm="per_rank"), strategies(2)
    whole = per_rank["RS01RR"]                          # channels split, all 4 slices on every device
    one = quarter["RS01RR"]
    local = 8 * 1 * 6 * 6 * 4                           # bytes of the device's input (and output)
    assert whole.compute_fwd == pytest.approx(4 * one.compute_fwd + hw.copy_seconds(local, "float32"))
    assert whole.compute_bwd == pytest.approx(4 * one.compute_bwd + hw.copy_seconds(local, "float32"))
    assert per_rank["S0S1RR"].compute_fwd == pytest.approx(2 * quarter["RS1RR"].compute_fwd
                                                           + hw.copy_seconds(4 * 2 * 36 * 4, "float32"))
    data_parallel = per_rank["S01RRR"]                  # one slice per device: the op itself
    assert data_parallel.compute_fwd == pytest.approx(quarter["RRRR"].compute_fwd)
    assert data_parallel.compute_bwd == pytest.approx(quarter["RRRR"].compute_bwd)


def test_per_rank_batch_norm_refuses_a_batch_the_mesh_does_not_divide():
    graph, _ = export_nodes(_bn(nn.BatchNorm2d, 4), (_x(6, 4, 2, 2),))
    node = find_node(graph, aten.batch_norm.default)
    with pytest.raises(UnsupportedOpError, match=r"per_rank.*batch is 6.*multiple of 4"):
        node_strategies(graph, node, MeshSpec((2, 2)), HW, batch_norm="per_rank")
    # eval batch norm reads its running statistics: per_rank changes nothing there
    graph, _ = export_nodes(_bn(nn.BatchNorm2d, 4, train=False), (_x(6, 4, 2, 2),))
    node = find_node(graph, aten.batch_norm.default)
    assert len(node_strategies(graph, node, MeshSpec((2, 2)), HW, batch_norm="per_rank").strategies) > 1


# -- Llama's RMSNorm, decomposed into pow / mean / add / rsqrt / mul ---------------------------------

RMS_PATTERN = {aten.pow.Tensor_Scalar, aten.mean.dim, aten.add.Tensor, aten.rsqrt.default, aten.mul.Tensor}


def _rms_pattern_nodes(graph, layer_norm_path: str):
    return [n for n in graph.nodes() if graph.module_path(n) == layer_norm_path and n.target in RMS_PATTERN]


def test_llama_rmsnorm_pattern_gets_batch_and_sequence_sharded_strategies():
    model, args, kwargs = build_model("llama-tiny")
    graph = capture(model, args, kwargs)
    paths = sorted({graph.module_path(n) for n in graph.nodes() if graph.module_type(n) == "LlamaRMSNorm"})
    assert paths and paths[-1] == "model.norm"
    for path in paths:
        nodes = _rms_pattern_nodes(graph, path)
        assert {n.target for n in nodes} == RMS_PATTERN
        for node in nodes:
            assert REGISTRY[node.target].family in ("pointwise", "reduction")
            ns = node_strategies(graph, node, MeshSpec((2, 2)), HW)
            # batch over axis 0 and sequence over axis 1 (operands follow: simulated below)
            assert any(s.output_spec.dims[:2] == ((0,), (1,)) for s in ns), f"{node.name}: {ns.names()}"


def test_llama_rmsnorm_pattern_every_strategy_simulates():
    torch.manual_seed(3)
    model, args, kwargs = build_model("llama-tiny", device="cpu")
    graph, values = export_nodes(model, args, kwargs)
    nodes = _rms_pattern_nodes(graph, "model.layers.0.input_layernorm")
    assert len(nodes) == 5 + 1          # the weight multiply is a second mul
    for node in nodes:
        check_all_strategies(graph, node, values, (2, 2))
