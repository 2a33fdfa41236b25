"""The collectives' waits for drifted ranks: the profile's tables per group, their fit, and the step
walk that prices them in predict (and not in the ILP)."""
from __future__ import annotations

import dataclasses

import pytest

from autoshard.capture import capture
from autoshard.enumerate import enumerate_strategies
from autoshard.hardware import HardwareError, HardwareProfile, SyncWait, load_hardware
from autoshard.models import build_model
from autoshard.profile.fitting import fit_sync_wait
from autoshard.profile.timing import ProfileError
from autoshard.solver import build_cost_graph
from autoshard.solver.baselines import solve_baseline
from autoshard.solver.evaluate import gradient_sync, param_gathers
from autoshard.solver.ilp import SolverOptions, objective_of, predict
from autoshard.solver.sync_wait import _Step, sync_gaps, sync_wait_seconds

TABLE = SyncWait((2e-3, 4e-3, 8e-3), (0.0, 1e-3, 3e-3))
TINY = SyncWait((0.2e-3, 1e-3, 2e-3), (0.0, 0.2e-3, 0.5e-3))       # gaps of a tiny model's step
GROUPS = ("axis0", "axis1", "world")


def test_the_wait_is_zero_up_to_the_priced_gap_linear_between_points_and_flat_beyond():
    assert TABLE.seconds_after(0.0) == 0.0
    assert TABLE.seconds_after(2e-3) == 0.0
    assert TABLE.seconds_after(3e-3) == pytest.approx(0.5e-3)
    assert TABLE.seconds_after(6e-3) == pytest.approx(2e-3)
    assert TABLE.seconds_after(1.0) == pytest.approx(3e-3)


def test_profile_round_trip_per_group_and_errors():
    tables = {"world": TABLE, "axis1": TINY}
    hw = dataclasses.replace(load_hardware("cpu-gloo"), sync_wait=tables)
    again = HardwareProfile.from_dict(hw.to_dict())
    assert again.sync_wait == tables
    assert again.sync_wait_seconds("world", 3e-3) == pytest.approx(0.5e-3)
    assert again.sync_wait_seconds("axis1", 2e-3) == pytest.approx(0.5e-3)
    assert again.sync_wait_seconds("axis0", 1.0) == 0.0           # not measured: no wait
    assert HardwareProfile.from_dict({k: v for k, v in hw.to_dict().items() if k != "sync_wait"}).sync_wait == {}
    legacy = hw.to_dict()                 # one table without groups, as written before waits per group
    legacy["sync_wait"] = {"gap": list(TABLE.gaps), "seconds": list(TABLE.seconds)}
    assert HardwareProfile.from_dict(legacy).sync_wait == {"world": TABLE}
    bad = hw.to_dict()
    bad["sync_wait"] = {"axis2": {"gap": [2e-3, 4e-3], "seconds": [0.0, 1e-3]}}
    with pytest.raises(HardwareError, match="must map groups"):
        HardwareProfile.from_dict(bad)
    bad["sync_wait"] = {"world": {"gap": [4e-3, 2e-3], "seconds": [0.0, 1e-3]}}
    with pytest.raises(HardwareError, match="gaps increasing"):
        HardwareProfile.from_dict(bad)
    bad["sync_wait"] = {"world": {"gap": [2e-3, 4e-3], "seconds": [0.0]}}
    with pytest.raises(HardwareError, match="as many seconds as gaps"):
        HardwareProfile.from_dict(bad)
    bad["sync_wait"] = {"axis0": {"gap": [2e-3, 4e-3], "seconds": [0.0, -1e-3]}}
    with pytest.raises(HardwareError, match=r"sync_wait.axis0.seconds\[1\]"):
        HardwareProfile.from_dict(bad)


def test_a_group_waits_for_the_compute_since_its_ranks_last_met_on_it_or_on_all_devices():
    """A meeting on a mesh axis's groups brings only those ranks together; one on all devices brings
    every group together. Gaps are the steady state's: the step's end runs into its start."""
    step = _Step((2, 2))
    for event in (1.0, (0,), 2.0, (1,), 4.0, (0, 1), 8.0, (0,), (1,), 16.0):
        step.compute(event) if isinstance(event, float) else step.meet(event)
    assert step.gaps() == [("axis0", 16.0 + 1.0), ("axis1", 16.0 + 1.0 + 2.0), ("world", 8.0 + 16.0 + 1.0 + 2.0 + 4.0),
                           ("axis0", 8.0), ("axis1", 8.0)]
    one_axis = _Step((1, 4))                 # a collective over both axes runs on axis 1's devices
    one_axis.compute(1.0)
    one_axis.meet((0, 1))
    one_axis.meet((0,))                      # nothing to move over an axis of one device
    assert one_axis.gaps() == [("axis1", 1.0)]


def test_fit_is_beyond_the_shortest_gap_never_negative_and_never_falling():
    fit = fit_sync_wait([2e-3, 4e-3, 8e-3, 16e-3], [7e-3, 6.5e-3, 10e-3, 9e-3])
    assert fit.gaps == (2e-3, 4e-3, 8e-3, 16e-3)
    assert fit.seconds == pytest.approx((0.0, 0.0, 3e-3, 3e-3))
    with pytest.raises(ProfileError):
        fit_sync_wait([2e-3], [7e-3])
    with pytest.raises(ProfileError):
        fit_sync_wait([4e-3, 2e-3], [7e-3, 8e-3])


@pytest.fixture(scope="module")
def graphs():
    """GPT-2 tiny on a 2x2 mesh, priced by cpu-gloo without a sync-wait table and with a tiny one
    (the table changes no node or edge cost: the same graph priced both ways)."""
    model, args, kwargs = build_model("gpt2-tiny", device="meta", num_layers=2, batch=8, seq=32)
    graph = capture(model, args, kwargs)
    plain = dataclasses.replace(load_hardware("cpu-gloo"), sync_wait={})
    out = {}
    for name, hw in (("plain", plain), ("waits", dataclasses.replace(plain, sync_wait=dict.fromkeys(GROUPS, TINY)))):
        out[name] = build_cost_graph(enumerate_strategies(graph, mesh_shape=(2, 2), hardware=hw))
    out["one device"] = build_cost_graph(enumerate_strategies(graph, mesh_shape=(1, 1), hardware=out["waits"].hardware))
    return out


def _walk(cg, sol):
    gathers = param_gathers(cg, sol.choice)
    sync = gradient_sync(cg, sol.choice, gathers)
    return gathers, sync, sync_gaps(cg, sol.choice, sol.decisions, gathers, sync, sol.time.optimizer)


@pytest.mark.parametrize("baseline", ["data_parallel", "megatron", "zero3"])
def test_every_second_of_compute_lands_in_one_gap_of_all_devices(graphs, baseline):
    cg = graphs["waits"]
    sol = solve_baseline(cg, baseline).solution
    gathers, sync, gaps = _walk(cg, sol)
    assert gaps and min(g for _, g in gaps) >= 0.0 and {group for group, _ in gaps} <= set(GROUPS)
    local_edges = 0.0
    for e in cg.edges:
        if (e.dst_member, e.operand) in gathers.uses:
            continue
        a, b = e.src_index[sol.choice[e.src]], e.dst_index[sol.choice[e.dst]]
        local_edges += float(e.fwd[a, b]) * (e.nbytes_fwd[a, b] == 0)
        local_edges += float(e.bwd[a, b]) * (e.nbytes_bwd[a, b] == 0) * e.grad
    compute = sum(float(n.costs.compute_fwd[sol.choice[n.name]] + n.costs.compute_bwd[sol.choice[n.name]]
                        + n.costs.reshard_fwd[sol.choice[n.name]] + n.costs.reshard_bwd[sol.choice[n.name]])
                  for n in cg.nodes.values())
    world = [g for group, g in gaps if group == "world"]        # the loss's all-reduce at least
    assert world and sum(world) == pytest.approx(compute + local_edges + sol.time.optimizer, rel=1e-9)


def test_one_device_never_waits(graphs):
    cg = graphs["one device"]
    sol = solve_baseline(cg, "data_parallel").solution
    assert _walk(cg, sol)[2] == []
    assert sol.time.sync_wait == 0.0


def test_data_parallel_waits_last_for_the_gradient_buckets(graphs):
    """The last meeting point of a data-parallel step is the wait for its gradient buckets, and the
    optimizer step runs into the first one of the next step."""
    cg = graphs["waits"]
    sol = solve_baseline(cg, "data_parallel").solution
    _, sync, gaps = _walk(cg, sol)
    assert sync.synced and len(gaps) >= 2 and gaps[-1][0] == "world" and gaps[0][1] >= sol.time.optimizer


def test_predict_adds_the_waits_and_the_ilp_objective_leaves_them_out(graphs):
    options = SolverOptions()
    sol = solve_baseline(graphs["waits"], "megatron").solution
    with_waits, _ = predict(graphs["waits"], sol.choice, sol.decisions, options)
    without, _ = predict(graphs["plain"], sol.choice, sol.decisions, options)
    gathers, sync, gaps = _walk(graphs["waits"], sol)
    expected = sum(TINY.seconds_after(g) for _, g in gaps)
    assert expected > 0
    assert with_waits.sync_wait == pytest.approx(expected)
    assert without.sync_wait == 0.0
    assert with_waits.total == pytest.approx(without.total + expected)
    assert sync_wait_seconds(graphs["plain"], sol.choice, sol.decisions, gathers, sync, sol.time.optimizer) == 0.0
    assert objective_of(graphs["waits"], sol.choice, sol.decisions, options) == pytest.approx(
        objective_of(graphs["plain"], sol.choice, sol.decisions, options), rel=1e-12)
