"""The search of AutoChunk: which chunk loops, with which chunk lengths, for a budget.

A plan is a set of :class:`~.regions.Region` s; :func:`simulate_plan` turns it into the program of
units the generated code runs and simulates its memory. At the simulated peak, :func:`candidates`
finds every region around it (from the producers of the largest live tensors, within ``window``
nodes) and :func:`pick` takes the best; :func:`plan_loops` repeats this peak after peak (the
budget rule is in :mod:`autoshard.autochunk`): with a budget until the peak fits it, without one
down to the lowest reachable peak and then back up by ``slack`` to longer chunks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import fx

from ..opinfo import op_name
from ..units import format_bytes
from .flow import NotFree, tensors_of
from .memory import Key, Simulation, StorageNamer, Unit, simulate, tensor_bytes
from .regions import GraphInfo, Region, analyse_range

MAX_REGIONS = 32
#: With ``max_memory=None``, the smallest working set (bytes) a loop iteration may have.
MIN_LOOP_BYTES = 256 * 1024


# ---------------------------------------------------------------------------------------------
# Plans: the program (list of units) for a set of regions
# ---------------------------------------------------------------------------------------------


def build_units(info: GraphInfo, regions: list[Region]) -> tuple[list[Unit], set[Key]]:
    """The program's units with ``regions`` as loops, and the keys of the graph outputs."""
    namer = StorageNamer(info.facts)
    for p in info.placeholders:
        namer.name_external(p)
    starts = {r.start: (i, r) for i, r in enumerate(regions)}
    covered = {j for r in regions for j in range(r.start, r.end + 1)}
    units: list[Unit] = []
    for i, n in enumerate(info.nodes):
        if i in starts:
            ri, r = starts[i]
            units.extend(_node_unit(info, namer, h) for h in r.hoisted)
            units.append(_loop_unit(namer, ri, r))
        if i not in covered:
            units.append(_node_unit(info, namer, n))
    outputs = {k for n in info.output_nodes for k in namer.keys.get(n, ())}
    return units, outputs


def _node_unit(info: GraphInfo, namer: StorageNamer, n: fx.Node) -> Unit:
    keys, fresh = namer.name(n, lambda i: (n.name, i))
    nbytes = info.facts.storage_bytes(n)
    defs = {keys[i]: nbytes[i] for i in fresh}
    return Unit(n.name, defs, namer.uses(n), node=n)


def _loop_unit(namer: StorageNamer, ri: int, r: Region) -> Unit:
    uses: set[Key] = set()
    for a in list(r.sliced) + list(r.whole):
        uses.update(k for k in namer.keys.get(a, ()) if k not in namer.external)
    defs: dict[Key, int] = {}
    for o in r.outputs:
        key = ("loop", ri, o.name)
        namer.set(o, [key])
        defs[key] = tensor_bytes(o.meta["val"])
    transient = int(math.ceil(r.chunk * r.row_bytes))
    return Unit(f"chunk loop {ri}", defs, uses, transient=transient, region=ri)


def simulate_plan(info: GraphInfo, regions: list[Region]) -> Simulation:
    units, outputs = build_units(info, regions)
    return simulate(units, outputs)


# ---------------------------------------------------------------------------------------------
# Candidates: the loops that could lower one peak
# ---------------------------------------------------------------------------------------------


@dataclass
class Candidate:
    """A region with the loop's memory split as ``base + chunk * region.row_bytes``."""

    region: Region
    base: int

    def peak_at(self, chunk: int) -> float:
        return self.base + chunk * self.region.row_bytes

    def largest_chunk(self, target: int) -> int:
        """Largest chunk length whose loop stays within ``target`` (0 when even 1 does not)."""
        if self.region.row_bytes <= 0:
            return self.region.size
        return max(0, min(self.region.size, int((target - self.base) // self.region.row_bytes)))


def _bounds(info: GraphInfo, regions: list[Region], lo: int, hi: int) -> tuple[int, int]:
    """Smallest start and largest end a new range around ``lo..hi`` may take."""
    left, right = 0, len(info.nodes) - 1
    for r in regions:
        if r.end < lo:
            left = max(left, r.end + 1)
        elif r.start > hi:
            right = min(right, r.start - 1)
    return left, right


def anchors_at(info: GraphInfo, sim: Simulation, unit: int, covered: set[int], k: int = 3) -> list[fx.Node]:
    """Producers of the ``k`` largest storages live while ``unit`` runs (not already in a loop)."""
    units = sim.units
    sizes: dict[Key, int] = {}
    owner: dict[Key, fx.Node] = {}
    for u in units:
        for key, b in u.defs.items():
            sizes[key] = b
            if u.node is not None:
                owner[key] = u.node
    live = [key for key in sim.live_during(unit) if key in owner and info.index[owner[key]] not in covered]
    live.sort(key=lambda key: -sizes[key])
    return [owner[key] for key in live[:k]]


def candidates(info: GraphInfo, regions: list[Region], sim: Simulation, unit: int,
               window: int) -> tuple[list[Candidate], list[str]]:
    """Every valid region around the peak ``unit``, with its loop's base memory."""
    covered = {j for r in regions for j in range(r.start, r.end + 1)}
    peak_node = sim.units[unit].node
    assert peak_node is not None
    p = info.index[peak_node]
    if p in covered:
        return [], [f"{peak_node.name} runs before an existing chunk loop (hoisted)"]
    found: list[Candidate] = []
    reasons: list[str] = []
    base_of = _LoopBase(info, sim)
    seen: set[tuple[int, int, fx.Node, int]] = set()
    for anchor in anchors_at(info, sim, unit, covered):
        a = info.index[anchor]
        lo, hi = min(a, p), max(a, p)
        left, right = _bounds(info, regions, lo, hi)
        if any(lo <= j <= hi for j in covered):
            continue
        for d, s in enumerate(tensors_of(anchor)[0].shape):
            if s == 1:
                continue
            for start in range(max(left, lo - window), lo + 1):
                for end in range(hi, min(right, hi + window) + 1):
                    if (start, end, anchor, d) in seen:
                        continue  # the same region was found from another anchor
                    try:
                        region = analyse_range(info, start, end, anchor, d)
                    except NotFree as e:
                        if start == lo and end == hi:
                            reasons.append(f"dim {d} of {anchor.name}: {e}")
                        continue
                    seen.update((start, end, n, nd) for n, nd in region.dims.items())
                    found.append(Candidate(region, base_of(region)))
    return found, reasons


class _LoopBase:
    """Memory live around a new loop: what the current plan holds just before the range starts,
    the hoisted nodes' results still needed, and the loop's output buffers."""

    def __init__(self, info: GraphInfo, sim: Simulation) -> None:
        self.info, self.sim = info, sim
        self.pos = {u.node: i for i, u in enumerate(sim.units) if u.node is not None}
        self.size: dict[Key, int] = {k: b for u in sim.units for k, b in u.defs.items()}

    def __call__(self, region: Region) -> int:
        info, sim = self.info, self.sim
        first = self.pos[info.nodes[region.start]]
        live = sim.live_after[first - 1] if first > 0 else set()
        base = sum(self.size[k] for k in live)
        for h in region.hoisted:
            if any(u in region.dims or u.op == "output" or info.index.get(u, -1) > region.end for u in h.users):
                base += sum(sim.units[self.pos[h]].defs.values())
        return base + sum(tensor_bytes(o.meta["val"]) for o in region.outputs)


def pick(found: list[Candidate], target: int | None) -> Candidate | None:
    """Best candidate: with a target, the one allowing the largest chunk (fewest iterations);
    without, the one with the lowest loop peak at chunk 1. Ties go to the shorter range."""
    if not found:
        return None
    if target is None:
        return min(found, key=lambda c: (c.peak_at(1), c.region.end - c.region.start))
    best = max(found, key=lambda c: (c.largest_chunk(target), -(c.region.end - c.region.start)))
    return best if best.largest_chunk(target) >= 1 else None

# ---------------------------------------------------------------------------------------------
# Peak after peak
# ---------------------------------------------------------------------------------------------


@dataclass
class ChunkPlan:
    """The chosen loops, the peak they leave (and where), and why the search stopped (None: it met
    its target)."""

    regions: list[Region]
    peak: int
    peak_label: str
    stop: str | None



def _greedy(info: GraphInfo, target: int | None, window: int) -> ChunkPlan:
    """Chunk peak after peak. ``target=None``: every loop at chunk 1, until no loop lowers the
    peak (gives the lowest reachable peak). Otherwise: stop as soon as the peak fits."""
    regions: list[Region] = []
    for _ in range(MAX_REGIONS):
        sim = simulate_plan(info, regions)
        at = sim.argmax
        unit = sim.units[at]
        if target is not None and sim.peak <= target:
            return ChunkPlan(regions, sim.peak, unit.label, None)
        if unit.region is not None:
            r = regions[unit.region]
            if target is not None and _shrink(r, sim.during[at] - unit.transient, target):
                continue
            return ChunkPlan(regions, sim.peak, unit.label,
                         f"the peak is inside chunk loop {unit.region} ({r.describe()}), which "
                         f"cannot be made smaller")
        found, reasons = candidates(info, regions, sim, at, window)
        best = pick(found, target)
        node = unit.node
        where = f"node {node.name} ({op_name(node.target)})" if node is not None else unit.label
        if best is None:
            why = "; ".join(reasons[:3]) or "no chunk loop keeps its peak within the budget"
            if not found:
                why = f"no free dim around it ({why})"
            return ChunkPlan(regions, sim.peak, unit.label, f"peak at {where}: {why}")
        if target is None and best.peak_at(1) >= sim.peak:
            return ChunkPlan(regions, sim.peak, unit.label, f"peak at {where}: no chunk loop lowers it")
        best.region.chunk = 1 if target is None else best.largest_chunk(target)
        regions.append(best.region)
    sim = simulate_plan(info, regions)
    return ChunkPlan(regions, sim.peak, sim.units[sim.argmax].label, f"stopped after {MAX_REGIONS} loops")


def _shrink(r: Region, base: int, target: int) -> bool:
    """Lower a loop's chunk so that ``base + chunk * row_bytes <= target``; False if impossible."""
    c = Candidate(r, base).largest_chunk(target)
    if 1 <= c < r.chunk:
        r.chunk = c
        return True
    return False


def _relax(info: GraphInfo, regions: list[Region], target: int) -> int:
    """Give every loop the largest chunk that keeps the whole plan within ``target``."""
    for r in regions:
        lo, hi = r.chunk, r.size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            r.chunk = mid
            if simulate_plan(info, regions).peak <= target:
                lo = mid
            else:
                hi = mid - 1
        r.chunk = lo
    return simulate_plan(info, regions).peak


def _drop_tiny_loops(regions: list[Region]) -> list[Region]:
    """Without a budget, give each loop at least ``MIN_LOOP_BYTES`` of work per iteration and
    drop loops that would then run in one piece (tiny models are left alone)."""
    kept = []
    for r in regions:
        if r.row_bytes > 0:
            r.chunk = max(r.chunk, math.ceil(MIN_LOOP_BYTES / r.row_bytes))
        if r.chunk < r.size:
            kept.append(r)
    return kept


def plan_loops(info: GraphInfo, budget: int | None, slack: float, window: int) -> tuple[ChunkPlan, int | None]:
    """The plan for ``budget`` (None: cheap minimum) and the lowest reachable peak if computed."""
    before = simulate_plan(info, []).peak
    if budget is not None and before <= budget:
        return ChunkPlan([], before, "", None), None
    if budget is not None:
        plan = _greedy(info, budget, window)
        if plan.stop is None:
            return plan, None
    lowest = _greedy(info, None, window)
    if budget is None:
        if not lowest.regions:
            return lowest, lowest.peak
        target = int(math.ceil(lowest.peak * (1 + slack)))
        _relax(info, lowest.regions, max(target, lowest.peak))
        regions = _drop_tiny_loops(lowest.regions)
        peak = simulate_plan(info, regions).peak
        stop = None if regions else f"every chunk loop would work on less than {format_bytes(MIN_LOOP_BYTES)}"
        return ChunkPlan(regions, peak, lowest.peak_label, stop), lowest.peak
    if lowest.peak <= budget:
        peak = _relax(info, lowest.regions, budget)
        return ChunkPlan(lowest.regions, peak, lowest.peak_label, None), lowest.peak
    raise Unreachable(lowest)


class Unreachable(Exception):
    """No plan reaches the budget; ``lowest`` is the lowest-peak plan found."""

    def __init__(self, lowest: ChunkPlan) -> None:
        super().__init__(lowest.stop)
        self.lowest = lowest
