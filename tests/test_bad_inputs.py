"""The bad-input battery: every kind of wrong input gets its own clear error, never a silent answer.

Each case feeds one bad input to one boundary (``autoshard.plan``'s arguments, specs, hardware
profiles, plan files, model factories, the command line, runtime inputs) and asserts the error type
and that the message says what to do (a regex over the message). Cases that need ranks are in
tests/distributed/test_bad_inputs_runtime.py. Every test runs under a timeout: no input may hang.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import pickle
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import yaml
from torch import nn

import autoshard
from autoshard import cli
from autoshard.api import ArgumentError, BudgetError
from autoshard.capture import CaptureError, capture_meta
from autoshard.hardware import HardwareError, HardwareProfile, LinkModel, load_hardware
from autoshard.mesh import MeshError, MeshSpec
from autoshard.models import ModelZooError, build_model
from autoshard.plans import Plan, PlanError, PlanMismatchError
from autoshard.runtime.inputs import InputBinder, InputError, check_constant, check_tensor
from autoshard.runtime.replicas import random_nodes
from autoshard.specs import ShardSpec, SpecError

pytestmark = pytest.mark.timeout(120)

HW = "cpu-gloo"


def _mlp() -> tuple[nn.Module, tuple]:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(8, 8, device="meta"),)


def _plan(**kw: Any) -> Plan:
    model, args = _mlp()
    options = dict(mesh=(2, 2), hardware=HW)
    options.update(kw)
    return autoshard.plan(model, args, **options)


def _plan_inputs(args: tuple) -> Callable[[], Any]:
    model, _ = _mlp()
    return lambda: autoshard.plan(model, args, mesh=(2, 2), hardware=HW)


# -- autoshard.plan arguments, specs -------------------------------------------------------------------

LIBRARY: list[tuple[str, Callable[[], Any], type, str]] = [
    ("mesh-float", lambda: _plan(mesh=(2.5, 2)), MeshError, r"int >= 1.*'2x4'"),
    ("mesh-bool-size", lambda: _plan(mesh=(True, 2)), MeshError, r"int >= 1, got True"),
    ("mesh-bool", lambda: _plan(mesh=True), MeshError, r"bool.*write it as"),
    ("mesh-zero", lambda: _plan(mesh=(0, 2)), MeshError, r">= 1, got 0"),
    ("mesh-negative-int", lambda: _plan(mesh=-4), MeshError, r"two positive ints|>= 1"),
    ("mesh-3d", lambda: _plan(mesh=(2, 2, 2)), MeshError, r"fold the axes into two"),
    ("mesh-bad-string", lambda: _plan(mesh="2x"), MeshError, r"'2x4'"),
    ("mesh-none", lambda: _plan(mesh=None), MeshError, r"write it as"),
    ("mesh-dict", lambda: _plan(mesh={"a": 2}), MeshError, r"not a mesh shape"),
    ("budget-inf", lambda: _plan(memory_budget=float("inf")), BudgetError, r"finite.*'40GiB'"),
    ("budget-nan", lambda: _plan(memory_budget=float("nan")), BudgetError, r"finite"),
    ("budget-over-device", lambda: _plan(hardware="h100-nvlink", memory_budget="200GiB"), BudgetError,
     r"exceeds the 80.00 GiB.*pass at most 80.00 GiB"),
    ("budget-negative", lambda: _plan(memory_budget=-5), BudgetError, r"negative"),
    ("budget-unit", lambda: _plan(memory_budget="40XB"), BudgetError, r"write e.g. '40GiB'"),
    ("budget-bool", lambda: _plan(memory_budget=True), BudgetError, r"byte count or a size"),
    ("budget-list", lambda: _plan(memory_budget=[1]), BudgetError, r"byte count or a size"),
    ("budget-huge-exponent", lambda: _plan(memory_budget="1e400GiB"), BudgetError, r"not finite"),
    ("hardware-int", lambda: _plan(hardware=123), HardwareError, r"profile name .*YAML profile"),
    ("hardware-unknown", lambda: _plan(hardware="tpu-v9"), HardwareError, r"known profiles: .*cpu-gloo"),
    ("hardware-missing-file", lambda: _plan(hardware="/nonexistent/x.yaml"), HardwareError, r"does not exist"),
    ("hardware-none", lambda: _plan(hardware=None), HardwareError, r"profile name"),
    ("optimizer-bytes-negative", lambda: _plan(optimizer_bytes_per_param=-8), ArgumentError, r"8 for AdamW"),
    ("optimizer-bytes-nan", lambda: _plan(optimizer_bytes_per_param=float("nan")), ArgumentError, r"finite"),
    ("time-limit-zero", lambda: _plan(time_limit=0), ArgumentError, r"seconds the ILP may run"),
    ("time-limit-inf", lambda: _plan(time_limit=float("inf")), ArgumentError, r"finite number > 0"),
    ("gap-above-one", lambda: _plan(gap_rel=1.5), ArgumentError, r"\[0, 1\)"),
    ("gap-negative", lambda: _plan(gap_rel=-0.1), ArgumentError, r">= 0"),
    ("dp-margin-one", lambda: _plan(prefer_data_parallel_within=1.0), ArgumentError, r"prefer_data_parallel_within"),
    ("dp-margin-text", lambda: _plan(prefer_data_parallel_within="5%"), ArgumentError, r"\[0, 1\)|>= 0"),
    ("solver-unknown", lambda: _plan(solver="gurobi"), ArgumentError, r"one of 'highs', 'cbc'"),
    ("fallback-unknown", lambda: _plan(fallback="skip"), ArgumentError, r"one of 'error', 'replicate'"),
    ("outputs-unknown", lambda: _plan(outputs="sharded"), ArgumentError, r"one of 'global', 'local'"),
    ("baseline-unknown", lambda: _plan(baseline="ddp"), ArgumentError, r"'data_parallel'"),
    ("flag-not-bool", lambda: _plan(merge_followers="yes"), ArgumentError, r"True or False"),
    ("name-empty", lambda: _plan(name=""), ArgumentError, r"non-empty string"),
    ("model-not-module", lambda: autoshard.plan("gpt2", (), mesh=(2, 2)), ArgumentError, r"nn.Module"),
    ("kwargs-not-mapping", lambda: autoshard.plan(_mlp()[0], _mlp()[1], "x", mesh=(2, 2), hardware=HW),
     ArgumentError, r"mapping of keyword"),
    ("input-batch-zero", _plan_inputs((torch.randn(0, 8, device="meta"),)), ArgumentError,
     r"zero-size dim.*shapes you train with"),
    ("input-none", _plan_inputs(()), ArgumentError, r"pass example inputs"),
    ("input-int64-to-float-linear", _plan_inputs((torch.zeros(8, 8, dtype=torch.int64, device="meta"),)),
     CaptureError, r"different dtypes.*x.float\(\)"),
    ("input-float64-to-float32-linear", _plan_inputs((torch.zeros(8, 8, dtype=torch.float64, device="meta"),)),
     CaptureError, r"float64.*float32"),
    ("batch-indivisible", _plan_inputs((torch.randn(6, 8, device="meta"),)), MeshError, r"multiple of 4"),
    ("spec-axis-2", lambda: ShardSpec.parse("S2R"), SpecError, r"axes 0 and 1 only.*S0, S1 or S01"),
    ("spec-partial-axis-5", lambda: ShardSpec.parse("RR+P5"), SpecError, r"axes 0 and 1 only.*\+P01"),
    ("spec-axis-twice", lambda: ShardSpec.parse("S0S0"), SpecError, r"used twice"),
    ("spec-descending", lambda: ShardSpec.parse("S10"), SpecError, r"ascending"),
    ("spec-garbage", lambda: ShardSpec.parse("X"), SpecError, r"expected tokens R, S0, S1, S01"),
    ("spec-constructed-axis", lambda: ShardSpec(((5,),)), SpecError, r"axes 0 and 1 only"),
    ("meshspec-direct-float", lambda: MeshSpec((2.0, 2)), MeshError, r"two positive ints"),
]


@pytest.mark.parametrize("case", LIBRARY, ids=[c[0] for c in LIBRARY])
def test_library_inputs(case) -> None:
    _, call, error, fix = case
    with pytest.raises(error, match=fix):
        call()


# -- hardware profiles ---------------------------------------------------------------------------------

def _profile(**edits: Any) -> dict:
    d = load_hardware("h100-nvlink").to_dict()
    for path, value in edits.items():
        *head, last = path.split("__")
        target = d
        for key in head:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if value is _DELETE:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return d


_DELETE = object()

PROFILES: list[tuple[str, dict | Any, str]] = [
    ("alpha-negative", _profile(axes__0__alpha=-1e-5), r"axes\[0\].alpha must be a finite non-negative.*seconds"),
    ("beta-zero", _profile(axes__1__beta=0), r"axes\[1\].beta must be a finite positive.*seconds per byte"),
    ("beta-inf", _profile(axes__0__beta=math.inf), r"seconds per byte"),
    ("flops-zero", _profile(peak_flops__float32=0), r"peak_flops.float32 .*FLOP/s"),
    ("flops-bool", _profile(peak_flops__float32=True), r"FLOP/s"),
    ("flops-empty", _profile(peak_flops={}), r"peak_flops must map dtype names to FLOP/s"),
    ("memory-bandwidth-negative", _profile(memory_bandwidth=-1.0), r"memory_bandwidth .*bytes/s"),
    ("memory-per-device-negative", _profile(memory_per_device="-8GiB"), r"memory_per_device .*size in bytes"),
    ("memory-per-device-zero", _profile(memory_per_device=0), r"positive size in bytes"),
    ("memory-per-device-words", _profile(memory_per_device="lots"), r"such as 80GiB"),
    ("host-bandwidth-nan", _profile(host_device_bandwidth=math.nan), r"host_device_bandwidth .*bytes/s"),
    ("one-axis", _profile(axes=[{"alpha": 1e-5, "beta": 1e-12}]), r"exactly 2 mesh axes"),
    ("axis-not-mapping", _profile(axes=["fast", {"alpha": 1e-5, "beta": 1e-12}]), r"axes\[0\] must have exactly"),
    ("axis-extra-key", _profile(axes=[{"alpha": 1e-5, "beta": 1e-12, "gamma": 1},
                                      {"alpha": 1e-5, "beta": 1e-12}]), r"alpha \(seconds\) and beta"),
    ("name-missing", _profile(name=_DELETE), r"lacks field 'name'.*h100-nvlink.yaml"),
    ("name-empty", _profile(name=""), r"non-empty string"),
    ("flag-string", _profile(device_memory_separate="false"), r"true or false"),
    ("overlap-above-one", _profile(overlap=1.5), r"overlap must be in \[0, 1\]"),
    ("compute-unknown-dtype", _profile(compute={"float99": {}}), r"not a torch dtype name"),
    ("compute-not-increasing", _profile(compute={"float32": {"matmul": {"work": [2.0, 1.0], "fwd": [1e-5, 2e-5],
                                                                        "bwd": [1e-5, 2e-5]}}}),
     r"strictly increasing"),
    ("not-a-mapping", [1, 2, 3], r"or a mapping, got \[1, 2, 3\] \(list\)"),
    ("extra-not-mapping", _profile(extra=[1]), r"extra must be a mapping"),
]


@pytest.mark.parametrize("case", PROFILES, ids=[c[0] for c in PROFILES])
def test_hardware_profiles(case) -> None:
    _, data, fix = case
    with pytest.raises(HardwareError, match=fix):
        load_hardware(data)


def test_hardware_profile_built_in_python_is_checked() -> None:
    with pytest.raises(HardwareError, match=r"axes\[0\].beta .*seconds per byte"):
        HardwareProfile(name="x", axes=(LinkModel(1e-5, -1e-9), LinkModel(1e-5, 1e-9)), peak_flops={"float32": 1e12},
                        memory_bandwidth=1e12, memory_per_device=2**30, host_device_bandwidth=1e10)


@pytest.mark.parametrize("text,fix", [("axes: [1, 2\nname: x", r"not readable YAML.*fix the file"),
                                      ("- 1\n- 2\n", r"holds list, not a mapping"),
                                      ("!!python/object/apply:os.system ['true']\n", r"not readable YAML")],
                         ids=["yaml-syntax", "yaml-list", "yaml-python-tag"])
def test_hardware_yaml_files(tmp_path, text, fix) -> None:
    path = tmp_path / "hw.yaml"
    path.write_text(text)
    with pytest.raises(HardwareError, match=fix):
        load_hardware(str(path))


# -- plan files ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _saved() -> dict:
    """A plan with reshardings (GPT-2 tiny, megatron on 2x2), as plain data."""
    model, args, kwargs = build_model("gpt2-tiny", batch=4)
    plan = autoshard.plan(model, args, kwargs, mesh=(2, 2), hardware=HW, baseline="megatron", other_mode=False)
    assert any(r.fwd for r in plan.reshards)
    return plan.to_dict()


def _edited(edit: Callable[[dict], None]) -> dict:
    d = copy.deepcopy(_saved())
    edit(d)
    return d


def _first_reshard(d: dict) -> dict:
    return next(r for r in d["reshards"] if r["fwd"])


def _move_axis(d: dict) -> None:
    step = _first_reshard(d)["fwd"][0]
    step["axis"] = 1 - step["axis"]


def _dst_spec(d: dict) -> None:
    r = _first_reshard(d)
    r["dst_spec"] = r["src_spec"] if r["dst_spec"] != r["src_spec"] else "R" * len(r["shape"])


def _consumer_input(d: dict) -> None:
    resharded = {(r["dst"], r["operand"]) for r in d["reshards"]}
    for node in d["nodes"].values():
        for j, producer in enumerate(node["operands"]):
            spec = node["inputs"][j]
            if (node["name"], j) not in resharded and node["kind"] == "call_function" and "S1" not in spec \
                    and spec.startswith("R"):
                node["inputs"][j] = "S1" + spec[1:]
                return
    raise AssertionError("no operand to edit")


def _unknown_operand(d: dict) -> None:
    node = next(n for n in d["nodes"].values() if n["operands"])
    node["operands"][0] = "nope"


def _move_kind(d: dict) -> None:
    _first_reshard(d)["fwd"][0]["kind"] = "teleport"


def _node_spec(d: dict) -> None:
    node = next(n for n in d["nodes"].values() if n["kind"] == "call_function")
    node["outputs"][0] = "S2" + node["outputs"][0][1:]


def _decision(d: dict) -> None:
    d["segments"] = {k: "nap" for k in d["segments"]} or {"transformer.h.0": "nap"}


PLAN_DATA: list[tuple[str, Any, str]] = [
    ("not-object", [1, 2], r"expected a JSON object"),
    ("no-version", {"nodes": {}}, r"no 'format_version'"),
    ("future-version", _edited(lambda d: d.update(format_version=99)), r"version 99.*Re-create the plan"),
    ("missing-field", _edited(lambda d: d.pop("nodes")), r"lacks field\(s\) 'nodes'"),
    ("wrong-type", _edited(lambda d: d.update(mesh_shape="2x2")), r"mesh_shape' should be a list"),
    ("mesh-zero", _edited(lambda d: d.update(mesh_shape=[2, 0])), r"two positive ints"),
    ("outputs-unknown", _edited(lambda d: d.update(outputs="sharded")), r"'outputs' must be one of"),
    ("hardware-negative-beta", _edited(lambda d: d["hardware"]["axes"][0].update(beta=-1.0)),
     r"hardware profile is malformed.*seconds per byte"),
    ("moves-other-axis", _edited(_move_axis), r"move 0 .*(not valid|gives|end).*Re-create the plan"),
    ("move-kind", _edited(_move_kind), r"'teleport', not one of"),
    ("reshard-dst-spec", _edited(_dst_spec), r"(ends at|to itself|moves end).*Re-create"),
    ("consumer-input-spec", _edited(_consumer_input), r"records no resharding between them"),
    ("unknown-operand", _edited(_unknown_operand), r"which the plan does not have"),
    ("node-spec-axis-2", _edited(_node_spec), r"malformed spec.*axes 0 and 1"),
    ("memory-decision", _edited(_decision), r"not one of keep"),
    ("budget-negative", _edited(lambda d: d.update(memory_budget=-1)), r"'memory_budget' must be positive"),
    ("other-mode-same-mode", _edited(lambda d: d.update(other_mode=copy.deepcopy(_saved()))),
     r"must be for the other mode"),
]


@pytest.mark.parametrize("case", PLAN_DATA, ids=[c[0] for c in PLAN_DATA])
def test_plan_data(case) -> None:
    _, data, fix = case
    with pytest.raises(PlanError, match=fix):
        Plan.from_dict(json.loads(json.dumps(data)))


def test_valid_plan_round_trips() -> None:
    """The battery's edits are the only thing wrong: the plan they start from loads."""
    Plan.from_dict(json.loads(json.dumps(_saved())))


PLAN_FILES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("dev-zero", lambda tmp: Path("/dev/zero"), r"not a regular file"),
    ("directory", lambda tmp: tmp, r"not a regular file"),
    ("missing", lambda tmp: tmp / "none.json", r"cannot read plan file"),
    ("pickle", lambda tmp: _write(tmp / "p.pkl", pickle.dumps(_saved())), r"pickle.*never unpickles"),
    ("binary", lambda tmp: _write(tmp / "p.bin", bytes(range(256)) * 4), r"binary, not a JSON plan"),
    ("truncated", lambda tmp: _write(tmp / "p.json", json.dumps(_saved()).encode()[:500]), r"corrupt or truncated"),
    ("nan", lambda tmp: _write(tmp / "p.json", json.dumps(_edited(lambda d: d["time"].update(total=math.nan)))
                                .encode()), r"NaN is not a number"),
    ("deep-nesting", lambda tmp: _write(tmp / "p.json", b"[" * 100000 + b"]" * 100000), r"not valid JSON"),
]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", PLAN_FILES, ids=[c[0] for c in PLAN_FILES])
def test_plan_files(tmp_path, case) -> None:
    _, make, fix = case
    with pytest.raises(PlanError, match=fix):
        Plan.load(make(tmp_path))


def test_plan_path_of_wrong_type() -> None:
    with pytest.raises(PlanError, match=r"str or a path"):
        Plan.load(123)  # type: ignore[arg-type]


def test_plan_shapes_must_be_the_graphs() -> None:
    model, args, kwargs = build_model("gpt2-tiny", batch=4)
    graph = capture_meta(model, args, kwargs, name="gpt2-tiny")
    data = _edited(lambda d: _first_reshard(d).update(dtype="float16"))
    plan = Plan.from_dict(data)
    with pytest.raises(PlanError, match=r"as a float16 tensor.*but the graph has (int64|float32).*Re-create"):
        plan.check(graph)


def test_plan_for_another_model() -> None:
    model, args = _mlp()
    graph = capture_meta(model, args)
    with pytest.raises(PlanMismatchError, match=r"Re-plan for this model"):
        Plan.from_dict(_saved()).check(graph)


# -- model factories -----------------------------------------------------------------------------------

FACTORIES: list[tuple[str, str, str]] = [
    ("syntax-error", "def make(:\n", r"syntax error at line 1.*fix the file"),
    ("import-error", "import no_such_module_here\n", r"failed to import: ModuleNotFoundError.*python "),
    ("no-factory", "def other():\n    pass\n", r"no callable 'make'; it defines other"),
    ("returns-module-only", "import torch\ndef make(**kw):\n    return torch.nn.Linear(2, 2)\n",
     r"must return \(model, args\)"),
    ("returns-non-module", "def make(**kw):\n    return (1, ())\n", r"where an nn.Module belongs"),
    ("factory-raises", "def make(**kw):\n    raise RuntimeError('boom')\n", r"raised RuntimeError: boom; fix the factory"),
    ("kwargs-not-dict", "import torch\ndef make(**kw):\n    return torch.nn.Linear(2, 2), (), [1]\n",
     r"return a dict of keyword inputs"),
]


@pytest.mark.parametrize("case", FACTORIES, ids=[c[0] for c in FACTORIES])
def test_model_factories(tmp_path, case) -> None:
    _, source, fix = case
    path = tmp_path / "factory.py"
    path.write_text(source)
    with pytest.raises(ModelZooError, match=fix):
        build_model(f"{path}:make")


@pytest.mark.parametrize("kw,fix", [({"num_layers": 0}, r"at least one layer"), ({"batch": 0}, r"int >= 1"),
                                    ({"seq": -1}, r"int >= 1")], ids=["layers-0", "batch-0", "seq-negative"])
def test_model_sizes(kw, fix) -> None:
    with pytest.raises(ModelZooError, match=fix):
        build_model("gpt2-tiny", **kw)


def test_unknown_preset() -> None:
    with pytest.raises(ModelZooError, match=r"presets: .*file.py:factory"):
        build_model("gpt5")


# -- command line --------------------------------------------------------------------------------------

def _bad_yaml(tmp: Path) -> str:
    (tmp / "hw.yaml").write_text("axes: [1, 2\n")
    return str(tmp / "hw.yaml")


def _pickled_plan(tmp: Path) -> str:
    (tmp / "p.json").write_bytes(pickle.dumps({"format_version": 1}))
    return str(tmp / "p.json")


def _bad_factory(tmp: Path) -> str:
    (tmp / "f.py").write_text("def make(:\n")
    return f"{tmp / 'f.py'}:make"


CLI: list[tuple[str, Callable[[Path], list[str]], str]] = [
    ("mesh-float", lambda t: ["plan", "mlp", "--mesh", "2.5x2"], r"mesh '2.5x2' must look like '8' or '2x4'"),
    ("mesh-zero", lambda t: ["plan", "mlp", "--mesh", "0x2"], r">= 1, got 0"),
    ("time-limit-zero", lambda t: ["plan", "mlp", "--mesh", "2x2", "--time-limit", "0"], r"--time-limit: must be"),
    ("time-limit-word", lambda t: ["plan", "mlp", "--mesh", "2x2", "--time-limit", "soon"], r"'soon' is not a number"),
    ("gap-two", lambda t: ["plan", "mlp", "--mesh", "2x2", "--gap", "2"], r"\[0, 1\)"),
    ("dp-margin-negative", lambda t: ["plan", "mlp", "--mesh", "2x2", "--prefer-data-parallel-within", "-0.1"],
     r"\[0, 1\)"),
    ("optimizer-bytes-negative", lambda t: ["plan", "mlp", "--mesh", "2x2", "--optimizer-bytes", "-8"], r">= 0"),
    ("layers-zero", lambda t: ["plan", "gpt2-tiny", "--mesh", "2x2", "--layers", "0"], r"integer >= 1"),
    ("batch-zero", lambda t: ["capture", "mlp", "--batch", "0"], r"integer >= 1"),
    ("budget-over-device", lambda t: ["plan", "mlp", "--mesh", "2x2", "--budget", "200GiB"],
     r"exceeds the 80.00 GiB"),
    ("budget-unit", lambda t: ["plan", "mlp", "--mesh", "2x2", "--budget", "40XB"], r"write e.g. '40GiB'"),
    ("hardware-bad-yaml", lambda t: ["plan", "mlp", "--mesh", "2x2", "--hardware", _bad_yaml(t)],
     r"not readable YAML"),
    ("hardware-unknown", lambda t: ["plan", "mlp", "--mesh", "2x2", "--hardware", "tpu"], r"known profiles"),
    ("out-missing-folder", lambda t: ["plan", "mlp", "--mesh", "2x2", "--out", str(t / "no" / "p.json")],
     r"does not exist; create it first"),
    ("out-is-directory", lambda t: ["plan", "mlp", "--mesh", "2x2", "--out", str(t)], r"is a directory"),
    ("json-missing-folder", lambda t: ["enumerate", "mlp", "--json", str(t / "no" / "s.json")], r"create it first"),
    ("factory-syntax", lambda t: ["capture", _bad_factory(t)], r"syntax error at line 1"),
    ("unknown-model", lambda t: ["capture", "gpt5"], r"presets:"),
    ("explain-pickle", lambda t: ["explain", _pickled_plan(t)], r"pickle.*never unpickles"),
    ("explain-dev-zero", lambda t: ["explain", "/dev/zero"], r"not a regular file"),
    ("explain-missing", lambda t: ["explain", str(t / "none.json")], r"cannot read plan file"),
    ("enumerate-unknown-node", lambda t: ["enumerate", "mlp", "--node", "nope"], r"not a node of the graph"),
    ("batch-indivisible", lambda t: ["plan", "mlp", "--mesh", "2x2", "--batch", "6"], r"multiple of 4"),
    ("unknown-flag", lambda t: ["plan", "mlp", "--mesh", "2x2", "--fast"], r"unrecognized arguments: --fast"),
]


@pytest.mark.parametrize("case", CLI, ids=[c[0] for c in CLI])
def test_cli_user_errors(tmp_path, capsys, case) -> None:
    """Exit status 2 and the error in one line on stderr (the last: progress lines of the stages that ran
    come before it), no traceback."""
    _, argv, fix = case
    assert cli.main(argv(tmp_path)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0] == lines[-1], captured.err
    assert re.search(fix, errors[0]), errors[0]
    assert errors[0].startswith("autoshard")
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize("argv", [["plan", "mlp", "--mesh", "2x2", "--budget", "200GiB"],
                                  ["plan", "mlp", "--mesh", "3x3x3"],
                                  ["plan", "mlp", "--mesh", "2x2", "--hardware", "tpu"],
                                  ["plan", "mlp", "--mesh", "2x2", "--out", "/no/such/folder/p.json"],
                                  ["plan", "mlp", "--mesh", "2x2", "--batch", "6"]],
                         ids=["budget", "mesh", "hardware", "out", "batch"])
def test_cli_checks_before_capture(monkeypatch, argv) -> None:
    def no_capture(args: Any) -> Any:
        raise AssertionError("captured before the arguments were checked")

    monkeypatch.setattr(cli, "_graph", no_capture)
    assert cli.main(argv) == 2


def test_cli_checks_a_factory_files_batch_before_capture(tmp_path, capsys) -> None:
    """A model file's batch is known once its factory has run: the check comes then, before the
    capture starts (no 'capturing' stage on stderr), with the planner's message."""
    path = tmp_path / "six.py"
    path.write_text("import torch\n\ndef factory():\n"
                    "    return torch.nn.Linear(8, 4), (torch.randn(6, 8),)\n")
    assert cli.main(["plan", f"{path}:factory", "--mesh", "2x2", "--hardware", HW]) == 2
    err = capsys.readouterr().err
    assert "multiple of 4" in err and "args[0]" in err and "capturing" not in err, err


def test_cli_stdout_is_only_the_plan(capfd) -> None:
    """The HiGHS banner (printed by native code) goes to stderr; stdout is the plain explanation."""
    assert cli.main(["plan", "mlp", "--mesh", "2x2", "--hardware", HW, "--plain"]) == 0
    out = capfd.readouterr().out
    assert "HiGHS" not in out and out.startswith("autoshard plan for mlp")


def test_explain_is_plain_unless_colour_is_asked() -> None:
    plan = _plan()
    assert "\x1b[" not in plan.explain() and "\x1b[" in plan.explain(color=True)


# -- runtime inputs (no ranks needed) ----------------------------------------------------------------

class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        y = self.lin(x) * scale
        return y if mask is None else y * mask


@functools.lru_cache(maxsize=None)
def _binder() -> InputBinder:
    import inspect

    graph = capture_meta(_Net(), (torch.randn(8, 8),))
    return InputBinder(inspect.signature(_Net().forward), graph.exported.call_spec.in_spec)


def test_keyword_call_binds_like_the_model() -> None:
    x = torch.randn(8, 8)
    assert _binder().flatten((), {"x": x})[0] is x
    assert _binder().flatten((x,), {})[0] is x


RUNTIME: list[tuple[str, Callable[[], Any], type, str]] = [
    ("kwarg-not-captured", lambda: _binder().flatten((torch.randn(8, 8),), {"mask": torch.ones(8, 4)}), InputError,
     r"mask were not passed when the plan was captured.*re-plan"),
    ("kwarg-unknown", lambda: _binder().flatten((), {"y": torch.randn(8, 8)}), InputError,
     r"does not accept this call"),
    ("arg-missing", lambda: _binder().flatten((), {}), InputError, r"does not accept this call|missing"),
    ("too-many-args", lambda: _binder().flatten((torch.randn(8, 8),) * 4, {}), InputError, r"does not accept"),
    ("nested-structure", lambda: _binder().flatten(([torch.randn(8, 8)],), {}), InputError,
     r"structured differently"),
    ("dtype", lambda: check_tensor(torch.zeros(8, 8, dtype=torch.int64), "args[0]", _meta(), (8, 8), "global"),
     InputError, r"dtype int64, the plan was made for float32: pass it as float32"),
    ("shape", lambda: check_tensor(torch.zeros(6, 8), "args[0]", _meta(), (8, 8), "global"), InputError,
     r"shape \(6, 8\), expected \(8, 8\).*re-plan"),
    ("meta-device", lambda: check_tensor(torch.zeros(8, 8, device="meta"), "args[0]", _meta(), (8, 8), "global"),
     InputError, r"meta tensor.*real tensor"),
    ("not-a-tensor", lambda: check_tensor([1.0], "args[0]", _meta(), (8, 8), "global"), InputError,
     r"must be a tensor"),
    ("constant-changed", lambda: check_constant(2.0, "kwargs['scale']", 1.0), InputError,
     r"specialised to that value; pass 1.0"),
]


def _meta():
    from autoshard.capture import TensorMeta

    return TensorMeta((8, 8), torch.float32, False)


@pytest.mark.parametrize("case", RUNTIME, ids=[c[0] for c in RUNTIME])
def test_runtime_inputs(case) -> None:
    _, call, error, fix = case
    with pytest.raises(error, match=fix):
        call()


def test_input_error_is_both_type_and_value_error() -> None:
    assert issubclass(InputError, TypeError) and issubclass(InputError, ValueError)


def test_random_ops_are_found() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3))
    graph = capture_meta(model, (torch.randn(8, 8),))
    assert random_nodes(graph.graph.nodes) == ["dropout"]
    assert random_nodes(capture_meta(model.eval(), (torch.randn(8, 8),)).graph.nodes) == []


def test_eval_mode_is_planned_with_the_training_layouts() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))
    assert autoshard.plan(model, (torch.randn(8, 8, device="meta"),), mesh=(2, 2), hardware=HW).other_mode is None
    plan = autoshard.plan(model, (torch.randn(8, 8, device="meta"),), mesh=(2, 2), hardware=HW, other_mode=True)
    assert plan.training and plan.other_mode is not None and not plan.other_mode.training
    main = {n.fqn: n.outputs for n in plan.nodes.values() if n.kind == "placeholder"}
    other = {n.fqn: n.outputs for n in plan.other_mode.nodes.values() if n.kind == "placeholder"}
    assert other == main
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).other_mode.to_dict() == plan.other_mode.to_dict()
    assert "eval mode planned too" in plan.explain()


@pytest.mark.parametrize("kw,fix", [({"timeout": -1}, r"timeout must be positive"),
                                    ({"timeout": "soon"}, r"finite number of seconds"),
                                    ({"backend": "mpi2"}, r"'nccl', 'gloo' or None"),
                                    ({"shape": (2.5, 2)}, r"int >= 1")],
                         ids=["timeout-negative", "timeout-string", "backend", "mesh"])
def test_init_mesh_arguments(kw, fix) -> None:
    """Checked before any process group is created (no ranks needed)."""
    options = {"shape": (2, 2), **kw}
    with pytest.raises(MeshError, match=fix):
        autoshard.init_mesh(options.pop("shape"), **options)


@pytest.mark.parametrize("where,fix", [("missing-folder", r"folder .* does not exist; create it"),
                                       ("directory", r"it is a directory; name a file")])
def test_plan_save_targets(tmp_path, where, fix) -> None:
    target = tmp_path / "no" / "plan.json" if where == "missing-folder" else tmp_path
    with pytest.raises(PlanError, match=fix):
        _plan().save(target)


SIGNATURES: list[tuple[str, Callable[[dict], None], str]] = [
    ("inputs-dtype", lambda d: d["inputs"]["leaves"][0].update(dtype="float99"), r"'float99', not a torch dtype"),
    ("inputs-shape", lambda d: d["inputs"]["leaves"][0].update(shape=[-4, 16]), r"list of ints >= 0"),
    ("inputs-spec", lambda d: d["inputs"].update(in_spec="garbage"), r"not a pytree spec"),
    ("inputs-leaf-count", lambda d: d["inputs"]["leaves"].append({"value": 1}),
     r"has \d+ leaves but 'inputs.leaves' lists \d+"),
]


@pytest.mark.parametrize("case", SIGNATURES, ids=[c[0] for c in SIGNATURES])
def test_plan_input_signature(case) -> None:
    """The recorded example inputs parallelize rebuilds the graph from are checked on load."""
    _, edit, fix = case
    with pytest.raises(PlanError, match=fix):
        Plan.from_dict(json.loads(json.dumps(_edited(edit))))


def test_spec_of_wrong_type() -> None:
    with pytest.raises(SpecError, match=r"a spec is a string such as 'S0R'"):
        ShardSpec.parse(3)  # type: ignore[arg-type]
