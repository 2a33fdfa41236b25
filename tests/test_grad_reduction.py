"""Which gradient all-reduces are left to the buckets (autoshard.grad_reduction), on small hand-made
graphs and on the data-parallel plan of a real GPT-2, whose learned position embedding is looked up
replicated and added to the batch-sharded token embeddings (its gradient is bucketed, as DDP does)."""
from __future__ import annotations

import pytest

from autoshard.grad_reduction import GradNode, plan_gradient_reduction

BOTH = (0, 1)
ALL = frozenset({0, 1})


def param(name: str) -> GradNode:
    return GradNode(name, "param", carries_grad=True)


def op(name: str, *operands: str, sync: tuple = (), replicated_over=None, resharded: tuple = (),
       carries_grad: bool = True) -> GradNode:
    n = len(operands)
    return GradNode(name, "op", tuple(operands), carries_grad, replicated_over,
                    tuple(sync) + ((),) * (n - len(sync)), tuple(resharded) + (False,) * (n - len(resharded)))


def output(*operands: str) -> GradNode:
    return GradNode("output", "output", tuple(operands))


def position_embedding_graph(**lookup) -> list[GradNode]:
    """tok = batch-sharded; pos = replicated lookup of wpe; add(tok, pos) all-reduces pos's gradient."""
    return [param("wte"), param("wpe"), GradNode("ids", "leaf"), GradNode("positions", "leaf"),
            op("tok", "wte", "ids", sync=(BOTH,)),
            op("pos", "wpe", "positions", replicated_over=lookup.pop("replicated_over", ALL), **lookup),
            op("add", "tok", "pos", sync=((), BOTH)),
            output("add")]


def test_a_parameter_read_directly_by_split_computation_is_bucketed():
    r = plan_gradient_reduction([param("w"), GradNode("x", "leaf"), op("mm", "x", "w", sync=((), BOTH)),
                                 output("mm")])
    assert r.bucketed == {"w": BOTH}
    assert r.deferred == {("mm", 1)}


def test_a_partial_gradient_flows_back_through_a_replicated_lookup_to_its_parameter():
    r = plan_gradient_reduction(position_embedding_graph())
    assert r.bucketed == {"wte": BOTH, "wpe": BOTH}          # in order of first use
    assert list(r.bucketed) == ["wte", "wpe"]
    assert r.deferred == {("tok", 0), ("add", 1)}


def test_a_consumer_giving_a_whole_gradient_keeps_the_all_reduce_inline():
    nodes = position_embedding_graph()
    nodes.insert(-1, op("other", "pos"))        # replicated use of pos whose gradient is whole
    nodes[-1] = output("add", "other")
    r = plan_gradient_reduction(nodes)
    assert "wpe" not in r.bucketed and ("add", 1) not in r.deferred
    assert r.bucketed == {"wte": BOTH}


@pytest.mark.parametrize("change", [
    {"replicated_over": frozenset({1})},         # the lookup is split over axis 0
    {"replicated_over": None},                   # it runs a collective or reads a resharded operand
    {"resharded": (True,)},                      # wpe reaches it resharded
])
def test_the_chain_must_run_replicated_over_the_axes_from_the_stored_parameter(change):
    r = plan_gradient_reduction(position_embedding_graph(**change))
    assert "wpe" not in r.bucketed and ("add", 1) not in r.deferred


def test_an_input_that_needs_a_gradient_stops_the_chain():
    nodes = position_embedding_graph()
    nodes[3] = GradNode("positions", "leaf", carries_grad=True)
    r = plan_gradient_reduction(nodes)
    assert ("add", 1) not in r.deferred and "wpe" not in r.bucketed


def test_a_consumer_without_gradient_is_ignored_and_differing_axes_are_not_bucketed():
    nodes = position_embedding_graph()
    nodes.insert(-1, op("check", "pos", carries_grad=False))      # e.g. an assert on the tensor's metadata
    assert plan_gradient_reduction(nodes).bucketed == {"wte": BOTH, "wpe": BOTH}
    r = plan_gradient_reduction([param("w"), GradNode("x", "leaf"), op("a", "x", "w", sync=((), (0,))),
                                 op("b", "a", "w", sync=((), BOTH)), output("b")])
    assert r.bucketed == {} and r.deferred == frozenset()


def test_the_data_parallel_plan_of_gpt2_all_reduces_exactly_the_parameter_gradients():
    """As DDP: the only backward all-reduces are the parameters' gradients, once each (the position
    embedding's included), and the step model prices no inline gradient all-reduce."""
    pytest.importorskip("transformers")
    import autoshard
    from autoshard.capture import capture
    from autoshard.models import build_model

    model, args, kwargs = build_model("gpt2-tiny", batch=8, seq=16)
    plan = autoshard.plan(capture(model, args, kwargs), mesh=(2, 2), hardware="cpu-gloo",
                          baseline="data_parallel", outputs="local")
    backward = {tuple(c.axes): c.nbytes for c in plan.comm if c.phase == "bwd" and c.kind == "all_reduce"}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert backward == {BOTH: param_bytes}
