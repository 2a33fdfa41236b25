"""The memory annotations of FX nodes: their keys, what they may hold, and their validation.

:func:`~.codegen.apply_memory_annotations` reads two keys of ``node.meta``:

``activation_checkpoint``
    An int region id, or a list of ints for nested regions (outermost first): ``[0]`` is
    region 0, ``[0, 1]`` is region 1 inside region 0. Each region must be one unbroken run of
    nodes in graph order. A region becomes a submodule (``self.checkpoint_0``, nested ones
    ``self.checkpoint_0.checkpoint_0_1``) called through
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: its activations are dropped
    after the forward and recomputed in backward.

``activation_offload``
    ``True`` on a checkpointed node: the inputs that its outermost checkpoint region saves for
    recomputation go to host memory, via ``torch.autograd.graph.save_on_cpu``.
    ``[region_id, offload_input, offload_rest]`` on un-checkpointed nodes: a plain offload region
    (again one unbroken run per id) run inside
    ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``. ``offload_input`` moves the saved
    tensors that are (views of) the region's inputs to host, ``offload_rest`` moves every other
    saved activation. Parameters are never moved; tensors that stay are handed to whatever saved
    tensor hooks were active outside the region (e.g. a :class:`SavedTensorMeter`).

The runtime sets two more on the graphs it lowers: :data:`PARTITION_META` (with
:data:`PARTITION_AXES_META`) and ``STATE_META`` (:mod:`.module_state`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx
from torch.fx.node import Node

__all__ = ["CHECKPOINT_META", "OFFLOAD_META", "PARTITION_AXES_META", "PARTITION_META", "MemoryAnnotationError",
           "PlainOffload", "checkpoint_path", "offload_annotation", "validate_annotations"]

CHECKPOINT_META = "activation_checkpoint"
OFFLOAD_META = "activation_offload"

PARTITION_META = "activation_partition"
"""On checkpointed nodes (set by the runtime): keep the region's replicated inputs partitioned over
the mesh (see :mod:`autoshard.runtime.partition`); each region input carries its replicated mesh
axes in ``meta[PARTITION_AXES_META]``, and the root module holds the mesh ``comm``."""
PARTITION_AXES_META = "partition_axes"


class MemoryAnnotationError(ValueError):
    """A malformed ``activation_checkpoint`` / ``activation_offload`` annotation."""


@dataclass(frozen=True)
class PlainOffload:
    region_id: int
    offload_inputs: bool
    offload_rest: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checkpoint_path(node: Node) -> tuple[int, ...]:
    """The node's checkpoint labels, outermost first; ``()`` when not checkpointed."""
    label = node.meta.get(CHECKPOINT_META)
    if label is None:
        return ()
    if _is_int(label):
        return (label,)
    if isinstance(label, (list, tuple)) and label and all(_is_int(x) for x in label):
        return tuple(label)
    raise MemoryAnnotationError(
        f"Node {node.name!r}: {CHECKPOINT_META}={label!r} must be an int region id or a non-empty "
        "list of ints (outermost region first)."
    )


def offload_annotation(node: Node) -> bool | PlainOffload:
    """``True`` (offload checkpoint inputs), a plain offload region, or ``False``."""
    label = node.meta.get(OFFLOAD_META, False)
    if isinstance(label, bool):
        return label
    if (isinstance(label, (list, tuple)) and len(label) == 3 and _is_int(label[0])
            and isinstance(label[1], bool) and isinstance(label[2], bool)):
        spec = PlainOffload(label[0], label[1], label[2])
        if not (spec.offload_inputs or spec.offload_rest):
            raise MemoryAnnotationError(
                f"Node {node.name!r}: {OFFLOAD_META}={label!r} offloads nothing; drop the "
                "annotation or set offload_input and/or offload_rest."
            )
        return spec
    raise MemoryAnnotationError(
        f"Node {node.name!r}: {OFFLOAD_META}={label!r} must be True (on a checkpointed node) or "
        "[region_id: int, offload_input: bool, offload_rest: bool]."
    )


def validate_annotations(graph: fx.Graph) -> None:
    for node in graph.nodes:
        path = checkpoint_path(node)
        offload = offload_annotation(node)
        annotated = bool(path) or offload is not False
        if annotated and node.op in ("placeholder", "output"):
            raise MemoryAnnotationError(
                f"Node {node.name!r} is a graph {node.op}; only computation nodes can be in a "
                "checkpoint or offload region. Remove its annotation."
            )
        if offload is True and not path:
            raise MemoryAnnotationError(
                f"Node {node.name!r} has {OFFLOAD_META}=True but no {CHECKPOINT_META} region to "
                f"offload the inputs of. Add {CHECKPOINT_META}, or use [region_id, offload_input, "
                "offload_rest] for a plain offload region."
            )
        if isinstance(offload, PlainOffload) and path:
            raise MemoryAnnotationError(
                f"Node {node.name!r} is in checkpoint region {list(path)} and also in plain offload "
                f"region {offload.region_id}. A checkpoint region keeps only its inputs; use "
                f"{OFFLOAD_META}=True to offload those."
            )
