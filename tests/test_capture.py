"""Tests of the capture stage (autoshard.capture) and the model zoo (autoshard.models)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export.graph_signature import InputKind

from autoshard.capture import CapturedGraph, CaptureError, TensorMeta, capture
from autoshard.models import ModelZooError, build_model, list_models

TINY = ["mlp", "cnn", "gpt2-tiny", "llama-tiny", "bert-tiny"]
HF_TINY = ["gpt2-tiny", "llama-tiny", "bert-tiny"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def meta_graphs() -> dict[str, tuple[nn.Module, CapturedGraph]]:
    """Meta captures of the tiny presets, built once per worker. Tests must not mutate them."""
    out = {}
    for name in TINY:
        model, args, kwargs = build_model(name)
        out[name] = (model, capture(model, args, kwargs, name=name))
    return out


def _find(graph: CapturedGraph, op: str, module_path: str) -> list[fx.Node]:
    return [n for n in graph.nodes() if str(n.target) == op and graph.module_path(n) == module_path]


# -- shapes and dtypes ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_meta_capture_allocates_nothing_and_annotates_every_tensor(name, meta_graphs):
    model, graph = meta_graphs[name]
    assert all(p.is_meta for p in model.parameters())
    for node in graph.nodes():
        val = node.meta.get("val")
        meta = graph.tensor_meta(node)
        if isinstance(val, torch.Tensor):
            assert meta == TensorMeta(tuple(val.shape), val.dtype, meta.requires_grad), node.name
        elif isinstance(val, (list, tuple)):
            assert isinstance(meta, tuple) and len(meta) == len(val), node.name
            for v, m in zip(val, meta):
                assert (m is None) == (not isinstance(v, torch.Tensor))
                assert m is None or (m.shape, m.dtype) == (tuple(v.shape), v.dtype)
        else:
            assert meta is None, node.name


class _Recorder(fx.Interpreter):
    """Runs an exported graph eagerly and records every node's real shape, dtype, requires_grad."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.seen: dict[str, list[tuple[tuple[int, ...], torch.dtype, bool]]] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if n.op != "output" and tensors:
            self.seen[n.name] = [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]
        return out


def _run_exported(graph: CapturedGraph, args: tuple, kwargs: dict) -> _Recorder:
    ep = graph.exported
    user = iter(pytree.tree_leaves((args, kwargs)))
    flat = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            flat.append(next(user))
        elif spec.target in ep.state_dict:
            flat.append(ep.state_dict[spec.target])
        else:  # non-persistent buffers and constants
            flat.append(ep.constants[spec.target])
    recorder = _Recorder(ep.graph_module)
    recorder.run(*flat)
    return recorder


@pytest.mark.parametrize("name", TINY)
def test_real_tensor_capture_matches_eager_execution(name):
    """Capture on real CPU tensors, run the graph eagerly under autograd: every node's shape, dtype
    and requires_grad must match what capture computed without running anything."""
    model, args, kwargs = build_model(name, device="cpu")
    graph = capture(model, args, kwargs, name=name)
    recorder = _run_exported(graph, args, kwargs)
    assert recorder.seen
    for node_name, real in recorder.seen.items():
        meta = graph.tensor_meta(node_name)
        metas = [m for m in (meta if isinstance(meta, tuple) else (meta,)) if m is not None]
        assert [(m.shape, m.dtype) for m in metas] == [(s, d) for s, d, _ in real], node_name
        assert graph.requires_grad(node_name) == any(g for _, _, g in real), node_name


@pytest.mark.parametrize("name", HF_TINY)
def test_meta_outputs_match_real_model(name, meta_graphs):
    _, graph = meta_graphs[name]
    model, args, kwargs = build_model(name, device="cpu")
    out = model(*args, **kwargs)
    loss, logits = (graph.tensor_meta(o) for o in graph.outputs)
    assert loss.shape == () == tuple(out.loss.shape) and loss.dtype == torch.float32
    assert logits.shape == tuple(out.logits.shape) == (2, 16, 128)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_meta_output_shape_matches_real_model(name, meta_graphs):
    _, graph = meta_graphs[name]
    model, args, kwargs = build_model(name, device="cpu")
    (out,) = graph.outputs
    assert graph.tensor_meta(out).shape == tuple(model(*args, **kwargs).shape)


def test_tensor_meta_sizes():
    meta = TensorMeta((4, 8, 2), torch.bfloat16, False)
    assert (meta.ndim, meta.numel, meta.nbytes) == (3, 64, 128)
    with pytest.raises(AttributeError):
        meta.shape = (1,)  # type: ignore[misc]


# -- parameters, buffers, inputs -----------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_param_and_buffer_fqns_cover_the_model(name, meta_graphs):
    model, graph = meta_graphs[name]
    names = [n for n, _ in model.named_parameters()]
    assert sorted(graph.param_fqn.values()) == sorted(names)
    assert sorted(graph.buffer_fqn.values()) == sorted(n for n, _ in model.named_buffers())
    for placeholder, fqn in graph.param_fqn.items():
        assert graph.is_param(placeholder) and not graph.is_buffer(placeholder)
        assert graph.tensor_meta(placeholder).shape == tuple(model.get_parameter(fqn).shape)


def test_tied_gpt2_head_appears_once(meta_graphs):
    model, graph = meta_graphs["gpt2-tiny"]
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head.weight" not in graph.param_fqn.values()
    assert graph.tied_params["transformer.wte.weight"] == ("transformer.wte.weight",
                                                           "lm_head.weight")
    (placeholder,) = [p for p, fqn in graph.param_fqn.items() if fqn == "transformer.wte.weight"]
    users = {str(u.target) for u in graph.node(placeholder).users}
    assert users == {"aten.embedding.default", "aten.linear.default"}
    # export also lifts the unused alias; it is not reported as a parameter
    (alias,) = graph.tied_placeholders
    assert graph.tied_placeholders[alias] == placeholder and not graph.is_param(alias)


def test_non_persistent_buffers_are_listed(meta_graphs):
    _, graph = meta_graphs["llama-tiny"]
    assert "model.rotary_emb.inv_freq" in graph.buffer_fqn.values()


@pytest.mark.parametrize("name", HF_TINY)
def test_user_inputs_in_order_with_their_source(name, meta_graphs):
    _, graph = meta_graphs[name]
    assert graph.user_inputs == ["input_ids", "attention_mask", "labels"]
    assert graph.user_input_specs["labels"] == "kwargs['labels']"
    assert all(graph.is_user_input(n) for n in graph.user_inputs)
    assert not any(graph.is_user_input(p) for p in graph.param_fqn)


def test_positional_and_constant_inputs():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, y, scale: float = 1.0, extra=None):
            return self.lin(x) * scale + y

    x, y = torch.empty(2, 4, device="meta"), torch.empty(2, 4, device="meta")
    graph = capture(Scaled().to("meta"), (x,), {"y": y, "scale": 2.0, "extra": None})
    assert graph.user_inputs == ["x", "y"]
    assert graph.user_input_specs == {"x": "args[0]", "y": "kwargs['y']"}
    assert graph.constant_inputs == {"scale": 2.0, "extra": None}
    assert not graph.is_user_input("scale")


# -- module paths --------------------------------------------------------------------------------


def test_module_paths_gpt2(meta_graphs):
    _, graph = meta_graphs["gpt2-tiny"]
    (qkv,) = _find(graph, "aten.addmm.default", "transformer.h.0.attn.c_attn")
    assert graph.module_type(qkv) == "Conv1D"
    (sdpa,) = _find(graph, "aten.scaled_dot_product_attention.default", "transformer.h.0.attn")
    assert graph.module_type(sdpa) == "GPT2Attention"
    (loss,) = _find(graph, "aten.cross_entropy_loss.default", "")
    assert graph.module_type(loss) == "GPT2LMHeadModel"


def test_module_paths_llama(meta_graphs):
    _, graph = meta_graphs["llama-tiny"]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        (lin,) = _find(graph, "aten.linear.default", f"model.layers.1.mlp.{proj}")
        assert graph.module_type(lin) == "Linear"
    (gate_mul,) = _find(graph, "aten.mul.Tensor", "model.layers.1.mlp")
    assert graph.module_type(gate_mul) == "LlamaMLP"
    assert len(_find(graph, "aten.linear.default", "model.layers.0.self_attn.k_proj")) == 1


def test_module_paths_bert_and_mlp(meta_graphs):
    _, bert = meta_graphs["bert-tiny"]
    assert len(_find(bert, "aten.linear.default", "bert.encoder.layer.1.attention.self.query")) == 1
    _, mlp = meta_graphs["mlp"]
    assert [mlp.module_path(n) for n in mlp.nodes()] == [f"net.{i}" for i in range(5)]
    assert [mlp.module_type(n) for n in mlp.nodes()][:2] == ["Linear", "GELU"]
    assert mlp.module_path(mlp.user_inputs[0]) == ""


# -- requires_grad -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HF_TINY)
def test_requires_grad_of_loss_inputs_and_masks(name, meta_graphs):
    _, graph = meta_graphs[name]
    loss = graph.outputs[0]
    assert graph.requires_grad(loss) and graph.tensor_meta(loss).requires_grad
    for placeholder in graph.user_inputs:
        assert not graph.requires_grad(placeholder)
    assert all(graph.requires_grad(p) for p in graph.param_fqn)
    assert not any(graph.requires_grad(b) for b in graph.buffer_fqn)
    metas = {n: graph.tensor_meta(n) for n in graph.nodes()}
    mask_nodes = [n for n, m in metas.items()
                  if isinstance(m, TensorMeta) and m.dtype == torch.bool]
    assert mask_nodes and not any(graph.requires_grad(n) for n in mask_nodes)
    sdpa = next(n for n in graph.nodes() if "scaled_dot_product" in str(n.target))
    assert graph.requires_grad(sdpa) and not graph.requires_grad(sdpa.args[3])  # attn mask


def test_requires_grad_frozen_params_and_grad_inputs():
    model, (x,), _ = build_model("mlp", depth=2)
    model.net[0].requires_grad_(False)
    graph = capture(model, (x,))
    first, act, second = graph.nodes()
    assert [graph.requires_grad(n) for n in (first, act, second)] == [False, False, True]
    frozen = [p for p, fqn in graph.param_fqn.items() if fqn.startswith("net.0.")]
    assert frozen and not any(graph.requires_grad(p) for p in frozen)

    model.requires_grad_(False)
    graph = capture(model, (x.clone().requires_grad_(True),))
    assert graph.requires_grad(graph.user_inputs[0])
    assert all(graph.requires_grad(n) for n in graph.nodes())


def test_requires_grad_non_differentiable_ops():
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():
                y = self.a(x)
            z = self.b(x)
            values, indices = z.max(dim=-1)
            return y + z.detach(), z.argmax(-1), values, indices, torch.zeros_like(z), z > 0

    graph = capture(Mixed().to("meta"), (torch.empty(2, 4, device="meta"),))
    out_grad = [graph.requires_grad(o) for o in graph.outputs]
    assert out_grad == [False, False, True, False, False, False]
    (max_node,) = [n for n in graph.nodes() if str(n.target) == "aten.max.dim"]
    values, indices = graph.tensor_meta(max_node)
    assert values.requires_grad and not indices.requires_grad and indices.dtype == torch.int64


# -- fingerprint ---------------------------------------------------------------------------------


def _fingerprint(name: str, **kw) -> str:
    return capture(*build_model(name, **kw)).fingerprint()


def test_fingerprint_same_for_identical_models(meta_graphs):
    _, graph = meta_graphs["llama-tiny"]
    assert len(graph.fingerprint()) == 64
    assert _fingerprint("llama-tiny") == graph.fingerprint()


def test_fingerprint_changes_with_shapes_and_structure(meta_graphs):
    _, graph = meta_graphs["llama-tiny"]
    variants = {_fingerprint("llama-tiny", seq=32), _fingerprint("llama-tiny", batch=3),
                _fingerprint("llama-tiny", intermediate_size=96),
                _fingerprint("llama-tiny", num_layers=3)}
    assert graph.fingerprint() not in variants and len(variants) == 4


def test_fingerprint_sees_frozen_params():
    model, args, _ = build_model("mlp")
    before = capture(model, args).fingerprint()
    model.net[0].weight.requires_grad_(False)
    assert capture(model, args).fingerprint() != before


class _Positions(nn.Module):
    """Records a device argument (arange) in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + torch.arange(x.shape[-1], device=x.device)


def test_fingerprint_is_device_independent_for_plain_models():
    assert _fingerprint("cnn") == _fingerprint("cnn", device="cpu")
    on_meta = capture(_Positions().to("meta"), (torch.empty(2, 4, device="meta"),))
    on_cpu = capture(_Positions(), (torch.empty(2, 4),))
    assert on_meta.fingerprint() == on_cpu.fingerprint()


def test_fingerprint_stable_across_processes(meta_graphs):
    _, graph = meta_graphs["gpt2-tiny"]
    code = ("from autoshard.capture import capture; from autoshard.models import build_model; "
            "print(capture(*build_model('gpt2-tiny')).fingerprint())")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO, check=True)
    assert out.stdout.strip().splitlines()[-1] == graph.fingerprint()


# -- errors --------------------------------------------------------------------------------------


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_data_dependent_control_flow_is_a_capture_error(device):
    with pytest.raises(CaptureError) as info:
        capture(_DataDependent().to(device), (torch.ones(2, 4, device=device),), name="branchy")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'branchy'" in message and "data-dependent" in message
    assert "control flow" in message and "torch.where" in message
    assert info.value.__cause__ is not None


def test_data_dependent_shape_is_a_capture_error():
    class NonZero(nn.Module):
        def forward(self, x):
            return x + x.nonzero().float().sum()

    with pytest.raises(CaptureError, match="Dynamic shapes are not supported") as info:
        capture(NonZero(), (torch.ones(2, 4),), name="nz")
    assert "'nonzero'" in str(info.value) and "aten.nonzero" in str(info.value)


def test_hf_failure_suggests_use_cache_and_keeps_cause():
    model, _, kwargs = build_model("gpt2-tiny")
    kwargs = {"inputs": kwargs["input_ids"]}
    with pytest.raises(CaptureError, match="use_cache=False") as info:
        capture(model, (), kwargs, name="gpt2-tiny")
    assert str(info.value).startswith("capture of 'gpt2-tiny' failed in torch.export: ")
    first_cause_line = str(info.value.__cause__).strip().splitlines()[0]
    assert first_cause_line in str(info.value)


def test_wrong_argument_names_point_at_the_signature():
    model, (x,), _ = build_model("mlp")
    with pytest.raises(CaptureError, match="signature of the model's forward") as info:
        capture(model, (), {"inputs": x})
    assert isinstance(info.value.__cause__, TypeError)
    assert "use_cache" not in str(info.value)


def test_wrong_input_shape_names_the_cause():
    model, _, _ = build_model("mlp")
    with pytest.raises(CaptureError, match="check the example input shapes"):
        capture(model, (torch.empty(8, 31, device="meta"),))


def test_capture_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        capture(lambda x: x, (torch.ones(1),))  # type: ignore[arg-type]


# -- scale and misc ------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_llama7b_width_on_meta_allocates_nothing():
    before = _rss_bytes()
    model, args, kwargs = build_model("llama-7b", num_layers=2)
    graph = capture(model, args, kwargs, name="llama-7b-2l")
    assert all(p.is_meta for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > 600_000_000  # 2.6 GB in fp32 if it were real
    assert _rss_bytes() - before < 512 * 2**20
    (down,) = _find(graph, "aten.linear.default", "model.layers.1.mlp.down_proj")
    assert graph.tensor_meta(down.args[0]).shape == (8, 2048, 11008)
    assert graph.tensor_meta(graph.outputs[1]).shape == (8, 2048, 32000)


def test_summary_and_nodes(meta_graphs):
    _, graph = meta_graphs["llama-tiny"]
    summary = graph.summary()
    assert sum(summary.values()) == sum(1 for _ in graph.nodes())
    assert all(n.op == "call_function" for n in graph.nodes())
    assert summary["aten.linear.default"] == 2 * 7 + 1
    assert summary["aten.scaled_dot_product_attention.default"] == 2
    assert list(summary.values()) == sorted(summary.values(), reverse=True)
    assert "llama-tiny" in repr(graph)


def test_node_lookup(meta_graphs):
    _, graph = meta_graphs["mlp"]
    assert graph.node("x").op == "placeholder"
    with pytest.raises(KeyError, match="no node named"):
        graph.node("nope")


# -- model zoo -----------------------------------------------------------------------------------


def test_list_models_contains_presets():
    names = list_models()
    for name in TINY + ["gpt2", "gpt2-xl", "bert-base", "llama-7b", "llama-13b", "llama-70b"]:
        assert name in names


@pytest.mark.parametrize("name, params", [("llama-70b", 68_976_648_192), ("gpt2", 124_439_808),
                                          ("bert-base", 109_514_298)])
def test_full_size_presets_have_the_published_size(name, params):
    model, _, kwargs = build_model(name)
    assert sum(p.numel() for p in model.parameters()) == params
    assert kwargs["input_ids"].is_meta


def test_tiny_llama_is_gqa_and_dropouts_off():
    model, _, _ = build_model("llama-tiny")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config.use_cache is False
    gpt2, _, _ = build_model("gpt2-tiny")
    assert gpt2.config.resid_pdrop == gpt2.config.attn_pdrop == 0.0
    gpt2, _, _ = build_model("gpt2-tiny", dropout=0.1)
    assert gpt2.config.resid_pdrop == gpt2.config.embd_pdrop == 0.1


def test_real_presets_are_deterministic():
    a, _, ka = build_model("llama-tiny", device="cpu")
    b, _, kb = build_model("llama-tiny", device="cpu")
    assert torch.equal(ka["input_ids"], kb["input_ids"])
    assert not torch.equal(ka["input_ids"], ka["labels"])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_zoo_errors():
    with pytest.raises(ModelZooError, match="unknown model 'gpt5'"):
        build_model("gpt5")
    with pytest.raises(ModelZooError, match="hiden_size"):
        build_model("llama-tiny", hiden_size=8)
    with pytest.raises(ModelZooError, match="width"):
        build_model("mlp", width=8)
    with pytest.raises(ModelZooError, match="no sequence dim"):
        build_model("mlp", seq=8)
    with pytest.raises(ModelZooError, match="int >= 1"):
        build_model("cnn", batch=0)


def test_hf_presets_need_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModelZooError, match=r"pip install autoshard\[hf\]"):
        build_model("gpt2-tiny")
    model, _, _ = build_model("mlp")  # plain presets still work
    assert isinstance(model, nn.Module)


def test_library_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None; "
            "import autoshard.capture, autoshard.models; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_factory_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make(width=4):
            return nn.Linear(width, 2), (torch.ones(3, width),)

        def not_a_model():
            return 1, 2
    """))
    model, args, kwargs = build_model(f"{path}:make")
    assert isinstance(model, nn.Linear) and args[0].shape == (3, 4) and kwargs == {}
    model, args, _ = build_model(f"{path}:make", device="meta")     # no device=: it builds where it likes
    assert isinstance(model, nn.Linear)
    model, args, _ = build_model(f"{path}:make", width=6)
    graph = capture(model, args)
    assert graph.tensor_meta(graph.outputs[0]).shape == (3, 2)
    with pytest.raises(ModelZooError, match="nn.Module"):
        build_model(f"{path}:not_a_model")
    with pytest.raises(ModelZooError, match="no callable 'missing'"):
        build_model(f"{path}:missing")
    with pytest.raises(ModelZooError, match="does not accept"):
        build_model(f"{path}:make", depth=3)
