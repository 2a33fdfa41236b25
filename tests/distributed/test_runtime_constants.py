"""Lifted tensor constants on 4 gloo ranks (2x2): an index list in forward (``qkv[..., [-2], :]``, as
multi-query attention splits its fused projection) becomes a constant placeholder; captured on meta
tensors it has no values, and the runtime reads them from a capture of the real model. Under the
solved plan, the data-parallel baseline and every strategy of the index nodes, outputs and gradients
equal the single-device module's."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoshard
from autoshard.runtime.constants import ConstantError
from runtime_harness import Reference, capture_case, check_plan, device_mesh, forced_plans, on_all_ranks

pytestmark = pytest.mark.timeout(300)

MESH = (2, 2)


class SplitHeads(nn.Module):
    """A fused projection split by index lists: query heads ``[:-2]``, one key ``[[-2]]``, one value ``[[-1]]``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4 * 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.proj(x).view(*x.shape[:2], 4, 6)
        q, k, v = qkv[..., :-2, :], qkv[..., [-2], :], qkv[..., [-1], :]
        return (q * k + v).sum(-2)


def _case() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    return SplitHeads(), [torch.randn(4, 8, 8)]


def test_constants_are_meta_in_the_planned_graph() -> None:
    module, inputs = _case()
    graph = capture_case(module, inputs, "split_heads")
    assert len(graph.constant_fqn) == 2
    assert all(graph.exported.constants[f].is_meta for f in graph.constant_fqn.values())


@pytest.mark.parametrize("baseline", [None, "data_parallel"], ids=["solved", "data_parallel"])
def test_plans_with_constants_equal_one_device(baseline: str | None) -> None:
    module, inputs = _case()
    graph = capture_case(module, inputs, "split_heads")
    plan = autoshard.plan_once(graph, mesh=MESH, hardware="cpu-gloo", baseline=baseline)
    ref = Reference(module, inputs)
    on_all_ranks(f"split_heads {baseline or 'solved'}", check_plan, copy.deepcopy(module), inputs, plan, graph, ref,
                 f"split_heads {baseline or 'solved'}")


def test_every_strategy_of_the_indexing_nodes() -> None:
    module, inputs = _case()
    graph = capture_case(module, inputs, "split_heads")
    ref = Reference(module, inputs)
    lifted = [use for name in graph.constant_fqn for use in graph.node(name).users]     # lift_fresh_copy
    index_nodes = {use.name for node in lifted for use in node.users}
    checked = 0
    for node, strategy, plan in forced_plans(graph, MESH):
        if node not in index_nodes:
            continue
        what = f"{node} {strategy}"
        on_all_ranks(what, check_plan, copy.deepcopy(module), inputs, plan, graph, ref, what)
        checked += 1
    assert checked >= 4, f"only {checked} strategies of {sorted(index_nodes)} checked"


def test_meta_model_is_an_error_naming_the_constants() -> None:
    module, inputs = _case()
    graph = capture_case(module, inputs, "split_heads")
    plan = autoshard.plan_once(graph, mesh=MESH, hardware="cpu-gloo")
    with torch.device("meta"):
        meta = SplitHeads()
    with pytest.raises(ConstantError, match=r"lifted_tensor_0.*real weights"):
        autoshard.parallelize(meta, plan, device_mesh(MESH), graph=graph)
