"""Steps in lockstep vs drifted: how much a plan's step gains when its ranks are not held together.

The profile's compute rates are timed with the 4 ranks running the same op at once (in lockstep). In a
training loop, a plan whose step has no collective (every rank computing the whole batch) lets its ranks
drift apart, so that ranks sharing cores run different phases at once; a plan with collectives is
brought back together at each one. This bench runs the same plans both ways, interleaved, in one
torchrun launch of 4 ranks (2x2 mesh):

- ``back to back``: as a training loop runs them (``runtime_speed.run_rounds(back_to_back=True)``:
  a turn of steps timed as one, the job's step while every rank was stepping);
- ``barrier per step``: a barrier before and after every step (``back_to_back=False``), which holds
  the ranks in lockstep; the time includes the closing barrier (1-2 ms on these ranks).

Plans per model (a ``bench/plan_fidelity.py`` model key): the ``replicated``, ``data_parallel`` and
solved plans under the profile, ``outputs="local"`` and the model's fidelity-bench function options
(a plan equal to one before it runs once). A step is forward + backward + AdamW (fp32).

Run: python bench/step_lockstep.py [--models mlp-256,cnn-20:8x32,gpt2-64:8x32] [--hardware cpu-gloo]
[--passes 6] [--rounds 8] [--steps 3] (re-launches itself under torchrun with 4 ranks).
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
from _common import init_gloo_ranks, rank_bench_parser, same_plan, work_or_launch, write  # noqa: E402

MESH = (2, 2)
WORLD = MESH[0] * MESH[1]
DEFAULT_MODELS = "mlp-256,cnn-20:8x32,gpt2-64:8x32"
PLANS = (("replicated", "replicated"), ("data_parallel", "data_parallel"), ("solved", None))
MODES = ("back to back", "barrier per step")


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import autoshard
    import plan_fidelity as pf
    from runtime_speed import Config, plan_on_rank0, run_rounds

    mesh, rank = init_gloo_ranks(MESH)
    results = []
    for key in args.models.split(","):
        configs, plans = [], {}
        for name, baseline in PLANS:
            model, kwargs = pf.build(key)
            plan, _ = plan_on_rank0(model, kwargs, MESH, baseline, rank, "local", args.hardware,
                                    **pf.function_options(key))
            same = same_plan(plans, plan)
            plans[name] = plan
            entry = {"model": key, "plan": name, "modeled_ms": 1e3 * plan.time["total"]}
            if same is not None:
                results.append({**entry, "same_as": same})
                continue
            pm = autoshard.parallelize(model, plan, mesh)
            configs.append(Config(name, key, pf.LossView(pm), kwargs, pm.parameters(), entry))
        times: dict[tuple[str, str], list[float]] = {(c.name, m): [] for c in configs for m in MODES}
        for p in range(args.passes):           # the two modes alternate, so that drift hits both alike
            mode = MODES[p % 2]
            for c in configs:
                c.times.clear()
            run_rounds(configs, 2, args.rounds, args.steps, dist.barrier, settle=1,
                       back_to_back=mode == MODES[0])
            for c in configs:
                times[c.name, mode] += c.times
        if rank == 0:
            print(f"[step_lockstep {time.strftime('%H:%M:%S')}] {key} done", file=sys.stderr, flush=True)
        for c in configs:
            results.append({**c.extra, **{mode: 1e3 * statistics.median(times[c.name, mode]) for mode in MODES},
                            "n": len(times[c.name, MODES[0]])})
        del configs
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, default=str))
    dist.destroy_process_group()


def report(args: argparse.Namespace, results: list[dict], wall_s: float) -> None:
    header = ["model", "plan", "modeled ms", "back to back ms", "barrier per step ms", "lockstep / back to back"]
    rows = []
    models = list(dict.fromkeys(r["model"] for r in results))
    order = [name for name, _ in PLANS]
    for r in sorted(results, key=lambda r: (models.index(r["model"]), order.index(r["plan"]))):
        if "same_as" in r:
            rows.append([r["model"], r["plan"], f"{r['modeled_ms']:.2f}", f"same plan as {r['same_as']}", "", ""])
            continue
        b2b, lock = r[MODES[0]], r[MODES[1]]
        rows.append([r["model"], r["plan"], f"{r['modeled_ms']:.2f}", f"{b2b:.1f}", f"{lock:.1f}", f"{lock / b2b:.2f}x"])
    note = (f"4 gloo ranks on a 2x2 mesh sharing the machine's cores, OMP_NUM_THREADS=1, profile `{args.hardware}`; "
            "step = forward + backward + AdamW step, fp32. Medians over "
            f"{args.passes} alternating passes (back to back, barrier per step, ...) of {args.rounds} interleaved "
            f"rounds x {args.steps} steps each. Barrier per step includes the closing barrier. Whole run "
            f"{wall_s / 60:.1f} min (python bench/step_lockstep.py).")
    write("step_lockstep", {"results": results, "hardware": args.hardware, "passes": args.passes,
                            "rounds": args.rounds, "steps": args.steps, "wall_s": wall_s},
          header, rows, note)


def main() -> int:
    ap = rank_bench_parser(__doc__.split("\n\n")[0], DEFAULT_MODELS, "cpu-gloo")
    ap.add_argument("--passes", type=int, default=6, help="alternating passes (even: both modes alike)")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds per pass")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round")
    args = ap.parse_args()
    import plan_fidelity as pf

    for key in args.models.split(","):
        pf.model_spec(key)
    if args.passes < 2 or args.passes % 2:
        raise SystemExit(f"--passes must be even and at least 2 (both modes alike), not {args.passes}")
    return work_or_launch(args, __file__, ("models", "hardware", "passes", "rounds", "steps"), worker, report, WORLD, ROOT)


if __name__ == "__main__":
    raise SystemExit(main())
