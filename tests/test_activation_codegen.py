"""apply_memory_annotations: generated code, exact numerics against the unannotated graph, and
real recomputation, on symbolic_trace graphs and torch.export graphs."""
from __future__ import annotations

import operator
import re
from typing import Any, Callable

import pytest
import torch
from torch import fx, nn

from autoshard.memory import (
    CHECKPOINT_META,
    OFFLOAD_META,
    MemoryAnnotationError,
    apply_memory_annotations,
)
from autoshard.runtime.memory_meter import SavedTensorMeter

TRACERS = ["symbolic_trace", "export"]


class MLP(nn.Module):
    def __init__(self, depth: int = 6, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class SkipNet(nn.Module):
    """Two values of the first three ops are read later: a region with two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        g = self.l2(h)
        return self.l3(g) * h


class TinyBlock(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual add."""

    def __init__(self, dim: int = 8, heads: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, self.dim // self.heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = (q @ k.transpose(-2, -1) * (self.dim // self.heads) ** -0.5).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, self.dim)
        x = x + self.proj(y)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def trace(model: nn.Module, x: torch.Tensor, tracer: str) -> fx.GraphModule:
    if tracer == "symbolic_trace":
        return fx.symbolic_trace(model)
    return torch.export.export(model, (x,)).module()


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that do work, in order (export's input guard excluded)."""
    return [n for n in gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module") and n.target != "_guards_fn"]


def annotate(nodes: list[fx.Node], checkpoint: dict[int, Any] = {}, offload: dict[int, Any] = {}) -> None:
    for index, label in checkpoint.items():
        nodes[index].meta[CHECKPOINT_META] = label
    for index, label in offload.items():
        nodes[index].meta[OFFLOAD_META] = label


def run_step(module: nn.Module, params: list[nn.Parameter], x: torch.Tensor, seed: int = 0):
    """Forward + backward of sum(); returns output and the gradients of params and x."""
    for p in params:
        p.grad = None
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    out = module(x)
    out.sum().backward()
    return out.detach(), [p.grad.clone() for p in params], x.grad.clone()


def assert_same_step(reference: nn.Module, annotated: nn.Module, x: torch.Tensor) -> None:
    # The annotated module shares the reference's parameters, so both fill the same .grad.
    params = list(reference.parameters())
    out_ref, grads_ref, gx_ref = run_step(reference, params, x)
    out, grads, gx = run_step(annotated, params, x)
    assert torch.equal(out, out_ref)
    for p, g, g_ref in zip(params, grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=0)


def count_calls(module: nn.Module) -> list[int]:
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    module.register_forward_pre_hook(hook)  # forward hooks miss recomputes that stop early
    return calls


def with_block_body(code: str, header: str) -> list[str]:
    """Statements directly inside the first `with header:` block of `code`."""
    lines = code.split("\n")
    start = next(i for i, line in enumerate(lines) if line.strip() == header)
    indent = len(lines[start]) - len(lines[start].lstrip()) + 4
    body = []
    for line in lines[start + 1:]:
        if len(line) - len(line.lstrip()) < indent:
            break
        body.append(line.strip())
    return body


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tracer", TRACERS)
def test_seed_layout_generates_hooks_checkpoints_and_matches_reference(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    gm = trace(model, x, tracer)
    nodes = compute_nodes(gm)  # linear, relu, linear, relu, ... (12 nodes)
    annotate(nodes,
             checkpoint={8: [0], 9: [0], 10: 1, 11: 1},
             offload={0: [0, True, False], 1: [0, True, False], 2: [1, True, True],
                      5: [2, False, True], 8: True})
    new = apply_memory_annotations(gm)
    code = new.code

    assert code.count("torch.utils.checkpoint.checkpoint(") == 2
    assert len(re.findall(r"use_reentrant\s*=\s*False", code)) == 2
    assert "with torch.autograd.graph.save_on_cpu(pin_memory=True):" in code
    assert code.count("with torch.autograd.graph.saved_tensors_hooks(") == 3
    # Only the checkpoint call with activation_offload=True sits under save_on_cpu.
    body = with_block_body(code, "with torch.autograd.graph.save_on_cpu(pin_memory=True):")
    assert len(body) == 1 and "checkpoint(checkpoint_0," in body[0]
    body = with_block_body(
        code, "with torch.autograd.graph.saved_tensors_hooks(offload_0_hooks.pack, offload_0_hooks.unpack):")
    assert len(body) == 2  # nodes 0 and 1
    assert [m.offload_inputs for m in (new.offload_0, new.offload_1, new.offload_2)] == [True, True, False]
    assert [m.offload_rest for m in (new.offload_0, new.offload_1, new.offload_2)] == [False, True, True]
    assert_same_step(gm, new, x)


@pytest.mark.parametrize("tracer", TRACERS)
def test_checkpoint_region_is_recomputed_in_backward(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = MLP(depth=3), torch.randn(4, 8, requires_grad=True)
    gm = trace(model, x, tracer)
    annotate(compute_nodes(gm), checkpoint={2: 0, 3: 0})
    new = apply_memory_annotations(gm)
    calls = count_calls(new.checkpoint_0)
    out = new(x)
    assert calls[0] == 1
    out.sum().backward()
    assert calls[0] == 2


@pytest.mark.parametrize("tracer", TRACERS)
def test_checkpoint_keeps_only_region_inputs(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = MLP(depth=3), torch.randn(4, 8)
    gm = trace(model, x, tracer)
    annotate(compute_nodes(gm), checkpoint={i: 0 for i in range(6)})
    new = apply_memory_annotations(gm)
    with SavedTensorMeter() as plain:
        gm(x)
    with SavedTensorMeter() as checkpointed:
        new(x)
    # Unannotated: x (4*8 fp32 = 128 B) for the first linear's weight grad, and each of the three
    # relu outputs (128 B), saved by the relu and again (same storage) by the next linear; the
    # 2nd and 3rd linear save their 8x8 weight (256 B). Checkpointed: only the region input x.
    assert (plain.report().activation_bytes, plain.report().parameter_bytes) == (128 * 4, 256 * 2)
    assert (checkpointed.report().activation_bytes, checkpointed.report().parameter_bytes) == (128, 0)


@pytest.mark.parametrize("tracer", TRACERS)
def test_nested_regions_nest_checkpoint_calls(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    gm = trace(model, x, tracer)
    annotate(compute_nodes(gm),
             checkpoint={2: [0], 3: [0], 4: [0, 1], 5: [0, 1], 6: [0], 9: [1, 0], 10: [1]},
             offload={2: True})
    new = apply_memory_annotations(gm)

    assert new.code.count("torch.utils.checkpoint.checkpoint(") == 2
    assert "torch.utils.checkpoint.checkpoint(checkpoint_0_1," in new.checkpoint_0.code
    assert "torch.utils.checkpoint.checkpoint(checkpoint_1_0," in new.checkpoint_1.code
    assert "save_on_cpu" in new.code and "save_on_cpu" not in new.checkpoint_0.code
    outer, inner = count_calls(new.checkpoint_0), count_calls(new.checkpoint_0.checkpoint_0_1)
    assert_same_step(gm, new, x)
    # Forward: outer once, inner once inside it. Backward: the outer recompute runs the inner
    # forward again, then the inner region recomputes itself.
    assert (outer[0], inner[0]) == (2, 3)


@pytest.mark.parametrize("tracer", TRACERS)
def test_region_with_two_outputs(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = SkipNet(), torch.randn(4, 8)
    gm = trace(model, x, tracer)
    annotate(compute_nodes(gm), checkpoint={0: 0, 1: 0, 2: 0})  # l1, relu, l2
    new = apply_memory_annotations(gm)
    assert "checkpoint_0_out[0]" in new.code and "checkpoint_0_out[1]" in new.code
    assert_same_step(gm, new, x)


@pytest.mark.parametrize("tracer", TRACERS)
def test_transformer_block_with_dropout(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = TinyBlock(), torch.randn(2, 5, 8)
    gm = trace(model, x, tracer)
    nodes = compute_nodes(gm)
    adds = [i for i, n in enumerate(nodes) if n.target in (operator.add, torch.ops.aten.add.Tensor)]
    first_add, last_add = adds
    attention = range(0, first_add)       # ln1 ... proj (dropout inside: RNG must be replayed)
    annotate(nodes,
             checkpoint={**{i: 0 for i in attention},
                         first_add + 2: [1, 0], first_add + 3: [1, 0], first_add + 4: [1]},
             offload={0: True, first_add + 1: [0, True, True]})  # ln2 -> offload region 0
    new = apply_memory_annotations(gm)
    assert "torch.utils.checkpoint.checkpoint(checkpoint_1_0," in new.checkpoint_1.code
    assert "saved_tensors_hooks(offload_0_hooks.pack" in new.code
    # Verbose code (stack trace comments between nodes, as print_readable shows) stays valid.
    compile(new.graph.python_code("self", verbose=True).src, "<verbose>", "exec")
    assert_same_step(gm, new, x)


@pytest.mark.parametrize("tracer", TRACERS)
def test_unannotated_graph_regenerates_the_same_statements(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = MLP(depth=2), torch.randn(4, 8)
    gm = trace(model, x, tracer)
    new = apply_memory_annotations(gm)
    # Attribute loads move next to their first use (export hoists them); nothing else changes.
    assert sorted(new.code.splitlines()) == sorted(gm.code.splitlines())
    assert_same_step(gm, new, x)


def test_input_graph_is_left_alone_and_result_carries_no_annotations() -> None:
    torch.manual_seed(0)
    gm = fx.symbolic_trace(MLP(depth=2))
    annotate(compute_nodes(gm), checkpoint={0: 0, 1: 0}, offload={2: [3, True, True]})
    before = gm.code
    new = apply_memory_annotations(gm)
    assert gm.code == before
    for graph_module in (new, new.checkpoint_0):
        for node in graph_module.graph.nodes:
            assert CHECKPOINT_META not in node.meta and OFFLOAD_META not in node.meta
    # Applying again to the result changes nothing: the regions are already code.
    again = apply_memory_annotations(new)
    assert again.code == new.code


def test_pin_memory_flag_reaches_save_on_cpu() -> None:
    gm = fx.symbolic_trace(MLP(depth=2))
    annotate(compute_nodes(gm), checkpoint={0: 0}, offload={0: True})
    assert "save_on_cpu(pin_memory=False)" in apply_memory_annotations(gm, pin_memory=False).code


def test_module_named_like_a_region_gets_a_fresh_name() -> None:
    class Clash(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.checkpoint_0 = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.checkpoint_0(x))

    gm = fx.symbolic_trace(Clash())
    annotate(compute_nodes(gm), checkpoint={1: 0})
    new = apply_memory_annotations(gm)
    assert isinstance(new.checkpoint_0, nn.Linear)
    assert "checkpoint(checkpoint_0_1," in new.code
    assert_same_step(gm, new, torch.randn(2, 8))


# -- malformed annotations ------------------------------------------------------------------------


def _mlp_nodes() -> tuple[fx.GraphModule, list[fx.Node]]:
    gm = fx.symbolic_trace(MLP(depth=3))
    return gm, compute_nodes(gm)  # layers_0, relu, layers_1, relu_1, layers_2, relu_2


def _set(index: int, key: str, value: Any) -> Callable[[fx.GraphModule, list[fx.Node]], None]:
    return lambda gm, nodes: nodes[index].meta.__setitem__(key, value)


def _placeholder(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    next(iter(gm.graph.nodes)).meta[CHECKPOINT_META] = 0


@pytest.mark.parametrize("edits, message", [
    ([_set(0, CHECKPOINT_META, 0), _set(2, CHECKPOINT_META, 0)],
     r"Checkpoint region \[0\] is not contiguous: it stops after node 'layers_0', node 'relu' is "
     r"outside it, and it resumes at node 'layers_1'"),
    ([_set(0, CHECKPOINT_META, [0, 1]), _set(1, CHECKPOINT_META, [0]), _set(2, CHECKPOINT_META, [0, 1])],
     r"Checkpoint region \[0, 1\] is not contiguous.*resumes at node 'layers_1'"),
    ([_set(0, OFFLOAD_META, [2, True, True]), _set(2, OFFLOAD_META, [2, True, True])],
     r"Offload region 2 is not contiguous.*resumes at node 'layers_1'"),
    ([_set(3, OFFLOAD_META, True)], r"Node 'relu_1' has activation_offload=True but no activation_checkpoint"),
    ([_set(1, CHECKPOINT_META, 0), _set(1, OFFLOAD_META, [0, True, False])],
     r"Node 'relu' is in checkpoint region \[0\] and also in plain offload region 0"),
    ([_set(0, OFFLOAD_META, [0, True, False]), _set(1, OFFLOAD_META, [0, False, True])],
     r"Offload region 0: node 'relu' has activation_offload=\[0, False, True\] but node 'layers_0'"),
    ([_set(4, OFFLOAD_META, [1, False, False])], r"Node 'layers_2'.*offloads nothing"),
    ([_set(4, OFFLOAD_META, "yes")], r"Node 'layers_2': activation_offload='yes' must be True"),
    ([_set(5, CHECKPOINT_META, "a")], r"Node 'relu_2': activation_checkpoint='a' must be an int"),
    ([_set(5, CHECKPOINT_META, [])], r"Node 'relu_2': activation_checkpoint=\[\] must be"),
    ([_set(5, CHECKPOINT_META, True)], r"Node 'relu_2': activation_checkpoint=True must be"),
    ([_placeholder], r"Node 'x' is a graph placeholder"),
])
def test_malformed_annotations_name_the_node(edits: list, message: str) -> None:
    gm, nodes = _mlp_nodes()
    for edit in edits:
        edit(gm, nodes)
    with pytest.raises(MemoryAnnotationError, match=message):
        apply_memory_annotations(gm)


def test_removing_the_hooks_users_after_codegen_is_reported() -> None:
    gm, nodes = _mlp_nodes()
    annotate(nodes, offload={0: [0, True, True]})
    new = apply_memory_annotations(gm)
    prefetch = next(n for n in new.graph.nodes if n.name == "offload_0_prefetch")
    new.graph.erase_node(prefetch)
    with pytest.raises(RuntimeError, match="reads node 'offload_0_hooks'"):
        new.recompile()
