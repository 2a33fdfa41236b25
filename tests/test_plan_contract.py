"""The plan is the only contract between planning and running: each node's decision is stored
structurally (specs, per-axis option tags, split, collectives), the runtime rebuilds it from the
plan entry and never enumerates strategies again, and an entry that does not fit the graph is a
:class:`LoweringError` that names the node and says to re-plan. (That the runtime, so lowered,
trains like the model on 4 real ranks is tests/distributed/test_runtime_contract.py.)"""
from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import pytest
import torch

import autoshard
from autoshard.enumerate import enumerate_strategies
from autoshard.handlers.registry import REGISTRY
from autoshard.models import build_model
from autoshard.phases import Phase
from autoshard.plans import Plan, PlanError
from autoshard.runtime import capture_meta
from autoshard.runtime.lower import LoweringError, lower
from autoshard.strategy import Strategy

from handler_utils import no_enumeration

MESH = (2, 2)
HW = "h100-nvlink"        # priced so that the solver and the baselines shard


class _Comm:
    """What lowering reads of a rank's collectives (it only generates code that calls them)."""

    def __init__(self, mesh_shape: Sequence[int]) -> None:
        self.mesh_shape = tuple(mesh_shape)

    def live_axes(self, axes: Sequence[int]) -> tuple[int, ...]:
        return tuple(sorted(a for a in axes if self.mesh_shape[a] > 1))


@pytest.fixture(scope="module")
def gpt2():
    model, args, kwargs = build_model("gpt2-tiny", batch=8)
    return capture_meta(model, args, kwargs, name="gpt2-tiny")


@pytest.fixture(scope="module")
def mlp():
    model, args, kwargs = build_model("mlp", batch=8, features=30)     # 30: a dim that 4 devices do not divide
    return capture_meta(model, args, kwargs, name="mlp")


def _saved_and_loaded(plan: Plan, tmp_path) -> Plan:
    return Plan.load(plan.save(tmp_path / "plan.json"))


@pytest.mark.parametrize("baseline", ["megatron", "zero3", None])
def test_each_entry_rebuilds_the_chosen_strategy_exactly(gpt2, tmp_path, baseline):
    """From the saved file alone: the specs, option tags (what kernels special-case: a k-sharded
    matmul's bias, a vocab-sharded embedding), split and collectives of every call node are those
    of the strategy the solver chose; costs as the plan counts them."""
    plan = _saved_and_loaded(autoshard.plan(gpt2, mesh=MESH, hardware=HW, baseline=baseline), tmp_path)
    table = enumerate_strategies(gpt2, mesh_shape=MESH, hardware=plan.hardware_profile())
    tags: set[str] = set()
    for name, entry in plan.nodes.items():
        if entry.kind != "call_function":
            continue
        chosen = table[name].by_name(entry.strategy)
        rebuilt = Strategy.from_plan(entry)
        assert rebuilt == dataclasses.replace(chosen, memory=rebuilt.memory), name
        assert rebuilt.tags == chosen.tags, name
        assert (rebuilt.memory.saved, rebuilt.memory.outputs) == (chosen.memory.saved, chosen.memory.outputs), name
        assert all(isinstance(c.phase, Phase) for c in rebuilt.comm)
        tags.update(rebuilt.tags)
    if baseline == "megatron":        # the tags kernels read are there
        assert {"k", "v"} <= tags, tags


def test_lowering_runs_from_the_plan_alone(gpt2, tmp_path, monkeypatch):
    """Lowering a sharded plan with every strategy generator made to raise: it lowers, each node
    with the plan's decision (row-parallel matmuls all-reduce their partial outputs, the
    vocab-sharded embedding gets its comm)."""
    plan = _saved_and_loaded(autoshard.plan(gpt2, mesh=MESH, hardware=HW, baseline="megatron"), tmp_path)
    no_enumeration(monkeypatch)
    program = lower(gpt2, plan, _Comm(MESH), torch.device("cpu"))
    code = program.module.code
    assert "reduce_partial" in code and "sync_grad" in code and "comm = " in code
    partial_outputs = [n for n, e in plan.nodes.items() if any(c.phase == "fwd" and c.operand == "out0"
                                                                for c in e.collectives)]
    assert partial_outputs and code.count("reduce_partial") >= len(partial_outputs)


# -- a decision that does not fit the graph ---------------------------------------------------------

def _linear(plan: Plan, graph) -> str:
    """The first call node with a 2-D parameter operand sharded on some axis (a linear layer)."""
    for name, entry in plan.nodes.items():
        if entry.kind == "call_function" and len(entry.operands) >= 2 and any(
                graph.is_param(graph.node(p)) and len(graph.tensor_meta(p).shape) == 2 for p in entry.operands) \
                and any(s != "RR" for s in entry.inputs):
            return name
    raise AssertionError("the plan shards no linear layer")


def _edit_inputs(entry, graph) -> None:
    entry.inputs = [s + "R" for s in entry.inputs]                 # one dim too many


def _edit_divides(entry, graph) -> None:
    shapes = [graph.tensor_meta(p).shape for p in entry.operands]
    j, k = next((j, k) for j, shape in enumerate(shapes) for k, d in enumerate(shape) if d % 4)
    entry.inputs[j] = "".join("S01" if i == k else "R" for i in range(len(shapes[j])))


def _edit_operands(entry, graph) -> None:
    entry.inputs, entry.operands = entry.inputs[:-1], entry.operands[:-1]


def _edit_tags(entry, graph) -> None:
    entry.tags = entry.tags[:1]


def _edit_phase(entry, graph) -> None:
    entry.collectives = [dataclasses.replace(c, phase="sideways") for c in entry.collectives] or entry.collectives
    assert entry.collectives, "the node has no collective"


EDITS = [
    (_edit_inputs, r"lays out operand \d as \w+, which does not fit its shape"),
    (_edit_divides, r"lays out operand \d as \w+, which does not fit its shape \[.*\] on the 2x2 mesh"),
    (_edit_operands, r"reads 2 operand\(s\) \[.*\], the node reads 3 \(\[.*\]\)"),
    (_edit_tags, r"has 1 per-axis option tag\(s\) for a mesh of 2 axes"),
    (_edit_phase, r"cannot be read \('sideways' is not a valid Phase\)"),
]


@pytest.mark.parametrize("edit, message", EDITS, ids=lambda x: getattr(x, "__name__", "")[6:])
def test_a_decision_that_does_not_fit_the_node_names_it_and_says_replan(mlp, edit, message):
    plan = autoshard.plan(mlp, mesh=MESH, hardware=HW, baseline="megatron")
    plan = copy.deepcopy(plan)
    name = _linear(plan, mlp)
    entry = plan.nodes[name]
    edit(entry, mlp)
    with pytest.raises(LoweringError, match=message) as info:
        lower(mlp, plan, _Comm(MESH), torch.device("cpu"))
    text = str(info.value)
    module = mlp.module_path(mlp.node(name))
    assert f"node '{name}' (aten." in text and f"module '{module}'" in text and "Re-plan" in text, text


def test_an_op_whose_handler_is_missing_at_runtime_is_named(mlp, monkeypatch):
    """A sharded node whose op has no handler in the running process cannot run its kernel."""
    plan = autoshard.plan(mlp, mesh=MESH, hardware=HW, baseline="megatron")
    name = _linear(plan, mlp)
    target = mlp.node(name).target
    monkeypatch.delitem(REGISTRY, target)
    with pytest.raises(LoweringError, match=rf"node '{name}' .*runs the handler of .*none is registered in this "
                                            rf"process.*Re-plan"):
        lower(mlp, plan, _Comm(MESH), torch.device("cpu"))


def test_a_plan_of_format_version_1_says_what_changed(mlp):
    data = autoshard.plan(mlp, mesh=MESH, hardware=HW, baseline="megatron").to_dict()
    data["format_version"] = 1
    with pytest.raises(PlanError, match=r"plan format version 1, which names each node's strategy but does not "
                                        r"record the decision itself.*Re-create the plan"):
        Plan.from_dict(data)


def test_a_call_node_without_its_option_tags_does_not_load(mlp):
    data = autoshard.plan(mlp, mesh=MESH, hardware=HW, baseline="megatron").to_dict()
    name = next(n for n, e in data["nodes"].items() if e["kind"] == "call_function")
    del data["nodes"][name]["tags"]
    with pytest.raises(PlanError, match=rf"node '{name}' records 0 per-axis option tag\(s\), the 2x2 mesh has 2 "
                                        rf"axes"):
        Plan.from_dict(data)
