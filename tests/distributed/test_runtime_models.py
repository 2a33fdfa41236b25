"""Whole models on 4 gloo ranks: the solver's plan and each baseline plan train exactly like one device.

For each model (tiny configs, dropout off) and plan: 3 optimizer steps give the same losses and the
same parameters as single-device training (fp32, rtol 1e-5, atol 1e-6), and the communication the
runtime records in a step equals the plan's prediction (bytes per kind, mesh axes and phase).

The optimizer is SGD with momentum, whose update is linear in the gradient, so a rounding difference
stays a rounding difference. AdamW divides by the gradient's own size: where a gradient is zero up
to rounding (GPT-2's key bias: softmax ignores a per-row constant) it turns the rounding noise into a
step of size ``lr`` whose sign depends on the summation order. AdamW on sharded parameters is
tested in ``test_runtime_outputs``.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.models import build_model
from autoshard.plans import Plan
from autoshard.runtime import capture_meta
from autoshard.solver.baselines import BASELINES
from runtime_harness import RTOL, ATOL, device_mesh, on_all_ranks

MODELS = ["mlp", "cnn", "gpt2-tiny", "llama-tiny", "bert-tiny"]
PLANS = ["solved", *BASELINES]
BATCH = 8
STEPS = 3
_GRAPHS: dict[str, object] = {}


def _inputs(name: str):
    torch.manual_seed(0)
    model, args, kwargs = build_model(name, device="cpu", batch=BATCH)
    return model, args, kwargs


def _graph(name: str):
    if name not in _GRAPHS:
        model, args, kwargs = _inputs(name)
        _GRAPHS[name] = capture_meta(model, args, kwargs, name=name)
    return _GRAPHS[name]


def _plan_on_rank0(name: str, kind: str, mesh_shape, hardware: str = "h100-nvlink") -> Plan:
    """Rank 0 plans (h100-nvlink costs, so that the solver shards), every rank gets the same plan."""
    box = [None]
    if dist.get_rank() == 0:
        plan = autoshard.plan(_graph(name), mesh=mesh_shape, hardware=hardware,
                              baseline=None if kind == "solved" else kind)
        box = [plan.to_dict()]
    dist.broadcast_object_list(box, 0)
    return Plan.from_dict(box[0])


def _loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().pow(2).mean()
    return out.loss if getattr(out, "loss", None) is not None else out[0].float().pow(2).mean()


def _train(model, args, kwargs, steps: int, counter=None) -> list[float]:
    """``steps`` SGD steps; with ``counter``, the collectives of the first step are recorded."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        with counter.recording() if counter is not None and step == 0 else contextlib.nullcontext():
            loss = _loss(model(*args, **kwargs))
            loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _predicted_comm(plan: Plan) -> dict:
    return {(c.kind, tuple(c.axes), c.phase): c.nbytes for c in plan.comm}


def _run(name: str, kind: str, hardware: str = "h100-nvlink") -> Plan:
    mesh_shape = (2, 2)
    plan = _plan_on_rank0(name, kind, mesh_shape, hardware)
    model, args, kwargs = _inputs(name)
    reference = copy.deepcopy(model)
    pm = autoshard.parallelize(model, plan, device_mesh(mesh_shape), graph=_graph(name))
    losses = _train(pm, args, kwargs, STEPS, pm.comm.counter)
    measured = {k: v[0] for k, v in pm.comm.counter.totals().items()}
    assert measured == _predicted_comm(plan), "measured communication != plan"
    ref_losses = _train(reference, args, kwargs, STEPS)
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"loss of step {step}: {m}")
    full = pm.state_dict()
    want = reference.state_dict()
    assert list(full) == list(want), "state dict keys differ from the original model's"
    for key, value in want.items():
        torch.testing.assert_close(full[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
    return plan


@pytest.mark.parametrize("kind", PLANS)
@pytest.mark.parametrize("name", MODELS)
def test_three_adamw_steps_match_single_device(name, kind):
    on_all_ranks(f"{name} with the {kind} plan", _run, name, kind)


@pytest.mark.parametrize("name, blocks", [("gpt2-tiny", 2 + 1), ("llama-tiny", 2 + 1), ("cnn", 1)])
def test_zero3_gathers_parameters_per_block(name, blocks):
    """Under cpu-gloo costs the ZeRO-3 plan computes batch-sharded, so each block's parameters are
    all-gathered together and their gradients reduce-scattered together (FSDP's program), exactly:
    the tiny LMs' 2 layers and the root group; the CNN's conv / batch-norm Sequential entries are
    single layers, not blocks, so its parameters are one root group (as FSDP2 wraps it)."""
    def run():
        plan = _run(name, "zero3", "cpu-gloo")
        counts = {(c.kind, tuple(c.axes), c.phase): c.count for c in plan.comm}
        assert counts.get(("all_gather", (0, 1), "fwd")) == blocks, plan.comm
        assert counts.get(("reduce_scatter", (0, 1), "bwd")) == blocks, plan.comm

    on_all_ranks(f"{name} ZeRO-3 gathers per block", run)
