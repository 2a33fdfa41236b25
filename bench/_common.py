"""Shared output helpers for benchmarks: every benchmark writes JSON and a markdown table."""
from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path
from typing import Sequence

import torch

RESULTS = Path(__file__).resolve().parent / "results"


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
