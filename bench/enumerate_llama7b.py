"""Time strategy enumeration of the Llama-2-7B config (32 layers, hidden 4096) on a 2x4 mesh.

Capture (on meta) is timed separately; enumeration starts from the captured graph with every
cache cleared, so each repetition measures a cold enumeration.
Run: python bench/enumerate_llama7b.py [--reps 3]
"""
from __future__ import annotations

import argparse
import time

from _common import median, write

from autoshard import capture, enumerate_strategies
from autoshard.models import build_model
from autoshard.opinfo import clear_profile_cache
from autoshard.reshard import clear_reshard_cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--hardware", default="h100-nvlink")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    t0 = time.perf_counter()
    model, args, kwargs = build_model(a.model, device="meta", batch=a.batch, seq=a.seq)
    graph = capture(model, args, kwargs, name=a.model)
    capture_s = time.perf_counter() - t0
    runs = []
    for _ in range(a.reps):
        clear_profile_cache()
        clear_reshard_cache()
        table = enumerate_strategies(graph, mesh_shape=a.mesh, hardware=a.hardware)
        runs.append(table.seconds)
    nodes, strategies = len(table), table.total_strategies()
    data = {"model": a.model, "mesh": a.mesh, "batch": a.batch, "seq": a.seq, "nodes": nodes,
            "strategies": strategies, "capture_s": capture_s, "enumerate_s": runs,
            "enumerate_median_s": median(runs)}
    write(f"enumerate_{a.model}", data,
          ["model", "mesh", "nodes", "strategies", "capture s", "enumerate s (median)", "target"],
          [[a.model, a.mesh, nodes, strategies, f"{capture_s:.2f}", f"{median(runs):.2f}", "< 10 s"]],
          note=f"Median of {a.reps} cold enumerations (caches cleared), batch {a.batch}, seq {a.seq}, "
               f"hardware {a.hardware}.")


if __name__ == "__main__":
    main()
