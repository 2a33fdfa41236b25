"""Hardware profiles in configs/hardware (measured compute curves, optimizer and overlap included),
the fits of `autoshard profile`, and the cost model's compute time from a profile."""
import dataclasses
import json
import math
import operator

import pytest
import yaml
import torch

from autoshard.capture import capture
from autoshard.enumerate import node_strategies
from autoshard.handlers import handler_for
from autoshard.hardware import (COMPUTE_FAMILIES, CONFIG_DIR, ELEMENTWISE_FUNCTIONS, FEW_ROWS, ComputeCurve, HardwareError,
                                HardwareProfile, OptimizerModel, load_hardware)
from autoshard.mesh import MeshSpec
from autoshard.phases import Phase
from autoshard.profile import COMPUTE_OPS, ProfileError, fit_alpha_beta, fit_optimizer, op_work, overlap_fraction
from autoshard.profile.fitting import fit_checkpoint

PROFILES = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def test_expected_profiles_exist():
    assert {"a100-nvlink", "h100-nvlink", "h100-multinode", "cpu-gloo"} <= set(PROFILES)


@pytest.mark.parametrize("name", PROFILES)
def test_profile_loads_and_is_sane(name):
    hw = load_hardware(name)
    assert hw.name == name
    assert hw.description.strip()
    assert all(link.alpha >= 0 and link.beta > 0 for link in hw.axes)
    assert hw.flops_for("float32") > 0 and hw.memory_bandwidth > 0 and hw.host_device_bandwidth > 0
    assert hw.memory_per_device > 2**30
    assert load_hardware(CONFIG_DIR / f"{name}.yaml") == hw
    assert HardwareProfile.from_dict(hw.to_dict()) == hw


def test_multinode_outer_axis_is_slower():
    hw = load_hardware("h100-multinode")
    assert hw.axes[0].beta > hw.axes[1].beta and hw.axes[0].alpha > hw.axes[1].alpha


def test_unknown_name_lists_known_profiles():
    with pytest.raises(HardwareError, match=r"unknown hardware profile 'tpu-v9'.*h100-nvlink"):
        load_hardware("tpu-v9")


def test_missing_field_is_named():
    d = load_hardware("h100-nvlink").to_dict()
    del d["memory_bandwidth"]
    with pytest.raises(HardwareError, match="memory_bandwidth"):
        HardwareProfile.from_dict(d)


# -- fitting measured all-reduce times ----------------------------------------------------------------
SIZES = [4096 * 4**k for k in range(7)]


def ring_all_reduce(nbytes, n, alpha, beta):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_exact_alpha_beta(n):
    times = [ring_all_reduce(b, n, 3e-5, 2e-10) for b in SIZES]
    link = fit_alpha_beta(SIZES, times, n)
    assert link.alpha == pytest.approx(3e-5, rel=1e-9)
    assert link.beta == pytest.approx(2e-10, rel=1e-9)


def test_fit_tolerates_noise_and_clamps_negative_latency():
    noisy = [ring_all_reduce(b, 2, 1e-4, 1e-9) * (1.1 if i % 2 else 0.9) for i, b in enumerate(SIZES)]
    link = fit_alpha_beta(SIZES, noisy, 2)
    assert link.alpha == pytest.approx(1e-4, rel=0.2) and link.beta == pytest.approx(1e-9, rel=0.2)
    # pure bandwidth with a tiny dip at small sizes would fit a negative intercept: clamp to 0
    dipped = [ring_all_reduce(b, 2, 0.0, 1e-9) - (1e-7 if b < 10**5 else 0) for b in SIZES]
    link = fit_alpha_beta(SIZES, dipped, 2)
    assert link.alpha == 0.0 and link.beta == pytest.approx(1e-9, rel=0.05)


def test_fit_rejects_unusable_data():
    with pytest.raises(ProfileError, match="two or more distinct"):
        fit_alpha_beta([4096, 4096], [1e-3, 1e-3], 2)
    with pytest.raises(ProfileError, match="does not grow"):
        fit_alpha_beta(SIZES, [1e-3 - 1e-12 * b for b in SIZES], 2)
    with pytest.raises(ProfileError, match="no communication"):
        fit_alpha_beta(SIZES, [1e-3] * len(SIZES), 1)


def test_device_memory_separate_only_on_gpu_profiles():
    assert not load_hardware("cpu-gloo").device_memory_separate
    for name in ("a100-nvlink", "h100-nvlink", "h100-multinode"):
        assert load_hardware(name).device_memory_separate


def test_device_memory_separate_defaults_true_and_must_be_a_bool():
    d = load_hardware("cpu-gloo").to_dict()
    assert d["device_memory_separate"] is False
    del d["device_memory_separate"]               # profiles (and plans) written before the field
    assert HardwareProfile.from_dict(d).device_memory_separate is True
    d["device_memory_separate"] = "false"
    with pytest.raises(HardwareError, match="device_memory_separate must be true or false"):
        HardwareProfile.from_dict(d)


# -- measured compute curves, optimizer and overlap --------------------------------------------------
WORK = [1e5, 1e7, 1e9]
FWD = [2e-5, 1e-4, 4e-2]
BWD = [5e-5, 3e-4, 9e-2]


def measured(**fields) -> HardwareProfile:
    """h100-nvlink's links and roofline, with a measured matmul curve and whatever ``fields`` say."""
    d = load_hardware("h100-nvlink").to_dict()
    d.update(name="measured-test", compute={"float32": {"matmul": {"work": WORK, "fwd": FWD, "bwd": BWD}}},
             optimizer={"per_tensor": 3e-5, "per_byte": 2e-10}, overlap=0.4)
    d.update(fields)
    return HardwareProfile.from_dict(d)


def test_op_seconds_is_exact_at_the_measured_points():
    hw = measured()
    for w, f, b in zip(WORK, FWD, BWD):
        assert hw.op_seconds("matmul", w, "fwd", "float32") == pytest.approx(f, rel=1e-12)
        assert hw.op_seconds("matmul", w, "bwd", "float32") == pytest.approx(b, rel=1e-12)


def test_op_seconds_interpolates_in_log_log():
    hw = measured()
    # the geometric middle of two points has the geometric mean of their times
    assert hw.op_seconds("matmul", 1e6, "fwd", "float32") == pytest.approx(math.sqrt(2e-5 * 1e-4), rel=1e-12)
    assert hw.op_seconds("matmul", 1e8, "bwd", "float32") == pytest.approx(math.sqrt(3e-4 * 9e-2), rel=1e-12)
    # a quarter of the way in log(work) is a quarter of the way in log(time), not in time
    w = 10 ** 7.5
    expect = math.exp(math.log(1e-4) + 0.25 * math.log(4e-2 / 1e-4))
    assert hw.op_seconds("matmul", w, "fwd", "float32") == pytest.approx(expect, rel=1e-12)
    assert hw.op_seconds("matmul", w, "fwd", "float32") < 1e-4 + 0.25 * (4e-2 - 1e-4)


def test_op_seconds_floors_below_and_scales_linearly_above():
    hw = measured()
    for w in (0.0, 1.0, 5e4, 1e5):                     # a per-op floor: dispatch overhead
        assert hw.op_seconds("matmul", w, "fwd", "float32") == 2e-5
        assert hw.op_seconds("matmul", w, "bwd", "float32") == 5e-5
    for k in (1, 3, 1000):                              # the largest point's rate
        assert hw.op_seconds("matmul", k * 1e9, "fwd", "float32") == pytest.approx(k * 4e-2, rel=1e-12)
        assert hw.op_seconds("matmul", k * 1e9, "bwd", "float32") == pytest.approx(k * 9e-2, rel=1e-12)


def test_op_seconds_is_none_where_not_measured_and_rejects_bad_arguments():
    hw = measured()
    assert hw.op_seconds("matmul", 1e6, "fwd", "bfloat16") is None
    assert hw.op_seconds("norm", 1e6, "fwd", "float32") is None
    gpu = load_hardware("a100-nvlink")                  # a datasheet roofline, no measurements
    assert gpu.compute == {} and gpu.optimizer is None and gpu.overlap is None
    assert gpu.op_seconds("matmul", 1e9, "fwd", "bfloat16") is None
    assert gpu.optimizer_seconds(10, 1e6) is None
    with pytest.raises(ValueError, match="unknown compute family 'gemm'"):
        hw.op_seconds("gemm", 1e6, "fwd", "float32")
    with pytest.raises(ValueError, match="phase"):
        hw.op_seconds("matmul", 1e6, "backward", "float32")
    with pytest.raises(ValueError, match="non-negative"):
        hw.op_seconds("matmul", -1.0, "fwd", "float32")


def test_optimizer_seconds_and_overlap():
    hw = measured()
    assert hw.optimizer_seconds(100, 4e6) == pytest.approx(100 * 3e-5 + 4e6 * 2e-10)
    assert hw.optimizer_seconds(0, 0) == 0.0
    assert hw.overlap == 0.4


def test_measured_fields_round_trip_through_yaml_and_json(tmp_path):
    hw = measured(compute={"float32": {
        "matmul": {"work": WORK, "fwd": FWD, "bwd": BWD},
        "pointwise": {"work": [4096], "fwd": [5e-6], "bwd": [8e-6]}},        # one point is a valid curve
        "bfloat16": {"attention": {"work": [1e6, 2e6], "fwd": [1e-5, 1.5e-5], "bwd": [3e-5, 4e-5]}}},
        overlap=0.0)
    assert hw.compute["float32"]["pointwise"] == ComputeCurve((4096.0,), (5e-6,), (8e-6,))
    assert hw.optimizer == OptimizerModel(3e-5, 2e-10)
    path = tmp_path / "m.yaml"
    hw.save(path)
    assert load_hardware(path) == hw
    assert HardwareProfile.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw   # as a plan stores it
    assert hw.op_seconds("pointwise", 1e3, "fwd", "float32") == 5e-6
    assert hw.op_seconds("pointwise", 8192, "bwd", "float32") == pytest.approx(16e-6)
    # profiles without measurements write none of the fields (plans made before them stay equal)
    d = load_hardware("a100-nvlink").to_dict()
    assert not {"compute", "optimizer", "overlap"} & set(d)


def _curve(**changes):
    c = {"work": list(WORK), "fwd": list(FWD), "bwd": list(BWD)}
    c.update(changes)
    return {"float32": {"matmul": c}}


@pytest.mark.parametrize("fields, message", [
    ({"compute": _curve(fwd=[2e-5, -1e-4, 4e-2])},
     r"'measured-test': compute\.float32\.matmul\.fwd\[1\] must be a finite positive number \(seconds\), got -0\.0001"),
    ({"compute": _curve(bwd=[5e-5, float("nan"), 9e-2])}, r"compute\.float32\.matmul\.bwd\[1\] .*\(seconds\), got nan"),
    ({"compute": _curve(fwd=[2e-5, float("inf"), 4e-2])}, r"matmul\.fwd\[1\] must be a finite positive"),
    ({"compute": _curve(work=[0, 1e7, 1e9])}, r"matmul\.work\[0\] must be a finite positive number \(FLOPs\), got 0"),
    ({"compute": _curve(fwd=[2e-5, "fast", 4e-2])}, r"matmul\.fwd\[1\] .*got 'fast'"),
    ({"compute": _curve(fwd=[2e-5, True, 4e-2])}, r"matmul\.fwd\[1\] .*got True"),
    ({"compute": _curve(bwd=[5e-5, 3e-4])}, r"compute\.float32\.matmul: work, fwd and bwd must have the same number "
                                            r"of points, got 3, 3 and 2"),
    ({"compute": _curve(work=[1e5, 1e9, 1e7])}, r"matmul\.work must be strictly increasing \(FLOPs\)"),
    ({"compute": _curve(work=[1e5, 1e5, 1e9])}, r"matmul\.work must be strictly increasing"),
    ({"compute": _curve(work=[])}, r"matmul\.work must be a non-empty list of FLOPs"),
    ({"compute": {"float32": {"norm": {"work": [1e5, 1e3], "fwd": [1, 2], "bwd": [1, 2]}}}},
     r"compute\.float32\.norm\.work must be strictly increasing \(bytes\)"),
    ({"compute": {"float32": {"softmax": {"work": [1], "fwd": [1], "bwd": [1]}}}},
     r"compute\.float32\.softmax: unknown op family; known: matmul, matmul_unaligned, matmul_rows1, matmul_rows2, matmul_rows4, "
         r"matmul_rows8, conv, conv_unaligned, attention, attention_narrow, pointwise, "
     r"transcendental, exp, log, tanh, "
     r"sigmoid, silu, gelu, gelu_tanh, norm, batch_norm, sync_batch_norm, max_pool, avg_pool, loss"),
    ({"compute": {"flaot32": {}}}, r"compute\.flaot32 is not a torch dtype name"),
    ({"compute": {"float32": {"matmul": {"work": WORK, "fwd": FWD}}}},
     r"matmul must have exactly the keys work \(FLOPs\)"),
    ({"overlap": 1.5}, r"'measured-test': overlap must be in \[0, 1\] \(fraction of an all-reduce hidden"),
    ({"overlap": -0.1}, r"overlap must be in \[0, 1\]"),
    ({"optimizer": {"per_tensor": -1e-5, "per_byte": 1e-10}},
     r"optimizer\.per_tensor must be a finite non-negative number \(seconds per tensor\), got -1e-05"),
    ({"optimizer": {"per_tensor": 1e-5, "per_byte": float("inf")}},
     r"optimizer\.per_byte must be a finite non-negative number \(seconds per byte\)"),
    ({"optimizer": {"per_tensor": 0, "per_byte": 0}}, r"optimizer\.per_tensor and optimizer\.per_byte are both 0"),
    ({"optimizer": {"per_tensor": 1e-5}}, r"optimizer must have exactly the keys per_tensor"),
])
def test_malformed_measurements_are_named(fields, message):
    with pytest.raises(HardwareError, match=message):
        measured(**fields)


def test_zero_coefficient_and_zero_overlap_are_valid():
    hw = measured(optimizer={"per_tensor": 0.0, "per_byte": 1e-10}, overlap=0)
    assert hw.optimizer_seconds(5, 1e6) == pytest.approx(1e-4) and hw.overlap == 0.0


# -- fits of `autoshard profile` ----------------------------------------------------------------------
def test_fit_optimizer_recovers_exact_coefficients_and_keeps_them_non_negative():
    n = [1, 16, 128, 2, 8, 8]
    b = [4e3, 6.4e4, 5.1e5, 8.4e6, 3.4e7, 6.7e7]
    model = fit_optimizer(n, b, [k * 4e-5 + x * 3e-10 for k, x in zip(n, b)])
    assert model.per_tensor == pytest.approx(4e-5, rel=1e-9) and model.per_byte == pytest.approx(3e-10, rel=1e-9)
    # times that fall with bytes would fit a negative per_byte: it is held at 0 instead
    model = fit_optimizer([1, 2, 4], [1e8, 1e6, 1e4], [1e-4, 2e-4, 4e-4])
    assert model.per_byte == 0.0 and model.per_tensor == pytest.approx(1e-4, rel=1e-9)
    with pytest.raises(ProfileError, match="two or more positive"):
        fit_optimizer([1], [1e3], [1e-4])


def test_fit_checkpoint_recovers_per_region_and_per_saved_tensor():
    saved = [3.0, 12.0, 48.0]
    model = fit_checkpoint(saved, [2e-4 + k * 1.5e-5 for k in saved])
    assert model.per_region == pytest.approx(2e-4, rel=1e-9) and model.per_saved_tensor == pytest.approx(1.5e-5, rel=1e-9)
    # a chain whose overhead measured 0 (noise) weighs as the smallest positive one, not as zero
    model = fit_checkpoint(saved, [0.0, 4e-4, 1e-3])
    assert model.per_region >= 0 and model.per_saved_tensor > 0
    with pytest.raises(ProfileError, match="some positive"):
        fit_checkpoint(saved, [0.0, 0.0, 0.0])


def test_checkpoint_overhead_round_trips_and_is_zero_where_not_measured(tmp_path):
    unmeasured = load_hardware("a100-nvlink")       # peak numbers only
    assert unmeasured.checkpoint is None and unmeasured.checkpoint_seconds(30) == 0.0
    hw = load_hardware("cpu-gloo")
    assert hw.checkpoint is not None and hw.checkpoint_seconds(30) > hw.checkpoint_seconds(3) > 0.0
    d = hw.to_dict()
    d["checkpoint"] = {"per_region": 2e-4, "per_saved_tensor": 1.5e-5}
    path = tmp_path / "ck.yaml"
    path.write_text(yaml.safe_dump(d))
    loaded = load_hardware(str(path))
    assert loaded.checkpoint_seconds(30) == pytest.approx(2e-4 + 30 * 1.5e-5)
    assert load_hardware(str(path)).to_dict()["checkpoint"] == d["checkpoint"]
    d["checkpoint"] = {"per_region": 2e-4}
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(HardwareError, match="checkpoint must have exactly the keys"):
        load_hardware(str(path))


def test_overlap_fraction():
    assert overlap_fraction(1.0, 1.0, 1.0) == 1.0          # fully hidden
    assert overlap_fraction(1.0, 1.0, 2.0) == 0.0          # serialised
    assert overlap_fraction(1.0, 0.5, 1.25) == pytest.approx(0.5)
    assert overlap_fraction(1.0, 1.0, 2.5) == 0.0          # slower than serial: clamped
    assert overlap_fraction(1.0, 1.0, 0.5) == 1.0          # noise: clamped


# -- the cost model prices compute from the curves --------------------------------------------------
FEW_ROWS_FAMILIES = {f"matmul_rows{r}" for r in FEW_ROWS}
# added after the shipped H100 profiles were measured (the shipped cpu-gloo profile has them)
LATER_FAMILIES = {"conv_unaligned", *FEW_ROWS_FAMILIES, "copy_blocks", "attention_narrow", "view"}
RATE = {f: (1 + i) * 1e-12 for i, f in enumerate(COMPUTE_FAMILIES)}   # seconds per unit of work, forward
RATE["pointwise"] = 1e-15     # a memory pass far cheaper than any FLOPs curve: no matmul here is bound by it
BWD_RATE = {f: 3 * r for f, r in RATE.items()}


def linear_in_work(families=COMPUTE_FAMILIES) -> HardwareProfile:
    """A profile whose curves are exactly ``RATE[family] * work``, a rate of its own per family (so
    compute time reveals the curve used and the work it was looked up at)."""
    return measured(compute={"float32": {
        f: {"work": [1.0, 1e15], "fwd": [RATE[f], RATE[f] * 1e15], "bwd": [BWD_RATE[f], BWD_RATE[f] * 1e15]}
        for f in families}})


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _compute_node(fn, args):
    graph = capture(_Call(fn), tuple(args))
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"
             and handler_for(n.target) is not None and not handler_for(n.target).free]
    assert len(nodes) == 1, [str(n.target) for n in nodes]
    return graph, nodes[0]


@pytest.mark.parametrize("family", [f for f in COMPUTE_OPS if f not in ("sync_batch_norm", "copy_blocks", "view")])  # own tests
def test_profiled_work_is_the_work_the_cost_model_prices(family):
    """What `autoshard profile` times an op at is what the cost model looks the op up at: FLOPs as
    opinfo counts them, or the bytes of the captured node's operands and outputs. (The functions whose
    median is the ``transcendental`` curve have curves of their own: it prices them where a profile has
    none of those.)"""
    sizes, builders = COMPUTE_OPS[family]
    hw = linear_in_work([f for f in COMPUTE_FAMILIES if family != "transcendental" or f not in ELEMENTWISE_FUNCTIONS])
    for build in builders:
        op = build(sizes[1], torch.float32, torch.device("cpu"))
        graph, node = _compute_node(op.fn, (op.x, *op.params(0)))
        (strategy,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
        assert strategy.compute_fwd == pytest.approx(RATE[family] * op_work(family, op), rel=1e-9)
        assert strategy.compute_bwd == pytest.approx(BWD_RATE[family] * op_work(family, op), rel=1e-9)


def _free_nodes(fn, x):
    graph = capture(_Call(fn), (x,))
    return graph, [n for n in graph.graph.nodes if n.op == "call_function"]


def test_a_view_costs_its_measured_dispatch_on_cpu_ranks():
    """A view (free: it moves no data) costs the ``view`` curve's smallest point forward and backward
    on ranks whose ops run on the host, whatever its size; nothing on a GPU, in a profile that never
    timed views, or in backward where no gradient flows through it. A getitem dispatches no op."""
    fwd, bwd = 7e-6, 9e-6
    curves = {"view": {"work": [8e3, 8e6], "fwd": [fwd, 1.1 * fwd], "bwd": [bwd, 1.2 * bwd]}}
    cpu = measured(compute={"float32": curves}, device_memory_separate=False)
    assert cpu.view_seconds(Phase.FWD) == fwd and cpu.view_seconds(Phase.BWD) == bwd
    assert cpu.dispatch_seconds() == fwd                  # a split the runtime takes as a view: the same op

    def priced(hw, x):
        graph, (node,) = _free_nodes(lambda t: t.transpose(0, 1), x)
        (strategy,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
        return strategy.compute_fwd, strategy.compute_bwd

    big = torch.randn(512, 1024, requires_grad=True)
    assert priced(cpu, big) == (fwd, bwd)
    assert priced(cpu, torch.randn(4, 8, requires_grad=True)) == (fwd, bwd)
    assert priced(cpu, torch.randn(4, 8)) == (fwd, 0.0)                       # no gradient through it
    assert priced(dataclasses.replace(cpu, device_memory_separate=True), big) == (0.0, 0.0)   # a GPU queues ops
    assert priced(measured(device_memory_separate=False), big) == (0.0, 0.0)  # views never timed

    graph, nodes = _free_nodes(lambda t: t.chunk(2)[0], big)
    getitem = next(n for n in nodes if n.target is operator.getitem)
    (strategy,) = node_strategies(graph, getitem, MeshSpec((1, 1)), cpu).strategies
    assert (strategy.compute_fwd, strategy.compute_bwd) == (0.0, 0.0)


@pytest.mark.parametrize("head_dim", [8, 12, 16, 32, 64])
def test_attention_is_priced_never_below_its_scores_at_the_narrow_head_dim(head_dim):
    """An attention op of head dim ``e`` costs at least the ``attention_narrow`` curve at its FLOPs x
    NARROW_HEAD_DIM / e (the same batch, heads and positions at that head dim: the score matrix's work
    does not shrink with the head dim); a profile without that curve prices it by ``attention`` alone."""
    from autoshard.hardware import NARROW_HEAD_DIM
    from autoshard.profile.compute import _attention

    op = _attention((2, 4, 64, head_dim), torch.float32, torch.device("cpu"))
    graph, node = _compute_node(op.fn, (op.x, *op.params(0)))
    flops = op_work("attention", op)
    rates = {"attention": 1e-12, "attention_narrow": 4e-12}     # narrow 4x per FLOP: binds below head dim 64
    curves = {f: {"work": [1.0, 1e15], "fwd": [r, r * 1e15], "bwd": [3 * r, 3e15 * r]} for f, r in rates.items()}
    hw = measured(compute={"float32": curves})
    (strategy,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
    expected = max(rates["attention"] * flops, rates["attention_narrow"] * flops * NARROW_HEAD_DIM / head_dim)
    assert strategy.compute_fwd == pytest.approx(expected, rel=1e-9)
    assert strategy.compute_bwd == pytest.approx(3 * expected, rel=1e-9)
    assert (expected > rates["attention"] * flops) == (head_dim < 4 * NARROW_HEAD_DIM)

    without = measured(compute={"float32": {"attention": curves["attention"]}})
    (plain,) = node_strategies(graph, node, MeshSpec((1, 1)), without).strategies
    assert plain.compute_fwd == pytest.approx(rates["attention"] * flops, rel=1e-9)


def test_copies_go_by_their_runs_between_the_copy_blocks_and_contiguous_curves():
    """``copy_seconds`` looks the ``copy_blocks`` curve up at the work the profile times it at (the
    bytes it reads and writes) for runs of ``COPY_RUN`` elements or fewer, the pointwise one from
    ``CONTIGUOUS_RUN`` up (and without a run), geometrically in log(run) between; a profile without
    the curve prices every copy by the pointwise one."""
    from autoshard.hardware import CONTIGUOUS_RUN, COPY_RUN
    sizes, (build,) = COMPUTE_OPS["copy_blocks"]
    op = build(sizes[2], torch.float32, torch.device("cpu"))
    nbytes = op.x.numel() * op.x.element_size()
    assert op_work("copy_blocks", op) == 2 * nbytes
    hw = linear_in_work(["pointwise", "copy_blocks"])
    contiguous, blocks = RATE["pointwise"] * 2 * nbytes, RATE["copy_blocks"] * 2 * nbytes
    assert hw.copy_seconds(nbytes, "float32") == pytest.approx(contiguous)
    assert hw.copy_seconds(nbytes, "torch.float32", run=1) == pytest.approx(blocks)
    assert hw.copy_seconds(nbytes, "float32", run=COPY_RUN) == pytest.approx(blocks)
    assert hw.copy_seconds(nbytes, "float32", run=CONTIGUOUS_RUN) == pytest.approx(contiguous)
    middle = int(math.sqrt(COPY_RUN * CONTIGUOUS_RUN))
    assert hw.copy_seconds(nbytes, "float32", run=middle) == pytest.approx(math.sqrt(blocks * contiguous))
    assert linear_in_work(["pointwise"]).copy_seconds(nbytes, "float32", run=1) == pytest.approx(contiguous)
    # a blocks curve faster than the contiguous one (noise) never makes a copy cheaper than contiguous
    fast = linear_in_work(["pointwise"])
    fast.compute["float32"]["copy_blocks"] = dataclasses.replace(fast.compute["float32"]["pointwise"])
    assert fast.copy_seconds(nbytes, "float32", run=1) == pytest.approx(contiguous)


def test_sync_batch_norm_is_priced_by_the_curve_of_its_kernel_at_the_local_work():
    """The profile times the runtime's sync-BN kernel on one device; the cost model prices a training
    batch norm whose batch is split (the strategies that run that kernel) by that curve, at the
    local shard's bytes, which are what the profile timed; with the channels split, the op's own."""
    sizes, (build,) = COMPUTE_OPS["sync_batch_norm"]
    hw = linear_in_work()
    local = build(sizes[1], torch.float32, torch.device("cpu"))
    x = torch.cat([local.x.detach()] * 2).requires_grad_()          # the batch of two devices' shards
    mean, var, w, b = local.params(0)
    graph, node = _compute_node(lambda x, m, v, w, b: torch.nn.functional.batch_norm(x, m, v, w, b, training=True),
                                (x, mean, var, w, b))
    strategies = node_strategies(graph, node, MeshSpec((2, 1)), hw).strategies
    synced = [s for s in strategies if s.input_specs[0].dims[0] == (0,)]
    by_channel = [s for s in strategies if s.input_specs[0].dims[1] == (0,)]
    assert synced and by_channel
    for s in synced:
        assert s.compute_fwd == pytest.approx(RATE["sync_batch_norm"] * op_work("sync_batch_norm", local), rel=1e-9)
        assert s.compute_bwd == pytest.approx(BWD_RATE["sync_batch_norm"] * op_work("sync_batch_norm", local), rel=1e-9)
    c = x.shape[1]
    half_channels = (2 * x.numel() + 4 * c) * 4 / 2      # x and the output, 4 per-channel tensors: halves
    for s in by_channel:
        assert s.compute_fwd == pytest.approx(RATE["batch_norm"] * half_channels, rel=1e-9)


def test_compute_uses_the_curve_of_the_family_and_the_local_work():
    x, w = torch.randn(64, 32, requires_grad=True), torch.randn(48, 32, requires_grad=True)
    graph, node = _compute_node(torch.nn.functional.linear, (x, w))
    flops = 2 * 64 * 32 * 48
    only_matmul = linear_in_work(families=["matmul"])
    for s in node_strategies(graph, node, MeshSpec((2, 2)), only_matmul):
        assert s.compute_fwd == pytest.approx(RATE["matmul"] * flops / s.split, rel=1e-9)
        assert s.compute_bwd == pytest.approx(BWD_RATE["matmul"] * flops / s.split, rel=1e-9)
    # a pointwise op on the same profile has no curve: the roofline, as on a GPU profile
    graph, node = _compute_node(torch.mul, (x, x + 1))
    (rep,) = [s for s in node_strategies(graph, node, MeshSpec((1, 1)), only_matmul)]
    assert rep.compute_fwd == pytest.approx(3 * 64 * 32 * 4 / only_matmul.memory_bandwidth, rel=1e-9)
    # ... and with a pointwise curve, its local bytes
    (rep,) = [s for s in node_strategies(graph, node, MeshSpec((1, 1)), linear_in_work())]
    assert rep.compute_fwd == pytest.approx(RATE["pointwise"] * 3 * 64 * 32 * 4, rel=1e-9)


def test_a_matmul_on_few_rows_is_priced_no_faster_than_a_memory_pass_over_its_operands():
    """A FLOPs curve is timed on square matmuls; a linear on a few rows moves its whole weight for
    few FLOPs. It costs at least one pointwise pass over its operands and output in forward, one per
    operand that needs a gradient in backward; a square one keeps its FLOPs price."""
    slow_memory = measured(compute={"float32": {
        "matmul": {"work": [1.0, 1e15], "fwd": [1e-12, 1e3], "bwd": [2e-12, 2e3]},
        "pointwise": {"work": [1.0, 1e15], "fwd": [1e-11, 1e4], "bwd": [1e-11, 1e4]}}})
    for rows, bound_by_memory in ((2, True), (512, False)):
        x, w = torch.randn(rows, 64, requires_grad=True), torch.randn(256, 64, requires_grad=True)
        graph, node = _compute_node(torch.nn.functional.linear, (x, w))
        (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), slow_memory).strategies
        flops, io = 2 * rows * 64 * 256, 4 * (rows * 64 + 256 * 64 + rows * 256)
        fwd, bwd = (1e-11 * io, 2 * 1e-11 * io) if bound_by_memory else (1e-12 * flops, 2e-12 * flops)
        assert (1e-11 * io > 1e-12 * flops) == bound_by_memory
        assert rep.compute_fwd == pytest.approx(fwd, rel=1e-9)
        assert rep.compute_bwd == pytest.approx(bwd, rel=1e-9)


@pytest.mark.parametrize("rows, curve", [(1, "matmul_rows1"), (3, "matmul_rows2"), (5, "matmul_rows4"),
                                          (15, "matmul_rows8"), (16, None)])
def test_a_matmul_on_few_rows_goes_by_the_curve_of_its_rows_by_bytes(rows, curve):
    """A linear on fewer rows than the matmul curve is timed on runs on kernels of its own, bound by
    its weight's bytes: the ``matmul_rows<r>`` curve of the largest measured row count not above its
    rows, at its local bytes, forward and backward; from 16 rows the matmul curve by FLOPs; on a
    profile measured before the few-row curves, the matmul curve."""
    x, w = torch.randn(rows, 64, requires_grad=True), torch.randn(256, 64, requires_grad=True)
    graph, node = _compute_node(torch.nn.functional.linear, (x, w))
    flops, io = 2 * rows * 64 * 256, 4 * (rows * 64 + 256 * 64 + rows * 256)
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), linear_in_work()).strategies
    work, family = (flops, "matmul") if curve is None else (io, curve)
    assert rep.compute_fwd == pytest.approx(RATE[family] * work, rel=1e-9)
    assert rep.compute_bwd == pytest.approx(BWD_RATE[family] * work, rel=1e-9)
    older = linear_in_work(families=[f for f in COMPUTE_FAMILIES if not f.startswith("matmul_rows")])
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), older).strategies
    assert rep.compute_fwd == pytest.approx(RATE["matmul"] * flops, rel=1e-9)


def test_a_matmul_s_rows_are_its_shard_s():
    """The rows are the local shard's: a linear on 8 rows has 8 replicated, 2 where the batch is
    split over 4 devices, 4 split over 2."""
    x, w = torch.randn(8, 64, requires_grad=True), torch.randn(256, 64, requires_grad=True)
    graph, node = _compute_node(torch.nn.functional.linear, (x, w))
    by_rows_split = {}
    for s in node_strategies(graph, node, MeshSpec((2, 2)), linear_in_work()):
        out = s.output_specs[0]
        if not s.input_specs[1].dims[0] and not out.dims[1] and s.input_specs[0].dims[1] == ():
            by_rows_split[out.shard_factor(0, (2, 2))] = s
    weight = 4 * 256 * 64
    for split, family in ((1, "matmul_rows8"), (2, "matmul_rows4"), (4, "matmul_rows2")):
        io = weight + 4 * (8 * 64 + 8 * 256) // split
        assert by_rows_split[split].compute_fwd == pytest.approx(RATE[family] * io, rel=1e-9)


def _priced_by_its_curve_else(fn, args, flops: float, curve: str, own: str, fallback: str) -> None:
    """``fn(*args)`` on one device is priced by ``curve``; on a profile without the ``own`` curve
    (measured before it existed), by ``fallback``."""
    graph, node = _compute_node(fn, args)
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), linear_in_work()).strategies
    assert rep.compute_fwd == pytest.approx(RATE[curve] * flops, rel=1e-9)
    older = linear_in_work(families=[f for f in COMPUTE_FAMILIES if f != own])
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), older).strategies
    assert rep.compute_fwd == pytest.approx(RATE[fallback] * flops, rel=1e-9)


@pytest.mark.parametrize("fn, shapes, curve", [
    (torch.nn.functional.linear, ((64, 32), (48, 32)), "matmul"),
    (torch.nn.functional.linear, ((64, 32), (50, 32)), "matmul_unaligned"),     # out rows of 200 bytes
    (torch.nn.functional.linear, ((64, 30), (48, 30)), "matmul_unaligned"),     # in rows of 120 bytes
    (torch.matmul, ((4, 64, 32), (4, 32, 48)), "matmul"),
    (torch.matmul, ((4, 64, 33), (4, 33, 48)), "matmul_unaligned"),
    (torch.mm, ((64, 32), (32, 47)), "matmul_unaligned"),
])
def test_matmuls_with_rows_of_no_whole_16_bytes_use_their_own_curve_then_the_matmul_one(fn, shapes, curve):
    """A GPU runs a matmul whose rows are no whole multiple of 16 bytes (GPT-2's 50257-word LM head) on
    slower kernels: its own curve where the profile has one, else the matmul curve."""
    args = [torch.randn(*s, requires_grad=True) for s in shapes]
    flops = 2 * math.prod(shapes[0]) * shapes[1][-2 if fn is torch.nn.functional.linear else -1]
    _priced_by_its_curve_else(fn, args, flops, curve, own="matmul_unaligned", fallback="matmul")


def test_a_matmul_is_unaligned_where_its_local_shard_is():
    """Alignment is the shard's: 24 out features (rows of 96 bytes) split over 2 devices leave rows
    of 48 bytes, over 4 devices rows of 24 bytes, which the GPU runs on its slower kernels."""
    args = [torch.randn(64, 32, requires_grad=True), torch.randn(24, 32, requires_grad=True)]
    graph, node = _compute_node(torch.nn.functional.linear, args)
    flops = 2 * 64 * 32 * 24
    by_out_split = {}      # devices the out features are split over -> the strategy splitting only them
    for s in node_strategies(graph, node, MeshSpec((2, 2)), linear_in_work()):
        out = s.output_specs[0]
        if s.input_specs[0].is_replicated() and not any(out.dims[:-1]):
            by_out_split[out.shard_factor(1, (2, 2))] = s
    assert by_out_split[1].compute_fwd == pytest.approx(RATE["matmul"] * flops, rel=1e-9)
    assert by_out_split[2].compute_fwd == pytest.approx(RATE["matmul"] * flops / 2, rel=1e-9)
    assert by_out_split[4].compute_fwd == pytest.approx(RATE["matmul_unaligned"] * flops / 4, rel=1e-9)


def _conv(x, w):
    return torch.nn.functional.conv2d(x, w, padding=1)


@pytest.mark.parametrize("c_in, c_out, curve", [
    (16, 32, "conv"), (3, 16, "conv_unaligned"), (16, 8, "conv_unaligned"), (24, 48, "conv_unaligned"),
])
def test_convs_with_channels_of_no_whole_16_use_their_own_curve_then_the_conv_one(c_in, c_out, curve):
    """oneDNN runs a convolution whose channels are no whole multiple of 16 (a first layer's 3 colours)
    outside its blocked layouts, slower per FLOP: its own curve where the profile has one, else the
    conv curve."""
    args = [torch.randn(2, c_in, 8, 8, requires_grad=True), torch.randn(c_out, c_in, 3, 3, requires_grad=True)]
    flops = 2 * 2 * c_out * 8 * 8 * c_in * 9
    _priced_by_its_curve_else(_conv, args, flops, curve, own="conv_unaligned", fallback="conv")


def test_a_conv_is_unaligned_where_its_local_shard_is():
    """Alignment is the shard's: 32 output channels split over 2 devices leave 16 (aligned), over 4
    devices 8, which oneDNN runs outside its blocked layouts."""
    args = [torch.randn(4, 32, 8, 8, requires_grad=True), torch.randn(32, 32, 3, 3, requires_grad=True)]
    graph, node = _compute_node(_conv, args)
    flops = 2 * 4 * 32 * 8 * 8 * 32 * 9
    by_out_split = {}      # devices the out channels are split over -> the strategy splitting only them
    for s in node_strategies(graph, node, MeshSpec((2, 2)), linear_in_work()):
        out = s.output_specs[0]
        if s.input_specs[0].is_replicated() and not out.partial and not out.dims[0] and not any(out.dims[2:]):
            by_out_split[out.shard_factor(1, (2, 2))] = s
    assert by_out_split[1].compute_fwd == pytest.approx(RATE["conv"] * flops, rel=1e-9)
    assert by_out_split[2].compute_fwd == pytest.approx(RATE["conv"] * flops / 2, rel=1e-9)
    assert by_out_split[4].compute_fwd == pytest.approx(RATE["conv_unaligned"] * flops / 4, rel=1e-9)


@pytest.mark.parametrize("fn, curve", [
    (torch.tanh, "tanh"), (torch.exp, "exp"), (torch.sigmoid, "sigmoid"), (torch.nn.functional.silu, "silu"),
    (torch.nn.functional.gelu, "gelu"), (lambda x: torch.nn.functional.gelu(x, approximate="tanh"), "gelu_tanh"),
    (torch.log, "log"), (torch.sin, "transcendental"), (torch.erf, "transcendental"),
])
def test_transcendental_ops_use_their_own_curve_then_the_median_then_the_pointwise_one(fn, curve):
    """tanh costs some 20 adds per byte on a CPU, SiLU 3: a function with a curve of its own is priced
    by it; a profile measured before those curves by the ``transcendental`` median (as are functions
    without one of their own); one measured before that curve as arithmetic (``pointwise``)."""
    x = torch.randn(64, 32, requires_grad=True)
    graph, node = _compute_node(fn, (x,))
    io = 2 * 64 * 32 * 4

    def priced(hw) -> float:
        (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
        return rep.compute_fwd

    assert priced(linear_in_work()) == pytest.approx(RATE[curve] * io, rel=1e-9)
    no_own = linear_in_work(families=[f for f in COMPUTE_FAMILIES if f not in ELEMENTWISE_FUNCTIONS])
    assert priced(no_own) == pytest.approx(RATE["transcendental"] * io, rel=1e-9)
    older = linear_in_work(families=[f for f in COMPUTE_FAMILIES if f not in (*ELEMENTWISE_FUNCTIONS, "transcendental")])
    assert priced(older) == pytest.approx(RATE["pointwise"] * io, rel=1e-9)


def test_piecewise_linear_activations_are_arithmetic():
    x = torch.randn(64, 32, requires_grad=True)
    graph, node = _compute_node(torch.relu, (x,))
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), linear_in_work()).strategies
    assert rep.compute_fwd == pytest.approx(RATE["pointwise"] * 2 * 64 * 32 * 4, rel=1e-9)


def _priced_rate(fn, args, hw) -> float:
    """Forward seconds per byte (tensor operands + outputs) of the one compute node of ``fn(*args)``."""
    graph, node = _compute_node(fn, args)
    vals = [a.meta["val"] for a in node.args if isinstance(a, torch.fx.Node)] + [node.meta["val"]]
    io = sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
    return rep.compute_fwd / io


@pytest.mark.parametrize("fn, stats, curve, older", [
    (lambda x: torch.nn.functional.max_pool2d(x, 2), False, "max_pool", "pointwise"),
    (lambda x: torch.nn.functional.max_pool2d(x, 3, 1, 1), False, "max_pool", "pointwise"),
    (lambda x: torch.nn.functional.avg_pool2d(x, 2), False, "avg_pool", "pointwise"),
    (lambda x: torch.nn.functional.adaptive_avg_pool2d(x, 1), False, "pointwise", "pointwise"),
    (lambda x, m, v: torch.nn.functional.batch_norm(x, m, v, training=True), True, "batch_norm", "norm"),
    (lambda x, m, v: torch.nn.functional.batch_norm(x, m, v, training=False), True, "pointwise", "pointwise"),
])
def test_pooling_and_batch_norm_use_their_own_curves_or_an_older_profiles(fn, stats, curve, older):
    """Windowed pools and training batch norm cost far more per byte than an add on a CPU: each has a
    curve of its own; global average pools and eval batch norm (a scale and shift) are arithmetic; a
    profile measured before those curves existed falls back to the pointwise or norm curve."""
    args = (torch.randn(2, 8, 16, 16, requires_grad=True),) + ((torch.zeros(8), torch.ones(8)) if stats else ())
    assert _priced_rate(fn, args, linear_in_work()) == pytest.approx(RATE[curve], rel=1e-9)
    before = linear_in_work(families=[f for f in COMPUTE_FAMILIES if f not in ("batch_norm", "max_pool", "avg_pool")])
    assert _priced_rate(fn, args, before) == pytest.approx(RATE[older], rel=1e-9)


def test_compute_falls_back_to_the_roofline_for_unmeasured_dtypes_and_skips_absent_backward():
    hw = linear_in_work()
    x, w = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    graph, node = _compute_node(torch.nn.functional.linear, (x, w))
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
    io = (64 * 32 + 48 * 32 + 64 * 48) * 2
    assert rep.compute_fwd == pytest.approx(max(2 * 64 * 32 * 48 / hw.flops_for("bfloat16"),
                                                io / hw.memory_bandwidth), rel=1e-9)
    # float32 operands that need no gradient: a measured forward, no backward
    graph, node = _compute_node(torch.nn.functional.linear, (x.float(), w.float()))
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
    assert rep.compute_fwd == pytest.approx(RATE["matmul"] * 2 * 64 * 32 * 48, rel=1e-9) and rep.compute_bwd == 0.0


def test_cpu_gloo_carries_measured_compute():
    """The shipped CPU profile is measured by `autoshard profile` with every curve it times (the
    shipped H100 profiles predate ``conv_unaligned``, the few-row matmul curves, ``copy_blocks`` and
    ``attention_narrow``; the last and ``view`` were added to it by scripts/add_compute_curve.py), the checkpoint
    machinery, small all-reduces and the collectives' waits."""
    hw = load_hardware("cpu-gloo")
    assert set(hw.compute) == {"float32"} and set(hw.compute["float32"]) == set(COMPUTE_FAMILIES)
    assert hw.checkpoint is not None and hw.small_all_reduce and hw.sync_wait
    points = {**{f: 4 for f in FEW_ROWS_FAMILIES}, "view": 2}          # a view's time does not grow with its size
    assert all(len(c.work) >= points.get(family, 5) for family, c in hw.compute["float32"].items())
    assert hw.optimizer is not None and hw.overlap is not None
    matmul = hw.compute["float32"]["matmul"]
    assert matmul.work[0] <= 2e5 and matmul.work[-1] >= 5e9      # spans ~1e5 .. ~1e10 FLOPs


@pytest.mark.parametrize("name", ["h100-nvlink", "h100-multinode"])
def test_h100_profiles_carry_compute_measured_on_one_h100(name):
    """The H100 profiles keep their datasheet links and carry every compute curve, float32 and
    bfloat16, measured by `autoshard profile --mesh 1x1` on one H100 (bench/gpu_op_compute.py), but
    ``conv_unaligned``, the few-row matmul curves, ``copy_blocks``, ``attention_narrow`` and ``view``, added
    after that measurement (their unaligned convolutions go by ``conv``, their linears on few rows by
    ``matmul``, their copies by ``pointwise``, their narrow heads by ``attention``; views cost a GPU's
    host nothing the cost model counts), and ``sync_batch_norm``,
    measured later the same way on one H200."""
    hw = load_hardware(name)
    assert set(hw.compute) == {"float32", "bfloat16"}
    assert all(set(hw.compute[dt]) == set(COMPUTE_FAMILIES) - LATER_FAMILIES for dt in hw.compute)
    assert hw.optimizer is not None and hw.overlap is None            # one GPU: no overlap to measure
    assert "H100" in hw.description and hw.extra["measured"]["backend"] == "nccl"
    bf16, fp32 = hw.compute["bfloat16"]["matmul"], hw.compute["float32"]["matmul"]
    assert bf16.work[-1] >= 1e12 and bf16.work[-1] / bf16.fwd[-1] > 5 * fp32.work[-1] / fp32.fwd[-1]


def test_a_measured_world_link_prices_collectives_over_both_axes():
    """The runtime runs a collective over both mesh axes on one group of all devices: a profile
    that measured that group prices it as one ring over it; without one, the best of the
    hierarchical and flat algorithms over the two axis links."""
    import dataclasses

    from autoshard.comm_cost import collective_cost
    from autoshard.hardware import HardwareProfile, LinkModel, load_hardware

    hw = load_hardware("h100-nvlink")
    world = LinkModel(alpha=1e-3, beta=1e-9)
    measured = dataclasses.replace(hw, world=world)
    n, nbytes = 4, 2**20
    expected = 2 * ((n - 1) * world.alpha + (n - 1) / n * nbytes * world.beta)
    assert collective_cost("all_reduce", nbytes, (0, 1), (2, 2), measured) == pytest.approx(expected)
    assert collective_cost("all_reduce", nbytes, (0, 1), (2, 2), hw) < expected
    assert collective_cost("all_reduce", nbytes, (1,), (2, 2), measured) == \
        collective_cost("all_reduce", nbytes, (1,), (2, 2), hw)
    again = HardwareProfile.from_dict(measured.to_dict())
    assert again.world == world
    bad = {**measured.to_dict(), "world": {"alpha": 1e-3, "beta": -1.0}}
    with pytest.raises(HardwareError, match="world.beta"):
        HardwareProfile.from_dict(bad)


def test_measured_links_of_other_collective_kinds_price_those_kinds():
    """`kinds` gives all-gather / reduce-scatter their own measured links (gloo's reduce-scatter
    costs about an all-reduce at any size); kinds and groups without one use the all-reduce's."""
    import dataclasses

    from autoshard.comm_cost import collective_cost
    from autoshard.hardware import HardwareProfile, LinkModel, load_hardware

    hw = dataclasses.replace(load_hardware("cpu-gloo"), kinds={})       # all-reduce links only
    slow = LinkModel(alpha=5e-3, beta=1e-9)
    measured = dataclasses.replace(hw, kinds={"reduce_scatter": {"world": slow, "axis1": slow}})
    n, nbytes = 4, 2**20
    assert collective_cost("reduce_scatter", nbytes, (0, 1), (2, 2), measured) == pytest.approx(
        (n - 1) * slow.alpha + (n - 1) / n * nbytes * slow.beta)
    assert collective_cost("reduce_scatter", nbytes, (1,), (2, 2), measured) == pytest.approx(
        slow.alpha + nbytes / 2 * slow.beta)
    for kind, axes in (("reduce_scatter", (0,)), ("all_gather", (0, 1)), ("all_reduce", (0, 1))):
        assert collective_cost(kind, nbytes, axes, (2, 2), measured) == collective_cost(kind, nbytes, axes, (2, 2), hw)
    assert HardwareProfile.from_dict(measured.to_dict()) == measured
    for kinds, message in (({"all_reduce": {"world": {"alpha": 0, "beta": 1e-9}}}, "kinds.all_reduce"),
                           ({"all_gather": {"axis7": {"alpha": 0, "beta": 1e-9}}}, "kinds.all_gather"),
                           ({"all_gather": {"world": {"alpha": 0, "beta": 0}}}, "kinds.all_gather.world.beta")):
        with pytest.raises(HardwareError, match=message):
            HardwareProfile.from_dict({**hw.to_dict(), "kinds": kinds})


def test_measured_small_all_reduces_price_the_sizes_below_the_fit():
    """`small_all_reduce` (gloo's ring all-reduce over 4 ranks takes ~1.6 ms for a loss's float64 sum
    and count and ~5.5 ms from 64 bytes up, which the alpha-beta fit says of 16 bytes too) prices all-reduces up to its largest
    size on its group, interpolated between sizes; larger ones, other kinds and groups without a
    table go by the links, and so does the solver's linear price per gradient bucket."""
    import dataclasses

    from autoshard.comm_cost import collective_cost
    from autoshard.hardware import SmallMessages
    from autoshard.solver.steptime import SyncPricing

    hw = dataclasses.replace(load_hardware("cpu-gloo"), small_all_reduce={})
    world = SmallMessages((4.0, 16.0, 64.0), (3.0e-3, 3.4e-3, 5.4e-3))
    measured = dataclasses.replace(hw, small_all_reduce={"world": world})
    both = (0, 1)
    assert collective_cost("all_reduce", 16, both, (2, 2), measured) == pytest.approx(3.4e-3)
    assert collective_cost("all_reduce", 2, both, (2, 2), measured) == pytest.approx(3.0e-3)
    assert collective_cost("all_reduce", 40, both, (2, 2), measured) == pytest.approx(4.4e-3)
    assert collective_cost("all_reduce", 16, both, (2, 2), hw) > 5e-3                  # the fit's price
    for kind, nbytes, axes in (("all_reduce", 65, both), ("all_reduce", 16, (0,)), ("all_gather", 16, both)):
        assert collective_cost(kind, nbytes, axes, (2, 2), measured) == collective_cost(kind, nbytes, axes, (2, 2), hw)
    assert collective_cost("all_reduce", 16, both, (2, 2), measured, measured_small=False) == \
        collective_cost("all_reduce", 16, both, (2, 2), hw)
    assert SyncPricing.of(both, (2, 2), measured) == SyncPricing.of(both, (2, 2), hw)
    assert HardwareProfile.from_dict(measured.to_dict()) == measured
    for table, message in (({"axis7": {"bytes": [4], "seconds": [1e-3]}}, "small_all_reduce must map"),
                           ({"world": {"bytes": [16, 4], "seconds": [1e-3, 1e-3]}}, "must increase"),
                           ({"world": {"bytes": [4, 16], "seconds": [1e-3]}}, "equally long"),
                           ({"world": {"bytes": [4], "seconds": [-1.0]}}, r"small_all_reduce.world.seconds\[0\]")):
        with pytest.raises(HardwareError, match=message):
            HardwareProfile.from_dict({**hw.to_dict(), "small_all_reduce": table})


def test_a_profile_without_a_conv_curve_prices_convolutions_on_its_matmul_curve():
    """Profiles measured before `autoshard profile` timed convolutions still price them from measurements."""
    sizes, (build,) = COMPUTE_OPS["conv"]
    op = build(sizes[1], torch.float32, torch.device("cpu"))
    graph, node = _compute_node(op.fn, (op.x, *op.params(0)))
    hw = linear_in_work([f for f in COMPUTE_FAMILIES if f != "conv"])
    (strategy,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
    assert strategy.compute_fwd == pytest.approx(RATE["matmul"] * op_work("conv", op), rel=1e-9)


def _view_node(fn, args, target):
    graph = capture(_Call(fn), tuple(args))
    (node,) = [n for n in graph.graph.nodes if n.target == target]
    return graph, node


@pytest.mark.parametrize("fn, target, io", [
    (lambda x: x.split(16, dim=1)[0] * 2, torch.ops.aten.split.Tensor, (64 * 32 + 64 * 32) * 4),
    (lambda x: x[:, 8:24] * 2, torch.ops.aten.slice.Tensor, (64 * 32 + 64 * 16) * 4),
    (lambda x: x.unsqueeze(0).expand(3, 64, 32) * 2, torch.ops.aten.expand.default, (64 * 32 + 3 * 64 * 32) * 4),
])
def test_views_whose_gradient_autograd_builds_whole_pay_one_memory_pass_in_backward(fn, target, io):
    """A view's forward is free; where its backward writes a whole gradient of its input (split's
    cat, slice's zeros and copy, expand's sum), that pass is priced as a pointwise op over the view's
    input and output bytes. A plain reshape stays free both ways."""
    hw = linear_in_work()
    x = torch.randn(64, 32, requires_grad=True)
    graph, node = _view_node(fn, (x,), target)
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
    assert rep.compute_fwd == 0.0
    assert rep.compute_bwd == pytest.approx(RATE["pointwise"] * io, rel=1e-9)
    # no gradient to build where the input needs none
    graph, node = _view_node(fn, (x.detach(),), target)
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
    assert rep.compute_bwd == 0.0
    graph, node = _view_node(lambda x: x.reshape(32, 64) * 2, (x,), torch.ops.aten.reshape.default)
    (rep,) = node_strategies(graph, node, MeshSpec((1, 1)), hw).strategies
    assert rep.compute_fwd == rep.compute_bwd == 0.0
