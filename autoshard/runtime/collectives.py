"""Collectives of a plan on a real process group: per-axis groups, autograd-correct wrappers, a counter.

:class:`MeshComm` is the runtime's :class:`autoshard.kernel_comm.DeviceComm`: one per rank, built
from a torch ``DeviceMesh``. Besides the all-reduce the kernels use, it runs the resharding moves
of :mod:`autoshard.reshard` (all-gather, split, all-to-all, all-reduce, reduce-scatter,
to-partial) on local shards, and records every collective in a :class:`CommCounter` with the byte
convention of :mod:`autoshard.comm_cost`, so that measured traffic can be compared with the plan's.

Autograd: the forward all-reduce that resolves a partial output has an identity backward (the
gradient of a sum is handed to every summand); the gradient all-reduce of an operand that is
replicated where the computation is split is an identity forward with an all-reduce backward;
a resharding runs the plan's forward moves forward and the plan's backward moves (gradient
resharding, consumer spec back to producer spec) backward.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from ..kernel_comm import MeshCoordinates
from ..phases import Phase
from ..memory.param_flag import PARAMETER_FLAG
from .step_watch import StepWatch

FWD, BWD, RECOMPUTE = Phase.FWD, Phase.BWD, Phase.RECOMPUTE

Move = tuple[str, int, tuple[int, ...]]
"""One resharding move: (kind, mesh axis, dims) as in :class:`autoshard.reshard.ReshardStep`."""


@dataclass(frozen=True)
class CommRecord:
    kind: str
    axes: tuple[int, ...]
    phase: str
    nbytes: int


class CommCounter:
    """Every collective a rank runs: kind, mesh axes, phase and bytes per device (comm_cost.py convention).

    ``with counter.recording():`` collects records; :meth:`totals` sums bytes and counts by
    (kind, axes, phase), the same key as :attr:`autoshard.Plan.comm`.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self.enabled = False

    def add(self, kind: str, axes: Sequence[int], phase: str, nbytes: int) -> None:
        if self.enabled:
            self.records.append(CommRecord(kind, tuple(axes), phase, int(nbytes)))

    def clear(self) -> None:
        self.records.clear()

    def recording(self) -> "_Recording":
        return _Recording(self)

    def totals(self) -> dict[tuple[str, tuple[int, ...], str], tuple[int, int]]:
        """(kind, axes, phase) -> (bytes per device, number of calls)."""
        out: dict[tuple[str, tuple[int, ...], str], list[int]] = defaultdict(lambda: [0, 0])
        for r in self.records:
            t = out[(r.kind, r.axes, r.phase)]
            t[0] += r.nbytes
            t[1] += 1
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}


class _Recording:
    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def __enter__(self) -> CommCounter:
        self.counter.clear()
        self.counter.enabled = True
        return self.counter

    def __exit__(self, *exc: object) -> None:
        self.counter.enabled = False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MeshComm(MeshCoordinates):
    """Collectives of one rank over the mesh axes of a ``DeviceMesh`` (see the module docstring)."""

    def __init__(self, device_mesh, counter: CommCounter | None = None) -> None:
        self.device_mesh = device_mesh
        self.mesh_shape: tuple[int, ...] = tuple(device_mesh.shape)
        self.coord: tuple[int, ...] = tuple(int(c) for c in device_mesh.get_coordinate())
        self.counter = counter or CommCounter()
        self.watch: StepWatch | None = None      # set by the parallel module: waits that notice a skipped backward
        self._groups = {(a,): device_mesh.get_group(a) for a in range(len(self.mesh_shape))}
        # Both axes: the mesh covers the world (init_mesh checks), in row-major rank order, which is
        # the outer-axis-first block order of a dim sharded over (0, 1).
        self._groups[tuple(range(len(self.mesh_shape)))] = dist.group.WORLD

    @property
    def phase(self) -> str:
        """Phase of a forward collective: 'recompute' when it runs inside backward (a checkpointed
        region's forward again), else 'fwd'. Gradient collectives say 'bwd' themselves."""
        return RECOMPUTE if torch._C._current_graph_task_id() != -1 else FWD

    # -- DeviceComm (axis_index / shard_index from MeshCoordinates) -----------------------------

    def all_reduce(self, t: torch.Tensor, axes: Sequence[int], *, op: str = "sum",
                   backward: str = "sum", phase: str | None = None) -> torch.Tensor:
        """Autograd-aware all-reduce over ``axes`` (see :class:`autoshard.kernel_comm.DeviceComm`)."""
        axes = self.live_axes(axes)
        if not axes:
            return t
        if op != "sum" or not t.requires_grad:
            return self.raw_all_reduce(t.detach().clone(), axes, op=op, phase=phase)
        return _AllReduce.apply(t, self, axes, backward)

    # -- raw collectives on local tensors (counted) --------------------------------------------

    def live_axes(self, axes: Sequence[int]) -> tuple[int, ...]:
        return tuple(sorted(a for a in axes if self.mesh_shape[a] > 1))

    def group(self, axes: Sequence[int]):
        return self._groups[tuple(axes)]

    def wait(self, work) -> None:
        """Wait for an async collective (through :class:`StepWatch` when the parallel module keeps
        one: a rank that skipped backward is then an error here in seconds, not a hang)."""
        if self.watch is None:
            work.wait()
        else:
            self.watch.wait(work)

    def raw_all_reduce(self, t: torch.Tensor, axes: Sequence[int], *, op: str = "sum",
                       phase: str | None = None) -> torch.Tensor:
        """In-place all-reduce of a contiguous tensor; returns it."""
        t = t.contiguous()
        self.counter.add("all_reduce", axes, phase or self.phase, _nbytes(t))
        self.wait(dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group(axes),
                                  async_op=True))
        return t

    def all_gather(self, t: torch.Tensor, axis: int, dim: int, phase: str) -> torch.Tensor:
        """Un-shard ``dim`` over ``axis``: the shards, gathered block after block, concatenated along
        ``dim`` (:func:`concat_gathered`, whose copy :mod:`autoshard.reshard` prices). The result is
        contiguous, as the single-device op's output is: a later aten.view needs the strides."""
        n = self.mesh_shape[axis]
        src = t.contiguous()
        out = torch.empty((n * src.shape[0], *src.shape[1:]), dtype=t.dtype, device=t.device)
        self.counter.add("all_gather", (axis,), phase, _nbytes(out))
        self.wait(dist.all_gather_single(out, src, group=self.group((axis,)), async_op=True))
        return concat_gathered(out, n, dim)

    def gather_flat(self, piece: torch.Tensor, axes: Sequence[int], phase: str) -> torch.Tensor:
        """All-gather equal flat pieces over ``axes`` (block order = shard index): the flat whole."""
        n = self.shard_count(axes)
        out = torch.empty(n * piece.numel(), dtype=piece.dtype, device=piece.device)
        self.counter.add("all_gather", tuple(axes), phase, _nbytes(out))
        self.wait(dist.all_gather_single(out, piece.contiguous().reshape(-1), group=self.group(tuple(axes)),
                                         async_op=True))
        return out

    def reduce_scatter_flat(self, whole: torch.Tensor, axes: Sequence[int], phase: str) -> torch.Tensor:
        """Sum ``n`` equal flat blocks over ``axes`` and keep block ``shard index`` (the inverse of
        :meth:`gather_flat`)."""
        n = self.shard_count(axes)
        whole = whole.contiguous().reshape(-1)
        out = torch.empty(whole.numel() // n, dtype=whole.dtype, device=whole.device)
        self.counter.add("reduce_scatter", tuple(axes), phase, _nbytes(whole))
        self.wait(dist.reduce_scatter_single(out, whole, group=self.group(tuple(axes)), async_op=True))
        return out

    def split(self, t: torch.Tensor, axis: int, dim: int) -> torch.Tensor:
        return t.chunk(self.mesh_shape[axis], dim)[self.coord[axis]].contiguous()

    def all_to_all(self, t: torch.Tensor, axis: int, dim_from: int, dim_to: int, phase: str) -> torch.Tensor:
        """Un-shard ``dim_from`` and shard ``dim_to`` over ``axis``."""
        n = self.mesh_shape[axis]
        src = split_blocks(t, n, dim_to).contiguous()
        out = torch.empty_like(src)
        self.counter.add("all_to_all", (axis,), phase, _nbytes(t))
        self.wait(dist.all_to_all_single(out, src, group=self.group((axis,)), async_op=True))
        return concat_blocks(out, dim_from)

    def reduce_scatter(self, t: torch.Tensor, axis: int, dim: int, phase: str) -> torch.Tensor:
        n = self.mesh_shape[axis]
        # the n blocks laid out one after another along dim 0, as the collective splits its input
        blocks = split_blocks(t, n, dim).contiguous()
        src = blocks.flatten(0, 1)
        out = torch.empty_like(blocks[0])
        self.counter.add("reduce_scatter", (axis,), phase, _nbytes(t))
        self.wait(dist.reduce_scatter_single(out, src, group=self.group((axis,)), async_op=True))
        return out

    def to_partial(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        return t.clone() if self.coord[axis] == 0 else torch.zeros_like(t)

    def run_moves(self, t: torch.Tensor, moves: Sequence[Move], phase: str) -> torch.Tensor:
        """Apply resharding moves to a local shard (no autograd: see :func:`reshard`)."""
        for kind, axis, dims in moves:
            if kind == "all_gather":
                t = self.all_gather(t, axis, dims[0], phase)
            elif kind == "split":
                t = self.split(t, axis, dims[0])
            elif kind == "all_to_all":
                t = self.all_to_all(t, axis, dims[0], dims[1], phase)
            elif kind == "all_reduce":
                t = self.raw_all_reduce(t.clone(), (axis,), phase=phase)
            elif kind == "reduce_scatter":
                t = self.reduce_scatter(t, axis, dims[0], phase)
            elif kind == "to_partial":
                t = self.to_partial(t, axis)
            else:
                raise ValueError(f"unknown resharding move {kind!r}")
        return t

    # -- what generated code calls (``comm.reshard(x, ...)``; see the functions below) ----------

    def reshard(self, x: torch.Tensor, fwd: tuple[Move, ...], bwd: tuple[Move, ...],
                parameter: bool = False, grad_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``parameter``: ``x`` is a parameter shard; its resharded copy (e.g. all-gathered for a
        consumer, as ZeRO-3 does) is flagged so that activation offload treats it as a parameter.
        ``grad_dtype``: the dtype the gradient's backward moves run in (mixed precision's reduce
        dtype; the result is returned in ``x``'s dtype)."""
        out = reshard(x, self, fwd, bwd, grad_dtype)
        if parameter:
            _flag_parameter(out)
        return out

    def reduce_partial(self, x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        return reduce_partial(x, self, axes)

    def sync_grad(self, x: torch.Tensor, axes: tuple[int, ...], grad_dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
        return sync_grad(x, self, axes, grad_dtype)

    def rank_share(self, x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        """This rank's value of a sum pending over ``axes``, scaled so that the mean over the ranks
        is the sum (a DDP rank's loss); autograd passes the gradient through unscaled, as to the
        summand itself, so that summing the gradients over ``axes`` differentiates the sum."""
        return _ScaleValue.apply(x, math.prod(self.mesh_shape[a] for a in axes))

    def cast_param(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A parameter shard cast to the working dtype (mixed precision), flagged as a parameter
        copy for activation offload; its gradient flows back to the master in the master's dtype."""
        out = x.to(dtype)
        if out is not x:
            _flag_parameter(out)
        return out

    def shard_input(self, x: torch.Tensor, dims: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        return shard_input(x, self, dims)

    def gather_params(self, axes: tuple[int, ...], dims: tuple[int, ...], *shards: torch.Tensor,
                      param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
                      ) -> tuple[torch.Tensor, ...]:
        """The whole parameters of a gather group (shard ``i`` split on dim ``dims[i]`` over
        ``axes``): one all-gather forward, one reduce-scatter of their gradients backward (which
        arrive as partial sums over ``axes``); flagged as parameters for activation offload.
        Mixed precision (as FSDP2): the shards are cast to ``param_dtype`` before the all-gather,
        the gradients reduce-scattered in ``reduce_dtype`` and returned in the shards' dtype."""
        whole = _GatherParams.apply(self, axes, dims, param_dtype, reduce_dtype, *shards)
        for t in whole:
            _flag_parameter(t)
        return whole

    def __repr__(self) -> str:
        return f"MeshComm(mesh={self.mesh_shape}, coord={self.coord})"


def _flag_parameter(t: torch.Tensor) -> None:
    """Flag a parameter copy, and its base where it is a view (a gathered group is views of one
    buffer; the views autograd saves, ``weight.t()``, see only the base)."""
    setattr(t, PARAMETER_FLAG, True)
    if t._base is not None:
        setattr(t._base, PARAMETER_FLAG, True)


# -- autograd wrappers ---------------------------------------------------------------------------

class _ScaleValue(torch.autograd.Function):
    """``x * factor`` forward, the gradient unscaled backward (see :meth:`MeshComm.rank_share`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: int):  # type: ignore[override]
        return x * factor

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, None


class _AllReduce(torch.autograd.Function):
    """Sum over ``axes``; backward: the same sum ('sum') or the identity ('identity')."""

    @staticmethod
    def forward(ctx, x, comm: MeshComm, axes: tuple[int, ...], backward: str):  # type: ignore[override]
        ctx.comm, ctx.axes, ctx.backward = comm, axes, backward
        return comm.raw_all_reduce(x.detach().clone(), axes, phase=comm.phase)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if ctx.backward == "identity":
            return g, None, None, None
        return ctx.comm.raw_all_reduce(g.clone(), ctx.axes, phase=BWD), None, None, None


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``axes`` (a replicated operand of a split
    computation: each device holds a partial sum of its gradient), in ``grad_dtype`` if given."""

    @staticmethod
    def forward(ctx, x, comm: MeshComm, axes: tuple[int, ...], grad_dtype: torch.dtype | None):  # type: ignore[override]
        ctx.comm, ctx.axes, ctx.grad_dtype = comm, axes, grad_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        buf = g.to(ctx.grad_dtype, copy=True) if ctx.grad_dtype is not None else g.clone()
        return ctx.comm.raw_all_reduce(buf, ctx.axes, phase=BWD).to(g.dtype), None, None, None


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: MeshComm, fwd: tuple[Move, ...], bwd: tuple[Move, ...],  # type: ignore[override]
                grad_dtype: torch.dtype | None):
        ctx.comm, ctx.bwd, ctx.grad_dtype = comm, bwd, grad_dtype
        return comm.run_moves(x.detach(), fwd, comm.phase)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if ctx.grad_dtype is None:
            return ctx.comm.run_moves(g, ctx.bwd, BWD), None, None, None, None
        return ctx.comm.run_moves(g.to(ctx.grad_dtype), ctx.bwd, BWD).to(g.dtype), None, None, None, None


class _GatherParams(torch.autograd.Function):
    """Shards -> whole tensors through one flat all-gather; gradients back through one flat
    reduce-scatter. Rank ``k`` (shard index over ``axes``) holds block ``k`` of each sharded dim; its
    shards lie one after another in their own layouts in block ``k`` of the gathered buffer (see
    :func:`unflatten_gathered` and :func:`flatten_grads` for the copies in and out)."""

    @staticmethod
    def forward(ctx, comm: MeshComm, axes: tuple[int, ...], dims: tuple[int, ...],  # type: ignore[override]
                param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = comm.shard_count(axes)
        dtype = param_dtype if param_dtype is not None else shards[0].dtype
        ctx.comm, ctx.axes, ctx.dims, ctx.n = comm, axes, dims, n
        ctx.shapes = [tuple(s.shape) for s in shards]
        ctx.dtype, ctx.device = dtype, shards[0].device
        ctx.reduce_dtype, ctx.shard_dtypes = reduce_dtype, [s.dtype for s in shards]
        flat = torch.cat([s.detach().reshape(-1).to(dtype) for s in shards])
        blocks = comm.gather_flat(flat, axes, comm.phase).view(n, -1)
        return unflatten_gathered(blocks, ctx.shapes, dims)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        dtype = ctx.reduce_dtype if ctx.reduce_dtype is not None else ctx.dtype
        flat = flatten_grads(grads, ctx.shapes, ctx.dims, ctx.n, dtype, ctx.device)
        mine = ctx.comm.reduce_scatter_flat(flat, ctx.axes, BWD)
        out = split_scattered(mine, ctx.shapes)
        return (None, None, None, None, None, *(o.to(stored) for o, stored in zip(out, ctx.shard_dtypes)))


def unflatten_gathered(blocks: torch.Tensor, shapes: Sequence[Sequence[int]], dims: Sequence[int]
                       ) -> tuple[torch.Tensor, ...]:
    """The whole tensors from one flat all-gather's ``(n, -1)`` blocks: row ``k`` holds rank ``k``'s
    shards (of ``shapes``, sharded along ``dims``) one after another; each whole tensor is its ``n``
    blocks concatenated along its dim (:func:`concat_blocks`: one copy, or a view)."""
    n = blocks.shape[0]
    out, start = [], 0
    for shape, d in zip(shapes, dims):
        k = math.prod(shape)
        out.append(concat_blocks(blocks[:, start:start + k].view(n, *shape), d))
        start += k
    return tuple(out)


def flatten_grads(grads: Sequence[torch.Tensor | None], shapes: Sequence[Sequence[int]],
                  dims: Sequence[int], n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The gradients of gathered tensors as ``(n, -1)`` blocks in ``dtype`` for one flat
    reduce-scatter (the layout :func:`unflatten_gathered` reads): one copy per gradient, in runs of a
    block's dim and the dims inside it; a tensor with no gradient contributes zeros."""
    flat = torch.empty((n, sum(math.prod(s) for s in shapes)), dtype=dtype, device=device)
    start = 0
    for g, shape, d in zip(grads, shapes, dims):
        k = math.prod(shape)
        dst = flat[:, start:start + k].view(n, *shape)
        if g is None:
            dst.zero_()
        else:
            dst.copy_(split_blocks(g, n, d))
        start += k
    return flat


def split_scattered(mine: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """This rank's flat reduce-scattered block back into one gradient per shard (views)."""
    out, start = [], 0
    for shape in shapes:
        k = math.prod(shape)
        out.append(mine[start:start + k].view(tuple(shape)))
        start += k
    return out


def split_blocks(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``x`` cut into ``n`` equal blocks along ``dim``, stacked along a new dim 0 (a view)."""
    shape = tuple(x.shape)
    return x.view(*shape[:dim], n, shape[dim] // n, *shape[dim + 1:]).movedim(dim, 0)


def concat_blocks(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """The blocks along dim 0 of ``blocks`` (``(n, *shape)``) concatenated along ``dim`` of
    ``shape``: a view where every dim before ``dim`` has size 1 and ``blocks`` is contiguous, else
    one copy in runs of a block's ``dim`` and the dims inside it. Contiguous either way."""
    n, shape = blocks.shape[0], tuple(blocks.shape[1:])
    if math.prod(shape[:dim]) == 1 and blocks.is_contiguous():
        return blocks.view(*shape[:dim], n * shape[dim], *shape[dim + 1:])
    return torch.cat(blocks.unbind(0), dim=dim)


# -- the functions generated code calls ------------------------------------------------------------

def reduce_partial(x: torch.Tensor, comm: MeshComm, axes: tuple[int, ...]) -> torch.Tensor:
    """Resolve a partial output: all-reduce forward, identity backward."""
    if not x.requires_grad:
        return comm.raw_all_reduce(x.detach().clone(), axes)
    return _AllReduce.apply(x, comm, axes, "identity")


def sync_grad(x: torch.Tensor, comm: MeshComm, axes: tuple[int, ...],
              grad_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient over ``axes`` backward (in ``grad_dtype`` if given)."""
    return _GradAllReduce.apply(x, comm, axes, grad_dtype) if x.requires_grad else x


def reshard(x: torch.Tensor, comm: MeshComm, fwd: tuple[Move, ...], bwd: tuple[Move, ...],
            grad_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Move a local shard to another layout; its gradient takes the plan's backward moves (in
    ``grad_dtype`` if given)."""
    if not x.requires_grad:
        return comm.run_moves(x, fwd, comm.phase)
    return _Reshard.apply(x, comm, fwd, bwd, grad_dtype)


def shard_input(x: torch.Tensor, comm: MeshComm, dims: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """This rank's block of a global tensor: dim ``d`` split over mesh axes ``dims[d]``."""
    for d, axes in enumerate(dims):
        if axes:
            n = comm.shard_count(axes)
            x = x.chunk(n, d)[comm.shard_index(axes)]
    return x.contiguous() if not x.is_contiguous() else x


def concat_gathered(blocks: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``n`` equal blocks gathered one after another along dim 0 of ``blocks`` (an all-gather's
    output), concatenated along ``dim`` instead (:func:`concat_blocks`)."""
    return concat_blocks(blocks.view(n, blocks.shape[0] // n, *blocks.shape[1:]), dim)


def gather_whole(x: torch.Tensor, comm: MeshComm, dims: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """The global tensor of this rank's block ``x`` (the inverse of :func:`shard_input`): one all-gather
    per sharded dim over the group of its mesh axes (a dim sharded over both axes in one, on the
    all-device group, whose rank order is the block order). Not counted in ``comm.counter``: state dicts
    and gathered gradients are not part of a training step's collectives."""
    for d, axes in enumerate(dims):
        live = comm.live_axes(axes)
        if not live:
            continue
        n = comm.shard_count(live)
        src = x.contiguous()
        out = torch.empty((n * src.shape[0], *src.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, src, group=comm.group(live))
        x = concat_gathered(out, n, d)
    return x.contiguous()


def iter_moves(steps: Sequence[object]) -> Iterator[Move]:
    """Plan step entries (with ``kind``, ``axis``, ``dims``) as moves."""
    for s in steps:
        yield (str(s.kind), int(s.axis), tuple(int(d) for d in s.dims))  # type: ignore[attr-defined]
