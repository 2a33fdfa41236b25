"""Parameter offload: train models whose parameters do not fit on the device.

``offload_parameters(model, example_args, num_slices=...)`` captures ``model`` with
``torch.export`` (training IR), cuts its node sequence into ``num_slices`` contiguous *slices*
with roughly equal parameter bytes, and returns an :class:`OffloadedModule` whose generated code
runs the slices one after another. Every parameter stays on the host (CPU memory, pinned when
the device is CUDA). Before a slice runs, its parameters are copied to the device; after it ran
they are released. In backward each slice's parameters are copied to the device again for that
slice's backward, and their gradients are sent back and accumulated into the host parameters'
``.grad``, so an ordinary optimizer over ``model.parameters()`` steps on the host.

This is the L2L / ZeRO-Offload idea of fairscale's ``OffloadModel``, generalised from
``nn.Sequential`` to any graph ``torch.export`` can capture.

Two ways to bring parameters back for backward
    ``checkpoint_activations=False`` (default): the slice runs with autograd on. Its device
    parameter copies come out of a custom autograd function (``_LoadSlice``) and the slice runs
    under ``torch.autograd.graph.saved_tensors_hooks``: any saved tensor that *is* (a view of) a
    device parameter copy is packed as a small reference instead of the tensor, so the autograd
    graph holds activations but no parameters. The first time backward unpacks such a reference
    the slice's parameters are loaded again; ``_LoadSlice``'s backward (which autograd runs only
    after every use of those copies got its gradient) moves the gradients to the host and
    releases the copies.
    ``checkpoint_activations=True``: one custom autograd function per slice
    (``_CheckpointedSlice``) runs the slice without autograd, keeps only the slice's inputs, and
    in backward reloads the parameters, recomputes the slice with autograd on and back-propagates
    through it (as fairscale's ``OffloadFunction`` and ``torch.utils.checkpoint`` do). RNG state
    is restored for the recomputation.

Parameters used in several slices (tied weights, e.g. GPT-2's ``wte``/``lm_head``)
    Each slice that uses a parameter loads its own device copy and releases it with the rest of
    the slice; the copy's gradient from every slice is accumulated into the one host ``.grad``.
    Such a parameter is counted in the bytes of every slice that uses it (the planner balances
    these per-slice bytes). Pure functions of parameters (``t(weight)``, dtype casts) are
    recomputed in every slice that consumes them, so no value aliasing a parameter copy crosses a
    slice boundary.

Microbatches (``num_microbatches > 1``)
    The graph is captured at microbatch size. Tensor inputs whose dim 0 equals the batch size
    (dim 0 of the first tensor input) are split into equal microbatches along dim 0, the other
    inputs go to every microbatch. Each slice loads its parameters once and runs every
    microbatch before it is released (as fairscale does), and in backward it runs every
    microbatch's backward with one load; gradients accumulate over microbatches. Outputs are
    combined: 0-dim tensors (losses) are *averaged* over microbatches, other tensors are
    concatenated along dim 0, non-tensors are taken from the first microbatch. The average of
    per-microbatch losses equals the full-batch loss only for mean-reduced losses whose
    microbatches hold the same number of counted elements (e.g. HF GPT-2's ``labels`` loss when
    no label is ``-100``; with ignored labels spread unevenly it differs). Sum-reduced losses
    come out divided by ``num_microbatches``.

Prefetch (``prefetch=True``, the default on CUDA)
    While slice ``i`` computes, slice ``i + 1``'s parameters are copied on a side CUDA stream
    (slice ``i - 1``'s in backward), so at most two slices are resident. On CPU the "prefetch" is
    a synchronous copy, only useful to exercise the bookkeeping.

Residency accounting
    A :class:`ResidencyTracker` is told whenever a slice's device copies are made (load or
    prefetch) and released, per phase (forward/backward), and keeps the maximum number of
    resident slices and bytes. On CPU the "device" copies are real copies (``clone``), so the
    numbers mean what they mean on a GPU. ``OffloadedModule.planned_max_resident`` is the bound
    the plan promises (1, or 2 with prefetch).

Limits: the code is specialised to the example input shapes (and the train/eval mode at
capture); buffers and lifted constants are copied to the device once and stay resident (they are
not trained, and the captured graph must not mutate them: no BatchNorm statistics updates in
train mode); saved-tensor hooks active outside the module are bypassed inside non-checkpointed
slices; ``torch.device('cpu')`` constants in the graph (``arange(..., device='cpu')``) are
rewritten to the target device.
"""
from __future__ import annotations

import keyword
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from ..units import format_bytes

__all__ = ["OffloadError", "OffloadedModule", "ResidencyTracker", "SlicePlan", "offload_parameters"]


class OffloadError(ValueError):
    """The model cannot be captured or sliced as requested."""


# ---------------------------------------------------------------------------------------------
# Residency accounting
# ---------------------------------------------------------------------------------------------


@dataclass
class ResidencyEvent:
    phase: str            # "forward" | "backward"
    action: str           # "load" | "prefetch" | "release"
    slice: int
    resident_slices: int  # after the event
    resident_bytes: int


@dataclass
class ResidencyTracker:
    """Counts the slices whose parameters have device copies at the same time.

    ``loaded``/``released`` are called by the runtime; ``max_slices``/``max_bytes`` are the
    high-water marks since the last :meth:`reset`; ``events`` the full history (bounded by
    ``keep_events``)."""

    keep_events: int = 10_000
    resident: dict[tuple[int, str], int] = field(default_factory=dict)
    max_slices: int = 0
    max_bytes: int = 0
    loads: int = 0
    events: list[ResidencyEvent] = field(default_factory=list)

    @property
    def resident_slices(self) -> int:
        return len(self.resident)

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    def loaded(self, slice_index: int, nbytes: int, phase: str, action: str = "load") -> None:
        self.resident[(slice_index, phase)] = nbytes
        self.loads += 1
        self.max_slices = max(self.max_slices, self.resident_slices)
        self.max_bytes = max(self.max_bytes, self.resident_bytes)
        self._log(phase, action, slice_index)

    def released(self, slice_index: int, phase: str) -> None:
        if self.resident.pop((slice_index, phase), None) is not None:
            self._log(phase, "release", slice_index)

    def reset(self) -> None:
        """Forget the high-water marks and history (resident copies stay counted)."""
        self.max_slices, self.max_bytes = self.resident_slices, self.resident_bytes
        self.loads = 0
        self.events.clear()

    def _log(self, phase: str, action: str, slice_index: int) -> None:
        if len(self.events) < self.keep_events:
            self.events.append(ResidencyEvent(phase, action, slice_index, self.resident_slices,
                                              self.resident_bytes))


# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------


@dataclass
class SlicePlan:
    """One slice: its parameters (host objects, unique), their names and bytes, and its nodes."""

    index: int
    param_names: list[str]
    params: list[nn.Parameter] = field(repr=False)
    nbytes: int
    nodes: list[str] = field(repr=False)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def describe(self) -> str:
        names = ", ".join(self.param_names[:4]) + (", ..." if len(self.param_names) > 4 else "")
        return (f"{len(self.params)} params, {format_bytes(self.nbytes)}, {len(self.nodes)} nodes "
                f"({self.nodes[0]}..{self.nodes[-1]}): {names}")


def _is_tuple_valued(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _balance(atom_params: list[list[int]], nbytes: dict[int, int], k: int) -> list[int]:
    """Cut atoms (each a list of param ids) into exactly ``k`` contiguous groups, minimising the
    largest group's parameter bytes (union per group). Returns the start atom of each group."""

    def greedy(limit: int) -> list[int] | None:
        starts, cur, cur_b = [0], set(), 0
        for a, ps in enumerate(atom_params):
            new = {p for p in ps if p not in cur}
            add = sum(nbytes[p] for p in new)
            if cur and cur_b + add > limit:
                starts.append(a)
                cur, cur_b = set(), 0
                new = set(ps)
                add = sum(nbytes[p] for p in new)
            if add > limit:
                return None
            cur |= new
            cur_b += add
        return starts

    lo = max(sum(nbytes[p] for p in set(ps)) for ps in atom_params)
    hi = sum(nbytes.values()) * max(1, len(atom_params))  # safe upper bound (tied params)
    while lo < hi:
        mid = (lo + hi) // 2
        s = greedy(mid)
        if s is not None and len(s) <= k:
            hi = mid
        else:
            lo = mid + 1
    starts = greedy(lo)
    assert starts is not None and len(starts) <= k
    # Fewer groups than asked: split the groups with the most atoms (never raises the maximum).
    while len(starts) < k:
        ends = starts[1:] + [len(atom_params)]
        g = max(range(len(starts)), key=lambda i: ends[i] - starts[i])
        assert ends[g] - starts[g] >= 2
        starts.insert(g + 1, (starts[g] + ends[g]) // 2)
    return starts


# ---------------------------------------------------------------------------------------------
# Runtime (what the generated code calls)
# ---------------------------------------------------------------------------------------------


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
    def forward(ctx: Any, rt: "_Runtime", i: int, *host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rt, ctx.i = rt, i
        ctx.set_materialize_grads(False)
        copies = rt._handoff
        rt._handoff = None
        return tuple(copies)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        rt: _Runtime = ctx.rt
        rt.release(ctx.i, "backward")
        params = rt.slices[ctx.i].params
        return (None, None, *(None if g is None else rt.to_host(g, p) for g, p in zip(grads, params)))


class _CheckpointedSlice(torch.autograd.Function):
    """One slice run for all microbatches without autograd; backward reloads the parameters and
    recomputes each microbatch with autograd on."""

    @staticmethod
    def forward(ctx: Any, rt: "_Runtime", i: int, n_in: int, *rest: Any) -> tuple[Any, ...]:
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
        rt: _Runtime = ctx.rt
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


class _Runtime:
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


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------


class OffloadedModule(nn.Module):
    """``model``'s forward as generated code that streams parameters slice by slice.

    ``code``: the driver and each slice's code; ``plan``: the :class:`SlicePlan` list;
    ``tracker``: the :class:`ResidencyTracker`; ``planned_max_resident``: how many slices may be
    resident at once (1, or 2 with prefetch). Parameters are ``model``'s own (host) parameters:
    ``offloaded.parameters()`` and ``model.parameters()`` are the same tensors.
    """

    def __init__(self, model: nn.Module, runtime: _Runtime, driver: Callable[..., Any], code: str,
                 in_spec: Any, out_spec: Any, input_shapes: list[Any], batch: int | None) -> None:
        super().__init__()
        self.model = model
        self.slices = nn.ModuleList(runtime.modules)
        self.code = code
        self._rt = runtime
        self._driver = driver
        self._in_spec, self._out_spec = in_spec, out_spec
        self._input_shapes = input_shapes
        self._batch = batch

    @property
    def plan(self) -> list[SlicePlan]:
        return self._rt.slices

    @property
    def tracker(self) -> ResidencyTracker:
        return self._rt.tracker

    @property
    def device(self) -> torch.device:
        return self._rt.device

    @property
    def num_microbatches(self) -> int:
        return self._rt.m

    @property
    def planned_max_resident(self) -> int:
        return 2 if self._rt.do_prefetch and len(self.plan) > 1 else 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            raise OffloadError(f"inputs do not have the structure of the example inputs ({self._in_spec})")
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat]
        if shapes != self._input_shapes:
            raise OffloadError(f"input shapes {shapes} differ from the example inputs' {self._input_shapes}; "
                               "the captured graph is specialised to them: call offload_parameters again")
        rt = self._rt
        per_input = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                x = x.to(rt.device)
                if rt.m > 1 and x.dim() >= 1 and x.shape[0] == self._batch:
                    per_input.append(list(torch.chunk(x, rt.m, dim=0)))
                    continue
            per_input.append([x] * rt.m)
        try:
            out = self._driver(rt, *per_input)
        finally:
            rt.release_all("forward")
        return pytree.tree_unflatten(list(out), self._out_spec)


# ---------------------------------------------------------------------------------------------
# Capture, slicing, code generation
# ---------------------------------------------------------------------------------------------


def _split_example(flat: list[Any], m: int) -> tuple[list[Any], int | None]:
    batch = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() >= 1), None)
    if m == 1:
        return flat, batch
    if batch is None:
        raise OffloadError("num_microbatches > 1 needs a tensor input with a batch dim (dim 0)")
    if batch % m:
        raise OffloadError(f"the batch size {batch} (dim 0 of the first tensor input) is not divisible "
                           f"by num_microbatches={m}")
    out = [x[: batch // m] if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch else x
           for x in flat]
    return out, batch


def _retarget_devices(graph: fx.Graph, device: torch.device) -> None:
    """Graph constants ``torch.device('cpu')`` (from capturing on CPU) -> ``device``."""
    if device.type == "cpu":
        return

    def fix(a: Any) -> Any:
        if isinstance(a, torch.device) and a.type == "cpu":
            return device
        return a

    for n in graph.nodes:
        if n.op == "call_function":
            n.args = fx.node.map_aggregate(n.args, fix)
            n.kwargs = fx.node.map_aggregate(n.kwargs, fix)


def _ident(name: str) -> str:
    return name if name.isidentifier() and not keyword.iskeyword(name) else f"v_{abs(hash(name))}"


def offload_parameters(model: nn.Module, example_args: Any, example_kwargs: Mapping[str, Any] | None = None, *,
                       num_slices: int, device: str | torch.device | None = None, num_microbatches: int = 1,
                       checkpoint_activations: bool = False, prefetch: bool | None = None,
                       tracker: ResidencyTracker | None = None) -> OffloadedModule:
    """Train ``model`` with its parameters on the host, streamed to ``device`` slice by slice.

    Args:
        model: the module, with its parameters on the CPU (they stay there; on CUDA they are
            pinned in place, the ``Parameter`` objects are kept).
        example_args, example_kwargs: inputs with the shapes the result will be called with.
        num_slices: how many contiguous slices of the graph to stream (>= 1, at most the number
            of places where the graph can be cut: nodes that use parameters).
        device: where slices compute; default ``"cuda"`` if available, else ``"cpu"``.
        num_microbatches: split the batch (dim 0) into this many microbatches per slice load.
        checkpoint_activations: keep only slice inputs and recompute each slice in backward.
        prefetch: copy the next slice's parameters while the current one computes (default: on
            CUDA only); at most two slices are then resident.
        tracker: a :class:`ResidencyTracker` to update (default: a new one).

    Returns:
        An :class:`OffloadedModule` computing what ``model`` computes.

    Raises:
        OffloadError: bad ``num_slices``/``num_microbatches``, a graph ``torch.export`` cannot
            capture, or graph features this runtime does not handle (state mutation).
    """
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
        raise OffloadError(f"num_slices must be a positive int, got {num_slices!r}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise OffloadError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if prefetch is None:
        prefetch = device.type == "cuda"
    off_host = sorted({str(p.device) for p in model.parameters() if p.device.type != "cpu"})
    if off_host:
        raise OffloadError(f"model parameters must be on the CPU (the host copy), found {off_host}; "
                           "call model.cpu() first")
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    kwargs = dict(example_kwargs or {})
    flat, in_spec = pytree.tree_flatten((example_args, kwargs))
    mb_flat, batch = _split_example(flat, num_microbatches)
    mb_args, mb_kwargs = pytree.tree_unflatten(mb_flat, in_spec)
    try:
        ep = torch.export.export(model, tuple(mb_args), dict(mb_kwargs), strict=False)
    except Exception as e:  # torch.export raises many types
        raise OffloadError(f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: {e}") from e
    if device.type == "cuda":
        for p in model.parameters():
            if not p.is_pinned():
                p.data = p.data.pin_memory()
    rt, driver, code = _build(model, ep, num_slices, device, num_microbatches, checkpoint_activations,
                              prefetch, tracker or ResidencyTracker())
    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat]
    return OffloadedModule(model, rt, driver, code, ep.call_spec.in_spec, ep.call_spec.out_spec, shapes, batch)


def _build(model: nn.Module, ep: ExportedProgram, num_slices: int, device: torch.device, m: int,
           checkpoint: bool, prefetch: bool, tracker: ResidencyTracker) -> tuple[_Runtime, Callable, str]:
    graph = ep.graph
    _retarget_devices(graph, device)
    ph = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    user_inputs: list[fx.Node] = []
    param_of: dict[fx.Node, nn.Parameter] = {}
    pname: dict[int, str] = {}
    spec_order: dict[int, int] = {}
    state_of: dict[fx.Node, torch.Tensor] = {}
    for spec in ep.graph_signature.input_specs:
        node = ph[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT:
            user_inputs.append(node)
        elif spec.kind == InputKind.PARAMETER:
            p = model.get_parameter(spec.target)
            param_of[node] = p
            pname.setdefault(id(p), spec.target)
            spec_order.setdefault(id(p), len(spec_order))
        elif spec.kind == InputKind.BUFFER:
            state_of[node] = model.get_buffer(spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            state_of[node] = ep.constants[spec.target]
        else:
            raise OffloadError(f"graph input {spec.arg.name} of kind {spec.kind.name} is not supported "
                               "(parameters, buffers, tensor constants and user inputs are)")
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise OffloadError(f"the captured graph writes {spec.kind.name} {spec.target!r} (e.g. BatchNorm "
                               "running statistics in train mode); parameter offload does not handle state "
                               "mutation: use eval() for such layers or a model without it")
    for n in graph.nodes:
        if n.op not in ("placeholder", "call_function", "output"):
            raise OffloadError(f"graph node {n.name} is a {n.op} ({n.target}); parameter offload handles flat "
                               "aten graphs (no control-flow or other higher-order ops)")
    by_id = {id(p): p for p in param_of.values()}
    nbytes = {pid: p.numel() * p.element_size() for pid, p in by_id.items()}

    # Pure functions of parameters: recomputed inside each slice that consumes them.
    derived: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "call_function":
            ins = n.all_input_nodes
            if ins and all(x in param_of or x in derived for x in ins):
                derived.add(n)
    out_node = next(n for n in graph.nodes if n.op == "output")
    for x in out_node.all_input_nodes:
        if x in derived or x in param_of or x in state_of:
            raise OffloadError(f"graph output {x.name} is a parameter/buffer (or a pure function of one); "
                               "parameter offload only returns computed values")

    def params_behind(x: fx.Node, acc: set[int]) -> set[int]:
        if x in param_of:
            acc.add(id(param_of[x]))
        elif x in derived:
            for y in x.all_input_nodes:
                params_behind(y, acc)
        return acc

    compute = [n for n in graph.nodes if n.op == "call_function" and n not in derived]
    uses = [sorted(set().union(*[params_behind(x, set()) for x in n.all_input_nodes]) if n.all_input_nodes else [])
            for n in compute]
    if not by_id:
        raise OffloadError("the model has no parameters: nothing to offload")
    # Legal cut positions: before a node that uses parameters, with no tuple value crossing.
    pos = {n: k for k, n in enumerate(compute)}
    blocked = [False] * (len(compute) + 1)
    for k, n in enumerate(compute):
        if _is_tuple_valued(n):
            last = max((pos[u] for u in n.users if u in pos), default=k)
            for c in range(k + 1, last + 1):
                blocked[c] = True
    first_user = next(k for k, u in enumerate(uses) if u)
    starts = [0] + [k for k in range(first_user + 1, len(compute)) if uses[k] and not blocked[k]]
    if num_slices > len(starts):
        raise OffloadError(
            f"num_slices={num_slices} is more than the {len(starts)} slice(s) this graph can be cut into: "
            f"it has {sum(1 for u in uses if u)} node(s) that use parameters ({len(by_id)} parameter tensors) "
            f"and slices are cut before such nodes; use num_slices <= {len(starts)}")
    atoms = [list(range(s, e)) for s, e in zip(starts, starts[1:] + [len(compute)])]
    atom_params = [sorted(set().union(*[set(uses[k]) for k in a])) for a in atoms]
    group_starts = _balance(atom_params, nbytes, num_slices)
    groups = [sum(atoms[a:b], []) for a, b in zip(group_starts, group_starts[1:] + [len(atoms)])]

    slice_of: dict[fx.Node, int] = {}
    for s, g in enumerate(groups):
        for k in g:
            slice_of[compute[k]] = s

    # Which values each slice reads from outside and must hand on.
    needed_later: dict[fx.Node, int] = {}  # value -> last slice (len = graph output) reading it
    for n in compute:
        for x in n.all_input_nodes:
            if x in slice_of or x in user_inputs:
                needed_later[x] = max(needed_later.get(x, -1), slice_of[n])
    for x in out_node.all_input_nodes:
        needed_later[x] = len(groups)

    plans: list[SlicePlan] = []
    modules: list[fx.GraphModule] = []
    states: list[list[torch.Tensor]] = []
    for s, g in enumerate(groups):
        nodes = [compute[k] for k in g]
        pids = sorted(set().union(*[set(uses[k]) for k in g]),
                      key=lambda pid: (min(k for k in g if pid in uses[k]), spec_order[pid]))
        new = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        pnode: dict[int, fx.Node] = {}
        for pid in pids:
            pnode[pid] = new.placeholder(_ident(pname[pid].replace(".", "_")))
        state_nodes = sorted({x for n in nodes for x in n.all_input_nodes if x in state_of}, key=lambda x: x.name)
        for x in state_nodes:
            env[x] = new.placeholder(x.name)
        inputs = []
        for n in nodes:
            for x in n.all_input_nodes:
                if (x in user_inputs or (x in slice_of and slice_of[x] != s)) and x not in env:
                    inputs.append(x)
                    env[x] = new.placeholder(x.name)
                    env[x].meta = dict(x.meta)

        def value(x: fx.Node) -> fx.Node:
            if x in env:
                return env[x]
            if x in param_of:
                env[x] = pnode[id(param_of[x])]
                return env[x]
            assert x in derived, x
            env[x] = new.node_copy(x, value)
            return env[x]

        for n in nodes:
            env[n] = new.node_copy(n, value)
        outputs = [n for n in nodes if needed_later.get(n, -1) > s]
        new.output(tuple(env[n] for n in outputs))
        gm = fx.GraphModule(nn.Module(), new, class_name=f"Slice{s}")
        params = [by_id[pid] for pid in pids]
        plans.append(SlicePlan(s, [pname[pid] for pid in pids], params, sum(nbytes[pid] for pid in pids),
                               [n.name for n in nodes], [x.name for x in inputs], [n.name for n in outputs]))
        modules.append(gm)
        states.append([state_of[x].to(device) for x in state_nodes])

    rt = _Runtime(plans, modules, states, device, m, checkpoint, prefetch, tracker)
    code, driver = _driver_code(plans, user_inputs, out_node, prefetch, checkpoint, m, device)
    full = code + "".join(f"\n\n# ---- self.slices[{p.index}] ----{modules[p.index].code}" for p in plans)
    return rt, driver, full


def _driver_code(plans: list[SlicePlan], user_inputs: list[fx.Node], out_node: fx.Node, prefetch: bool,
                 checkpoint: bool, m: int, device: torch.device) -> tuple[str, Callable]:
    total = sum(p.nbytes for p in plans)
    lines = [f"def forward(rt, {', '.join(n.name for n in user_inputs)}):",
             f"    # {len(plans)} slices streaming {format_bytes(total)} of parameters from host to {device}; "
             f"{'checkpointed' if checkpoint else 'autograd-tracked'} slices, {m} microbatch(es).",
             "    # Every value is a list with one entry per microbatch."]
    for p in plans:
        lines.append(f"    # slice {p.index}/{len(plans)}: {p.describe()}")
        lines.append(f"    rt.load({p.index})  # host -> {device} copies of this slice's parameters")
        if prefetch and p.index + 1 < len(plans):
            lines.append(f"    rt.prefetch({p.index + 1}, 'forward')  # side-stream copy overlaps slice {p.index}")
        call = f"rt.run({p.index}{''.join(', ' + x for x in p.inputs)})"
        if p.outputs:
            lines.append(f"    {', '.join(p.outputs)}, = {call}")
        else:
            lines.append(f"    {call}")
        lines.append(f"    rt.release({p.index}, 'forward')  # drop the device copies")
    outs = []
    for a in out_node.args[0]:
        outs.append(a.name if isinstance(a, fx.Node) else f"rt.same({a!r})")
    lines.append(f"    return rt.combine({', '.join(outs)})")
    src = "\n".join(lines) + "\n"
    glb: dict[str, Any] = {"torch": torch}
    exec(compile(src, "<param_offload driver>", "exec"), glb)
    return src, glb["forward"]
