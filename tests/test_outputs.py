"""``outputs="local"``: the plan records it, the cost model prices no gathering of non-scalar graph
outputs, plan files round-trip it, and plans written before the field existed load as ``"global"``."""
from __future__ import annotations

import functools
import json

import pytest

import autoshard
from autoshard import cli
from autoshard.capture import CapturedGraph
from autoshard.models import build_model
from autoshard.plans import Plan, PlanError
from autoshard.solver import build_cost_graph
from autoshard.specs import ShardSpec

HW = "cpu-gloo"


@functools.lru_cache(maxsize=None)
def gpt2() -> CapturedGraph:
    model, args, kwargs = build_model("gpt2-tiny", batch=4)
    return autoshard.capture(model, args, kwargs, name="gpt2-tiny")


@functools.lru_cache(maxsize=None)
def data_parallel(outputs: str) -> Plan:
    """The data-parallel plan: the logits [batch, seq, vocab] are produced batch-sharded (S01RR)."""
    return autoshard.plan(gpt2(), mesh=(2, 2), hardware=HW, baseline="data_parallel", outputs=outputs)


def _output_reshards(plan: Plan) -> list:
    return [r for r in plan.reshards if r.dst == "output"]


def test_local_plan_records_the_producers_layout_and_prices_no_gather() -> None:
    glob, local = data_parallel("global"), data_parallel("local")
    assert (glob.outputs, local.outputs) == ("global", "local")
    loss, logits = gpt2().graph.output_node().all_input_nodes          # (loss, logits)
    assert glob.nodes["output"].inputs == ["", "RRR"]
    produced = local.nodes[logits.name].outputs[0]
    assert local.nodes["output"].inputs == ["", produced] and produced == "S01RR"
    assert local.nodes["output"].strategy == "return local"
    # global gathers the logits (forward all-gathers); local reshards nothing into the output
    gathers = _output_reshards(glob)
    assert [r.src for r in gathers] == [logits.name] and gathers[0].cost > 0
    assert _output_reshards(local) == []
    assert local.time["reshard"] == pytest.approx(glob.time["reshard"] - gathers[0].cost)
    assert local.time["total"] == pytest.approx(glob.time["total"] - gathers[0].cost)
    # the other decisions are the same: the plans differ only by the gathers
    assert {n: e.strategy for n, e in local.nodes.items() if n != "output"} == \
        {n: e.strategy for n, e in glob.nodes.items() if n != "output"}
    gathered = {}
    for step in gathers[0].fwd:
        gathered[(step.kind, (step.axis,), "fwd")] = gathered.get((step.kind, (step.axis,), "fwd"), 0) + step.nbytes
    expected = dict(glob.comm_bytes())
    for key, nbytes in gathered.items():
        expected[key] -= nbytes
    assert local.comm_bytes() == {k: v for k, v in expected.items() if v}


def test_cost_graph_has_no_edge_into_the_output_for_non_scalar_tensors() -> None:
    def output_edges(outputs: str) -> dict[str, int]:
        table = autoshard.enumerate_strategies(gpt2(), mesh_shape=(2, 2), hardware=HW, outputs=outputs)
        cg = build_cost_graph(table)
        return {e.src_member: e.tensor.shape for e in cg.edges if e.dst == "output"}

    loss, logits = gpt2().graph.output_node().all_input_nodes
    assert set(output_edges("global")) == {loss.name, logits.name}
    assert output_edges("local") == {loss.name: ()}       # the 0-dim loss stays global, priced as before


def test_local_plan_round_trips_and_old_plans_load_as_global(tmp_path) -> None:
    local = data_parallel("local")
    path = local.save(tmp_path / "plan.json")
    assert json.loads(path.read_text())["outputs"] == "local"
    loaded = Plan.load(path, graph=gpt2())
    assert loaded == local and loaded.outputs == "local"
    old = data_parallel("global").to_dict()
    del old["outputs"]                                   # a plan file from before the field existed
    assert Plan.from_dict(json.loads(json.dumps(old))).outputs == "global"


def test_a_plan_file_with_an_unknown_outputs_value_is_rejected() -> None:
    data = data_parallel("local").to_dict()
    data["outputs"] = "sharded"
    with pytest.raises(PlanError, match="'outputs' must be one of 'global', 'local', got 'sharded'"):
        Plan.from_dict(data)


def test_unknown_outputs_value_raises_value_error_naming_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match="outputs must be one of 'global', 'local', got 'Local'"):
        autoshard.plan(gpt2(), mesh=(2, 2), hardware=HW, outputs="Local")
    with pytest.raises(ValueError, match="outputs must be one of 'global', 'local'"):
        autoshard.enumerate_strategies(gpt2(), mesh_shape=(2, 2), hardware=HW, outputs=None)


def test_explain_says_how_outputs_are_returned() -> None:
    assert "outputs returned global" in data_parallel("global").explain(plain=True)
    assert "outputs returned local" in data_parallel("local").explain(plain=True)


def test_cli_plan_outputs_local(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "gpt2-tiny", "--mesh", "2x2", "--batch", "4", "--hardware", HW,
                     "--outputs", "local", "--out", str(out), "--plain"]) == 0
    capsys.readouterr()
    plan = Plan.load(out)
    assert plan.outputs == "local"
    specs = [ShardSpec.parse(s) for s in plan.nodes["output"].inputs]
    assert specs[0] == ShardSpec.replicate(0)
    assert cli.main(["plan", "gpt2-tiny", "--mesh", "2x2", "--outputs", "whole"]) == 2   # a usage error
    assert "invalid choice: 'whole'" in capsys.readouterr().err


def test_cli_plan_batch_norm_per_rank(tmp_path, capsys) -> None:
    """``--batch-norm per_rank`` plans torch DDP's batch norm: recorded in the plan, said by explain,
    and no strategy of a batch norm communicates statistics; an older plan file reads as global."""
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "cnn", "--mesh", "2x2", "--batch", "8", "--hardware", HW, "--batch-norm", "per_rank",
                     "--out", str(out), "--plain"]) == 0
    capsys.readouterr()
    plan = Plan.load(out)
    assert plan.batch_norm == "per_rank"
    assert "batch norm per rank" in plan.explain(plain=True)
    assert not any(c.operand.startswith("bn-") for n in plan.nodes.values() for c in n.collectives)
    old = plan.to_dict()
    del old["batch_norm"]
    assert Plan.from_dict(json.loads(json.dumps(old))).batch_norm == "global"
    old["batch_norm"] = "local"
    with pytest.raises(PlanError, match="'batch_norm' must be one of 'global', 'per_rank', got 'local'"):
        Plan.from_dict(old)
    with pytest.raises(ValueError, match="batch_norm must be one of 'global', 'per_rank', got 'sync'"):
        autoshard.plan(gpt2(), mesh=(2, 2), hardware=HW, batch_norm="sync")
