"""Time a finished plan-fidelity run's plans again, in a fresh process: model error or machine drift?

``bench/plan_fidelity.py`` times each model's plans minutes after it measured the profile they are
priced under, on a shared VM whose speed moves by a third within minutes. Where a model misses its
targets there, this bench tells whether the cost model or the moment was wrong: in one new torchrun
launch of 4 gloo ranks (2x2 mesh) it solves every plan of the named models again under THAT run's
measured profile (``bench/results/FROM_RUN-profile.yaml``; each plan's modeled time is checked to be
the run's, within 1%: a budget plan's ILP stops within its gap), builds the plans that ran there and
torch DDP, and times them as the fidelity bench times its rounds (interleaved back-to-back turns,
the job's step while every rank was stepping, ``runtime_speed._loop_turn``; without FSDP2 and the
head to head, so one fewer configuration per round), with the profile's compute points timed
again before and after (the machine drift, ``autoshard.profile.compute.remeasure_drift``).

Per model: the median and worst |modeled - measured| / measured and Spearman over the same plans,
in the run and now, the data-parallel plan against torch DDP in both, and the machine drift in both.
A model whose errors shrink now while its modeled times are the run's was mis-measured (the machine),
not mis-modeled. Writes bench/results/NAME.{json,md} (NAME: FROM_RUN-retime by default).

Run: python bench/plan_retime.py --from-run plan_fidelity_dec07 --models llama-40:8x64 [--rounds 4]
     [--max-rounds 24] [--timed-seconds 60] [--steps 3] [--settle 1] [--warmup 2] [--name NAME]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, init_gloo_ranks, work_or_launch, write  # noqa: E402
from plan_fidelity import (MESH, TIMING_OPTIONS, _drift_cell, _ms, add_timing_options, autoshard_config,  # noqa: E402
                           capture, ddp_config, drift_record, fit, guarded, log, make_plans, warm_up_and_count_rounds)
from runtime_speed import run_rounds, summary  # noqa: E402

MODELED_SAME = 0.01     # relative: a plan solved again under the run's profile models what it did there (a budget
                        # plan's ILP stops within its gap, so it may land on a plan modeled a little otherwise)
DDP = "torch DDP"


def run_files(run: str) -> tuple[Path, Path]:
    """The fidelity run's results and the profile it measured."""
    return RESULTS / f"{run}.json", RESULTS / f"{run}-profile.yaml"


def ran_plans(model: dict) -> dict[str, dict]:
    """The distinct plans of a fidelity run's ``model`` that were timed there, by name."""
    return {p["name"]: p for p in model["plans"] if "measured" in p and "same_as" not in p}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import autoshard

    mesh, rank = init_gloo_ranks(MESH)
    results_path, profile = run_files(args.from_run)
    hw = autoshard.load_hardware(str(profile))
    then = {m["model"]: m for m in json.loads(results_path.read_text())["models"]}
    out = []
    for key in args.models.split(","):
        graph, _ = capture(key)
        before = ran_plans(then[key])
        box: list[Any] = [None]
        if rank == 0:
            log(f"{key}: planning again under {profile.name}")
            box = [[p for p in make_plans(key, graph, str(profile)) if p["name"] in before and "plan" in p]]
        dist.broadcast_object_list(box, 0)
        configs, plans = [], {}
        for entry in box[0]:
            cfg, err = guarded(lambda e=entry: autoshard_config(e["name"], key, e["plan"], graph, mesh),
                               entry["name"], rank)
            plans[entry["name"]] = {"modeled_s": entry["modeled_s"], "modeled_then_s": before[entry["name"]]["modeled_s"],
                                    "measured_then_ms": before[entry["name"]]["measured"]["median_ms"],
                                    **({"error": err[0]} if err else {})}
            if cfg is not None:
                configs.append(cfg)
        ddp, ddp_error = guarded(lambda: ddp_config(key, rank), DDP, rank)
        if ddp is not None:
            configs.append(ddp)
        drift_before = drift_record(hw)
        rounds = warm_up_and_count_rounds(configs, args)
        if rank == 0:
            log(f"{key}: timing {len(configs)} configurations, {rounds} rounds x {args.steps} steps")
        run_rounds(configs, 0, rounds, args.steps, dist.barrier, settle=args.settle, back_to_back=True)
        measured = {c.name: summary(c) for c in configs}
        for name, p in plans.items():
            if name in measured:
                p["measured_ms"] = measured[name]["median_ms"]
        ddp_then = (then[key]["references"].get(DDP) or {}).get("median_ms")
        out.append({"model": key, "rounds": rounds, "plans": plans,
                    "ddp_ms": measured.get(DDP, {}).get("median_ms"), "ddp_then_ms": ddp_then,
                    **({"ddp_error": ddp_error[0]} if ddp_error else {}),
                    "drift": {"before": drift_before, "after": drift_record(hw)},
                    "drift_then": then[key].get("drift")})
        configs = ddp = None
        dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"models": out}))
    dist.destroy_process_group()


def compare(model: dict) -> dict:
    """The run's and this run's fit over the plans timed in both (each priced as the run priced it)."""
    both = {n: p for n, p in model["plans"].items() if "measured_ms" in p}
    same = all(abs(p["modeled_s"] - p["modeled_then_s"]) <= MODELED_SAME * p["modeled_then_s"] for p in both.values())
    modeled = [p["modeled_then_s"] for p in both.values()]
    then = fit(modeled, [p["measured_then_ms"] / 1e3 for p in both.values()]) if len(both) > 1 else (None, None, None)
    now = fit(modeled, [p["measured_ms"] / 1e3 for p in both.values()]) if len(both) > 1 else (None, None, None)
    dp = both.get("data_parallel", {})
    return {"plans": len(both), "same_models": same, "then": then, "now": now,
            "dp_over_ddp_then": dp["measured_then_ms"] / model["ddp_then_ms"] if dp and model["ddp_then_ms"] else None,
            "dp_over_ddp_now": dp["measured_ms"] / model["ddp_ms"] if dp and model["ddp_ms"] else None}


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def report(args: argparse.Namespace, results: dict, wall_s: float) -> None:
    header = ["model", "plans", "modeled as in the run", "spearman then / now", "median err then / now",
              "worst err then / now", "data parallel / DDP then / now", "machine / profile then", "machine / profile now"]
    rows = []
    for m in results["models"]:
        c = m["compare"] = compare(m)
        rows.append([m["model"], c["plans"], "yes" if c["same_models"] else "NO (planning differs)",
                     f"{_ms(c['then'][0], 2)} / {_ms(c['now'][0], 2)}",
                     f"{_pct(c['then'][1])} / {_pct(c['now'][1])}", f"{_pct(c['then'][2])} / {_pct(c['now'][2])}",
                     f"{_x(c['dp_over_ddp_then'])} / {_x(c['dp_over_ddp_now'])}",
                     _drift_cell(m["drift_then"]), _drift_cell(m["drift"])])
    note = (f"The plans of `{args.from_run}` (bench/plan_fidelity.py) that ran there, solved again under its measured profile "
            f"(`{args.from_run}-profile.yaml`) and timed again with torch DDP in one fresh torchrun launch of 4 gloo ranks "
            f"(2x2), as that bench times them: interleaved rounds of {args.steps}-step back-to-back turns after "
            f"{args.settle} untimed step(s), the job's step while every rank was stepping. Errors: |modeled - measured| / "
            f"measured, modeled as in the run; then: that run's measurements, now: this run's. Machine / profile: the "
            f"median over compute families of the profile's middle points timed again, before / after the model's "
            f"timing. Whole run {wall_s / 60:.1f} min, {time.strftime('%Y-%m-%d %H:%M')}.")
    write(args.name or f"{args.from_run}-retime", {"run": args.from_run, **results, "wall_s": wall_s}, header, rows, note)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-run", required=True, help="a finished bench/plan_fidelity.py run (its --name)")
    ap.add_argument("--models", help="comma-separated models of that run (default: all of them)")
    add_timing_options(ap)
    ap.add_argument("--name", help="results as bench/results/NAME.{json,md} (default: FROM_RUN-retime)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    results_path, profile = run_files(args.from_run)
    if not args.worker:
        for path in (results_path, profile):
            if not path.exists():
                raise SystemExit(f"no {path}: name a finished bench/plan_fidelity.py run (--from-run NAME)")
        known = [m["model"] for m in json.loads(results_path.read_text())["models"]]
        args.models = args.models or ",".join(known)
        unknown = [k for k in args.models.split(",") if k not in known]
        if unknown:
            raise SystemExit(f"{', '.join(unknown)}: not in {args.from_run} (its models: {', '.join(known)})")
    return work_or_launch(args, __file__, ["from_run", "models", *TIMING_OPTIONS], worker, report, 4, HERE.parent)


if __name__ == "__main__":
    raise SystemExit(main())
