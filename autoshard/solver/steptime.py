"""The parts of a training step's time that are not one node's: gradient sync and the optimizer.

The runtime (:mod:`autoshard.runtime.grad_sync`) does not all-reduce a parameter's gradient where
an op produces it. Parameters read in their stored layout whose every use needs the same gradient
all-reduce are grouped into buckets (:func:`autoshard.comm_cost.grad_buckets`: by mesh axes and dtype,
filled in reverse order of first use up to ``GRAD_BUCKET_BYTES``); a bucket is all-reduced
asynchronously as soon as backward has produced all of its gradients, while backward goes on, and
the step waits for every bucket before the optimizer runs. So the step is a critical path over
two streams:

- compute stream: forward, then backward (ops, their inline collectives and resharding);
- communication stream: the buckets, in launch order, each starting when its last gradient is
  ready and the previous bucket is done.

A bucket that runs while backward still computes is hidden up to the profile's measured
``overlap`` fraction (1 where communication has its own engine, as NCCL on GPUs; on CPU ranks
sharing cores much less): the seconds the two share cost ``(1 - overlap)`` of themselves on the
compute stream and, as much, on the communication stream (at ``overlap`` 0 the two run one after
the other: a bucket that starts 1 ms before backward ends still costs its whole all-reduce after
that millisecond of compute). What is left of the communication stream after backward ends is exposed in
full. :func:`exposed_grad_sync` computes that exactly for one assignment (what
:func:`~autoshard.solver.evaluate.predict` reports); :class:`SyncPricing` gives the ILP its linear
approximation: per mesh-axis set, bytes over the bucket bandwidth plus one latency per bucket
(``bytes / GRAD_BUCKET_BYTES`` of them, and at least one when any gradient syncs there), less what
``overlap`` of the backward can hide, and never less than one bucket latency.

Bucketing copies: the runtime flattens a bucket's gradients into one buffer (a ``cat``) before its
all-reduce and copies the summed buffer back into the gradients after it (one multi-tensor copy),
two memory-bound passes over the bucket's bytes on the compute stream
(:meth:`~autoshard.hardware.HardwareProfile.copy_seconds`; on CPU ranks, where a 25 MiB pass costs
milliseconds, they were the largest unmodeled part of a
data-parallel step). The flatten delays backward and the bucket's start; the copy back runs after
each bucket's wait.

The optimizer step runs on each device's local shards after the sync: measured
(``HardwareProfile.optimizer_seconds``) or, without a measurement, AdamW's memory traffic over the
device's bandwidth (:func:`optimizer_seconds`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ..comm_cost import GRAD_BUCKET_BYTES, collective_cost, grad_buckets

if TYPE_CHECKING:
    from ..hardware import HardwareProfile

ADAMW_TRAFFIC = 7
"""Bytes AdamW moves per byte of parameter without a measurement: reads parameter, gradient and
both moments, writes parameter and both moments."""


def optimizer_seconds(hw: "HardwareProfile", nbytes: float, n_tensors: int = 1) -> float:
    """Seconds of the optimizer step over ``n_tensors`` tensors of ``nbytes`` in all (0 for none)."""
    if nbytes <= 0 or n_tensors <= 0:
        return 0.0
    measured = hw.optimizer_seconds(n_tensors, nbytes)
    return measured if measured is not None else ADAMW_TRAFFIC * nbytes / hw.memory_bandwidth


def bucket_copy_seconds(hw: "HardwareProfile", nbytes: float, dtype: str) -> float:
    """The ILP's linear price of the copies of one gradient of ``nbytes`` that is bucketed: its share
    of flattening a full bucket, and of copying one back out."""
    if nbytes <= 0:
        return 0.0
    return 2.0 * hw.copy_seconds(GRAD_BUCKET_BYTES, dtype) * nbytes / GRAD_BUCKET_BYTES


def overlap_fraction(hw: "HardwareProfile") -> float:
    """How much of an asynchronous all-reduce compute hides: measured, else 1 for devices with
    memory of their own (GPUs: NCCL runs beside the kernels) and 0 for CPU ranks."""
    if hw.overlap is not None:
        return float(hw.overlap)
    return 1.0 if hw.device_memory_separate else 0.0


@dataclass(frozen=True)
class SyncPricing:
    """Linear pricing of bucketed gradient all-reduces over one set of mesh axes (for the ILP):
    ``latency`` seconds per bucket and ``per_byte`` seconds per byte at the bucket size."""

    axes: tuple[int, ...]
    latency: float
    per_byte: float

    @staticmethod
    def of(axes: tuple[int, ...], mesh_shape: Sequence[int], hw: "HardwareProfile") -> "SyncPricing":
        latency = collective_cost("all_reduce", 0, axes, mesh_shape, hw, measured_small=False)
        full = collective_cost("all_reduce", GRAD_BUCKET_BYTES, axes, mesh_shape, hw, measured_small=False)
        return SyncPricing(axes, latency, (full - latency) / GRAD_BUCKET_BYTES)

    def seconds_per_byte(self) -> float:
        """Bandwidth plus the bucket latencies a byte accounts for."""
        return self.per_byte + self.latency / GRAD_BUCKET_BYTES


@dataclass(frozen=True)
class SyncedGradient:
    """One parameter's bucketed gradient: its bucket key (mesh axes, dtype), bytes per device,
    and the backward time (seconds from the start of backward) at which it is complete."""

    axes: tuple[int, ...]
    dtype: str
    nbytes: int
    ready: float


def exposed_grad_sync(grads: Sequence[SyncedGradient], backward_end: float, mesh_shape: Sequence[int],
                      hw: "HardwareProfile") -> tuple[float, float]:
    """``(exposed, total)`` seconds of bucketed gradient sync: what the step waits for beyond a
    backward of ``backward_end`` seconds (the bucket flattens it is delayed by, the compute-stream
    slowdown of the overlapped part, the wait for the last bucket and the copies back), and the
    buckets' summed all-reduce time. ``grads`` in order of first use in forward."""
    eta = overlap_fraction(hw)
    buckets = grad_buckets([((g.axes, g.dtype), g.nbytes) for g in grads])
    comm_end = overlapped = total = flattened = 0.0
    done: list[tuple[float, float]] = []         # per bucket: its all-reduce's end, its copy back
    for bucket in buckets:
        first = grads[bucket[0]]
        nbytes = sum(grads[i].nbytes for i in bucket)
        cost = collective_cost("all_reduce", nbytes, first.axes, mesh_shape, hw)
        flattened += hw.copy_seconds(nbytes, first.dtype)
        start = max(comm_end, max(grads[i].ready for i in bucket) + flattened)
        shared = max(0.0, min(cost, backward_end + flattened - start))
        overlapped += shared
        # both streams stretch by the un-hidden shared seconds: at overlap 0 the step pays both
        comm_end = start + cost + (1.0 - eta) * shared
        total += cost
        done.append((comm_end, hw.copy_seconds(nbytes, first.dtype)))
    clock = backward_end + flattened + (1.0 - eta) * overlapped
    for end, copy_back in done:                  # the runtime waits for each bucket, then copies it back
        clock = max(clock, end) + copy_back
    return clock - backward_end, total
