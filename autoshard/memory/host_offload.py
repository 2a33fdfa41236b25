"""Host offload at run time: the saved-tensor hooks that offload regions of generated code run.

A plain offload region (``activation_offload=[region_id, offload_input, offload_rest]``, see
:mod:`.annotations`) runs inside ``torch.autograd.graph.saved_tensors_hooks`` with the pack/unpack
hooks of a :class:`HostOffloadHooks`: saved tensors go to host memory (pinned buffers and a side
stream on CUDA, prefetched back before the region's backward), parameters never do, and tensors
that stay are handed to whatever saved tensor hooks were active outside the region (e.g. a
``SavedTensorMeter``). :data:`HOST_OFFLOAD_COUNTER` tallies the host copies process-wide.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Hashable, Iterable

import torch
from torch import nn

from .param_flag import is_parameter_like

__all__ = ["HOST_OFFLOAD_COUNTER", "HostOffloadCounter", "HostOffloadHooks", "HostOffloadRegion", "delegate_pack",
           "delegate_unpack", "outer_saved_tensors_hooks", "unbroadcast"]


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

    __slots__ = ("device", "host", "copied", "prefetched", "prefetch_done", "source", "broadcast_to", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.device = t.device
        # A broadcast view (stride 0: an attention mask expanded over heads, which CUDA's SDPA saves)
        # is copied as the memory it reads and expanded again on the way back, not materialised.
        compact = unbroadcast(t)
        self.broadcast_to = tuple(t.shape) if compact is not t else None
        # The tensor that owns the memory: ops often save a fresh view of a live value (linear saves
        # its input reshaped to 2D), and that view object dies once packed, while its base lives on.
        self.source = weakref.ref(t._base if t._base is not None else t)
        self.prefetched: torch.Tensor | None = None
        self.prefetch_done: torch.cuda.Event | None = None
        self.copied: torch.cuda.Event | None = None
        if t.device.type == "cuda":
            # Pinned buffer + side stream: the copy overlaps the rest of the forward.
            # empty_like keeps the strides of dense tensors, so restore() gives the same layout.
            self.host = torch.empty_like(compact, device="cpu", pin_memory=True)
            stream = _offload_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host.copy_(compact, non_blocking=True)
                self.copied = stream.record_event()
            # The caching allocator must not hand t's memory out again before the copy has read it.
            t.record_stream(stream)
        else:
            # On CPU this "offload" gains nothing, but it is a real copy (the original storage can
            # be freed), so byte accounting and tests mean the same thing as on CUDA.
            self.host = torch.empty_like(compact, device="cpu")
            self.host.copy_(compact)
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
        back = self._back_on_device()
        return back if self.broadcast_to is None else back.expand(self.broadcast_to)

    def _back_on_device(self) -> torch.Tensor:
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


def unbroadcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every broadcast dim (stride 0, size > 1) narrowed to size 1 (``t`` itself if none):
    the elements it reads, which ``.expand(t.shape)`` turns back into ``t``."""
    if all(st != 0 or n <= 1 for n, st in zip(t.shape, t.stride())):
        return t
    return t.as_strided([1 if st == 0 else n for n, st in zip(t.shape, t.stride())], t.stride(), t.storage_offset())


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
        """Start copying every live host copy of this region back to the device, the last saved
        first: backward needs them in reverse order, so it can start on the first while the rest
        are still on their way."""
        for host_copy in reversed(list(self._copies.values())):
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
