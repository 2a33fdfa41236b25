"""Chunk regions of AutoChunk: the free-dim analysis that turns a node range into one loop.

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

from ..opinfo import op_name
from .flow import Flow, NotFree, input_nodes, tensors_of
from .memory import NodeFacts, StorageNamer, Unit, simulate
from .rules import backward


class GraphInfo:
    """The call nodes of an exported graph in order, with what the memory model needs."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.nodes = [n for n in graph.nodes if n.op == "call_function"]
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.output = next(n for n in graph.nodes if n.op == "output")
        self.output_nodes = set(self.output.all_input_nodes)
        self._rule_cache: dict[tuple[fx.Node, int, int], Flow | str] = {}
        self.facts = NodeFacts()

    def flow(self, node: fx.Node, d: int, size: int) -> Flow:
        """Cached :func:`.rules.backward`."""
        key = (node, d, size)
        if key not in self._rule_cache:
            try:
                self._rule_cache[key] = backward(node, d, size)
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
            raise NotFree(f"{node.name} ({op_name(node.target)}) has no tensor output")
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
                      f"({op_name(node.target)})")


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
