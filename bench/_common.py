"""Shared output helpers for benchmarks: every benchmark writes JSON and a markdown table."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path
from typing import Sequence

import torch

RESULTS = Path(__file__).resolve().parent / "results"


# glibc malloc, left to itself, returns large freed blocks to the OS (mmap'd chunks, heap trims) and
# moves its thresholds with what was freed last; the next step then page-faults its memory back in,
# 0.4 ms per MiB on this VM (a 1 MiB relu into fresh memory: 448 us, into reused memory: 23 us). How
# much depends on what ran before: interleaved configurations left each other's allocator in
# different states (cnn-16, one run: autoshard's data-parallel plan 19.3 ms, torch DDP 16.8; with
# this setting 17.1 and 17.1). Fixed thresholds keep freed memory in the process, as the CUDA
# caching allocator does on a GPU; every configuration and the profile run under them.
KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824"


def rank_env(root: Path) -> dict:
    """The environment of the benchmarks' torchrun launches: one intra-op thread per rank (4 ranks
    share the cores), malloc keeping freed memory (see :data:`KEEP_FREED_MEMORY`), the repo importable."""
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "GLIBC_TUNABLES": KEEP_FREED_MEMORY,
            "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def init_gloo_ranks(mesh_shape: Sequence[int]):
    """A benchmark worker's start on its torchrun rank: one intra-op thread, the gloo process group
    (30 min timeout: a long bench waits on its slowest rank), autoshard's mesh. Returns (mesh, rank)."""
    import datetime

    import torch.distributed as dist

    import autoshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    return autoshard.init_mesh(tuple(mesh_shape)), dist.get_rank()


def same_plan(plans: dict, plan) -> str | None:
    """The name of a plan in ``plans`` that runs the same strategies and memory decisions as ``plan``."""
    return next((name for name, p in plans.items() if p.nodes == plan.nodes and p.segments == plan.segments), None)


def work_or_launch(args: argparse.Namespace, script: str, forward: Sequence[str], worker, report, ranks: int,
                   root: Path, measured_profile: bool = False) -> int:
    """The end of a torchrun benchmark's ``main``: on a rank (``--worker``), ``worker(args)``; else launch
    ``script`` on ``ranks`` local ranks with the options named in ``forward`` (argparse names, passed on
    as ``--name-with-dashes VALUE``) and ``report(args, results, wall_s)`` with what rank 0 wrote.
    ``measured_profile``: ``args.hardware`` must be a profile file already there (one a bench measured),
    checked before the launch."""
    import time

    if args.worker:
        worker(args)
        return 0
    if measured_profile:
        require_profile(args.hardware)
    start = time.perf_counter()
    passed = [item for name in forward for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    report(args, run_on_ranks(script, passed, ranks, root), time.perf_counter() - start)
    return 0


def machine() -> dict:
    import os

    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "machine": platform.machine()}


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def write(name: str, data: dict, header: Sequence[str], rows: Sequence[Sequence[object]], note: str = "") -> Path:
    """Write ``results/<name>.json`` and ``results/<name>.md``; returns the markdown path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {**data, "machine": machine()}
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    md = "\n".join(lines) + "\n" + (f"\n{note}\n" if note else "")
    path = RESULTS / f"{name}.md"
    path.write_text(md)
    print(md)
    return path


def run_on_ranks(script: str, args: Sequence[str], ranks: int, root: Path) -> object:
    """Run ``script --worker --out FILE *args`` under torchrun on ``ranks`` local ranks (the
    benchmarks' environment, :func:`rank_env`) and return the JSON its rank 0 wrote to FILE."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(Path(script).resolve()), "--worker", "--out", str(out), *args]
        subprocess.run(cmd, env=rank_env(root), check=True, cwd=root)
        return json.loads(out.read_text())


def rank_bench_parser(description: str, models: str, profile: "Path | str",
                      plans: str | None = None) -> argparse.ArgumentParser:
    """The options every bench that re-launches itself on ranks under a profile takes: ``--models``,
    ``--hardware`` and the worker's own ``--worker`` and ``--out``; with ``plans``, ``--plans`` (its
    default) for a bench that runs named plans (``step_decomposition.named_plan``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--models", default=models, help="comma-separated plan_fidelity model keys")
    ap.add_argument("--hardware", default=str(profile), help="profile to plan and price under")
    if plans is not None:
        ap.add_argument("--plans", default=plans, help="comma-separated baselines, 'solved', and saved plans "
                        "(*.json, Plan.save, made for the model and mesh)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap


def require_profile(path: str) -> None:
    if not Path(path).exists():
        raise SystemExit(f"no profile at {path}: run bench/plan_fidelity.py (it measures one) or pass --hardware")
