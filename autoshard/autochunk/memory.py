"""The activation-memory model of AutoChunk: the estimated memory of a program of units.

A program is a sequence of :class:`Unit` s (one aten call, or one chunk loop). Each unit
*defines* storages (new allocations, in bytes) and *uses* storages made earlier. A storage
lives from the unit that defines it to the last unit that uses it (graph outputs live to the
end), exactly like the generated code, which deletes every name after its last use. The memory
while a unit runs is everything still live + what it defines + its ``transient`` (the working
set of a chunk loop). Parameters, buffers and the caller's inputs are not counted: the model
holds them whether or not we chunk.

Views share their input's storage: a node whose fake tensor (``node.meta['val']``) has the
same storage as one of its inputs' fake tensors defines nothing and keeps that storage alive.

(:mod:`.measure` measures the real peak, to check this estimate.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch
from torch import fx

from .flow import input_nodes, tensors_of

Key = Hashable


def storage_id(t: torch.Tensor) -> int:
    """Identity of a (fake) tensor's storage; views share it with their base."""
    return t.untyped_storage()._cdata


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a dense tensor with this shape and dtype (what a fresh allocation needs)."""
    return t.numel() * t.element_size()


@dataclass
class Unit:
    """One step of a program: a node, or a whole chunk loop (``region`` set)."""

    label: str
    defs: dict[Key, int] = field(default_factory=dict)
    uses: set[Key] = field(default_factory=set)
    transient: int = 0
    node: fx.Node | None = None
    region: int | None = None


@dataclass
class Simulation:
    """Per-unit memory (bytes) while each unit runs, and the peak."""

    units: list[Unit]
    during: list[int]
    live_after: list[set[Key]]

    @property
    def peak(self) -> int:
        return max(self.during, default=0)

    @property
    def argmax(self) -> int:
        return max(range(len(self.during)), key=self.during.__getitem__) if self.during else -1

    def live_during(self, i: int) -> set[Key]:
        """Storages held while unit ``i`` runs (live before it plus what it defines)."""
        before = self.live_after[i - 1] if i > 0 else set()
        return before | set(self.units[i].defs)


def simulate(units: list[Unit], outputs: set[Key]) -> Simulation:
    """Walk the units, freeing each storage after its last use; ``outputs`` never die."""
    last: dict[Key, float] = {}
    size: dict[Key, int] = {}
    for i, u in enumerate(units):
        for k, b in u.defs.items():
            size[k] = b
            last[k] = max(last.get(k, i), i)
        for k in u.uses:
            if k in last:
                last[k] = i
    for k in outputs:
        if k in last:
            last[k] = math.inf
    live: set[Key] = set()
    total = 0
    during: list[int] = []
    live_after: list[set[Key]] = []
    for i, u in enumerate(units):
        new = sum(u.defs.values())
        during.append(total + new + u.transient)
        live |= set(u.defs)
        total += new
        dead = {k for k in live if last[k] <= i}
        total -= sum(size[k] for k in dead)
        live -= dead
        live_after.append(set(live))
    return Simulation(units, during, live_after)


class StorageNamer:
    """Gives every tensor of every node a storage key that follows views through the graph.

    A tensor whose fake storage equals the fake storage of one of the node's inputs inherits that
    input's key; any other tensor gets a fresh key. Keys can be overridden per node (the output
    buffers of a chunk loop), and anything derived from an ``external`` node stays external.
    """

    def __init__(self, facts: "NodeFacts | None" = None) -> None:
        self.keys: dict[fx.Node, list[Key]] = {}
        self.external: set[Key] = set()
        self.facts = facts or NodeFacts()

    def name_external(self, node: fx.Node) -> None:
        self.keys[node] = [("ext", node.name, i) for i in range(len(self.facts.tensors(node)))]
        self.external.update(self.keys[node])

    def set(self, node: fx.Node, keys: list[Key]) -> None:
        self.keys[node] = keys

    def name(self, node: fx.Node, fresh: Callable[[int], Key]) -> tuple[list[Key], list[int]]:
        """Keys for ``node``'s tensors and the indices of the fresh (newly allocated) ones."""
        by_storage: dict[int, Key] = {}
        facts = self.facts
        for a in facts.inputs(node):
            if a not in self.keys:
                continue
            for sid, k in zip(facts.storages(a), self.keys[a]):
                by_storage.setdefault(sid, k)
        keys: list[Key] = []
        fresh_idx: list[int] = []
        for i, sid in enumerate(facts.storages(node)):
            if sid in by_storage:
                keys.append(by_storage[sid])
            else:
                keys.append(fresh(i))
                fresh_idx.append(i)
        self.keys[node] = keys
        return keys, fresh_idx

    def uses(self, node: fx.Node) -> set[Key]:
        """Non-external keys read by ``node``."""
        out: set[Key] = set()
        for a in self.facts.inputs(node):
            out.update(k for k in self.keys.get(a, ()) if k not in self.external)
        return out


class NodeFacts:
    """Memoised per-node facts the memory model reads again and again."""

    def __init__(self) -> None:
        self._tensors: dict[fx.Node, list[torch.Tensor]] = {}
        self._inputs: dict[fx.Node, list[fx.Node]] = {}
        self._storages: dict[fx.Node, list[int]] = {}
        self._nbytes: dict[fx.Node, list[int]] = {}

    def tensors(self, n: fx.Node) -> list[torch.Tensor]:
        if n not in self._tensors:
            self._tensors[n] = tensors_of(n)
        return self._tensors[n]

    def inputs(self, n: fx.Node) -> list[fx.Node]:
        """Distinct tensor input nodes."""
        if n not in self._inputs:
            self._inputs[n] = list(dict.fromkeys(input_nodes(n)))
        return self._inputs[n]

    def storages(self, n: fx.Node) -> list[int]:
        if n not in self._storages:
            self._storages[n] = [storage_id(t) for t in self.tensors(n)]
        return self._storages[n]

    def storage_bytes(self, n: fx.Node) -> list[int]:
        """Storage size of each tensor of ``n`` (a fresh tensor's allocation)."""
        if n not in self._nbytes:
            self._nbytes[n] = [t.untyped_storage().nbytes() for t in self.tensors(n)]
        return self._nbytes[n]
