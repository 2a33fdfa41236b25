"""Plan: building, JSON round trip, validation on load, fingerprint checks, explain, the
top-level ``autoshard.plan`` API (input validation) and the ``plan``/``explain`` CLI."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import sys
from collections import Counter

import pytest

import autoshard
from autoshard import cli
from autoshard.capture import CapturedGraph
from autoshard.hardware import HardwareError, available_profiles, load_hardware
from autoshard.mesh import MeshError
from autoshard.models import build_model
from autoshard.plans import PLAN_FORMAT_VERSION, Plan, PlanError, PlanMismatchError
from autoshard.plans.build import plan_from_solution
from autoshard.reshard import reshard_plan
from autoshard.solver import CostGraph, build_cost_graph
from autoshard.param_gather import gathered_bytes
from autoshard.solver.evaluate import _gather_seconds
from autoshard.solver.ilp import (InfeasibleBudgetError, Solution, SolverOptions, minimum_budget, param_gathers, predict,
                                 solve)
from autoshard.specs import ShardSpec
from autoshard.units import format_bytes

HW = "cpu-gloo"
GPT2_LAYERS = 4


@functools.lru_cache(maxsize=None)
def graph_of(name: str, batch: int = 4, num_layers: int | None = None) -> CapturedGraph:
    overrides = {} if num_layers is None else {"num_layers": num_layers}
    model, args, kwargs = build_model(name, batch=batch, **overrides)
    return autoshard.capture(model, args, kwargs, name=name)


def gpt2() -> CapturedGraph:
    return graph_of("gpt2-tiny", 4, GPT2_LAYERS)


@functools.lru_cache(maxsize=None)
def planned(name: str, mesh: tuple[int, int] = (2, 2)) -> Plan:
    graph = gpt2() if name == "gpt2-tiny" else graph_of(name)
    return autoshard.plan(graph, mesh=mesh, hardware=HW, memory_budget="4GiB", name=name)


@functools.lru_cache(maxsize=None)
def cost_graph(name: str, mesh: tuple[int, int], merge: bool = True) -> CostGraph:
    graph = gpt2() if name == "gpt2-tiny" else graph_of(name)
    table = autoshard.enumerate_strategies(graph, mesh_shape=mesh, hardware=HW)
    return build_cost_graph(table, merge_followers=merge)


def random_plan(cg: CostGraph, seed: int, decision: str = "keep") -> tuple[Plan, dict[str, int]]:
    """A plan of a random strategy assignment (lots of collectives and reshardings)."""
    rng = random.Random(seed)
    choice = {name: rng.randrange(len(node)) for name, node in cg.nodes.items()}
    decisions = {n.segment: decision for n in cg.nodes.values()
                 if n.segment is not None and n.kind == "call_function"}
    options = SolverOptions()
    time_pred, mem = predict(cg, choice, decisions, options)
    solution = Solution(choice, decisions, time_pred, mem, "Optimal", time_pred.total, 0.0, 0.0, 0, 0, "highs")
    return plan_from_solution(cg, solution, model_name="random", options=options, budget=None), choice


def expected_comm(cg: CostGraph, choice: dict[str, int]) -> Counter:
    """Bytes by (kind, axes, phase), from the cost graph: each CGNode's strategy (merged nodes'
    strategies carry their members' collectives and the resharding between members) and each
    edge's cheapest resharding, forward and, when gradient flows, backward; where the runtime
    gathers parameters per block (autoshard.param_gather), one all-gather and one reduce-scatter
    per group instead of those edges' reshardings and their consumers' gradient all-reduces."""
    total: Counter = Counter()
    gathers = param_gathers(cg, choice)
    for node in cg.nodes.values():
        for c in node.strategies[choice[node.name]].comm:
            total[(c.kind, tuple(c.axes), c.phase)] += c.nbytes
        for member in node.members:
            for c in node.member_strategy(member, choice[node.name]).comm:
                if c.phase == "bwd" and c.operand.startswith("in") and (member, int(c.operand[2:])) in gathers.uses:
                    total[(c.kind, tuple(c.axes), c.phase)] -= c.nbytes
    for group in gathers.groups:
        for kind, phase in (("all_gather", "fwd"), ("reduce_scatter", "bwd")):
            total[(kind, group.axes, phase)] += gathered_bytes(cg.graph, group)
        for p in group.params:
            if p.leftover:
                host = cg.node_of[p.name]
                total[("all_reduce", p.leftover, "bwd")] += int(cg.nodes[host].costs.grads[choice[host]])
    for e in cg.edges:
        if (e.dst_member, e.operand) in gathers.uses:
            continue
        a, b = e.src_index[choice[e.src]], e.dst_index[choice[e.dst]]
        src, dst = e.src_specs[a], e.dst_specs[b]
        moves = [("fwd", src, dst, e.nbytes_fwd[a, b])] + ([("bwd", dst, src, e.nbytes_bwd[a, b])] if e.grad else [])
        for phase, x, y, nbytes in moves:
            steps = [s for s in reshard_plan(x, y, e.tensor.shape, e.tensor.dtype.itemsize, cg.mesh.shape,
                                             cg.hardware, str(e.tensor.dtype)).steps if s.collective is not None]
            assert sum(s.nbytes for s in steps) == nbytes
            for s in steps:
                total[(s.kind, (s.axis,), phase)] += s.nbytes
    return total


# -- contents ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,mesh", [("gpt2-tiny", (2, 2)), ("llama-tiny", (1, 4)), ("mlp", (2, 2))])
def test_plan_records_every_graph_node_with_parseable_specs(name: str, mesh: tuple[int, int]) -> None:
    plan = planned(name, mesh)
    graph = gpt2() if name == "gpt2-tiny" else graph_of(name)
    assert list(plan.nodes) == [n.name for n in graph.graph.nodes]
    assert plan.format_version == PLAN_FORMAT_VERSION and plan.autoshard_version == autoshard.__version__
    assert plan.fingerprint == graph.fingerprint() and plan.model_name == name
    assert plan.mesh_shape == list(mesh) and plan.memory_budget == 4 * 2**30
    assert plan.hardware == load_hardware(HW).to_dict()
    assert plan.solver_options["solver"] == "highs" and plan.solver_options["memory_budget"] == 4 * 2**30
    assert set(plan.timings) == {"capture_s", "enumerate_s", "costgraph_s", "solving_s", "build_s", "solve_s"}
    assert plan.timings["solving_s"] >= plan.timings["solve_s"]         # the stage holds every ILP solved
    for entry in plan.nodes.values():
        for spec in entry.inputs + [s for s in entry.outputs if s is not None]:
            assert str(ShardSpec.parse(spec)) == spec
    for p, fqn in graph.param_fqn.items():
        assert plan.nodes[p].fqn == fqn and plan.nodes[p].kind == "placeholder"
    assert plan.solver.status and plan.solver.n_variables > 0 and plan.solver.solve_seconds >= 0
    static = sum(plan.memory[k] for k in ("params", "grads", "optimizer"))
    held = static + plan.memory["activations"]
    peak = max(held, held - plan.memory.get("post_segment", 0.0) + plan.memory["working_set"])
    assert plan.memory["bound"] == pytest.approx(peak) and plan.memory["peak"] <= plan.memory["bound"]


@pytest.mark.parametrize("merge", [True, False])
def test_node_costs_and_reshardings_add_up_to_the_modeled_step_time(merge: bool) -> None:
    cg = cost_graph("gpt2-tiny", (2, 2), merge)
    plan, choice = random_plan(cg, seed=1)
    graph_choice = cg.graph_choice(choice)
    for name, entry in plan.nodes.items():
        assert entry.strategy == cg.table[name].strategies[graph_choice[name]].name
    assert sum(n.compute_fwd + n.compute_bwd for n in plan.nodes.values()) == pytest.approx(plan.time["compute"])
    # inline collectives, plus the parameter-gradient all-reduces the runtime cannot bucket, plus
    # the per-block parameter gathers, which replace their uses' reshardings and gradient all-reduces
    gathers = param_gathers(cg, choice)
    _, grouped = _gather_seconds(cg, choice, gathers)
    inline = sum(c.cost for n in plan.nodes.values() for c in n.collectives if not c.bucketed)
    assert inline - 1e-12 <= plan.time["comm"] <= sum(n.comm_seconds for n in plan.nodes.values()) + grouped + 1e-12
    assert sum(r.cost for r in plan.reshards if (r.dst, r.operand) not in gathers.uses) == pytest.approx(
        plan.time["reshard"])
    assert plan.time["comm"] > 0 and plan.time["reshard"] > 0       # the random plan does communicate
    for r in plan.reshards:   # each resharding joins the producer's output spec to the consumer's input spec
        assert plan.nodes[r.src].outputs[r.src_output] == r.src_spec != r.dst_spec
        assert plan.nodes[r.dst].inputs[r.operand] == r.dst_spec
        assert r.fwd and r.fwd[-1].after == r.dst_spec
        assert not r.bwd or r.bwd[-1].after == r.src_spec


@pytest.mark.parametrize("name,mesh", [("gpt2-tiny", (2, 2)), ("llama-tiny", (1, 4))])
@pytest.mark.parametrize("merge", [True, False])
def test_comm_bytes_equal_strategy_collectives_plus_reshard_steps(name: str, mesh: tuple[int, int],
                                                                  merge: bool) -> None:
    cg = cost_graph(name, mesh, merge)
    for seed in (0, 1):
        plan, choice = random_plan(cg, seed)
        expected = expected_comm(cg, choice)
        assert plan.comm_bytes() == {k: v for k, v in expected.items() if v}
        assert {phase for _, _, phase in plan.comm_bytes()} <= {"fwd", "bwd"}


def test_recomputed_segments_count_their_forward_collectives_again() -> None:
    cg = cost_graph("gpt2-tiny", (2, 2))
    plan, choice = random_plan(cg, seed=3, decision="recompute")
    gathered = param_gathers(cg, choice).uses        # gathered once, before any recomputed region
    again: Counter = Counter()
    for node in plan.nodes.values():
        if node.kind == "call_function" and node.segment is not None:
            for c in node.collectives:
                if c.phase == "fwd":
                    again[(c.kind, tuple(c.axes))] += c.nbytes
    for r in plan.reshards:
        if plan.nodes[r.dst].segment is not None and (r.dst, r.operand) not in gathered:
            for s in r.fwd:
                if s.is_collective:
                    again[(s.kind, (s.axis,))] += s.nbytes
    recompute = {(k, axes): n for (k, axes, phase), n in plan.comm_bytes().items() if phase == "recompute"}
    assert recompute and recompute == {k: v for k, v in again.items() if v}


# -- serialisation -------------------------------------------------------------------------------------

def test_json_round_trip(tmp_path) -> None:
    plan = planned("gpt2-tiny")
    path = plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["format_version"] == PLAN_FORMAT_VERSION
    loaded = Plan.load(path, graph=gpt2())
    assert loaded.to_dict() == plan.to_dict()
    assert loaded == plan
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_random_plan_round_trips() -> None:
    plan, _ = random_plan(cost_graph("llama-tiny", (1, 4), False), seed=2, decision="partitioned")
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).to_dict() == plan.to_dict()


def test_load_against_another_model_names_both_fingerprints(tmp_path) -> None:
    plan = planned("gpt2-tiny")
    path = plan.save(tmp_path / "plan.json")
    other = graph_of("llama-tiny")
    with pytest.raises(PlanMismatchError) as err:
        Plan.load(path, graph=other)
    message = str(err.value)
    assert plan.fingerprint in message and other.fingerprint() in message
    assert "gpt2-tiny" in message and "Re-plan" in message
    with pytest.raises(PlanMismatchError):          # same model, another batch size
        plan.check(graph_of("gpt2-tiny", 8, GPT2_LAYERS))
    plan.check(gpt2())


def _write(tmp_path, text: str):
    path = tmp_path / "plan.json"
    path.write_text(text)
    return path


def _good_dict() -> dict:
    return planned("mlp").to_dict()


@pytest.mark.parametrize("case,expected", [
    ("truncated", "not valid JSON"),
    ("not json", "not valid JSON"),
    ("list", "expected a JSON object, got a list"),
    ("no version", "no 'format_version'"),
    ("wrong version", "format version 99"),
    ("missing field", "lacks field(s) 'nodes'"),
    ("wrong type", "field 'mesh_shape' should be a list"),
    ("bad node", "field 'nodes'['linear']: field 'strategy' should be a string"),
    ("bad spec", "node 'linear' has a malformed spec"),
    ("bad hardware", "hardware profile is malformed"),
])
def test_corrupt_plan_files_raise_plan_error(tmp_path, case: str, expected: str) -> None:
    data = _good_dict()
    text = json.dumps(data)
    if case == "truncated":
        text = text[: len(text) // 2]
    elif case == "not json":
        text = "this is not a plan\n"
    elif case == "list":
        text = json.dumps([data])
    else:
        if case == "no version":
            del data["format_version"]
        elif case == "wrong version":
            data["format_version"] = 99
        elif case == "missing field":
            del data["nodes"]
        elif case == "wrong type":
            data["mesh_shape"] = "2x2"
        elif case == "bad node":
            data["nodes"]["linear"]["strategy"] = 3
        elif case == "bad spec":
            data["nodes"]["linear"]["inputs"][0] = "S9X"
        elif case == "bad hardware":
            del data["hardware"]["axes"]
        text = json.dumps(data)
    with pytest.raises(PlanError) as err:
        Plan.load(_write(tmp_path, text))
    message = str(err.value)
    assert expected in message and "Re-create the plan" in message
    assert not isinstance(err.value, PlanMismatchError)


def test_missing_plan_file(tmp_path) -> None:
    with pytest.raises(PlanError, match="cannot read plan file"):
        Plan.load(tmp_path / "nope.json")


# -- the API: validation -------------------------------------------------------------------------------

def test_infeasible_budget_names_the_smallest_feasible_one() -> None:
    budget = 16 * 2**10
    with pytest.raises(InfeasibleBudgetError) as err:
        autoshard.plan(gpt2(), mesh=(2, 2), hardware=HW, memory_budget="16KiB")
    need, _ = minimum_budget(cost_graph("gpt2-tiny", (2, 2)), SolverOptions(memory_budget=budget))
    assert need > budget
    assert f"smallest feasible budget is {format_bytes(need, round_up=True)}" in str(err.value)
    assert "16.00 KiB" in str(err.value)


def test_mesh_that_does_not_divide_the_batch() -> None:
    model, args, kwargs = build_model("mlp", batch=4)
    with pytest.raises(MeshError) as err:
        autoshard.plan(model, args, kwargs, mesh=(3, 1), hardware=HW)
    message = str(err.value)
    assert "batch size 4" in message and "mesh 3x1" in message and "multiple of 3" in message
    with pytest.raises(MeshError, match="batch size 4"):     # a captured graph is checked the same way
        autoshard.plan(graph_of("mlp", 4), mesh="3x1", hardware=HW)
    plan = autoshard.plan(graph_of("mlp", 4), mesh="3x1", hardware=HW, check_batch=False)
    assert plan.mesh_shape == [3, 1]


@pytest.mark.parametrize("mesh", ["2x", (2, 2, 2), (0, 2), ("a", 2), "two"])
def test_malformed_mesh(mesh) -> None:
    with pytest.raises(MeshError):
        autoshard.plan(graph_of("mlp"), mesh=mesh, hardware=HW)


def test_unknown_hardware_lists_known_profiles() -> None:
    with pytest.raises(HardwareError) as err:
        autoshard.plan(graph_of("mlp"), mesh=(2, 2), hardware="tpu-v9")
    assert "tpu-v9" in str(err.value)
    for name in available_profiles():
        assert name in str(err.value)


@pytest.mark.parametrize("budget", ["40XB", -5, 0, "0GiB", True])
def test_unreadable_budget(budget) -> None:
    with pytest.raises(autoshard.BudgetError):
        autoshard.plan(graph_of("mlp"), mesh=(2, 2), hardware=HW, memory_budget=budget)


def test_default_budget_is_the_profiles_memory() -> None:
    plan = autoshard.plan(graph_of("mlp"), mesh=(1, 4), hardware=HW)
    assert plan.memory_budget == load_hardware(HW).memory_per_device
    assert plan.memory["peak"] <= plan.memory_budget


# -- explain -------------------------------------------------------------------------------------------

def test_explain_summary_and_plain_mode() -> None:
    plan = planned("gpt2-tiny")
    plain = plan.explain(plain=True)
    rich = plan.explain(color=True)
    assert plan.explain() == plain                                 # plain unless colour is asked for
    for text in (plain, rich):
        for needle in ("autoshard plan for gpt2-tiny", "mesh 2x2 (4 devices)", "hardware cpu-gloo",
                       "memory budget 4.00 GiB per device", "predicted peak memory per device",
                       "modeled step time", "solver: highs", "per-node decisions"):
            assert needle in text, needle
    assert "\x1b[" not in plain and "\x1b[" in rich
    assert str(plan) == "\n".join(plan.summary_lines()) and "per-node decisions" not in str(plan)
    peak = format_bytes(plan.memory["peak"])
    assert f"predicted peak memory per device: {peak}" in plain


def test_explain_groups_identical_layers_unless_full() -> None:
    plan = planned("gpt2-tiny")
    layer3 = [n.name for n in plan.nodes.values() if n.segment == "transformer.h.3"]
    layer0 = [n.name for n in plan.nodes.values() if n.segment == "transformer.h.0"]
    assert layer3 and layer0
    grouped = node_table(plan.explain(plain=True))
    full = node_table(plan.explain(plain=True, full=True))
    assert any(line.startswith("transformer.h.1-3") and "same as transformer.h.0" in line for line in grouped)
    first = {line.split()[0] for line in grouped}
    assert set(layer0) <= first and not set(layer3) & first
    assert [line.split()[0] for line in full] == list(plan.nodes)
    assert not any("same as" in line for line in full)


def test_explain_does_not_group_layers_that_differ() -> None:
    plan, _ = random_plan(cost_graph("gpt2-tiny", (2, 2)), seed=4)     # every layer chose differently
    grouped = node_table(plan.explain(plain=True))
    assert [line.split()[0] for line in grouped] == list(plan.nodes)
    assert not any("same as" in line for line in grouped)


def node_table(text: str) -> list[str]:
    """The rows of the plain per-node table (no title, header or rule)."""
    lines = text.splitlines()
    start = lines.index("per-node decisions") + 3
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return lines[start:end]


def test_strategy_of() -> None:
    plan = planned("mlp")
    entry = plan.strategy_of("linear")
    assert entry["op"] == "aten.linear.default" and entry["module"] == "net.0"
    assert entry["strategy"] == plan.nodes["linear"].strategy and entry["inputs"] == plan.nodes["linear"].inputs
    with pytest.raises(KeyError, match="did you mean 'linear'"):
        plan.strategy_of("linearr")


# -- CLI -----------------------------------------------------------------------------------------------

def test_cli_plan_and_explain(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "plan.json"
    rc = cli.main(["plan", "gpt2-tiny", "--mesh", "2x2", "--batch", "4", "--hardware", HW,
                   "--budget", "4GiB", "--out", str(out), "--plain"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "autoshard plan for gpt2-tiny" in captured.out and "modeled step time" in captured.out
    assert "\x1b[" not in captured.out
    assert "solving the ILP" in captured.err                       # progress on stderr
    plan = Plan.load(out)
    assert plan.mesh_shape == [2, 2] and plan.memory_budget == 4 * 2**30 and plan.model_name == "gpt2-tiny"

    summary = "\n".join(plan.summary_lines())
    assert cli.main(["explain", str(out), "--plain"]) == 0          # the summary, and how to get the table
    text = capsys.readouterr().out
    assert text.startswith(summary) and "per-node decisions of the" in text and "add --full" in text
    assert len(text.splitlines()) <= len(plan.summary_lines()) + 1
    assert cli.main(["explain", str(out), "--full", "--plain"]) == 0
    assert capsys.readouterr().out == plan.explain(plain=True, full=True)
    assert cli.main(["explain", str(out), "--full"]) == 0            # piped: plain text, as with --plain
    assert capsys.readouterr().out == plan.explain(plain=True, full=True)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert cli.main(["explain", str(out), "--full"]) == 0            # on a terminal: rich tables
    text = capsys.readouterr().out
    assert "per-node decisions" in text and "┃" in text


@pytest.mark.parametrize("argv,needle", [
    (["plan", "mlp", "--mesh", "2x2", "--budget", "1KiB", "--hardware", HW], "smallest feasible budget"),
    (["plan", "mlp", "--mesh", "2x2", "--budget", "40XB"], "cannot read size '40XB'"),
    (["plan", "mlp", "--mesh", "3x1", "--batch", "4"], "batch size 4"),
    (["plan", "mlp", "--mesh", "2x2", "--hardware", "tpu-v9"], "unknown hardware profile"),
])
def test_cli_errors_exit_2_with_one_line(argv, needle, capsys) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("autoshard plan: error:") and needle in err[-1]
    assert not any("Traceback" in line for line in err)


def test_cli_explain_corrupt_plan(tmp_path, capsys) -> None:
    path = _write(tmp_path, '{"format_version": 1, "nodes"')
    assert cli.main(["explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not valid JSON" in err and "Traceback" not in err


def test_solution_totals_are_json_numbers() -> None:
    data = json.loads(json.dumps(planned("llama-tiny", (1, 4)).to_dict()))
    assert all(isinstance(v, float) and math.isfinite(v) for v in data["time"].values())
    assert all(isinstance(v, float) for v in data["memory"].values())


def test_the_summary_says_how_much_is_sharded() -> None:
    """The data-parallel plan says which compute ops run on shards; a plan where every device runs
    the whole step says so (a tiny model on CPU ranks, where one collective costs milliseconds)."""
    graph = graph_of("gpt2-tiny", 8)
    dp = autoshard.plan(graph, mesh=(2, 2), hardware="cpu-gloo", baseline="data_parallel")
    line = next(x for x in dp.summary_lines() if x.startswith("sharding:"))
    ops = sum(n.kind == "call_function" and n.compute_fwd + n.compute_bwd > 0 for n in dp.nodes.values())
    split, total = (int(x) for x in line.removeprefix("sharding: ").split(" compute ops")[0].split(" of "))
    assert total == ops and 0 < split < total and "parameters: 0 of" in line
    replicated = autoshard.plan(graph, mesh=(2, 2), hardware="cpu-gloo")
    assert all(n.comm_bytes == 0 for n in replicated.nodes.values()) and not replicated.reshards
    assert f"sharding: none - every device runs all {ops} compute ops" in "\n".join(replicated.summary_lines())


@pytest.mark.parametrize("mesh", [(1, 1), (2, 2)])
def test_offloaded_bytes_read_getitem_as_the_view_it_is(mesh: tuple[int, int]) -> None:
    # GPT-2's attention splits q, k, v and reads them through getitem. The plan's offloaded bytes
    # looked at each offloaded node's op profile and profiled getitem as an op on the split's first
    # operand: with a batch of 2, getitem(x, 2) indexed dim 0 and raised; with a larger batch it
    # silently profiled x[i]. getitem is a free view: it saves nothing, so the bytes scale with the batch.
    def offloaded(batch: int) -> float:
        cg = build_cost_graph(autoshard.enumerate_strategies(graph_of("gpt2-tiny", batch, 2), mesh_shape=mesh,
                                                             hardware="h100-nvlink"))
        options = SolverOptions(memory_budget=None)
        free = solve(cg, options)
        offload = {s: "offload" for s in free.decisions}
        t, mem = predict(cg, free.choice, offload, options)
        sol = dataclasses.replace(free, decisions=offload, time=t, memory=mem, objective=t.total, status="hand")
        return plan_from_solution(cg, sol, model_name="gpt2-tiny", options=options, budget=None).memory["offloaded"]

    small, large = offloaded(2), offloaded(8)
    assert small > 0
    assert large == pytest.approx(4 * small, rel=0.02)      # the causal mask is the part that does not scale
