"""Tests of folded capture (autoshard.capture.fold): the synthesised graph must be exactly the one a full
torch.export of the deep model gives, and anything not periodic must raise FoldError."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import fx, nn

from autoshard.capture import fold
from autoshard.capture import CapturedGraph, capture
from autoshard.capture import FoldError, capture_folded, capture_preset, exported_differences
from autoshard.models import build_model

# A Llama-2-7B-like config (32 heads, SwiGLU 2.6875x, vocab 32000) narrowed to run in seconds.
NARROW_7B = dict(hidden_size=512, intermediate_size=1376, num_attention_heads=32,
                 num_key_value_heads=32)
CASES = {
    "gpt2-tiny": ("gpt2-tiny", {}),
    "llama-tiny": ("llama-tiny", {}),
    "bert-tiny": ("bert-tiny", {}),
    "llama-7b-narrow": ("llama-7b", dict(NARROW_7B, batch=2, seq=64)),
}
DEPTHS = (4, 5, 7)


def _builder(preset: str, options: dict):
    return lambda depth: build_model(preset, num_layers=depth, **options)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param


def _pair(case: str, depth: int) -> tuple[CapturedGraph, CapturedGraph]:
    preset, options = CASES[case]
    build = _builder(preset, options)
    folded = capture_folded(build, depth, name=case)
    real = capture(*build(depth), name=case)
    return folded, real


# -- exactness -------------------------------------------------------------------------------------


def _canonical_args(value):
    return fx.node.map_arg(value, lambda n: f"%{n.name}")


def _val(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.dtype, v.device.type, v.requires_grad)
    if isinstance(v, (list, tuple)):
        return tuple(_val(x) for x in v)
    return repr(v)


@pytest.mark.parametrize("depth", DEPTHS)
def test_folded_capture_equals_real_export(case, depth):
    folded, real = _pair(case, depth)
    assert "fold_s" in folded.timings, "the folded path was not taken"
    assert folded.fingerprint() == real.fingerprint()
    fn, rn = list(folded.graph.nodes), list(real.graph.nodes)
    assert [n.name for n in fn] == [n.name for n in rn]
    for a, b in zip(fn, rn):
        assert (a.op, a.target) == (b.op, b.target), a.name
        assert _canonical_args(a.args) == _canonical_args(b.args), a.name
        assert _canonical_args(a.kwargs) == _canonical_args(b.kwargs), a.name
        assert a.meta.keys() == b.meta.keys(), a.name
        assert _val(a.meta.get("val")) == _val(b.meta.get("val")), a.name
        assert a.meta.get("nn_module_stack") == b.meta.get("nn_module_stack"), a.name
        assert a.meta.get("torch_fn") == b.meta.get("torch_fn"), a.name
        assert a.meta.get("stack_trace") == b.meta.get("stack_trace"), a.name
        assert folded.tensor_meta(a.name) == real.tensor_meta(b.name), a.name
        assert folded.requires_grad(a.name) == real.requires_grad(b.name), a.name
        assert folded.module_path(a.name) == real.module_path(b.name), a.name
        assert folded.module_type(a.name) == real.module_type(b.name), a.name
    for attr in ("param_fqn", "buffer_fqn", "constant_fqn", "tied_params", "tied_placeholders",
                 "user_inputs", "user_input_specs", "outputs"):
        assert getattr(folded, attr) == getattr(real, attr), attr
    fe, re_ = folded.exported, real.exported
    assert fe.graph_signature.input_specs == re_.graph_signature.input_specs
    assert fe.graph_signature.output_specs == re_.graph_signature.output_specs
    assert list(fe.state_dict) == list(re_.state_dict)
    assert list(fe.constants) == list(re_.constants)
    assert [e.fqn for e in fe.module_call_graph] == [e.fqn for e in re_.module_call_graph]
    assert exported_differences(fe, re_) == []


def test_folded_program_runs_like_the_model():
    """On real CPU weights, the folded program computes what the model computes: every layer's
    nodes read that layer's parameters."""
    torch.manual_seed(0)
    graph = capture_preset("llama-tiny", device="cpu", num_layers=5)
    assert "fold_s" in graph.timings
    model, _, kwargs = build_model("llama-tiny", device="cpu", num_layers=5)
    with torch.no_grad():
        for p in model.parameters():      # distinct weights per layer
            p.normal_(0, 0.2)
        expected = model(**kwargs).loss
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        module = graph.exported.module()
        module.load_state_dict(state, strict=False)
        got = module(**kwargs)
    loss = got["loss"] if isinstance(got, dict) else got[0]
    torch.testing.assert_close(loss, expected)


def test_differences_are_reported():
    """exported_differences is not blind: another depth, or one changed meta, is a difference."""
    build = _builder("llama-tiny", {})
    folded = capture_folded(build, 4)
    assert exported_differences(folded.exported, capture(*build(5)).exported)
    real = capture(*build(4))
    assert exported_differences(folded.exported, real.exported) == []
    node = next(n for n in folded.graph.nodes if n.op == "call_function"
                and "layers.3" in str(n.meta.get("nn_module_stack")))
    node.meta["nn_module_stack"] = dict(list(node.meta["nn_module_stack"].items())[:-1])
    assert any("nn_module_stack" in d for d in exported_differences(folded.exported, real.exported))


def test_shallow_depths_are_plain_captures():
    build = _builder("gpt2-tiny", {})
    graph = capture_folded(build, 3)
    assert "fold_s" not in graph.timings
    assert graph.fingerprint() == capture(*build(3)).fingerprint()
    with pytest.raises(ValueError, match="probes"):
        capture_folded(build, 6, probes=(1, 2))


# -- capture_preset --------------------------------------------------------------------------------


class _Records(logging.Handler):
    """Collects log records (the suite may run with ``-p no:logging``: no caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_capture_preset_folds_hf_presets_and_falls_back(monkeypatch):
    folded = capture_preset("gpt2-tiny", num_layers=5)
    full = capture_preset("gpt2-tiny", num_layers=5, fold=False)
    assert "fold_s" in folded.timings and "fold_s" not in full.timings
    assert folded.fingerprint() == full.fingerprint()

    def refuse(*args, **kwargs):
        raise FoldError("not periodic")
    monkeypatch.setattr(fold, "capture_folded", refuse)
    records = _Records()
    logging.getLogger("autoshard.capture.fold").addHandler(records)
    try:
        fallback = capture_preset("gpt2-tiny", num_layers=5)
    finally:
        logging.getLogger("autoshard.capture.fold").removeHandler(records)
    assert any("not periodic" in m for m in records.messages)
    assert fallback.fingerprint() == full.fingerprint()


def test_capture_preset_captures_other_models_in_full():
    graph = capture_preset("mlp", depth=4)
    model, args, kwargs = build_model("mlp", depth=4)
    assert graph.fingerprint() == capture(model, args, kwargs).fingerprint()


# -- non-periodic models raise -------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int, index: int, scale_by_index: bool, no_grad: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.scale = 1.0 / (index + 1) if scale_by_index else 1.0
        self.no_grad = no_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.no_grad:
            with torch.no_grad():
                x = x + 1
        return torch.relu(self.fc(x)) * self.scale + x


class Stack(nn.Module):
    """A stack of Blocks with options that break (or keep) periodicity."""

    def __init__(self, depth: int, *, width: int = 8, scale_by_index: bool = False,
                 collect: bool = False, between: bool = False, freeze_from: int | None = None,
                 no_grad: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.layers = nn.ModuleList(Block(width, i, scale_by_index, no_grad) for i in range(depth))
        if freeze_from is not None:
            for block in self.layers[freeze_from:]:
                block.fc = nn.Linear(width, width).requires_grad_(False)
        self.head = nn.Linear(width, 2)
        self.collect, self.between = collect, between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        seen = []
        for layer in self.layers:
            h = layer(h)
            if self.between:
                h = h * 0.5
            seen.append(h)
        out = self.head(h)
        return out + sum(s.sum() for s in seen) if self.collect else out


def _stack_builder(**options):
    return lambda depth: (Stack(depth, **options).to("meta"), (torch.empty(3, 4, device="meta"),),
                          {})


@pytest.mark.parametrize("options", [{}, {"between": True}], ids=["plain", "parent-ops-between"])
def test_periodic_custom_model_folds_exactly(options):
    build = _stack_builder(**options)
    folded = capture_folded(build, 6)
    real = capture(*build(6))
    assert exported_differences(folded.exported, real.exported) == []
    assert folded.fingerprint() == real.fingerprint()


@pytest.mark.parametrize("options, message", [
    ({"scale_by_index": True}, "arguments are not the same"),
    ({"collect": True}, "not only the last layer"),
    ({"no_grad": True}, "higher-order"),
    ({"freeze_from": 4}, "not identical"),
])
def test_non_periodic_models_raise(options, message):
    with pytest.raises(FoldError, match=message):
        capture_folded(_stack_builder(**options), 6)


def test_a_depth_that_changes_nothing_raises():
    with pytest.raises(FoldError, match="does not change the model"):
        capture_folded(lambda depth: _stack_builder()(2), 6)


# -- the library's capture (autoshard.plan) --------------------------------------------------------


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_the_library_folds_a_hugging_face_model_exactly(preset):
    """autoshard.plan's capture of a model object (no preset name) is folded and is the graph the
    runtime's full meta capture gives, fingerprint for fingerprint."""
    from autoshard.api import _captured
    from autoshard.runtime import capture_meta

    model, args, kwargs = build_model(preset, device="cpu", batch=4, num_layers=6)
    folded = _captured(model, args, kwargs, name=preset)
    assert "fold_s" in folded.timings
    assert folded.fingerprint() == capture_meta(model, args, kwargs, name=preset).fingerprint()


def test_the_library_fold_keeps_what_the_user_changed():
    """The probes are cut from the model itself, so a cast and a replaced module are in them: the
    folded graph still equals the full capture (a model rebuilt from its config would have neither)."""
    from autoshard.api import _captured
    from autoshard.runtime import capture_meta

    model, args, kwargs = build_model("llama-tiny", device="cpu", batch=4, num_layers=5)
    model = model.to(torch.bfloat16)
    for layer in model.model.layers:
        layer.mlp.act_fn = nn.Tanh()
    folded = _captured(model, args, kwargs, name="edited")
    assert "fold_s" in folded.timings
    assert folded.fingerprint() == capture_meta(model, args, kwargs, name="edited").fingerprint()
    assert "aten.tanh.default" in {str(n.target) for n in folded.graph.nodes}


def test_the_library_captures_in_full_what_does_not_fold(monkeypatch):
    """A model that is no Hugging Face stack, or whose fold fails, is captured in full."""
    from autoshard.api import _captured

    model, args, kwargs = build_model("mlp", depth=6)
    assert "fold_s" not in _captured(model, args, kwargs, name="mlp").timings

    def refuse(*a, **k):
        raise FoldError("not periodic")
    monkeypatch.setattr(fold, "capture_folded", refuse)
    model, args, kwargs = build_model("gpt2-tiny", device="cpu", batch=4, num_layers=5)
    graph = _captured(model, args, kwargs, name="gpt2")
    assert "fold_s" not in graph.timings and len(list(graph.graph.nodes)) > 0
