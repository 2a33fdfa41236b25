"""Model zoo: transformers families planned and trained on 4 gloo ranks, exactly like one process.

For each family (a tiny config built from scratch, no download; the loss computed inside the model
from labels): capture on meta tensors, plan on a 2x2 mesh under two profiles, and train 3 steps on
4 gloo ranks next to the same model on one process:

- ``default``: the shipped ``cpu-gloo`` profile (what a user on this machine gets);
- ``forced``: ``h100-nvlink`` with communication priced near zero and compute at 1 GFLOP/s, so that
  the solver shards every node it can (the check that the sharded kernels, not replication, are
  what trains exactly).

Per family and profile: sharded op nodes / op nodes (a node is sharded when any of its input or
output specs splits a dim), whether 3 training steps give the same losses and final parameters as
one process, or the error that stopped it. Each plan is trained twice:

- SGD with momentum, whose step is linear in the gradient: losses, parameters and buffers within
  rtol 1e-5, atol 1e-6 (fp32), the rtol of a parameter relative to the larger of its final value and
  how far training moved it (an element that moved by several units and ended near zero carries the
  rounding of its updates: CLIP's text position embedding, one element 1.4e-6 off after 3 steps, where
  one process in float32 is itself 7.9e-7 off float64);
- AdamW (lr 1e-3): losses as above; parameters within rtol 1e-5 and 1% of the most AdamW can move an
  element in 3 steps. AdamW divides by the gradient's own size, so an element whose gradient nearly
  cancels moves by a fraction of lr set by rounding, and a gradient that is zero up to rounding
  (a key bias: softmax ignores a per-row constant) by a full lr-sized step whose sign depends on
  the summation order. Parameters of that second kind (whose float32 gradient, eval mode, is more
  than 10% away from the float64 one) are listed in the table and their AdamW values not compared.

Run: python bench/model_zoo.py [--families gpt2,llama]   (one torchrun launch, 4 ranks, ~10 min)
Writes bench/results/model_zoo.{json,md}.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BATCH, SEQ, IMAGE = 8, 16, 32
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6
ADAMW_LR = 1e-3
OPTIMIZERS = ("sgd", "adamw")
NOISE = 0.1              # a float32 gradient this far from the float64 one (relative) is rounding noise

LM = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
          max_position_embeddings=64)


def _lm(config: str, model: str, **fields: Any) -> Callable[[], tuple[torch.nn.Module, dict]]:
    """A causal or masked LM: input ids and labels (the model shifts or masks them)."""
    def build():
        import transformers

        cfg = getattr(transformers, config)(use_cache=False, **fields)
        ids = torch.randint(3, 100, (BATCH, SEQ))
        return getattr(transformers, model)(cfg), {"input_ids": ids, "labels": ids}
    return build


def _seq2seq(config: str, model: str, **fields: Any) -> Callable[[], tuple[torch.nn.Module, dict]]:
    def build():
        import transformers

        cfg = getattr(transformers, config)(use_cache=False, **fields)
        ids = torch.randint(3, 100, (BATCH, SEQ))
        return getattr(transformers, model)(cfg), {"input_ids": ids, "labels": ids.flip(1).contiguous()}
    return build


def _vision(config: str, model: str, **fields: Any) -> Callable[[], tuple[torch.nn.Module, dict]]:
    def build():
        import transformers

        cfg = getattr(transformers, config)(num_labels=10, **fields)
        return getattr(transformers, model)(cfg), {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE),
                                                   "labels": torch.randint(0, 10, (BATCH,))}
    return build


def _clip():
    import transformers

    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=SEQ),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           image_size=IMAGE, patch_size=8), projection_dim=32)
    return transformers.CLIPModel(cfg), {"input_ids": torch.randint(3, 100, (BATCH, SEQ)),
                                         "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE), "return_loss": True}


ENC = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           max_position_embeddings=64)
FAMILIES: dict[str, tuple[str, Callable[[], tuple[torch.nn.Module, dict]]]] = {
    "gpt2": ("decoder, learned positions, Conv1D, tied head", _lm(
        "GPT2Config", "GPT2LMHeadModel", vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "gpt_neox": ("decoder, partial rotary, parallel residual", _lm("GPTNeoXConfig", "GPTNeoXForCausalLM", **LM)),
    "gptj": ("decoder, rotary, parallel attention/MLP", _lm(
        "GPTJConfig", "GPTJForCausalLM", vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        rotary_dim=4)),
    "opt": ("decoder, learned positions, untied head", _lm(
        "OPTConfig", "OPTForCausalLM", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32)),
    "bloom": ("decoder, ALiBi", _lm("BloomConfig", "BloomForCausalLM", vocab_size=128, hidden_size=32, n_layer=2,
                                     n_head=4)),
    "llama": ("decoder, rotary, GQA, RMSNorm, SwiGLU", _lm("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2,
                                                            **LM)),
    "mistral": ("decoder, rotary, GQA, sliding window", _lm("MistralConfig", "MistralForCausalLM",
                                                             num_key_value_heads=2, sliding_window=8, **LM)),
    "qwen2": ("decoder, rotary, GQA, qkv bias", _lm("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **LM)),
    "gemma": ("decoder, MQA, GeGLU, scaled embeddings", _lm("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=1,
                                                            head_dim=8, **LM)),
    "phi": ("decoder, partial rotary, parallel attention/MLP", _lm("PhiConfig", "PhiForCausalLM", **LM)),
    "falcon": ("decoder, MQA, parallel attention", _lm(
        "FalconConfig", "FalconForCausalLM", vocab_size=128, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, multi_query=True, parallel_attn=True)),
    "stablelm": ("decoder, partial rotary, LayerNorm", _lm("StableLmConfig", "StableLmForCausalLM",
                                                            num_key_value_heads=4, **LM)),
    "mixtral": ("mixture of experts: router top-k, token dispatch", _lm(
        "MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        **LM)),
    "bert": ("encoder, masked LM", _lm("BertConfig", "BertForMaskedLM", **ENC)),
    "roberta": ("encoder, masked LM, offset positions", _lm("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1,
                                                            **ENC)),
    "distilbert": ("encoder, masked LM", _lm("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=128, dim=32,
                                             n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)),
    "electra": ("encoder, embedding projection", _lm("ElectraConfig", "ElectraForMaskedLM", embedding_size=16,
                                                      **ENC)),
    "albert": ("encoder, shared layers, factorised embeddings", _lm("AlbertConfig", "AlbertForMaskedLM",
                                                                     embedding_size=16, **ENC)),
    "t5": ("encoder-decoder, relative position bias", _seq2seq(
        "T5Config", "T5ForConditionalGeneration", vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
        num_heads=4, decoder_start_token_id=0)),
    "bart": ("encoder-decoder, learned positions", _seq2seq(
        "BartConfig", "BartForConditionalGeneration", vocab_size=128, d_model=32, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64)),
    "vit": ("vision transformer, patch conv", _vision(
        "ViTConfig", "ViTForImageClassification", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, image_size=IMAGE, patch_size=8)),
    "swin": ("vision, windowed attention", _vision(
        "SwinConfig", "SwinForImageClassification", image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1],
        num_heads=[2, 4], window_size=4)),
    "resnet": ("CNN, BatchNorm, in-place residual adds", _vision(
        "ResNetConfig", "ResNetForImageClassification", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        layer_type="basic")),
    "convnext": ("CNN, depthwise conv, LayerNorm", _vision(
        "ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)),
    "clip": ("multimodal dual encoder, contrastive loss", _clip),
}


def forced_profile():
    """h100-nvlink with communication nearly free and compute at 1 GFLOP/s (its measured compute
    curves dropped, so that the roofline prices every op): the solver shards every node it can."""
    from autoshard.hardware import LinkModel, load_hardware

    hw = load_hardware("h100-nvlink")
    free = LinkModel(alpha=1e-12, beta=1e-18)
    return dataclasses.replace(hw, name="forced-sharding", axes=(free, free), world=free, kinds={},
                               peak_flops={k: 1e9 for k in hw.peak_flops}, memory_bandwidth=1e9, compute={})


# -- worker (every rank) --------------------------------------------------------------------------

def _sharded_nodes(plan) -> tuple[int, int]:
    from autoshard.specs import ShardSpec

    ops = [n for n in plan.nodes.values() if n.kind == "call_function"]
    sharded = sum(1 for n in ops if any(not ShardSpec.parse(s).is_replicated()
                                        for s in n.inputs + [o for o in n.outputs if o is not None]))
    return sharded, len(ops)


def _optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=ADAMW_LR)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def param_atol(optimizer: str) -> float:
    """Absolute tolerance of a final parameter. AdamW moves an element by up to ``lr`` per step
    whatever its gradient's size, so an element whose gradient nearly cancels (relative rounding of
    1e-3 and more) moves by a rounding-dependent fraction of ``lr``: allowed up to 1% of the most
    AdamW can move it in ``STEPS`` steps (a wrong gradient moves it by up to 100%; SGD, whose step
    is linear in the gradient, is checked at ``ATOL``)."""
    return max(ATOL, 1e-2 * ADAMW_LR * STEPS) if optimizer == "adamw" else ATOL


def _train(model, kwargs: dict, seed: int, optimizer: str) -> list[torch.Tensor]:
    """``STEPS`` optimizer steps with seeded dropout."""
    opt = _optimizer(model.parameters(), optimizer)
    losses = []
    for step in range(STEPS):
        torch.manual_seed(seed + step)
        loss = model(**kwargs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _grads(model, kwargs: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Parameter gradients of one eval-mode step (no dropout) of a copy of ``model`` in ``dtype``."""
    model = copy.deepcopy(model).to(dtype).eval()
    cast = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    model(**cast).loss.backward()
    return {k: p.grad.double() for k, p in model.named_parameters() if p.grad is not None}


def rounding_only(model, kwargs: dict) -> set[str]:
    """Parameters whose float32 gradient is rounding noise: more than ``NOISE`` (relative, largest
    element) away from the float64 gradient. Their true gradient is zero or nearly (a key bias,
    which softmax ignores); AdamW divides by the gradient's own size, so the sign of the noise,
    which depends on the summation order, sets an lr-sized step. A gradient that is only small (a
    block behind a layer scale of 1e-6) is accurate in float32 and stays compared. A model that
    cannot run in float64 has every parameter compared."""
    single = _grads(model, kwargs, torch.float32)
    try:
        double = _grads(model, kwargs, torch.float64)
    except RuntimeError:             # an op with no float64 kernel (Mixtral's grouped matmul): compare them all
        return set()
    return {k for k, g in double.items()
            if float((single[k] - g).abs().max()) > NOISE * float(g.abs().max()) + 1e-30}


def _check_training(model, plan, graph, kwargs: dict, mesh, optimizer: str) -> dict:
    """Train ``model`` parallelized under ``plan`` and a copy on this process with ``optimizer``;
    AssertionError (naming the optimizer and tensor) unless losses and final state agree."""
    import autoshard

    reference = copy.deepcopy(model)
    initial = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    pm = autoshard.parallelize(copy.deepcopy(model), plan, mesh, graph=graph)
    losses = _train(pm, kwargs, 100, optimizer)
    skipped = rounding_only(reference, kwargs) if optimizer == "adamw" else set()
    want = _train(reference, kwargs, 100, optimizer)
    worst = 0.0
    for step, (got, ref) in enumerate(zip(losses, want)):
        worst = max(worst, float((got - ref).abs() / ref.abs().clamp_min(1e-12)))
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{optimizer} loss {step}: {m}")
    state, ref_state = pm.state_dict(), reference.state_dict()
    params = dict(reference.named_parameters())
    for key, value in ref_state.items():         # parameters, and buffers (running statistics) at ATOL
        if key not in skipped:
            assert_state_close(f"{optimizer} {key}", state[key], value, initial[key],
                               param_atol(optimizer) if key in params else ATOL)
    return {"loss_rel_diff": worst, "rounding_only": sorted(skipped)}


def assert_state_close(what: str, got: torch.Tensor, want: torch.Tensor, initial: torch.Tensor, atol: float) -> None:
    """``got`` within ``atol + RTOL * max(|want|, |want - initial|)`` of ``want``, element by element.

    Rounding in a training step is relative to what the step computes: an element that moved far
    and ended near zero (an SGD step of a large gradient) carries the rounding of its updates, which
    a tolerance relative to its final value alone does not allow for."""
    got, want, initial = got.detach().double(), want.detach().double(), initial.double()
    allowed = atol + RTOL * torch.maximum(want.abs(), (want - initial).abs())
    diff = (got - want).abs()
    bad = diff > allowed
    if bool(bad.any()):
        worst = int(torch.argmax(diff - allowed))
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), want.shape)) if want.ndim else ()
        raise AssertionError(f"{what}: {int(bad.sum())} of {want.numel()} elements differ; worst at {index}: "
                             f"{float(got.flatten()[worst]):.9g} vs {float(want.flatten()[worst]):.9g} "
                             f"(moved {float((want - initial).flatten()[worst]):.3g} in training), "
                             f"allowed {float(allowed.flatten()[worst]):.3g}")


def _run_family(name: str, profile: Any, mesh) -> dict:
    import autoshard
    from autoshard.runtime import capture_meta

    torch.manual_seed(0)
    model, kwargs = FAMILIES[name][1]()
    model.train()
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    graph = capture_meta(model, (), kwargs, name=name)
    plan = autoshard.plan_once(graph, mesh=(2, 2), hardware=profile)
    out["plan_s"] = time.perf_counter() - t0
    out["sharded"], out["ops"] = _sharded_nodes(plan)
    out["fallbacks"] = list(plan.fallbacks)
    for optimizer in OPTIMIZERS:
        out[optimizer] = _check_training(model, plan, graph, kwargs, mesh, optimizer)
    out["rounding_only"] = out["adamw"]["rounding_only"]
    return out


def worker(args) -> None:
    import torch.distributed as dist

    import autoshard

    torch.set_num_threads(1)
    mesh = autoshard.init_mesh((2, 2))
    rank = dist.get_rank()
    profiles = {"default": "cpu-gloo", "forced": forced_profile()}
    results: dict[str, dict] = {}
    for name in args.families.split(","):
        results[name] = {}
        for label, profile in profiles.items():
            try:
                entry = _run_family(name, profile, mesh)
                entry["matched"] = True
            except Exception as e:           # reported per family: one failure must not hide the others
                entry = {"matched": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                if rank == 0:
                    traceback.print_exc()
            flags = [None] * dist.get_world_size()
            dist.all_gather_object(flags, entry.get("error"))
            if entry["matched"] and any(flags):
                entry = {"matched": False, "error": next(f for f in flags if f)}
            results[name][label] = entry
            if rank == 0:
                print(f"[zoo] {name} {label}: {entry}", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(HERE))
    from _common import write

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "zoo.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
               str(Path(__file__).resolve()), "--worker", "--out", str(out), "--families", args.families]
        subprocess.run(cmd, env=env, check=True, cwd=ROOT)
        results = json.loads(out.read_text())
    rows = []
    for name, by_profile in results.items():
        row = [name, FAMILIES[name][0]]
        for label in ("default", "forced"):
            e = by_profile[label]
            plan = f"{e['sharded']}/{e['ops']}" if "ops" in e else "-"
            row += [plan, "yes" if e["matched"] else f"NO: {e.get('error', '')[:160]}"]
        skipped = sorted({k for e in by_profile.values() for k in e.get("rounding_only", [])})
        row.append(", ".join(skipped) or "-")
        rows.append(row)
    matched = sum(all(e["matched"] for e in p.values()) for p in results.values())
    note = (f"{matched} of {len(results)} families train exactly like one process under both profiles. 2x2 mesh, "
            f"4 gloo ranks, batch {BATCH}, seq {SEQ} (images {IMAGE}x{IMAGE}), 2 layers, hidden 32, fp32; "
            f"{STEPS} steps with seeded dropout, twice: SGD (lr 0.1, momentum 0.9; losses, final parameters and "
            f"buffers within rtol {RTOL}, atol {ATOL}, a parameter's rtol relative to the larger of its final value "
            f"and how far training moved it) and AdamW (lr {ADAMW_LR}; parameters within atol "
            f"{param_atol('adamw'):.0e}, 1% of the most AdamW moves an element in {STEPS} steps; parameters whose float32 "
            "gradient is rounding noise, more than 10% from the float64 one, listed and not compared). Plan: sharded op nodes / op nodes. default: cpu-gloo; forced: "
            f"communication nearly free, compute 1 GFLOP/s (roofline, no measured curves). Whole run {(time.perf_counter() - t0) / 60:.1f} min "
            "(python bench/model_zoo.py).")
    write("model_zoo", {"results": results, "steps": STEPS, "optimizers": OPTIMIZERS, "rtol": RTOL,
                        "atol": ATOL, "adamw_param_atol": param_atol("adamw")},
          ["family", "what it exercises", "default plan", "default trains exactly", "forced plan",
           "forced trains exactly", "rounding-only gradients (not compared)"], rows, note)


if __name__ == "__main__":
    main()
