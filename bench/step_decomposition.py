"""Where a data-parallel step's time goes, measured part by part against the cost model's parts.

The plan fidelity bench compares whole steps; this one takes autoshard's data-parallel plan (the plan
the solver picks on every model of that bench) apart, on 4 gloo ranks (2x2 mesh), under a measured
profile (by default the one the last fidelity run measured). Per model, three configurations run
interleaved (the order rotates every iteration), each phase (forward, backward, optimizer step)
started after a barrier and timed on every rank:

- ``plain``: the module itself on this rank's quarter of the batch, no collective (what DDP computes);
- ``runtime, no collectives``: autoshard's parallel module with every ``all_reduce`` a no-op (timing
  only: the loss and the gradients are this rank's own), the gradient buckets' flatten and copy-back
  included;
- ``runtime``: the same module as it runs.

The model's parts against their measured counterparts (medians over iterations):

- compute: ``plan.time`` compute + resharding + the buckets' copies (two passes over each bucket, as
  :mod:`autoshard.solver.steptime` prices them) against the no-collective runtime's forward +
  backward, the mean over ranks;
- ranks' spread: the slowest rank's forward + backward less the mean, against ``plan.time`` sync_wait
  (where ranks share cores they progress unevenly, and a collective waits for the slowest; the model
  prices that wait per collective from the compute before it, :mod:`autoshard.solver.sync_wait`; in a
  training loop part of the spread comes back, as the ranks that wait in a collective leave the cores
  to the others, so this bench's sum of phases, each after a barrier, is not a loop's step: the
  fidelity bench times those);
- collectives: ``plan.time`` comm (the loss's all-reduce; batch-norm statistics where global) +
  gradient sync less the copies, against the runtime less the no-collective runtime's slowest rank,
  forward and backward;
- optimizer: against the runtime's optimizer phase, the mean over ranks.

Only plans whose collectives are all all-reduces are taken apart (skipping another kind would leave
buffers unfilled); any other is refused by name.

Run: python bench/step_decomposition.py [--models gpt2-128,llama-128,bert-128,cnn-16,cnnsync-16]
[--hardware bench/results/fidelity-measured.yaml] [--iters 24]
(re-launches itself under torchrun with 4 ranks, OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, rank_bench_parser, require_profile, run_on_ranks, write  # noqa: E402
from plan_fidelity import (MESH, OUTPUTS, WORLD, LossView, _local, build, function_options,  # noqa: E402
                           model_spec)
from runtime_speed import plan_on_rank0  # noqa: E402

ROOT = HERE.parent
DEFAULT_MODELS = "gpt2-128,gpt2-384,llama-128,llama-256,bert-128,bert-256,cnn-16,cnn-64,cnnsync-16"
DEFAULT_PROFILE = RESULTS / "fidelity-measured.yaml"
CONFIGS = ("plain", "runtime, no collectives", "runtime")
PHASES = ("fwd", "bwd", "opt")


class _Completed:
    """What a skipped asynchronous all-reduce returns: already done."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class SkippedAllReduce:
    """``torch.distributed.all_reduce`` replaced by a no-op while ``on`` (the runtime looks it up at
    each call); every other call goes through."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.real, self.on = dist, dist.all_reduce, False
        dist.all_reduce = self

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.on:
            return _Completed() if kwargs.get("async_op") else None
        return self.real(tensor, *args, **kwargs)

    def restore(self) -> None:
        self.dist.all_reduce = self.real


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


def _bucket_copy_seconds(pm, hw) -> float:
    """The modeled flatten and copy-back passes over the runtime's gradient buckets (their sizes as
    the runtime made them)."""
    return sum(2.0 * hw.copy_seconds(b.nbytes, str(b.dtype)) for b in pm.grad_buckets)


def measure_model(key: str, hw_path: str, iters: int, warmup: int, mesh, skip: SkippedAllReduce) -> dict:
    import torch.distributed as dist

    import autoshard
    from autoshard.runtime import capture_meta

    rank = dist.get_rank()
    model, kwargs = build(key)
    graph = capture_meta(model, (), kwargs, name=key)
    plan, _ = plan_on_rank0(graph, None, MESH, "data_parallel", rank, OUTPUTS, hw_path, name=key,
                            **function_options(key))
    pm = autoshard.parallelize(model, plan, mesh, graph=graph)
    plain, _ = build(key)
    runs: dict[str, tuple[torch.nn.Module, dict, torch.optim.Optimizer]] = {
        "plain": (LossView(plain), _local(kwargs, rank), torch.optim.AdamW(plain.parameters(), lr=1e-4)),
        "runtime": (LossView(pm), kwargs, torch.optim.AdamW(pm.parameters(), lr=1e-4)),
    }
    runs["runtime, no collectives"] = runs["runtime"]
    with pm.comm.counter.recording() as counter:
        _phases(*runs["runtime"])
    kinds = sorted({kind for kind, *_ in counter.totals()})
    if any(k != "all_reduce" for k in kinds):
        raise RuntimeError(f"{key}: the data-parallel plan runs {', '.join(kinds)}; this bench skips all-reduces "
                           f"only (another kind skipped would leave its output unfilled)")
    samples: dict[str, list[list[float]]] = {c: [] for c in CONFIGS}
    for i in range(warmup + iters):
        order = CONFIGS[i % 3:] + CONFIGS[:i % 3]
        for name in order:
            skip.on = name == "runtime, no collectives"
            try:
                own = _phases(*runs[name])
            finally:
                skip.on = False
            mean = torch.tensor(own, dtype=torch.float64)
            slowest = mean.clone()
            dist.all_reduce(mean)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if i >= warmup:
                samples[name].append((mean / WORLD).tolist() + slowest.tolist())
    hw = autoshard.load_hardware(hw_path)
    med = {name: [statistics.median(col) * 1e3 for col in zip(*rows)] for name, rows in samples.items()}
    t = {k: v * 1e3 for k, v in plan.time.items()}
    copies = _bucket_copy_seconds(pm, hw) * 1e3
    return {"model": key, "spec": model_spec(key), "iters": iters, "collective_kinds": kinds,
            "modeled_ms": {**t, "bucket_copies": copies},
            "measured_ms": {name: {"mean": dict(zip(PHASES, v[:3])), "slowest": dict(zip(PHASES, v[3:]))}
                            for name, v in med.items()}}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import autoshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    mesh = autoshard.init_mesh(MESH)
    skip = SkippedAllReduce()
    results = []
    try:
        for key in args.models.split(","):
            if dist.get_rank() == 0:
                print(f"[step_decomposition {time.strftime('%H:%M:%S')}] {key}", file=sys.stderr, flush=True)
            results.append(measure_model(key, args.hardware, args.iters, args.warmup, mesh, skip))
    finally:
        skip.restore()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def parts(r: dict) -> dict[str, tuple[float, float]]:
    """(modeled, measured) ms of each part of one model's step."""
    m, meas = r["modeled_ms"], r["measured_ms"]
    quiet, live = meas["runtime, no collectives"], meas["runtime"]

    def fb(side: dict) -> float:
        return side["fwd"] + side["bwd"]

    return {
        "compute": (m["compute"] + m["reshard"] + m["bucket_copies"], fb(quiet["mean"])),
        "spread": (m["sync_wait"], fb(quiet["slowest"]) - fb(quiet["mean"])),
        # one part, not one per phase: plan comm holds the backward's own collectives too (a global
        # batch norm's gradient sums), which the runtime runs in its backward phase
        "collectives": (m["comm"] + m["grad_sync"] - m["bucket_copies"], fb(live["slowest"]) - fb(quiet["slowest"])),
        "optimizer": (m["optimizer"], live["mean"]["opt"]),
        "step": (m["total"], fb(live["slowest"]) + live["mean"]["opt"]),
    }


def _cell(pair: tuple[float, float]) -> str:
    modeled, measured = pair
    return f"{modeled:.1f} / {measured:.1f}"


def report(args: argparse.Namespace, results: list[dict], wall_s: float) -> None:
    rows = []
    for r in results:
        p = parts(r)
        plain = r["measured_ms"]["plain"]["mean"]
        rows.append([r["model"], f"{plain['fwd'] + plain['bwd']:.1f}", _cell(p["compute"]),
                     f"{100 * (p['compute'][0] - p['compute'][1]) / p['compute'][1]:+.0f}%",
                     _cell(p["spread"]), _cell(p["collectives"]),
                     _cell(p["optimizer"]), _cell(p["step"]),
                     f"{100 * (p['step'][0] - p['step'][1]) / p['step'][1]:+.0f}%"])
    header = ["model", "plain fwd+bwd", "compute (+copies)", "compute err", "ranks' spread",
              "collectives", "optimizer", "step (sum of phases)", "step err"]
    note = (f"Modeled / measured ms, autoshard's data-parallel plan, 4 gloo ranks (2x2), profile "
            f"`{Path(args.hardware).name}`, median of {args.iters} interleaved iterations, each phase after a barrier. "
            "plain: the module on the rank's quarter of the batch (mean over ranks). compute: plan compute + "
            "resharding + the buckets' flatten and copy-back, against the runtime with every all-reduce skipped "
            "(mean over ranks). ranks' spread: modeled wait of collectives for drifted ranks against that runtime's slowest rank less the mean. "
            "collectives: plan comm + exposed gradient sync less the copies, against the runtime less the skipped one, "
            "slowest ranks, forward + backward. step: the runtime's slowest-rank forward "
            "and backward plus its optimizer phase, each after a barrier (not a training loop's step, which "
            "gets back part of the spread: bench/plan_fidelity.py times those). "
            f"Whole run {wall_s / 60:.1f} min.")
    write("step_decomposition", {"results": results, "hardware": args.hardware, "iters": args.iters,
                                 "warmup": args.warmup, "wall_s": wall_s}, header, rows, note)


def main() -> int:
    ap = rank_bench_parser(__doc__.split("\n\n")[0], DEFAULT_MODELS, DEFAULT_PROFILE)
    ap.add_argument("--iters", type=int, default=24, help="timed iterations per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations per configuration")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    require_profile(args.hardware)
    start = time.perf_counter()
    results = run_on_ranks(__file__, ["--hardware", args.hardware, "--models", args.models, "--iters", str(args.iters),
                                      "--warmup", str(args.warmup)], WORLD, ROOT)
    report(args, results, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
