"""Cost of the step watch (a rank that skips backward is an error): the same plan with it
(``check_inputs="first"``, the default) and without (``check_inputs="never"``), on 4 gloo ranks.

Per model (a ``bench/plan_fidelity.py`` model key) and plan (``--plans``: baselines and ``solved``,
planned under ``--hardware`` with ``outputs="local"`` and the model's fidelity-bench function
options), the two modules train in interleaved rounds as a training loop runs them, back to back
(``runtime_speed.run_rounds(back_to_back=True)``: a turn of steps timed as one, the job's step while
every rank was stepping). Each rank also times the watch's own code per step (the
call's check, which reads the store at most once per 0.25 s of calls; the start of backward, which
posts this rank's word to the store's background writer) and counts the diagnosis reads.

Run: python bench/step_watch_overhead.py [--models gpt2-64:8x32,cnn-12:8x32] [--plans data_parallel,replicated]
[--hardware cpu-gloo] [--rounds 30] [--steps 3] (re-launches itself under torchrun with 4 ranks).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import init_gloo_ranks, rank_bench_parser, work_or_launch, write  # noqa: E402
from runtime_speed import LOOP_TIMING  # noqa: E402

MESH = (2, 2)
WORLD = MESH[0] * MESH[1]
DEFAULT_MODELS = "gpt2-64:8x32,cnn-12:8x32"
DEFAULT_PLANS = "data_parallel,replicated"
MODES = (("with watch", "first"), ("without", "never"))


def _timed_watch(own: dict) -> None:
    """Time the watch's per-step code and count its diagnosis reads into ``own`` (this rank)."""
    from autoshard.runtime import step_watch

    def timed(name, fn):
        def wrapper(self, *args):
            start = time.perf_counter()
            try:
                return fn(self, *args)
            finally:
                own[name] += time.perf_counter() - start
        return wrapper

    def counted(fn):
        def wrapper(self, *args, **kwargs):
            own["reads"] += 1
            return fn(self, *args, **kwargs)
        return wrapper

    watch = step_watch.StepWatch
    watch.before_forward = timed("before_forward", watch.before_forward)
    watch.backward_started = timed("backward_started", watch.backward_started)
    watch.check = counted(watch.check)


def worker(args: argparse.Namespace) -> None:
    import json

    import torch.distributed as dist

    import autoshard
    import plan_fidelity as pf
    from runtime_speed import Config, plan_on_rank0, run_rounds

    mesh, rank = init_gloo_ranks(MESH)
    own = {"before_forward": 0.0, "backward_started": 0.0, "reads": 0}
    _timed_watch(own)
    results = []
    for key in args.models.split(","):
        for plan_name in args.plans.split(","):
            model, kwargs = pf.build(key)
            plan, _ = plan_on_rank0(model, kwargs, MESH, None if plan_name == "solved" else plan_name, rank, "local",
                                    args.hardware, **pf.function_options(key))
            configs = []
            for mode, check in MODES:
                pm = autoshard.parallelize(pf.build(key)[0], plan, mesh, check_inputs=check)
                configs.append(Config(mode, key, pf.LossView(pm), kwargs, pm.parameters()))
            own.update(before_forward=0.0, backward_started=0.0, reads=0)
            run_rounds(configs, 2, args.rounds, args.steps, dist.barrier, settle=1, back_to_back=True)
            steps = (2 + args.rounds * (1 + args.steps))          # every step the watched module ran
            everyone: list = [None] * WORLD
            dist.all_gather_object(everyone, {k: v / steps for k, v in own.items()})
            times = {c.name: c.times for c in configs}
            results.append({"model": key, "plan": plan_name, "modeled_ms": 1e3 * plan.time["total"],
                            "median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
                            "times_s": times, "watch_own_per_step_per_rank": everyone})
            if rank == 0:
                print(f"[step_watch_overhead {time.strftime('%H:%M:%S')}] {key} {plan_name} done", file=sys.stderr,
                      flush=True)
            del configs
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, default=str))
    dist.destroy_process_group()


def _span(values) -> str:
    return f"{1e3 * min(values):.3f}-{1e3 * max(values):.3f}"


def report(args: argparse.Namespace, results: list[dict], wall_s: float) -> None:
    import os

    rows = []
    for r in results:
        with_ms, without_ms = r["median_ms"]["with watch"], r["median_ms"]["without"]
        own = r["watch_own_per_step_per_rank"]
        rows.append([r["model"], r["plan"], f"{without_ms:.2f}", f"{with_ms:.2f}", f"{with_ms / without_ms:.3f}x",
                     _span([o["before_forward"] for o in own]), _span([o["backward_started"] for o in own]),
                     f"{max(o['reads'] for o in own):.2f}"])
    load = os.getloadavg()[0]
    note = (f"Training step (forward + backward + AdamW, fp32), 4 gloo ranks on a 2x2 mesh sharing the machine's "
            f"cores, 1 torch thread each, profile `{args.hardware}`; the module with the watch and without it in "
            f"{args.rounds} interleaved rounds of a turn of {args.steps} steps, {LOOP_TIMING} (after 2 warm-up "
            f"steps), medians. Watch code: per step, the range over ranks. Load average (1 min) after the "
            f"run {load:.1f}; whole run {wall_s / 60:.1f} min (python bench/step_watch_overhead.py).")
    write("step_watch_overhead", {"results": results, "hardware": args.hardware, "rounds": args.rounds,
                                  "steps": args.steps, "wall_s": wall_s, "load_average_1min_after": load},
          ["model", "plan", "without ms", "with watch ms", "with / without", "watch at the call ms",
           "watch at backward start ms", "diagnosis reads per step"], rows, note)


def main() -> int:
    ap = rank_bench_parser(__doc__.split("\n\n")[0], DEFAULT_MODELS, "cpu-gloo")
    ap.add_argument("--plans", default=DEFAULT_PLANS, help="comma-separated baselines, and 'solved'")
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round")
    args = ap.parse_args()
    import plan_fidelity as pf

    for key in args.models.split(","):
        pf.model_spec(key)
    return work_or_launch(args, __file__, ("models", "plans", "hardware", "rounds", "steps"), worker, report, WORLD,
                          ROOT)


if __name__ == "__main__":
    raise SystemExit(main())
