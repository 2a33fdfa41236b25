"""Small models: is the plan the solver picks faster, measured, than data parallelism and torch DDP?

On 4 gloo ranks sharing 2 CPU cores one collective costs milliseconds, so for the tiny presets the
solver (shipped ``cpu-gloo`` profile) plans fully replicated: every rank computes the whole batch,
and no gradient is synchronised. This bench checks that choice where it runs. Per model (a preset
at a batch x sequence length), in one torchrun launch of 4 ranks (2x2 mesh):

- ``solved``: ``autoshard.plan`` under the profile;
- ``data_parallel``: ``autoshard.plan(baseline="data_parallel")`` (run once, as the solved plan,
  where the two are the same plan);
- ``torch DDP``: the same model under ``DistributedDataParallel``, each rank a quarter of the batch.

Every autoshard plan is made with ``outputs="local"`` and ``loss="per_rank"`` (each rank's mean loss
over its share, averaged: the function DDP computes; for a replicated plan every rank's share is the
whole batch). A step is forward + backward + AdamW step (fp32, dropout 0), timed back to back as a
training loop runs it (``runtime_speed.run_rounds``), medians of interleaved rounds.

Run: python bench/replicated_plans.py [--models gpt2-tiny:8x64,llama-tiny:8x64,bert-tiny:8x64,gpt2-mini:8x64]
[--hardware cpu-gloo] [--rounds 30] [--steps 5] (re-launches itself under torchrun with 4 ranks).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import init_gloo_ranks, same_plan, work_or_launch, write  # noqa: E402
from runtime_speed import LOOP_TIMING  # noqa: E402

MESH = (2, 2)
WORLD = MESH[0] * MESH[1]
DEFAULT_MODELS = "gpt2-tiny:8x64,llama-tiny:8x64,bert-tiny:8x64,gpt2-mini:8x64"
TARGET = 1.05        # the solved plan over the fastest configuration


def parse_model(spec: str) -> tuple[str, int, int]:
    """``preset:BATCHxSEQ`` -> (preset, batch, seq)."""
    preset, _, shape = spec.partition(":")
    batch, _, seq = shape.partition("x")
    if not preset or not batch.isdigit() or not seq.isdigit():
        raise SystemExit(f"bad model {spec!r}: expected preset:BATCHxSEQ, e.g. gpt2-tiny:8x64")
    return preset, int(batch), int(seq)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import autoshard
    from autoshard.models import build_model
    from autoshard.plans.explain import sharding_counts
    from runtime_speed import Config, plan_info, plan_on_rank0, run_rounds

    mesh, rank = init_gloo_ranks(MESH)
    results = []
    for spec in args.models.split(","):
        preset, batch, seq = parse_model(spec)

        def build():
            torch.manual_seed(0)
            model, _, kwargs = build_model(preset, device="cpu", batch=batch, seq=seq, dropout=0.0)
            return model, kwargs

        configs, plans = [], {}
        for name, baseline in (("solved", None), ("data_parallel", "data_parallel")):
            model, kwargs = build()
            plan, seconds = plan_on_rank0(model, kwargs, MESH, baseline, rank, "local", args.hardware,
                                          loss="per_rank")
            info = {**plan_info(plan, seconds), "sharding": sharding_counts(plan)._asdict()}
            same = same_plan(plans, plan)
            plans[name] = plan
            if same is not None:
                results.append({"model": spec, "config": name, "same_as": same, "plan": info})
                continue
            pm = autoshard.parallelize(model, plan, mesh)
            configs.append(Config(name, spec, pm, kwargs, pm.parameters(), {"plan": info},
                                  loss_group=dist.group.WORLD))
        model, kwargs = build()
        local = {k: v.chunk(WORLD, 0)[rank].contiguous() for k, v in kwargs.items()}
        ddp = DDP(model)
        configs.append(Config("torch DDP", spec, ddp, local, ddp.parameters(), loss_group=dist.group.WORLD))
        if rank == 0:
            print(f"[replicated_plans {time.strftime('%H:%M:%S')}] {spec}: timing {[c.name for c in configs]}",
                  file=sys.stderr, flush=True)
        run_rounds(configs, args.warmup, args.rounds, args.steps, dist.barrier, settle=1, back_to_back=True)
        for c in configs:
            results.append({"model": spec, "config": c.name, "median_ms": 1e3 * statistics.median(c.times),
                            "min_ms": 1e3 * min(c.times), "max_ms": 1e3 * max(c.times), "n": len(c.times),
                            "step0_loss": c.first_loss, **c.extra})
        del configs, ddp
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, default=str))
    dist.destroy_process_group()


def _sharding(plan: dict) -> str:
    """The plan's compute ops run on shards (``autoshard.plans.explain.sharding_counts``)."""
    c = plan["sharding"]
    return "none: replicated" if not c["split_ops"] else f"{c['split_ops']} of {c['ops']} compute ops sharded"


def report(args: argparse.Namespace, results: list[dict], wall_s: float) -> None:
    header = ["model (batch x seq)", "solved plan", "modeled solved / data parallel ms", "measured solved ms",
              "data parallel ms", "torch DDP ms", "solved / fastest", f"<= {TARGET:.2f}x", "step-0 loss diff"]
    rows, summary = [], []
    for spec in args.models.split(","):
        mine = {r["config"]: r for r in results if r["model"] == spec}
        timed = {k: r for k, r in mine.items() if "median_ms" in r}

        def measured(name: str) -> dict:
            r = mine[name]
            return timed[r["same_as"]] if "same_as" in r else r

        solved, dp, ddp = measured("solved"), measured("data_parallel"), timed["torch DDP"]
        fastest = min(timed.values(), key=lambda r: r["median_ms"])
        ratio = solved["median_ms"] / fastest["median_ms"]
        modeled = [mine[k]["plan"]["modeled_ms"]["total"] for k in ("solved", "data_parallel")]
        losses = [r["step0_loss"] for r in timed.values()]
        dp_cell = f"{dp['median_ms']:.1f}" + (" (same plan)" if "same_as" in mine["data_parallel"] else "")
        rows.append([spec.replace(":", " ").replace("x", " x "), _sharding(mine["solved"]["plan"]),
                     f"{modeled[0]:.1f} / {modeled[1]:.1f}", f"{solved['median_ms']:.1f}", dp_cell,
                     f"{ddp['median_ms']:.1f}", f"{ratio:.2f}x", "yes" if ratio <= TARGET else "no",
                     f"{max(losses) - min(losses):.1e}"])
        summary.append({"model": spec, "solved_over_fastest": ratio, "fastest": fastest["config"]})
    note = (f"4 gloo ranks on a 2x2 mesh sharing the machine's cores, OMP_NUM_THREADS=1, profile `{args.hardware}`; "
            f"step = forward + backward + AdamW step, fp32, dropout 0, timed {LOOP_TIMING}; median ms of "
            f"{args.rounds} interleaved rounds of a turn of {args.steps} steps after 1 untimed one, after "
            f"{args.warmup} warm-up steps. Plans: outputs='local', loss='per_rank' (the function DDP computes). "
            "Solved plan: its compute ops that run on a shard of their work ('none: replicated': every rank runs "
            "every op on the whole batch). Step-0 loss diff: max - min of the configurations' global-batch losses at step 0. "
            f"Whole run {wall_s / 60:.1f} min (python bench/replicated_plans.py).")
    write("replicated_plans", {"results": results, "summary": summary, "hardware": args.hardware,
                               "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "wall_s": wall_s},
          header, rows, note)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated preset:BATCHxSEQ")
    ap.add_argument("--hardware", default="cpu-gloo", help="profile name or YAML path to plan under")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration before the rounds")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for spec in args.models.split(","):
        parse_model(spec)
    return work_or_launch(args, __file__, ("models", "hardware", "rounds", "steps", "warmup"), worker, report, WORLD, ROOT)


if __name__ == "__main__":
    raise SystemExit(main())
