"""Parallel-module state and the runtime's contracts on 4 gloo ranks.

State dicts gather bit-identically (tied weights included); DCP checkpoints saved on one mesh load
on another (into a meta model or an existing module); a safetensors file loads into a meta model;
gradient clipping by the global norm equals the single-device ``clip_grad_norm_``;
``input_mode="local"`` equals ``"global"``; gradient accumulation through the bucketed gradient sync
is exact; a plan for another model and plans that differ across ranks are errors on every rank.
"""
from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.utils import _pytree as pytree

import autoshard
from autoshard.models import build_model
from autoshard.plans import Plan
from autoshard.plans.build import plan_from_solution
from autoshard.runtime import capture_meta
from autoshard.verify import shard_of
from runtime_harness import ATOL, RTOL, device_mesh, on_all_ranks

BATCH = 8
_GRAPHS: dict[str, object] = {}
_PLANS: dict[tuple, Plan] = {}


def _model(name: str, **overrides):
    """The model with real (seeded, so identical on every rank) weights and its example inputs."""
    return build_model(name, device="cpu", batch=BATCH, **overrides)


def _graph(name: str):
    if name not in _GRAPHS:
        model, args, kwargs = _model(name)
        _GRAPHS[name] = capture_meta(model, args, kwargs, name=name)
    return _GRAPHS[name]


def _plan(name: str, kind: str | None, mesh_shape: tuple[int, int], graph_fn=None) -> Plan:
    """Rank 0 plans (h100-nvlink costs, so that the solver shards) the graph ``graph_fn()`` (default:
    the preset ``name``); every rank gets the same plan."""
    key = (name, kind, mesh_shape)
    if key not in _PLANS:
        box = [None]
        if dist.get_rank() == 0:
            graph = graph_fn() if graph_fn is not None else _graph(name)
            box = [autoshard.plan(graph, mesh=mesh_shape, hardware="h100-nvlink", baseline=kind).to_dict()]
        dist.broadcast_object_list(box, 0)
        _PLANS[key] = Plan.from_dict(box[0])
    return _PLANS[key]


def _loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().pow(2).mean()
    return out.loss


def _assert_state_identical(got: dict, want: dict, what: str) -> None:
    """Same keys in the same order, every tensor bit-identical (dtype and shape included)."""
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    for key, value in want.items():
        g = got[key]
        assert not isinstance(g, DTensor), f"{what}: {key} is a DTensor, expected the full tensor"
        assert g.dtype == value.dtype and g.shape == value.shape, \
            f"{what}: {key} is {g.dtype}{tuple(g.shape)}, expected {value.dtype}{tuple(value.shape)}"
        assert torch.equal(g, value), f"{what}: {key} differs (max abs diff {(g - value).abs().max()})"


def _local_shards_differ(pm, model) -> bool:
    """Whether any parameter of ``pm`` differs from ``model``'s (a precondition: a load must change it)."""
    want = model.state_dict()
    return any(not torch.equal(v, want[k]) for k, v in pm.state_dict().items())


@pytest.fixture(scope="module")
def shared_dir():
    """A directory every rank sees (rank 0 creates it, broadcasts the path, removes it at the end)."""
    box = [tempfile.mkdtemp(prefix="autoshard-state-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    try:
        yield Path(box[0])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(box[0])


# -- (a) state dict round trip ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["megatron", "zero3"])
def test_state_dict_round_trip_is_bit_identical(kind):
    name = "gpt2-tiny"

    def run():
        model, _, _ = _model(name)
        graph = _graph(name)
        assert graph.tied_params, "gpt2-tiny should tie lm_head.weight to transformer.wte.weight"
        plan = _plan(name, kind, (2, 2))
        pm = autoshard.parallelize(model, plan, device_mesh((2, 2)), graph=graph)
        sharded = pm.sharded_state_dict()
        assert any(any(isinstance(p, Shard) for p in v.placements) for v in sharded.values()), \
            f"the {kind} plan shards no parameter; the round trip would not gather anything"
        _assert_state_identical(_state_dict_quietly(pm), model.state_dict(), f"{kind} state_dict()")
        # the tied names are one parameter, as in the original model
        assert pm.get_parameter("lm_head.weight") is pm.get_parameter("transformer.wte.weight")

    on_all_ranks(f"state dict round trip, {name} {kind}", run)


def _state_dict_quietly(pm) -> dict:
    """``pm.state_dict()``, failing if it logs a warning (DTensor's full_tensor of a dim sharded over
    both axes logs "2 sequential all_gather operations ... flatten mesh dimensions" on every rank)."""
    import logging

    from torch.distributed.tensor import _redistribute

    _redistribute._warned_flatten_issues.clear()      # torch warns once per mesh: make it warn again
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append                      # type: ignore[method-assign]
    logger = logging.getLogger("torch.distributed.tensor")
    logger.addHandler(handler)
    try:
        state = pm.state_dict()
    finally:
        logger.removeHandler(handler)
    assert not records, f"state_dict() logged: {[r.getMessage()[:200] for r in records]}"
    return state


# -- (b) DCP checkpoint across meshes --------------------------------------------------------------

def test_dcp_checkpoint_saved_on_2x2_loads_on_1x4(shared_dir):
    name = "gpt2-tiny"
    path = shared_dir / "dcp-2x2"

    def run():
        model, _, _ = _model(name)
        graph = _graph(name)
        plan_2x2 = _plan(name, "zero3", (2, 2))
        plan_1x4 = _plan(name, "megatron", (1, 4))
        pm = autoshard.parallelize(model, plan_2x2, device_mesh((2, 2)), graph=graph)
        autoshard.save_checkpoint(pm, path)
        dist.barrier()

        # into a model built on the meta device, on another mesh and plan
        meta_model, _, _ = build_model(name)
        assert all(p.is_meta for p in meta_model.parameters())
        loaded = autoshard.parallelize(meta_model, plan_1x4, device_mesh((1, 4)), checkpoint=str(path), graph=graph)
        _assert_state_identical(loaded.state_dict(), model.state_dict(), "parallelize(meta, checkpoint=dcp)")

        # into an existing parallel module holding other weights
        other, _, _ = _model(name, seed=1)
        existing = autoshard.parallelize(other, plan_1x4, device_mesh((1, 4)), graph=graph)
        assert _local_shards_differ(existing, model), "seed=1 weights equal seed=0 weights: the load proves nothing"
        autoshard.load_checkpoint(existing, path)
        _assert_state_identical(existing.state_dict(), model.state_dict(), "load_checkpoint")
        assert existing.get_parameter("lm_head.weight") is existing.get_parameter("transformer.wte.weight")

    on_all_ranks("DCP checkpoint 2x2 zero3 -> 1x4 megatron", run)


# -- (c) safetensors ---------------------------------------------------------------------------------

def test_safetensors_file_loads_into_meta_model(shared_dir):
    from safetensors.torch import save_file

    name = "gpt2-tiny"
    path = shared_dir / "gpt2-tiny.safetensors"

    def run():
        model, _, kwargs = _model(name)
        graph = _graph(name)
        plan = _plan(name, None, (2, 2))
        if dist.get_rank() == 0:
            # safetensors refuses shared tensors: each tied tensor is saved once, under its canonical
            # (first) name, as transformers' save_pretrained does; tensors must be contiguous.
            aliases = {n for canonical, names in graph.tied_params.items() for n in names if n != canonical}
            assert aliases == {"lm_head.weight"}, aliases
            save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in aliases}, str(path))
        dist.barrier()
        meta_model, _, _ = build_model(name)
        pm = autoshard.parallelize(meta_model, plan, device_mesh((2, 2)), checkpoint=str(path))
        _assert_state_identical(pm.state_dict(), model.state_dict(), "parallelize(meta, checkpoint=safetensors)")
        got = pm(**kwargs)
        want = model(**kwargs)
        torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got.loss, want.loss, rtol=RTOL, atol=ATOL)

    on_all_ranks("safetensors checkpoint, gpt2-tiny solved plan", run)


# -- (d) gradient clipping -------------------------------------------------------------------------

def _clip_run(clip) -> None:
    """One backward of gpt2-tiny under the megatron plan (sharded and replicated parameters), then
    ``clip(pm, max_norm)``: the returned total norm and the clipped gradients equal the single-device
    ``torch.nn.utils.clip_grad_norm_``'s (max_norm a quarter of the norm, so every gradient is scaled)."""
    name = "gpt2-tiny"
    model, args, kwargs = _model(name)
    reference = copy.deepcopy(model)
    plan = _plan(name, "megatron", (2, 2))
    pm = autoshard.parallelize(model, plan, device_mesh((2, 2)), graph=_graph(name))
    layouts = [pm.specs[n] for n, _ in pm.named_parameters()]
    assert any(s.is_replicated() for s in layouts), "no replicated parameter"
    assert any(not s.is_replicated() for s in layouts), "no sharded parameter"

    _loss(pm(*args, **kwargs)).backward()
    _loss(reference(*args, **kwargs)).backward()
    want_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    max_norm = float(want_norm) / 4
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    got = clip(pm, max_norm)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"total norm: {m}")
    ref_params = dict(reference.named_parameters())
    grads = pm.full_grads()
    assert list(grads) == list(ref_params), f"parameter names {list(grads)} != {list(ref_params)}"
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_params[n].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"clipped grad of {n}: {m}")


def test_clip_grad_norm_matches_single_device():
    """``pm.clip_grad_norm_(max_norm)``: the global norm over all shards, as on one device."""
    on_all_ranks("ParallelModule.clip_grad_norm_, gpt2-tiny megatron", _clip_run,
                 lambda pm, max_norm: pm.clip_grad_norm_(max_norm))


@pytest.mark.xfail(strict=True, reason="parameters are plain local shards (d99a3f2): torch's clip_grad_norm_ "
                                       "sees this rank's shards only and returns a per-rank norm; use "
                                       "pm.clip_grad_norm_")
def test_torch_clip_grad_norm_on_parallel_parameters_matches_single_device():
    """``torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm)`` unchanged: today each rank gets the
    norm of its own shards (0.864 / 0.872 vs 1.011 on one device), so ranks clip replicated
    parameters by different factors and the replicas drift apart silently."""
    on_all_ranks("torch.nn.utils.clip_grad_norm_, gpt2-tiny megatron", _clip_run,
                 lambda pm, max_norm: torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm))


# -- (e) local input mode --------------------------------------------------------------------------

def test_local_input_mode_equals_global():
    name = "gpt2-tiny"

    def run():
        model, args, kwargs = _model(name)
        graph = _graph(name)
        # a plan that shards the inputs (the solved plan of this tiny model may replicate them)
        plan = _plan(name, "data_parallel", (2, 2))
        mesh = device_mesh((2, 2))
        pm_global = autoshard.parallelize(model, plan, mesh, graph=graph)
        pm_local = autoshard.parallelize(model, plan, mesh, graph=graph, input_mode="local")

        inputs = [p for p in pm_local.placeholders if p.kind == "input"]
        leaves, treespec = pytree.tree_flatten((args, kwargs))
        assert len(inputs) == len(leaves), (inputs, len(leaves))
        coord = pm_local.comm.coord
        local_leaves = []
        for p, x in zip(inputs, leaves):
            planned = autoshard.ShardSpec.parse(plan.nodes[p.name].outputs[0])
            assert str(p.spec) == str(planned), f"{p.name}: placeholder spec {p.spec} != plan's {planned}"
            local_leaves.append(shard_of(x, p.spec, plan.mesh_shape, coord))
        assert any(lx.shape != x.shape for lx, x in zip(local_leaves, leaves)), \
            "the plan shards no input: local mode would equal global mode trivially"
        local_args, local_kwargs = pytree.tree_unflatten(local_leaves, treespec)

        out_g = pm_global(*args, **kwargs)
        out_g.loss.backward()
        out_l = pm_local(*local_args, **local_kwargs)
        out_l.loss.backward()
        assert torch.equal(out_l.loss, out_g.loss), f"loss {out_l.loss} != {out_g.loss}"
        assert torch.equal(out_l.logits, out_g.logits), "logits differ"
        grads_g = {n: p.grad for n, p in pm_global.named_parameters()}
        for n, p in pm_local.named_parameters():
            assert p.grad is not None and grads_g[n] is not None, n
            assert torch.equal(p.grad, grads_g[n]), f"this rank's gradient shard of {n} differs"

    on_all_ranks("input_mode='local', gpt2-tiny data-parallel plan", run)


# -- (f) gradient accumulation ---------------------------------------------------------------------

def _data_parallel_plan(graph, mesh_shape: tuple[int, int]) -> Plan:
    """Pure data parallelism, forced: every parameter replicated, every other node batch-sharded
    over both axes (``S01R = S01R x RR`` for the linears), so that every weight gradient is a partial
    sum over (0, 1) that the bucketed gradient sync all-reduces. (The ``data_parallel`` baseline is
    the cheapest plan of that family; for a tiny model it computes replicated and syncs nothing.)"""
    from autoshard.enumerate import enumerate_strategies
    from autoshard.solver.costgraph_build import build_cost_graph
    from autoshard.solver.fixed import fixed_solution
    from autoshard.solver.ilp import SolverOptions

    table = enumerate_strategies(graph, mesh_shape=mesh_shape, hardware="h100-nvlink")
    cg = build_cost_graph(table, merge_followers=False, alias_blocks=False)
    choice = {ns.node: next(k for k, s in enumerate(ns.strategies) if s.name.startswith("S01R"))
              for ns in table if ns.op != "output" and ns.node not in graph.param_fqn}
    options = SolverOptions()
    return plan_from_solution(cg, fixed_solution(cg, choice, options), model_name=graph.name, options=options,
                              budget=None)


def test_gradient_accumulation_through_bucketed_sync():
    name = "mlp"

    def run():
        model, (x,), _ = _model(name)
        reference = copy.deepcopy(model)
        box = [_data_parallel_plan(_graph(name), (2, 2)).to_dict() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, 0)
        plan = Plan.from_dict(box[0])
        # small buckets: several buckets, each launched when its last gradient arrives
        pm = autoshard.parallelize(model, plan, device_mesh((2, 2)), graph=_graph(name), bucket_bytes=8192)
        params = list(pm.parameters())
        assert all(pm.specs[n].is_replicated() for n, _ in pm.named_parameters()), "not replicated"
        assert len(pm._grad_sync.bucket_of) == len(params), "not every parameter goes through the bucketed sync"
        buckets = pm.grad_buckets
        assert len(buckets) > 1, "one bucket only"
        assert sum(b.params for b in buckets) == len(params)
        assert sum(b.nbytes for b in buckets) == sum(p.numel() * p.element_size() for p in params)
        assert all(b.axes == (0, 1) and b.dtype == torch.float32 for b in buckets)
        assert "sync_grad" not in pm.code, "gradients synchronised in the graph, not by the bucketed sync"

        gen = torch.Generator().manual_seed(1)
        micro = [[x, torch.randn(x.shape, generator=gen)], [torch.randn(x.shape, generator=gen) for _ in range(2)]]
        opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        for step, batches in enumerate(micro):
            set_to_none = step == 0          # step 1 accumulates into zero-filled .grad tensors
            opt.zero_grad(set_to_none=set_to_none)
            ref_opt.zero_grad(set_to_none=set_to_none)
            for i, xb in enumerate(batches):
                with pm.comm.counter.recording() as counter:
                    _loss(pm(xb)).backward()
                synced = sum(n for (kind, axes, phase), (_, n) in counter.totals().items()
                             if kind == "all_reduce" and phase == "bwd" and axes == (0, 1))
                assert synced == len(buckets), f"{synced} gradient all-reduces, expected one per bucket"
                _loss(reference(xb)).backward()
                grads = pm.full_grads()
                for n, r in reference.named_parameters():
                    torch.testing.assert_close(grads[n], r.grad, rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"step {step} micro-batch {i}: grad of {n}: {m}")
            opt.step()
            ref_opt.step()
            buffers = [b.flat for b in pm._grad_sync.buckets]
            if step == 0:
                kept = [t.data_ptr() for t in buffers]
                held = sum(t.numel() * t.element_size() for t in buffers)
                assert held == plan.memory["grad_buckets"], f"bucket buffers {held} B, plan counts {plan.memory['grad_buckets']}"
            assert [t.data_ptr() for t in buffers] == kept, "a bucket's buffer was reallocated (DDP keeps its buckets)"
        full = pm.state_dict()
        for n, r in reference.named_parameters():
            torch.testing.assert_close(full[n], r.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"parameter {n} after 2 steps: {m}")

    on_all_ranks("gradient accumulation, mlp data parallel", run)


# -- (g) a plan for another model --------------------------------------------------------------------

def test_plan_for_another_model_is_rejected_on_every_rank():
    def run():
        def other_graph():
            other, other_args, _ = _model("mlp", hidden=48)
            return capture_meta(other, other_args, name="mlp-hidden48")

        plan = _plan("mlp-hidden48", "data_parallel", (2, 2), other_graph)
        model, _, _ = _model("mlp")
        with pytest.raises(autoshard.PlanMismatchError, match="fingerprint"):
            autoshard.parallelize(model, plan, device_mesh((2, 2)))

    on_all_ranks("plan made for another model", run)


# -- (h) ranks holding different plans ---------------------------------------------------------------

def test_ranks_with_different_plans_fail_on_every_rank():
    name = "mlp"

    def run():
        model, _, _ = _model(name)
        megatron = _plan(name, "megatron", (2, 2))
        data_parallel = _plan(name, "data_parallel", (2, 2))
        mine = data_parallel if dist.get_rank() == 1 else megatron
        with pytest.raises(autoshard.PlanDisagreementError, match=r"ranks \[1\] differ from rank 0 in plan"):
            autoshard.parallelize(model, mine, device_mesh((2, 2)), graph=_graph(name))

    on_all_ranks("rank 1 holds another plan", run)


def test_ranks_that_each_plan_identically_agree():
    """Every rank makes its own plan with the same deterministic call (the usual script): the
    decisions are identical, so parallelize must accept them. Today it raises PlanDisagreementError:
    the plan digest in ``plan_agreement._plan_digest`` drops ``created`` and ``timings`` but not the solver's
    ``solve_seconds``/``build_seconds``, which differ from run to run."""
    name = "mlp"

    def run():
        model, _, _ = _model(name)
        own = autoshard.plan(_graph(name), mesh=(2, 2), hardware="h100-nvlink", baseline="data_parallel")
        decisions = {k: v for k, v in own.to_dict().items() if k not in ("created", "timings", "solver")}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, decisions)
        assert all(d == everyone[0] for d in everyone), "the ranks' plans differ in their decisions"
        autoshard.parallelize(model, own, device_mesh((2, 2)), graph=_graph(name))

    on_all_ranks("every rank plans for itself", run)


def test_all_gather_along_an_inner_dim_returns_a_contiguous_tensor():
    """A gathered shard is contiguous like the single-device value, so the next aten.view works
    (it failed with 'view size is not compatible with input tensor's size and stride')."""
    from autoshard.runtime.collectives import MeshComm

    comm = MeshComm(device_mesh((2, 2)))
    whole = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6)
    local = whole.chunk(2, 1)[comm.coord[1]].contiguous()
    gathered = comm.all_gather(local, 1, 1, "fwd")
    assert gathered.is_contiguous()
    torch.testing.assert_close(gathered.view(2, 24), whole.view(2, 24))


def test_reduce_scatter_sums_and_keeps_this_ranks_block():
    """MeshComm.reduce_scatter (a resharding move from a partial tensor): the sum over the axis,
    this rank's block along the dim (it laid its input out in a shape gloo rejects before)."""
    from autoshard.runtime.collectives import MeshComm

    comm = MeshComm(device_mesh((2, 2)))
    parts = [torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) * (r + 1) for r in range(2)]
    for dim in (0, 1):
        got = comm.reduce_scatter(parts[comm.coord[1]].clone(), 1, dim, "bwd")
        torch.testing.assert_close(got, (parts[0] + parts[1]).chunk(2, dim)[comm.coord[1]])
