"""Every strategy of every handler, forced one at a time, on 4 real gloo ranks: forward outputs and the
gradients of inputs and parameters equal the single-device module's (fp32, rtol 1e-5, atol 1e-6)."""
from __future__ import annotations

import pytest
import torch

from autoshard.handlers import REGISTRY
from op_cases import CASES, build_case
from runtime_harness import Reference, capture_case, case_seed, check_plan, forced_plans, on_all_ranks

MESHES = [(2, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("case", list(CASES))
def test_every_strategy_matches_single_device(case, mesh):
    torch.manual_seed(0)
    module, inputs = build_case(case)
    graph = capture_case(module, inputs, case)
    ref = Reference(module, inputs, seed=case_seed(case))
    count = 0
    for node, strategy, plan in forced_plans(graph, mesh):
        on_all_ranks(f"{case} on {mesh}: node {node} strategy {strategy!r}", check_plan, module, inputs, plan,
                     graph, ref, f"{node} {strategy!r}")
        count += 1
    assert count > 0


def test_cases_cover_every_handler():
    """Each handler's rule set (the rules function, shared by a family of ops) appears in some case's graph."""
    from autoshard.handlers import handler_for

    seen = set()
    for case in CASES:
        module, inputs = build_case(case)
        graph = capture_case(module, inputs, case)
        for node in graph.graph.nodes:
            h = handler_for(node.target) if node.op == "call_function" else None
            if h is not None:
                seen.add(h.rules.__code__)
    missing = sorted({f"{h.family}:{h.rules.__name__}" for h in REGISTRY.values() if h.rules.__code__ not in seen})
    assert not missing, f"no case exercises {missing}"
