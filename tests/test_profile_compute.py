"""How `autoshard profile` times one op of a compute curve (no process group: the timer is replaced)."""
import math

import pytest
import torch

from autoshard.profile import compute


@pytest.fixture
def timed_outputs(monkeypatch):
    """Replaces the barrier-synchronised timer: each timed function runs once, 1 s, and what it
    returned is kept (forward runs return their outputs, backward runs their gradients)."""
    runs: list = []

    def fake_median_time(fn, *args, **kwargs):
        runs.append(fn())
        return 1.0

    monkeypatch.setattr(compute, "_median_time", fake_median_time)
    monkeypatch.setattr(compute, "_cold_bytes", lambda device: 10 * 2**20)
    monkeypatch.setattr(compute, "_one_call_seconds", lambda op, device: 1.0)     # the chain's length by work
    monkeypatch.setattr(compute, "_cold_chain_cap", lambda op, device: 10**9)     # no cap by time
    monkeypatch.setattr(compute, "_max_over_ranks", lambda values, device: values)  # one process
    return runs


def test_forward_and_backward_are_timed_over_held_outputs_that_outgrow_the_cache(timed_outputs):
    """A step's forward writes activations that live until backward to memory out of cache, and its
    backward reads them back from there: the chain holds every output, is long enough to write twice
    the last-level cache, and its backward runs over all of it."""
    op = compute._unary(torch.tanh)(65536, torch.float32, torch.device("cpu"))
    out_bytes = 3 * 65536 * 4
    work, fwd, bwd = compute._time_op("tanh", op, torch.device("cpu"), iters=3)
    forward_outputs, input_grads = timed_outputs
    k = math.ceil(10 * 2**20 / out_bytes)
    assert compute._chain_length("tanh", op, work, torch.device("cpu")) < k         # longer than the short chain
    assert len(forward_outputs) == k
    assert len({t.untyped_storage().data_ptr() for t in forward_outputs}) == k     # all held at once
    assert fwd == pytest.approx(1.0 / k)
    y = op.x.detach().requires_grad_()                                             # the backward ran through all k
    z = y
    for _ in range(k):
        z = torch.tanh(z)
    torch.testing.assert_close(input_grads[0], torch.autograd.grad(z, y, torch.ones_like(z))[0])
    assert bwd == pytest.approx(1.0 / k)


def test_forward_chain_length_is_capped_and_side_by_side_ops_count_their_inputs(timed_outputs, monkeypatch):
    tiny = compute._unary(torch.tanh)(128, torch.float32, torch.device("cpu"))
    _, fwd, _ = compute._time_op("tanh", tiny, torch.device("cpu"), iters=3)
    assert len(timed_outputs[0]) == compute._MAX_COLD_CHAIN and fwd == pytest.approx(1.0 / compute._MAX_COLD_CHAIN)
    timed_outputs.clear()
    # exp runs side by side, each instance on an input of its own: its input is fresh bytes too
    monkeypatch.setattr(compute, "_cold_bytes", lambda device: 64 * 2**20)
    apart = compute._unary_apart(torch.exp)(65536, torch.float32, torch.device("cpu"))
    work, fwd, _ = compute._time_op("exp", apart, torch.device("cpu"), iters=3)
    assert work == 2 * 3 * 65536 * 4
    assert fwd == pytest.approx(1.0 / math.ceil(64 * 2**20 / work))      # 43 instances (86 counting outputs only)
    assert all(torch.isfinite(t).all() for t in timed_outputs[0])


def test_last_level_cache_size_is_read_where_the_system_lists_it():
    llc = compute._last_level_cache_bytes(torch.device("cpu"))
    assert llc is None or llc >= 2**16
    assert compute._cold_bytes(torch.device("cpu")) == (2 * llc if llc else compute._COLD_BYTES_FALLBACK)


def test_chain_is_long_enough_in_time_where_work_alone_would_time_one_call(timed_outputs, monkeypatch):
    """A GPU runs a matmul of 2e8+ FLOPs in microseconds, while one autograd.grad call costs ~0.1 ms:
    the chain also lasts _CHAIN_S, so that the call's fixed cost is shared by many ops."""
    op = compute._linear((64, 512, 512), torch.float32, torch.device("cpu"))     # 3.4e7 FLOPs: 6 by work
    work = compute.op_work("matmul", op)
    by_work = math.ceil(compute._CHAIN_WORK["FLOPs"] / work)
    monkeypatch.setattr(compute, "_one_call_seconds", lambda op, device: compute._CHAIN_S / 20)
    assert compute._chain_length("matmul", op, work, torch.device("cpu")) == max(by_work, 20)
    monkeypatch.setattr(compute, "_one_call_seconds", lambda op, device: compute._CHAIN_S / 1000)
    assert compute._chain_length("matmul", op, work, torch.device("cpu")) == compute._MAX_CHAIN
    monkeypatch.setattr(compute, "_one_call_seconds", lambda op, device: 1.0)     # slow: work decides
    assert compute._chain_length("matmul", op, work, torch.device("cpu")) == by_work
    _, fwd, bwd = compute._time_op("matmul", op, torch.device("cpu"), iters=3)
    cold = math.ceil(10 * 2**20 / (64 * 512 * 4))                                  # outputs outgrow the cache first
    assert fwd == bwd == pytest.approx(1.0 / max(by_work, cold))


def test_one_call_is_timed_on_the_op_itself():
    op = compute._unary(torch.tanh)(1024, torch.float32, torch.device("cpu"))
    assert 0 < compute._one_call_seconds(op, torch.device("cpu")) < 1.0


def test_optimizer_is_timed_on_larger_lists_on_a_gpu():
    assert compute.optimizer_params(torch.device("cpu")) == compute.OPTIMIZER_PARAMS
    cuda = compute.optimizer_params(torch.device("cuda"))
    assert cuda[:len(compute.OPTIMIZER_PARAMS)] == compute.OPTIMIZER_PARAMS
    assert max(n * numel for n, numel in cuda) * 4 >= 2**30          # a GPU's rate per byte shows from ~100 MB


def test_checkpoint_overhead_is_what_a_checkpointed_chain_adds_beyond_one_more_forward(monkeypatch):
    """Per chain: the checkpointed forward + backward less the plain one less one more forward,
    against the tensors the chain's forward saves (2 per linear without bias, 1 per tanh)."""
    timings = iter([2.0, 5.0, 1.0, 2.0, 2.5, 1.0, 4.0, 9.0, 2.0])    # (plain, checkpointed, forward) x 3
    ran = []

    def fake_median_time(fn, *args, **kwargs):
        ran.append(fn())
        return next(timings)

    monkeypatch.setattr(compute, "_median_time", fake_median_time)
    out = compute._measure_checkpoint(torch.device("cpu"), iters=3)
    assert out["checkpoint.saved"] == [3.0 * n for n in compute.CHECKPOINT_CHAINS]
    assert out["checkpoint.seconds"] == [2.0, 0.0, 3.0]      # noise below zero is held at zero
    assert len(ran) == 9


def test_cold_chain_is_capped_by_time_but_never_below_the_short_chain(monkeypatch):
    """A machine may report far more cache than its ranks get (a VM's host L3): the cold chain then
    stops at about _MAX_COLD_CHAIN_S of forward + backward, but is never shorter than the chain its
    work and time ask for."""
    calls: list = []
    monkeypatch.setattr(compute, "_median_time", lambda fn, *a, **k: calls.append(fn()) or 1.0)
    monkeypatch.setattr(compute, "_max_over_ranks", lambda values, device: values)  # one process
    monkeypatch.setattr(compute, "_cold_bytes", lambda device: 2**40)
    monkeypatch.setattr(compute, "_one_call_seconds", lambda op, device: compute._MAX_COLD_CHAIN_S / 100)
    op = compute._unary(torch.tanh)(65536, torch.float32, torch.device("cpu"))
    assert compute._cold_chain_cap(op, torch.device("cpu")) == 100
    compute._time_op("tanh", op, torch.device("cpu"), iters=3)
    assert len(calls[0]) == 100
    monkeypatch.setattr(compute, "_one_call_seconds", lambda op, device: 10.0)     # one call past the cap
    assert compute._cold_chain_cap(op, torch.device("cpu")) == 1
    calls.clear()
    compute._time_op("tanh", op, torch.device("cpu"), iters=3)
    short = compute._chain_length("tanh", op, compute.op_work("tanh", op), torch.device("cpu"))
    assert short > 1 and len(calls[0]) == short


def test_drift_scales_each_family_by_its_own_ratio_or_its_proxys():
    """A profile rescaled to the drift probe's findings: each timed family by the geometric mean of
    its ratios, an untimed family by its proxy's (matmul_unaligned by matmul, transcendental by
    pointwise), the optimizer by pointwise, families with no ratio and the links as measured."""
    from dataclasses import replace

    from autoshard.hardware import ComputeCurve, OptimizerModel, load_hardware

    def curve(t):
        return ComputeCurve((1.0, 10.0), (t, 10 * t), (2 * t, 20 * t))

    hw = replace(load_hardware("cpu-gloo"),
                 compute={"float32": {"matmul": curve(1.0), "matmul_unaligned": curve(2.0),
                                      "transcendental": curve(3.0), "conv": curve(4.0)},
                          "bfloat16": {"matmul": curve(5.0)}},
                 optimizer=OptimizerModel(per_tensor=1e-5, per_byte=1e-9))
    points = [compute.DriftPoint("matmul", 1.0, 2.0, 1.0), compute.DriftPoint("matmul", 1.0, 8.0, 1.0),
              compute.DriftPoint("pointwise", 1.0, 0.5, 1.0)]
    now = compute.drift_scaled(hw, points)
    assert now.op_seconds("matmul", 5.0, "fwd", "float32") == pytest.approx(4 * hw.op_seconds("matmul", 5.0, "fwd", "float32"))
    assert now.op_seconds("matmul_unaligned", 1.0, "bwd", "float32") == pytest.approx(4 * 4.0)
    assert now.op_seconds("transcendental", 10.0, "fwd", "float32") == pytest.approx(0.5 * 30.0)
    assert now.compute["float32"]["conv"] == hw.compute["float32"]["conv"]          # no ratio: as measured
    assert now.compute["bfloat16"] == hw.compute["bfloat16"]                        # another dtype
    assert now.optimizer_seconds(10, 1e6) == pytest.approx(0.5 * hw.optimizer_seconds(10, 1e6))
    assert now.axes == hw.axes and now.world == hw.world


def test_a_curve_timed_while_the_machine_was_loaded_is_timed_again_and_keeps_the_faster_times(monkeypatch):
    """After every curve each middle point is timed once more; a curve whose point now takes 15%+
    less (the machine was loaded while it was timed) is timed again whole and keeps, per size, the
    faster forward and backward; a point that rechecks slower (the load is now) leaves its curve."""
    families = {"matmul": ((1, 2, 3), None), "pointwise": ((1, 2, 3), None), "norm": ((1, 2, 3), None)}
    first = {"matmul": 2.0, "pointwise": 1.0, "norm": 1.0}       # matmul's curve timed under a load
    recheck = {"matmul": 1.0, "pointwise": 0.9, "norm": 1.5}     # pointwise: within noise; norm: loaded now
    calls: list = []

    def fake_time_family(family, builders, sizes, dtype, device, iters):
        calls.append((family, tuple(sizes)))
        timed = sum(1 for f, _ in calls if f == family)
        scale = first[family] if timed == 1 else recheck[family] if timed == 2 else 1.1
        return [(float(s), scale * s, 2 * scale * s * (0.5 if timed == 3 and s == 3 else 1.0)) for s in sizes]

    monkeypatch.setattr(compute, "COMPUTE_OPS", families)
    monkeypatch.setattr(compute, "_time_family", fake_time_family)
    monkeypatch.setattr(compute, "_max_over_ranks", lambda values, device: values)
    out = compute._measure_compute(torch.device("cpu"), iters=3, points=None)
    assert [c for c in calls if c[0] == "matmul"] == [("matmul", (1, 2, 3)), ("matmul", (2,)), ("matmul", (1, 2, 3))]
    assert len([c for c in calls if c[0] != "matmul"]) == 4          # pointwise and norm: curve and recheck only
    assert out["float32.matmul.fwd"] == [1.1, 2.2, pytest.approx(3.3)]   # the second timing, faster everywhere
    assert out["float32.matmul.bwd"] == [2.2, 4.4, pytest.approx(3.3)]
    assert out["float32.pointwise.fwd"] == [1.0, 2.0, 3.0] and out["float32.norm.fwd"] == [1.0, 2.0, 3.0]
    assert out[f"float32.{compute.REMEASURED}"] == [1.0, 0.0, 0.0]


def test_faster_rows_refuses_timings_of_different_work():
    assert compute.faster_rows([(1.0, 2.0, 3.0)], [(1.0, 1.5, 4.0)]) == [(1.0, 1.5, 3.0)]
    with pytest.raises(compute.ProfileError, match="differ in work"):
        compute.faster_rows([(1.0, 2.0, 3.0)], [(2.0, 1.5, 4.0)])
