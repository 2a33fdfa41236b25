"""Overhead of the runtime itself: a 1x1 mesh vs the plain module and vs the exported graph, one rank.

Each configuration trains GPT-2 and Llama (width 128, 4 layers, batch 8, seq 128, fp32) with AdamW;
steps are timed individually and interleaved in rounds (order reversed every other round) so that
load from other processes hits all configurations alike; medians over all timed steps. The
exported graph (``torch.export(...).module()``) is what autoshard executes, so "vs exported"
isolates the runtime's own cost from the capture's. Target: autoshard 1x1 <= 1.05x the plain module.

Run: python bench/runtime_overhead.py [--rounds 8] [--steps 4]
(re-launches itself under torchrun with one rank, OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine, write  # noqa: E402

MODELS = {
    "gpt2": ("gpt2-tiny", dict(n_embd=128, num_layers=4, n_head=4, n_positions=128, vocab_size=2048)),
    "llama": ("llama-tiny", dict(hidden_size=128, intermediate_size=512, num_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=2048, max_position_embeddings=128)),
}


def worker(rounds: int, steps: int, out: str) -> None:
    import autoshard
    from autoshard.models import build_model

    torch.set_num_threads(1)
    mesh = autoshard.init_mesh((1, 1))
    results = {}
    for label, (preset, overrides) in MODELS.items():
        torch.manual_seed(0)
        model, args, kwargs = build_model(preset, device="cpu", batch=8, seq=128, **overrides)
        plan = autoshard.plan(model, args, kwargs, mesh=(1, 1), hardware="cpu-gloo")
        modules = {"plain": copy.deepcopy(model),
                   "exported graph": torch.export.export(copy.deepcopy(model), args, kwargs, strict=False).module(),
                   "autoshard 1x1": autoshard.parallelize(model, plan, mesh)}
        opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in modules.items()}

        def step(name: str) -> float:
            start = time.perf_counter()
            modules[name](*args, **kwargs).loss.backward()
            opts[name].step()
            opts[name].zero_grad()
            return time.perf_counter() - start

        times: dict[str, list[float]] = {n: [] for n in modules}
        for name in modules:
            for _ in range(3):
                step(name)
        for r in range(rounds):
            for name in (list(modules) if r % 2 == 0 else list(modules)[::-1]):
                times[name] += [step(name) for _ in range(steps)]
        results[label] = {n: ts for n, ts in times.items()}
    with open(out, "w") as f:
        json.dump(results, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--worker-out")
    a = p.parse_args()
    if a.worker_out:
        worker(a.rounds, a.steps, a.worker_out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                        __file__, "--rounds", str(a.rounds), "--steps", str(a.steps), "--worker-out", out],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(out) as f:
            times = json.load(f)
    rows, data = [], {"machine": machine(), "rounds": a.rounds, "steps": a.steps, "models": {}}
    for label, per in times.items():
        med = {n: statistics.median(ts) for n, ts in per.items()}
        ratio = med["autoshard 1x1"] / med["plain"]
        data["models"][label] = {"median_s": med, "steps_s": per, "ratio_vs_plain": ratio,
                                 "ratio_vs_exported": med["autoshard 1x1"] / med["exported graph"]}
        rows.append([label, f"{med['plain'] * 1e3:.1f}", f"{med['exported graph'] * 1e3:.1f}",
                     f"{med['autoshard 1x1'] * 1e3:.1f}", f"{ratio:.3f}x",
                     f"{med['autoshard 1x1'] / med['exported graph']:.3f}x", "yes" if ratio <= 1.05 else "NO"])
    write("runtime_overhead", data,
          ["model", "plain ms", "exported graph ms", "autoshard 1x1 ms", "autoshard / plain", "autoshard / exported",
           "<= 1.05x"], rows,
          note=f"Training step (forward + backward + AdamW), width 128, 4 layers, batch 8, seq 128, fp32, one "
               f"rank, 1 torch thread; median of {a.rounds} interleaved rounds x {a.steps} steps after 3 warm-up "
               f"steps per configuration.")


if __name__ == "__main__":
    main()
