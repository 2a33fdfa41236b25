"""SavedTensorMeter: exact byte counts, worked out by hand, for tiny models on CPU."""
from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from autoshard.memory import (
    CHECKPOINT_META,
    HOST_OFFLOAD_COUNTER,
    OFFLOAD_META,
    apply_memory_annotations,
)
from autoshard.runtime.memory_meter import SavedTensorMeter

F32 = 4  # bytes


def tiny_mlp() -> nn.Sequential:
    """x(3,4) -> Linear(4,8, no bias) -> ReLU -> Linear(8,2, no bias)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2, bias=False))


# What the tiny MLP saves, with x(3,4) not requiring grad:
#   linear 1: x (for W1's grad). W1 is not saved: nobody needs the grad of x.
#   relu:     its output r(3,8).
#   linear 2: r again (same storage, counted once) and W2.t() (a view of the parameter W2(2,8)).
X_BYTES = 3 * 4 * F32      # 48
R_BYTES = 3 * 8 * F32      # 96
W1_BYTES = 8 * 4 * F32     # 128
W2_BYTES = 2 * 8 * F32     # 64


def test_tiny_mlp_exact_bytes_and_release_in_backward() -> None:
    model, x = tiny_mlp(), torch.randn(3, 4)
    with SavedTensorMeter() as meter:
        out = model(x)
    after_forward = meter.report()
    assert after_forward.saved_tensors == 4
    assert after_forward.activation_bytes == X_BYTES + R_BYTES
    assert after_forward.parameter_bytes == W2_BYTES
    assert after_forward.live_activation_bytes == X_BYTES + R_BYTES
    out.sum().backward()
    after_backward = meter.report()
    assert after_backward.live_activation_bytes == 0
    assert after_backward.peak_activation_bytes == X_BYTES + R_BYTES
    assert after_backward.host_offload_bytes == 0
    assert (after_backward.cuda_peak_allocated_delta is None) == (not torch.cuda.is_available())


def test_input_requiring_grad_saves_first_weight_too() -> None:
    model, x = tiny_mlp(), torch.randn(3, 4, requires_grad=True)
    with SavedTensorMeter() as meter:
        model(x)
    report = meter.report()
    assert report.saved_tensors == 5  # + W1.t() for x's grad
    assert report.activation_bytes == X_BYTES + R_BYTES
    assert report.parameter_bytes == W1_BYTES + W2_BYTES


def test_views_of_one_storage_count_once() -> None:
    a = torch.randn(4, 4, requires_grad=True)
    with SavedTensorMeter() as meter:
        b = a.exp()           # saves its result b
        c = b[0] * b[1]       # saves the views b[0] and b[1]: both live in b's storage
    report = meter.report()
    assert report.saved_tensors == 3
    assert report.activation_bytes == 4 * 4 * F32
    del b, c
    assert meter.report().live_activation_bytes == 0


def test_saved_view_counts_its_whole_storage() -> None:
    a = torch.randn(16, 4)
    w = torch.randn(4, 4, requires_grad=True)
    with SavedTensorMeter() as meter:
        (a[:2] @ w).sum()     # saves the (2,4) slice, which keeps all of a's (16,4) storage alive
    assert meter.report().activation_bytes == 16 * 4 * F32


def test_params_argument_moves_buffers_to_parameter_bytes() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 8, bias=False)
            self.register_buffer("scale", torch.full((8,), 2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale   # mul saves scale (for the grad of lin(x))

    model, x = Scaled(), torch.randn(3, 4)
    with SavedTensorMeter() as unaware:
        model(x)
    with SavedTensorMeter([*model.parameters(), *model.buffers()]) as aware:
        model(x)
    assert (unaware.report().activation_bytes, unaware.report().parameter_bytes) == (X_BYTES + 8 * F32, 0)
    assert (aware.report().activation_bytes, aware.report().parameter_bytes) == (X_BYTES, 8 * F32)


def test_dropping_the_graph_without_backward_releases() -> None:
    model, x = tiny_mlp(), torch.randn(3, 4)
    with SavedTensorMeter() as meter:
        out = model(x)
    del out  # no reference cycle keeps the graph: released at once, no gc needed
    assert meter.report().live_activation_bytes == 0


def test_retain_graph_keeps_saved_tensors_until_last_backward() -> None:
    model, x = tiny_mlp(), torch.randn(3, 4)
    with SavedTensorMeter() as meter:
        loss = model(x).sum()
    loss.backward(retain_graph=True)
    assert meter.report().live_activation_bytes == X_BYTES + R_BYTES
    loss.backward()
    assert meter.report().live_activation_bytes == 0


def test_peak_is_per_live_set_total_is_cumulative() -> None:
    model = tiny_mlp()
    with SavedTensorMeter() as meter:
        for _ in range(2):  # two micro-batches, each released by its backward
            model(torch.randn(3, 4)).sum().backward()
    report = meter.report()
    assert report.activation_bytes == 2 * (X_BYTES + R_BYTES)
    assert report.peak_activation_bytes == X_BYTES + R_BYTES
    assert report.parameter_bytes == W2_BYTES  # the same W2 storage both times


def test_checkpoint_leaves_only_its_inputs() -> None:
    model, x = tiny_mlp(), torch.randn(3, 4, requires_grad=True)
    with SavedTensorMeter() as meter:
        checkpoint(model, x, use_reentrant=False)
    report = meter.report()
    assert (report.saved_tensors, report.activation_bytes, report.parameter_bytes) == (1, X_BYTES, 0)


def test_nested_meters_both_see_the_tensors() -> None:
    model, x = tiny_mlp(), torch.randn(3, 4)
    with SavedTensorMeter() as outer:
        with SavedTensorMeter() as inner:
            model(x).sum().backward()
    for meter in (outer, inner):
        assert meter.report().activation_bytes == X_BYTES + R_BYTES
        assert meter.report().live_activation_bytes == 0


def test_a_meter_measures_one_window() -> None:
    meter = SavedTensorMeter()
    with meter:
        pass
    with pytest.raises(RuntimeError, match="one window"):
        meter.__enter__()


# -- with autoshard.memory offload regions ----------------------------------------------------------


def _annotated_mlp(checkpoint_nodes: dict[int, object], offload_nodes: dict[int, object]):
    gm = fx.symbolic_trace(tiny_mlp())
    nodes = [n for n in gm.graph.nodes if n.op == "call_module"]  # 0: linear 1, 1: relu, 2: linear 2
    for index, label in checkpoint_nodes.items():
        nodes[index].meta[CHECKPOINT_META] = label
    for index, label in offload_nodes.items():
        nodes[index].meta[OFFLOAD_META] = label
    return gm, apply_memory_annotations(gm)


@pytest.mark.parametrize("region, flags, device_bytes, host_bytes", [
    # relu + linear 2, offload the rest: r (relu's output; linear 2 saves the same tensor, one copy).
    ([1, 2], [0, False, True], X_BYTES, R_BYTES),
    # relu + linear 2, offload inputs only: their input is linear 1's output, which neither saves.
    ([1, 2], [0, True, False], X_BYTES + R_BYTES, 0),
    # linear 2 alone, inputs only: r is copied for linear 2, but relu (outside) keeps r on device.
    ([2], [0, True, False], X_BYTES + R_BYTES, R_BYTES),
    ([1, 2], [0, True, True], X_BYTES, R_BYTES),
])
def test_offload_region_bytes(region: list[int], flags: list, device_bytes: int, host_bytes: int) -> None:
    gm, annotated = _annotated_mlp({}, {i: flags for i in region})
    x = torch.randn(3, 4)
    live_before = HOST_OFFLOAD_COUNTER.live_bytes
    with SavedTensorMeter() as meter:
        out = annotated(x)
    report = meter.report()
    assert report.activation_bytes == device_bytes
    assert report.parameter_bytes == W2_BYTES  # parameters are never offloaded, the meter sees them
    assert report.host_offload_bytes == host_bytes
    assert report.host_offload_tensors == (1 if host_bytes else 0)
    assert HOST_OFFLOAD_COUNTER.live_bytes - live_before == host_bytes
    out.sum().backward()
    assert HOST_OFFLOAD_COUNTER.live_bytes == live_before
    assert meter.report().live_activation_bytes == 0
    torch.testing.assert_close(out, gm(x), rtol=0, atol=0)


class _TwoHeads(nn.Module):
    """Two linears read one 3D activation: each saves a fresh 2D view of it (the view object dies
    once packed, its base lives on)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8, bias=False), nn.Linear(4, 8, bias=False)

    def forward(self, x):
        h = torch.relu(x)
        return self.a(h) + self.b(h)


def test_fresh_views_of_one_live_tensor_are_offloaded_once() -> None:
    gm = fx.symbolic_trace(_TwoHeads())
    linears = [n for n in gm.graph.nodes if n.op == "call_module" and n.target in ("a", "b")]
    for n in linears:
        n.meta[OFFLOAD_META] = [0, True, True]
    annotated = apply_memory_annotations(gm)
    x = torch.randn(2, 3, 4)
    packed = HOST_OFFLOAD_COUNTER.packed_tensors, HOST_OFFLOAD_COUNTER.packed_bytes
    out = annotated(x)
    assert (HOST_OFFLOAD_COUNTER.packed_tensors - packed[0], HOST_OFFLOAD_COUNTER.packed_bytes - packed[1]) \
        == (1, 2 * 3 * 4 * F32)                       # relu's output, saved (as a 2D view) by both
    out.sum().backward()
    torch.testing.assert_close(out, gm(x), rtol=0, atol=0)



class _MaskedScores(nn.Module):
    """A mask broadcast over heads (stride 0), saved by the op that reads it, as CUDA's SDPA saves
    its attention bias."""

    def forward(self, scores, mask):
        return scores * mask.expand_as(scores)


def test_broadcast_views_are_offloaded_as_the_memory_they_read() -> None:
    gm = fx.symbolic_trace(_MaskedScores())
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta[OFFLOAD_META] = [0, True, True]
    annotated = apply_memory_annotations(gm)
    scores = torch.randn(2, 8, 5, 5, requires_grad=True)
    mask = torch.rand(2, 1, 5, 5)
    packed = HOST_OFFLOAD_COUNTER.packed_tensors, HOST_OFFLOAD_COUNTER.packed_bytes
    out = annotated(scores, mask)
    # mul saves only the expanded mask (the scores' gradient needs it; the mask needs none): 2x1x5x5 copied, not 2x8x5x5
    assert (HOST_OFFLOAD_COUNTER.packed_tensors - packed[0], HOST_OFFLOAD_COUNTER.packed_bytes - packed[1]) \
        == (1, 2 * 5 * 5 * F32)
    out.backward(torch.ones_like(out))
    expected = scores.detach().clone().requires_grad_()
    (expected * mask.expand_as(expected)).backward(torch.ones_like(out))
    torch.testing.assert_close(scores.grad, expected.grad, rtol=0, atol=0)

def test_offloaded_checkpoint_inputs_leave_the_meter() -> None:
    # Checkpoint inputs offloaded with torch's save_on_cpu are not seen by the meter (documented).
    _, kept = _annotated_mlp({0: 0, 1: 0, 2: 0}, {})
    _, offloaded = _annotated_mlp({0: 0, 1: 0, 2: 0}, {0: True})
    x = torch.randn(3, 4, requires_grad=True)
    with SavedTensorMeter() as kept_meter:
        kept(x)
    with SavedTensorMeter() as offloaded_meter:
        offloaded(x)
    assert kept_meter.report().activation_bytes == X_BYTES
    assert offloaded_meter.report().activation_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_delta_and_pinned_offload_round_trip() -> None:
    gm, annotated = _annotated_mlp({}, {1: [0, True, True], 2: [0, True, True]})
    gm.cuda()
    x = torch.randn(3, 4, device="cuda")
    with SavedTensorMeter() as meter:
        out = annotated(x)
    out.sum().backward()
    report = meter.report()
    assert report.host_offload_bytes == R_BYTES
    assert report.cuda_peak_allocated_delta is not None and report.cuda_peak_allocated_delta > 0
    grads = [p.grad.clone() for p in gm.parameters()]
    gm.zero_grad(set_to_none=True)
    gm(x).sum().backward()
    for g, p in zip(grads, gm.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)
