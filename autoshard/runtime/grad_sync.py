"""Bucketed gradient synchronisation of parameters replicated over mesh axes (DDP-style).

A parameter that every use reads in its stored layout, and whose gradient each rank computes as a
partial sum over the same mesh axes, is not all-reduced per use in the graph. Its gradient is caught
once autograd has accumulated it into ``.grad`` (a post-accumulate hook); parameters are grouped
into buckets (by axes and dtype, in reverse order of first use, so buckets fill in the order
backward produces gradients); a full bucket is flattened into its buffer and all-reduced
asynchronously while backward goes on; at the end of backward every bucket is waited for and the
summed gradients written back. Each copy is one multi-tensor op over the bucket. A bucket's buffer
is allocated once and kept, as DDP keeps its buckets: on CPU ranks a fresh 14 MiB buffer per step
cost 6-80 ms of page faults on 4 ranks sharing 2 cores (the plans' memory counts the buffers,
``grad_buckets``). Gradient accumulation over several backward passes is exact: a hook before
accumulation keeps this pass's gradient and what ``.grad`` held before it, and the result is
``previous + reduced``, never ``previous`` reduced twice. Under mixed precision (``reduce_dtype``) a
bucket is all-reduced in that dtype and the sum written back in the gradient's own (the master's)
dtype; buckets are sized in the reduce dtype, as planned.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm_cost import GRAD_BUCKET_BYTES, grad_buckets
from .collectives import BWD, MeshComm

DEFAULT_BUCKET_BYTES = GRAD_BUCKET_BYTES


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class GradBucket(NamedTuple):
    """One bucket of parameter gradients the runtime all-reduces as a single flat tensor after
    backward: over mesh ``axes``, in ``dtype``, ``nbytes`` per device, holding ``params`` gradients."""

    axes: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    params: int


@dataclass
class _Bucket:
    axes: tuple[int, ...]
    params: list[torch.nn.Parameter]
    dtype: torch.dtype                   # what the bucket is all-reduced in
    slices: dict[int, tuple[int, int]] = field(default_factory=dict)   # id(param) -> (offset, numel) in flat
    incoming: dict[int, torch.Tensor] = field(default_factory=dict)    # id(param) -> this pass's gradient
    previous: dict[int, torch.Tensor | None] = field(default_factory=dict)
    flat: torch.Tensor | None = None     # allocated once, kept from step to step (fresh CPU memory page-faults)
    views: dict[int, torch.Tensor] = field(default_factory=dict)       # id(param) -> its slice of flat, shaped
    work: object = None

    def __post_init__(self) -> None:
        offset = 0
        for p in self.params:
            self.slices[id(p)] = (offset, _local(p).numel())
            offset += _local(p).numel()

    def allocate(self, device: torch.device) -> None:
        """The buffer and each parameter's view of it, made once: slicing per gradient per step cost
        ~8 us each in Python on a CPU rank."""
        if self.flat is not None:
            return
        self.flat = torch.empty(sum(n for _, n in self.slices.values()), dtype=self.dtype, device=device)
        for p in self.params:
            offset, n = self.slices[id(p)]
            self.views[id(p)] = self.flat[offset:offset + n].view(_local(p).shape)

    def describe(self) -> GradBucket:
        numel = sum(n for _, n in self.slices.values())
        return GradBucket(self.axes, self.dtype, numel * self.dtype.itemsize, len(self.params))

    def reset(self) -> None:
        self.incoming.clear()
        self.previous.clear()
        self.work = None


class GradSync:
    """Installs the hooks on ``params`` (pairs of parameter and gradient all-reduce axes)."""

    def __init__(self, comm: MeshComm, params: Sequence[tuple[torch.nn.Parameter, tuple[int, ...]]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype | None = None) -> None:
        self.comm = comm
        self.buckets = _make_buckets(params, bucket_bytes, reduce_dtype)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.armed = False
        self.enabled = True
        for b in self.buckets:
            for p in b.params:
                p.register_hook(self._accumulating_hook_for(p))
                p.register_post_accumulate_grad_hook(self._accumulated_hook)

    def _accumulating_hook_for(self, p: torch.nn.Parameter):
        """Before autograd accumulates into a ``.grad`` that holds a gradient already (accumulation over
        backward passes): keep this pass's gradient and a copy of what ``.grad`` held. Nothing is kept
        otherwise: a reference held past this hook would stop autograd from taking the incoming
        gradient as ``.grad`` and make it copy every gradient (~10 us each on a CPU rank)."""
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self.enabled and p.grad is not None:
                b = self.bucket_of[id(p)]
                b.incoming[id(p)] = _local(grad)
                b.previous[id(p)] = _local(p.grad).clone()
            return grad

        return hook

    def _accumulated_hook(self, p: torch.nn.Parameter) -> None:
        """After autograd accumulated ``p``'s gradient: this pass's gradient is ``.grad`` itself unless
        the hook before kept it; a bucket whose gradients are all in is launched."""
        if not self.enabled:
            return
        if not self.armed:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.armed = True
        b = self.bucket_of[id(p)]
        if id(p) not in b.incoming:
            b.incoming[id(p)] = _local(p.grad)
            b.previous[id(p)] = None
        if len(b.incoming) == len(b.params):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        """Flatten the gradients into the bucket's buffer (one multi-tensor copy, casting to the
        reduce dtype) and all-reduce it asynchronously."""
        grads = list(b.incoming.values())
        b.allocate(grads[0].device)
        for p in b.params:
            if id(p) not in b.incoming:        # no gradient this pass: its slice is summed as zeros
                b.views[id(p)].zero_()
        torch._foreach_copy_([b.views[i] for i in b.incoming], grads)
        self.comm.counter.add("all_reduce", b.axes, BWD, b.flat.numel() * b.flat.element_size())
        b.work = dist.all_reduce(b.flat, group=self.comm.group(b.axes), async_op=True)

    def _write_back(self, b: _Bucket) -> None:
        """The summed bucket into the gradients: one multi-tensor copy (casting back from the reduce
        dtype), as DDP's reducer does it in C++, not a Python copy per gradient (on a GPU that loop was
        a launch-bound ~10 us per gradient), then what ``.grad`` held before this pass added back."""
        params = {id(p): p for p in b.params}
        order = list(b.incoming)
        grads = [_local(params[i].grad) for i in order]
        torch._foreach_copy_(grads, [b.views[i] for i in order])
        accumulated = [(g, b.previous[i]) for g, i in zip(grads, order) if b.previous[i] is not None]
        if accumulated:
            torch._foreach_add_([g for g, _ in accumulated], [prev for _, prev in accumulated])

    def _finish(self) -> None:
        self.armed = False
        for b in self.buckets:
            if b.incoming and b.work is None:
                self._launch(b)          # a bucket some of whose parameters got no gradient
        for b in self.buckets:
            if b.work is None:
                continue
            self.comm.wait(b.work)
            self._write_back(b)
            b.reset()


def _make_buckets(params: Sequence[tuple[torch.nn.Parameter, tuple[int, ...]]], bucket_bytes: int,
                  reduce_dtype: torch.dtype | None = None) -> list[_Bucket]:
    """Buckets as :func:`autoshard.comm_cost.grad_buckets` forms them (the cost model prices the same),
    sized in the dtype they are reduced in."""
    def size(p: torch.Tensor) -> int:
        item = reduce_dtype.itemsize if reduce_dtype is not None and p.is_floating_point() else p.element_size()
        return p.numel() * item

    def reduced_in(p: torch.Tensor) -> torch.dtype:
        return reduce_dtype if reduce_dtype is not None and p.is_floating_point() else p.dtype

    items = [((axes, _local(p).dtype), size(_local(p))) for p, axes in params]
    return [_Bucket(params[b[0]][1], [params[i][0] for i in b], reduced_in(_local(params[b[0]][0])))
            for b in grad_buckets(items, bucket_bytes)]
