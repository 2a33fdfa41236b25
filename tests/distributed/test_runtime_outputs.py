"""``outputs="local"`` on 4 gloo ranks: GPT-2 tiny returns each rank's shard of its logits and no
collective gathers them, while training stays exactly single-device training.

The data-parallel plan (cpu-gloo costs) shards the batch, so the logits ``[batch, seq, vocab]`` are
produced batch-sharded over both mesh axes: with ``outputs="global"`` two all-gathers make them whole
on every rank, with ``"local"`` each rank gets its ``batch/4`` rows. Over 3 AdamW steps the loss equals
the single-device loss, each rank's logits equal its rows of the single-device logits, the collectives
the runtime counts equal the plan's (``plan.comm``), and a step runs fewer of them than with
``"global"``.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import autoshard
from autoshard.models import build_model
from autoshard.plans import Plan
from autoshard.runtime import capture_meta
from autoshard.specs import ShardSpec
from autoshard.verify import shard_of
from runtime_harness import ATOL, RTOL, device_mesh, on_all_ranks

MESH = (2, 2)
BATCH = 8
STEPS = 3


def _model():
    torch.manual_seed(0)
    return build_model("gpt2-tiny", device="cpu", batch=BATCH)


def _plans(graph) -> dict[str, Plan]:
    """Rank 0 plans both output modes, every rank gets the same plans."""
    box: list = [None]
    if dist.get_rank() == 0:
        box = [{mode: autoshard.plan(graph, mesh=MESH, hardware="cpu-gloo", baseline="data_parallel",
                                     outputs=mode).to_dict() for mode in ("global", "local")}]
    dist.broadcast_object_list(box, 0)
    return {mode: Plan.from_dict(data) for mode, data in box[0].items()}


def _comm(plan: Plan) -> dict:
    return {(c.kind, tuple(c.axes), c.phase): c.nbytes for c in plan.comm}


def _check_local_logits_train_like_one_device() -> None:
    model, args, kwargs = _model()
    graph = capture_meta(model, args, kwargs, name="gpt2-tiny")
    plans = _plans(graph)
    local, glob = plans["local"], plans["global"]
    assert local.outputs == "local" and glob.outputs == "global"
    mesh = device_mesh(MESH)

    counts = {}
    for mode, plan in plans.items():
        pm = autoshard.parallelize(copy.deepcopy(model), plan, mesh, graph=graph)
        with pm.comm.counter.recording() as counter:
            pm(*args, **kwargs).loss.backward()
        assert {k: v[0] for k, v in counter.totals().items()} == _comm(plan), f"{mode}: measured != plan"
        counts[mode] = len(counter.records)
    assert counts["local"] < counts["global"], f"collectives per step: {counts}"

    reference = copy.deepcopy(model)
    pm = autoshard.parallelize(model, local, mesh, graph=graph)
    loss_spec, logits_spec = pm.output_specs
    assert loss_spec == ShardSpec.replicate(0) and not logits_spec.is_replicated(), pm.output_specs
    assert str(logits_spec) == local.nodes["output"].inputs[1]
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(STEPS):
        with pm.comm.counter.recording() as counter:
            out = pm(*args, **kwargs)
            out.loss.backward()
        assert {k: v[0] for k, v in counter.totals().items()} == _comm(local), f"step {step}: measured != plan"
        want = reference(*args, **kwargs)
        want.loss.backward()
        torch.testing.assert_close(out.loss, want.loss, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"loss of step {step}: {m}")
        rows = shard_of(want.logits.detach(), logits_spec, MESH, pm.comm.coord)
        assert out.logits.shape == logits_spec.local_shape(want.logits.shape, MESH) == rows.shape
        torch.testing.assert_close(out.logits.detach(), rows, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"logits of step {step}: {m}")
        torch.testing.assert_close(pm.comm.shard_input(want.logits.detach(), logits_spec.dims), rows)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def test_local_outputs_return_each_ranks_logits_without_gathering():
    on_all_ranks("gpt2-tiny with outputs='local'", _check_local_logits_train_like_one_device)
