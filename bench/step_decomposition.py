"""Where a step's time goes, measured part by part against the cost model's parts.

The plan fidelity bench compares whole steps; this one takes autoshard plans apart (by default the
data-parallel plan, the one the solver picks on most models of that bench; ``--plans`` takes any
baselines, ``solved`` and saved plans, ``*.json``, whose model is their ``plan.time``: the profile they
were made under), on 4 gloo ranks (2x2 mesh), under a measured profile (by default the one
the last fidelity run measured). Per model and plan, five configurations run interleaved (the order
rotates every iteration):

- ``plain``: the module itself on this rank's quarter of the batch, no collective (what DDP computes);
- ``runtime, local collectives``: autoshard's parallel module with every collective replaced by a
  local stand-in of the same shapes (:class:`LocalCollectives`: an all-reduce does nothing, a gather
  copies this rank's piece into its block, a reduce-scatter keeps its block, an all-to-all copies;
  timing only, the numbers are wrong), the resharding's own copies and the gradient buckets'
  flatten and copy-back included;
- ``runtime``: the same module as it runs;

each phase (forward, backward, optimizer step) started after a barrier and timed on every rank; and

- ``loop`` and ``loop, local collectives``: the runtime's training steps back to back, as a training
  loop (and :mod:`plan_fidelity`) runs them, with real and with stand-in collectives: the job's
  step while every rank was stepping (:func:`runtime_speed.busy_step`; a turn without such a moment
  is counted, not timed). Where ranks share cores a rank blocked in a collective leaves its core to
  the others, which the phases after barriers do not show.

The model's parts against their measured counterparts (medians over iterations):

- compute: ``plan.time`` compute + the buckets' copies (two passes over each bucket, as
  :mod:`autoshard.solver.steptime` prices them) against the local-collective runtime's forward +
  backward, the mean over ranks (the resharding's own copies are measured on this side and priced
  on the collectives' side, in ``plan.time`` resharding with the collectives they lay out for);
- ranks' spread: the slowest rank's forward + backward less the mean, against ``plan.time`` sync_wait
  (where ranks share cores they progress unevenly, and a collective waits for the slowest; the model
  prices that wait per collective from the compute before it, :mod:`autoshard.solver.sync_wait`);
- collectives: ``plan.time`` comm (the loss's all-reduce; batch-norm statistics where global) +
  resharding + gradient sync less the copies, against the runtime less the local-collective
  runtime's slowest rank, forward and backward;
- optimizer: against the runtime's optimizer phase, the mean over ranks;
- step: ``plan.time`` total against the sum of the runtime's phases;
- loop without collectives: ``plan.time`` compute + optimizer + the buckets' copies against the
  local-collective loop's step (its resharding copies measured, not modeled, on this side);
- loop collectives: ``plan.time`` comm + resharding + gradient sync + sync_wait less the copies,
  against the loop's step less the local-collective loop's;
- loop step: ``plan.time`` total against the loop's step: what the fidelity bench compares.

Run: python bench/step_decomposition.py [--models gpt2-128,llama-128,bert-128,cnn-16,cnnsync-16]
[--plans data_parallel,megatron,zero3,solved] [--hardware bench/results/fidelity-measured.yaml]
[--iters 24] (re-launches itself under torchrun with 4 ranks, OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, init_gloo_ranks, rank_bench_parser, work_or_launch, write  # noqa: E402
from plan_fidelity import (MESH, OUTPUTS, WORLD, LossView, _local, build, function_options,  # noqa: E402
                           model_spec)
from runtime_speed import _gathered, busy_step, plan_on_rank0  # noqa: E402

ROOT = HERE.parent
DEFAULT_MODELS = "gpt2-128,gpt2-384,llama-128,llama-256,bert-128,bert-256,cnn-16,cnn-64,cnnsync-16"
DEFAULT_PROFILE = RESULTS / "fidelity-measured.yaml"
DEFAULT_PLANS = "data_parallel"
LOCAL = "runtime, local collectives"
CONFIGS = ("plain", LOCAL, "runtime")
LOOPS = ("loop", "loop, local collectives")
PHASES = ("fwd", "bwd", "opt")
LOOP_STEPS = 3
"""Training steps back to back per timed loop turn (after one untimed step)."""


class _Completed:
    """What a stand-in asynchronous collective returns: already done."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _flat_block(whole: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """The first ``piece``-sized block of ``whole`` (flat views)."""
    return whole.reshape(-1)[:piece.numel()]


class LocalCollectives:
    """The collectives the runtime issues (``torch.distributed`` ``all_reduce``,
    ``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``; it looks them up at
    each call) replaced, while ``on``, by local stand-ins that fill their outputs with this rank's
    own data and return at once: the step's compute and copies as the runtime runs them, without a
    collective (timing only). Off, every call goes through to torch."""

    NAMES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.on = dist, False
        self.real = {name: getattr(dist, name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(dist, name, self._switch(name))

    @staticmethod
    def _local(name: str, *tensors: torch.Tensor) -> None:
        if name == "all_gather_single":                  # (output, input): this rank's piece in block 0
            out, piece = tensors
            _flat_block(out, piece).copy_(piece.reshape(-1))
        elif name == "reduce_scatter_single":            # (output, input): block 0, unreduced
            out, whole = tensors
            out.reshape(-1).copy_(_flat_block(whole, out))
        elif name == "all_to_all_single":                # (output, input): the blocks where they are
            out, src = tensors
            out.copy_(src)

    def _switch(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return self.real[name](*args, **kwargs)
            self._local(name, *args[:2])
            return _Completed() if kwargs.get("async_op") else None
        return call

    def restore(self) -> None:
        for name, fn in self.real.items():
            setattr(self.dist, name, fn)

def _phases(module: torch.nn.Module, inputs: dict, opt: torch.optim.Optimizer) -> list[float]:
    """Seconds of forward, backward and optimizer step on this rank, each started after a barrier."""
    import torch.distributed as dist

    out = []
    dist.barrier()
    t0 = time.perf_counter()
    loss = module(**inputs).loss
    out.append(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    loss.backward()
    out.append(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out.append(time.perf_counter() - t0)
    return out


def _loop(module: torch.nn.Module, inputs: dict, opt: torch.optim.Optimizer) -> float:
    """The job's seconds per training step over :data:`LOOP_STEPS` steps run back to back after one
    untimed step and a barrier, timed while every rank was stepping (:func:`runtime_speed.busy_step`,
    as :mod:`plan_fidelity` times its turns; the same on every rank); NaN where the turn had no moment
    with every rank stepping."""
    import torch.distributed as dist

    def step() -> None:
        module(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    dist.barrier()
    moments = [time.perf_counter()]
    for _ in range(LOOP_STEPS):
        step()
        moments.append(time.perf_counter())
    busy = busy_step(_gathered(moments))
    return math.nan if busy is None else busy


def _drop_untimed_turns(samples: dict[str, list[list[float]]], what: str) -> dict[str, int]:
    """Drop the loop turns :func:`_loop` could not time (NaN) from ``samples``; their count per loop.
    Raises where a configuration is left with no sample."""
    untimed = {name: sum(math.isnan(row[0]) for row in samples[name]) for name in LOOPS}
    samples.update({name: [row for row in samples[name] if not math.isnan(row[0])] for name in LOOPS})
    for name, rows in samples.items():
        if not rows:
            raise RuntimeError(f"{what}: no {name!r} turn had a moment with every rank stepping; run more --iters")
    return untimed


def _bucket_copy_seconds(pm, hw) -> float:
    """The modeled flatten and copy-back passes over the runtime's gradient buckets (their sizes as
    the runtime made them)."""
    return sum(2.0 * hw.copy_seconds(b.nbytes, str(b.dtype)) for b in pm.grad_buckets)


def named_plan(graph, key: str, name: str, rank: int, hw_path: str):
    """Plan ``name`` of model ``key`` on every rank: a baseline or ``solved`` (solved by rank 0 under
    ``hw_path``, as the fidelity bench makes it), or a saved plan (``*.json``, ``Plan.save``, made for
    this model and mesh)."""
    if name.endswith(".json"):
        from autoshard.plans import Plan

        return Plan.load(name, graph)
    plan, _ = plan_on_rank0(graph, None, MESH, None if name == "solved" else name, rank, OUTPUTS, hw_path, name=key,
                            **function_options(key))
    return plan


def measure_model(key: str, plan_name: str, hw_path: str, iters: int, warmup: int, mesh,
                  local: LocalCollectives) -> dict:
    import torch.distributed as dist

    import autoshard
    from autoshard.runtime import capture_meta

    rank = dist.get_rank()
    model, kwargs = build(key)
    graph = capture_meta(model, (), kwargs, name=key)
    plan = named_plan(graph, key, plan_name, rank, hw_path)
    pm = autoshard.parallelize(model, plan, mesh, graph=graph)
    plain, _ = build(key)
    runs: dict[str, tuple[torch.nn.Module, dict, torch.optim.Optimizer]] = {
        "plain": (LossView(plain), _local(kwargs, rank), torch.optim.AdamW(plain.parameters(), lr=1e-4)),
        "runtime": (LossView(pm), kwargs, torch.optim.AdamW(pm.parameters(), lr=1e-4)),
    }
    runs[LOCAL] = runs["runtime"]
    with pm.comm.counter.recording() as counter:
        _phases(*runs["runtime"])
    kinds = sorted({kind for kind, *_ in counter.totals()})
    samples: dict[str, list[list[float]]] = {c: [] for c in CONFIGS + LOOPS}
    turns = CONFIGS + LOOPS
    for i in range(warmup + iters):
        order = turns[i % len(turns):] + turns[:i % len(turns)]
        for name in order:
            local.on = name in (LOCAL, LOOPS[1])
            try:
                own = _loop(*runs["runtime"]) if name in LOOPS else _phases(*runs[name])
            finally:
                local.on = False
            own = own if isinstance(own, list) else [own]
            mean = torch.tensor(own, dtype=torch.float64)
            slowest = mean.clone()
            dist.all_reduce(mean)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if i >= warmup:
                samples[name].append((mean / WORLD).tolist() + slowest.tolist())
    hw = autoshard.load_hardware(hw_path)
    untimed = _drop_untimed_turns(samples, f"{key} {plan_name}")
    med = {name: [statistics.median(col) * 1e3 for col in zip(*rows)] for name, rows in samples.items()}
    t = {k: v * 1e3 for k, v in plan.time.items()}
    copies = _bucket_copy_seconds(pm, hw) * 1e3
    measured = {name: {"mean": dict(zip(PHASES, v[:3])), "slowest": dict(zip(PHASES, v[3:]))}
                for name, v in med.items() if name in CONFIGS}
    # a loop's value is the busy-window step (runtime_speed.busy_step): one figure, the same on every rank
    measured.update({name: med[name][0] for name in LOOPS})
    return {"model": key, "plan": plan_name, "spec": model_spec(key), "iters": iters, "collective_kinds": kinds,
            "modeled_ms": {**t, "bucket_copies": copies}, "measured_ms": measured,
            "untimed_loop_turns": untimed}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    mesh, _ = init_gloo_ranks(MESH)
    local = LocalCollectives()
    results = []
    try:
        for key in args.models.split(","):
            for plan_name in args.plans.split(","):
                if dist.get_rank() == 0:
                    print(f"[step_decomposition {time.strftime('%H:%M:%S')}] {key} {plan_name}", file=sys.stderr,
                          flush=True)
                results.append(measure_model(key, plan_name, args.hardware, args.iters, args.warmup, mesh, local))
    finally:
        local.restore()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def parts(r: dict) -> dict[str, tuple[float, float]]:
    """(modeled, measured) ms of each part of one model's step."""
    m, meas = r["modeled_ms"], r["measured_ms"]
    quiet, live = meas[LOCAL], meas["runtime"]

    def fb(side: dict) -> float:
        return side["fwd"] + side["bwd"]

    # the resharding's price (its collectives and their copies) on the collectives' side: the
    # stand-in runtime still makes the copies, so a resharding plan's compute is measured over by them
    return {
        "compute": (m["compute"] + m["bucket_copies"], fb(quiet["mean"])),
        "spread": (m["sync_wait"], fb(quiet["slowest"]) - fb(quiet["mean"])),
        # one part, not one per phase: plan comm holds the backward's own collectives too (a global
        # batch norm's gradient sums), which the runtime runs in its backward phase
        "collectives": (m["comm"] + m["reshard"] + m["grad_sync"] - m["bucket_copies"],
                        fb(live["slowest"]) - fb(quiet["slowest"])),
        "optimizer": (m["optimizer"], live["mean"]["opt"]),
        "step": (m["total"], fb(live["slowest"]) + live["mean"]["opt"]),
        "loop without collectives": (m["compute"] + m["optimizer"] + m["bucket_copies"],
                                     meas["loop, local collectives"]),
        "loop collectives": (m["comm"] + m["reshard"] + m["grad_sync"] + m["sync_wait"] - m["bucket_copies"],
                             meas["loop"] - meas["loop, local collectives"]),
        "loop step": (m["total"], meas["loop"]),
    }


def _cell(pair: tuple[float, float]) -> str:
    modeled, measured = pair
    return f"{modeled:.1f} / {measured:.1f}"


def _err(pair: tuple[float, float]) -> str:
    modeled, measured = pair
    return f"{100 * (modeled - measured) / measured:+.0f}%"


def _untimed_cell(results: list[dict]) -> str:
    """The loop turns that had no moment with every rank stepping (not timed), where there were any."""
    untimed = [f"{r['model']} {Path(r['plan']).stem} {name} {n}" for r in results
               for name, n in r.get("untimed_loop_turns", {}).items() if n]
    return f"Untimed loop turns (of {results[0]['iters']}): {', '.join(untimed)}. " if untimed else ""


def report(args: argparse.Namespace, results: list[dict], wall_s: float) -> None:
    rows = []
    for r in results:
        p = parts(r)
        plain = r["measured_ms"]["plain"]["mean"]
        rows.append([r["model"], Path(r.get("plan", "data_parallel")).stem, f"{plain['fwd'] + plain['bwd']:.1f}",
                     _cell(p["compute"]), _err(p["compute"]), _cell(p["spread"]), _cell(p["collectives"]),
                     _cell(p["optimizer"]), _cell(p["step"]), _err(p["step"]),
                     _cell(p["loop without collectives"]), _err(p["loop without collectives"]),
                     _cell(p["loop collectives"]), _cell(p["loop step"]), _err(p["loop step"])])
    header = ["model", "plan", "plain fwd+bwd", "compute (+copies)", "compute err", "ranks' spread",
              "collectives", "optimizer", "step (sum of phases)", "step err", "loop without collectives",
              "its err", "loop collectives", "loop step", "loop err"]
    note = (f"Modeled / measured ms, autoshard plans, 4 gloo ranks (2x2), profile "
            f"`{Path(args.hardware).name}`, median of {args.iters} interleaved iterations. Phases (compute to "
            "step) each after a barrier: plain: the module on the rank's quarter of the batch (mean over ranks). "
            "compute: plan compute + the buckets' flatten and copy-back, against the runtime with "
            "every collective a local stand-in (mean over ranks). ranks' spread: modeled wait of collectives for "
            "drifted ranks against that runtime's slowest rank less the mean. collectives: plan comm + resharding "
            "(its copies too) + exposed gradient sync less the copies, against the runtime less the stand-in one, slowest ranks, forward + "
            "backward. step: the runtime's slowest-rank forward and backward plus its optimizer phase. Loops: "
            f"{LOOP_STEPS} training steps back to back, the job's step while every rank was stepping (as "
            "bench/plan_fidelity.py times a turn). loop without collectives: "
            "plan compute + optimizer + the buckets' copies against the loop with stand-in collectives. loop "
            "collectives: plan comm + resharding + gradient sync + sync_wait less the copies, against the loop "
            "less that one. loop step: plan total against the loop (what bench/plan_fidelity.py compares). "
            f"{_untimed_cell(results)}Whole run {wall_s / 60:.1f} min.")
    write("step_decomposition", {"results": results, "hardware": args.hardware, "iters": args.iters,
                                 "warmup": args.warmup, "wall_s": wall_s}, header, rows, note)


def main() -> int:
    ap = rank_bench_parser(__doc__.split("\n\n")[0], DEFAULT_MODELS, DEFAULT_PROFILE, DEFAULT_PLANS)
    ap.add_argument("--iters", type=int, default=24, help="timed iterations per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations per configuration")
    args = ap.parse_args()
    return work_or_launch(args, __file__, ("hardware", "models", "plans", "iters", "warmup"), worker, report, WORLD, ROOT,
                          measured_profile=True)


if __name__ == "__main__":
    raise SystemExit(main())
