"""Single-process check of a strategy: does sharding a node this way compute the same thing?

For every device coordinate of the mesh, the global operand values are cut into the local shards
the strategy's input specs describe, the handler's local kernel runs on them, the strategy's
forward all-reduces are applied (summing over the reduced axes), and the result is compared with
the matching shard of the unsharded op's output. Backward likewise: each device back-propagates
its shard of a random output gradient (the forward all-reduce's backward is the identity), the
strategy's backward all-reduces are applied, and the input gradients are compared with the
shards of the unsharded op's gradients. Operands the op updates in place (batch-norm running
stats) are compared after the op with the shards of the unsharded op's updated values.

Devices run as threads of one process; kernels that need a collective inside the op (sync
batch-norm statistics, a global token count) get a :class:`SimulatedComm` whose all-reduce meets
the other threads at a barrier, forward and backward, exactly as the runtime's DeviceMesh one does.
"""
from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .kernel_comm import MeshCoordinates
from .opinfo import OpInfo
from .specs import ShardSpec
from .strategy import BWD, FWD, Strategy


def shard_of(t: torch.Tensor, spec: ShardSpec, mesh_shape: Sequence[int], coord: Sequence[int]) -> torch.Tensor:
    """The block of ``t`` that the device at ``coord`` holds under ``spec`` (partial axes ignored)."""
    for d, axes in enumerate(spec.dims):
        if not axes:
            continue
        n = math.prod(mesh_shape[a] for a in axes)
        idx = 0
        for a in axes:                       # outer axis first
            idx = idx * mesh_shape[a] + coord[a]
        t = t.chunk(n, d)[idx]
    return t


@dataclass
class CheckResult:
    strategy: str
    simulated: bool


def _axes_of(strategy: Strategy, phase: str, operand: str) -> tuple[int, ...]:
    """Axes of the partial-output (fwd) or gradient (bwd) all-reduces of one operand.

    Collectives inside the op (``ExtraComm``) are labelled otherwise; the kernel performs them.
    """
    axes: set[int] = set()
    for c in strategy.comm:
        if c.phase == phase and c.operand == operand:
            if c.kind != "all_reduce":
                raise AssertionError(f"unexpected {c.kind} on {operand} in strategy {strategy.name}")
            axes |= set(c.axes)
    return tuple(sorted(axes))


def _group_sum(values: dict, coord: tuple[int, ...], axes: tuple[int, ...], mesh_shape) -> torch.Tensor:
    """Sum of ``values[c]`` over the coordinates that differ from ``coord`` only on ``axes``."""
    total = None
    for c, v in values.items():
        if all(c[a] == coord[a] for a in range(len(mesh_shape)) if a not in axes):
            total = v if total is None else total + v
    assert total is not None
    return total


class _Rendezvous:
    """Where the device threads of a simulated mesh exchange tensors for a collective."""

    def __init__(self, mesh_shape: Sequence[int]):
        self.mesh_shape = tuple(mesh_shape)
        self.barrier = threading.Barrier(math.prod(mesh_shape), timeout=60)
        self.slots: dict[tuple[int, ...], torch.Tensor] = {}

    def all_reduce(self, coord: tuple[int, ...], t: torch.Tensor, axes: Sequence[int], op: str) -> torch.Tensor:
        self.slots[coord] = t.detach().clone()
        self.barrier.wait()
        group = [v for c, v in self.slots.items()
                 if all(c[a] == coord[a] for a in range(len(self.mesh_shape)) if a not in axes)]
        out = torch.stack(group).sum(0) if op == "sum" else torch.stack(group).amax(0)
        self.barrier.wait()
        return out


class SimulatedComm(MeshCoordinates):
    """DeviceComm of one thread of a simulated mesh (see :mod:`autoshard.kernel_comm`)."""

    def __init__(self, rendezvous: _Rendezvous, coord: tuple[int, ...]):
        self.rv = rendezvous
        self.coord = coord
        self.mesh_shape = rendezvous.mesh_shape

    def all_reduce(self, t: torch.Tensor, axes: Sequence[int], *, op: str = "sum",
                   backward: str = "sum", phase: str | None = None) -> torch.Tensor:
        axes = tuple(axes)
        if op != "sum" or not t.requires_grad:
            return self.rv.all_reduce(self.coord, t, axes, op)
        comm = self

        class _AllReduce(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):  # type: ignore[override]
                return comm.rv.all_reduce(comm.coord, x, axes, "sum")

            @staticmethod
            def backward(ctx, g):  # type: ignore[override]
                return comm.rv.all_reduce(comm.coord, g, axes, "sum") if backward == "sum" else g

        return _AllReduce.apply(t)


def run_on_simulated_mesh(mesh_shape: Sequence[int], fn: Callable[[tuple[int, ...], SimulatedComm], object]
                          ) -> dict[tuple[int, ...], object]:
    """Run ``fn(coord, comm)`` once per device coordinate, each in its own thread; results by coord."""
    rv = _Rendezvous(mesh_shape)
    coords = list(itertools.product(*(range(s) for s in mesh_shape)))
    results: dict[tuple[int, ...], object] = {}
    errors: list[BaseException] = []

    def body(c: tuple[int, ...]) -> None:
        try:
            results[c] = fn(c, SimulatedComm(rv, c))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            errors.append(e)
            rv.barrier.abort()

    threads = [threading.Thread(target=body, args=(c,)) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results


def _run(kernel, op: OpInfo, tensors: Sequence[torch.Tensor], comm=None) -> tuple[torch.Tensor, ...]:
    by_node = dict(zip(op.operand_nodes, tensors))
    args, kwargs = pytree.tree_map(lambda x: by_node.get(x, x) if isinstance(x, fx.Node) else x,
                                   (kernel.args, kernel.kwargs))
    if kernel.uses_comm:
        kwargs = {**kwargs, "comm": comm}
    out = kernel.target(*args, **kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def check_strategy(op: OpInfo, handler, strategy: Strategy, values: Sequence[torch.Tensor], *,
                   rtol: float = 1e-9, atol: float = 1e-10, seed: int = 0) -> CheckResult:
    """Raise AssertionError if ``strategy`` does not reproduce the op's forward and backward.

    Floating values are promoted to float64, so that a wrong rule shows as an O(1) error while
    summation-order rounding stays far below the tolerance (fp32 tolerances are the multi-process
    suite's business).
    """
    values = [v.double() if v.dtype.is_floating_point else v for v in values]
    mesh_shape = op.mesh.shape
    grad_flags = [op.operand_requires_grad(j) for j in range(len(values))]
    g_inputs = [v.detach().clone().requires_grad_(f) for v, f in zip(values, grad_flags)]
    ref_kernel = handler.kernel(op, _replicated_like(strategy))
    ref_out = run_on_simulated_mesh((1, 1), lambda c, comm: _run(ref_kernel, op, g_inputs, comm))[(0, 0)]
    gen = torch.Generator().manual_seed(seed)
    grad_out = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if o is not None and o.requires_grad
                else None for o in ref_out]
    ref_grads = _grads(ref_out, grad_out, g_inputs)

    kernel = handler.kernel(op, strategy)
    local_in = {}
    partial_out: dict = {}
    gather = threading.Barrier(math.prod(mesh_shape), timeout=60)

    def device(c: tuple[int, ...], comm: SimulatedComm) -> list:
        local_in[c] = [shard_of(v.detach(), s, mesh_shape, c).clone().requires_grad_(f)
                       for v, s, f in zip(values, strategy.input_specs, grad_flags)]
        partial_out[c] = _run(kernel, op, local_in[c], comm)
        gather.wait()           # every device's partial outputs are in before they are summed
        outs = []
        for j, o in enumerate(partial_out[c]):
            axes = _axes_of(strategy, FWD, f"out{j}")
            if axes:   # all-reduce: value of the sum, gradient flows to this device's summand only
                others = _group_sum({k: v[j].detach() for k, v in partial_out.items()}, c, axes, mesh_shape)
                o = o + (others - o.detach())
            outs.append(o)
        outs_t = tuple(outs)
        if kernel.epilogue is not None:
            outs_t = kernel.epilogue(outs_t, local_in[c])
        for j, (o, ref) in enumerate(zip(outs_t, ref_out)):
            spec = strategy.output_specs[j]
            if spec is None:
                continue
            want = shard_of(ref.detach(), spec, mesh_shape, c)
            _assert_close(o.detach(), want, rtol, atol, f"{op.describe()} strategy {strategy.name!r}: "
                                                        f"forward output {j} on device {c}")
        # Operands updated in place (batch-norm running stats, a step counter) must hold the
        # shard of what the unsharded op left in them; untouched operands trivially do.
        for j, (t, ref_in) in enumerate(zip(local_in[c], g_inputs)):
            want = shard_of(ref_in.detach(), strategy.input_specs[j], mesh_shape, c)
            _assert_close(t.detach(), want, rtol, atol, f"{op.describe()} strategy {strategy.name!r}: "
                                                        f"operand {j} after the op on device {c}", equal_nan=True)
        g_local = [None if g is None else shard_of(g, s, mesh_shape, c)
                   for g, s in zip(grad_out, strategy.output_specs)]
        return _grads(outs_t, g_local, local_in[c])

    local_grads = run_on_simulated_mesh(mesh_shape, device)
    for c in local_grads:
        for j, ref in enumerate(ref_grads):
            if ref is None:
                continue
            axes = _axes_of(strategy, BWD, f"in{j}")
            got = _group_sum({k: v[j] for k, v in local_grads.items()}, c, axes, mesh_shape) if axes \
                else local_grads[c][j]
            want = shard_of(ref, strategy.input_specs[j], mesh_shape, c)
            _assert_close(got, want, rtol, atol, f"{op.describe()} strategy {strategy.name!r}: "
                                                 f"gradient of operand {j} on device {c}")
    return CheckResult(strategy.name, True)


def _replicated_like(strategy: Strategy) -> Strategy:
    """The all-replicated counterpart (for the reference kernel: no tags, so no special-casing)."""
    return Strategy("reference", tuple(ShardSpec.replicate(s.ndim) for s in strategy.input_specs),
                    tuple(None if s is None else ShardSpec.replicate(s.ndim) for s in strategy.output_specs),
                    0.0, 0.0, (), strategy.memory)


def _grads(outs: Sequence[torch.Tensor], grad_out: Sequence[torch.Tensor | None],
           inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    pairs = [(o, g) for o, g in zip(outs, grad_out) if g is not None and o.requires_grad]
    need = [t for t in inputs if t.requires_grad]
    if not pairs or not need:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], need, [g for _, g in pairs], allow_unused=True))
    result = []
    for t in inputs:
        if not t.requires_grad:
            result.append(None)
            continue
        g = next(got)
        result.append(torch.zeros_like(t) if g is None else g)
    return result


def _assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str,
                  equal_nan: bool = False) -> None:
    """``equal_nan`` for operands compared after the op: an untouched NaN must still match itself."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: local shape {tuple(got.shape)} != expected {tuple(want.shape)}")
    if got.dtype.is_floating_point:
        torch.testing.assert_close(got, want.to(got.dtype), rtol=rtol, atol=atol, equal_nan=equal_nan,
                                   msg=lambda m: f"{what}: {m}")
    elif not torch.equal(got, want):
        raise AssertionError(f"{what}: values differ")
