"""Mixed precision in the planner: the policy, the memory accounting, the plan file, the errors.

The accounting (bytes per parameter element, as the runtime holds them; see autoshard.precision):
fp32 master 4 + fp32 gradient on the master 4 (FSDP2 keeps its sharded gradients in the parameter's
dtype too, whatever ``reduce_dtype`` the reduction ran in) + AdamW state 8 per master element, all
divided as the plan shards the parameter; plus the bf16 working copy, 2 per element of the layout a
consumer reads it in, where the consumer saves it for backward (a matmul's weight; not the first
layer's weight when the input needs no gradient, not an embedding table). Unsharded and with every
working copy held: 4 + 4 + 8 + 2 = 18 bytes per parameter (the "16" of the usual mixed-precision
AdamW accounting counts the gradient in bf16, 2 bytes; the optimizer needs it in the master's dtype).
"""
from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
from autoshard.errors import ArgumentError
from autoshard.capture import capture_meta
from autoshard.plans import Plan, PlanError
from autoshard.precision import MixedPrecision
from autoshard.specs import ShardSpec

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False), nn.ReLU(),
                          nn.Linear(512, 256, bias=False))
    return model, torch.randn(8, 256)


def _stored_elements(plan: Plan, model: nn.Module) -> int:
    """Parameter elements this device stores, as the plan lays each parameter out."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    total = 0
    for node in plan.nodes.values():
        if node.kind == "placeholder" and node.fqn in shapes:
            spec = node.output_specs()[0] or ShardSpec.replicate(len(shapes[node.fqn]))
            total += spec.local_numel(shapes[node.fqn], tuple(plan.mesh_shape))
    return total


def test_unsharded_breakdown_is_18_bytes_per_parameter():
    model, x = _mlp()
    n = sum(p.numel() for p in model.parameters())
    plan = autoshard.plan(model, (x,), mesh=1, mp_policy=BF16)
    mem = plan.memory
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * n, 4 * n, 8 * n)
    # working copies: the 2nd and 3rd weights (the 1st is not saved: x needs no gradient)
    assert mem["param_copies"] == 2 * (512 * 512 + 512 * 256)
    held = 4 * n + 4 * n + 8 * n + 2 * n
    assert held == 18 * n and mem["params"] + mem["grads"] + mem["optimizer"] + 2 * n == held
    # without a policy: fp32 parameters and gradients, no copies
    fp32 = autoshard.plan(model, (x,), mesh=1).memory
    assert (fp32["params"], fp32["grads"], fp32["optimizer"], fp32["param_copies"]) == (4 * n, 4 * n, 8 * n, 0)


def test_compute_priced_at_the_working_dtype():
    model, x = _mlp()
    # a roofline profile: the tiny MLP's ops are at the per-op floor on the measured H100 curves
    bf16 = autoshard.plan(model, (x,), mesh=1, mp_policy=BF16, hardware="a100-nvlink")
    fp32 = autoshard.plan(model, (x,), mesh=1, hardware="a100-nvlink")
    assert bf16.time["compute"] < 0.75 * fp32.time["compute"]
    assert bf16.fingerprint != fp32.fingerprint       # captured with bf16 parameters


def test_reduce_dtype_defaults_to_param_dtype_and_gradients_stay_master():
    model, x = _mlp()
    plan = autoshard.plan(model, (x,), mesh=1, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    mp = plan.mixed_precision
    assert (mp.param_dtype, mp.reduce_dtype, mp.master_dtype, mp.output_dtype, mp.cast_forward_inputs) == \
        ("bfloat16", "bfloat16", "float32", None, True)
    n = sum(p.numel() for p in model.parameters())
    assert plan.memory["grads"] == 4 * n


def test_sharded_breakdown_divides_as_the_plan_shards():
    model, x = _mlp()
    plan = autoshard.plan(model, (x,), mesh=(2, 2), mp_policy=BF16, baseline="zero3")
    local = _stored_elements(plan, model)
    n = sum(p.numel() for p in model.parameters())
    assert local == n // 4                              # ZeRO-3: every weight sharded 4 ways
    assert (plan.memory["params"], plan.memory["grads"], plan.memory["optimizer"]) == (4 * local, 4 * local, 8 * local)
    # gathered for their consumers: whole bf16 copies of the saved weights, held until backward
    assert plan.memory["param_copies"] == 2 * (512 * 512 + 512 * 256)
    # parameters all-gathered in bf16, their gradients reduce-scattered in fp32 (bytes of the whole tensors)
    comm: dict[tuple[str, str], int] = {}
    for c in plan.comm:
        comm[(c.kind, c.phase)] = comm.get((c.kind, c.phase), 0) + c.nbytes
    assert comm[("reduce_scatter", "bwd")] == 4 * n
    assert comm[("all_gather", "fwd")] >= 2 * n


def test_plan_json_round_trip(tmp_path):
    model, x = _mlp()
    plan = autoshard.plan(model, (x,), mesh=1, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32))
    path = plan.save(tmp_path / "plan.json")
    loaded = Plan.load(path)
    assert loaded.mixed_precision == plan.mixed_precision == MixedPrecision("bfloat16", "float32", "float32",
                                                                            "float32", True)
    assert loaded.to_dict() == plan.to_dict()
    assert "bfloat16 working copies" in loaded.explain(plain=True)
    data = json.loads(path.read_text())
    data.pop("mixed_precision")                         # a plan written before the field: no policy
    assert Plan.from_dict(data).mixed_precision is None
    data["mixed_precision"] = {**plan.to_dict()["mixed_precision"], "param_dtype": "int8"}
    with pytest.raises(PlanError, match="param_dtype"):
        Plan.from_dict(data)


def test_plan_without_policy_is_unchanged():
    model, x = _mlp()
    plan = autoshard.plan(model, (x,), mesh=1)
    assert plan.mixed_precision is None and plan.to_dict()["mixed_precision"] is None
    assert "mixed precision" not in plan.explain(plain=True)


@pytest.mark.parametrize("policy, match", [
    (MixedPrecisionPolicy(reduce_dtype=torch.float32), "param_dtype is None"),
    (MixedPrecisionPolicy(param_dtype=torch.int8), "floating-point"),
    ({"param_dtype": torch.bfloat16}, "MixedPrecisionPolicy"),
])
def test_bad_policies(policy, match):
    model, x = _mlp()
    with pytest.raises(ArgumentError, match=match):
        autoshard.plan(model, (x,), mesh=1, mp_policy=policy)


def test_policy_needs_the_module():
    model, x = _mlp()
    graph = capture_meta(model, (x,))
    with pytest.raises(ArgumentError, match="needs the nn.Module"):
        autoshard.plan(graph, mesh=1, mp_policy=BF16)


def test_mixed_master_dtypes_rejected():
    model, x = _mlp()
    model[0].half()
    with pytest.raises(ArgumentError, match="one dtype"):
        autoshard.plan(model, (x,), mesh=1, mp_policy=BF16)


def test_llama7b_2x4_bf16_plans_in_seconds_with_the_accounting():
    """Llama-2-7B (HF LlamaConfig on meta, batch 8, seq 2048) on 2x4 h100-nvlink, bf16 compute,
    fp32 master weights: master 4 + gradient 4 + AdamW 8 bytes per element each device stores."""
    from autoshard.models import build_model

    model, args, kwargs = build_model("llama-7b", device="meta", batch=8, seq=2048)
    start = time.perf_counter()
    plan = autoshard.plan(model, args, kwargs, mesh=(2, 4), hardware="h100-nvlink", mp_policy=BF16)
    seconds = time.perf_counter() - start
    assert seconds < 180, f"planning took {seconds:.0f} s"   # ~20 s alone, ~40 s on 2 shared cores
    local = _stored_elements(plan, model)
    mem = plan.memory
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * local, 4 * local, 8 * local)
    n = sum(p.numel() for p in model.parameters())
    assert n / 8 <= local < n                         # sharded: at most what one device would hold
    assert 0 < mem["param_copies"] <= 2 * n           # the bf16 copies its consumers hold
    assert mem["peak"] <= 80 * 2**30


def test_autoshard_policy_object_accepted_and_checked():
    model, x = _mlp()
    plan = autoshard.plan(model, (x,), mesh=1, mp_policy=MixedPrecision("bfloat16", "float32"))
    assert plan.mixed_precision == MixedPrecision("bfloat16", "float32", "float32")
    with pytest.raises(ArgumentError, match="param_dtype"):
        autoshard.plan(model, (x,), mesh=1, mp_policy=MixedPrecision("int8", "float32"))


def test_other_mode_planned_under_the_same_policy():
    from autoshard.models import build_model

    model, args, kwargs = build_model("gpt2-tiny", device="meta", batch=4, dropout=0.1)
    plan = autoshard.plan(model, args, kwargs, mesh=1, mp_policy=BF16, other_mode=True)
    assert plan.other_mode is not None and plan.other_mode.mixed_precision == plan.mixed_precision
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).other_mode.mixed_precision == plan.mixed_precision


def test_compiling_a_mixed_precision_plan_is_a_named_error():
    """compile=True does not run a mixed-precision plan's casts yet: a CompileError saying so, not a
    compiled program in the wrong dtype."""
    from autoshard.runtime.compiled import CompileError, check_compilable

    model, x = _mlp()
    plan = autoshard.plan(model, (x,), mesh=1, mp_policy=BF16)
    with pytest.raises(CompileError, match="mixed-precision plan"):
        check_compilable(plan, torch.fx.GraphModule(nn.Module(), torch.fx.Graph()))
    check_compilable(autoshard.plan(model, (x,), mesh=1), torch.fx.GraphModule(nn.Module(), torch.fx.Graph()))
