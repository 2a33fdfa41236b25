"""Baselines as restrictions: data parallel, Megatron TP+DP and ZeRO-3 on tiny models (2x2 mesh)."""
from __future__ import annotations

import functools

import pytest

from autoshard.capture import capture
from autoshard.enumerate import enumerate_strategies
from autoshard.models import build_model
from autoshard.solver import CostGraph, build_cost_graph
from autoshard.solver.baselines import (BASELINES, DATA_PARALLEL_MARGIN, data_parallel, input_nodes, megatron, parameter_nodes, restriction,
                                        solve_baseline, zero3)
from autoshard.solver.ilp import SolverOptions, objective_of, solve
from autoshard.solver.tp_roles import COLUMN, ROW, linear_roles
from autoshard.specs import ShardSpec
from autoshard.solver.reference import reference_costs
from solver_utils import runtime_change

pytest.importorskip("transformers")

MESH = (2, 2)
LLMS = ["gpt2-tiny", "llama-tiny"]


@functools.lru_cache(maxsize=None)
def graph(name: str, mesh: tuple[int, int] = MESH, batch: int = 8, **overrides) -> CostGraph:
    model, args, kwargs = build_model(name, batch=batch, seq=16, **overrides)
    table = enumerate_strategies(capture(model, args, kwargs), mesh_shape=mesh, hardware="h100-nvlink")
    return build_cost_graph(table)


@functools.lru_cache(maxsize=None)
def unrestricted(name: str):
    return solve(graph(name), SolverOptions())


@functools.lru_cache(maxsize=None)
def baseline(name: str, family: str):
    return solve_baseline(graph(name), family, SolverOptions())


def chosen_specs(cg: CostGraph, sol, nodes) -> dict[str, str]:
    """Placeholder (FQN or input name) -> compact spec it stores under ``sol``."""
    g = cg.graph
    return {g.param_fqn.get(n.members[0], n.members[0]): str(n.strategies[sol.choice[n.name]].output_specs[0])
            for n in nodes}


def by_suffix(specs: dict[str, str], suffix: str) -> set[str]:
    found = {s for fqn, s in specs.items() if fqn.endswith(suffix)}
    assert found, f"no parameter ends with {suffix!r}"
    return found


# -- data parallel ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LLMS)
def test_data_parallel_replicates_params_and_shards_batch(name):
    cg = graph(name)
    sol = baseline(name, "data_parallel").solution
    params = chosen_specs(cg, sol, parameter_nodes(cg))
    assert params and all(ShardSpec.parse(s).is_replicated() for s in params.values()), params
    inputs = chosen_specs(cg, sol, input_nodes(cg))
    assert set(inputs) == {"input_ids", "attention_mask", "labels"}
    assert set(inputs.values()) == {"S01R"}


@pytest.mark.parametrize("name", LLMS + ["bert-tiny"])
def test_data_parallel_carries_the_batch_sharding_through_every_matmul(name):
    """DDP's program: every parameter-reading matmul computes on the batch shard (no input is
    gathered to run replicated) and activations are not resharded between ops; what may move is
    a small mask (the index op reads its tensor replicated) and the graph's outputs."""
    cg = graph(name)
    sol = baseline(name, "data_parallel").solution
    matmuls = [n for n in cg.nodes.values()
               if any(m.startswith(("linear", "addmm")) for m in n.members[:1])]
    assert matmuls
    for node in matmuls:
        strategy = node.strategies[sol.choice[node.name]]
        assert strategy.split == 4, (node.name, strategy.name)
        assert strategy.output_specs[0].dims[0] == (0, 1), (node.name, strategy.name)
    moved = [e for e in cg.edges if cg.nodes[e.dst].kind != "output"
             and e.cost_of(sol.choice[e.src], sol.choice[e.dst]) > 0]
    assert all(e.tensor.nbytes <= 4096 for e in moved), \
        [(e.src_member, e.dst_member, e.tensor.shape) for e in moved]


def test_data_parallel_on_a_1d_mesh_shards_over_the_non_trivial_axis():
    cg = graph("gpt2-tiny", (1, 4))
    r = data_parallel(cg)
    for node in input_nodes(cg):
        assert {str(node.strategies[c].output_specs[0]) for c in r.allowed[node.name]} == {"S1R"}
    assert r.notes == []


def test_batch_that_does_not_divide_falls_back_to_fewer_axes_with_a_note():
    cg = graph("gpt2-tiny", batch=6)
    r = data_parallel(cg)
    node = input_nodes(cg)[0]
    specs = {str(node.strategies[c].output_specs[0]) for c in r.allowed[node.name]}
    assert specs in ({"S0R"}, {"S1R"})
    assert any("does not divide" in n for n in r.notes), r.notes


def test_batch_that_divides_over_no_axis_is_replicated_with_a_note():
    cg = graph("gpt2-tiny", batch=3)
    r = zero3(cg)
    for node in input_nodes(cg):
        assert {str(node.strategies[c].output_specs[0]) for c in r.allowed[node.name]} == {"RR"}
    assert any("divides over no mesh axis" in n for n in r.notes), r.notes


# -- Megatron ---------------------------------------------------------------------------------------

def test_megatron_gpt2_conv1d_layouts():
    cg = graph("gpt2-tiny")
    specs = chosen_specs(cg, baseline("gpt2-tiny", "megatron").solution, parameter_nodes(cg))
    # Conv1D weights are [in, out]: column shards dim 1, row shards dim 0 (tp axis 1)
    assert by_suffix(specs, "attn.c_attn.weight") == {"RS1"}
    assert by_suffix(specs, "attn.c_attn.bias") == {"S1"}
    assert by_suffix(specs, "attn.c_proj.weight") == {"S1R"}
    assert by_suffix(specs, "attn.c_proj.bias") == {"R"}
    assert by_suffix(specs, "mlp.c_fc.weight") == {"RS1"}
    assert by_suffix(specs, "mlp.c_proj.weight") == {"S1R"}
    assert specs["transformer.wte.weight"] == "S1R"       # vocab-parallel, tied with the LM head
    assert specs["transformer.wpe.weight"] == "RR"        # position table: replicated
    assert by_suffix(specs, "ln_1.weight") == {"R"}
    inputs = chosen_specs(cg, baseline("gpt2-tiny", "megatron").solution, input_nodes(cg))
    assert set(inputs.values()) == {"S0R"}                # batch over the data-parallel axis 0


def test_megatron_llama_linear_layouts():
    cg = graph("llama-tiny")
    specs = chosen_specs(cg, baseline("llama-tiny", "megatron").solution, parameter_nodes(cg))
    # nn.Linear weights are [out, in]: column shards dim 0, row shards dim 1
    for col in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight"):
        assert by_suffix(specs, col) == {"S1R"}, col
    for row in ("o_proj.weight", "down_proj.weight"):
        assert by_suffix(specs, row) == {"RS1"}, row
    assert specs["model.embed_tokens.weight"] == "S1R"
    assert specs["lm_head.weight"] == "S1R"
    assert by_suffix(specs, "layernorm.weight") == {"R"}
    assert specs["model.norm.weight"] == "R"


def test_megatron_on_axis_0():
    cg = graph("llama-tiny")
    r = megatron(cg, tp_axis=0)
    q = next(n for n in parameter_nodes(cg) if cg.graph.param_fqn[n.members[0]].endswith("0.self_attn.q_proj.weight"))
    assert {str(q.strategies[c].output_specs[0]) for c in r.allowed[q.name]} == {"S0R"}
    for node in input_nodes(cg):
        assert {str(node.strategies[c].output_specs[0]) for c in r.allowed[node.name]} == {"S1R"}
    with pytest.raises(ValueError, match="tp_axis"):
        megatron(cg, tp_axis=2)


@pytest.mark.parametrize("name", LLMS + ["bert-tiny"])
def test_alternation_rule_reproduces_the_name_table(name):
    cg = graph(name)
    named, alternated = linear_roles(cg), linear_roles(cg, use_names=False)
    assert named == alternated
    assert set(named.values()) == {COLUMN, ROW}


def test_non_divisible_vocab_falls_back_to_replicated_with_a_note():
    cg = graph("gpt2-tiny", vocab_size=127)
    r = megatron(cg)
    wte = next(n for n in parameter_nodes(cg) if cg.graph.param_fqn[n.members[0]] == "transformer.wte.weight")
    assert {str(wte.strategies[c].output_specs[0]) for c in r.allowed[wte.name]} == {"RR"}
    assert any("transformer.wte.weight" in n and "replicated instead" in n for n in r.notes), r.notes
    z = zero3(cg)
    assert {str(wte.strategies[c].output_specs[0]) for c in z.allowed[wte.name]} == {"RS01"}
    assert any("sharded on dim 1" in n for n in z.notes), z.notes


# -- ZeRO-3 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LLMS)
def test_zero3_shards_every_parameter_over_all_devices(name):
    cg = graph(name)
    sol = baseline(name, "zero3").solution
    params = chosen_specs(cg, sol, parameter_nodes(cg))
    for fqn, s in params.items():
        assert ShardSpec.parse(s).dims[0] == (0, 1), (fqn, s)
    assert set(chosen_specs(cg, sol, input_nodes(cg)).values()) == {"S01R"}
    assert baseline(name, "zero3").notes == []


# -- all baselines ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(BASELINES))
@pytest.mark.parametrize("name", LLMS)
def test_baseline_is_no_better_than_the_unrestricted_plan(name, family):
    res = baseline(name, family)
    assert res.solution.status == "optimal"
    assert set(res.solution.decisions.values()) <= {"keep"}
    assert res.solution.objective >= unrestricted(name).objective * (1 - 1e-9)


@pytest.mark.parametrize("family", list(BASELINES))
def test_baseline_no_better_under_a_budget(family):
    cg = graph("llama-tiny")
    budget = int(baseline("llama-tiny", family).solution.memory.peak * 1.001)
    opts = SolverOptions(memory_budget=budget)
    res = solve_baseline(cg, family, opts)
    assert res.solution.memory.peak <= budget
    assert res.solution.objective >= solve(cg, opts).objective * (1 - 1e-9)


@pytest.mark.parametrize("family", list(BASELINES))
@pytest.mark.parametrize("name", LLMS)
def test_baseline_predictions_match_evaluate(name, family):
    cg = graph(name)
    sol = baseline(name, family).solution
    ref = reference_costs(cg, sol.choice)
    assert sol.time.total == pytest.approx(ref.total + sol.time.grad_sync + runtime_change(cg, sol.choice), rel=1e-9)
    assert sol.time.recompute == 0 and sol.time.offload == 0
    keep = {seg: "keep" for seg in sol.decisions}
    assert sol.objective == pytest.approx(objective_of(cg, sol.choice, keep, SolverOptions()), rel=1e-6)
    assert sol.memory.params == ref.params and sol.memory.grads == ref.grads
    assert sol.memory.activations == ref.saved


@pytest.mark.parametrize("family", list(BASELINES))
def test_solution_respects_the_restriction(family):
    cg = graph("llama-tiny")
    res = baseline("llama-tiny", family)
    for node, allowed in res.allowed.items():
        assert res.solution.choice[node] in allowed, node


def test_unknown_baseline_is_an_error():
    with pytest.raises(ValueError, match="unknown baseline"):
        restriction(graph("gpt2-tiny"), "pipeline")


# -- replicated --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LLMS)
def test_replicated_runs_every_node_replicated_with_no_collective(name):
    cg = graph(name)
    sol = baseline(name, "replicated").solution
    assert baseline(name, "replicated").notes == []
    for node in cg.nodes.values():
        for m in node.members:
            s = node.member_strategy(m, sol.choice[node.name])
            assert all(x.is_replicated() for x in (*s.input_specs, *s.output_specs) if x is not None), (m, s.name)
            assert not s.comm, (m, s.name)
    assert sol.time.comm == 0 and sol.time.grad_sync == 0 and sol.time.reshard == 0


def test_the_replicated_plan_replaces_an_ilp_plan_the_step_schedule_models_slower():
    """mlp-256 at batch 8 under the profile its fidelity run measured: the ILP's plan shards all but
    the first layer and defers that layer's activation-gradient all-reduce into the parameters'
    buckets, which the ILP prices inline; predict models it slower than the plan with no collective
    (measured 25.8 against 17.6 ms), so autoshard.plan takes that one and says why."""
    import sys
    from pathlib import Path

    import autoshard

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    import plan_fidelity as pf

    key, profile = "mlp-256", str(bench / "results" / "plan_fidelity_sizes-profile.yaml")
    graph_, _ = pf.capture(key)
    kw = dict(mesh=pf.MESH, hardware=profile, outputs=pf.OUTPUTS, **pf.function_options(key))
    plan = autoshard.plan(graph_, **kw)
    cg = build_cost_graph(enumerate_strategies(graph_, mesh_shape=pf.MESH, hardware=profile, outputs=pf.OUTPUTS,
                                               **pf.function_options(key)))
    ilp = solve(cg, SolverOptions(memory_budget=plan.memory_budget))
    assert plan.time["total"] < ilp.time.total
    assert "replicated plan" in plan.solver.note and "replaces the ILP's plan" in plan.solver.note
    assert all(n.comm_bytes == 0 for n in plan.nodes.values()) and not plan.reshards


@pytest.mark.parametrize("hardware", ["cpu-gloo", "h100-nvlink"])
def test_the_plan_picked_is_no_slower_than_any_baseline_under_the_step_model(hardware):
    """autoshard.plan returns the ILP's plan or, where the exact step schedule (predict) models the
    best plan of an arbitrated family faster, that one, and says so in plan.solver.note; the plan is
    no slower than any family's best, Megatron's (not arbitrated) included."""
    import autoshard

    model, args, kwargs = build_model("gpt2-tiny", batch=8, seq=128, n_positions=128, n_embd=128, vocab_size=2048)
    graph = capture(model, args, kwargs)
    plan = autoshard.plan(graph, mesh=MESH, hardware=hardware, outputs="local")
    budget = plan.memory_budget
    cg = build_cost_graph(enumerate_strategies(graph, mesh_shape=MESH, hardware=hardware, outputs="local"))
    ilp = solve(cg, SolverOptions(memory_budget=budget))
    bests = {family: solve_baseline(cg, family, SolverOptions(memory_budget=budget)).solution.time.total
             for family in BASELINES}
    fastest = min(ilp.time.total, *bests.values())
    if plan.solver.note and plan.solver.note.startswith("the data-parallel plan"):
        # kept over a plan modeled faster by at most DATA_PARALLEL_MARGIN
        assert plan.time["total"] == pytest.approx(bests["data_parallel"], rel=1e-9)
        assert fastest < plan.time["total"] <= fastest * (1 + DATA_PARALLEL_MARGIN)
    else:
        assert plan.time["total"] <= fastest * (1 + 1e-9)
        # data parallelism: the plan, modeled more than the margin slower, or slower than ZeRO-3 or replicated
        dp = bests["data_parallel"]
        assert (dp == pytest.approx(plan.time["total"], rel=1e-9) or dp > plan.time["total"] * (1 + DATA_PARALLEL_MARGIN)
                or min(bests["zero3"], bests["replicated"]) < dp)
    if plan.time["total"] != pytest.approx(ilp.time.total, rel=1e-9):
        assert plan.solver.note and "replaces the" in plan.solver.note


def _fidelity_plan(key: str, run: str, **options):
    """``key``'s plan as bench/plan_fidelity.py makes it, under the profile its run ``run`` measured."""
    import sys
    from pathlib import Path

    import autoshard

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    import plan_fidelity as pf

    graph_, _ = pf.capture(key)
    profile = str(bench / "results" / f"{run}-profile.yaml")
    return autoshard.plan(graph_, mesh=pf.MESH, hardware=profile, outputs=pf.OUTPUTS, **pf.function_options(key),
                          **options)


def test_the_data_parallel_plan_is_kept_over_a_plan_modeled_only_a_few_percent_faster():
    """cnn-28 at batch 8 x 32 x 32 under the profile of its fidelity re-run: the ILP's plan (the first
    conv's channels over axis 0, the batch over axis 1) is modeled 1.5% faster than data parallelism
    and ran 1.15x slower; autoshard.plan keeps data parallelism and says why. With the margin 0 it
    returns the ILP's plan."""
    kept = _fidelity_plan("cnn-28:8x32", "plan_fidelity_rerun")
    assert kept.solver.note.startswith("the data-parallel plan") and "5% faster" in kept.solver.note
    assert [(c.kind, c.axes, c.phase) for c in kept.comm] == [("all_reduce", [0, 1], "bwd")]   # gradient sync only
    fastest = _fidelity_plan("cnn-28:8x32", "plan_fidelity_rerun", prefer_data_parallel_within=0.0)
    assert fastest.time["total"] < kept.time["total"] <= fastest.time["total"] * (1 + DATA_PARALLEL_MARGIN)
    assert ("all_reduce", [0], "fwd") in [(c.kind, c.axes, c.phase) for c in fastest.comm]   # the partial sums
    assert not (fastest.solver.note or "").startswith("the data-parallel plan")


def test_a_plan_modeled_well_ahead_of_data_parallelism_is_not_replaced():
    """mlp-288 at batch 8 under the profile of its fidelity run: the solved plan is modeled 2.2x
    faster than data parallelism (measured 2.0x); the margin leaves it."""
    plan = _fidelity_plan("mlp-288:8", "plan_fidelity_busy")
    dp = _fidelity_plan("mlp-288:8", "plan_fidelity_busy", baseline="data_parallel")
    assert plan.time["total"] * (1 + DATA_PARALLEL_MARGIN) < dp.time["total"]
    assert not (plan.solver.note or "").startswith("the data-parallel plan")
