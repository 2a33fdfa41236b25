"""What the generated driver of parameter offload calls: load, prefetch, run and release slices.

:class:`SliceRuntime` makes and drops the device copies of each slice's parameters (counted by the
:class:`~.residency.ResidencyTracker`) and runs the slices; it brings the parameters back for
backward in one of two ways.

``checkpoint_activations=False`` (default)
    The slice runs with autograd on. Its device parameter copies come out of a custom autograd
    function (``_LoadSlice``) and the slice runs under ``torch.autograd.graph.saved_tensors_hooks``:
    any saved tensor that *is* (a view of) a device parameter copy is packed as a small reference
    instead of the tensor, so the autograd graph holds activations but no parameters. The first
    time backward unpacks such a reference the slice's parameters are loaded again;
    ``_LoadSlice``'s backward (which autograd runs only after every use of those copies got its
    gradient) moves the gradients to the host and releases the copies.

``checkpoint_activations=True``
    One custom autograd function per slice (``_CheckpointedSlice``) runs the slice without
    autograd, keeps only the slice's inputs, and in backward reloads the parameters, recomputes
    the slice with autograd on and back-propagates through it (as fairscale's ``OffloadFunction``
    and ``torch.utils.checkpoint`` do). RNG state is restored for the recomputation.

Prefetch (``prefetch=True``, the default on CUDA)
    While slice ``i`` computes, slice ``i + 1``'s parameters are copied on a side CUDA stream
    (slice ``i - 1``'s in backward), so at most two slices are resident. On CPU the "prefetch" is
    a synchronous copy, only useful to exercise the bookkeeping.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx

from .residency import ResidencyTracker
from .slicing import SlicePlan

__all__ = ["SliceRuntime"]


@dataclass(frozen=True)
class _ParamRef:
    """A saved tensor that was (a view of) device parameter copy ``j`` of slice ``i``."""

    slice: int
    j: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _LoadSlice(torch.autograd.Function):
    """Forward: hands out the device copies of slice ``i``'s parameters (made by the runtime).
    Backward: runs after every use of those copies got its gradient; sends the gradients to the
    host parameters and releases the slice's backward copies."""

    @staticmethod
    def forward(ctx: Any, rt: "SliceRuntime", i: int, *host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rt, ctx.i = rt, i
        ctx.set_materialize_grads(False)
        copies = rt._handoff
        rt._handoff = None
        return tuple(copies)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        rt: SliceRuntime = ctx.rt
        rt.release(ctx.i, "backward")
        params = rt.slices[ctx.i].params
        return (None, None, *(None if g is None else rt.to_host(g, p) for g, p in zip(grads, params)))


class _CheckpointedSlice(torch.autograd.Function):
    """One slice run for all microbatches without autograd; backward reloads the parameters and
    recomputes each microbatch with autograd on."""

    @staticmethod
    def forward(ctx: Any, rt: "SliceRuntime", i: int, n_in: int, *rest: Any) -> tuple[Any, ...]:
        nparams = len(rt.slices[i].params)
        flat = rest[nparams:]
        m = len(flat) // n_in if n_in else rt.m
        ctx.rt, ctx.i, ctx.n_in, ctx.m = rt, i, n_in, m
        ctx.set_materialize_grads(False)
        copies = rt._fwd[i]
        outs: list[Any] = []
        ctx.rng = []
        with torch.no_grad():
            for k in range(m):
                ctx.rng.append(rt.rng_state())
                outs += rt.call_slice(i, copies, flat[k * n_in:(k + 1) * n_in])
        ctx.n_out = len(outs) // m if m else 0
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.structure = [isinstance(x, torch.Tensor) for x in flat]
        ctx.others = [None if isinstance(x, torch.Tensor) else x for x in flat]
        ctx.mark_non_differentiable(*[o for o in outs if isinstance(o, torch.Tensor)
                                      and not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        rt: SliceRuntime = ctx.rt
        i, n_in, m, n_out = ctx.i, ctx.n_in, ctx.m, ctx.n_out
        saved = iter(ctx.saved_tensors)
        flat = [next(saved) if is_t else other for is_t, other in zip(ctx.structure, ctx.others)]
        needs = ctx.needs_input_grad[3:]
        params = rt.slices[i].params
        nparams = len(params)
        copies = rt.acquire(i, "backward")
        rt.prefetch(rt.previous(i), "backward")
        leaves = [c.detach().requires_grad_(p.requires_grad) for c, p in zip(copies, params)]
        in_grads: list[Any] = [None] * len(flat)
        for k in range(m):
            args = []
            for a in range(k * n_in, (k + 1) * n_in):
                x = flat[a]
                if isinstance(x, torch.Tensor):
                    x = x.detach().requires_grad_(bool(needs[nparams + a]))
                args.append(x)
            with torch.random.fork_rng(devices=rt.rng_devices):
                rt.set_rng_state(ctx.rng[k])
                with torch.enable_grad():
                    outs = rt.call_slice(i, leaves, args)
            pairs = [(o, g) for o, g in zip(outs, grads[k * n_out:(k + 1) * n_out])
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            for j, x in enumerate(args):
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    in_grads[k * n_in + j] = x.grad
        pgrads = [None if leaf.grad is None else rt.to_host(leaf.grad, p) for leaf, p in zip(leaves, params)]
        del leaves, copies
        rt.release(i, "backward")
        return (None, None, None, *pgrads, *in_grads)


class SliceRuntime:
    """Loads, prefetches, runs and releases slices; the generated driver code calls it."""

    def __init__(self, slices: list[SlicePlan], modules: list[fx.GraphModule], state: list[list[torch.Tensor]],
                 device: torch.device, m: int, checkpoint: bool, prefetch: bool,
                 tracker: ResidencyTracker) -> None:
        self.slices, self.modules, self.state = slices, modules, state
        self.device, self.m, self.checkpoint, self.do_prefetch = device, m, checkpoint, prefetch
        self.tracker = tracker
        self.cuda = device.type == "cuda"
        self.rng_devices = [device] if self.cuda else []
        self._fwd: dict[int, list[torch.Tensor]] = {}
        self._bwd: dict[int, list[torch.Tensor]] = {}
        self._pre: dict[tuple[int, str], tuple[list[torch.Tensor], Any]] = {}
        self._handoff: list[torch.Tensor] | None = None
        self._stream = torch.cuda.Stream(device=device) if self.cuda and prefetch else None
        # Every device copy made, weakly: lets tests check that nothing keeps released copies alive.
        self.live_copies: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()

    # --- copies ---------------------------------------------------------------------------

    def _copy(self, i: int) -> list[torch.Tensor]:
        if self.device.type == "cpu":  # a real copy, so the accounting means what it does on a GPU
            copies = [p.detach().clone() for p in self.slices[i].params]
        else:
            copies = [p.detach().to(self.device, non_blocking=True) for p in self.slices[i].params]
        self.live_copies.update(copies)
        return copies

    def to_host(self, g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return g if g.device == p.device else g.to(p.device)

    def previous(self, i: int) -> int:
        return i - 1

    def acquire(self, i: int, phase: str) -> list[torch.Tensor]:
        """Device copies of slice ``i`` (a prefetched set if there is one)."""
        pre = self._pre.pop((i, phase), None)
        if pre is not None:
            copies, event = pre
            if event is not None:  # CUDA: wait for the side-stream copy, keep its memory alive
                cur = torch.cuda.current_stream(self.device)
                cur.wait_event(event)
                for c in copies:
                    c.record_stream(cur)
            return copies
        copies = self._copy(i)
        self.tracker.loaded(i, self.slices[i].nbytes, phase)
        return copies

    def prefetch(self, i: int, phase: str) -> None:
        """Start copying slice ``i`` (side CUDA stream); no-op without prefetch or out of range."""
        if not self.do_prefetch or not 0 <= i < len(self.slices) or (i, phase) in self._pre:
            return
        if (i, phase) in self.tracker.resident:
            return
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                copies = self._copy(i)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            copies, event = self._copy(i), None
        self._pre[(i, phase)] = (copies, event)
        self.tracker.loaded(i, self.slices[i].nbytes, phase, "prefetch")

    def release(self, i: int, phase: str) -> None:
        (self._fwd if phase == "forward" else self._bwd).pop(i, None)
        self._pre.pop((i, phase), None)
        self.tracker.released(i, phase)

    def release_all(self, phase: str) -> None:
        for (i, ph) in list(self.tracker.resident):
            if ph == phase:
                self.release(i, ph)

    # --- forward --------------------------------------------------------------------------

    def load(self, i: int) -> None:
        copies = self.acquire(i, "forward")
        params = self.slices[i].params
        if (not self.checkpoint and torch.is_grad_enabled() and any(p.requires_grad for p in params)):
            self._handoff = copies
            copies = list(_LoadSlice.apply(self, i, *params))
        self._fwd[i] = copies

    def call_slice(self, i: int, copies: Sequence[torch.Tensor], args: Sequence[Any]) -> list[Any]:
        return list(self.modules[i](*copies, *self.state[i], *args))

    def run(self, i: int, *values: list[Any]) -> tuple[list[Any], ...]:
        """Run slice ``i`` on every microbatch; ``values`` and the result hold one entry per
        microbatch."""
        n_out = len(self.slices[i].outputs)
        if self.checkpoint:
            flat = [v[k] for k in range(self.m) for v in values]
            outs = _CheckpointedSlice.apply(self, i, len(values), *self.slices[i].params, *flat)
            per_mb = [list(outs[k * n_out:(k + 1) * n_out]) for k in range(self.m)]
        else:
            copies = self._fwd[i]
            per_mb = []
            with torch.autograd.graph.saved_tensors_hooks(self._packer(i, copies), self._unpack):
                for k in range(self.m):
                    per_mb.append(self.call_slice(i, copies, [v[k] for v in values]))
        return tuple([per_mb[k][o] for k in range(self.m)] for o in range(n_out))

    # --- saved tensor hooks (non-checkpointed mode) ----------------------------------------

    def _packer(self, i: int, copies: Sequence[torch.Tensor]) -> Callable[[torch.Tensor], Any]:
        where = {c.untyped_storage().data_ptr(): (j, c.dtype) for j, c in enumerate(copies) if c.numel()}

        def pack(t: torch.Tensor) -> Any:
            if t.device != self.device or t.layout != torch.strided or not t.numel():
                return t
            hit = where.get(t.untyped_storage().data_ptr())
            if hit is None or hit[1] != t.dtype:
                return t
            return _ParamRef(i, hit[0], tuple(t.size()), tuple(t.stride()), t.storage_offset())

        return pack

    def _unpack(self, obj: Any) -> torch.Tensor:
        if not isinstance(obj, _ParamRef):
            return obj
        i = obj.slice
        copies = self._bwd.get(i)
        if copies is None:
            copies = self._bwd[i] = self.acquire(i, "backward")
            self.prefetch(self.previous(i), "backward")
            # Safety net: copies whose _LoadSlice backward does not run (frozen parameters,
            # partial backward) are released when this backward pass ends.
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.release_all("backward"))
        c = copies[obj.j]
        if tuple(c.size()) == obj.size and tuple(c.stride()) == obj.stride and c.storage_offset() == obj.offset:
            return c
        return c.as_strided(obj.size, obj.stride, obj.offset)

    # --- rng ------------------------------------------------------------------------------

    def rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda else None)

    def set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    # --- driver helpers -------------------------------------------------------------------

    def same(self, value: Any) -> list[Any]:
        return [value] * self.m

    def combine(self, *outputs: list[Any]) -> list[Any]:
        """Per-microbatch outputs -> one value each: 0-dim tensors averaged, other tensors
        concatenated along dim 0, non-tensors from the first microbatch."""
        if self.m == 1:
            return [o[0] for o in outputs]
        result = []
        for o in outputs:
            x = o[0]
            if isinstance(x, torch.Tensor) and x.dim() == 0:
                result.append(torch.stack(list(o)).mean())
            elif isinstance(x, torch.Tensor):
                result.append(torch.cat(list(o), dim=0))
            else:
                result.append(x)
        return result
