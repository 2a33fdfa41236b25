"""Custom ops (torch.library): inlined through their decomposition where one is registered;
otherwise an error naming the op, node and module path, or a reported replicate under
fallback='replicate'."""
from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.capture import INLINED_FROM, capture
from autoshard.enumerate import UnsupportedOpError, enumerate_strategies
from custom_ops_lib import example


def test_opaque_custom_op_is_an_error_naming_op_node_module_and_what_to_do():
    model, args = example("opaque_scaled_mm")
    graph = capture(model, args)
    (node,) = [n for n in graph.nodes() if n.target == torch.ops.astest.opaque_scaled_mm.default]
    assert graph.module_path(node) == "expert"
    with pytest.raises(UnsupportedOpError) as err:
        enumerate_strategies(graph)
    msg = str(err.value)
    assert f"astest.opaque_scaled_mm.default at node '{node.name}' (module 'expert')" in msg
    assert "register_decomposition" in msg and "fallback='replicate'" in msg


def test_opaque_custom_op_under_fallback_replicate_is_reported_and_planned():
    model, args = example("opaque_scaled_mm")
    graph = capture(model, args)
    table = enumerate_strategies(graph, fallback="replicate")
    assert table.fallbacks == ["astest.opaque_scaled_mm.default at node 'opaque_scaled_mm' (module 'expert')"]
    (ns,) = [ns for ns in table if ns.op == "astest.opaque_scaled_mm.default"]
    assert ns.fallback and [s.name for s in ns] == ["RRR = RRR, RR"]
    plan = autoshard.plan(graph, mesh=(2, 2), hardware="h100-nvlink", fallback="replicate")
    assert plan.fallbacks


def test_custom_op_with_a_decomposition_is_inlined_as_aten_ops_in_its_module():
    model, args = example("decomposed_scaled_mm")
    graph = capture(model, args)
    assert not [n for n in graph.nodes() if n.target.namespace == "astest"]
    inlined = [n for n in graph.nodes() if n.meta.get(INLINED_FROM)]
    assert inlined and all(graph.module_path(n) == "expert" for n in inlined)
    assert {n.meta[INLINED_FROM] for n in inlined} == {"astest.decomposed_scaled_mm.default"}
    torch.testing.assert_close(graph.exported.module()(*args), model(*args))
    table = enumerate_strategies(graph)          # every node has a handler, no fallback
    assert not table.fallbacks
    # the weight of the inlined matmul may be sharded (column-parallel), as any matmul's
    mm = [ns for ns in table if ns.node in {n.name for n in inlined} and len(ns) > 1]
    assert mm, "the inlined ops offer no sharded strategy"
