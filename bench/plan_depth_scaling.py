"""Capture-to-plan time against depth: Llama-2-70B width at 12/24/48/80 layers on a 4x8 mesh and
Llama-2-7B (32 layers) on 2x4, hardware profile h100-nvlink, batch 4, seq 2048, meta tensors.

Stages, each timed on its own: capture (folded: two shallow exports + unfolding, see
autoshard/capture/fold.py), enumerate_strategies, build_cost_graph(alias_blocks=True) and the ILP solve
with default SolverOptions (no memory budget); total is their sum. The ILP is then solved again
under the profile's memory per device (80 GiB), reported apart: how hard a budget is depends on
how tight it is at that depth. Also times one full (unfolded) capture of the 80-layer model, and
the library call a user makes, ``autoshard.plan(model, kwargs=inputs, mesh=(2, 4))`` on the
Llama-2-7B model object built from its Hugging Face config (capture folded from the model itself,
then the same stages).
Run: python bench/plan_depth_scaling.py [--reps 1] [--depths 12 24 48 80] [--no-full]
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from collections import Counter
from dataclasses import dataclass

from _common import median, write

from autoshard.capture import capture
from autoshard.enumerate import enumerate_strategies
from autoshard.capture import capture_preset
from autoshard.hardware import load_hardware
from autoshard.models import build_model
from autoshard.solver import build_cost_graph
from autoshard.solver.ilp import InfeasibleBudgetError, Solution, SolverOptions, solve

HARDWARE, BATCH, SEQ = "h100-nvlink", 4, 2048
LIBRARY_BATCH = 8     # autoshard.plan checks that the 8 devices of 2x4 divide the batch


@dataclass(frozen=True)
class Config:
    label: str
    preset: str
    layers: int
    mesh: tuple[int, int]


def configs(depths: list[int]) -> list[Config]:
    out = [Config(f"llama-70b width, {d} layers", "llama-70b", d, (4, 8)) for d in depths]
    out.append(Config("llama-7b, 32 layers", "llama-7b", 32, (2, 4)))
    return out


def plan_once(cfg: Config) -> dict:
    """Time every stage of one capture-to-plan run."""
    gc.collect()
    t0 = time.perf_counter()
    graph = capture_preset(cfg.preset, batch=BATCH, seq=SEQ, num_layers=cfg.layers)
    t1 = time.perf_counter()
    table = enumerate_strategies(graph, mesh_shape=cfg.mesh, hardware=HARDWARE)
    t2 = time.perf_counter()
    cg = build_cost_graph(table, alias_blocks=True)
    t3 = time.perf_counter()
    solution = solve(cg, SolverOptions())
    t4 = time.perf_counter()
    budgeted, budget = _solve_with_budget(cg)
    t5 = time.perf_counter()
    return {"capture_s": t1 - t0, "enumerate_s": t2 - t1, "costgraph_s": t3 - t2,
            "solve_s": t4 - t3, "total_s": t4 - t0, "budget_solve_s": t5 - t4,
            "budget_status": budgeted.status if budgeted else "infeasible",
            "budget_step_time_s": budgeted.time.total if budgeted else None,
            "budget_decisions": dict(Counter(budgeted.decisions.values())) if budgeted else None,
            "folded": "fold_s" in graph.timings,
            "capture_timings": graph.timings, "costgraph_timings": cg.timings,
            "graph_nodes": len(graph.graph.nodes), "cg_nodes": len(cg.nodes),
            "decision_groups": len(cg.variable_groups()), "ilp_variables": solution.n_variables,
            "ilp_constraints": solution.n_constraints, "ilp_build_s": solution.build_seconds,
            "ilp_solver_s": solution.solve_seconds, "status": solution.status,
            "memory_budget": budget, "step_time_s": solution.time.total}


def _solve_with_budget(cg) -> tuple[Solution | None, int]:
    """Solve under the profile's memory per device (None if that budget is infeasible)."""
    budget = int(load_hardware(HARDWARE).memory_per_device)
    try:
        return solve(cg, SolverOptions(memory_budget=budget)), budget
    except InfeasibleBudgetError:
        return None, budget


def library_plan(reps: int) -> dict:
    """``autoshard.plan`` on Llama-2-7B's model object (built from its Hugging Face config on meta),
    2x4, timed from the call to the plan: the library's own capture (folded from the model) and stages."""
    import autoshard

    model, args, kwargs = build_model("llama-7b", batch=LIBRARY_BATCH, seq=SEQ)
    runs = []
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        plan = autoshard.plan(model, args, kwargs, mesh=(2, 4), hardware=HARDWARE)
        wall = time.perf_counter() - start
        runs.append({"total_s": wall, **{k: v for k, v in plan.timings.items()}, "nodes": len(plan.nodes),
                     "step_time_s": plan.time["total"]})
    return {"median_total_s": median([r["total_s"] for r in runs]), "runs": runs}


def full_capture_seconds(layers: int) -> float:
    model, args, kwargs = build_model("llama-70b", batch=BATCH, seq=SEQ, num_layers=layers)
    start = time.perf_counter()
    capture(model, args, kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 24, 48, 80])
    parser.add_argument("--no-full", action="store_true", help="skip the full 80-layer capture")
    opts = parser.parse_args()
    build_model("llama-7b", num_layers=2)           # import transformers' Llama code once
    plan_once(Config("warm-up", "llama-70b", 4, (4, 8)))
    results = []
    for cfg in configs(opts.depths):
        runs = [plan_once(cfg) for _ in range(opts.reps)]
        med = {k: median([r[k] for r in runs]) for k in
               ("capture_s", "enumerate_s", "costgraph_s", "solve_s", "total_s",
                "budget_solve_s")}
        results.append({"config": cfg.__dict__, "median": med, "runs": runs})
        print(f"{cfg.label}: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()), flush=True)
    library = library_plan(opts.reps)
    print(f"llama-7b via autoshard.plan: {library['median_total_s']:.2f} s", flush=True)
    full = None if opts.no_full else full_capture_seconds(80)
    data = {"hardware": HARDWARE, "batch": BATCH, "seq": SEQ, "reps": opts.reps,
            "full_capture_80_layers_s": full, "load_average_at_end": os.getloadavg(),
            "results": results, "library_plan_llama7b": library}
    header = ["model", "mesh", "graph nodes", "capture s", "enumerate s", "cost graph s",
              "solve s", "total s", "ILP vars", "solve s, 80 GiB budget"]
    rows = []
    for r in results:
        cfg, med, run = r["config"], r["median"], r["runs"][0]
        rows.append([cfg["label"], "x".join(map(str, cfg["mesh"])), run["graph_nodes"],
                     f"{med['capture_s']:.2f}", f"{med['enumerate_s']:.2f}",
                     f"{med['costgraph_s']:.2f}", f"{med['solve_s']:.2f}",
                     f"{med['total_s']:.2f}", run["ilp_variables"],
                     f"{med['budget_solve_s']:.2f} ({run['budget_status']})"])
    lib = library["runs"][0]
    rows.append(["llama-7b, 32 layers: autoshard.plan(model) from the library", "2x4", lib["nodes"],
                 f"{lib.get('capture_s', 0):.2f}", f"{lib.get('enumerate_s', 0):.2f}",
                 f"{lib.get('costgraph_s', 0):.2f}", f"{lib.get('solving_s', 0):.2f}",
                 f"{library['median_total_s']:.2f}", "-", "-"])
    note = (f"Batch {BATCH}, seq {SEQ}, fp32, meta tensors, {HARDWARE}; median of {opts.reps} "
            "run(s) after a warm-up; load average at the end "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores. capture is folded (two shallow "
            "exports + unfolding, exact); the cost graph aliases identical blocks; total = "
            "capture + enumerate + cost graph + solve without a memory budget. The last column "
            "solves the same cost graph again under the profile's 80 GiB per device. The last row is "
            f"the library call on the model object at batch {LIBRARY_BATCH} (wall time of autoshard.plan, "
            "the plan's own stage timings, solve = the whole solving stage: the ILP and the arbitration "
            "against baseline families; its graph nodes are the plan's).")
    if full is not None:
        note += f" A full (unfolded) capture of the 80-layer model took {full:.2f} s."
    write("plan_depth_scaling", data, header, rows, note)


if __name__ == "__main__":
    main()
