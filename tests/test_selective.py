"""Selective recomputation: which runs a block offers, and how plans carry them."""
from __future__ import annotations

import pytest

from autoshard import capture, enumerate_strategies
from autoshard.models import build_model
from autoshard.plans import Plan, PlanError
from autoshard.plans.build import plan_from_solution
from autoshard.solver import build_cost_graph
from autoshard.solver.ilp import SolverOptions, memory_segments, solve
from autoshard.solver.selective import memory_bound_runs, recompute_runs

_CACHE: dict = {}


def _cost_graph(hardware: str):
    if hardware not in _CACHE:
        model, args, kwargs = build_model("gpt2-tiny", device="meta", batch=8, seq=32, n_embd=64)
        table = enumerate_strategies(capture(model, args, kwargs), mesh_shape=(2, 2), hardware=hardware)
        _CACHE[hardware] = build_cost_graph(table)
    return _CACHE[hardware]


def test_gpt2_block_recomputes_its_gelu_alone():
    """On cpu-gloo (matmuls compute-bound) each GPT-2 block offers one run: the tanh GELU between
    its two MLP matmuls; the layer norms (whose saved input is what a checkpoint would store) and
    the view-only runs are not offered."""
    cg = _cost_graph("cpu-gloo")
    runs = recompute_runs(cg)
    assert sorted(runs) == ["transformer.h.0", "transformer.h.1"]
    for seg, seg_runs in runs.items():
        assert len(seg_runs) == 1, seg_runs
        modules = {cg.graph.module_path(n) for n in seg_runs[0].nodes}
        ops = {str(cg.graph.node(n).target) for n in seg_runs[0].nodes}
        assert f"{seg}.mlp.act" in modules and "aten.tanh.default" in ops and "aten.pow.Tensor_Scalar" in ops
        assert not any("addmm" in op or "attention" in op for op in ops)
        assert len(memory_bound_runs(cg)[seg]) > 1                 # the others were candidates
    seg = next(s for s in memory_segments(cg) if s.name == "transformer.h.0")
    (run,) = seg.runs
    assert sum(v[0] for v in run.saved.values()) > sum(v[0] for v in run.stored.values()) > 0


def test_no_run_where_whole_block_recompute_frees_more_per_second():
    """At this tiny size on the a100-nvlink roofline every op is memory-bound: recomputing a whole
    block frees more bytes per second than any run, so selective is not offered and the solver
    cannot pick it."""
    cg = _cost_graph("a100-nvlink")
    assert recompute_runs(cg) == {}
    with pytest.raises(ValueError, match="cannot be selective"):
        solve(cg, SolverOptions(fixed_decision="selective"))


def test_plan_carries_runs_and_maps_nodes_to_their_run(tmp_path):
    cg = _cost_graph("cpu-gloo")
    sol = solve(cg, SolverOptions(fixed_decision="selective"))
    assert set(sol.decisions.values()) == {"selective"}
    assert sol.time.recompute > 0 and sol.memory.working_set > 0
    plan = plan_from_solution(cg, sol, model_name="gpt2-tiny", options=SolverOptions(), budget=None)
    runs = {seg: [r.nodes for r in rs] for seg, rs in recompute_runs(cg).items()}
    assert plan.recompute_runs == runs
    regions = plan.memory_regions()
    assert set(regions) == {n for rs in runs.values() for r in rs for n in r}
    assert {r for r, _ in regions.values()} == {"transformer.h.0#0", "transformer.h.1#0"}
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.recompute_runs == plan.recompute_runs and loaded.segments == plan.segments
    data = plan.to_dict()
    data["recompute_runs"] = {}
    with pytest.raises(PlanError, match="selective but the plan lists no run"):
        Plan.from_dict(data)
    data = plan.to_dict()
    data["segments"]["transformer.h.0"] = "squeeze"
    with pytest.raises(PlanError, match="memory decision 'squeeze'"):
        Plan.from_dict(data)
