"""What the ranks' waits in collectives cost a training loop on ranks that share CPU cores.

Every blocking collective waits for the last rank of its group. Where ranks outnumber cores (4 gloo
ranks on 2 here), a rank blocked in a collective sleeps (gloo does not spin) and leaves its core to
the others, so its wait costs the step only where fewer ranks are left computing than there are
cores. This bench measures both, per autoshard plan, in a loop of training steps run back to back
(as :mod:`plan_fidelity` times them), on 4 gloo ranks (2x2 mesh):

- ``period``: the machine's step, from the last rank's start of one step to its start of the next;
- ``CPU / cores``: the ranks' summed process CPU time in a step (compute, and the collectives'
  own copies and reductions) over the cores;
- ``idle``: ``period - CPU / cores``, the cores' time no rank used (as step ms);
- ``waiting``: the mean rank's seconds blocked in the runtime's collective waits (from entering
  ``wait`` to its return: the wait for the group's last rank and the transfer after it);
- modeled: ``plan.time`` ``comm + grad_sync`` (the collectives' prices), ``sync_wait`` (the waits for
  drifted ranks beyond those prices, :mod:`autoshard.solver.sync_wait`) and ``total``.

Medians over the timed steps. The plans are solved under a measured profile (by default the one the
last fidelity run measured).

Run: python bench/step_waits.py [--models gpt2-128,llama-384,cnnsync-8]
[--plans data_parallel,megatron,zero3,solved] [--hardware bench/results/fidelity-measured.yaml]
[--steps 10] (re-launches itself under torchrun with 4 ranks, OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, init_gloo_ranks, rank_bench_parser, work_or_launch, write  # noqa: E402
from plan_fidelity import MESH, OUTPUTS, WORLD, LossView, build, function_options  # noqa: E402
from runtime_speed import Config, plan_on_rank0  # noqa: E402

ROOT = HERE.parent
DEFAULT_MODELS = "gpt2-128,llama-384,cnnsync-8"
DEFAULT_PLANS = "data_parallel,megatron,zero3,solved"
DEFAULT_PROFILE = RESULTS / "fidelity-measured.yaml"


class WaitTrace:
    """Records (entered, returned) monotonic seconds of every collective wait of the runtime
    (:meth:`autoshard.runtime.collectives.MeshComm.wait`) while installed."""

    def __init__(self) -> None:
        from autoshard.runtime.collectives import MeshComm

        self.cls, self.real = MeshComm, MeshComm.wait
        self.spans: list[tuple[float, float]] = []
        real, spans = self.real, self.spans

        def wait(comm, work) -> None:
            t0 = time.monotonic()
            real(comm, work)
            spans.append((t0, time.monotonic()))

        MeshComm.wait = wait

    def restore(self) -> None:
        self.cls.wait = self.real


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def trace_steps(cfg: Config, steps: int, trace: WaitTrace) -> list[dict]:
    """This rank's steps, back to back: start (monotonic, comparable across local ranks), process
    CPU seconds and seconds blocked in collective waits."""
    out = []
    for _ in range(steps):
        trace.spans.clear()
        t0, c0 = time.monotonic(), time.process_time()
        cfg.step()
        out.append({"start": t0, "cpu": time.process_time() - c0,
                    "waiting": sum(b - a for a, b in trace.spans), "waits": len(trace.spans)})
    return out


def summarize(per_rank: list[list[dict]], n_cores: int) -> dict:
    """Medians over steps (the last one has no next start and is dropped) of the machine's figures."""
    periods, cpu, waiting = [], [], []
    for s in range(len(per_rank[0]) - 1):
        periods.append(max(r[s + 1]["start"] for r in per_rank) - max(r[s]["start"] for r in per_rank))
        cpu.append(sum(r[s]["cpu"] for r in per_rank) / n_cores)
        waiting.append(statistics.mean(r[s]["waiting"] for r in per_rank))
    idle = [p - c for p, c in zip(periods, cpu)]
    return {"period_ms": 1e3 * statistics.median(periods), "cpu_over_cores_ms": 1e3 * statistics.median(cpu),
            "idle_ms": 1e3 * statistics.median(idle), "waiting_ms": 1e3 * statistics.median(waiting),
            "waits_per_step": per_rank[0][0]["waits"]}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import autoshard
    from autoshard.runtime import capture_meta

    mesh, rank = init_gloo_ranks(MESH)
    trace = WaitTrace()
    results = []
    try:
        for key in args.models.split(","):
            model, kwargs = build(key)
            graph = capture_meta(model, (), kwargs, name=key)
            for name in args.plans.split(","):
                if rank == 0:
                    print(f"[step_waits {time.strftime('%H:%M:%S')}] {key} {name}", file=sys.stderr, flush=True)
                baseline = None if name == "solved" else name
                plan, _ = plan_on_rank0(graph, None, MESH, baseline, rank, OUTPUTS, args.hardware, name=key,
                                        **function_options(key))
                model, kwargs = build(key)
                pm = autoshard.parallelize(model, plan, mesh, graph=graph)
                cfg = Config(name, key, LossView(pm), kwargs, pm.parameters())
                for _ in range(args.warmup):
                    cfg.step()
                dist.barrier()
                mine = trace_steps(cfg, args.steps, trace)
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, mine)
                modeled = {k: 1e3 * v for k, v in plan.time.items()}
                results.append({"model": key, "plan": name, "modeled_ms": modeled,
                                "measured": summarize(everyone, cores()), "ranks": everyone})
                del pm, cfg
    finally:
        trace.restore()
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def report(args: argparse.Namespace, results: list[dict], wall_s: float) -> None:
    header = ["model", "plan", "period", "CPU / cores", "idle", "waiting (mean rank)", "waits / step",
              "modeled comm + grad sync", "modeled sync_wait", "modeled step"]
    rows = []
    for r in results:
        m, meas = r["modeled_ms"], r["measured"]
        rows.append([r["model"], r["plan"], f"{meas['period_ms']:.1f}", f"{meas['cpu_over_cores_ms']:.1f}",
                     f"{meas['idle_ms']:.1f}", f"{meas['waiting_ms']:.1f}", str(meas["waits_per_step"]),
                     f"{m['comm'] + m['grad_sync']:.1f}", f"{m['sync_wait']:.1f}", f"{m['total']:.1f}"])
    note = (f"ms per training step, steps back to back on 4 gloo ranks (2x2) sharing {cores()} cores, profile "
            f"`{Path(args.hardware).name}`, median of {args.steps - 1} steps after {args.warmup} untimed. period: "
            "the machine's step; CPU / cores: the ranks' summed process CPU time over the cores; idle: period less "
            "that; waiting: a rank's time blocked in collective waits (mean over ranks). A blocked rank leaves "
            f"its core to the others, so waiting costs the step only as idle. Whole run {wall_s / 60:.1f} min.")
    write("step_waits", {"results": results, "hardware": args.hardware, "steps": args.steps, "warmup": args.warmup,
                         "cores": cores(), "wall_s": wall_s}, header, rows, note)


def main() -> int:
    ap = rank_bench_parser(__doc__.split("\n\n")[0], DEFAULT_MODELS, DEFAULT_PROFILE)
    ap.add_argument("--plans", default=DEFAULT_PLANS, help="comma-separated baselines, and 'solved'")
    ap.add_argument("--steps", type=int, default=10, help="traced steps per plan (the last only ends the one before)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per plan")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: a step's period ends at the next step's start")
    return work_or_launch(args, __file__, ("hardware", "models", "plans", "steps", "warmup"), worker, report, WORLD, ROOT,
                          measured_profile=True)


if __name__ == "__main__":
    raise SystemExit(main())
