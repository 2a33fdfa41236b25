"""Compiled execution: the local program through ``torch.compile`` (``parallelize(..., compile=True)``).

The eager program's collectives (:class:`~autoshard.runtime.collectives.MeshComm`) call
``torch.distributed`` directly and wait on ``Work`` objects, which ``torch.compile`` cannot put in a
graph: every one is a graph break. The compiled program is a copy of the same ``fx.GraphModule``
whose ``comm`` is a :class:`FunctionalComm`: the same methods (``reshard``, ``reduce_partial``,
``sync_grad``, ``gather_params``, ``shard_input`` and the kernels' ``all_reduce``) written with the
functional collectives of ``torch.ops._c10d_functional`` (an op that returns a new tensor, then
``wait_tensor``), inside ``torch.autograd.Function`` s whose forward and backward both trace, so
dynamo captures the whole forward in one graph and AOTAutograd its backward, collectives included,
with the same gradient semantics as the eager wrappers (identity backward of a resolved partial
sum, all-reduce backward of ``sync_grad``, the plan's backward moves of a resharding, one
reduce-scatter of a gathered parameter group).

What stays eager, around the compiled graph: the input checks, the step watch, and the bucketed
gradient all-reduce after backward (:mod:`autoshard.runtime.grad_sync`: hooks on the parameters,
which the compiled backward's gradients reach as the eager ones do).

Activation memory decisions: ``recompute`` segments compile (their regions are non-reentrant
``torch.utils.checkpoint`` calls, which dynamo traces into one graph; the regions' collectives are
the functional ones too). What the compiled backward recomputes inside a region is then decided by
AOTAutograd's partitioner under the regions' recompute tags, not by the generated code: on Megatron
GPT-2 (tests/distributed/test_compile.py) it re-runs the same all-gathers as eager recompute plus
one all-reduce. Not compiled (:class:`CompileError` at ``parallelize``, naming the feature):
host offload (saved-tensor hooks), partitioned checkpoints (their restore runs eager collectives),
selective runs (checkpoint regions too, not yet checked compiled), and recompute regions that update
module state (BatchNorm statistics, which the compiled backward would update again).

Differences from the eager program, by design: ``comm.counter`` cannot count collectives that run
inside a compiled graph, so calling the compiled program while the counter records is a
:class:`CompileError` (count with ``compile=False``); a collective inside the compiled graph waits
on the process group's timeout, not through the step watch (a rank that skips a backward is still
reported at its next call and in the bucketed all-reduce, as in eager).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from ..plans import Plan, PlanError
from ..memory.module_state import update_state_once
from .collectives import (MeshComm, Move, concat_blocks, concat_gathered, flatten_grads, split_blocks,
                          split_scattered, unflatten_gathered)

__all__ = ["CompileError", "CompiledProgram", "FunctionalComm", "compile_program", "compile_options"]

_ops = torch.ops._c10d_functional

Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[tuple[int, ...], str], ...]]
"""What a collective of one rank needs, as constants dynamo can specialise on: (mesh shape, this
rank's coordinate, (axes, process group name) pairs)."""


class CompileError(PlanError):
    """A plan or use that ``parallelize(..., compile=True)`` does not support (says what to do)."""


# -- functional collectives on one rank's layout ----------------------------------------------------

# (loops, not generator expressions: dynamo breaks the graph on a generator passed to a function)

def _group(layout: Layout, axes: Sequence[int]) -> str:
    key = tuple(axes)
    for group_axes, name in layout[2]:
        if group_axes == key:
            return name
    raise KeyError(f"no process group for mesh axes {key}")


def _size(layout: Layout, axes: Sequence[int]) -> int:
    n = 1
    for a in axes:
        n *= layout[0][a]
    return n


def _all_reduce(t: torch.Tensor, layout: Layout, axes: Sequence[int], op: str = "sum") -> torch.Tensor:
    return _ops.wait_tensor(_ops.all_reduce(t.contiguous(), op, _group(layout, axes)))


def _all_gather_dim0(t: torch.Tensor, layout: Layout, axes: Sequence[int]) -> torch.Tensor:
    """Blocks of all ranks of ``axes`` concatenated along dim 0 (block order = shard index)."""
    return _ops.wait_tensor(_ops.all_gather_into_tensor(t.contiguous(), _size(layout, axes), _group(layout, axes)))


def _reduce_scatter_dim0(t: torch.Tensor, layout: Layout, axes: Sequence[int]) -> torch.Tensor:
    """Sum over the ranks of ``axes``, keeping block ``shard index`` of dim 0."""
    return _ops.wait_tensor(_ops.reduce_scatter_tensor(t.contiguous(), "sum", _size(layout, axes),
                                                       _group(layout, axes)))


def run_moves(t: torch.Tensor, moves: Sequence[Move], layout: Layout) -> torch.Tensor:
    """:meth:`MeshComm.run_moves` with functional collectives (same blocks, same order)."""
    shape, coord = layout[0], layout[1]
    for kind, axis, dims in moves:
        n = shape[axis]
        if kind == "all_gather":
            t = concat_gathered(_all_gather_dim0(t, layout, (axis,)), n, dims[0])
        elif kind == "split":
            t = t.chunk(n, dims[0])[coord[axis]].contiguous()
        elif kind == "all_to_all":
            src = split_blocks(t, n, dims[1]).contiguous()
            out = _ops.wait_tensor(_ops.all_to_all_single(src, [1] * n, [1] * n, _group(layout, (axis,))))
            t = concat_blocks(out, dims[0])
        elif kind == "all_reduce":
            t = _all_reduce(t, layout, (axis,))
        elif kind == "reduce_scatter":
            t = _reduce_scatter_dim0(split_blocks(t, n, dims[0]).contiguous().flatten(0, 1), layout, (axis,))
        elif kind == "to_partial":
            t = t.clone() if coord[axis] == 0 else torch.zeros_like(t)
        else:
            raise ValueError(f"unknown resharding move {kind!r}")
    return t


class _AllReduce(torch.autograd.Function):
    """Sum over ``axes``; backward: the same sum ('sum') or the identity ('identity')."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: Layout, axes: tuple[int, ...], backward: str):  # type: ignore[override]
        ctx.layout, ctx.axes, ctx.backward = layout, axes, backward
        return _all_reduce(x, layout, axes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        if ctx.backward == "identity":
            return g, None, None, None
        return _all_reduce(g, ctx.layout, ctx.axes), None, None, None


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``axes``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: Layout, axes: tuple[int, ...]):  # type: ignore[override]
        ctx.layout, ctx.axes = layout, axes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return _all_reduce(g, ctx.layout, ctx.axes), None, None


class _Reshard(torch.autograd.Function):
    """The plan's forward moves forward, its backward moves on the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: Layout,  # type: ignore[override]
                fwd: tuple[Move, ...], bwd: tuple[Move, ...]):
        ctx.layout, ctx.bwd = layout, bwd
        return run_moves(x, fwd, layout)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return run_moves(g, ctx.bwd, ctx.layout), None, None, None


class _GatherParams(torch.autograd.Function):
    """Shards -> whole tensors through one flat all-gather; gradients back through one flat
    reduce-scatter (as :class:`autoshard.runtime.collectives._GatherParams`)."""

    @staticmethod
    def forward(ctx, layout: Layout, axes: tuple[int, ...], dims: tuple[int, ...],  # type: ignore[override]
                *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = _size(layout, axes)
        ctx.layout, ctx.axes, ctx.dims, ctx.n = layout, axes, dims, n
        ctx.shapes = [tuple(s.shape) for s in shards]
        ctx.dtype = shards[0].dtype
        blocks = _all_gather_dim0(torch.cat([s.reshape(-1) for s in shards]), layout, axes).view(n, -1)
        return unflatten_gathered(blocks, ctx.shapes, dims)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        flat = flatten_grads(grads, ctx.shapes, ctx.dims, ctx.n, ctx.dtype, _grads_device(grads))
        mine = _reduce_scatter_dim0(flat.reshape(-1), ctx.layout, ctx.axes)
        return (None, None, None, *split_scattered(mine, ctx.shapes))


def _grads_device(grads: Sequence[torch.Tensor | None]) -> torch.device:
    """The device of the first gradient that is not None (one is: backward runs for some output)."""
    for g in grads:
        if g is not None:
            return g.device
    raise ValueError("no gradient reached any gathered parameter")


# -- the comm the compiled program calls ------------------------------------------------------------

class FunctionalComm(MeshComm):
    """A :class:`MeshComm` whose graph-facing methods use functional collectives (see the module
    docstring). Shares the eager comm's groups, coordinate, counter and step watch."""

    def __init__(self, eager: MeshComm) -> None:        # noqa: D107 - no super().__init__: nothing to create
        self.device_mesh = eager.device_mesh
        self.mesh_shape = eager.mesh_shape
        self.coord = eager.coord
        self.counter = eager.counter
        self.watch = eager.watch
        self._groups = eager._groups
        self.layout: Layout = (self.mesh_shape, self.coord,
                               tuple((axes, g.group_name) for axes, g in sorted(eager._groups.items())))

    def all_reduce(self, t: torch.Tensor, axes: Sequence[int], *, op: str = "sum",
                   backward: str = "sum", phase: str | None = None) -> torch.Tensor:
        live = []
        for a in sorted(axes):
            if self.mesh_shape[a] > 1:
                live.append(a)
        axes = tuple(live)
        if not axes:
            return t
        if op != "sum" or not t.requires_grad:
            return _all_reduce(t.detach(), self.layout, axes, op)
        return _AllReduce.apply(t, self.layout, axes, backward)

    def reshard(self, x: torch.Tensor, fwd: tuple[Move, ...], bwd: tuple[Move, ...],
                parameter: bool = False) -> torch.Tensor:
        # ``parameter`` flags the copy for activation offload, which compiled programs do not run
        if not x.requires_grad:
            return run_moves(x, fwd, self.layout)
        return _Reshard.apply(x, self.layout, fwd, bwd)

    def reduce_partial(self, x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        if not x.requires_grad:
            return _all_reduce(x, self.layout, axes)
        return _AllReduce.apply(x, self.layout, axes, "identity")

    def sync_grad(self, x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        return _GradAllReduce.apply(x, self.layout, axes) if x.requires_grad else x

    def shard_input(self, x: torch.Tensor, dims: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        for d, axes in enumerate(dims):
            if axes:
                x = x.chunk(_size(self.layout, axes), d)[self.shard_index(axes)]
        return x.contiguous()

    def gather_params(self, axes: tuple[int, ...], dims: tuple[int, ...], *shards: torch.Tensor
                      ) -> tuple[torch.Tensor, ...]:
        return _GatherParams.apply(self.layout, axes, dims, *shards)

    def __repr__(self) -> str:
        return f"FunctionalComm(mesh={self.mesh_shape}, coord={self.coord})"


# -- compiling a program ----------------------------------------------------------------------------

_DEFAULTS: dict[str, Any] = {"backend": "inductor", "dynamic": False}


def compile_options(compile: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``torch.compile`` keyword arguments of ``parallelize``'s ``compile=`` (None: run eagerly)."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return dict(_DEFAULTS)
    if isinstance(compile, Mapping):
        return {**_DEFAULTS, **compile}
    from ..errors import ArgumentError

    raise ArgumentError(f"compile must be True, False or a dict of torch.compile options (e.g. "
                        f"{{'backend': 'aot_eager', 'fullgraph': True}}), got {compile!r}")


COMPILED_DECISIONS = ("recompute",)
"""Activation memory decisions whose generated regions compile (non-reentrant checkpoint regions)."""


def check_compilable(plan: Plan, module: fx.GraphModule) -> None:
    """:class:`CompileError` when the plan has activation memory decisions the compiled path does not
    run (selective, partitioned, offload), a recompute region that updates module state, or mixed
    precision (its casts and reduce-dtype collectives are not on the functional comm yet)."""
    if plan.mixed_precision is not None:
        raise CompileError(f"parallelize(compile=True) cannot compile plan {plan.model_name!r}: it is a mixed-precision "
                           f"plan (mp_policy), whose casts and reduce-dtype collectives the compiled path does not "
                           f"run yet. Run it with compile=False, or plan without mp_policy.")
    kinds: dict[str, int] = {}
    for _, decision in plan.memory_regions().values():
        if decision not in COMPILED_DECISIONS:
            kinds[decision] = kinds.get(decision, 0) + 1
    if kinds:
        what = ", ".join(f"{n} node(s) {d}" for d, n in sorted(kinds.items()))
        raise CompileError(f"parallelize(compile=True) cannot compile these activation memory decisions of plan "
                           f"{plan.model_name!r} ({what}): host offload (saved-tensor hooks) and partitioned "
                           f"checkpoints (eager collectives) do not trace, selective runs are not checked compiled "
                           f"yet; only 'recompute' segments compile. Run it with compile=False, or re-plan so "
                           f"that every activation is kept or recomputed (a larger memory_budget, or a baseline "
                           f"plan).")
    for gm in module.modules():
        if isinstance(gm, fx.GraphModule) and any(n.target is update_state_once for n in gm.graph.nodes):
            raise CompileError(f"parallelize(compile=True) cannot compile plan {plan.model_name!r}: a recomputed "
                               f"segment updates module state in place (e.g. BatchNorm running statistics), which "
                               f"the compiled backward would update a second time. Run it with compile=False, or "
                               f"re-plan keeping that segment.")


class CompiledProgram:
    """The compiled local program: a copy of ``module`` on a :class:`FunctionalComm`, through
    ``torch.compile``. Called like the eager ``module``; ``functional`` is the uncompiled copy
    (what :func:`torch._dynamo.explain` can be run on)."""

    def __init__(self, module: fx.GraphModule, comm: MeshComm, options: Mapping[str, Any]) -> None:
        self.functional = copy.deepcopy(module, memo={id(comm): FunctionalComm(comm)})
        self.counter = comm.counter
        self.options = dict(options)
        self.compiled: Callable[..., Any] = torch.compile(self.functional, **self.options)

    def __call__(self, *feeds: Any) -> Any:
        if self.counter.enabled:
            raise CompileError("comm.counter cannot count the collectives of a compiled program (they run inside "
                               "the compiled graph); record the collectives of a parallelize(..., compile=False) "
                               "model instead")
        return self.compiled(*feeds)


def compile_program(module: fx.GraphModule, comm: MeshComm, plan: Plan,
                    options: Mapping[str, Any]) -> CompiledProgram:
    """The compiled version of the local program ``module`` of ``plan`` (see the module docstring)."""
    check_compilable(plan, module)
    return CompiledProgram(module, comm, options)
