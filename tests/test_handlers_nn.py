"""Convolution, pooling and embedding handlers: option sets, and every strategy simulated on real
values on the (2,2), (1,4) and (4,1) meshes."""
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
from handler_utils import MESHES, Fn, check_all_strategies, export_nodes, find_node, operand_values

aten = torch.ops.aten


def _rand(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).requires_grad_()


def check_everywhere(module, args, target, meshes=MESHES):
    """Export once; simulate every strategy of the first ``target`` node on each mesh.
    Returns {mesh: per-axis tag pairs of the strategies}."""
    graph, values = export_nodes(module, args)
    node = find_node(graph, target)
    return {mesh: {s.tags for s in check_all_strategies(graph, node, values, mesh)} for mesh in meshes}


def axis_tags(tag_pairs):
    return {t for pair in tag_pairs for t in pair}


# -- convolution ----------------------------------------------------------------------------------

CONV_CASES = {
    "conv2d_bias": (nn.Conv2d(4, 8, 3, padding=1), (4, 4, 6, 6), aten.conv2d.default, {"n", "cout", "cin"}),
    "conv2d_nobias_stride": (nn.Conv2d(4, 8, 3, stride=2, bias=False), (4, 4, 7, 7), aten.conv2d.default,
                             {"n", "cout", "cin"}),
    "conv2d_same_dilated": (nn.Conv2d(4, 8, 3, padding="same", dilation=2), (4, 4, 6, 6),
                            aten.conv2d.padding, {"n", "cout", "cin"}),
    "conv1d_groups4": (nn.Conv1d(8, 8, 3, groups=4), (4, 8, 9), aten.conv1d.default, {"n", "g"}),
    "depthwise2d": (nn.Conv2d(4, 8, 3, groups=4, padding=1), (4, 4, 5, 5), aten.conv2d.default, {"n", "g"}),
    "conv3d": (nn.Conv3d(4, 8, 2), (4, 4, 3, 3, 3), aten.conv3d.default, {"n", "cout", "cin"}),
    "unbatched2d": (nn.Conv2d(4, 8, 3), (4, 5, 5), aten.conv2d.default, {"cout", "cin"}),
    "transpose2d": (nn.ConvTranspose2d(4, 8, 3, stride=2), (4, 4, 3, 3), aten.conv_transpose2d.input,
                    {"n", "cout", "cin"}),
    "transpose1d_groups4": (nn.ConvTranspose1d(8, 8, 3, groups=4), (4, 8, 5), aten.conv_transpose1d.default,
                            {"n", "g"}),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_every_strategy_simulates(case):
    torch.manual_seed(0)
    layer, shape, target, options = CONV_CASES[case]
    tags = check_everywhere(Fn(lambda m, x: m.conv(x), conv=layer), (_rand(*shape),), target)
    assert axis_tags(tags[(2, 2)]) == options | {"R"}
    assert len(tags[(2, 2)]) == (len(options) + 1) ** 2       # every pair divides here
    assert len(tags[(1, 4)]) == len(tags[(4, 1)]) == len(options) + 1


@pytest.mark.parametrize("transposed", [False, True])
def test_aten_convolution_simulates(transposed):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn((4, 8, 3, 3) if transposed else (8, 4, 3, 3)))
    b = nn.Parameter(torch.randn(8))

    def fn(m, x):
        return torch.convolution(x, m.w, m.b, [1, 1], [1, 1], [1, 1], transposed, [0, 0], 1)

    module = Fn(fn)
    module.w, module.b = w, b
    tags = check_everywhere(module, (_rand(4, 4, 5, 5),), aten.convolution.default)
    assert axis_tags(tags[(2, 2)]) == {"n", "cout", "cin", "R"}


def test_conv_groups_not_dividing_every_factor_are_not_sharded():
    # groups=2: a 4-way split of the groups would cut them, so no group option on a 4-device mesh
    tags = check_everywhere(Fn(lambda m, x: m.conv(x), conv=nn.Conv1d(8, 8, 3, groups=2)),
                            (_rand(4, 8, 9),), aten.conv1d.default, meshes=[(2, 2), (1, 4)])
    assert axis_tags(tags[(2, 2)]) == axis_tags(tags[(1, 4)]) == {"n", "R"}


def test_conv_names_use_logical_notation():
    graph, _ = export_nodes(Fn(lambda m, x: m.conv(x), conv=nn.Conv2d(4, 8, 3)), (_rand(4, 4, 6, 6),))
    ns = node_strategies(graph, find_node(graph, aten.conv2d.default), MeshSpec((2, 2)),
                         load_hardware("h100-nvlink"))
    names = set(ns.names())
    # batch x out-channels, and in-channels (partial output) x batch
    assert {"S0S1 = S0R x RS1", "S1R = S1S0 x S0R", "RR = RR x RR", "S01R = S01R x RR"} <= names
    cin = next(s for s in ns if s.name == "RR = RS01 x S01R")
    assert [c.phase for c in cin.comm if c.operand == "out0"] == ["fwd"]


def test_conv_bias_added_once_is_needed():
    """The check can fail: adding the bias on every device of an in-channel split is caught."""
    graph, values = export_nodes(Fn(lambda m, x: m.conv(x), conv=nn.Conv2d(4, 8, 3)), (_rand(4, 4, 6, 6),))
    node = find_node(graph, aten.conv2d.default)
    mesh = MeshSpec((1, 4))
    ns = node_strategies(graph, node, mesh, load_hardware("h100-nvlink"))
    handler = handler_for(node.target)
    op = OpInfo(node, graph, mesh)
    cin = next(s for s in ns if "cin" in s.tags)
    check_strategy(op, handler, cin, operand_values(op, values))
    with pytest.raises(AssertionError):
        check_strategy(op, dataclasses.replace(handler, kernel=default_kernel), cin,
                       operand_values(op, values))


# -- pooling --------------------------------------------------------------------------------------

POOL_CASES = {
    "max_pool2d": (lambda m, x: F.max_pool2d(x, 2), (4, 8, 6, 6), aten.max_pool2d.default),
    "max_pool2d_indices": (lambda m, x: F.max_pool2d(x, 3, 2, 1, return_indices=True)[0] * 1.0,
                           (4, 8, 6, 6), aten.max_pool2d_with_indices.default),
    "avg_pool2d": (lambda m, x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), (4, 8, 6, 6),
                   aten.avg_pool2d.default),
    "adaptive_avg_pool2d": (lambda m, x: F.adaptive_avg_pool2d(x, (2, 3)), (4, 8, 7, 7),
                            aten.adaptive_avg_pool2d.default),
    "adaptive_max_pool2d": (lambda m, x: F.adaptive_max_pool2d(x, 3), (4, 8, 7, 7),
                            aten.adaptive_max_pool2d.default),
    "max_pool1d": (lambda m, x: F.max_pool1d(x, 2), (4, 8, 6), aten.max_pool1d.default),
    "avg_pool1d": (lambda m, x: F.avg_pool1d(x, 2), (4, 8, 6), aten.avg_pool1d.default),
    "adaptive_avg_pool1d": (lambda m, x: F.adaptive_avg_pool1d(x, 4), (4, 8, 6),
                            aten.adaptive_avg_pool1d.default),
    "max_pool3d": (lambda m, x: F.max_pool3d(x, 2), (4, 8, 4, 4, 4), aten.max_pool3d.default),
    "avg_pool3d": (lambda m, x: F.avg_pool3d(x, 2), (4, 8, 4, 4, 4), aten.avg_pool3d.default),
    "unbatched_max_pool2d": (lambda m, x: F.max_pool2d(x, 2), (8, 6, 6), aten.max_pool2d.default),
}


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_pool_every_strategy_simulates(case):
    fn, shape, target = POOL_CASES[case]
    tags = check_everywhere(Fn(fn), (_rand(*shape),), target)
    lead = len(shape) - int(target.__name__.split("pool")[1][0])       # "max_pool2d..." -> 2 spatial
    assert axis_tags(tags[(2, 2)]) == {f"d{d}" for d in range(lead)} | {"R"}
    assert len(tags[(2, 2)]) == (lead + 1) ** 2


# -- embedding ------------------------------------------------------------------------------------

def _indices(vocab, shape, must_have=()):
    idx = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))
    for i, v in enumerate(must_have):
        idx.view(-1)[i] = v
    return idx


@pytest.mark.parametrize("padding_idx", [None, 3, 13])
def test_embedding_every_strategy_simulates(padding_idx):
    torch.manual_seed(0)
    emb = nn.Embedding(16, 8, padding_idx=padding_idx)
    pad = () if padding_idx is None else (padding_idx, padding_idx)
    tags = check_everywhere(Fn(lambda m, i: m.emb(i), emb=emb), (_indices(16, (4, 6), pad),),
                            aten.embedding.default)
    assert axis_tags(tags[(2, 2)]) == {"i0", "i1", "h", "v", "R"}
    assert ("v", "v") in tags[(2, 2)] and ("i0", "v") in tags[(2, 2)]
    assert ("i1", "i1") not in tags[(2, 2)]          # 6 indices per row do not split 4 ways


def test_embedding_padding_row_gradient_stays_zero_vocab_parallel():
    """The padding row of a vocab shard other than the first keeps a zero gradient."""
    emb = nn.Embedding(16, 8, padding_idx=13)
    graph, values = export_nodes(Fn(lambda m, i: m.emb(i), emb=emb), (_indices(16, (4, 6), (13, 13, 12)),))
    node = find_node(graph, aten.embedding.default)
    mesh = MeshSpec((1, 4))
    handler = handler_for(node.target)
    op = OpInfo(node, graph, mesh)
    vocab = next(s for s in node_strategies(graph, node, mesh, load_hardware("h100-nvlink")) if "v" in s.tags)
    check_strategy(op, handler, vocab, operand_values(op, values))

    def no_local_padding(op, strategy):   # the masked lookup, but padding_idx dropped
        k = handler.kernel(op, strategy)
        if "v" not in strategy.tags:      # the unsharded reference stays right
            return k
        return dataclasses.replace(k, args=k.args[:2] + (-1,) + k.args[3:])

    with pytest.raises(AssertionError, match="gradient of operand 0"):
        check_strategy(op, dataclasses.replace(handler, kernel=no_local_padding), vocab,
                       operand_values(op, values))


def test_embedding_scale_grad_by_freq_only_shards_hidden():
    emb = nn.Embedding(16, 8, scale_grad_by_freq=True)
    tags = check_everywhere(Fn(lambda m, i: m.emb(i), emb=emb), (_indices(16, (4, 8), (5, 5, 5)),),
                            aten.embedding.default)
    assert axis_tags(tags[(2, 2)]) == {"h", "R"}
