"""Collective costs: the ring formulas on hand-computed numbers and the two-axis model."""
import pytest

from autoshard.comm_cost import (KINDS, Collective, all_gather_cost, all_reduce_cost, all_to_all_cost,
                            collective_cost, reduce_scatter_cost)
from autoshard.hardware import HardwareProfile, LinkModel


def profile(a0=2e-5, b0=2e-11, a1=1e-5, b1=2.5e-12) -> HardwareProfile:
    """Axis 0 slow (inter-node-like), axis 1 fast."""
    return HardwareProfile(name="test", axes=(LinkModel(a0, b0), LinkModel(a1, b1)),
                           peak_flops={"float32": 1e12}, memory_bandwidth=1e12,
                           memory_per_device=2**30, host_device_bandwidth=1e10)


HW = profile()
MESH = (2, 4)
B = 2**24


def test_one_axis_formulas_by_hand():
    # axis 1: n=4, alpha=1e-5, beta=2.5e-12 -> 3*1e-5 + 3/4 * 2**24 * 2.5e-12
    ring1 = 3e-5 + 3.145728e-5
    assert all_gather_cost(B, (1,), MESH, HW) == pytest.approx(ring1)
    assert reduce_scatter_cost(B, (1,), MESH, HW) == pytest.approx(ring1)
    assert all_to_all_cost(B, (1,), MESH, HW) == pytest.approx(ring1)
    assert all_reduce_cost(B, (1,), MESH, HW) == pytest.approx(2 * ring1)
    # axis 0: n=2, alpha=2e-5, beta=2e-11 -> 1*2e-5 + 1/2 * 2**24 * 2e-11
    ring0 = 2e-5 + 1.6777216e-4
    assert all_gather_cost(B, (0,), MESH, HW) == pytest.approx(ring0)
    assert all_reduce_cost(B, (0,), MESH, HW) == pytest.approx(2 * ring0)


def test_collective_cost_dispatches_and_collective_matches():
    for kind in KINDS:
        expected = {"all_gather": all_gather_cost, "all_reduce": all_reduce_cost,
                    "reduce_scatter": reduce_scatter_cost, "all_to_all": all_to_all_cost}[kind]
        for axes in [(0,), (1,), (0, 1)]:
            assert collective_cost(kind, 12345, axes, MESH, HW) == expected(12345, axes, MESH, HW)
            assert Collective(kind, axes, 12345).cost(MESH, HW) == expected(12345, axes, MESH, HW)


@pytest.mark.parametrize("kind", KINDS)
def test_size_one_axis_and_no_axes_cost_nothing(kind):
    assert collective_cost(kind, B, (0,), (1, 4), HW) == 0.0
    assert collective_cost(kind, B, (), MESH, HW) == 0.0
    # both axes on a (1, 4) mesh is just axis 1
    assert collective_cost(kind, B, (0, 1), (1, 4), HW) == collective_cost(kind, B, (1,), (1, 4), HW)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("axes", [(0,), (1,), (0, 1)])
def test_monotonic_in_bytes(kind, axes):
    costs = [collective_cost(kind, b, axes, MESH, HW) for b in [0, 1, 1024, 2**20, 2**30]]
    assert all(x < y for x, y in zip(costs, costs[1:]))
    assert costs[0] > 0  # latency remains at zero bytes


def test_all_reduce_both_axes_is_hierarchical_inner_first():
    # Inner (fast) axis first: reduce-scatter on axis 1, all-reduce 1/4 of the data on axis 0,
    # all-gather on axis 1.
    rs1 = 3e-5 + 0.75 * B * 2.5e-12
    ar0_quarter = 2 * (2e-5 + 0.5 * (B / 4) * 2e-11)
    inner_first = rs1 + ar0_quarter + rs1
    outer_first = 2 * (2e-5 + 0.5 * B * 2e-11) + 2 * (3e-5 + 0.75 * (B / 2) * 2.5e-12)
    flat = 2 * (7 * 2e-5 + 7 / 8 * B * 2e-11)
    assert inner_first < outer_first < flat
    assert all_reduce_cost(B, (0, 1), MESH, HW) == pytest.approx(inner_first)
    assert all_reduce_cost(B, (1, 0), MESH, HW) == pytest.approx(inner_first)


def test_all_gather_and_reduce_scatter_both_axes_send_little_over_slow_axis():
    # all-gather: outer axis first on the small shard (B/4 gathered over axis 0), then axis 1 on B.
    ag = (2e-5 + 0.5 * (B / 4) * 2e-11) + (3e-5 + 0.75 * B * 2.5e-12)
    assert all_gather_cost(B, (0, 1), MESH, HW) == pytest.approx(ag)
    # reduce-scatter: inner axis first on B, then axis 0 on B/4.
    rs = (3e-5 + 0.75 * B * 2.5e-12) + (2e-5 + 0.5 * (B / 4) * 2e-11)
    assert reduce_scatter_cost(B, (0, 1), MESH, HW) == pytest.approx(rs)


def test_all_to_all_both_axes_takes_the_flat_ring_when_cheaper():
    equal = profile(a0=1e-6, b0=1e-10, a1=1e-6, b1=1e-10)
    hierarchical = (1e-6 + 0.5 * B * 1e-10) + (3e-6 + 0.75 * B * 1e-10)
    flat = 7e-6 + 7 / 8 * B * 1e-10
    assert flat < hierarchical
    assert all_to_all_cost(B, (0, 1), MESH, equal) == pytest.approx(flat)
    # small messages: latency dominates and the hierarchical form (4 steps, not 7) wins
    small = 64
    hier_small = (1e-6 + 0.5 * small * 1e-10) + (3e-6 + 0.75 * small * 1e-10)
    assert all_to_all_cost(small, (0, 1), MESH, equal) == pytest.approx(hier_small)


def test_both_axes_never_cheaper_than_either_axis_alone():
    for kind in KINDS:
        both = collective_cost(kind, B, (0, 1), MESH, HW)
        assert both > collective_cost(kind, B, (1,), MESH, HW)
        assert both > collective_cost(kind, B / 4, (0,), MESH, HW)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown collective kind"):
        collective_cost("broadcast", 1, (0,), MESH, HW)
    with pytest.raises(ValueError, match="unknown collective kind"):
        Collective("gather", (0,), 1)
    with pytest.raises(ValueError, match=">= 0"):
        all_gather_cost(-1, (0,), MESH, HW)
    with pytest.raises(ValueError, match="out of range"):
        all_gather_cost(1, (2,), MESH, HW)
    with pytest.raises(ValueError, match="repeated"):
        all_gather_cost(1, (1, 1), MESH, HW)
