"""Measure what autograd keeps for backward, on any device (CPU included).

:class:`SavedTensorMeter` is a context manager that installs ``saved_tensors_hooks`` for the code
it wraps and reports (:class:`SavedTensorReport`):

* bytes of the distinct storages saved for backward, split into activations and parameters;
* the current and peak bytes of activation storages held by autograd (live saved bytes);
* bytes copied to host by the offload regions of :mod:`autoshard.memory`;
* on CUDA, the ``torch.cuda.max_memory_allocated`` rise over the window.

What is exact and what is not:

* Sizes are whole storages (``untyped_storage().nbytes()``): saving a view keeps its whole
  storage alive, so that is what is counted, and several views of one storage count once.
* "Live" means "referenced by a saved tensor slot of the autograd graph": a storage is released
  when the last slot holding it is freed (after its node ran in backward, or when the graph is
  dropped). That is exact for autograd's references; the memory itself may outlive them when
  something else (a module output kept by the caller, a parameter) still holds the storage.
* Tensors saved under other, inner saved tensor hooks are invisible: those of checkpointed
  regions (recomputed, not kept — which is the point), and checkpoint inputs offloaded with
  ``save_on_cpu``. Offload regions of :mod:`autoshard.memory` hand the tensors they keep on the
  device to the meter and count the ones they copy in :data:`HOST_OFFLOAD_COUNTER`, which the
  meter reads (``host_offload_bytes``; the counter is process-wide, so concurrent threads mix).
* Activation bytes are summed each time a storage becomes held; a storage saved, released and
  saved again within one window counts twice. Parameter bytes count each storage once.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from ..memory.host_offload import HOST_OFFLOAD_COUNTER, delegate_pack, delegate_unpack, outer_saved_tensors_hooks
from ..memory.param_flag import is_parameter_like

__all__ = ["SavedTensorMeter", "SavedTensorReport"]

_StorageKey = tuple[str, int]


@dataclass(frozen=True)
class SavedTensorReport:
    """A snapshot of :class:`SavedTensorMeter`'s counters (bytes unless said otherwise)."""

    saved_tensors: int
    """Pack calls seen (one per saved tensor slot, before de-duplication)."""
    activation_bytes: int
    """Distinct non-parameter storages saved for backward."""
    parameter_bytes: int
    """Distinct parameter storages saved for backward."""
    live_activation_bytes: int
    """Activation storages still held by autograd at the time of the snapshot."""
    peak_activation_bytes: int
    """Maximum of ``live_activation_bytes`` since the meter was entered."""
    host_offload_tensors: int
    """Host copies made by autoshard.memory offload regions inside the window."""
    host_offload_bytes: int
    """Bytes of those host copies."""
    cuda_peak_allocated_delta: int | None
    """``max_memory_allocated`` during the window minus ``memory_allocated`` at entry; None
    without CUDA."""


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[_StorageKey, int]:
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # no plain storage: count the tensor itself
        return ("tensor", id(t)), t.numel() * t.element_size()


class _Saved:
    """What autograd holds for one saved tensor slot while the meter watches it."""

    __slots__ = ("payload", "__weakref__")

    def __init__(self, payload: Any) -> None:
        self.payload = payload


class SavedTensorMeter:
    """Context manager recording the tensors autograd saves for backward.

    ``params``: tensors to count as parameters (e.g. ``[*model.parameters(), *model.buffers()]``),
    matched by storage; ``nn.Parameter`` objects and views of them count as parameters anyway.
    ``cuda_device``: the device whose allocator peak is measured when CUDA is available (the
    current one by default); entering resets its peak statistics.
    """

    def __init__(self, params: Iterable[torch.Tensor] = (), *,
                 cuda_device: torch.device | int | None = None) -> None:
        self._param_storages = {_storage_key_and_bytes(p)[0] for p in params}
        self._cuda_device = cuda_device
        self._lock = threading.RLock()  # finalizers may run on the autograd engine's threads
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._entered = False
        self._outer: Any = None
        self._saved_tensors = 0
        self._activation_bytes = 0
        self._param_seen: dict[_StorageKey, int] = {}
        self._live_refs: dict[_StorageKey, int] = {}
        self._live_sizes: dict[_StorageKey, int] = {}
        self._live_bytes = 0
        self._peak_bytes = 0
        self._host_at_enter = (0, 0)
        self._host_at_exit: tuple[int, int] | None = None
        self._cuda_at_enter: int | None = None
        self._cuda_peak_delta: int | None = None

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> SavedTensorMeter:
        if self._entered:
            raise RuntimeError("A SavedTensorMeter measures one window; create a new one.")
        self._entered = True
        self._outer = outer_saved_tensors_hooks()
        self._host_at_enter = HOST_OFFLOAD_COUNTER.snapshot()[:2]
        self._host_at_exit = None
        if torch.cuda.is_available():
            device = torch.cuda.current_device() if self._cuda_device is None else self._cuda_device
            self._cuda_device = device
            torch.cuda.reset_peak_memory_stats(device)
            self._cuda_at_enter = torch.cuda.memory_allocated(device)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._host_at_exit = HOST_OFFLOAD_COUNTER.snapshot()[:2]
        if self._cuda_at_enter is not None:
            peak = torch.cuda.max_memory_allocated(self._cuda_device)
            self._cuda_peak_delta = peak - self._cuda_at_enter

    # -- hooks --------------------------------------------------------------------------------

    def _is_param(self, t: torch.Tensor, key: _StorageKey) -> bool:
        return key in self._param_storages or is_parameter_like(t)

    def _pack(self, t: torch.Tensor) -> Any:
        key, nbytes = _storage_key_and_bytes(t)
        saved = _Saved(delegate_pack(self._outer, t))
        with self._lock:
            self._saved_tensors += 1
            if self._is_param(t, key):
                self._param_seen.setdefault(key, nbytes)
                return saved
            if self._live_refs.get(key, 0) == 0:
                self._live_sizes[key] = nbytes
                self._activation_bytes += nbytes
                self._live_bytes += nbytes
                self._peak_bytes = max(self._peak_bytes, self._live_bytes)
            self._live_refs[key] = self._live_refs.get(key, 0) + 1
        # The slot dies with this object: autograd drops it after backward used it or with the graph.
        weakref.finalize(saved, self._release, key)
        return saved

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        return delegate_unpack(saved.payload)

    def _release(self, key: _StorageKey) -> None:
        with self._lock:
            self._live_refs[key] -= 1
            if self._live_refs[key] == 0:
                del self._live_refs[key]
                self._live_bytes -= self._live_sizes.pop(key)

    # -- results ------------------------------------------------------------------------------

    def report(self) -> SavedTensorReport:
        """Counters now; usable inside the window (e.g. between forward and backward) or after."""
        host_now = self._host_at_exit or HOST_OFFLOAD_COUNTER.snapshot()[:2]
        with self._lock:
            return SavedTensorReport(
                saved_tensors=self._saved_tensors,
                activation_bytes=self._activation_bytes,
                parameter_bytes=sum(self._param_seen.values()),
                live_activation_bytes=self._live_bytes,
                peak_activation_bytes=self._peak_bytes,
                host_offload_tensors=host_now[0] - self._host_at_enter[0],
                host_offload_bytes=host_now[1] - self._host_at_enter[1],
                cuda_peak_allocated_delta=self._cuda_peak_delta,
            )
