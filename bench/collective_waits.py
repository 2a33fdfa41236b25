"""Each collective of a plan's training step, timed as a training loop runs it, against its price.

The fidelity bench compares whole steps and :mod:`step_decomposition` all of a step's collectives
together; this bench times them one by one, on 4 gloo ranks (2x2 mesh), training steps back to back
(as :mod:`plan_fidelity` runs them), the plans' turns interleaved. Every collective the runtime
issues and waits for (``torch.distributed`` all-reduce, all-gather, reduce-scatter and all-to-all,
then :meth:`autoshard.runtime.collectives.MeshComm.wait`) is recorded on every rank: when it was
issued, when the rank entered the wait and when the wait returned. Per collective of the step
(the n-th one issued; every rank issues the same sequence, each on its own group):

- ``after the last rank``: the wait's return less the moment the last rank of its group issued it:
  the collective's own time once every rank is there (for a gradient bucket issued during backward
  and waited for at its end, an upper bound);
- ``priced``: :func:`autoshard.comm_cost.collective_cost` of its kind, bytes and mesh axes under the
  profile (what the cost model charges it, before any wait for drifted ranks);
- ``blocked``: from entering the wait to its return;
- ``arrival spread``: the last rank's issue less the first's, in its group (what
  :mod:`autoshard.solver.sync_wait` prices; where ranks share cores, a rank blocked early leaves its core
  to the others);

medians over the ranks, steps and turns; and the step itself (the machine's period, the last rank's
start of one step to its start of the next). ``--plans`` takes baselines, ``solved`` and saved plans
(``*.json``, :meth:`autoshard.plans.Plan.save`, made for the model).

Run: python bench/collective_waits.py [--models cnn-28:8x32] [--plans data_parallel,solved]
[--hardware bench/results/fidelity-measured.yaml] [--rounds 20] [--steps 3]
(re-launches itself under torchrun with 4 ranks, OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, init_gloo_ranks, rank_bench_parser, work_or_launch, write  # noqa: E402
from plan_fidelity import MESH, WORLD, LossView, build  # noqa: E402
from runtime_speed import Config  # noqa: E402
from step_decomposition import named_plan  # noqa: E402

ROOT = HERE.parent
DEFAULT_MODELS = "cnn-28:8x32"
DEFAULT_PLANS = "data_parallel,solved"
DEFAULT_PROFILE = RESULTS / "fidelity-measured.yaml"
TRACED = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
          "all_to_all_single": "all_to_all"}
"""The ``torch.distributed`` collectives the tracer wraps (those the runtime issues, async) -> the
kind the cost model prices (:mod:`autoshard.comm_cost`; bytes: the larger of output and input, the
whole gathered or scattered tensor, as it counts them)."""


class CollectiveTrace:
    """While installed, records every async collective issued through ``torch.distributed`` and its
    wait through :meth:`MeshComm.wait`: ``[kind, group ranks, bytes, phase, issued, waited, returned]``
    (monotonic seconds, comparable across the local ranks; phase 'bwd' inside autograd's backward)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        from autoshard.runtime.collectives import MeshComm

        self.calls: list[list[Any]] = []
        self.on = False
        self._pending: dict[int, int] = {}
        self._real = {name: getattr(dist, name) for name in TRACED if hasattr(dist, name)}
        self._real_wait, self._comm = MeshComm.wait, MeshComm
        trace = self

        def wrapped(name: str, fn):
            def collective(out, *args, group=None, async_op=False, **kwargs):
                issued = time.monotonic()
                work = fn(out, *args, group=group, async_op=async_op, **kwargs)
                if trace.on and async_op:
                    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
                    phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
                    trace._pending[id(work)] = len(trace.calls)
                    nbytes = max(t.numel() * t.element_size() for t in (out, *args[:1]) if isinstance(t, torch.Tensor))
                    trace.calls.append([TRACED[name], ranks, nbytes, phase, issued, None, None])
                return work
            return collective

        for name, fn in self._real.items():
            setattr(dist, name, wrapped(name, fn))

        def wait(comm, work) -> None:
            entered = time.monotonic()
            trace._real_wait(comm, work)
            i = trace._pending.pop(id(work), None)
            if i is not None:
                trace.calls[i][5:7] = [entered, time.monotonic()]

        MeshComm.wait = wait

    def restore(self) -> None:
        import torch.distributed as dist

        for name, fn in self._real.items():
            setattr(dist, name, fn)
        self._comm.wait = self._real_wait


def group_axes(comm) -> dict[tuple[int, ...], tuple[int, ...]]:
    """This rank's groups (sorted global ranks) -> the mesh axes they span, from the runtime's comm."""
    import torch.distributed as dist

    return {tuple(sorted(dist.get_process_group_ranks(g))): axes for axes, g in comm._groups.items()}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import autoshard
    from autoshard.runtime import capture_meta

    mesh, rank = init_gloo_ranks(MESH)
    results = []
    trace = CollectiveTrace()
    try:
        for key in args.models.split(","):
            model, kwargs = build(key)
            graph = capture_meta(model, (), kwargs, name=key)
            configs: dict[str, Config] = {}
            axes: dict[tuple[int, ...], tuple[int, ...]] = {}
            for name in args.plans.split(","):
                plan = named_plan(graph, key, name, rank, args.hardware)
                module, inputs = build(key)
                pm = autoshard.parallelize(module, plan, mesh, graph=graph)
                axes.update(group_axes(pm.comm))
                configs[name] = Config(name, key, LossView(pm), inputs, pm.parameters())
                for _ in range(args.warmup):
                    configs[name].step()
            turns: dict[str, list[dict]] = {name: [] for name in configs}
            names = list(configs)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    configs[name].step()                         # untimed: the turn settles
                    dist.barrier()
                    trace.calls.clear()
                    trace.on = True
                    starts = []
                    for _ in range(args.steps + 1):              # the last step only ends the one before
                        starts.append(time.monotonic())
                        configs[name].step()
                    trace.on = False
                    turns[name].append({"starts": starts, "calls": [list(c) for c in trace.calls]})
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, {"turns": turns, "axes": {",".join(map(str, g)): list(a)
                                                                       for g, a in axes.items()}})
            if rank == 0:
                print(f"[collective_waits {time.strftime('%H:%M:%S')}] {key} done", file=sys.stderr, flush=True)
            results.append({"model": key, "ranks": [e["turns"] for e in everyone],
                            "axes": {g: a for e in everyone for g, a in e["axes"].items()}})
            del configs
    finally:
        trace.restore()
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def summarize(ranks: list[list[dict]], axes: dict[str, list[int]], price) -> dict:
    """One plan's turns on every rank (``ranks[r][turn]``) -> the step's period and, per collective
    of the step, its medians (ms) and its price (``price(kind, nbytes, axes)``, seconds)."""
    periods: list[float] = []
    per: dict[int, dict[str, Any]] = {}
    for turn in range(len(ranks[0])):
        mine = [r[turn] for r in ranks]
        steps = len(mine[0]["starts"])
        periods += [max(t["starts"][s + 1] for t in mine) - max(t["starts"][s] for t in mine) for s in range(steps - 1)]
        calls = len(mine[0]["calls"])
        if calls % steps or any(len(t["calls"]) != calls for t in mine):
            raise RuntimeError(f"ranks issued {[len(t['calls']) for t in mine]} collectives in {steps} steps: "
                               "not the same sequence every step on every rank")
        for i in range(calls):
            kind, group, nbytes, phase = mine[0]["calls"][i][:4]
            e = per.setdefault(i % (calls // steps), {
                "kind": kind, "phase": phase, "bytes": nbytes, "group_size": len(group),
                "axes": axes[",".join(map(str, sorted(group)))], "after_last": [], "blocked": [], "spread": []})
            for t in mine:
                _, group, _, _, issued, waited, returned = t["calls"][i]
                if returned is None:
                    raise RuntimeError(f"collective {i} ({kind}) was issued but never waited for through MeshComm.wait")
                arrivals = [mine[g]["calls"][i][4] for g in group]
                e["after_last"].append(returned - max(arrivals))
                e["blocked"].append(returned - waited)
                e["spread"].append(max(arrivals) - min(arrivals))
    collectives = []
    for _, e in sorted(per.items()):
        row = {k: e[k] for k in ("kind", "phase", "bytes", "group_size", "axes")}
        row.update({f"{k}_ms": 1e3 * statistics.median(e[k]) for k in ("after_last", "blocked", "spread")})
        row["priced_ms"] = 1e3 * price(e["kind"], e["bytes"], tuple(e["axes"]))
        collectives.append(row)
    return {"period_ms": 1e3 * statistics.median(periods), "collectives": collectives}


def report(args: argparse.Namespace, results: list[dict], wall_s: float) -> None:
    import autoshard
    from autoshard.comm_cost import collective_cost

    hw = autoshard.load_hardware(args.hardware)

    def price(kind: str, nbytes: int, axes: tuple[int, ...]) -> float:
        return collective_cost(kind, nbytes, axes, MESH, hw)

    header = ["model", "plan", "step", "collective", "bytes", "after the last rank", "priced", "ratio", "blocked",
              "arrival spread"]
    rows, summaries = [], []
    for r in results:
        for name in r["ranks"][0]:
            s = summarize([rank[name] for rank in r["ranks"]], r["axes"], price)
            summaries.append({"model": r["model"], "plan": name, **s})
            label = Path(name).stem if name.endswith(".json") else name
            for i, c in enumerate(s["collectives"]):
                group = "world" if len(c["axes"]) > 1 else f"axis {c['axes'][0]}"
                rows.append([r["model"], label, f"{s['period_ms']:.2f}" if i == 0 else "",
                             f"{c['phase']} {c['kind']} on {group}", str(c["bytes"]), f"{c['after_last_ms']:.2f}",
                             f"{c['priced_ms']:.2f}", f"{c['after_last_ms'] / c['priced_ms']:.2f}",
                             f"{c['blocked_ms']:.2f}", f"{c['spread_ms']:.2f}"])
    note = (f"ms, 4 gloo ranks (2x2), profile `{Path(args.hardware).name}`; saved plans by file name; "
            f"{args.rounds} interleaved rounds of a "
            f"turn of {args.steps} training steps back to back (after 1 untimed step and a barrier), after "
            f"{args.warmup} warm-up steps. step: the machine's period (median). Per collective of the step, in the "
            "order issued, medians over ranks, steps and turns: after the last rank: its wait's return less the "
            "moment its group's last rank issued it (a gradient bucket waited for at the end of backward: an "
            "upper bound); priced: collective_cost of its kind, bytes and axes under the profile; ratio: the two; "
            "blocked: in the wait; arrival spread: its group's last issue less its first. "
            f"Whole run {wall_s / 60:.1f} min.")
    write("collective_waits", {"results": summaries, "hardware": args.hardware, "rounds": args.rounds,
                               "steps": args.steps, "warmup": args.warmup, "wall_s": wall_s}, header, rows, note)


def main() -> int:
    ap = rank_bench_parser(__doc__.split("\n\n")[0], DEFAULT_MODELS, DEFAULT_PROFILE, DEFAULT_PLANS)
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds (one turn per plan each)")
    ap.add_argument("--steps", type=int, default=3, help="traced steps per turn")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per plan before the rounds")
    args = ap.parse_args()
    if args.steps < 1 or args.rounds < 1:
        raise SystemExit("--steps and --rounds must be at least 1")
    return work_or_launch(args, __file__, ("hardware", "models", "plans", "rounds", "steps", "warmup"), worker, report,
                          WORLD, ROOT, measured_profile=True)


if __name__ == "__main__":
    raise SystemExit(main())
