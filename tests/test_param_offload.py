"""Parameter offload (autoshard.offload): training through the offloaded module
equals training the plain model, and the residency accounting stays within the plan."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from autoshard.models import build_model
from autoshard.offload import OffloadError, offload_parameters

RTOL, ATOL = 1e-5, 1e-6


class ResMLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x)) + x
        return nn.functional.mse_loss(self.head(x), y)


def _train(model, params, loss_fn, steps=3):
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train_accumulating(model, batch_kwargs, m, steps=3):
    """Plain model, gradients accumulated over m microbatches of a mean loss (loss / m each)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        b = next(iter(batch_kwargs.values())).shape[0] // m
        for k in range(m):
            out = model(**{n: v[k * b:(k + 1) * b] for n, v in batch_kwargs.items()})
            loss = (out if isinstance(out, torch.Tensor) else out.loss) / m
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


def _assert_same_params(a: nn.Module, b: nn.Module, noise: dict[str, slice] | None = None) -> None:
    """``noise``: parts of parameters whose true gradient is exactly zero, so that the
    rounding noise of a different summation order is all AdamW sees (and scales to +-lr)."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        for suffix, part in (noise or {}).items():
            if name.endswith(suffix):
                keep = torch.ones(p.shape[0], dtype=torch.bool)
                keep[part] = False
                p, q = p[keep], q[keep]
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda s: f"{name}: {s}")


@pytest.fixture(scope="module")
def mlp_data():
    torch.manual_seed(0)
    return ResMLP(), torch.randn(8, 16), torch.randn(8, 4)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_mlp_training_matches_plain(mlp_data, checkpoint, prefetch):
    base, x, y = mlp_data
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    off = offload_parameters(model, (x, y), num_slices=4, checkpoint_activations=checkpoint, prefetch=prefetch,
                             device="cpu")
    want = _train(ref, ref.parameters(), lambda m: m(x, y))
    got = _train(off, model.parameters(), lambda m: m(x, y))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    _assert_same_params(model, ref)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert off.planned_max_resident == (2 if prefetch else 1)
    assert off.tracker.max_slices == off.planned_max_resident
    assert off.tracker.max_bytes <= sum(sorted(p.nbytes for p in off.plan)[-off.planned_max_resident:])
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert off.tracker.max_bytes < total
    # every slice was loaded in forward and again in backward, each step
    phases = {(e.phase, e.slice) for e in off.tracker.events if e.action in ("load", "prefetch")}
    assert phases == {(ph, i) for ph in ("forward", "backward") for i in range(4)}


@pytest.mark.parametrize("checkpoint", [False, True])
def test_mlp_microbatches(mlp_data, checkpoint):
    base, x, y = mlp_data
    model, ref, acc = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    off = offload_parameters(model, (x, y), num_slices=3, num_microbatches=2, checkpoint_activations=checkpoint,
                             device="cpu")
    full = _train(ref, ref.parameters(), lambda m: m(x, y))
    got = _train(off, model.parameters(), lambda m: m(x, y))
    want = _train_accumulating(acc, {"x": x, "y": y}, 2)
    # mean-reduced loss over equal microbatches: the average of microbatch losses is the batch loss
    torch.testing.assert_close(got, full, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    _assert_same_params(model, acc)
    assert off.tracker.max_slices == 1


@pytest.fixture(scope="module")
def gpt2():
    model, args, kwargs = build_model("gpt2-tiny", device="cpu", batch=4)
    return model, args, kwargs


def test_gpt2_training_matches_plain(gpt2):
    base, args, kwargs = gpt2
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    off = offload_parameters(model, args, kwargs, num_slices=4, prefetch=True, device="cpu")
    # tied embedding / LM head: loaded by the first and by the last slice
    assert "transformer.wte.weight" in off.plan[0].param_names
    assert any(p is model.lm_head.weight for p in off.plan[-1].params)
    # nothing but the graph's saved activations survives the forward: no parameter copy
    out = off(*args, **kwargs)
    gc.collect()
    assert len(off._rt.live_copies) == 0 and off.tracker.resident == {}
    del out
    off.tracker.reset()
    want = _train(ref, ref.parameters(), lambda m: m(*args, **kwargs).loss)
    got = _train(off, model.parameters(), lambda m: m(*args, **kwargs).loss)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    _assert_same_params(model, ref)
    assert off.tracker.max_slices <= off.planned_max_resident == 2
    assert off.tracker.resident == {}


def test_gpt2_checkpointed_microbatches(gpt2):
    base, args, kwargs = gpt2
    model, ref, acc = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    off = offload_parameters(model, args, kwargs, num_slices=3, num_microbatches=2, checkpoint_activations=True,
                             device="cpu")
    full = _train(ref, ref.parameters(), lambda m: m(*args, **kwargs).loss)
    got = _train(off, model.parameters(), lambda m: m(*args, **kwargs).loss)
    want = _train_accumulating(acc, kwargs, 2)
    # HF GPT-2's labels loss is a token mean; with no ignored labels every microbatch has the same
    # token count, so the microbatch average is the full-batch loss.
    torch.testing.assert_close(got, full, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # The key bias of attention gets a zero gradient (softmax ignores a per-row shift); the
    # recomputation sums its ~1e-10 rounding noise in another order and AdamW turns it into +-lr.
    _assert_same_params(model, acc, noise={"attn.c_attn.bias": slice(32, 64)})
    assert off.tracker.max_slices == 1
    logits = off(*args, **kwargs).logits
    assert logits.shape == (4, 16, 128)


def test_code_shows_slice_loads(mlp_data):
    base, x, y = mlp_data
    off = offload_parameters(copy.deepcopy(base), (x, y), num_slices=3, prefetch=True, device="cpu")
    code = off.code
    for i in range(3):
        assert f"rt.load({i})" in code and f"rt.release({i}, 'forward')" in code
        assert f"# ---- self.slices[{i}] ----" in code
    assert "rt.prefetch(1, 'forward')" in code and "rt.prefetch(2, 'forward')" in code
    assert "torch.ops.aten.linear.default" in code
    assert "layers.0.weight" in code  # the slice comment names its parameters


def test_bad_num_slices(mlp_data):
    base, x, y = mlp_data
    with pytest.raises(OffloadError, match="num_slices must be a positive int, got 0"):
        offload_parameters(base, (x, y), num_slices=0)
    with pytest.raises(OffloadError, match=r"num_slices=50 is more than the 7 slice\(s\).*7 node\(s\) that use "
                                           r"parameters"):
        offload_parameters(base, (x, y), num_slices=50)
    with pytest.raises(OffloadError, match="not divisible by num_microbatches=3"):
        offload_parameters(base, (x, y), num_slices=2, num_microbatches=3)
    off = offload_parameters(base, (x, y), num_slices=7, device="cpu")  # the most there is
    assert len(off.plan) == 7
    with pytest.raises(OffloadError, match="input shapes"):
        off(x[:4], y[:4])
