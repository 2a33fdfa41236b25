"""Handlers of views/shape ops, indexing, casts, factory ops, higher-order ops and mask-building ops.

Every strategy of every covered node is simulated on real values (forward and gradients) on the
meshes (2, 2), (1, 4) and (4, 1); a few tests pin down which shardings must (not) be offered, and
that the checker rejects a wrong one.
"""
from __future__ import annotations

import operator
from typing import Callable

import pytest
import torch
from torch import nn

from autoshard.enumerate import enumerate_strategies, node_strategies
from autoshard.handlers import handler_for
from autoshard.handlers.registry import default_kernel
from autoshard.hardware import load_hardware
from autoshard.mesh import MeshSpec
from autoshard.opinfo import OpInfo
from autoshard.specs import ShardSpec
from autoshard.strategy import AxisOption, default_name, expand
from autoshard.verify import _run, check_strategy, run_on_simulated_mesh, shard_of
from handler_utils import MESHES, check_all_strategies, export_nodes, operand_values

aten = torch.ops.aten
MY_FAMILIES = {"view", "index", "cast", "factory", "hop", "mask", "meta"}


class Fn(nn.Module):
    """A module whose forward is ``fn`` (and which may own a parameter ``w``)."""

    def __init__(self, fn: Callable, param: torch.Tensor | None = None):
        super().__init__()
        self.fn = fn
        if param is not None:
            self.w = nn.Parameter(param)

    def forward(self, *args):
        return self.fn(self, *args)


def f32(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


IDX4 = torch.tensor([3, 0, 2, 0])
IDX44 = torch.tensor([[1, 0, 3, 2], [0, 0, 1, 3], [2, 2, 0, 1], [3, 1, 1, 0]])

# name -> (forward, example args). Sizes divide by 4 wherever a dim can be sharded.
CASES: dict[str, tuple[Callable, tuple]] = {
    "reshapes": (lambda m, x: (
        x.view(4, 2, 8, 4), x.reshape(8, 32), x.reshape(64, 4), x.flatten(0, 1), x.flatten(),
        x.unflatten(1, (2, 4)), x.unsqueeze(1), x.unsqueeze(-1).squeeze(-1),
        torch.ops.aten._unsafe_view.default(x * 1, [4, 64]), x.reshape(4, 2, 32).view(8, 8, 4),
        x.view(16, 16).view_as(x)), (f32(8, 8, 4),)),
    # y: dim 0 (size 2) becomes 1 locally when sharded; squeeze must still keep it.
    "squeezes": (lambda m, x, y: (x.squeeze(), x.squeeze(1), x.squeeze([1, 3]), y.squeeze(),
                                  y.squeeze(0), y.squeeze([0, 1])),
                 (f32(4, 1, 8, 1), f32(2, 1, 8))),
    "permutes": (lambda m, x, y: (
        x.permute(2, 0, 1), x.transpose(0, 2), x.mT, torch.ops.aten.numpy_T.default(x),
        x.movedim(0, 2), x.movedim((0, 1), (2, 0)), x.swapaxes(0, 1), x.swapdims(1, 2),
        torch.ops.aten.adjoint.default(x), y.t()), (f32(8, 4, 4), f32(8, 4))),
    "expands": (lambda m, x, y: (
        x.expand(2, 4, 4, 8), x.expand(4, 4, 8), y.expand(4, 8), x.expand_as(torch.zeros(4, 4, 8)),
        x.repeat(1, 2, 1), x.repeat(2, 1, 1, 1)), (f32(4, 1, 8), f32(1, 8))),
    "slices": (lambda m, x: (
        x[:, 1:3], x[::2], torch.ops.aten.slice.Tensor(x, 1, 0, 9223372036854775807),
        torch.ops.aten.slice.Tensor(x, 0, -8, 8), x.narrow(1, 0, 8), x.narrow(1, 4, 4),
        x.select(1, 2), x[-1]), (f32(8, 8, 4),)),
    "gathers": (lambda m, x, i, j: (
        x.index_select(1, i), x.index_select(0, i), x.gather(1, j), x.gather(0, j[:, :2])),
                (f32(4, 8), IDX4, IDX44)),
    "index": (lambda m, x, i, j: (
        x[i], x[:, i], x[:, j], x[i, :, i], x[i[:, None], i[None, :]], x[j[:, None, :], 1:2]),
              (f32(4, 4, 8), IDX4, IDX44)),
    # Indices built from an arange over the whole dim they address (Hugging Face's padding mask
    # mask[batch_idx, kv_idx]): that dim of x may be cut with them. Adjacent indexed dims (in
    # place, after a None), non-adjacent ones (to the front), broadcast shapes, an arange beside
    # an arbitrary index on one dim, a diagonal, chains (+ 0, cast, view/expand/transpose), and
    # aranges that do not qualify (short of the dim, not starting at 0).
    "index_arange": (lambda m, x, y, i: (
        (y > 0)[torch.arange(4)[:, None, None, None], (torch.arange(8) + 0)[None, None, None, :]],
        y[torch.arange(4)[:, None], torch.arange(8).to(torch.int32)[None, :]],
        x[:, torch.arange(4)[:, None], i[None, :]],
        x[torch.arange(4), :, i],
        x[torch.arange(4)[:, None], :, torch.arange(8)[None, :]],
        x[torch.arange(4), torch.arange(4)],
        x[torch.arange(4).view(1, 4).expand(2, 4).transpose(0, 1)],
        x[..., torch.arange(4)], x[torch.arange(1, 5) % 4]),
                     (f32(4, 4, 8), f32(4, 8), IDX4)),
    "split_cat": (lambda m, x, y: (
        x.split(2, 1), x.split([1, 3], 1), x.chunk(2, -1), x.unbind(1), torch.cat([x, y], 1),
        torch.cat([x, y, x], -1), torch.stack([x, y], 1), torch.stack([x, y], -1)),
                  (f32(8, 4, 8), f32(8, 4, 8))),
    "casts": (lambda m, x, y: (
        x.to(torch.float64), x.double().float(), x.to("cpu", torch.float64), x.type_as(y),
        torch.ops.aten.to.other(x, y), torch.ops.aten.to.dtype_layout(x, dtype=torch.float64),
        torch.ops.aten._to_copy.default(x, dtype=torch.float64), x.half().to(torch.float32),
        torch.ops.aten.alias.default(x), x.detach(), x.transpose(0, 1).contiguous(), x.clone(),
        x + torch.tensor(2.0)), (f32(8, 4), torch.randn(4, 8, dtype=torch.float64))),
    "factories": (lambda m, x: (
        torch.arange(8), torch.arange(2, 10), torch.arange(1, 17, 2), torch.arange(0.5, 4.5, 0.5),
        torch.ones(4, 8), torch.zeros(8, 4, dtype=torch.int64), torch.full((4, 4), 2.5),
        torch.empty(4, 8), x.new_ones(4, 8), x.new_zeros(8), x.new_full((4,), 3.0), x.new_ones(()),
        x.new_empty(8), torch.ones_like(x), torch.zeros_like(x), torch.full_like(x, 7.0),
        torch.empty_like(x), torch.scalar_tensor(3.0)), (f32(8, 4),)),
    # 2-D for the broadcasting/scan/pad/triangle rules, 1-D for the other overloads of the same rule.
    "masks": (lambda m, x, y, i, a, b: (
        x >= y, (x > 0) & (y < 0), (x > 0) | (y[:1] < 0), ~(x > 0), torch.logical_and(x > 0, y),
        (i & 1) ^ (i | 2), torch.bitwise_xor(i, i), x.cumsum(-1), torch.diff(x, dim=0, prepend=y[:2]),
        nn.functional.pad(x, (1, 2)), nn.functional.pad(x[None], (0, 0, 1, 1), mode="reflect"),
        torch.ops.aten.constant_pad_nd.default(x, [0, 0, 2, 0], 1.0), x.tril(-2),
        torch.triu(x[None].expand(4, 8, 8), 1), torch.ones(8, 8, dtype=torch.bool).tril(),
        a < b, a <= b, a > b, a == b, a != b, a == 0, a != 0, a <= 0, a >= 0, a.eq(b) ^ True,
        torch.logical_or(a, b), torch.logical_xor(a, b), torch.logical_not(a),
        torch.bitwise_and(i[0], 3), torch.bitwise_or(i[0], i[1]), torch.bitwise_not(i[0]),
        i[0].cumsum(0)),
              (f32(8, 8), f32(8, 8), torch.arange(16).view(4, 4), f32(8), f32(8))),
    "asserts": (lambda m, x: (x.to(torch.float64), x.to(torch.float32)), (f32(8, 4),)),
}


def _grad_no(m, pos, inv_freq):
    with torch.no_grad():
        ang = pos[..., None].float() * inv_freq
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos(), emb.sin()
    return cos, sin


class Rotary(nn.Module):
    """Llama-style rotary embedding: a no_grad region (wrap_with_set_grad_enabled) and an autocast one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(4))
        self.lin = nn.Linear(8, 8)

    def forward(self, q, pos):
        cos, sin = _grad_no(self, pos, self.inv_freq)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.lin(q)
        return q * cos + h.float() * sin


def _my_nodes(graph):
    """call_function nodes whose handler is one of this module's families."""
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        h = handler_for(node.target)
        if h is not None and h.family in MY_FAMILIES:
            yield node


_UNDEFINED_VALUES = {aten.empty.memory_format, aten.new_empty.default, aten.empty_like.default}


def _check_node(graph, node, values, mesh) -> list:
    if node.target in _UNDEFINED_VALUES:
        return _check_shapes_only(graph, node, values, mesh)
    return check_all_strategies(graph, node, values, mesh)


def _check_shapes_only(graph, node, values, mesh_shape) -> list:
    """empty*: the values are undefined, so only the local shapes can be checked."""
    mesh = MeshSpec.of(mesh_shape)
    handler = handler_for(node.target)
    op = OpInfo(node, graph, mesh, free=handler.free)
    vals = operand_values(op, values)
    strategies = node_strategies(graph, node, mesh, load_hardware("h100-nvlink")).strategies
    for s in strategies:
        kernel = handler.kernel(op, s)

        def device(coord, comm, s=s, kernel=kernel):
            local = [shard_of(v, spec, mesh.shape, coord) for v, spec in zip(vals, s.input_specs)]
            out = _run(kernel, op, local, comm)[0]
            assert tuple(out.shape) == s.output_specs[0].local_shape(op.out_shape, mesh.shape), s.name

        run_on_simulated_mesh(mesh.shape, device)
    return strategies


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_strategy_matches_single_device(case):
    fn, args = CASES[case]
    graph, values = export_nodes(Fn(fn), args)
    nodes = list(_my_nodes(graph))
    assert nodes, f"case {case} produced none of the covered ops"
    sharded = 0
    for node in nodes:
        for mesh in MESHES:
            strategies = _check_node(graph, node, values, mesh)
            assert strategies, f"{node.name} has no strategy on {mesh}"
            sharded += sum(not all(s is None or s.is_replicated() for s in st.output_specs + st.input_specs)
                           for st in strategies)
    assert sharded, f"case {case}: no node offered a sharded strategy"


def test_higher_order_ops_and_getitem():
    q, pos = torch.randn(4, 8, 8, requires_grad=True), torch.arange(8).expand(4, 8)
    graph, values = export_nodes(Rotary(), (q, pos))
    hops = [n for n in graph.graph.nodes if n.op == "call_function"
            and handler_for(n.target) is not None and handler_for(n.target).family == "hop"]
    assert len(hops) == 2, [n.target for n in hops]
    for node in _my_nodes(graph):
        for mesh in MESHES:
            strategies = _check_node(graph, node, values, mesh)
            if node.target is operator.getitem:
                assert len(strategies) > 1, "getitem of a HOP element must offer shardings"
    for hop in hops:
        metas = graph.tensor_meta(hop)
        assert isinstance(metas, tuple) and all(m is not None for m in metas)
        ns = node_strategies(graph, hop, MeshSpec.of((2, 2)), load_hardware("h100-nvlink"))
        assert [s.output_specs for s in ns.strategies] == [
            tuple(ShardSpec.replicate(len(m.shape)) for m in metas)]


def _strategies(fn, args, target, index=0, mesh=(2, 2)):
    graph, values = export_nodes(Fn(fn), args)
    node = [n for n in graph.graph.nodes if n.target == target][index]
    return node_strategies(graph, node, MeshSpec.of(mesh), load_hardware("h100-nvlink")), graph, node, values


def _sharded_dims(specs) -> set[tuple[int, int]]:
    """{(tensor index, dim)} sharded in any of ``specs``."""
    return {(j, d) for j, s in enumerate(specs) if s is not None for d, axes in enumerate(s.dims) if axes}


def _all_sharded(ns, which: str) -> set[tuple[int, int]]:
    out: set = set()
    for s in ns.strategies:
        out |= _sharded_dims(s.input_specs if which == "in" else s.output_specs)
    return out


def test_reshape_shards_only_group_leading_dims():
    # [2, 16, 96] -> [32, 96]: dim 1 (16) is inside the flattened group, dim 0 leads it.
    ns, *_ = _strategies(lambda m, x: x.view(32, 96), (f32(4, 16, 96)[:2],), aten.view.default)
    assert _all_sharded(ns, "in") == {(0, 0), (0, 2)}
    # [2, 16, 32] -> [2, 16, 4, 8]: the heads dim (4) of the split group may carry dim 2.
    ns, *_ = _strategies(lambda m, x: x.view(2, 16, 4, 8), (f32(2, 16, 32),), aten.view.default)
    assert {s.name for s in ns.strategies} >= {"RRS01R = RRS01", "S0S1RR = S0S1R"}
    assert (0, 3) not in _all_sharded(ns, "out")


def test_checker_rejects_sharding_inside_a_group():
    """The rule matters: sharding the inner dim of a flattened group is caught as wrong."""
    _, graph, node, values = _strategies(lambda m, x: x.view(32, 8), (f32(4, 8, 8),), aten.view.default)
    op = OpInfo(node, graph, MeshSpec.of((1, 4)), free=True)
    wrong = expand(op, [AxisOption((1,), (0,), "inner")], load_hardware("h100-nvlink"), default_name)
    wrong = [s for s in wrong if s.input_specs[0].dims[1]]
    assert wrong
    with pytest.raises(AssertionError):
        check_strategy(op, handler_for(node.target), wrong[0], operand_values(op, values))


def test_slice_and_split_keep_their_dim_replicated():
    ns, *_ = _strategies(lambda m, x: x[:, 1:3], (f32(8, 8),), aten.slice.Tensor)
    assert _all_sharded(ns, "in") == {(0, 0)}
    ns, *_ = _strategies(lambda m, x: torch.ops.aten.slice.Tensor(x, 1, 0, 8), (f32(8, 8),),
                         aten.slice.Tensor)
    assert _all_sharded(ns, "in") == {(0, 0), (0, 1)}
    ns, *_ = _strategies(lambda m, x: x.split(4, 1), (f32(8, 8),), aten.split.Tensor)
    assert _all_sharded(ns, "in") == {(0, 0)}
    assert all(len(set(s.output_specs)) == 1 for s in ns.strategies)
    ns, *_ = _strategies(lambda m, x, y: torch.cat([x, y], 0), (f32(8, 8), f32(4, 8)), aten.cat.default)
    assert _all_sharded(ns, "in") == {(0, 1), (1, 1)}
    assert all(s.input_specs[0] == s.input_specs[1] for s in ns.strategies)


def test_expand_shards_broadcast_dims_from_replicated_input():
    ns, *_ = _strategies(lambda m, x: x.expand(4, 8, 8), (f32(4, 1, 8),), aten.expand.default)
    names = {s.name for s in ns.strategies}
    assert "RS01R = RRR" in names                     # broadcast dim: input replicated
    s = ns.by_name("RS01R = RRR")
    assert [c.operand for c in s.comm] == ["in0"]     # its gradient is a partial sum
    assert (0, 1) not in _all_sharded(ns, "in")       # the size-1 input dim never is


def test_index_tensor_layouts():
    # x[i[:, None], i[None, :]] on x [4, 8]: out [4, 4]; out dim 0 from i0, dim 1 from i1.
    ns, *_ = _strategies(lambda m, x, i: x[i[:, None], i[None, :]], (f32(4, 8), IDX4), aten.index.Tensor)
    s = ns.by_name("S0S1 = RR, S0R, RS1")
    assert s.input_specs[0].is_replicated()
    # Non-adjacent indices go to the front: x[i, :, i] on [4, 4, 8] -> [4, 4]; x dim 1 -> out dim 1.
    ns, *_ = _strategies(lambda m, x, i: x[i, :, i[:4] % 4], (f32(4, 4, 8), IDX4), aten.index.Tensor)
    assert any(s.input_specs[0].dims[1] and s.output_specs[0].dims[1] for s in ns.strategies)
    assert not any(s.input_specs[0].dims[0] or s.input_specs[0].dims[2] for s in ns.strategies)


def _x_cut_on(ns) -> set[int]:
    return {d for s in ns.strategies for d, axes in enumerate(s.input_specs[0].dims) if axes}


def test_index_with_arange_indices_cuts_the_indexed_dim():
    # Hugging Face's padding mask: mask[arange(B)[:, None, None, None], arange(S)[None, None, None, :]].
    mask = lambda m, y: (y > 0)[torch.arange(4)[:, None, None, None], torch.arange(8)[None, None, None, :]]
    ns, graph, node, values = _strategies(mask, (f32(4, 8),), aten.index.Tensor)
    assert {"S01RRR = S01R, S01RRR, RRRR", "S0RRS1 = S0S1, S0RRR, RRRS1"} <= {s.name for s in ns.strategies}
    # The arange is the index's only sharded form: x replicated beside a cut index is not offered
    # (mixed over the two axes it would be wrong, see test_checker_rejects_mixed_arange_cut).
    assert all(s.input_specs[0].dims[0] == s.input_specs[1].dims[0] for s in ns.strategies)
    # Through + 0, a cast, view/expand/transpose; and beside an arbitrary index on the same dim.
    ns, *_ = _strategies(lambda m, x: x[(torch.arange(4) + 0).int().view(1, 4).expand(2, 4).transpose(0, 1)],
                         (f32(4, 8),), aten.index.Tensor)
    assert _x_cut_on(ns) == {0, 1}
    ns, *_ = _strategies(lambda m, x, i: x[torch.arange(4), :, i], (f32(4, 4, 8), IDX4), aten.index.Tensor)
    assert _x_cut_on(ns) == {0, 1}
    # Not an arange over the whole dim: short of it, not from 0, or an input holding one.
    for fn, args, cut in [(lambda m, x: x[:, torch.arange(4)], (f32(4, 8),), {0}),
                          (lambda m, x: x[torch.arange(1, 5) % 4], (f32(4, 8),), {1}),
                          (lambda m, x: x[torch.arange(1, 5)], (f32(8, 8),), {1}),
                          (lambda m, x, i: x[i], (f32(4, 8), torch.arange(4)), {1})]:
        ns, *_ = _strategies(fn, args, aten.index.Tensor)
        assert _x_cut_on(ns) == cut


def test_index_strategies_depend_on_where_the_indices_come_from():
    """Two index nodes alike in shapes share no strategy list when only one index is an arange."""
    graph, _ = export_nodes(Fn(lambda m, x, i: (x[torch.arange(4)], x[i])), (f32(4, 8), IDX4))
    table = enumerate_strategies(graph, mesh_shape=(2, 2))
    a, b = [n.name for n in graph.graph.nodes if n.target is aten.index.Tensor]
    assert "S01R = S01R, S01" in {s.name for s in table[a].strategies}
    assert all(s.input_specs[0].dims[0] == () for s in table[b].strategies)


def test_checker_rejects_mixed_arange_cut():
    """Why the arange index has one sharded form: x replicated on the outer axis and cut on the
    inner one (index cut on both) hands device (1, 0) index block 2 = rows 4..5 of x, which lie
    in x's block 0 (rows 0..3) on axis 1 - out of bounds; and the default kernel (no rebasing)
    is wrong too."""
    ns, graph, node, values = _strategies(lambda m, x: x[torch.arange(8)], (f32(8, 4),), aten.index.Tensor)
    op = OpInfo(node, graph, MeshSpec.of((2, 2)))
    handler = handler_for(node.target)
    hw = load_hardware("h100-nvlink")
    plain, aligned = AxisOption((None, 0), (0,), "i0"), AxisOption((0, 0), (0,), "x0i0")
    mixed = [s for s in expand(op, [plain, aligned], hw, default_name)
             if s.input_specs[0].dims[0] == (1,) and s.input_specs[1].dims[0] == (0, 1)]
    assert mixed
    with pytest.raises((AssertionError, IndexError)):
        check_strategy(op, handler, mixed[0], operand_values(op, values))
    good = ns.by_name("S01R = S01R, S01")
    check_strategy(op, handler, good, operand_values(op, values))

    class NoRebase:
        kernel = staticmethod(default_kernel)

    with pytest.raises((AssertionError, IndexError)):
        check_strategy(op, NoRebase, good, operand_values(op, values))


def test_arange_creates_local_block():
    ns, graph, node, values = _strategies(lambda m, x: torch.arange(3, 35, 2) + x, (torch.ones(16),),
                                          aten.arange.start_step, mesh=(1, 4))
    op = OpInfo(node, graph, MeshSpec.of((1, 4)))
    s = ns.by_name("S1 = ()")
    kernel = handler_for(node.target).kernel(op, s)
    assert kernel.uses_comm
    got = run_on_simulated_mesh((1, 4), lambda c, comm: _run(kernel, op, [], comm)[0])
    assert torch.equal(got[(0, 2)], torch.arange(3, 35, 2)[8:12])


def test_assert_metadata_checks_local_size_in_any_layout():
    # export cannot trace a size argument (fake-tensor bug), so give the captured node one.
    _, graph, node, values = _strategies(lambda m, x: x.to(torch.float64), (f32(8, 4),),
                                         aten._assert_tensor_metadata.default)
    node.args = (node.args[0], [8, 4])
    for mesh in MESHES:
        strategies = check_all_strategies(graph, node, values, mesh)
        assert any(not s.input_specs[0].is_replicated() for s in strategies)
    op = OpInfo(node, graph, MeshSpec.of((1, 4)), free=True)
    s = next(s for s in node_strategies(graph, node, op.mesh, load_hardware("h100-nvlink")).strategies
             if s.input_specs[0].dims[0])
    kernel = handler_for(node.target).kernel(op, s)
    assert kernel.kwargs["size"] == [2, 4]


def test_getitem_offers_every_dim():
    ns, *_ = _strategies(lambda m, x: x.split(2, 0)[1], (f32(4, 8, 4),), operator.getitem, index=1)
    assert _all_sharded(ns, "in") == {(0, 0), (0, 1), (0, 2)}
    assert all(s.input_specs == s.output_specs for s in ns.strategies)


MY_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.cat.default,
    aten.stack.default, aten.slice.Tensor, aten.select.int, aten.index.Tensor,
    aten.index_select.default, aten.gather.default, aten.contiguous.default, aten.clone.default,
    aten.alias.default, aten.detach.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten.to.other, aten.type_as.default, aten._assert_tensor_metadata.default, operator.getitem,
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default,
    aten.zeros.default, aten.full.default, aten.empty.memory_format, aten.new_ones.default,
    aten.new_zeros.default, aten.new_full.default, aten.new_empty.default, aten.ones_like.default,
    aten.zeros_like.default, aten.full_like.default, aten.scalar_tensor.default,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.ge.Scalar,
    aten.gt.Tensor, aten.eq.Tensor, aten.ne.Tensor, aten.eq.Scalar, aten.ne.Scalar,
    aten.cumsum.default, aten.diff.default, aten.pad.default, aten.constant_pad_nd.default,
}


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_model_nodes_have_strategies_and_check_on_real_values(name):
    if "tiny" in name:
        pytest.importorskip("transformers")
    from autoshard.models import build_model

    model, args, kwargs = build_model(name, device="cpu")
    graph, values = export_nodes(model, args, kwargs)
    table = enumerate_strategies(graph, mesh_shape=(2, 2), fallback="replicate")
    seen = set()
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        h = handler_for(node.target)
        mine = node.target in MY_OPS or getattr(node.target, "__name__", "").startswith("wrap_with")
        if not mine:
            continue
        assert h is not None and not table[node.name].fallback, f"{node.name} ({node.target}) fell back"
        assert len(table[node.name]) >= 1
        op = OpInfo(node, graph, MeshSpec.of((2, 2)), free=h.free)
        if op.signature() in seen:   # identical layers: checked once
            continue
        seen.add(op.signature())
        _check_node(graph, node, values, (2, 2))
