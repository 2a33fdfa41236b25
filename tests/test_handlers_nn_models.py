"""The nn-op handlers on the model zoo: every conv/embedding/attention/loss/pooling node of the
presets gets sharded strategies on a 2x2 mesh, and the real GPT-2 / Llama nodes simulate exactly."""
import pytest
import torch

from autoshard.capture import capture
from autoshard.enumerate import node_strategies
from autoshard.hardware import load_hardware
from autoshard.mesh import MeshSpec
from autoshard.models import build_model
from handler_utils import check_all_strategies, export_nodes, find_node

aten = torch.ops.aten
NN_FAMILIES = {"conv", "embedding", "attention", "loss", "pooling"}
MESH = MeshSpec((2, 2))


def _family_nodes(graph):
    from autoshard.handlers import handler_for

    return [n for n in graph.nodes() if (h := handler_for(n.target)) is not None and h.family in NN_FAMILIES]


@pytest.fixture(scope="module", params=["cnn", "gpt2-tiny", "llama-tiny", "bert-tiny"])
def preset(request):
    if request.param != "cnn":
        pytest.importorskip("transformers")
    model, args, kwargs = build_model(request.param)
    return request.param, capture(model, args, kwargs)


def test_every_nn_node_gets_sharded_strategies(preset):
    name, graph = preset
    hw = load_hardware("h100-nvlink")
    nodes = _family_nodes(graph)
    lm = {"scaled_dot_product_attention": 2, "cross_entropy_loss": 1}
    expected = {"cnn": {"conv2d": 2, "max_pool2d": 1, "adaptive_avg_pool2d": 1},
                "gpt2-tiny": {"embedding": 2, **lm}, "llama-tiny": {"embedding": 1, **lm},
                "bert-tiny": {"embedding": 3, **lm}}[name]
    found: dict[str, int] = {}
    for node in nodes:
        op = node.target._schema.name.split("::")[-1]
        found[op] = found.get(op, 0) + 1
        ns = node_strategies(graph, node, MESH, hw)
        sharded = [s for s in ns if s.split > 1]
        assert sharded, f"{node.name} ({op}) got only {ns.names()}"
    assert found == expected


def _tags(graph, target, index=0):
    ns = node_strategies(graph, find_node(graph, target, index), MESH, load_hardware("h100-nvlink"))
    return {t for s in ns for t in s.tags}


def test_transformer_nodes_offer_the_parallel_layouts(preset):
    name, graph = preset
    if name == "cnn":
        assert _tags(graph, aten.conv2d.default, 1) == {"n", "cout", "cin", "R"}   # 8 in-channels
        return
    assert {"b0", "b1", "sq"} <= _tags(graph, aten.scaled_dot_product_attention.default)   # batch, heads
    assert {"v", "h", "i0"} <= _tags(graph, aten.embedding.default)                        # vocab-parallel
    assert {"row0", "c"} <= _tags(graph, aten.cross_entropy_loss.default)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_real_transformer_nodes_simulate_exactly(name):
    """Token embedding (Llama: padding_idx 0), attention and the loss of the shifted labels
    (which end in ignore_index -100) on real values, every strategy on 2x2."""
    pytest.importorskip("transformers")
    model, args, kwargs = build_model(name, device="cpu")
    graph, values = export_nodes(model, args, kwargs)
    ce = find_node(graph, aten.cross_entropy_loss.default)
    assert (values[ce.args[1].name] == -100).any()
    for target in (aten.embedding.default, aten.scaled_dot_product_attention.default,
                   aten.cross_entropy_loss.default):
        assert check_all_strategies(graph, find_node(graph, target), values, (2, 2))
