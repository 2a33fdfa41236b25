"""Compiled execution: ``parallelize(..., compile=True)`` (inductor, C++ on CPU) vs the eager program.

For each (model, plan) two parallel modules from the same weights, one eager and one compiled, each
training step (forward + backward + AdamW step, fp32, dropout 0) timed between two barriers on every
rank (rank 0's wall time of a step is then the slowest rank's), medians of interleaved rounds (every
configuration runs a few steps in turn, so load from other processes hits all alike; the timing
helpers are those of ``bench/runtime_speed.py``). Compile time: the first step of the compiled
module (dynamo + AOTAutograd + inductor for forward and backward; the inductor cache is disabled so
that it is a cold compile) minus its steady median step. Both modules train on the same batch for
the same number of steps, so their losses are compared step by step (max relative difference).

Run: python bench/compile_speed.py [--rounds 4] [--steps 4] [--warmup 2]
(one torchrun launch, 4 gloo ranks on a 2x2 mesh, OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from runtime_speed import (BATCH, HARDWARE, MODELS, SEQ, Config, build, plan_info,  # noqa: E402
                           plan_on_rank0, run_rounds, stats)

# (model, baseline or None for the solved plan, outputs)
CASES = [("gpt2", None, "local"), ("gpt2", "megatron", "global"), ("llama", "megatron", "global"),
         ("llama", "zero3", "local")]


class LossConfig(Config):
    """A :class:`Config` that keeps every step's loss and the wall time of its first step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []
        self.first_step_s: float | None = None

    def step(self) -> float:
        t0 = time.perf_counter()
        loss = super().step()
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - t0
        self.losses.append(loss)
        return loss


def worker(args) -> dict:
    import torch.distributed as dist

    import autoshard

    mesh = autoshard.init_mesh((2, 2))
    rank = dist.get_rank()
    pairs = []
    configs: list[LossConfig] = []
    for model_key, baseline, outputs in CASES:
        model, kwargs = build(model_key)
        plan, seconds = plan_on_rank0(model, kwargs, (2, 2), baseline, rank, outputs)
        label = f"{model_key} {baseline or 'solved'}"
        made = []
        for compiled in (False, True):
            pm = autoshard.parallelize(copy.deepcopy(model), plan, mesh, compile=compiled)
            cfg = LossConfig(f"{label} {'compiled' if compiled else 'eager'}", model_key, pm, kwargs, pm.parameters(),
                             {"plan": plan_info(plan, seconds), "compiled": compiled})
            dist.barrier()
            cfg.step()            # the first step: the compile, for the compiled module
            dist.barrier()
            made.append(cfg)
        pairs.append((label, *made))
        configs += made
    # the first step ran above; the warm-up steps run in run_rounds
    run_rounds(configs, args.warmup, args.rounds, args.steps, dist.barrier)
    rows = []
    for label, eager, compiled in pairs:
        steady_e, steady_c = stats(eager.times), stats(compiled.times)
        diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager.losses, compiled.losses)]
        rows.append({"case": label, "eager": steady_e, "compiled": steady_c,
                     "speedup": steady_e["median_ms"] / steady_c["median_ms"],
                     "eager_first_step_s": eager.first_step_s, "compiled_first_step_s": compiled.first_step_s,
                     "compile_s": compiled.first_step_s - steady_c["median_ms"] / 1e3,
                     "steps_compared": len(diffs), "max_rel_loss_diff": max(diffs),
                     "first_loss": eager.losses[0], "plan": eager.extra["plan"]})
    return {"world_size": dist.get_world_size(), "cases": rows}


def worker_main(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = worker(args)
    if dist.get_rank() == 0:
        result["torch_threads"] = torch.get_num_threads()
        result["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
        Path(args.out).write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


def driver(args) -> int:
    from _common import write

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
               str(Path(__file__).resolve()), "--worker", "--out", str(out), "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        # a cold compile (no inductor/FX graph cache from earlier runs), in a cache folder of its own
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
               "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        print("$", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, cwd=ROOT)
        result = json.loads(out.read_text())
        result["wall_s"] = time.perf_counter() - t0
    env_info = {"torch": torch.__version__, "OMP_NUM_THREADS": result.get("omp_num_threads"),
                "torch_threads_per_rank": result.get("torch_threads"), "backend": "gloo", "cpus": os.cpu_count(),
                "loadavg_at_end": os.getloadavg()}
    try:
        import transformers
        env_info["transformers"] = transformers.__version__
    except ImportError:
        pass
    data = {"settings": {"batch": BATCH, "seq": SEQ, "hardware_profile": HARDWARE, "models": MODELS,
                         "cases": CASES, "rounds": args.rounds, "steps_per_round": args.steps, "warmup": args.warmup,
                         "compile": "torch.compile(backend='inductor', dynamic=False), cold caches",
                         "timing": "barrier; forward+backward+AdamW step+zero_grad; barrier (rank 0 wall time)"},
            "environment": env_info, **result}
    fmt = lambda s: f"{s['median_ms']:.1f} ({s['min_ms']:.1f}-{s['max_ms']:.1f})"  # noqa: E731
    rows = [[c["case"], fmt(c["eager"]), fmt(c["compiled"]), f"{c['speedup']:.2f}x", f"{c['compile_s']:.0f}",
             f"{c['compiled_first_step_s']:.1f} / {c['eager_first_step_s']:.2f}",
             f"{c['max_rel_loss_diff']:.1e} ({c['steps_compared']} steps)"] for c in result["cases"]]
    note = ("Step = forward + backward + AdamW step, fp32, batch 8 x seq 128 (global), 4 gloo ranks on a 2x2 mesh, "
            f"median (min-max) ms of {args.rounds} interleaved rounds x {args.steps} steps after "
            f"{args.warmup} warm-up steps, OMP_NUM_THREADS=1, one torchrun launch. Compiled: "
            "parallelize(..., compile=True) = torch.compile(inductor, dynamic=False) of the local program with "
            "functional collectives; the bucketed gradient all-reduce and the AdamW step stay eager. compile s: the "
            "compiled module's first step (cold inductor caches) minus its median step. Loss diff: max relative "
            "difference of the eager and compiled losses over every step both ran (same weights, same batch). "
            "The machine's 2 cores are shared with other processes: the figures are noisy. Models: " +
            ", ".join(f"{k}: {p} {o}" for k, (p, o) in MODELS.items()) + "; solved plans for the cpu-gloo profile; "
            "'local' plans keep each rank's shard of the logits (outputs='local').")
    write("compile_speed", data, ["case", "eager ms", "compiled ms", "speed-up", "compile s",
                                  "first step s (compiled / eager)", "max loss diff"], rows, note)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per configuration per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
