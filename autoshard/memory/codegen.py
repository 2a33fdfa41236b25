"""Activation checkpoint / offload annotations on FX nodes -> regenerated, readable code.

:func:`apply_memory_annotations` reads two keys of ``node.meta``:

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

FX graphs cannot hold ``with`` blocks, so the regenerated graph carries them as node metadata and
a small :class:`torch.fx.graph.CodeGen` subclass writes them into ``.code``. The returned module
shares parameters and submodules with the input; its state-dict keys for weights used inside
checkpoint regions gain the region prefix (``checkpoint_0.linear1.weight``). Graph passes that
rebuild nodes (DCE, ``node.replace_all_uses_with``...) do not know about the ``with`` blocks: run
them before, not after, this function. Pickling the result re-traces the code and loses the blocks.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
import torch.utils.checkpoint
from torch import fx, nn
from torch.fx.graph import CodeGen
from torch.fx.node import Node

from .param_flag import PARAMETER_FLAG, is_parameter_like

__all__ = [
    "CHECKPOINT_META",
    "HOST_OFFLOAD_COUNTER",
    "OFFLOAD_META",
    "HostOffloadCounter",
    "HostOffloadHooks",
    "HostOffloadRegion",
    "MemoryAnnotationError",
    "apply_memory_annotations",
    "delegate_pack",
    "delegate_unpack",
    "is_parameter_like",
    "outer_saved_tensors_hooks",
]

CHECKPOINT_META = "activation_checkpoint"
OFFLOAD_META = "activation_offload"
# Set on nodes of the regenerated graph that must be emitted inside a `with` block.
_WITH_BLOCK_META = "autoshard_with_block"


class MemoryAnnotationError(ValueError):
    """A malformed ``activation_checkpoint`` / ``activation_offload`` annotation."""


# --------------------------------------------------------------------------------------------
# Host offload runtime (what the generated code calls)
# --------------------------------------------------------------------------------------------


class HostOffloadCounter:
    """Process-wide tally of the host copies made by :class:`HostOffloadHooks`.

    ``packed_tensors`` / ``packed_bytes`` only grow; ``live_bytes`` drops when a host copy is freed
    (its saved tensor was released by autograd). :class:`SavedTensorMeter` reads deltas of these.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.packed_tensors = 0
        self.packed_bytes = 0
        self.live_bytes = 0

    def _add(self, nbytes: int) -> None:
        with self._lock:
            self.packed_tensors += 1
            self.packed_bytes += nbytes
            self.live_bytes += nbytes

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes

    def snapshot(self) -> tuple[int, int, int]:
        """``(packed_tensors, packed_bytes, live_bytes)`` read atomically."""
        with self._lock:
            return self.packed_tensors, self.packed_bytes, self.live_bytes


HOST_OFFLOAD_COUNTER = HostOffloadCounter()

_OFFLOAD_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _offload_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _OFFLOAD_STREAMS:
        _OFFLOAD_STREAMS[device] = torch.cuda.Stream(device)
    return _OFFLOAD_STREAMS[device]


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, some tensor subclasses
        return None


def outer_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost ``(pack, unpack)`` saved tensor hooks active now, or None.

    Hooks do not compose in PyTorch (only the innermost pair runs), so our hooks capture the pair
    that was active when they were created and pass on the tensors they do not keep themselves.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


class _Delegated:
    """A saved tensor handed to the saved tensor hooks that were active outside ours."""

    __slots__ = ("payload", "unpack")

    def __init__(self, payload: Any, unpack: Callable[[Any], torch.Tensor]) -> None:
        self.payload = payload
        self.unpack = unpack


def delegate_pack(outer: tuple[Callable, Callable] | None, t: torch.Tensor) -> Any:
    """Pack ``t`` with the outer hooks, or keep it when there are none.

    Kept tensors are detached: when ``t`` is an output of the op saving it, holding ``t`` itself
    would make a reference cycle through its ``grad_fn`` that Python's GC cannot see (the graph
    would never be freed). Autograd restores the autograd metadata on unpack.
    """
    if outer is None:
        return t.detach()
    pack, unpack = outer
    return _Delegated(pack(t), unpack)


def delegate_unpack(packed: Any) -> torch.Tensor:
    """Inverse of :func:`delegate_pack`."""
    return packed.unpack(packed.payload) if isinstance(packed, _Delegated) else packed


class _HostCopy:
    """Host copy of one saved tensor; gives the device tensor back on :meth:`restore`."""

    __slots__ = ("device", "host", "copied", "prefetched", "prefetch_done", "source", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.device = t.device
        # The tensor that owns the memory: ops often save a fresh view of a live value (linear saves
        # its input reshaped to 2D), and that view object dies once packed, while its base lives on.
        self.source = weakref.ref(t._base if t._base is not None else t)
        self.prefetched: torch.Tensor | None = None
        self.prefetch_done: torch.cuda.Event | None = None
        self.copied: torch.cuda.Event | None = None
        if t.device.type == "cuda":
            # Pinned buffer + side stream: the copy overlaps the rest of the forward.
            # empty_like keeps the strides of dense tensors, so restore() gives the same layout.
            self.host = torch.empty_like(t, device="cpu", pin_memory=True)
            stream = _offload_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
                self.copied = stream.record_event()
            # The caching allocator must not hand t's memory out again before the copy has read it.
            t.record_stream(stream)
        else:
            # On CPU this "offload" gains nothing, but it is a real copy (the original storage can
            # be freed), so byte accounting and tests mean the same thing as on CUDA.
            self.host = torch.empty_like(t, device="cpu")
            self.host.copy_(t)
        nbytes = self.host.untyped_storage().nbytes()
        HOST_OFFLOAD_COUNTER._add(nbytes)
        weakref.finalize(self, HOST_OFFLOAD_COUNTER._release, nbytes)

    def prefetch(self) -> None:
        """Start the copy back to the device on the side stream (CUDA only)."""
        if self.device.type != "cuda" or self.prefetched is not None:
            return
        stream = _offload_stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self.copied)
            self.prefetched = self.host.to(self.device, non_blocking=True)
            self.prefetch_done = stream.record_event()

    def restore(self) -> torch.Tensor:
        """The saved tensor on its original device."""
        if self.device.type != "cuda":
            return self.host
        current = torch.cuda.current_stream(self.device)
        if self.prefetched is not None:
            current.wait_event(self.prefetch_done)
            # Allocated on the side stream, used on this one: keep the allocator from reusing it early.
            self.prefetched.record_stream(current)
            return self.prefetched
        current.wait_event(self.copied)
        return self.host.to(self.device, non_blocking=True)


class HostOffloadHooks:
    """Pack/unpack hooks for one run of a plain offload region (see module docstring).

    Tensors saved more than once (same data, shape, strides and version) are copied once.
    """

    def __init__(self, inputs: Iterable[Any], offload_inputs: bool, offload_rest: bool) -> None:
        self.offload_inputs = offload_inputs
        self.offload_rest = offload_rest
        self._input_storages = {
            p for t in inputs if isinstance(t, torch.Tensor) and (p := _storage_ptr(t)) is not None
        }
        self._copies: weakref.WeakValueDictionary[Hashable, _HostCopy] = weakref.WeakValueDictionary()
        self._outer = outer_saved_tensors_hooks()
        self._prefetch_armed = False

    def wants(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes to host under this region's policy."""
        if t.layout != torch.strided or t.device.type not in ("cpu", "cuda") or is_parameter_like(t):
            return False
        if _storage_ptr(t) in self._input_storages:
            return self.offload_inputs
        return self.offload_rest

    def pack(self, t: torch.Tensor) -> Any:
        """``saved_tensors_hooks`` pack hook."""
        if not self.wants(t):
            return delegate_pack(self._outer, t)
        key = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version)
        host_copy = self._copies.get(key)
        # Once the tensor owning the memory a copy was made from is freed, that memory (and so the
        # key) can belong to a new tensor: a copy only stands for tensors saved while it is alive.
        if host_copy is None or host_copy.source() is None:
            host_copy = _HostCopy(t)
            self._copies[key] = host_copy
        return host_copy

    def unpack(self, packed: Any) -> torch.Tensor:
        """``saved_tensors_hooks`` unpack hook."""
        if isinstance(packed, _HostCopy):
            return packed.restore()
        return delegate_unpack(packed)

    def prefetch(self) -> None:
        """Start copying every live host copy of this region back to the device."""
        for host_copy in list(self._copies.values()):
            host_copy.prefetch()

    def prefetch_on_backward(self, *outputs: Any) -> None:
        """Prefetch once the gradient of any region output is computed, i.e. just before the
        region's own backward runs. A no-op for CPU tensors."""
        if self._prefetch_armed:
            return
        cuda_outputs = [
            t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad and t.is_cuda
        ]
        if not cuda_outputs:
            return
        self._prefetch_armed = True
        fired = [False]

        def on_grad(_: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                self.prefetch()

        for t in cuda_outputs:
            t.register_hook(on_grad)


class HostOffloadRegion(nn.Module):
    """Offload policy of one plain offload region; calling it with the region's inputs returns
    fresh :class:`HostOffloadHooks` for that run."""

    def __init__(self, region_id: int, offload_inputs: bool, offload_rest: bool) -> None:
        super().__init__()
        self.region_id = region_id
        self.offload_inputs = offload_inputs
        self.offload_rest = offload_rest

    def forward(self, *inputs: Any) -> HostOffloadHooks:
        return HostOffloadHooks(inputs, self.offload_inputs, self.offload_rest)

    def extra_repr(self) -> str:
        return (f"region_id={self.region_id}, offload_inputs={self.offload_inputs}, "
                f"offload_rest={self.offload_rest}")


# --------------------------------------------------------------------------------------------
# Code generation of `with` blocks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _WithBlock:
    """Consecutive nodes sharing one ``_WithBlock`` are emitted under one ``with header:``."""

    block_id: int
    header: str
    needs_node: str | None = None  # node the header reads; it must survive until the block


# Unique per process, so blocks of graphs regenerated from regenerated graphs never merge.
_BLOCK_IDS = itertools.count()
_COUNTER_LINE = re.compile(r"# COUNTER: (\d+)\n")


def _indent(text: str) -> str:
    return "\n".join(("    " + line) if line.strip() else line for line in text.split("\n"))


def _split_trailer(text: str) -> tuple[str, str]:
    """Split a node's code from the comment lines FX appends after it for the next node."""
    lines = text.split("\n")
    end = len(lines)
    while end > 0 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
        end -= 1
    if end == len(lines):
        return text, ""
    return "\n".join(lines[:end]) + "\n", "\n".join(lines[end:])


def _wrap_with_blocks(body: list[str], blocks: Sequence[_WithBlock | None]) -> list[str]:
    """Insert ``with`` headers and indent the code of the nodes inside them.

    FX marks the start of each node's code with a ``# COUNTER: <node index>`` line (removed after
    the body transformer runs), which is how the code of a node is told apart from its neighbours'.
    """
    chunks: list[tuple[int | None, list[str]]] = [(None, [])]
    for piece in body:
        match = _COUNTER_LINE.fullmatch(piece)
        if match:
            chunks.append((int(match.group(1)), [piece]))
        else:
            chunks[-1][1].append(piece)
    block_of = [blocks[i] if i is not None else None for i, _ in chunks]
    out: list[str] = []
    for position, (_, pieces) in enumerate(chunks):
        block = block_of[position]
        if block is None:
            out.extend(pieces)
            continue
        marker, text = pieces[0], "".join(pieces[1:])
        out.append(marker)
        if block_of[position - 1] != block:
            out.append(f"{block.header}\n")
        code, trailer = _split_trailer(text)
        out.append(_indent(code))
        # Comments after the code belong to the next node: indent them only if it is in the block.
        stays_inside = position + 1 < len(chunks) and block_of[position + 1] == block
        out.append(_indent(trailer) if stays_inside else trailer)
    return out


class _WithBlockMixin:
    """Makes any ``CodeGen`` honour ``node.meta[_WITH_BLOCK_META]``."""

    def _gen_python_code(self, nodes: Any, *args: Any, **kwargs: Any) -> Any:
        node_list = list(nodes)
        blocks = [n.meta.get(_WITH_BLOCK_META) for n in node_list]
        if not any(blocks):
            return super()._gen_python_code(nodes, *args, **kwargs)
        _check_block_dependencies(node_list, blocks)
        previous = self._body_transformer

        def transform(body: list[str]) -> list[str]:
            wrapped = _wrap_with_blocks(body, blocks)
            return previous(wrapped) if previous else wrapped

        self._body_transformer = transform
        try:
            return super()._gen_python_code(nodes, *args, **kwargs)
        finally:
            self._body_transformer = previous


def _check_block_dependencies(nodes: list[Node], blocks: list[_WithBlock | None]) -> None:
    by_name = {n.name: n for n in nodes}
    for block in {b for b in blocks if b is not None and b.needs_node}:
        node = by_name.get(block.needs_node)
        # FX sets a value to None right after its last use; with no later user the header would
        # read None.
        if node is None or not node.users:
            raise RuntimeError(
                f"The `with` block '{block.header}' reads node {block.needs_node!r}, which was "
                "removed from the graph or lost its users after apply_memory_annotations. "
                "Run graph passes before apply_memory_annotations, not on its result."
            )


class WithBlockCodeGen(_WithBlockMixin, CodeGen):
    """Plain FX codegen plus ``with`` blocks."""


_CODEGEN_CLASSES: dict[type, type] = {CodeGen: WithBlockCodeGen}


def _with_block_codegen(base: CodeGen) -> CodeGen:
    """A copy of ``base`` (e.g. torch.export's pytree codegen) that also emits ``with`` blocks."""
    base_cls = type(base)
    if not issubclass(base_cls, _WithBlockMixin) and base_cls not in _CODEGEN_CLASSES:
        # Subclass rather than wrap: FX checks isinstance(codegen, _PyTreeCodeGen) in places.
        _CODEGEN_CLASSES[base_cls] = type(f"WithBlock{base_cls.__name__}", (_WithBlockMixin, base_cls), {})
    cls = base_cls if issubclass(base_cls, _WithBlockMixin) else _CODEGEN_CLASSES[base_cls]
    codegen = cls.__new__(cls)
    codegen.__dict__.update(base.__dict__)  # shallow: pytree specs are immutable
    return codegen


# --------------------------------------------------------------------------------------------
# Reading annotations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PlainOffload:
    region_id: int
    offload_inputs: bool
    offload_rest: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checkpoint_path(node: Node) -> tuple[int, ...]:
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


def _offload_annotation(node: Node) -> bool | _PlainOffload:
    """``True`` (offload checkpoint inputs), a plain offload region, or ``False``."""
    label = node.meta.get(OFFLOAD_META, False)
    if isinstance(label, bool):
        return label
    if (isinstance(label, (list, tuple)) and len(label) == 3 and _is_int(label[0])
            and isinstance(label[1], bool) and isinstance(label[2], bool)):
        spec = _PlainOffload(label[0], label[1], label[2])
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


def _validate_annotations(graph: fx.Graph) -> None:
    for node in graph.nodes:
        path = _checkpoint_path(node)
        offload = _offload_annotation(node)
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
        if isinstance(offload, _PlainOffload) and path:
            raise MemoryAnnotationError(
                f"Node {node.name!r} is in checkpoint region {list(path)} and also in plain offload "
                f"region {offload.region_id}. A checkpoint region keeps only its inputs; use "
                f"{OFFLOAD_META}=True to offload those."
            )


# --------------------------------------------------------------------------------------------
# Finding regions
# --------------------------------------------------------------------------------------------


@dataclass
class _Region:
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


def _fill_io(region: _Region) -> _Region:
    """Inputs: values from outside read inside (get_attr excepted). Outputs: values read after."""
    members = set(region.nodes)
    for node in region.nodes:
        for arg in node.all_input_nodes:
            if arg not in members and arg.op != "get_attr" and arg not in region.inputs:
                region.inputs.append(arg)
    region.outputs = [n for n in region.nodes if any(u not in members for u in n.users)]
    return region


def _checkpoint_regions(nodes: Sequence[Node], level: int) -> list[_Region]:
    def key_of(node: Node) -> tuple[int, ...] | None:
        path = _checkpoint_path(node)
        return path[: level + 1] if len(path) > level else None

    runs = _contiguous_runs(nodes, key_of, lambda key: f"Checkpoint region {list(key)}")
    return [_fill_io(_Region(key, run)) for key, run in runs]


def _plain_offload_regions(nodes: Sequence[Node]) -> list[tuple[_Region, _PlainOffload]]:
    def key_of(node: Node) -> int | None:
        offload = _offload_annotation(node)
        return offload.region_id if isinstance(offload, _PlainOffload) else None

    result = []
    for key, run in _contiguous_runs(nodes, key_of, lambda key: f"Offload region {key}"):
        spec = _offload_annotation(run[0])
        for node in run[1:]:
            if _offload_annotation(node) != spec:
                raise MemoryAnnotationError(
                    f"Offload region {key}: node {node.name!r} has {OFFLOAD_META}="
                    f"{node.meta[OFFLOAD_META]!r} but node {run[0].name!r} has "
                    f"{run[0].meta[OFFLOAD_META]!r}; one region needs one set of flags."
                )
        result.append((_fill_io(_Region((key,), run)), spec))
    return result


# --------------------------------------------------------------------------------------------
# Building the regenerated graphs
# --------------------------------------------------------------------------------------------


def _fetch_attr(root: nn.Module, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), root)


PARTITION_META = "activation_partition"
"""On checkpointed nodes (set by the runtime): keep the region's replicated inputs partitioned over
the mesh (see :mod:`autoshard.runtime.partition`); each region input carries its replicated mesh
axes in ``meta[PARTITION_AXES_META]``, and the root module holds the mesh ``comm``."""
PARTITION_AXES_META = "partition_axes"


STATE_META = "module_state"
"""On placeholders (set by the runtime): the value is module state that ops update in place (a
buffer such as batch-norm running statistics). A checkpoint region takes such an input by
reference (:class:`StateRef`) rather than as a saved tensor, whose version check would fail
once the region has updated it."""


class StateRef:
    """A tensor handed to a checkpoint region by reference (see :data:`STATE_META`)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


def state_ref(tensor: Any) -> StateRef:
    return StateRef(tensor)


def state_of(ref: StateRef) -> Any:
    return ref.tensor


def update_state_once(fn: Callable[..., Any], state: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; when it runs again in backward (the recomputation of a checkpoint
    region), the module state at positions ``state`` is handed in as copies, so that in-place
    updates (running statistics, batch counters) happen once per step, as in the model."""
    if torch._C._current_graph_task_id() != -1:
        args = tuple(a.clone() if i in state and isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
    return fn(*args, **kwargs)


def _clean_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in (CHECKPOINT_META, OFFLOAD_META, PARTITION_META)}


class _GraphBuilder:
    """Copies nodes of the annotated graph into a new graph, replacing regions as it goes.

    ``root`` is the annotated GraphModule: every get_attr / call_module target refers to it.
    """

    def __init__(self, root: nn.Module, graph: fx.Graph, pin_memory: bool) -> None:
        self.root = root
        self.graph = graph
        self.pin_memory = pin_memory
        self.env: dict[Node, Node] = {}
        self.attrs: dict[str, Any] = {}
        self._attr_nodes: dict[str, Node] = {}

    # -- basic copying ------------------------------------------------------------------------

    def lookup(self, old: Node) -> Node:
        if old.op == "get_attr":
            return self._get_attr(old)
        return self.env[old]

    def _get_attr(self, old: Node) -> Node:
        target = str(old.target)
        if target not in self._attr_nodes:
            self.attrs[target] = _fetch_attr(self.root, target)
            self._attr_nodes[target] = self.copy(old)
        return self._attr_nodes[target]

    def copy(self, old: Node, block: _WithBlock | None = None) -> Node:
        """Copy ``old``; ``block`` puts it in a `with` block (an existing block is kept otherwise)."""
        new = self.graph.node_copy(old, self.lookup)
        new.meta = _clean_meta(new.meta)
        if block is not None:
            new.meta[_WITH_BLOCK_META] = block
        if old.op == "call_module":
            self.attrs[str(old.target)] = self.root.get_submodule(str(old.target))
        if old.op != "get_attr":
            self.env[old] = new
        return new

    def fresh_attr(self, base: str, value: Any) -> str:
        name, suffix = base, 0
        while hasattr(self.root, name) or any(t.split(".")[0] == name for t in self.attrs):
            suffix += 1
            name = f"{base}_{suffix}"
        self.attrs[name] = value
        return name

    @staticmethod
    def new_block(header: str, needs_node: str | None = None) -> _WithBlock:
        return _WithBlock(next(_BLOCK_IDS), header, needs_node)

    def module(self, class_name: str) -> fx.GraphModule:
        gm = fx.GraphModule(self.attrs, self.graph, class_name=class_name)
        gm.training = self.root.training
        return gm

    # -- regions ------------------------------------------------------------------------------

    def emit(self, nodes: Sequence[Node], level: int) -> None:
        """Copy ``nodes`` (one level of nesting) into the graph."""
        starts: dict[Node, Callable[[], None]] = {}
        skip: set[Node] = set()
        for region in _checkpoint_regions(nodes, level):
            starts[region.nodes[0]] = functools.partial(self._emit_checkpoint, region, level)
            skip.update(region.nodes)
        if level == 0:
            for region, spec in _plain_offload_regions(nodes):
                starts[region.nodes[0]] = functools.partial(self._emit_plain_offload, region, spec)
                skip.update(region.nodes)
        for node in nodes:
            if node in starts:
                starts[node]()
            elif node not in skip and node.op != "get_attr":
                self.copy(node)

    def _region_module(self, region: _Region, level: int) -> fx.GraphModule:
        sub = _GraphBuilder(self.root, fx.Graph(), self.pin_memory)
        for inp in region.inputs:
            placeholder = sub.graph.placeholder(inp.name)
            placeholder.meta = _clean_meta(inp.meta)
            if inp.meta.get(STATE_META):
                placeholder = sub.graph.call_function(state_of, (placeholder,), name=f"{inp.name}_state")
                placeholder.meta = _clean_meta(inp.meta)
            sub.env[inp] = placeholder
        sub.emit(region.nodes, level + 1)
        outputs = [sub.env[o] for o in region.outputs]
        sub.graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        return sub.module("CheckpointRegion")

    def _bind_outputs(self, region: _Region, call: Node) -> None:
        if len(region.outputs) == 1:
            self.env[region.outputs[0]] = call
            call.meta = _clean_meta(region.outputs[0].meta)
            return
        for index, out in enumerate(region.outputs):
            item = self.graph.create_node("call_function", operator.getitem, (call, index), name=out.name)
            item.meta = _clean_meta(out.meta)
            self.env[out] = item

    def _emit_checkpoint(self, region: _Region, level: int) -> None:
        label = "_".join(str(k) for k in region.key)
        name = self.fresh_attr(f"checkpoint_{label}", self._region_module(region, level))
        fn = self.graph.get_attr(name)
        args = (fn, *(self.graph.call_function(state_ref, (self.lookup(i),)) if i.meta.get(STATE_META)
                      else self.lookup(i) for i in region.inputs))
        # Offloading applies to the outermost region: inner regions' inputs are not kept anyway.
        offload = level == 0 and any(_offload_annotation(n) is True for n in region.nodes)
        call_name = region.outputs[0].name if len(region.outputs) == 1 else f"{name}_out"
        if level == 0 and any(n.meta.get(PARTITION_META) for n in region.nodes):
            from ..runtime.partition import partitioned_checkpoint

            self.attrs["comm"] = self.root.comm
            axes = tuple(tuple(i.meta.get(PARTITION_AXES_META, ())) for i in region.inputs)
            call = self.graph.create_node(
                "call_function", partitioned_checkpoint, (fn, self.graph.get_attr("comm"), axes, *args[1:]),
                name=call_name)
        else:
            call = self.graph.create_node(
                "call_function", torch.utils.checkpoint.checkpoint, args, {"use_reentrant": False},
                name=call_name,
            )
        self._bind_outputs(region, call)
        if offload:
            header = f"with torch.autograd.graph.save_on_cpu(pin_memory={self.pin_memory}):"
            call.meta[_WITH_BLOCK_META] = self.new_block(header)

    def _emit_plain_offload(self, region: _Region, spec: _PlainOffload) -> None:
        name = self.fresh_attr(f"offload_{spec.region_id}",
                               HostOffloadRegion(spec.region_id, spec.offload_inputs, spec.offload_rest))
        # Load attributes first so the `with` block holds only the region's own nodes.
        for node in region.nodes:
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    self.lookup(arg)
        inputs = tuple(self.lookup(i) for i in region.inputs)
        hooks = self.graph.create_node("call_module", name, inputs, name=f"{name}_hooks")
        block = self.new_block(
            f"with torch.autograd.graph.saved_tensors_hooks({hooks.name}.pack, {hooks.name}.unpack):",
            needs_node=hooks.name,
        )
        for node in region.nodes:
            self.copy(node, block)
        outputs = tuple(self.env[o] for o in region.outputs)
        self.graph.create_node("call_method", "prefetch_on_backward", (hooks, *outputs),
                               name=f"{name}_prefetch")


def apply_memory_annotations(gm: fx.GraphModule, *, pin_memory: bool = True) -> fx.GraphModule:
    """Regenerate ``gm`` with its checkpoint / offload annotations turned into code.

    Works on ``torch.fx.symbolic_trace`` graphs and on ``torch.export(...).module()`` graphs
    (the pytree calling convention is kept). ``gm`` itself is not modified; the result shares its
    parameters, buffers and submodules. ``pin_memory`` is passed to ``save_on_cpu`` for offloaded
    checkpoint inputs (it only pins when CUDA is available). Raises
    :class:`MemoryAnnotationError`, naming the node, for malformed annotations.
    """
    _validate_annotations(gm.graph)
    graph = fx.Graph()
    graph.set_codegen(_with_block_codegen(gm.graph._codegen))
    builder = _GraphBuilder(gm, graph, pin_memory)
    builder.emit(list(gm.graph.nodes), level=0)
    result = builder.module("GraphModule")
    result.meta = dict(getattr(gm, "meta", {}))
    return result
