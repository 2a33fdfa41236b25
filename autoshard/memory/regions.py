"""Memory regions of an annotated graph: each checkpoint or plain offload region as one unbroken run
of nodes, with the values it reads from outside (inputs) and those read after it (outputs)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from torch.fx.node import Node

from .annotations import OFFLOAD_META, MemoryAnnotationError, PlainOffload, checkpoint_path, offload_annotation

__all__ = ["Region", "checkpoint_regions", "plain_offload_regions"]


@dataclass
class Region:
    key: tuple[int, ...]
    nodes: list[Node]
    inputs: list[Node] = dataclasses.field(default_factory=list)
    outputs: list[Node] = dataclasses.field(default_factory=list)


def _contiguous_runs(
    nodes: Sequence[Node], key_of: Callable[[Node], Hashable | None], describe: Callable[[Any], str]
) -> list[tuple[Hashable, list[Node]]]:
    """Maximal runs of nodes with one non-None key; a key may own only one run.

    get_attr nodes are skipped: they are re-created wherever their value is needed.
    """
    runs: list[tuple[Hashable, list[Node]]] = []
    ended: dict[Hashable, tuple[Node, Node]] = {}  # key -> (its last node, the node after it)
    current: Hashable | None = None
    for node in nodes:
        if node.op == "get_attr":
            continue
        key = key_of(node)
        if key is not None and key == current:
            runs[-1][1].append(node)
            continue
        if current is not None:
            ended[current] = (runs[-1][1][-1], node)
        if key is not None:
            if key in ended:
                last, breaker = ended[key]
                raise MemoryAnnotationError(
                    f"{describe(key)} is not contiguous: it stops after node {last.name!r}, node "
                    f"{breaker.name!r} is outside it, and it resumes at node {node.name!r}. "
                    "Annotate one unbroken run of nodes per region."
                )
            runs.append((key, [node]))
        current = key
    return runs


def _fill_io(region: Region) -> Region:
    """Inputs: values from outside read inside (get_attr excepted). Outputs: values read after."""
    members = set(region.nodes)
    for node in region.nodes:
        for arg in node.all_input_nodes:
            if arg not in members and arg.op != "get_attr" and arg not in region.inputs:
                region.inputs.append(arg)
    region.outputs = [n for n in region.nodes if any(u not in members for u in n.users)]
    return region


def checkpoint_regions(nodes: Sequence[Node], level: int) -> list[Region]:
    def key_of(node: Node) -> tuple[int, ...] | None:
        path = checkpoint_path(node)
        return path[: level + 1] if len(path) > level else None

    runs = _contiguous_runs(nodes, key_of, lambda key: f"Checkpoint region {list(key)}")
    return [_fill_io(Region(key, run)) for key, run in runs]


def plain_offload_regions(nodes: Sequence[Node]) -> list[tuple[Region, PlainOffload]]:
    def key_of(node: Node) -> int | None:
        offload = offload_annotation(node)
        return offload.region_id if isinstance(offload, PlainOffload) else None

    result = []
    for key, run in _contiguous_runs(nodes, key_of, lambda key: f"Offload region {key}"):
        spec = offload_annotation(run[0])
        for node in run[1:]:
            if offload_annotation(node) != spec:
                raise MemoryAnnotationError(
                    f"Offload region {key}: node {node.name!r} has {OFFLOAD_META}="
                    f"{node.meta[OFFLOAD_META]!r} but node {run[0].name!r} has "
                    f"{run[0].meta[OFFLOAD_META]!r}; one region needs one set of flags."
                )
        result.append((_fill_io(Region((key,), run)), spec))
    return result
