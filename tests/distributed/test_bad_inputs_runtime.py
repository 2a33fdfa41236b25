"""Runtime bad inputs and modes on 4 gloo ranks (2x2): what would make ranks drift apart is an error on
every rank, and ``train()``/``eval()`` behave as on the original module.

- eval/train: a model with BatchNorm and Dropout, parallelized data-parallel (the batch, and so the
  dropout mask, sharded over all 4 ranks), equals the single-device model step for step in training
  (seeded dropout, synchronised BatchNorm statistics), in eval (dropout off, running statistics read
  and not updated) and back in training; with the stored eval plan and with one derived at the switch.
- replicas: per-rank model seeds are an error naming the parameters; ``replicas="broadcast"`` fixes it.
- global input mode: a different batch on one rank, or per-rank RNG seeds with dropout, are errors on
  the first step; ``check_inputs="never"`` turns the check off.
- inputs: keyword calls bind like the model's forward; wrong dtype or names are InputErrors.
- backward: a rank that skips backward on a step the others run is a SkippedBackwardError on every rank
  (here with a replicated plan, which has no collective to wait in; the data-parallel plan, whose
  gradient all-reduce the others would wait in, runs in its own launch: tests/test_runtime_errors.py);
  every rank skipping backward is legal and training stays exact.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.api import ArgumentError
from autoshard.runtime.inputs import InputError
from autoshard.runtime.replicas import ReplicaMismatchError
from autoshard.runtime.step_watch import SkippedBackwardError
from runtime_harness import ATOL, RTOL, device_mesh, on_all_ranks

pytestmark = pytest.mark.timeout(300)

MESH = (2, 2)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))


def _shared_plan(model: nn.Module, **kw) -> autoshard.Plan:
    """Rank 0 plans; every rank gets the same plan."""
    return autoshard.plan_once(model, (_batch(0),), mesh=MESH, hardware="cpu-gloo", baseline="data_parallel", **kw)


def _assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("stored", [True, False], ids=["stored-eval-plan", "derived-eval-plan"])
def test_train_and_eval_equal_one_device(stored: bool) -> None:
    ref = _model()
    plan = _shared_plan(ref, other_mode=True)
    assert plan.training and plan.other_mode is not None
    if not stored:
        plan.other_mode = None             # an older plan: the runtime derives the eval plan at the switch
    pm = autoshard.parallelize(copy.deepcopy(ref), plan, device_mesh(MESH))
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

    def train_step(step: int) -> None:
        torch.manual_seed(100 + step)
        loss = pm(_batch(step)).square().mean()
        torch.manual_seed(100 + step)
        ref_loss = ref(_batch(step)).square().mean()
        _assert_close(loss, ref_loss, f"training loss, step {step}")
        loss.backward()
        ref_loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()

    def check() -> None:
        for step in range(2):
            train_step(step)
        pm.eval(), ref.eval()
        assert not pm.training
        before = {k: v.clone() for k, v in pm.state_dict().items()}
        with torch.no_grad():
            for step in range(2):                     # eval: deterministic, running statistics read only
                _assert_close(pm(_batch(10 + step)), ref(_batch(10 + step)), f"eval output {step}")
        after = pm.state_dict()
        for k, v in before.items():
            assert torch.equal(v, after[k]), f"{k} changed in eval mode"
        for k, v in ref.state_dict().items():
            _assert_close(after[k], v, f"state {k}")
        pm.train(), ref.train()
        train_step(5)
        for k, v in ref.state_dict().items():
            _assert_close(pm.state_dict()[k], v, f"state {k} after returning to training")

    on_all_ranks("train/eval equal one device", check)


def test_eval_differs_from_training_where_it_should() -> None:
    """A check that can fail: the eval program really is another program (no dropout, no statistics
    update), not the training one run again."""
    ref = _model()
    pm = autoshard.parallelize(copy.deepcopy(ref), _shared_plan(ref), device_mesh(MESH))
    x = _batch(3)
    torch.manual_seed(7)
    train_out = pm(x)
    pm.eval()
    eval_out = pm(x)
    assert not torch.allclose(train_out, eval_out)
    assert "coordinated_dropout" not in pm.code and "sync_batch_norm" not in pm.code
    assert "dropout.default(relu, 0.5, False)" in pm.code          # eval dropout: the identity
    pm.train()
    assert "coordinated_dropout" in pm.code and "sync_batch_norm" in pm.code


def test_per_rank_model_seeds_are_an_error() -> None:
    plan = _shared_plan(_model())
    with pytest.raises(ReplicaMismatchError, match=r"differ from rank 0.*torch.manual_seed\(0\).*replicas='broadcast'"):
        autoshard.parallelize(_model(seed=dist.get_rank()), plan, device_mesh(MESH))


def test_broadcast_replicas_give_rank_0s_model() -> None:
    plan = _shared_plan(_model())
    pm = autoshard.parallelize(_model(seed=dist.get_rank()), plan, device_mesh(MESH), replicas="broadcast")
    assert "broadcast from rank 0" in pm.replicas
    full = pm.state_dict()
    for k, v in _model(seed=0).state_dict().items():
        assert torch.equal(full[k], v), k


def test_different_batches_in_global_mode_are_an_error() -> None:
    ref = _model()
    plan = _shared_plan(ref)
    pm = autoshard.parallelize(copy.deepcopy(ref), plan, device_mesh(MESH))
    with pytest.raises(ReplicaMismatchError, match=r"same batch.*args\[0\].*input_mode='local'"):
        pm(_batch(dist.get_rank()))
    pm = autoshard.parallelize(copy.deepcopy(ref), plan, device_mesh(MESH), check_inputs="never")
    torch.manual_seed(0)
    pm(_batch(dist.get_rank()))                       # not checked: runs


def test_per_rank_rng_seeds_with_dropout_are_an_error() -> None:
    ref = _model()
    pm = autoshard.parallelize(copy.deepcopy(ref), _shared_plan(ref), device_mesh(MESH))
    torch.manual_seed(dist.get_rank())
    with pytest.raises(ReplicaMismatchError, match=r"RNG state.*same seed on every rank"):
        pm(_batch(0))


def test_keyword_calls_and_bad_inputs() -> None:
    ref = _model()
    pm = autoshard.parallelize(copy.deepcopy(ref), _shared_plan(ref), device_mesh(MESH)).eval()
    x = _batch(1)
    torch.testing.assert_close(pm(input=x), pm(x))
    with pytest.raises(InputError, match=r"dtype float64.*pass it as float32"):
        pm(x.double())
    with pytest.raises(InputError, match=r"does not accept this call"):
        pm(x, x)
    with pytest.raises(InputError, match=r"shape \(4, 8\).*re-plan"):
        pm(x[:4])


@pytest.mark.parametrize("kw,fix", [({"replicas": "maybe"}, r"replicas must be one of 'check', 'broadcast'"),
                                    ({"check_inputs": "sometimes"}, r"'first', 'always', 'never'"),
                                    ({"bucket_bytes": 0}, r"int >= 1"),
                                    ({"input_mode": "shard"}, r"'global', 'local'")],
                         ids=["replicas", "check-inputs", "bucket-bytes", "input-mode"])
def test_parallelize_arguments(kw, fix) -> None:
    plan = _shared_plan(_model())
    with pytest.raises(ArgumentError, match=fix):
        autoshard.parallelize(_model(), plan, device_mesh(MESH), **kw)
    with pytest.raises(ArgumentError, match=r"needs a Plan"):
        autoshard.parallelize(_model(), "plan.json", device_mesh(MESH))


def _replicated_plan(model: nn.Module) -> autoshard.Plan:
    """Every node replicated: no collective at all, so a rank that skips backward would drift silently."""
    from autoshard.enumerate import enumerate_strategies
    from autoshard.runtime import capture_meta
    from autoshard.plans.build import plan_from_solution
    from autoshard.solver.costgraph_build import build_cost_graph
    from autoshard.solver.fixed import fixed_solution
    from autoshard.solver.ilp import SolverOptions

    graph = capture_meta(model, (_batch(0),), name="mlp")
    cg = build_cost_graph(enumerate_strategies(graph, mesh_shape=MESH, hardware="cpu-gloo"), merge_followers=False,
                          alias_blocks=False)
    return plan_from_solution(cg, fixed_solution(cg, {}), model_name="mlp", options=SolverOptions(),
                                        budget=None)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


_SKIPPED = r"rank 3 did not run backward on training step {} .*while ranks 0, 1, 2 did.*same training loop on every rank"


def test_a_rank_that_skips_backward_is_an_error_at_the_same_call_with_check_always() -> None:
    """``check_inputs="always"``: every rank waits for every rank's word on the last step at each
    call, so all raise at the same call (the replicated plan has no collective to wait in)."""
    model = _mlp()
    pm = autoshard.parallelize(model, _replicated_plan(model), device_mesh(MESH), check_inputs="always")
    pm(_batch(0)).sum().backward()
    loss = pm(_batch(1)).sum()
    if dist.get_rank() != 3:
        loss.backward()
    with pytest.raises(SkippedBackwardError, match=_SKIPPED.format(2)):
        pm(_batch(2))
    with pytest.raises(SkippedBackwardError, match=_SKIPPED.format(2)):     # and at every later call
        pm(_batch(3))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("skip_step", [1, 3])
def test_a_rank_that_skips_backward_without_collectives_is_an_error_on_every_rank(skip_step: int) -> None:
    """Default ``check_inputs``, fully replicated plan (no collective at all, so the ranks' replicas
    would drift apart silently): rank 3 skips backward on ``skip_step``; it raises
    ``SkippedBackwardError`` at its next call, the others at one of their next calls (they run ahead
    freely; each call reads the diagnosis rank 3 posts), within seconds.

    Fails before the step watch: with the default ``check_inputs`` nothing is checked, every rank
    runs all its calls."""
    import time

    model = _mlp()
    pm = autoshard.parallelize(model, _replicated_plan(model), device_mesh(MESH))
    assert pm.check_inputs == "first"
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(1, skip_step):
        pm(_batch(step)).sum().backward()
        opt.step(), opt.zero_grad()
    loss = pm(_batch(skip_step)).sum()
    if rank != 3:
        loss.backward()
        opt.step(), opt.zero_grad()
    deadline = time.monotonic() + 20
    calls = 0
    with pytest.raises(SkippedBackwardError, match=_SKIPPED.format(skip_step)):
        while time.monotonic() < deadline:          # rank 3 raises at once; the others when rank 3 has told
            calls += 1
            pm(_batch(skip_step + calls)).sum().backward()
            opt.step(), opt.zero_grad()
            time.sleep(0.05)
    if rank == 3:
        assert calls == 1, f"rank 3 raised at its call {calls} after the skipped step, not the next one"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["data-parallel", "replicated"])
def test_every_rank_skipping_backward_is_legal_and_training_stays_exact(kind: str) -> None:
    """A forward without backward on every rank (evaluation under grad mode) is no error, and the
    training around it equals one device's: on step 1, on a later step, and two calls before one
    backward (gradient accumulation across calls). Both with a plan whose backward all-reduces the
    gradients (data parallel) and one with no collective (replicated)."""
    ref = _mlp()
    model = copy.deepcopy(ref)
    plan = _shared_plan(ref) if kind == "data-parallel" else _replicated_plan(ref)
    pm = autoshard.parallelize(model, plan, device_mesh(MESH))
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

    def run(step: int) -> None:
        x = _batch(step)
        if step in (1, 4):                     # every rank: forward under grad mode, no backward
            _assert_close(pm(x), ref(x), f"forward of step {step} without backward")
            return
        if step == 6:                          # two calls, one backward
            loss, want = pm(x).square().mean() + pm(x + 1).square().mean(), \
                ref(x).square().mean() + ref(x + 1).square().mean()
        else:
            loss, want = pm(x).square().mean(), ref(x).square().mean()
        _assert_close(loss, want, f"loss of step {step}")
        loss.backward(), want.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()

    for step in range(1, 9):
        run(step)
    full = pm.state_dict()
    for k, v in ref.state_dict().items():
        _assert_close(full[k], v, f"{k} after training")


def test_plan_once_failure_reaches_every_rank():
    """Planning that fails on rank 0 (a budget no plan fits) raises on every rank, none waits."""
    def run():
        model = _model()
        try:
            autoshard.plan_once(model, (_batch(0),), mesh=MESH, hardware="cpu-gloo", memory_budget="1KiB")
        except autoshard.RemotePlanError as e:
            assert dist.get_rank() != 0 and "planning failed on rank 0" in str(e) and "budget" in str(e), e
        except autoshard.InfeasibleBudgetError as e:
            assert dist.get_rank() == 0, e
        else:
            raise AssertionError("plan_once accepted a 1 KiB budget")

    on_all_ranks("plan_once with an impossible budget", run)


def test_plan_once_gives_every_rank_the_same_plan():
    def run():
        plan = _shared_plan(_model())
        texts = [None] * dist.get_world_size()
        dist.all_gather_object(texts, json.dumps(plan.to_dict(), sort_keys=True))
        assert len(set(texts)) == 1

    on_all_ranks("plan_once gives one plan", run)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_attention_dropout_under_sharding_equals_one_device(name: str) -> None:
    """Seeded attention dropout (scaled_dot_product_attention with dropout_p > 0) on a sharded
    plan draws the single-device op's mask: the loss and gradients equal one device's."""
    from autoshard.models import build_model

    overrides = {"attn_pdrop": 0.3} if name.startswith("gpt2") else {"attention_dropout": 0.3}

    def run() -> None:
        torch.manual_seed(0)
        model, _, kwargs = build_model(name, device="cpu", batch=8, dropout=0.0, **overrides)
        model.train()
        reference = copy.deepcopy(model)
        plan = autoshard.plan_once(model, kwargs=kwargs, mesh=MESH, hardware="h100-nvlink",
                                   baseline="data_parallel")
        pm = autoshard.parallelize(model, plan, device_mesh(MESH))
        assert "dropout_row_block_sdpa" in pm.code, "the sharded attention does not draw the global mask"
        for step in range(2):
            torch.manual_seed(100 + step)
            loss = pm(**kwargs).loss
            torch.manual_seed(100 + step)
            want = reference(**kwargs).loss
            _assert_close(loss, want, f"loss of step {step}")
            loss.backward()
            want.backward()
        grads = pm.full_grads()
        for key, p in reference.named_parameters():
            _assert_close(grads[key], p.grad, f"gradient of {key}")

    on_all_ranks(f"{name} with attention dropout 0.3", run)
