"""Resharding: the cost-minimal sequence of moves turning one ShardSpec into another.

States are all specs (partial ones included) that fit the tensor's shape on the mesh. From a spec,
for each mesh axis ``a`` (``n_a`` devices), the moves are:

- ``all_gather``: un-shard dim ``d`` over ``a``, where ``a`` is the innermost (last) axis of ``d``
  (``S01 -> S0`` gathers axis 1; axis 0 cannot be gathered out of ``S01`` directly).
  Bytes: the gathered local shard, ``local * n_a``.
- ``split``: shard dim ``d`` over an unused axis ``a`` appended innermost, only if ``a`` is larger
  than every axis already on ``d`` (so ``S0 -> S01``, never ``S1 -> S10``). Local slicing.
- ``all_to_all``: move ``a`` from innermost on ``d1`` to innermost on ``d2`` (same ascending
  rule on ``d2``). Bytes: the local shard.
- ``all_reduce``: finish the pending sum over a partial axis ``a`` (``P_a -> replicated on a``).
  Bytes: the local shard.
- ``reduce_scatter``: finish the pending sum over partial ``a`` and shard dim ``d`` over ``a``
  (appended innermost, ascending rule). Bytes: the local shard before scattering.
- ``to_partial``: make an unused axis ``a`` partial: the coordinate 0 of ``a`` keeps the value,
  the others hold zeros. Local; it makes partial targets reachable.

A move costs its collective (:mod:`autoshard.comm_cost`, bytes by its convention, from the local
shard of the CURRENT spec) plus the local copies the runtime makes around it
(:class:`~autoshard.runtime.collectives.MeshComm`), each one memory-bound pass
(:meth:`~autoshard.hardware.HardwareProfile.copy_seconds`, at the rate of its contiguous runs): a
gather or a split along a dim that is not the shard's outermost non-trivial one lays the shard out
contiguously (a split: its slice; a gather: the gathered blocks concatenated along the dim; along the
outermost one a gather's result is a view, and a split's a view, which costs what an op costs to
dispatch, :meth:`~autoshard.hardware.HardwareProfile.dispatch_seconds`, so that of two plans
otherwise alike the one that runs fewer ops is the cheaper), an all-to-all stacks its blocks and
concatenates what it gets, a reduce-scatter stacks its blocks, an all-reduce runs on a clone, a
partial axis starts from a clone or zeros. All moves have non-negative cost, so Dijkstra finds the optimum; ties in cost are
broken by fewer steps. Every fitting spec is reachable from every other (all-reduce the partial
axes and gather innermost-first down to replicated; then make the target's partial axes and split
its axes outer-first), so an unreachable target means it does not fit.

The search runs once per (shape, dtype, mesh shape, the prices of the profile it reads) key: a
Dijkstra from every state gives an all-pairs table, which is cached; later queries are dictionary
lookups.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from .comm_cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, Collective, collective_cost
from .hardware import HardwareProfile, LinkModel
from .specs import ShardSpec, SpecError, all_specs
from .units import format_bytes

SPLIT = "split"
TO_PARTIAL = "to_partial"
MOVE_KINDS = (ALL_GATHER, SPLIT, ALL_TO_ALL, ALL_REDUCE, REDUCE_SCATTER, TO_PARTIAL)
_LOCAL_KINDS = (SPLIT, TO_PARTIAL)


class ReshardError(ValueError):
    """A resharding that is impossible: a spec does not fit the shape/mesh, or no path exists."""


@dataclass(frozen=True)
class ReshardStep:
    """One move. ``dims``: ``(d,)`` for all_gather/split/reduce_scatter, ``(from, to)`` for
    all_to_all, ``()`` for all_reduce/to_partial. ``nbytes`` per device, comm_cost.py convention."""

    kind: str
    axis: int
    dims: tuple[int, ...]
    nbytes: int
    cost: float
    after: ShardSpec

    @property
    def collective(self) -> Collective | None:
        """The collective this step runs, or None for a local move."""
        if self.kind in _LOCAL_KINDS:
            return None
        return Collective(self.kind, (self.axis,), self.nbytes)

    def __str__(self) -> str:
        args = [f"axis={self.axis}"]
        if self.kind == ALL_TO_ALL:
            args.append(f"dim {self.dims[0]}->{self.dims[1]}")
        elif self.dims:
            args.append(f"dim={self.dims[0]}")
        if self.kind not in _LOCAL_KINDS:
            args += [format_bytes(self.nbytes), _fmt_seconds(self.cost)]
        return f"{self.kind}({', '.join(args)})"


@dataclass(frozen=True)
class ReshardPlan:
    """Cost-minimal move sequence from ``src`` to ``dst``; ``cost`` in seconds."""

    src: ShardSpec
    dst: ShardSpec
    steps: tuple[ReshardStep, ...]
    cost: float

    def collectives(self) -> list[Collective]:
        return [c for c in (s.collective for s in self.steps) if c is not None]

    def __str__(self) -> str:
        if not self.steps:
            return f"{self.src} -> {self.dst}: no-op"
        moves = "; ".join(str(s) for s in self.steps)
        return f"{self.src} -> {self.dst} ({_fmt_seconds(self.cost)}): {moves}"


def _fmt_seconds(t: float) -> str:
    return f"{t * 1e6:.3g} us" if t < 1e-3 else f"{t * 1e3:.3g} ms"


# -- the state graph -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Problem:
    """What the costs of one state graph depend on."""

    shape: tuple[int, ...]
    itemsize: int
    mesh_shape: tuple[int, ...]
    hw: HardwareProfile
    dtype: str | None = None       # prices local copies by the profile's measured rate of this dtype


def _appendable(spec: ShardSpec, axis: int, dim: int) -> bool:
    """May ``axis`` become the innermost axis of ``dim`` (ascending order kept)?"""
    d = spec.dims[dim]
    return not d or d[-1] < axis


def _strided(shape: Sequence[int], dim: int) -> bool:
    """Is a slice along ``dim`` of a contiguous tensor of ``shape`` strided (a copy to lay out)?"""
    return math.prod(shape[:dim]) > 1


def _run(shape: Sequence[int], dim: int, parts: int = 1) -> int:
    """Elements per contiguous run of one of ``parts`` blocks along ``dim`` of a contiguous tensor
    of ``shape`` (what a copy laying that block out, or concatenating such blocks, moves at a time)."""
    return max(1, shape[dim] // parts) * math.prod(shape[dim + 1:])


def _moves(spec: ShardSpec, p: _Problem) -> Iterator[ReshardStep]:
    """Every move out of ``spec`` (targets not yet checked for fitting), priced with its copies."""
    shape = spec.local_shape(p.shape, p.mesh_shape)
    local = math.prod(shape) * p.itemsize

    def copies(*passes: tuple[float, int | None]) -> float:
        """Local copies of (bytes, elements per contiguous run; None: one block) each."""
        return sum(p.hw.copy_seconds(b, p.dtype, run) for b, run in passes)

    def comm(kind: str, axis: int, dims: tuple[int, ...], nbytes: int, after: ShardSpec, copied: float) -> ReshardStep:
        cost = collective_cost(kind, nbytes, (axis,), p.mesh_shape, p.hw) + copied
        return ReshardStep(kind, axis, dims, nbytes, cost, after)

    for a in range(len(p.mesh_shape)):
        n = p.mesh_shape[a]
        d = spec.axis_dim(a)
        targets = [t for t in range(spec.ndim) if t != d and _appendable(spec, a, t)]
        if a in spec.partial:
            done = spec.with_partial(set(spec.partial) - {a})
            yield comm(ALL_REDUCE, a, (), local, done, copies((local, None)))
            for t in targets:     # the n blocks along t stacked one after another
                yield comm(REDUCE_SCATTER, a, (t,), local, done.with_dim(t, spec.dims[t] + (a,)),
                           copies((local, _run(shape, t, n))))
        elif d is None:
            for t in targets:
                cost = copies((local / n, _run(shape, t, n))) if _strided(shape, t) else p.hw.dispatch_seconds()
                yield ReshardStep(SPLIT, a, (t,), 0, cost, spec.with_dim(t, spec.dims[t] + (a,)))
            yield ReshardStep(TO_PARTIAL, a, (), 0, copies((local, None)), spec.with_partial(spec.partial + (a,)))
        elif spec.dims[d][-1] == a:
            gathered = spec.with_dim(d, spec.dims[d][:-1])
            # the gathered blocks concatenated along d (a view where d is the outermost non-trivial dim)
            laid_out = copies((local * n, _run(shape, d))) if _strided(shape, d) else 0.0
            yield comm(ALL_GATHER, a, (d,), local * n, gathered, laid_out)
            for t in targets:     # this shard's n blocks along t stacked; the n received ones concatenated along d
                piece = [s // n if i == t else s for i, s in enumerate(shape)]
                yield comm(ALL_TO_ALL, a, (d, t), local, gathered.with_dim(t, spec.dims[t] + (a,)),
                           copies((local, _run(shape, t, n)), (local, _run(piece, d))))


class ReshardTable:
    """All-pairs cost-minimal resharding between the fitting specs of one tensor on one mesh."""

    def __init__(self, p: _Problem) -> None:
        self.shape, self.itemsize, self.mesh_shape = p.shape, p.itemsize, p.mesh_shape
        self.states: tuple[ShardSpec, ...] = tuple(
            s for s in all_specs(len(p.shape), len(p.mesh_shape), with_partial=True)
            if s.fits(p.shape, p.mesh_shape))
        self.index: dict[ShardSpec, int] = {s: i for i, s in enumerate(self.states)}
        edges = [[(self.index[m.after], m) for m in _moves(s, p) if m.after in self.index]
                 for s in self.states]
        self._plans: dict[tuple[int, int], ReshardPlan] = {}
        self._dist: list[list[float]] = []
        self._prev: list[list[tuple[int, ReshardStep] | None]] = []
        for i in range(len(self.states)):
            dist, prev = _dijkstra(i, edges)
            self._dist.append(dist)
            self._prev.append(prev)

    def _idx(self, spec: ShardSpec, role: str) -> int:
        i = self.index.get(spec)
        if i is not None:
            return i
        try:
            spec.check(self.shape, self.mesh_shape)
        except SpecError as e:
            raise ReshardError(f"cannot reshard: {role} spec {spec} does not fit: {e}") from None
        raise ReshardError(f"cannot reshard: {role} spec {spec} is not a state of shape {self.shape} "
                           f"on mesh {self.mesh_shape}")

    def cost(self, src: ShardSpec, dst: ShardSpec) -> float:
        """Seconds of the cheapest resharding from ``src`` to ``dst``."""
        i, j = self._idx(src, "source"), self._idx(dst, "target")
        c = self._dist[i][j]
        if c == float("inf"):
            raise ReshardError(f"no resharding path from {src} to {dst} for shape {self.shape}")
        return c

    def plan(self, src: ShardSpec, dst: ShardSpec) -> ReshardPlan:
        """The cheapest move sequence from ``src`` to ``dst`` (memoised)."""
        cost = self.cost(src, dst)
        key = (self.index[src], self.index[dst])
        if key not in self._plans:
            self._plans[key] = self._walk_back(src, dst, cost)
        return self._plans[key]

    def _walk_back(self, src: ShardSpec, dst: ShardSpec, cost: float) -> ReshardPlan:
        i, j = self.index[src], self.index[dst]
        steps: list[ReshardStep] = []
        while j != i:
            prev = self._prev[i][j]
            assert prev is not None  # finite distance implies a predecessor chain
            j, step = prev
            steps.append(step)
        return ReshardPlan(src, dst, tuple(reversed(steps)), cost)


def _dijkstra(src: int, edges: list[list[tuple[int, ReshardStep]]]
              ) -> tuple[list[float], list[tuple[int, ReshardStep] | None]]:
    """Shortest paths by (cost, number of steps) from ``src``; returns distances and predecessors."""
    n = len(edges)
    best: list[tuple[float, int]] = [(float("inf"), 0)] * n
    prev: list[tuple[int, ReshardStep] | None] = [None] * n
    best[src] = (0.0, 0)
    heap = [(0.0, 0, src)]
    done = [False] * n
    while heap:
        cost, nsteps, u = heapq.heappop(heap)
        if done[u]:
            continue
        done[u] = True
        for v, step in edges[u]:
            cand = (cost + step.cost, nsteps + 1)
            if cand < best[v]:
                best[v] = cand
                prev[v] = (u, step)
                heapq.heappush(heap, (cand[0], cand[1], v))
    return [b[0] for b in best], prev


# -- public API ------------------------------------------------------------------------------------
# Tables keyed by (shape, itemsize, mesh shape, dtype, what of the profile the prices read). A plain
# dict, not lru_cache, because HardwareProfile holds dicts and is unhashable; the fast path must stay
# a single tuple lookup (the cost graph asks for millions of pairs).
_TABLES: dict[tuple, ReshardTable] = {}


def replay_moves(src: "ShardSpec | str", moves: Sequence[tuple[str, int, Sequence[int]]], shape: Sequence[int],
                 mesh_shape: Sequence[int]) -> ShardSpec:
    """The spec ``moves`` (each ``(kind, axis, dims)``, as :class:`ReshardStep` has them) turn ``src``
    into, applying each as the resharding search defines it; :class:`ReshardError` naming the first
    move that is not valid from the spec it is applied to (an unknown kind, an axis the mesh lacks,
    a dim the move cannot take, a layout the shape does not divide)."""
    p = _problem(shape, 1, mesh_shape, _replay_profile())
    spec = _spec(src)
    if not spec.fits(p.shape, p.mesh_shape):
        raise ReshardError(f"spec {spec} does not fit shape {list(p.shape)} on mesh {list(p.mesh_shape)}")
    for i, (kind, axis, dims) in enumerate(moves):
        if kind not in MOVE_KINDS:
            raise ReshardError(f"move {i} is {kind!r}, not one of {', '.join(MOVE_KINDS)}")
        found = [m for m in _moves(spec, p) if m.kind == kind and m.axis == axis and m.dims == tuple(dims)]
        if not found or not found[0].after.fits(p.shape, p.mesh_shape):
            valid = ", ".join(f"{m.kind}(axis={m.axis}, dims={list(m.dims)})" for m in _moves(spec, p)
                              if m.after.fits(p.shape, p.mesh_shape))
            raise ReshardError(f"move {i} {kind}(axis={axis}, dims={list(dims)}) cannot be applied to {spec} "
                               f"(shape {list(p.shape)}, mesh {list(p.mesh_shape)}); valid moves from there: {valid}")
        spec = found[0].after
    return spec


@functools.lru_cache(maxsize=1)
def _replay_profile() -> HardwareProfile:
    """A stand-in profile for :func:`replay_moves`, which needs the moves, not their costs."""
    link = LinkModel(1e-6, 1e-9)
    return HardwareProfile(name="replay", axes=(link, link), peak_flops={"float32": 1e12}, memory_bandwidth=1e12,
                           memory_per_device=2**40, host_device_bandwidth=1e10)


def clear_reshard_cache() -> None:
    """Forget every cached resharding table."""
    _TABLES.clear()


def _spec(spec: "ShardSpec | str") -> ShardSpec:
    return spec if isinstance(spec, ShardSpec) else ShardSpec.parse(spec)


def reshard_table(shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int],
                  hw: HardwareProfile, dtype: str | None = None) -> ReshardTable:
    """The cached all-pairs table for one tensor shape, element size, mesh and hardware; ``dtype``
    (a dtype name) prices the moves' local copies by the profile's measured rate, None by its
    memory bandwidth."""
    key = (tuple(shape), itemsize, tuple(mesh_shape), dtype, hw.link_pricing_key(), hw.copy_pricing_key(dtype))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = ReshardTable(_problem(shape, itemsize, mesh_shape, hw, dtype))
    return table


def _problem(shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int], hw: HardwareProfile,
             dtype: str | None = None) -> _Problem:
    if int(itemsize) != itemsize or itemsize <= 0:
        raise ReshardError(f"itemsize must be a positive byte count, got {itemsize}")
    if any(int(s) != s or s < 0 for s in shape):
        raise ReshardError(f"shape must be non-negative ints, got {tuple(shape)}")
    if len(hw.axes) < len(mesh_shape):
        raise ReshardError(f"hardware profile {hw.name!r} has {len(hw.axes)} axes, mesh {tuple(mesh_shape)} "
                           f"needs {len(mesh_shape)}")
    return _Problem(tuple(int(s) for s in shape), int(itemsize), tuple(int(m) for m in mesh_shape), hw,
                    None if dtype is None else dtype.removeprefix("torch."))


def reshard_plan(src: "ShardSpec | str", dst: "ShardSpec | str", shape: Sequence[int], itemsize: int,
                 mesh_shape: Sequence[int], hw: HardwareProfile, dtype: str | None = None) -> ReshardPlan:
    """Cheapest move sequence turning ``src`` into ``dst`` (memoised; ``dtype``: see :func:`reshard_table`)."""
    return reshard_table(shape, itemsize, mesh_shape, hw, dtype).plan(_spec(src), _spec(dst))


def reshard_cost(src: "ShardSpec | str", dst: "ShardSpec | str", shape: Sequence[int], itemsize: int,
                 mesh_shape: Sequence[int], hw: HardwareProfile, dtype: str | None = None) -> float:
    """Seconds of the cheapest resharding from ``src`` to ``dst`` (memoised; ``dtype``: see
    :func:`reshard_table`)."""
    return reshard_table(shape, itemsize, mesh_shape, hw, dtype).cost(_spec(src), _spec(dst))
