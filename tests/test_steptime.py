"""Step-time pieces that are not one node's: gradient buckets, their schedule beside backward, the
optimizer step (autoshard.solver.steptime), and that the runtime forms the same buckets."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autoshard.comm_cost import GRAD_BUCKET_BYTES, collective_cost, grad_buckets
from autoshard.hardware import load_hardware
from autoshard.solver.steptime import (SyncedGradient, SyncPricing, exposed_grad_sync,
                                       optimizer_seconds, overlap_fraction)

MESH = (2, 2)
MiB = 2**20


def test_buckets_fill_in_reverse_order_of_first_use_per_key():
    items = [("a", 10 * MiB), ("a", 10 * MiB), ("b", 1 * MiB), ("a", 10 * MiB), ("a", 30 * MiB)]
    # backward meets item 4 first: it is larger than a bucket and gets one of its own
    assert grad_buckets(items) == [[4], [3, 1], [2], [0]]
    assert grad_buckets(items, bucket_bytes=100 * MiB) == [[4, 3, 1, 0], [2]]


def test_runtime_buckets_are_the_cost_models():
    from autoshard.runtime.grad_sync import _make_buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4 * MiB, 2 * MiB, 5 * MiB, 1)]
    axes = [(0, 1), (0, 1), (1,), (0, 1)]
    buckets = _make_buckets(list(zip(params, axes)), bucket_bytes=20 * MiB)
    expected = grad_buckets([((a, torch.float32), p.numel() * 4) for p, a in zip(params, axes)], 20 * MiB)
    assert [[id(p) for p in b.params] for b in buckets] == [[id(params[i]) for i in b] for b in expected]
    assert [b.axes for b in buckets] == [axes[b[0]] for b in expected]


def _gloo(overlap: float | None):
    return dataclasses.replace(load_hardware("cpu-gloo"), overlap=overlap)


def _grads(*ready: float, nbytes: int = MiB) -> list[SyncedGradient]:
    return [SyncedGradient((0, 1), "torch.float32", nbytes, r) for r in ready]


def test_without_overlap_every_bucket_is_waited_for():
    hw = _gloo(0.0)
    grads = _grads(9.0, 5.0, 1.0)            # first used first: ready last in backward
    exposed, total = exposed_grad_sync(grads, backward_end=10.0, mesh_shape=MESH, hw=hw)
    assert total == pytest.approx(collective_cost("all_reduce", 3 * MiB, (0, 1), MESH, hw))
    # one bucket: flattened when its last gradient is ready (delaying backward), all-reduced, waited
    # for in full, then copied back into its three gradients in one pass over the bucket
    flatten = back = hw.copy_seconds(3 * MiB, "float32")
    assert exposed == pytest.approx(flatten + total + back)


def test_full_overlap_hides_buckets_that_finish_before_backward_ends():
    hw = _gloo(1.0)
    big = GRAD_BUCKET_BYTES                  # one bucket per gradient
    one = collective_cost("all_reduce", big, (0, 1), MESH, hw)
    copy = hw.copy_seconds(big, "float32")  # a flatten, and a copy back, of one bucket
    early = _grads(2.0 * one, 0.0, nbytes=big)   # second gradient ready at the start of backward
    exposed, total = exposed_grad_sync(early, backward_end=10 * one, mesh_shape=MESH, hw=hw)
    # both all-reduces hide behind backward; what is left are the copies on the compute stream
    assert total == pytest.approx(2 * one) and exposed == pytest.approx(4 * copy)
    late = _grads(10 * one, 0.0, nbytes=big)      # the last bucket starts when backward ends
    exposed, _ = exposed_grad_sync(late, backward_end=10 * one, mesh_shape=MESH, hw=hw)
    assert exposed == pytest.approx(2 * copy + one + copy)   # flattens, the last all-reduce, its copy back


def test_partial_overlap_charges_the_hidden_part_at_one_minus_overlap():
    eta = 0.25
    hw = _gloo(eta)
    big = GRAD_BUCKET_BYTES
    one = collective_cost("all_reduce", big, (0, 1), MESH, hw)
    copy = hw.copy_seconds(big, "float32")
    exposed, _ = exposed_grad_sync(_grads(0.0, nbytes=big), backward_end=10 * one, mesh_shape=MESH, hw=hw)
    assert exposed == pytest.approx(copy + (1 - eta) * one + copy)


@pytest.mark.parametrize("eta", [0.0, 0.25, 1.0])
def test_a_bucket_longer_than_the_backward_left_is_stretched_by_what_it_shares(eta):
    """A bucket that starts a quarter of its all-reduce before backward ends: without overlap the
    step pays that quarter of compute and the whole all-reduce after it, with full overlap the
    quarter hides; in between, the shared seconds cost (1 - overlap) on both streams."""
    hw = _gloo(eta)
    big = GRAD_BUCKET_BYTES
    one = collective_cost("all_reduce", big, (0, 1), MESH, hw)
    copy = hw.copy_seconds(big, "float32")
    end = 10 * one
    exposed, _ = exposed_grad_sync(_grads(end - one / 4, nbytes=big), backward_end=end, mesh_shape=MESH, hw=hw)
    assert exposed == pytest.approx(copy + one - one / 4 + (1 - eta) * one / 4 + copy)


def test_bucket_copies_are_priced_at_the_measured_pointwise_rate():
    """A flatten or copy back reads and writes the bytes once: the profile's pointwise curve at
    twice the bytes, or read + write over the memory bandwidth for a profile without curves."""
    cpu, gpu = load_hardware("cpu-gloo"), load_hardware("a100-nvlink")
    assert cpu.copy_seconds(MiB, "float32") == pytest.approx(cpu.op_seconds("pointwise", 2 * MiB, "fwd", "float32"))
    assert gpu.copy_seconds(MiB, "torch.float32") == pytest.approx(2 * MiB / gpu.memory_bandwidth)
    assert cpu.copy_seconds(0, "float32") == 0.0


def test_ilp_pricing_is_bandwidth_plus_one_latency_per_bucket():
    hw = _gloo(0.0)
    price = SyncPricing.of((0, 1), MESH, hw)
    for nbytes in (GRAD_BUCKET_BYTES, 3 * GRAD_BUCKET_BYTES):
        buckets = nbytes // GRAD_BUCKET_BYTES
        exact = buckets * collective_cost("all_reduce", GRAD_BUCKET_BYTES, (0, 1), MESH, hw)
        assert nbytes * price.seconds_per_byte() == pytest.approx(exact)


def test_optimizer_and_overlap_fall_back_without_measurements():
    gpu = load_hardware("a100-nvlink")
    assert gpu.optimizer_seconds(1, MiB) is None
    assert optimizer_seconds(gpu, MiB) == pytest.approx(7 * MiB / gpu.memory_bandwidth)
    assert overlap_fraction(gpu) == 1.0
    cpu = load_hardware("cpu-gloo")
    assert optimizer_seconds(cpu, MiB) == pytest.approx(cpu.optimizer_seconds(1, MiB))
    assert optimizer_seconds(cpu, 0) == 0.0
    assert overlap_fraction(dataclasses.replace(cpu, overlap=None)) == 0.0
