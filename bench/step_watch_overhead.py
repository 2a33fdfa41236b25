"""Cost of the step watch (a rank that skips backward is an error): the same data-parallel step with it
(``check_inputs="first"``, the default) and without (``check_inputs="never"``), on 4 gloo ranks.

GPT-2 (width 128, 4 layers, batch 8, seq 128, fp32, AdamW), ``baseline="data_parallel"`` on a 2x2
mesh: every backward all-reduces the gradients in buckets, the collectives the watch waits in. Each
step runs between two barriers (rank 0's time is the slowest rank's); the two configurations
alternate step by step (order swapped every other round), so that load from other processes hits
both alike; medians, and the median of the paired differences. Besides, each rank times the watch's
own code (the store read at a call, at most one per 0.25 s of calls; the store write at the start of
backward) and counts the diagnosis reads (those of the calls, plus one per 0.25 s a collective runs
past a wait slice).

Run: python bench/step_watch_overhead.py [--rounds 40] [--baseline data_parallel]
(re-launches itself under torchrun with 4 ranks, OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine, write  # noqa: E402

GPT2 = ("gpt2-tiny", dict(n_embd=128, num_layers=4, n_head=4, n_positions=128, vocab_size=2048))


def worker(rounds: int, baseline: str, out: str) -> None:
    import torch.distributed as dist

    import autoshard
    from autoshard.models import build_model
    from autoshard.runtime import step_watch

    own = {"before_forward": 0.0, "backward_started": 0.0, "reads": 0}

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

    step_watch.StepWatch.before_forward = timed("before_forward", step_watch.StepWatch.before_forward)
    step_watch.StepWatch.backward_started = timed("backward_started", step_watch.StepWatch.backward_started)
    step_watch.StepWatch.check = counted(step_watch.StepWatch.check)

    mesh = autoshard.init_mesh((2, 2))
    rank = dist.get_rank()
    torch.manual_seed(0)
    preset, overrides = GPT2
    model, _, kwargs = build_model(preset, device="cpu", batch=8, seq=128, dropout=0.0, **overrides)
    plan = autoshard.plan_once(model, kwargs=kwargs, mesh=(2, 2), hardware="cpu-gloo", baseline=baseline)
    modules = {name: autoshard.parallelize(copy.deepcopy(model), plan, mesh, check_inputs=check)
               for name, check in (("with watch", "first"), ("without", "never"))}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in modules.items()}

    def step(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        modules[name](**kwargs).loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - start

    for name in modules:
        for _ in range(3):
            step(name)
    own.update(before_forward=0.0, backward_started=0.0, reads=0)
    times: dict[str, list[float]] = {n: [] for n in modules}
    for r in range(rounds):
        for name in (list(modules) if r % 2 == 0 else list(modules)[::-1]):
            times[name].append(step(name))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: v / rounds for k, v in own.items()})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "watch_own_per_step": everyone}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--baseline", default="data_parallel")
    p.add_argument("--worker-out")
    a = p.parse_args()
    if a.worker_out:
        worker(a.rounds, a.baseline, a.worker_out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                        __file__, "--rounds", str(a.rounds), "--baseline", a.baseline, "--worker-out", out],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(out) as f:
            result = json.load(f)
    times = result["times"]
    med = {n: statistics.median(ts) for n, ts in times.items()}
    diff = statistics.median(a - b for a, b in zip(times["with watch"], times["without"]))
    own = result["watch_own_per_step"]
    load = os.getloadavg()[0]
    data = {"machine": machine(), "rounds": a.rounds, "baseline": a.baseline, "median_s": med,
            "paired_difference_s": diff, "steps_s": times, "watch_own_per_step_per_rank": own,
            "load_average_1min_after": load}
    rows = [[f"gpt2 {a.baseline} 2x2", f"{med['without'] * 1e3:.1f}", f"{med['with watch'] * 1e3:.1f}",
             f"{diff * 1e3:+.1f}",
             f"{min(o['before_forward'] for o in own) * 1e3:.2f}-{max(o['before_forward'] for o in own) * 1e3:.2f}",
             f"{min(o['backward_started'] for o in own) * 1e3:.2f}-"
             f"{max(o['backward_started'] for o in own) * 1e3:.2f}",
             f"{max(o['reads'] for o in own):.1f}", f"{load:.1f}"]]
    write("step_watch_overhead" + ("" if a.baseline == "data_parallel" else f"_{a.baseline}"), data,
          ["model", "without ms", "with watch ms", "paired difference ms", "watch per call ms (ranks)",
           "watch at backward start ms", "diagnosis reads per step", "load average"], rows,
          note=f"Training step (forward + backward + AdamW), 4 gloo ranks on a 2x2 mesh, 1 torch thread each; "
               f"medians of {a.rounds} steps per configuration, alternating, after 3 warm-up steps each. The machine "
               f"is shared: the load average (1 min, after the run) says how much.")


if __name__ == "__main__":
    main()
