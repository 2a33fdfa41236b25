"""Grouped matmul of mixture-of-experts layers (handlers/grouped_mm.py): every strategy simulated on
each 4-device mesh, for transformers' custom op."""
from __future__ import annotations

import torch
import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

from autoshard.handlers import handler_for
from handler_utils import MESHES, Fn, check_all_strategies, export_nodes, find_node

OFFSETS = torch.tensor([2, 2, 6, 8], dtype=torch.int32)     # expert 1 gets no rows


def _case():
    torch.manual_seed(0)
    module = Fn(lambda m, x, offs: torch.ops.transformers.grouped_mm_fallback(x, m.w, offs),
                w=torch.nn.Parameter(torch.randn(4, 8, 4)))
    graph, values = export_nodes(module, (torch.randn(8, 8).requires_grad_(), OFFSETS))
    return graph, values, find_node(graph, torch.ops.transformers.grouped_mm_fallback.default)


def test_every_strategy_simulates() -> None:
    graph, values, node = _case()
    for mesh in MESHES:
        strategies = check_all_strategies(graph, node, values, mesh)
        tags = {t for s in strategies for t in s.tags}
        assert {"s", "k", "e", "n"} <= tags, tags


def test_custom_op_is_found_by_name() -> None:
    """transformers' op is registered by name: the handler needs no transformers import to load."""
    assert handler_for(torch.ops.transformers.grouped_mm_fallback.default).family == "matmul"


def test_expert_parallel_sums_the_input_gradient() -> None:
    """Experts split over an axis: the output is partial and so is the gradient of the replicated
    input (each device back-propagates into its experts' rows only)."""
    graph, values, node = _case()
    strategies = check_all_strategies(graph, node, values, (1, 4))
    expert = next(s for s in strategies if s.tags[-1] == "e")
    assert expert.input_specs[1].dims[0] == (1,) and not expert.input_specs[0].dims[0]
    assert sorted((c.phase, c.operand, c.axes) for c in expert.comm) == [("bwd", "in0", (1,)), ("fwd", "out0", (1,))]
