"""Resharding: known cases, errors, and optimality against an exhaustive search written here."""
from __future__ import annotations

import dataclasses
import math

import pytest

from autoshard.comm_cost import collective_cost
from autoshard.hardware import HardwareProfile, LinkModel
from autoshard.reshard import ReshardError, reshard_cost, reshard_plan, reshard_table
from autoshard.specs import ShardSpec, all_specs

# Distinct links per axis so that ties between axes are rare and wrong axis choices show.
HW = HardwareProfile(name="test", axes=(LinkModel(3e-5, 2e-11), LinkModel(1e-5, 3e-12)),
                     peak_flops={"float32": 1e12}, memory_bandwidth=1e12, memory_per_device=2**30,
                     host_device_bandwidth=1e10)
S = ShardSpec.parse


def plan(src: str, dst: str, shape=(8, 8), mesh=(2, 2)):
    return reshard_plan(S(src), S(dst), shape, 4, mesh, HW)


# -- known cases ---------------------------------------------------------------------------------
def test_identity_is_free_and_empty():
    for s in reshard_table((8, 8), 4, (2, 2), HW).states:
        p = reshard_plan(s, s, (8, 8), 4, (2, 2), HW)
        assert p.steps == () and p.cost == 0.0


def test_gather_is_one_all_gather_of_the_full_tensor():
    p = plan("S0R", "RR")
    [step] = p.steps
    assert (step.kind, step.axis, step.dims, step.nbytes) == ("all_gather", 0, (0,), 8 * 8 * 4)
    assert p.cost == collective_cost("all_gather", 256, (0,), (2, 2), HW)
    assert str(step).startswith("all_gather(axis=0, dim=0, 256 B, ")


def copy(nbytes: float) -> float:
    """One local copy of ``nbytes`` on HW (no measured curve: read + write over the bandwidth)."""
    return 2 * nbytes / HW.memory_bandwidth


def test_split_of_the_outer_dim_is_free_an_inner_one_copies_its_slice():
    p = plan("RR", "S0R")
    assert [(s.kind, s.axis, s.dims) for s in p.steps] == [("split", 0, (0,))] and p.cost == 0.0
    assert str(p.steps[0]) == "split(axis=0, dim=0)"
    inner = plan("RR", "RS0")
    assert [(s.kind, s.dims) for s in inner.steps] == [("split", (1,))]
    assert inner.cost == pytest.approx(copy(8 * 8 * 4 / 2))       # chunk(...).contiguous() of a column block
    assert plan("RR", "RS0", shape=(1, 8)).cost == 0.0             # a leading dim of 1: the slice is contiguous


def test_a_split_that_is_a_view_costs_one_dispatch_on_cpu_ranks_with_measured_ops():
    """Two plans alike but for a split the runtime takes as a view: the one that runs fewer ops is
    the cheaper (a tie broken arbitrarily left a plan running splits a data-parallel plan avoids)."""
    from autoshard.hardware import ComputeCurve

    floor = 5e-6
    curves = {"float32": {"pointwise": ComputeCurve((1e3, 1e6), (floor, 1e-4), (2 * floor, 2e-4))}}
    hw = dataclasses.replace(HW, compute=curves, device_memory_separate=False)      # CPU ranks
    assert hw.dispatch_seconds() == floor and HW.dispatch_seconds() == 0.0
    assert dataclasses.replace(hw, device_memory_separate=True).dispatch_seconds() == 0.0    # a GPU queues ops
    p = reshard_plan(S("RR"), S("S01R"), (8, 8), 8, (2, 2), hw, "int64")    # token ids: dispatch whatever the dtype
    assert [s.kind for s in p.steps] == ["split", "split"] and p.cost == pytest.approx(2 * floor)


def test_gather_of_an_inner_dim_pays_its_layout_copies():
    p = plan("RS0", "RR")
    [step] = p.steps
    assert (step.kind, step.dims, step.nbytes) == ("all_gather", (1,), 256)
    # the gathered blocks concatenated along the dim: one copy of the result
    assert p.cost == pytest.approx(collective_cost("all_gather", 256, (0,), (2, 2), HW) + copy(256))


def test_shard_to_other_dim_is_one_all_to_all():
    p = plan("S0R", "RS0")
    [step] = p.steps
    assert (step.kind, step.axis, step.dims, step.nbytes) == ("all_to_all", 0, (0, 1), 128)
    # its blocks stacked before, what it got concatenated after
    assert p.cost == pytest.approx(collective_cost("all_to_all", 128, (0,), (2, 2), HW) + 2 * copy(128))
    assert "dim 0->1" in str(step)


def test_partial_to_shard_is_one_reduce_scatter():
    p = plan("RR+P1", "RS1")
    [step] = p.steps
    assert (step.kind, step.axis, step.dims, step.nbytes) == ("reduce_scatter", 1, (1,), 256)
    assert p.cost == pytest.approx(collective_cost("reduce_scatter", 256, (1,), (2, 2), HW) + copy(256))


def test_partial_to_replicate_is_all_reduce_of_a_clone_and_back_a_local_copy():
    there = plan("RR+P0", "RR")
    assert [s.kind for s in there.steps] == ["all_reduce"]
    assert there.cost == pytest.approx(collective_cost("all_reduce", 256, (0,), (2, 2), HW) + copy(256))
    back = plan("RR", "RR+P0")
    assert [s.kind for s in back.steps] == ["to_partial"] and back.cost == pytest.approx(copy(256))


def test_copies_priced_by_the_measured_pointwise_curve_of_the_dtype():
    from autoshard.hardware import ComputeCurve
    curve = ComputeCurve((1e3, 1e6), (1e-6, 1e-3), (2e-6, 2e-3))
    measured = dataclasses.replace(HW, compute={"float32": {"pointwise": curve}})
    p = reshard_plan(S("RS0"), S("RR"), (8, 8), 4, (2, 2), measured, "torch.float32")
    gather = collective_cost("all_gather", 256, (0,), (2, 2), HW)
    assert p.cost == pytest.approx(gather + curve.seconds(2 * 256, "fwd"))
    # a dtype with no curve, or none given, falls back to the bandwidth; tables are not shared across these
    assert reshard_cost("RS0", "RR", (8, 8), 4, (2, 2), measured, "bfloat16") == pytest.approx(gather + copy(256))
    assert reshard_cost("RS0", "RR", (8, 8), 4, (2, 2), measured) == pytest.approx(gather + copy(256))


def test_copies_in_short_runs_go_by_the_copy_blocks_curve():
    """A profile with a ``copy_blocks`` curve prices a layout copy by its contiguous runs: the gather
    of the last dim of (64, 4096) over 2 devices concatenates runs of 2048 elements (the contiguous
    rate), of (4096, 64) runs of 32 (between the two curves, geometrically in log(run)), of
    (16384, 16) runs of 8 (the blocks curve)."""
    from autoshard.hardware import CONTIGUOUS_RUN, COPY_RUN, ComputeCurve
    from autoshard.reshard import _moves, _problem
    pointwise = ComputeCurve((1e3, 1e8), (1e-6, 1e-1), (1e-6, 1e-1))
    blocks = ComputeCurve((1e3, 1e8), (4e-6, 4e-1), (4e-6, 4e-1))
    measured = dataclasses.replace(HW, compute={"float32": {"pointwise": pointwise, "copy_blocks": blocks}})
    for shape, run in (((64, 4096), 2048), ((4096, 64), 32), ((16384, 16), 8)):
        gathered = math.prod(shape) * 4
        w = min(1.0, math.log(max(run, COPY_RUN) / COPY_RUN) / math.log(CONTIGUOUS_RUN / COPY_RUN))
        layout = blocks.seconds(2 * gathered, "fwd") ** (1 - w) * pointwise.seconds(2 * gathered, "fwd") ** w
        moves = _moves(S("RS0"), _problem(shape, 4, (2, 2), measured, "float32"))
        [gather] = [m for m in moves if m.kind == "all_gather"]
        assert gather.cost == pytest.approx(collective_cost("all_gather", gathered, (0,), (2, 2), HW) + layout), shape
    # a split along the outer dim of the shard is a view whatever its rows' length
    assert reshard_cost("RR", "S0R", (4096, 64), 4, (2, 2), measured, "float32") == pytest.approx(HW.dispatch_seconds())


def test_both_axes_gather_goes_innermost_first():
    p = plan("S01R", "RR", shape=(8, 8), mesh=(2, 4))
    assert [(s.kind, s.axis) for s in p.steps] == [("all_gather", 1), ("all_gather", 0)]
    assert [s.nbytes for s in p.steps] == [8 * 8 * 4 // 2, 8 * 8 * 4]


def test_plan_is_memoised_and_printable():
    assert plan("S0S1", "S1S0") is plan("S0S1", "S1S0")
    assert str(plan("S0R", "S0R")) == "S0R -> S0R: no-op"
    assert str(plan("S0R", "RS0")).startswith("S0R -> RS0 (")


def test_string_and_spec_arguments_agree():
    assert reshard_cost("S0R", "RS1", (8, 8), 4, (2, 2), HW) == reshard_cost(S("S0R"), S("RS1"), (8, 8), 4, (2, 2), HW)


def test_non_fitting_or_wrong_rank_specs_raise():
    with pytest.raises(ReshardError, match="target spec RS01 does not fit.*divisible by 4"):
        reshard_cost("RR", "RS01", (8, 6), 4, (2, 2), HW)
    with pytest.raises(ReshardError, match="source spec S0R does not fit"):
        reshard_plan("S0R", "RR", (3, 8), 4, (2, 2), HW)
    with pytest.raises(ReshardError, match="3 dims"):
        reshard_cost("RRR", "RR", (8, 8), 4, (2, 2), HW)
    with pytest.raises(ReshardError, match="itemsize"):
        reshard_cost("RR", "RR", (8, 8), 0, (2, 2), HW)


# -- an independent model of the moves -------------------------------------------------------------
def role(spec: ShardSpec, axis: int):
    """What ``axis`` does in ``spec``: ('P',), ('S', dim) or None."""
    if axis in spec.partial:
        return ("P",)
    d = spec.axis_dim(axis)
    return None if d is None else ("S", d)


def innermost(spec: ShardSpec, axis: int) -> bool:
    d = spec.axis_dim(axis)
    return d is None or spec.dims[d][-1] == axis


def one_move(s: ShardSpec, t: ShardSpec, shape, mesh):
    """(kind, axis, dims, cost) if ``t`` is one move from ``s``, else None.

    Written from the move list, not from reshard.py: exactly one axis changes role, every other
    axis keeps its role, and the moved axis is innermost where it leaves and where it arrives.
    """
    changed = [a for a in range(len(mesh)) if role(s, a) != role(t, a)]
    if len(changed) != 1:
        return None
    a = changed[0]
    rs, rt = role(s, a), role(t, a)
    local_shape = s.local_shape(shape, mesh)
    local = math.prod(local_shape) * 4
    if not (innermost(s, a) and innermost(t, a)):
        return None

    def strided(dim: int) -> bool:      # a block along ``dim`` is not one contiguous piece of the shard
        return math.prod(local_shape[:dim]) > 1

    if rs is None and rt == ("P",):
        return "to_partial", a, (), copy(local)
    if rs is None:
        return "split", a, (rt[1],), copy(local / mesh[a]) if strided(rt[1]) else 0.0
    if rs == ("P",) and rt is None:
        return "all_reduce", a, (), collective_cost("all_reduce", local, (a,), mesh, HW) + copy(local)
    if rs == ("P",):
        return "reduce_scatter", a, (rt[1],), collective_cost("reduce_scatter", local, (a,), mesh, HW) + copy(local)
    if rt is None:
        layout = copy(local * mesh[a]) if strided(rs[1]) else 0.0
        return "all_gather", a, (rs[1],), collective_cost("all_gather", local * mesh[a], (a,), mesh, HW) + layout
    if rt[0] == "S":
        return "all_to_all", a, (rs[1], rt[1]), collective_cost("all_to_all", local, (a,), mesh, HW) + 2 * copy(local)
    return None  # sharded -> partial is not a move


def brute_force_costs(src: ShardSpec, states: list[ShardSpec], edges) -> dict[ShardSpec, float]:
    """Cheapest cost from ``src`` to every state by DFS over simple paths.

    Depth bound: a simple path has at most len(states) - 1 moves, and every move costs >= 0, so a
    walk that repeats a state is never cheaper than the simple path left after cutting its cycle.
    Pruning: a path is abandoned at a state only when strictly (beyond rounding) costlier than the
    best known cost there. The prefixes of an optimal path cost exactly the optimum at each of its
    states (a prefix of a shortest path is shortest), so they are never pruned and the optimal
    path itself is enumerated.
    """
    best = {s: math.inf for s in states}
    best[src] = 0.0
    on_path = {src}

    def dfs(u: ShardSpec, cost: float, depth: int) -> None:
        if depth == len(states) - 1:
            return
        for v, c in edges[u]:
            if v in on_path or cost + c > best[v] * (1 + 1e-9):
                continue
            best[v] = min(best[v], cost + c)
            on_path.add(v)
            dfs(v, cost + c, depth + 1)
            on_path.remove(v)

    dfs(src, 0.0, 0)
    return best


def all_simple_path_costs(src: ShardSpec, edges) -> dict[ShardSpec, float]:
    """Cheapest cost to every state over ALL simple paths from ``src``, no pruning."""
    best = {src: 0.0}

    def dfs(u: ShardSpec, cost: float, on_path: frozenset) -> None:
        for v, c in edges[u]:
            if v not in on_path:
                best[v] = min(best.get(v, math.inf), cost + c)
                dfs(v, cost + c, on_path | {v})

    dfs(src, 0.0, frozenset([src]))
    return best


def replay(p, shape, mesh) -> None:
    """Apply each step by the move rules and check the specs, costs and the total."""
    spec, total = p.src, 0.0
    for step in p.steps:
        nxt = step.after
        assert nxt.fits(shape, mesh), f"{step} leaves the fitting states"
        assert one_move(spec, nxt, shape, mesh)[:3] == (step.kind, step.axis, step.dims), str(step)
        assert step.cost == pytest.approx(one_move(spec, nxt, shape, mesh)[3], rel=1e-12)
        spec, total = nxt, total + step.cost
    assert spec == p.dst
    assert total == pytest.approx(p.cost, rel=1e-12, abs=0)


CASES = [
    ((8,), (2, 2)), ((8,), (2, 4)), ((2,), (2, 4)),
    ((8, 16), (2, 2)), ((8, 16), (2, 4)), ((2, 6), (2, 4)),
    ((4, 8, 2), (2, 2)),
]


@pytest.mark.parametrize("shape,mesh", CASES, ids=[f"{s}-{m}" for s, m in CASES])
def test_optimal_against_exhaustive_search(shape, mesh):
    states = [s for s in all_specs(len(shape), len(mesh), with_partial=True) if s.fits(shape, mesh)]
    assert set(states) == set(reshard_table(shape, 4, mesh, HW).states)
    edges = {s: [(t, m[3]) for t in states if (m := one_move(s, t, shape, mesh))] for s in states}
    for src in states:
        best = brute_force_costs(src, states, edges)
        for dst in states:
            p = reshard_plan(src, dst, shape, 4, mesh, HW)
            assert p.cost == pytest.approx(best[dst], rel=1e-9, abs=1e-15), f"{src} -> {dst}: {p}"
            replay(p, shape, mesh)


@pytest.mark.parametrize("shape,mesh", [((8,), (2, 2)), ((2, 6), (2, 4))])
def test_pruned_search_equals_full_enumeration(shape, mesh):
    states = [s for s in all_specs(len(shape), len(mesh), with_partial=True) if s.fits(shape, mesh)]
    edges = {s: [(t, m[3]) for t in states if (m := one_move(s, t, shape, mesh))] for s in states}
    for src in states:
        assert brute_force_costs(src, states, edges) == pytest.approx(all_simple_path_costs(src, edges))


@pytest.mark.parametrize("shape, dim", [((4, 6, 8), 0), ((4, 6, 8), 1), ((4, 6, 8), 2), ((1, 1, 6, 8), 2), ((2, 3, 4, 8), 3)])
def test_gathered_blocks_concatenate_to_the_whole_tensor(shape, dim):
    """The runtime's all-gather receives the shards block after block along dim 0 and concatenates
    them along the gathered dim: the whole tensor, contiguous (a view where the dims before it have
    size 1, as the resharding prices it)."""
    import torch

    from autoshard.runtime.collectives import concat_gathered
    whole = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    n = 2
    blocks = torch.cat([b.contiguous() for b in whole.chunk(n, dim)])     # shard after shard, along dim 0
    out = concat_gathered(blocks, n, dim)
    assert torch.equal(out, whole) and out.is_contiguous()
    assert (out.data_ptr() == blocks.data_ptr()) == (math.prod(shape[:dim]) == 1)
