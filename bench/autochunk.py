"""AutoChunk on a long-sequence attention model: measured inference peak and time per budget.

Model: 2 pre-norm transformer blocks (written-out multi-head attention with a [B, H, T, T] score
tensor, then a 4x MLP), width 32, 2 heads, sequence 4096, batch 1, float32, CPU.

For the eager model and for ``autochunk`` at several budgets: the measured activation peak
(allocator events via ``measure_peak_memory``), the planner's estimate, the median wall time of
several runs (process CPU time, and wall time), and the largest output difference from eager.
Timings use one intra-op thread (``torch.set_num_threads(1)``) because the 2-core machine is
shared and multi-threaded timings swing by several x under load; the load average is recorded.

Run: python bench/autochunk.py   (writes bench/results/autochunk.{json,md}; about a minute)
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, write  # noqa: E402

from autoshard.autochunk import autochunk, measure_peak_memory  # noqa: E402

SEQ, WIDTH, HEADS, LAYERS = 4096, 32, 2, 2
BUDGETS: list[str | None] = ["1GiB", None, "64MiB", "16MiB", "4MiB"]  # 1GiB: fits, no loops
RUNS = 7
MiB = 2**20


class Block(nn.Module):
    """Pre-norm attention (explicit scores and softmax) followed by a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = ((q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def timed(fn: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """Median (CPU seconds, wall seconds) of ``RUNS`` calls after one warm-up.

    CPU time of the process (one intra-op thread) is the headline: on a shared machine it
    does not count the time other processes hold the cores, which wall time does."""
    with torch.no_grad():
        fn(x)
        cpu, wall = [], []
        for _ in range(RUNS):
            c0, t0 = time.process_time(), time.perf_counter()
            fn(x)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
    return median(cpu), median(wall)


def peak(fn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    with torch.no_grad():
        out, mem = measure_peak_memory(fn, x)
    return out, mem.peak


def main() -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()   # no options (--help)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[Block(WIDTH, HEADS) for _ in range(LAYERS)]).eval()
    x = torch.randn(1, SEQ, WIDTH)
    load_before = os.getloadavg()
    ref, eager_peak = peak(model, x)
    eager_time, eager_wall = timed(model, x)
    results = [{"config": "eager", "peak": eager_peak, "cpu_s": eager_time, "wall_s": eager_wall}]
    rows = [["eager (no autochunk)", "-", f"{eager_peak / MiB:.1f}", "-", "-", f"{eager_time:.3f}", "1.00x",
             f"{eager_wall:.3f}", "-", "-"]]
    for budget in BUDGETS:
        t0 = time.perf_counter()
        chunked = autochunk(model, (x,), max_memory=budget)
        plan_s = time.perf_counter() - t0
        out, measured = peak(chunked, x)
        secs, wall = timed(chunked, x)
        diff = (out - ref).abs().max().item()
        rep = chunked.report
        loops = ", ".join(f"{lp.chunk}x{lp.iterations}" for lp in rep.loops) or "none"
        results.append({"config": f"autochunk max_memory={budget}", "budget": budget, "peak": measured,
                        "estimated_peak": rep.estimated_peak_after, "lowest_peak": rep.lowest_peak,
                        "cpu_s": secs, "wall_s": wall, "plan_s": plan_s, "max_abs_diff": diff,
                        "loops": [vars(lp) for lp in rep.loops]})
        rows.append([f"autochunk max_memory={budget}", f"{rep.estimated_peak_after / MiB:.2f}",
                     f"{measured / MiB:.2f}", f"{1 - measured / eager_peak:.1%}", loops,
                     f"{secs:.3f}", f"{secs / eager_time:.2f}x", f"{wall:.3f}", f"{diff:.1e}", f"{plan_s:.1f}"])
    data = {"model": {"seq": SEQ, "width": WIDTH, "heads": HEADS, "layers": LAYERS, "dtype": "float32"},
            "threads": 1, "runs": RUNS, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "results": results}
    note = (f"{LAYERS} attention+MLP blocks, seq {SEQ}, width {WIDTH}, {HEADS} heads, float32, batch 1, CPU, "
            f"1 intra-op thread, median of {RUNS} runs (process CPU time; wall time for reference). Peaks are measured from allocator events "
            "(`measure_peak_memory`); the estimate is the planner's. Loops: chunk length x iterations "
            "per loop. `None` = lowest reachable peak + 25% slack. Load average during the run: "
            f"{load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.")
    write("autochunk", data, ["config", "est. peak MiB", "measured peak MiB", "peak cut", "loops",
                              "CPU s", "CPU vs eager", "wall s", "max |diff|", "plan s"], rows, note)


if __name__ == "__main__":
    main()
