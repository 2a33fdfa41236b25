"""A mean loss planned ``loss="per_rank"`` is torch DDP's loss: each rank's mean over its own share
of the batch, the gradients averaged. On the 4 real ranks GPT-2 tiny, with labels whose ignored
positions (``-100``) differ between the ranks' shares (so the per-rank mean differs from the whole
batch's), trains under autoshard's plans (solved, data parallel, Megatron, ZeRO-3) as under torch
DDP: with ``outputs="local"`` each rank returns a value whose mean over the ranks is the mean of
DDP's ranks' losses (DDP's own loss for its share under the data-parallel plan), with ``"global"``
every rank that mean; the parameters after three SGD steps are DDP's; the data-parallel plan's
forward runs no collective."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import autoshard
from autoshard.models import build_model
from autoshard.plans import Plan
from autoshard.runtime import capture_meta
from runtime_harness import ATOL, RTOL, device_mesh, on_all_ranks

MESH, BATCH, STEPS = (2, 2), 8, 3


def _model_and_inputs():
    torch.manual_seed(0)
    model, args, kwargs = build_model("gpt2-tiny", device="cpu", batch=BATCH)
    labels = kwargs["labels"].clone()
    labels[2, :5] = -100           # rank 1's share counts fewer targets than rank 0's
    labels[6, 3:] = -100           # rank 3's far fewer
    return model, args, {**kwargs, "labels": labels}


def _plan_on_rank0(graph, baseline: str | None, outputs: str) -> Plan:
    box: list = [None]
    if dist.get_rank() == 0:
        box = [autoshard.plan(graph, mesh=MESH, hardware="cpu-gloo", baseline=baseline, outputs=outputs,
                              loss="per_rank").to_dict()]
    dist.broadcast_object_list(box, 0)
    return Plan.from_dict(box[0])


def _share(kwargs: dict, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _sgd_steps(model, args, kwargs) -> list[torch.Tensor]:
    # SGD, not AdamW: Adam's normalised update turns the fp32 noise of a gradient that is zero in
    # exact arithmetic (the key bias's: softmax ignores it) into a step of the full learning rate
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(*args, **kwargs).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _run(baseline: str | None, outputs: str) -> None:
    model, args, kwargs = _model_and_inputs()
    graph = capture_meta(model, args, kwargs, name="gpt2-tiny")
    plan = _plan_on_rank0(graph, baseline, outputs)
    assert plan.loss == "per_rank"
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(copy.deepcopy(model))
    pm = autoshard.parallelize(copy.deepcopy(model), plan, device_mesh(MESH), graph=graph)

    single = model(*args, **kwargs).loss.detach()
    local_losses = _sgd_steps(ddp, [a.chunk(world)[rank] for a in args], _share(kwargs, rank, world))
    mean_of_means = local_losses[0].clone()
    dist.all_reduce(mean_of_means)
    mean_of_means /= world
    assert abs(float(mean_of_means) - float(single)) > 1e-3, "the shares must count different targets"

    losses = _sgd_steps(pm, args, kwargs)
    for step, (got, local) in enumerate(zip(losses, local_losses)):
        if outputs == "local" and baseline == "data_parallel":      # this rank's share is its own
            torch.testing.assert_close(got, local, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step}'s loss: {m}")
        if outputs == "local":              # each rank's value; their mean is the loss
            got = got.clone()
            dist.all_reduce(got)
            got /= world
        want = local.clone()
        dist.all_reduce(want)
        torch.testing.assert_close(got, want / world, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"mean loss of step {step}: {m}")
    state = pm.state_dict()
    for key, value in ddp.module.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("baseline,outputs", [(None, "local"), ("data_parallel", "local"), ("megatron", "local"),
                                              ("zero3", "local"), ("data_parallel", "global")],
                         ids=["solved", "data_parallel", "megatron", "zero3", "data_parallel-global_outputs"])
def test_per_rank_loss_trains_as_torch_ddp(baseline, outputs):
    on_all_ranks(f"per-rank loss, {baseline or 'solved'} plan, outputs={outputs}", _run, baseline, outputs)


def _forward_collectives() -> None:
    model, args, kwargs = _model_and_inputs()
    graph = capture_meta(model, args, kwargs, name="gpt2-tiny")
    plan = _plan_on_rank0(graph, "data_parallel", "local")
    assert not [c for c in plan.comm if c.phase == "fwd"], plan.comm
    pm = autoshard.parallelize(model, plan, device_mesh(MESH), graph=graph)
    with pm.comm.counter.recording() as counter:
        out = pm(*args, **kwargs)
    assert not counter.records, [(r.kind, r.axes, r.phase) for r in counter.records]
    assert pm.output_specs[0].partial == (0, 1), pm.output_specs
    out.loss.backward()


def test_data_parallel_per_rank_loss_runs_no_forward_collective():
    on_all_ranks("per-rank loss, data-parallel forward", _forward_collectives)
