"""Attention and classification-loss handlers: option sets, and every strategy simulated on real
values (targets including ignore_index) on the (2,2), (1,4) and (4,1) meshes."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoshard.enumerate import node_strategies
from autoshard.handlers import handler_for
from autoshard.handlers.registry import default_kernel
from autoshard.hardware import load_hardware
from autoshard.mesh import MeshSpec
from autoshard.opinfo import OpInfo
from autoshard.verify import check_strategy
from handler_utils import export_nodes, find_node, operand_values
from test_handlers_nn import Fn, _rand, axis_tags, check_everywhere

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
CE = aten.cross_entropy_loss.default


def _strategy_with(graph, node, mesh, tag):
    """(op, handler, first strategy whose per-axis tags include ``tag``)."""
    mesh = MeshSpec(mesh)
    handler = handler_for(node.target)
    ns = node_strategies(graph, node, mesh, load_hardware("h100-nvlink"))
    return OpInfo(node, graph, mesh), handler, next(s for s in ns if tag in s.tags)


def _broken_for(handler, tag):
    """The handler with its default kernel for strategies using ``tag`` (reference untouched)."""
    def kernel(op, strategy):
        return default_kernel(op, strategy) if tag in strategy.tags else handler.kernel(op, strategy)
    return dataclasses.replace(handler, kernel=kernel)


# -- attention ------------------------------------------------------------------------------------

def _sdpa(**kw):
    return lambda m, q, k, v, *mask: F.scaled_dot_product_attention(q, k, v, *mask, **kw)


ATTENTION_CASES = {
    # name: (function, q shape, k/v shape without the last dim, mask shape or None, mask dtype,
    #        per-axis options on (2, 2)); k gets q's last dim, v one more
    "float_mask_bcast_heads": (_sdpa(), (4, 4, 8, 4), (4, 4, 8), (4, 1, 8, 8), torch.float64,
                               {"b0", "b1", "sq"}),
    "bool_mask_2d": (_sdpa(scale=0.3), (4, 4, 8, 4), (4, 4, 12), (8, 12), torch.bool, {"b0", "b1", "sq"}),
    "causal": (_sdpa(is_causal=True), (4, 4, 8, 4), (4, 4, 8), None, None, {"b0", "b1", "sq"}),
    "causal_longer_keys": (_sdpa(is_causal=True), (2, 4, 8, 4), (2, 4, 12), None, None, {"b0", "b1", "sq"}),
    "gqa_causal": (_sdpa(is_causal=True, enable_gqa=True), (4, 4, 8, 4), (4, 2, 8), None, None,
                   {"b0", "b1", "sq"}),
    "unheaded_3d_causal": (_sdpa(is_causal=True), (4, 8, 4), (4, 8), None, None, {"b0", "sq"}),
}


def _qkv(q, kv):
    return [_rand(*q), _rand(*kv, q[-1]), _rand(*kv, q[-1] + 1)]


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_every_strategy_simulates(case):
    fn, q, kv, mask_shape, mask_dtype, options = ATTENTION_CASES[case]
    args = _qkv(q, kv)
    if mask_shape is not None:
        args.append(_rand(*mask_shape) if mask_dtype.is_floating_point
                    else torch.rand(mask_shape, generator=torch.Generator().manual_seed(2)) > 0.3)
    tags = check_everywhere(Fn(fn), args, SDPA)
    assert axis_tags(tags[(2, 2)]) == options | {"R"}


def test_gqa_heads_shard_only_in_whole_kv_groups():
    fn, q, kv, *_ = ATTENTION_CASES["gqa_causal"]
    tags = check_everywhere(Fn(fn), _qkv(q, kv), SDPA, meshes=[(2, 2), (1, 4)])
    assert ("b1", "R") in tags[(2, 2)] and ("R", "b1") in tags[(2, 2)]
    assert "b1" not in axis_tags(tags[(1, 4)])         # 2 kv heads cannot split 4 ways
    assert ("b1", "b1") not in tags[(2, 2)]


def test_causal_query_split_needs_the_offset_mask():
    """The check can fail: a local is_causal flag on a block of query rows is caught."""
    fn, q, kv, *_ = ATTENTION_CASES["causal"]
    graph, values = export_nodes(Fn(fn), _qkv(q, kv))
    op, handler, rows = _strategy_with(graph, find_node(graph, SDPA), (1, 4), "sq")
    check_strategy(op, handler, rows, operand_values(op, values))
    with pytest.raises(AssertionError, match="forward output"):
        check_strategy(op, _broken_for(handler, "sq"), rows, operand_values(op, values))


def test_a_boolean_mask_is_saved_at_the_querys_itemsize_in_the_masks_layout():
    """The fused kernel keeps an additive copy of a boolean mask in the query's dtype: a split of
    the heads divides q, k, v, the output and the log-sum-exp, not the (batch, 1, q, k) mask, which
    every device converts whole (an offloaded block copies all of it to host)."""
    q, kv = (4, 4, 8, 4), (4, 4, 8)
    mask = torch.rand((4, 1, 8, 8), generator=torch.Generator().manual_seed(2)) > 0.3
    graph, _ = export_nodes(Fn(_sdpa()), [*_qkv(q, kv), mask])
    node = find_node(graph, SDPA)
    strategies = list(node_strategies(graph, node, MeshSpec((2, 2)), load_hardware("h100-nvlink")))
    whole = next(s for s in strategies if tuple(s.tags) == ("R", "R")).memory.saved
    heads = next(s for s in strategies if tuple(s.tags) == ("b1", "R")).memory.saved
    copy = mask.numel() * torch.get_default_dtype().itemsize
    assert whole - heads == pytest.approx((whole - copy) / 2)


# -- losses ---------------------------------------------------------------------------------------

def _targets(n_classes, shape, ignore_index=-100, n_ignored=3, seed=3):
    t = torch.randint(0, n_classes, shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[1:1 + 2 * n_ignored:2] = ignore_index        # uneven per shard: exercises the count
    return t


class Loss(nn.Module):
    def __init__(self, fn, weight=None):
        super().__init__()
        self.fn = fn
        self.register_buffer("weight", weight)

    def forward(self, x, t):
        return self.fn(x, t, self.weight)


def _ce(**kw):
    return lambda x, t, w: F.cross_entropy(x, t, weight=w, **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["hard", "smooth"])
def test_cross_entropy_every_strategy_simulates(reduction, weighted, smoothing):
    weight = torch.rand(12, generator=torch.Generator().manual_seed(4)) + 0.5 if weighted else None
    module = Loss(_ce(reduction=reduction, label_smoothing=smoothing), weight)
    tags = check_everywhere(module, (_rand(8, 12), _targets(12, (8,))), CE)
    if reduction == "mean":     # a replicated mean from one fused all-reduce, combined only with itself
        assert axis_tags(tags[(2, 2)]) == {"row0", "row0-global", "c", "R"}
        assert len(tags[(2, 2)]) == 9 + 3
        assert not any("row0-global" in t and ("row0" in t or "c" in t) for t in tags[(2, 2)])
    else:
        assert axis_tags(tags[(2, 2)]) == {"row0", "c", "R"}
        assert len(tags[(2, 2)]) == 9


LOSS_CASES = {
    # name: (loss module, input shape, target, op, per-axis options on (2, 2))
    "ce_spatial_ignore5": (Loss(_ce(ignore_index=5)), (4, 8, 4), _targets(8, (4, 4), ignore_index=5), CE,
                           {"row0", "row1", "row0-global", "row1-global", "c"}),
    "ce_prob_target": (Loss(_ce(label_smoothing=0.2), torch.rand(12) + 0.5), (8, 12),
                       torch.rand(8, 12, generator=torch.Generator().manual_seed(5)).softmax(1), CE,
                       {"row0", "c"}),
    "ce_prob_target_sum": (Loss(_ce(reduction="sum")), (8, 12),
                           torch.rand(8, 12, generator=torch.Generator().manual_seed(5)).softmax(1), CE,
                           {"row0", "c"}),
    "ce_unbatched": (Loss(_ce()), (12,), torch.tensor(7), CE, {"c"}),
    "nll_after_log_softmax": (Loss(lambda x, t, w: F.nll_loss(F.log_softmax(x, 1), t, w), torch.rand(12)),
                              (8, 12), _targets(12, (8,)), aten.nll_loss_nd.default,
                              {"row0", "row0-global", "c"}),
    "nll_none_4d": (Loss(lambda x, t, w: F.nll_loss(x, t, reduction="none")), (4, 8, 2, 4),
                    _targets(8, (4, 2, 4)), aten.nll_loss_nd.default, {"row0", "row1", "row2", "c"}),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_every_strategy_simulates(case):
    module, x_shape, target, op, options = LOSS_CASES[case]
    tags = check_everywhere(module, (_rand(*x_shape), target), op)
    assert axis_tags(tags[(2, 2)]) == options | {"R"}


def test_row_split_mean_needs_the_global_count():
    """The check can fail: a local mean over rows with ignored targets is caught."""
    graph, values = export_nodes(Loss(_ce()), (_rand(8, 12), _targets(12, (8,))))
    op, handler, rows = _strategy_with(graph, find_node(graph, CE), (1, 4), "row0")
    assert [c.operand for c in rows.comm if c.phase == "fwd"] == ["out0", "loss denominator"]
    check_strategy(op, handler, rows, operand_values(op, values))
    with pytest.raises(AssertionError, match="forward output"):
        check_strategy(op, _broken_for(handler, "row0"), rows, operand_values(op, values))


def test_vocab_parallel_cross_entropy_prices_its_collectives():
    graph, _ = export_nodes(Loss(_ce()), (_rand(8, 12), _targets(12, (8,))))
    _, _, vocab = _strategy_with(graph, find_node(graph, CE), (1, 4), "c")
    extra = sorted((c.phase, c.operand, c.nbytes) for c in vocab.comm if c.operand != "out0")
    assert extra == [("bwd", "softmax sum-exp grad", 8 * 4), ("fwd", "softmax max", 8 * 4),
                     ("fwd", "softmax sum-exp", 8 * 4)]


# -- losses planned per rank (torch DDP's mean) -----------------------------------------------------

def _ddp_mean(module, x, t, groups):
    """torch DDP's loss: the mean over ``groups`` consecutive slices of the batch of each one's mean."""
    return torch.stack([module(xs, ts) for xs, ts in zip(x.chunk(groups), t.chunk(groups))]).mean()


PER_RANK_CASES = {
    "ce_ignored": (Loss(_ce()), (8, 12), _targets(12, (8,)), CE),
    "ce_weighted_smooth": (Loss(_ce(label_smoothing=0.1), torch.rand(12) + 0.5), (8, 12), _targets(12, (8,)), CE),
    "ce_spatial": (Loss(_ce()), (4, 8, 6), _targets(8, (4, 6), n_ignored=5), CE),
    "nll_weighted": (Loss(lambda x, t, w: F.nll_loss(x, t, w), torch.rand(12)), (8, 12), _targets(12, (8,)),
                     aten.nll_loss_nd.default),
}


@pytest.mark.parametrize("returned", [False, True], ids=["reduced", "returned_per_rank"])
@pytest.mark.parametrize("case", list(PER_RANK_CASES))
def test_per_rank_mean_loss_is_ddps_under_every_strategy_with_no_comm(case, returned):
    """Planned loss="per_rank", each strategy splits only the batch (or nothing), no collective
    counts targets, and the devices' summands add up (over the output's partial axes) to torch DDP's
    loss, their input gradients to its gradient's blocks. Returned per rank (outputs="local"), the
    pending sum stays in the output spec instead of an all-reduce."""
    from autoshard.verify import run_on_simulated_mesh, shard_of

    module, x_shape, target, op_target = PER_RANK_CASES[case]
    x = _rand(*x_shape)
    ref_x = x.detach().clone().requires_grad_()
    want = _ddp_mean(module, ref_x, target, 4)
    want.backward()
    graph, _ = export_nodes(module, (x, target))
    node = find_node(graph, op_target)
    mesh = (2, 2)
    spec_mesh = MeshSpec(mesh)
    strategies = node_strategies(graph, node, spec_mesh, load_hardware("h100-nvlink"), loss="per_rank",
                                 outputs="local" if returned else "global").strategies
    assert {t for s in strategies for t in s.tags} == {"row0", "R"}
    op = OpInfo(node, graph, spec_mesh, loss_groups=4, returns_per_rank=returned)
    weight = module.weight
    for strategy in strategies:
        partial = tuple(a for a, tag in enumerate(strategy.tags) if tag == "row0")
        assert [c.operand for c in strategy.comm if c.phase == "fwd"] == ([] if returned or not partial else ["out0"])
        assert strategy.output_specs[0].partial == (partial if returned else ())
        kernel = handler_for(node.target).kernel(op, strategy)
        assert not kernel.uses_comm

        def device(coord, comm, strategy=strategy, kernel=kernel):
            lx = shard_of(x.detach(), strategy.input_specs[0], mesh, coord).clone().requires_grad_()
            lt = shard_of(target, strategy.input_specs[1], mesh, coord)
            y = kernel.target(lx, lt, weight, **kernel.kwargs)
            y.backward()
            return y.detach(), lx.grad

        results = run_on_simulated_mesh(mesh, device)
        for coord, (y, gx) in results.items():
            label = f"{strategy.name} on {coord}"
            peers = [results[c][0] for c in results if all(c[a] == coord[a] for a in range(2) if a not in partial)]
            torch.testing.assert_close(torch.stack(peers).sum(), want.detach(), msg=label)
            torch.testing.assert_close(gx, shard_of(ref_x.grad, strategy.input_specs[0], mesh, coord), msg=label)


def test_per_rank_mean_loss_refuses_rows_the_mesh_does_not_divide():
    from autoshard.opinfo import UnsupportedOpError

    graph, _ = export_nodes(Loss(_ce()), (_rand(6, 12), _targets(12, (6,))))
    with pytest.raises(UnsupportedOpError, match=r"loss='per_rank'.*6 row\(s\).*multiple of 4"):
        node_strategies(graph, find_node(graph, CE), MeshSpec((2, 2)), load_hardware("h100-nvlink"), loss="per_rank")
    # a sum is the same function either way: its options are the global ones
    graph, _ = export_nodes(Loss(_ce(reduction="sum")), (_rand(6, 12), _targets(12, (6,))))
    tags = {t for s in node_strategies(graph, find_node(graph, CE), MeshSpec((2, 2)), load_hardware("h100-nvlink"),
                                       loss="per_rank") for t in s.tags}
    assert "c" in tags
