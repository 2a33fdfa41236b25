"""Model zoo: small and full-size presets with example inputs, ready for ``capture``.

``build_model(name, device=..., batch=..., seq=..., **overrides)`` returns
``(model, args, kwargs)``.
Presets build on the ``meta`` device by default (no memory allocated); pass ``device="cpu"`` (or a
GPU) for real weights. Besides preset names, ``name`` may be ``"path/to/file.py:factory"``, where
``factory(**overrides)`` returns ``(model, args, kwargs)`` or ``(model, args)``; it gets ``device=`` only
if it takes that argument (``batch``/``seq``/overrides given explicitly are always passed).

The Hugging Face presets need ``transformers`` (``pip install autoshard[hf]``), imported lazily.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

Built = tuple[nn.Module, tuple, dict]

# Token ids inside every preset's vocabulary, so transformers does not warn about them.
_PAD, _BOS, _EOS = 0, 1, 2


class ModelZooError(ValueError):
    """Unknown preset, bad override, or a factory file that cannot be used."""


# -- plain torch models --------------------------------------------------------------------------


class MLP(nn.Module):
    """``depth`` linear layers with GELU/ReLU alternating between them."""

    def __init__(self, features: int = 32, hidden: int = 64, out_features: int = 16,
                 depth: int = 3) -> None:
        super().__init__()
        if depth < 1:
            raise ModelZooError(f"mlp depth must be >= 1, got {depth}")
        dims = [features] + [hidden] * (depth - 1) + [out_features]
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < depth - 1:
                layers.append(nn.GELU() if i % 2 == 0 else nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Two conv/batch-norm/relu blocks, pooling, and a linear classifier.

    The convolutions have no bias: batch norm subtracts the mean right after, so a bias there has
    an exactly-zero gradient (only rounding noise, which Adam would amplify into real updates)."""

    def __init__(self, channels: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * c, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# -- presets -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A named model: how to build it and its default example-input sizes."""

    name: str
    description: str
    build: Callable[..., Built]     # (device, batch, seq, **overrides) -> (model, args, kwargs)
    batch: int
    seq: int | None                 # sequence length; image side for the CNN; None: no such dim


def _build_mlp(device: torch.device, batch: int, seq: int | None, **overrides: Any) -> Built:
    model = _construct(MLP, device, **overrides)
    x = _randn((batch, model.net[0].in_features), device)
    return model, (x,), {}


def _build_cnn(device: torch.device, batch: int, seq: int, **overrides: Any) -> Built:
    model = _construct(CNN, device, **overrides)
    return model, (_randn((batch, 3, seq, seq), device),), {}


def _construct(cls: type[nn.Module], device: torch.device, *, seed: int = 0,
               **overrides: Any) -> nn.Module:
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ModelZooError(
            f"{cls.__name__} has no option(s) {unknown}; options: {sorted(allowed)}")
    with _seeded(device, seed):
        return cls(**overrides)


@contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Build on ``device`` with a fixed seed, leaving the caller's RNG state as it was."""
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices), torch.device(device):
        torch.manual_seed(seed)
        yield


@dataclass(frozen=True)
class _HFFamily:
    config: str                      # transformers config class
    model: str                       # transformers model class
    layers: str                      # config field holding the layer count
    dropouts: tuple[str, ...]        # config fields set by dropout=
    loss_type: str
    learned_positions: bool          # position table limits seq (RoPE does not)


_HF_FAMILIES = {
    "gpt2": _HFFamily("GPT2Config", "GPT2LMHeadModel", "n_layer",
                      ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"),
                      "ForCausalLM", learned_positions=True),
    "llama": _HFFamily("LlamaConfig", "LlamaForCausalLM", "num_hidden_layers",
                       ("attention_dropout",), "ForCausalLM", learned_positions=False),
    "bert": _HFFamily("BertConfig", "BertForMaskedLM", "num_hidden_layers",
                      ("hidden_dropout_prob", "attention_probs_dropout_prob"), "ForMaskedLM",
                      learned_positions=True),
}


def _hf_preset(family: str, **config: Any) -> Callable[..., Built]:
    def build(device: torch.device, batch: int, seq: int, **overrides: Any) -> Built:
        return _build_hf(_HF_FAMILIES[family], dict(config), device, batch, seq, **overrides)
    return build


def _build_hf(fam: _HFFamily, config: dict[str, Any], device: torch.device, batch: int, seq: int,
              *, num_layers: int | None = None, dropout: float = 0.0,
              dtype: torch.dtype | None = None, seed: int = 0, **overrides: Any) -> Built:
    transformers = _import_transformers()
    config_cls = getattr(transformers, fam.config)
    _check_config_keys(config_cls, overrides)
    config.update({k: dropout for k in fam.dropouts})
    if num_layers is not None:
        config[fam.layers] = num_layers
    config.update(overrides)
    cfg = config_cls(pad_token_id=_PAD, bos_token_id=_BOS, eos_token_id=_EOS, use_cache=False,
                     attn_implementation="sdpa", **config)
    if fam.learned_positions and seq > cfg.max_position_embeddings:
        raise ModelZooError(f"seq {seq} exceeds the {cfg.max_position_embeddings} positions of "
                            f"this preset; pass max_position_embeddings={seq} as well")
    with _seeded(device, seed):
        model = getattr(transformers, fam.model)(cfg)
    # transformers guesses the loss from the class name and warns for GPT2LMHeadModel.
    model.loss_type = fam.loss_type
    if dtype is not None:
        model = model.to(dtype)
    model.train()
    return model, (), _lm_inputs(cfg.vocab_size, batch, seq, device, seed)


def _check_config_keys(config_cls: type, overrides: dict[str, Any]) -> None:
    """HF configs swallow unknown kwargs silently; a typo in an override must not."""
    reference = config_cls()
    unknown = sorted(k for k in overrides if not hasattr(reference, k))
    if unknown:
        raise ModelZooError(
            f"{config_cls.__name__} has no field(s) {unknown}; besides its fields, HF presets "
            "take num_layers=, dropout=, dtype= and seed=")


def _lm_inputs(vocab: int, batch: int, seq: int, device: torch.device, seed: int) -> dict:
    """input_ids, an all-ones attention_mask and labels (distinct tensors: export would merge
    a tensor passed twice into one input)."""
    ids = _randint(vocab, (batch, seq), device, seed)
    labels = _randint(vocab, (batch, seq), device, seed + 1)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _randint(high: int, shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    if device.type == "meta":
        return torch.randint(0, high, shape, device=device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=gen).to(device)


def _randn(shape: tuple[int, ...], device: torch.device, seed: int = 0) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(shape, device=device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device)


def _import_transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ModelZooError(
            "this preset is a Hugging Face model and needs transformers: "
            "pip install autoshard[hf]") from e


_TINY_GPT2 = dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
_TINY_LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
_TINY_BERT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    return dict(vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=4096, rms_norm_eps=1e-5)


_GPT2 = dict(vocab_size=50257, n_positions=1024)

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("mlp", "3-layer MLP (GELU/ReLU); input (batch, features)", _build_mlp, 8, None),
    Preset("cnn", "2 conv/bn/relu blocks, pools, linear; input (batch, 3, seq, seq)",
           _build_cnn, 4, 16),
    Preset("gpt2-tiny", "GPT-2 LM, 2 layers, hidden 32, vocab 128",
           _hf_preset("gpt2", **_TINY_GPT2), 2, 16),
    Preset("gpt2-mini", "GPT-2 LM, 4 layers, hidden 128, vocab 2048, 128 positions (large enough that data "
           "parallelism pays on 4 CPU ranks: the README demo)",
           _hf_preset("gpt2", vocab_size=2048, n_embd=128, n_layer=4, n_head=4, n_positions=128), 8, 128),
    Preset("llama-tiny", "Llama LM with GQA (4 heads, 2 kv heads), 2 layers, hidden 32, vocab 128",
           _hf_preset("llama", **_TINY_LLAMA), 2, 16),
    Preset("bert-tiny", "BERT masked LM, 2 layers, hidden 32, vocab 128",
           _hf_preset("bert", **_TINY_BERT), 2, 16),
    Preset("gpt2", "GPT-2 124M: 12 layers, hidden 768",
           _hf_preset("gpt2", **_GPT2, n_embd=768, n_layer=12, n_head=12), 8, 1024),
    Preset("gpt2-xl", "GPT-2 XL 1.5B: 48 layers, hidden 1600",
           _hf_preset("gpt2", **_GPT2, n_embd=1600, n_layer=48, n_head=25), 8, 1024),
    Preset("bert-base", "BERT-base masked LM: 12 layers, hidden 768",
           _hf_preset("bert", vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                      num_attention_heads=12, intermediate_size=3072,
                      max_position_embeddings=512), 8, 512),
    Preset("llama-7b", "Llama-2 7B: 32 layers, hidden 4096, ffn 11008, 32 heads",
           _hf_preset("llama", **_llama(4096, 11008, 32, 32, 32)), 8, 2048),
    Preset("llama-13b", "Llama-2 13B: 40 layers, hidden 5120, ffn 13824, 40 heads",
           _hf_preset("llama", **_llama(5120, 13824, 40, 40, 40)), 8, 2048),
    Preset("llama-70b", "Llama-2 70B: 80 layers, hidden 8192, ffn 28672, 64 heads, 8 kv heads",
           _hf_preset("llama", **_llama(8192, 28672, 80, 64, 8)), 8, 2048),
)}


# -- public API ----------------------------------------------------------------------------------


def list_models() -> list[str]:
    """Names of the built-in presets."""
    return list(PRESETS)


def build_model(name: str, *, device: "str | torch.device | None" = None, batch: int | None = None,
                seq: int | None = None, **overrides: Any) -> Built:
    """Build a preset (or ``file.py:factory``) and example inputs: ``(model, args, kwargs)``.

    ``device`` defaults to ``meta`` for presets; ``batch``/``seq`` default to the preset's.
    HF presets take ``num_layers=``, ``dropout=`` (all dropouts, default 0.0), ``dtype=``, ``seed=``
    and any field of their transformers config; ``mlp``/``cnn`` take their constructor's options.
    """
    if ":" in name and name.split(":", 1)[0].endswith(".py"):
        return _build_from_file(name, device=device, batch=batch, seq=seq, **overrides)
    preset = PRESETS.get(name)
    if preset is None:
        raise ModelZooError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}, "
                            "or 'path/to/file.py:factory'")
    for label, value in (("batch", batch), ("seq", seq), ("num_layers", overrides.get("num_layers"))):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelZooError(f"{label} must be an int >= 1, got {value!r}"
                                + ("; a model needs at least one layer (--layers 1)" if label == "num_layers" else ""))
    if seq is not None and preset.seq is None:
        raise ModelZooError(f"preset {name!r} has no sequence dim; drop seq= (use features=)")
    dev = torch.device(device if device is not None else "meta")
    return preset.build(dev, batch or preset.batch, seq or preset.seq, **overrides)


def _build_from_file(spec: str, **options: Any) -> Built:
    """``path/to/file.py:factory``; options given explicitly (not None) are passed as kwargs."""
    path_text, factory_name = spec.rsplit(":", 1)
    path = Path(path_text)
    if not path.is_file():
        raise ModelZooError(f"model file {path} does not exist (from {spec!r})")
    module_spec = importlib.util.spec_from_file_location(f"_autoshard_zoo_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ModelZooError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ModelZooError(f"model file {path} has a syntax error at line {e.lineno}: {e.msg}; fix the file") from None
    except Exception as e:  # the user's module failed to import: report it as theirs, with the cause
        raise ModelZooError(f"model file {path} failed to import: {type(e).__name__}: {e}; fix the file "
                            f"(run `python {path}` to see the traceback)") from e
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        known = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ModelZooError(f"{path} has no callable {factory_name!r}; it defines {', '.join(known) or 'none'}")
    kwargs = {k: v for k, v in options.items() if v is not None}
    if "device" in kwargs and not _accepts(factory, "device"):
        kwargs.pop("device")        # a factory without device= builds where it likes (capture needs no real data)
    try:
        result = factory(**kwargs)
    except TypeError as e:
        if kwargs and "argument" in str(e):
            raise ModelZooError(f"{spec} does not accept {sorted(kwargs)}: {e}") from e
        raise ModelZooError(f"{spec} raised TypeError: {e}; fix the factory") from e
    except Exception as e:  # the factory is user code: its failure is reported as the user's, with the cause
        raise ModelZooError(f"{spec} raised {type(e).__name__}: {e}; fix the factory") from e
    return _normalise_factory_result(spec, result)


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):      # no signature to read (a builtin): pass it and let the call say
        return True
    return any(p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.kind == p.VAR_KEYWORD
               for p in params)


def _normalise_factory_result(spec: str, result: Any) -> Built:
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise ModelZooError(f"{spec} must return (model, args) or (model, args, kwargs), "
                            f"got {type(result).__name__}")
    model, args, *rest = result
    kwargs = rest[0] if rest else {}
    if not isinstance(model, nn.Module):
        raise ModelZooError(f"{spec} returned a {type(model).__name__} where an nn.Module belongs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ModelZooError(f"{spec} returned kwargs of type {type(kwargs).__name__}; return a dict of keyword "
                            f"inputs as the third element")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    return model, args, dict(kwargs or {})
