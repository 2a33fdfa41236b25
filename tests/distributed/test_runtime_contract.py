"""The runtime runs from the plan alone: with every strategy generator made to raise after planning
(the enumerator, the expander, each handler's per-axis rules), whole models parallelized under
their plans train exactly like one device and communicate what the plan predicts (see
tests/test_plan_contract.py for the lowering itself)."""
from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from handler_utils import no_enumeration
from runtime_harness import ATOL, RTOL, device_mesh, on_all_ranks
from test_runtime_models import _graph, _inputs, _plan_on_rank0, _predicted_comm, _train

STEPS = 2
CASES = [("gpt2-tiny", "megatron"), ("llama-tiny", "solved"), ("cnn", "megatron")]


def _run(name: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh_shape = (2, 2)
    plan = _plan_on_rank0(name, kind, mesh_shape)       # planning enumerates; nothing after it may
    graph = _graph(name)
    model, args, kwargs = _inputs(name)
    reference = copy.deepcopy(model)
    with monkeypatch.context() as patch:
        no_enumeration(patch)
        pm = autoshard.parallelize(model, plan, device_mesh(mesh_shape), graph=graph)
        losses = _train(pm, args, kwargs, STEPS, pm.comm.counter)
        full = pm.state_dict()
    assert {k: v[0] for k, v in pm.comm.counter.totals().items()} == _predicted_comm(plan), \
        "measured communication != plan"
    for step, (got, want) in enumerate(zip(losses, _train(reference, args, kwargs, STEPS))):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"loss of step {step}: {m}")
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name, kind", CASES)
def test_a_parallelized_model_trains_from_the_plan_alone(name, kind, monkeypatch):
    on_all_ranks(f"{name} with the {kind} plan, no strategy enumerated", _run, name, kind, monkeypatch)
