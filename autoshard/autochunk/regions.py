"""Finding chunk regions: free-dim analysis of a node range, the memory of a plan, the search.

A *region* is a contiguous range of the graph's call nodes turned into one loop over chunks of a
free dim. Inside the range every node is either *chunked* (computed per chunk, carrying the dim
at a known position) or *hoisted* (does not depend on any chunked node, so it runs once before
the loop). Tensors made before the range are read per chunk (``narrow``) when they carry the dim,
or whole otherwise. Chunked nodes used after the range are the region's outputs: buffers
allocated before the loop and filled chunk by chunk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx

from . import flow
from .flow import NotFree, input_nodes, tensors_of
from .memory import Key, NodeFacts, Simulation, StorageNamer, Unit, simulate, tensor_bytes


class GraphInfo:
    """The call nodes of an exported graph in order, with what the memory model needs."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.nodes = [n for n in graph.nodes if n.op == "call_function"]
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.output = next(n for n in graph.nodes if n.op == "output")
        self.output_nodes = set(self.output.all_input_nodes)
        self._rule_cache: dict[tuple[fx.Node, int, int], flow.Flow | str] = {}
        self.facts = NodeFacts()

    def flow(self, node: fx.Node, d: int, size: int) -> flow.Flow:
        """Cached :func:`.flow.backward`."""
        key = (node, d, size)
        if key not in self._rule_cache:
            try:
                self._rule_cache[key] = flow.backward(node, d, size)
            except NotFree as e:
                self._rule_cache[key] = str(e)
        res = self._rule_cache[key]
        if isinstance(res, str):
            raise NotFree(res)
        return res

    def forward(self, node: fx.Node, src: fx.Node, src_dim: int, size: int) -> int:
        """Output dim of ``node`` that carries ``src_dim`` of input ``src`` (cached rules)."""
        ts = tensors_of(node)
        if not ts:
            raise NotFree(f"{node.name} ({flow.describe_op(node)}) has no tensor output")
        for d in range(ts[0].ndim):
            if ts[0].shape[d] != size:
                continue
            try:
                f = self.flow(node, d, size)
            except NotFree:
                continue
            if f.inputs.get(src, -1) == src_dim:
                return d
        raise NotFree(f"dim {src_dim} of {src.name} does not flow through {node.name} "
                      f"({flow.describe_op(node)})")


@dataclass
class Region:
    """One chunk loop. ``chunk`` is the chunk length; ``row_bytes`` the loop's working set per unit
    of chunk length (so the loop holds about ``chunk * row_bytes`` beyond what lives around it)."""

    start: int
    end: int
    size: int
    dims: dict[fx.Node, int]
    hoisted: list[fx.Node]
    sliced: dict[fx.Node, int]
    whole: set[fx.Node]
    outputs: list[fx.Node]
    size_args: dict[fx.Node, int] = field(default_factory=dict)
    row_bytes: float = 0.0
    chunk: int = 0

    @property
    def chunked(self) -> list[fx.Node]:
        return list(self.dims)

    @property
    def iterations(self) -> int:
        return math.ceil(self.size / self.chunk) if self.chunk else 0

    def describe(self) -> str:
        first, last = self.chunked[0].name, self.chunked[-1].name
        return (f"{len(self.dims)} nodes {first}..{last}, dim of size {self.size}, "
                f"chunk {self.chunk} ({self.iterations} iterations)")


class _Analysis:
    """Propagates one (anchor, dim) through a node range; see :func:`analyse_range`."""

    def __init__(self, info: GraphInfo, start: int, end: int, size: int) -> None:
        self.info, self.start, self.end, self.size = info, start, end, size
        self.dims: dict[fx.Node, int] = {}
        self.size_args: dict[fx.Node, int] = {}
        self.whole_needed: set[fx.Node] = set()
        self.demoted: set[fx.Node] = set()
        self.sliced: dict[fx.Node, int] = {}
        self.whole: set[fx.Node] = set()
        self.queue: list[fx.Node] = []
        self.anchor: fx.Node | None = None

    def in_range(self, n: fx.Node) -> bool:
        i = self.info.index.get(n)
        return i is not None and self.start <= i <= self.end

    def assign(self, n: fx.Node, d: int) -> None:
        if n in self.whole_needed or n in self.demoted:
            raise NotFree(f"{n.name} is needed whole and per chunk")
        if n in self.dims:
            if self.dims[n] != d:
                raise NotFree(f"{n.name} would be chunked along dims {self.dims[n]} and {d}")
            return
        self.dims[n] = d
        self.queue.append(n)

    def read_outside(self, a: fx.Node, d: int | None) -> None:
        if d is None:
            self.whole.add(a)
        elif self.sliced.setdefault(a, d) != d:
            raise NotFree(f"{a.name} is read along dims {self.sliced[a]} and {d}")

    def visit(self, n: fx.Node) -> None:
        try:
            f = self.info.flow(n, self.dims[n], self.size)
        except NotFree:
            if n is self.anchor or any(a in self.dims for a in input_nodes(n)):
                raise
            # nothing chunked feeds n: compute it whole before the loop and slice it per chunk
            d = self.dims.pop(n)
            self.demoted.add(n)
            self.read_outside(n, d)
            return
        if f.size_arg is not None:
            self.size_args[n] = f.size_arg
        for a, ad in f.inputs.items():
            if self.in_range(a) and a not in self.demoted:
                if ad is None:
                    if a in self.dims:
                        raise NotFree(f"{a.name} is chunked but {n.name} needs it whole")
                    self.whole_needed.add(a)
                else:
                    self.assign(a, ad)
            else:
                self.read_outside(a, ad)
        for u in n.users:
            if self.in_range(u):
                self.assign(u, self.info.forward(u, n, self.dims[n], self.size))

    def run(self, anchor: fx.Node, d: int) -> None:
        self.anchor = anchor
        self.assign(anchor, d)
        while self.queue:
            n = self.queue.pop()
            if n in self.dims:
                self.visit(n)


def analyse_range(info: GraphInfo, start: int, end: int, anchor: fx.Node, d: int) -> Region:
    """Chunk dim ``d`` of ``anchor`` through nodes ``start..end``; raises NotFree when impossible."""
    ts = tensors_of(anchor)
    if not ts or ts[0].ndim <= d:
        raise NotFree(f"{anchor.name} has no dim {d}")
    size = int(ts[0].shape[d])
    an = _Analysis(info, start, end, size)
    an.run(anchor, d)
    nodes = info.nodes[start:end + 1]
    dims = {n: an.dims[n] for n in nodes if n in an.dims}
    hoisted = [n for n in nodes if n not in dims]
    for h in hoisted:
        if any(a in dims for a in h.all_input_nodes):
            raise NotFree(f"{h.name} depends on the chunked nodes but is not chunked")
    outputs = [n for n in dims if n in info.output_nodes or any(not an.in_range(u) for u in n.users)]
    for o in outputs:
        if not isinstance(o.meta.get("val"), torch.Tensor):
            raise NotFree(f"{o.name} is used after the region but is not a single tensor")
    if not outputs:
        raise NotFree("the region has no outputs")
    region = Region(start, end, size, dims, hoisted, dict(an.sliced), an.whole | an.whole_needed, outputs,
                    {n: a for n, a in an.size_args.items() if n in dims})
    region.row_bytes = loop_row_bytes(info, region)
    return region


def loop_row_bytes(info: GraphInfo, region: Region) -> float:
    """Peak bytes inside one loop iteration per unit of chunk length (chunked tensors only)."""
    namer = StorageNamer(info.facts)
    for a in list(region.sliced) + list(region.whole):
        namer.name_external(a)
    units: list[Unit] = []
    for n in region.chunked:
        keys, fresh = namer.name(n, lambda i, n=n: ("in", n.name, i))
        nbytes = info.facts.storage_bytes(n)
        defs = {keys[i]: nbytes[i] / region.size for i in fresh}
        units.append(Unit(n.name, defs, namer.uses(n)))  # type: ignore[arg-type]
    out_keys = {k for o in region.outputs for k in namer.keys[o] if k not in namer.external}
    units.append(Unit("write back", {}, out_keys))
    return float(simulate(units, set()).peak)


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
# Search
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
