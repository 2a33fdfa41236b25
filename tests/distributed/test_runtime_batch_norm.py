"""Batch norm planned ``batch_norm="per_rank"`` is torch DDP's batch norm: every rank normalises its
own quarter of the batch. On the 4 real ranks, a CNN under autoshard's plans (solved, data parallel,
every segment recomputed) trains as torch DDP trains the same model (its losses and parameters after three AdamW steps), the
running statistics are the mean of DDP's ranks' (averaged when read: the state dict, an eval
forward), and the plans communicate no statistics."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import autoshard
from autoshard.models import build_model
from autoshard.plans import Plan
from autoshard.plans.build import plan_from_solution
from autoshard.solver import build_cost_graph, solve
from autoshard.solver.ilp import SolverOptions
from autoshard.runtime import capture_meta
from runtime_harness import RTOL, ATOL, device_mesh, on_all_ranks

BATCH, STEPS = 8, 3


class _WithLoss(torch.nn.Module):
    """The preset CNN with its cross-entropy (mean over the batch) inside the graph."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), labels)


def _model_and_batch():
    torch.manual_seed(0)
    net, (x,), _ = build_model("cnn", device="cpu", batch=BATCH, seq=16)
    labels = torch.randint(0, net.head[-1].out_features, (BATCH,), generator=torch.Generator().manual_seed(1))
    return _WithLoss(net), x, labels


def _every_segment_recomputed(graph) -> Plan:
    """The plan with every memory decision recompute (regions run again in backward, where the
    running statistics must still move once per step)."""
    cg = build_cost_graph(autoshard.enumerate_strategies(graph, mesh_shape=(2, 2), hardware="h100-nvlink",
                                                         batch_norm="per_rank"))
    options = SolverOptions(fixed_decision="recompute")
    return plan_from_solution(cg, solve(cg, options), model_name="cnn", options=options, budget=None)


def _plan_on_rank0(graph, kind: str | None) -> Plan:
    box = [None]
    if dist.get_rank() == 0:
        plan = _every_segment_recomputed(graph) if kind == "recompute" else \
            autoshard.plan(graph, mesh=(2, 2), hardware="h100-nvlink", batch_norm="per_rank", baseline=kind)
        box = [plan.to_dict()]
    dist.broadcast_object_list(box, 0)
    return Plan.from_dict(box[0])


def _adamw_steps(model, *inputs) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _run(baseline: str | None) -> None:
    model, x, labels = _model_and_batch()
    graph = capture_meta(model, (x, labels), {}, name="cnn")
    plan = _plan_on_rank0(graph, baseline)
    assert plan.batch_norm == "per_rank"
    if baseline == "recompute":
        assert set(plan.segments.values()) == {"recompute"}
    assert not any(c.operand.startswith("bn-") for n in plan.nodes.values() for c in n.collectives)
    ddp = DistributedDataParallel(copy.deepcopy(model), forward_sync_buffers=False)
    pm = autoshard.parallelize(model, plan, device_mesh((2, 2)), graph=graph)

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = x.chunk(world)[rank], labels.chunk(world)[rank]
    local_losses = _adamw_steps(ddp, *mine)
    losses = _adamw_steps(pm, x, labels)
    for step, (got, local) in enumerate(zip(losses, local_losses)):
        want = local.clone()
        dist.all_reduce(want)                   # the global batch's mean loss: the mean of the ranks'
        torch.testing.assert_close(got, want / world, rtol=RTOL, atol=ATOL, msg=lambda m: f"loss of step {step}: {m}")

    state = pm.state_dict()                     # averages the per-rank running statistics first
    for key, value in ddp.module.state_dict().items():
        want = value.clone()
        if key.endswith(("running_mean", "running_var")):
            dist.all_reduce(want)
            want /= world
        else:                                   # parameters (DDP keeps them equal) and batch counters
            assert key.endswith("num_batches_tracked") or value.is_floating_point()
        torch.testing.assert_close(state[key], want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")

    # eval reads the running statistics: the same logits as one device with the averaged ones
    reference = copy.deepcopy(ddp.module).eval()
    reference.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(pm.eval()(x, labels), reference(x, labels), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("baseline", [None, "data_parallel", "recompute"],
                         ids=["solved", "data_parallel", "every_segment_recomputed"])
def test_per_rank_batch_norm_trains_as_torch_ddp(baseline):
    on_all_ranks(f"per-rank batch norm, {baseline or 'solved'} plan", _run, baseline)


def _sync_counts() -> None:
    model, x, labels = _model_and_batch()
    graph = capture_meta(model, (x, labels), {}, name="cnn")
    plan = _plan_on_rank0(graph, "data_parallel")
    pm = autoshard.parallelize(model, plan, device_mesh((2, 2)), graph=graph)
    with pm.comm.counter.recording():
        pm(x, labels).backward()
    training = [r for r in pm.comm.counter.records if r.phase == "buffers"]
    assert not training, "a training step must not average the running statistics"
    with pm.comm.counter.recording():
        pm.sync_buffers()
        pm.sync_buffers()                       # nothing pending the second time
    synced = [r for r in pm.comm.counter.records if r.phase == "buffers"]
    n_stats = sum(b.numel() for name, b in model.named_buffers() if name.endswith(("running_mean", "running_var")))
    assert [(r.kind, r.axes, r.nbytes) for r in synced] == [("all_reduce", (0, 1), 4 * n_stats)]


def test_running_statistics_are_averaged_once_when_read_and_never_in_a_training_step():
    on_all_ranks("per-rank running statistics averaged on read", _sync_counts)
