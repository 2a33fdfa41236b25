"""Whole-graph enumeration: every node of every supported model gets strategies, and the specs a
consumer asks for are layouts of the tensor its producer makes (same local shard shapes)."""
import operator

import pytest
import torch

from autoshard import UnsupportedOpError, capture, enumerate_strategies
from autoshard.models import build_model
from autoshard.reshard import reshard_cost
from autoshard.hardware import load_hardware

MODELS = ["mlp", "cnn", "gpt2-tiny", "llama-tiny", "bert-tiny"]


@pytest.fixture(scope="module", params=MODELS)
def captured(request):
    model, args, kwargs = build_model(request.param, device="meta")
    return capture(model, args, kwargs, name=request.param)


@pytest.mark.parametrize("mesh", [(2, 2), (2, 4), (1, 4)], ids=str)
def test_every_node_has_strategies_without_fallback(captured, mesh):
    table = enumerate_strategies(captured, mesh_shape=mesh, hardware="h100-nvlink")
    assert not table.fallbacks
    assert len(table) == len(list(captured.graph.nodes))
    for ns in table:
        assert len(ns) >= 1, ns.node
        assert len(set(ns.names())) == len(ns), f"duplicate strategy names at {ns.node}"


def test_consumer_specs_are_layouts_of_the_producer_tensor(captured):
    """For every edge, each input spec of the consumer fits the producer's output shape (so the
    local shard it runs on is a block of the producer's tensor), and the producer reaches it."""
    mesh = (2, 2)
    hw = load_hardware("h100-nvlink")
    table = enumerate_strategies(captured, mesh_shape=mesh, hardware=hw)
    for ns in table:
        node = captured.node(ns.node)
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        for j, producer in enumerate(ns.operand_nodes):
            meta = captured.tensor_meta(producer)
            if isinstance(meta, tuple):
                continue
            producer_specs = {s.output_specs[0] for s in table[producer].strategies
                              if s.output_specs and s.output_specs[0] is not None}
            for s in ns.strategies:
                spec = s.input_specs[j]
                assert spec.fits(meta.shape, mesh), (ns.node, producer, str(spec))
                if spec in producer_specs:
                    continue
                src = next(iter(producer_specs))
                assert reshard_cost(src, spec, meta.shape, meta.dtype.itemsize, mesh, hw) >= 0


def test_identical_signatures_share_strategies():
    model, args, kwargs = build_model("llama-tiny", device="meta", num_layers=3)
    graph = capture(model, args, kwargs)
    table = enumerate_strategies(graph, mesh_shape=(2, 2), hardware="h100-nvlink")
    linears = [ns for ns in table if ns.op == "aten.linear.default"]
    by_path = {}
    for ns in linears:
        by_path.setdefault(ns.module_path.split(".")[-1], []).append(ns)
    q_projs = by_path["q_proj"]
    assert len(q_projs) == 3
    assert q_projs[0].strategies == q_projs[1].strategies == q_projs[2].strategies


def test_unsupported_op_names_op_node_and_module():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.special.i0(self.inner(x))

    graph = capture(Odd(), (torch.randn(4, 8),))
    with pytest.raises(UnsupportedOpError) as e:
        enumerate_strategies(graph, mesh_shape=(2, 2), hardware="h100-nvlink")
    msg = str(e.value)
    assert "aten.special_i0" in msg or "i0" in msg
    assert "node" in msg and "fallback='replicate'" in msg
    table = enumerate_strategies(graph, mesh_shape=(2, 2), hardware="h100-nvlink", fallback="replicate")
    assert len(table.fallbacks) == 1 and "i0" in table.fallbacks[0]
    fallback_node = [ns for ns in table if ns.fallback][0]
    assert fallback_node.names() == ["R = R"] or len(fallback_node) == 1
