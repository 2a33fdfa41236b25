"""``parallelize(..., compile=True)`` on 4 gloo ranks (2x2 mesh): the compiled program equals eager.

Each case trains two copies of one model, eagerly and compiled (inductor, C++ on CPU), for
``STEPS`` SGD steps under the same plan: every step's loss and every gathered gradient must agree
within fp32 reassociation tolerance (inductor fuses pointwise ops and reorders reductions, e.g. a
fused ``sum`` or ``mean`` adds in another order: about 1e-7 relative on these sizes; the bound is
``RTOL``/``ATOL`` as in the rest of the distributed suite). The graph test compiles with a backend
that records dynamo's and AOTAutograd's graphs: one graph, no graph break, and exactly the
collectives the eager program runs in forward and backward are in them (the bucketed gradient
all-reduce after backward stays eager in both). A plan with every segment recomputed compiles to one
graph too and equals eager; plans the compiled path does not run raise
:class:`~autoshard.runtime.compiled.CompileError`.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.models import build_model
from autoshard.errors import ArgumentError
from autoshard.plans import Plan
from autoshard.runtime import capture_meta
from autoshard.runtime.compiled import CompileError
from runtime_harness import RTOL, ATOL, device_mesh, on_all_ranks

MESH = (2, 2)
STEPS = 3
LR = 0.1
_CACHE: dict[Any, Any] = {}


def _model(name: str):
    if name == "mlp":      # large enough that the solved plan shards it (2D tensor parallel on cpu-gloo)
        return build_model("mlp", device="cpu", batch=64, features=256, hidden=1024, out_features=256)
    return build_model(name, device="cpu", batch=8, dropout=0.0)


def _graph(name: str):
    if ("graph", name) not in _CACHE:
        model, args, kwargs = _model(name)
        _CACHE[("graph", name)] = capture_meta(model, args, kwargs, name=name)
    return _CACHE[("graph", name)]


def _plan(name: str, baseline: str | None) -> Plan:
    """Solved on rank 0 (``baseline`` None: the free optimum for the cpu-gloo profile), broadcast."""
    if ("plan", name, baseline) not in _CACHE:
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            box = [autoshard.plan(_graph(name), mesh=MESH, hardware="cpu-gloo", baseline=baseline).to_dict()]
        dist.broadcast_object_list(box, 0)
        _CACHE[("plan", name, baseline)] = Plan.from_dict(box[0])
    return _CACHE[("plan", name, baseline)]


def _loss(pm: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    out = pm(*args, **kwargs)
    return out.loss if hasattr(out, "loss") else out.square().mean()


def _train(pm: autoshard.ParallelModule, args: tuple, kwargs: dict) -> list[tuple[float, dict]]:
    """``STEPS`` SGD steps: each step's loss and gathered gradients."""
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    steps = []
    for _ in range(STEPS):
        loss = _loss(pm, args, kwargs)
        loss.backward()
        steps.append((loss.item(), pm.full_grads()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps


def _compare(name: str, baseline: str | None, compile: Any, plan: Plan | None = None) -> autoshard.ParallelModule:
    model, args, kwargs = _model(name)
    plan = plan or _plan(name, baseline)
    mesh = device_mesh(MESH)
    eager = autoshard.parallelize(copy.deepcopy(model), plan, mesh, graph=_graph(name))
    compiled = autoshard.parallelize(copy.deepcopy(model), plan, mesh, graph=_graph(name), compile=compile)
    want, got = _train(eager, args, kwargs), _train(compiled, args, kwargs)
    for step, ((lw, gw), (lg, gg)) in enumerate(zip(want, got)):
        torch.testing.assert_close(lg, lw, rtol=RTOL, atol=ATOL, msg=lambda m: f"loss of step {step}: {m}")
        assert gw.keys() == gg.keys()
        for key in gw:
            assert (gw[key] is None) == (gg[key] is None), f"step {step}: gradient of {key}"
            if gw[key] is not None:
                torch.testing.assert_close(gg[key], gw[key], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step}: gradient of {key}: {m}")
    return compiled


@pytest.mark.parametrize("name,baseline", [("mlp", "data_parallel"), ("mlp", "megatron"), ("mlp", None),
                                           ("gpt2-tiny", "megatron")])
def test_compiled_training_equals_eager(name, baseline):
    """Inductor-compiled steps give eager's losses and gradients (data parallel, Megatron, solved)."""
    on_all_ranks(f"{name} {baseline or 'solved'} compiled with inductor", _compare, name, baseline, True)


def _per_rank_loss_run() -> None:
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box = [autoshard.plan(_graph("gpt2-tiny"), mesh=MESH, hardware="cpu-gloo", baseline="data_parallel",
                              outputs="local", loss="per_rank").to_dict()]
    dist.broadcast_object_list(box, 0)
    compiled = _compare("gpt2-tiny", "data_parallel", True, Plan.from_dict(box[0]))
    assert compiled.output_specs[0].partial == (0, 1)       # each rank's own loss, no all-reduce


def test_compiled_per_rank_loss_equals_eager():
    """loss="per_rank" with local outputs (each rank's own loss, its gradient unscaled) compiles."""
    on_all_ranks("gpt2-tiny data parallel, per-rank loss, compiled", _per_rank_loss_run)


def _no_grad_run(name: str, baseline: str | None) -> None:
    model, args, kwargs = _model(name)
    plan, mesh = _plan(name, baseline), device_mesh(MESH)
    eager = autoshard.parallelize(copy.deepcopy(model), plan, mesh, graph=_graph(name)).eval()
    compiled = autoshard.parallelize(copy.deepcopy(model), plan, mesh, graph=_graph(name), compile=True).eval()
    assert compiled.compiled is not None and eager.compiled is None
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args, **kwargs), eager(*args, **kwargs), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name,baseline", [("mlp", "megatron"), ("mlp", None)])
def test_compiled_eval_without_grad_equals_eager(name, baseline):
    """Evaluation under no_grad: the collectives' non-differentiable branch, compiled."""
    on_all_ranks(f"{name} {baseline or 'solved'} eval under no_grad", _no_grad_run, name, baseline)


class _Recorder:
    """A torch.compile backend recording dynamo's graphs and AOTAutograd's forward/backward graphs."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        self.dynamo: list[torch.fx.GraphModule] = []
        self.fw: list[torch.fx.GraphModule] = []
        self.bw: list[torch.fx.GraphModule] = []

        def keep(into: list):
            def compiler(gm: torch.fx.GraphModule, example_inputs: Any):
                into.append(gm)
                return make_boxed_func(gm.forward)
            return compiler

        # inductor's partitioner (the default one of aot_autograd places ops by their position in
        # the joint graph and puts a dead copy of forward collectives into the backward)
        self._aot = aot_autograd(fw_compiler=keep(self.fw), bw_compiler=keep(self.bw),
                                 partition_fn=min_cut_rematerialization_partition)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any):
        self.dynamo.append(gm)
        return self._aot(gm, example_inputs)


def _collectives(graphs: list[torch.fx.GraphModule]) -> int:
    """Collective ops (not waits) of the functional-collective namespace in ``graphs``."""
    return sum(1 for gm in graphs for n in gm.graph.nodes
               if n.op == "call_function" and str(n.target).startswith("_c10d_functional.")
               and "wait_tensor" not in str(n.target))


def _graph_run(name: str, baseline: str | None) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    recorder = _Recorder()
    compiled = _compare(name, baseline, {"backend": recorder})
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert len(recorder.dynamo) == 1 and len(recorder.fw) == 1 and len(recorder.bw) == 1, \
        (len(recorder.dynamo), len(recorder.fw), len(recorder.bw))
    # the eager program's collectives for one step, by phase; the bucketed all-reduces stay eager
    model, args, kwargs = _model(name)
    eager = autoshard.parallelize(copy.deepcopy(model), _plan(name, baseline), device_mesh(MESH), graph=_graph(name))
    with eager.comm.counter.recording() as counter:
        _loss(eager, args, kwargs).backward()
    calls = {"fwd": 0, "bwd": 0}
    for (kind, axes, phase), (_, n) in counter.totals().items():
        calls[phase] += n
    buckets = len(eager._grad_sync.buckets)
    assert calls["fwd"] + calls["bwd"] - buckets > 0, f"the plan should have in-graph collectives: {calls}"
    assert _collectives(recorder.fw) == calls["fwd"], (_collectives(recorder.fw), calls)
    assert _collectives(recorder.bw) == calls["bwd"] - buckets, (_collectives(recorder.bw), calls, buckets)
    # the compiled program's bucketed gradients are still synchronised after backward (eager hooks)
    assert len(compiled._grad_sync.buckets) == buckets


@pytest.mark.parametrize("name,baseline", [("mlp", None), ("gpt2-tiny", "megatron"), ("llama-tiny", "zero3")])
def test_compiled_program_has_no_graph_break(name, baseline):
    """Dynamo captures the whole forward in one graph and AOTAutograd the whole backward, with the
    plan's collectives inside: no graph break from the collectives."""
    on_all_ranks(f"{name} {baseline or 'solved'} graphs", _graph_run, name, baseline)


def _every_segment(decision: str) -> Plan:
    plan = Plan.from_dict(_plan("gpt2-tiny", "megatron").to_dict())
    plan.segments = {segment: decision for segment in plan.segments}
    return plan


def _recompute_run() -> None:
    from torch._dynamo.utils import counters

    plan = _every_segment("recompute")
    torch._dynamo.reset()
    counters.clear()
    recorder = _Recorder()
    compiled = _compare("gpt2-tiny", "megatron", {"backend": recorder}, plan)
    assert "checkpoint" in compiled.code
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert (len(recorder.dynamo), len(recorder.fw), len(recorder.bw)) == (1, 1, 1)
    model, args, kwargs = _model("gpt2-tiny")
    eager = autoshard.parallelize(copy.deepcopy(model), plan, device_mesh(MESH), graph=_graph("gpt2-tiny"))
    with eager.comm.counter.recording() as counter:
        _loss(eager, args, kwargs).backward()
    calls: dict[tuple[str, str], int] = {}
    for (kind, _, phase), (_, n) in counter.totals().items():
        calls[(kind, phase)] = calls.get((kind, phase), 0) + n
    gathers = sum(1 for gm in recorder.bw for n in gm.graph.nodes if "all_gather" in str(n.target))
    reduces = sum(1 for gm in recorder.bw for n in gm.graph.nodes if "_c10d_functional.all_reduce" in str(n.target))
    assert _collectives(recorder.fw) == sum(n for (_, phase), n in calls.items() if phase == "fwd")
    # backward re-runs the regions' all-gathers, as eager recompute does (AOTAutograd's partitioner
    # chooses what else to recompute: here one forward all-reduce more than eager)
    assert calls.get(("all_gather", "recompute"), 0) > 0 and gathers == calls[("all_gather", "recompute")], \
        (gathers, calls)
    assert reduces >= calls[("all_reduce", "bwd")] - len(eager._grad_sync.buckets), (reduces, calls)


def test_recompute_segments_compile_and_equal_eager():
    """Checkpoint regions (every segment recomputed): one graph, no break, eager's losses and gradients."""
    on_all_ranks("gpt2-tiny megatron, every segment recomputed, compiled", _recompute_run)


@pytest.mark.parametrize("decision", ["offload", "partitioned"])
def test_other_memory_decisions_are_a_clear_error(decision):
    """Offload and partitioned regions are not compiled: an error naming them and what to do."""
    def run() -> None:
        model, _, _ = _model("gpt2-tiny")
        with pytest.raises(CompileError, match=rf"{decision}.*compile=False"):
            autoshard.parallelize(model, _every_segment(decision), device_mesh(MESH), graph=_graph("gpt2-tiny"),
                                  compile=True)

    on_all_ranks(f"{decision} plan with compile=True", run)


def _counter_error() -> None:
    model, args, kwargs = _model("mlp")
    pm = autoshard.parallelize(model, _plan("mlp", "megatron"), device_mesh(MESH), graph=_graph("mlp"),
                               compile={"backend": "eager"})
    with pytest.raises(CompileError, match="compile=False"):
        with pm.comm.counter.recording():
            pm(*args, **kwargs)


def test_counting_collectives_of_a_compiled_program_is_a_clear_error():
    on_all_ranks("comm.counter on a compiled program", _counter_error)


def test_bad_compile_argument_is_a_clear_error():
    model, _, _ = _model("mlp")
    with pytest.raises(ArgumentError, match=r"compile must be True, False or a dict of torch.compile options"):
        autoshard.parallelize(model, _plan("mlp", "megatron"), device_mesh(MESH), graph=_graph("mlp"),
                              compile="inductor")


def _batchnorm_state_error() -> None:
    model, args, kwargs = build_model("cnn", device="cpu", batch=8)
    graph = capture_meta(model, args, kwargs, name="cnn")
    plan = autoshard.plan_once(graph, mesh=MESH, hardware="cpu-gloo", baseline="data_parallel")
    plan.segments = {segment: "recompute" for segment in plan.segments}
    assert plan.segments, "the CNN plan should have segments to recompute"
    with pytest.raises(CompileError, match=r"updates module state.*compile=False"):
        autoshard.parallelize(model, plan, device_mesh(MESH), graph=graph, compile=True)


def test_recomputed_module_state_is_a_clear_error():
    """A recomputed region that updates BatchNorm statistics would update them twice compiled."""
    on_all_ranks("cnn (BatchNorm) recompute with compile=True", _batchnorm_state_error)
