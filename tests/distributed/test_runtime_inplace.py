"""Models written with in-place ops, and models calling custom ops, train on 4 gloo ranks exactly
like one device.

Capture makes their in-place ops out-of-place (``autoshard.capture.functionalize_inplace``): a
residual CNN whose blocks do ``out += identity`` (BatchNorm in training, its running stats and step
counters updated as on one device), and an attention layer that does ``scores.masked_fill_``.
3 AdamW steps under the solved plan and baseline plans give the same losses, parameters and
buffers as single-device training (fp32, rtol 1e-5, atol 1e-6; parameters 3e-5, see PARAM_ATOL),
and the communication recorded in a step equals the plan's. Custom ops (``custom_ops_lib``): one with a registered decomposition
(inlined by capture, sharded like its aten ops) and an opaque one run replicated under
``fallback="replicate"``. A tiny Mixtral (MoE routing ops and transformers' custom grouped matmul,
sharded by their handlers).
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.plans import Plan
from autoshard.runtime import capture_meta
from custom_ops_lib import example as custom_op_example
from inplace_models import ResidualBlock
from runtime_harness import ATOL, RTOL, device_mesh, on_all_ranks

STEPS = 3
LR = 1e-3
# AdamW moves an element by up to lr per step whatever its gradient's size, so an element whose
# gradient nearly cancels moves by a rounding-dependent fraction of lr (Mixtral's experts: 1 element
# in 8192 by 1.4e-6): parameters are compared to 1% of the most AdamW moves them (a wrong gradient
# moves them by up to 100%), losses and buffers at ATOL.
PARAM_ATOL = 1e-2 * LR * STEPS


class ResidualCNN(nn.Module):
    def __init__(self, c: int = 8, classes: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(ResidualBlock(c), ResidualBlock(c))
        self.fc = nn.Linear(c, classes)

    def forward(self, x, y):
        h = self.blocks(self.stem(x)).mean((2, 3))
        return nn.functional.cross_entropy(self.fc(h), y)


class MaskedAttention(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(d, d) for _ in range(3))
        # no key bias: its gradient is zero up to rounding (softmax ignores a per-row constant),
        # and AdamW would turn that rounding noise into full-size steps
        self.k = nn.Linear(d, d, bias=False)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        scores.masked_fill_(mask, -1e4)
        out = self.o(scores.softmax(-1) @ self.v(x))
        out.mul_(0.5)
        return out.pow(2).mean()


class LMLoss(nn.Module):
    """A Hugging Face causal LM whose forward takes token ids and returns the loss."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids, use_cache=False).loss


def _model(name: str):
    if name == "mixtral_tiny":
        import transformers

        torch.manual_seed(0)
        cfg = transformers.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32)
        return LMLoss(transformers.MixtralForCausalLM(cfg)), (torch.randint(0, 64, (8, 8)),)
    if name.startswith("custom_"):
        return custom_op_example(name[len("custom_"):])
    torch.manual_seed(0)
    if name == "residual_cnn":
        return ResidualCNN(), (torch.randn(8, 3, 8, 8), torch.randint(0, 8, (8,)))
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1).expand(8, 8, 8).contiguous()
    return MaskedAttention(), (torch.randn(8, 8, 16), causal)


def _train(model, args, steps: int, counter=None) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        with counter.recording() if counter is not None and step == 0 else contextlib.nullcontext():
            loss = model(*args)
            loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _run(name: str, kind: str, fallback: str = "error") -> None:
    mesh_shape = (2, 2)
    model, args = _model(name)
    graph = capture_meta(model, args, name=name)
    assert not [n for n in graph.nodes() if getattr(n.target, "_schema", None) is not None
                and n.target._schema.is_mutable and not graph.is_buffer(n.args[0])], \
        "capture left in-place ops on activations"
    box = [None]
    if dist.get_rank() == 0:
        plan = autoshard.plan(graph, mesh=mesh_shape, hardware="h100-nvlink", fallback=fallback,
                              baseline=None if kind == "solved" else kind)
        assert bool(plan.fallbacks) == (fallback == "replicate")
        box = [plan.to_dict()]
    dist.broadcast_object_list(box, 0)
    plan = Plan.from_dict(box[0])
    reference = copy.deepcopy(model)
    pm = autoshard.parallelize(model, plan, device_mesh(mesh_shape), graph=graph)
    losses = _train(pm, args, STEPS, pm.comm.counter)
    measured = {k: v[0] for k, v in pm.comm.counter.totals().items()}
    assert measured == {(c.kind, tuple(c.axes), c.phase): c.nbytes for c in plan.comm}, "measured comm != plan"
    ref_losses = _train(reference, args, STEPS)
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"loss of step {step}: {m}")
    full, want = pm.state_dict(), reference.state_dict()
    assert list(full) == list(want)
    params = dict(reference.named_parameters())
    for key, value in want.items():     # parameters, BatchNorm running stats and step counters
        atol = PARAM_ATOL if key in params else ATOL
        torch.testing.assert_close(full[key], value, rtol=RTOL, atol=atol, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("kind", ["solved", "data_parallel", "zero3"])
@pytest.mark.parametrize("name", ["residual_cnn", "masked_attention"])
def test_inplace_models_train_like_one_device(name, kind):
    on_all_ranks(f"{name} with the {kind} plan", _run, name, kind)


@pytest.mark.parametrize("kind", ["solved", "megatron"])
@pytest.mark.parametrize("op", ["decomposed_scaled_mm", "opaque_scaled_mm"])
def test_custom_op_models_train_like_one_device(op, kind):
    fallback = "replicate" if op.startswith("opaque") else "error"
    on_all_ranks(f"custom op {op} with the {kind} plan", _run, f"custom_{op}", kind, fallback)


@pytest.mark.parametrize("kind", ["solved", "megatron"])
def test_mixture_of_experts_trains_like_one_device(kind):
    """Router top-k, sort, histc (of integer ids, as a meta capture records it), floor_divide,
    index_put and transformers' grouped_mm_fallback custom op sharded by their handlers, no fallback."""
    on_all_ranks(f"mixtral_tiny with the {kind} plan", _run, "mixtral_tiny", kind)
