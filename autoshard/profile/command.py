"""Measure a hardware profile of the running cluster (``autoshard profile``), under torchrun.

The command: its options, the measurement on every rank, the YAML rank 0 writes and the summary it
prints (``python -m autoshard.profile`` runs :func:`main`).
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Sequence

from ..hardware import COMPUTE_FAMILIES, HardwareProfile, load_hardware
from ..units import format_bytes, parse_bytes
from .measure import DEFAULT_SIZES, measure_profile

__all__ = ["add_profile_arguments", "main", "run_profile"]


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``autoshard profile``."""
    parser.add_argument("--mesh", required=True, help="mesh shape, e.g. 2x4; its size must equal the world size")
    parser.add_argument("--name", default="measured", help="profile name (default: measured)")
    parser.add_argument("--out", help="YAML file to write (default: <name>.yaml)")
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                        help="comma-separated all-reduce message sizes, e.g. 4KiB,1MiB,16MiB")
    parser.add_argument("--iters", type=int, default=30, help="timed runs per collective measurement (median kept)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before each collective measurement")
    parser.add_argument("--compute-iters", type=int, default=10,
                        help="timed runs per compute/optimizer/overlap measurement, at most (median kept)")
    parser.add_argument("--compute-points", type=int, default=None,
                        help="measure only the N smallest sizes of each compute family (quick; default: all)")
    parser.add_argument("--base", help="profile (name or YAML) supplying what is not measured")


def run_profile(args: argparse.Namespace) -> int:
    """Run the measurement on every rank; rank 0 writes ``args.out`` and prints a summary."""
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    base = load_hardware(args.base) if args.base else None
    start = time.perf_counter()
    profile = measure_profile(args.mesh, name=args.name, sizes=sizes, iters=args.iters,
                              warmup=args.warmup, base=base, compute_iters=args.compute_iters,
                              compute_points=args.compute_points, progress=True)
    if int(os.environ.get("RANK", 0)) == 0:
        out = args.out or f"{args.name}.yaml"
        profile.save(out)
        print(_summary(profile, out, time.perf_counter() - start))
    return 0


def _summary(p: HardwareProfile, out: str, seconds: float) -> str:
    lines = [f"wrote {out} (measured in {seconds:.0f} s)"]
    for a, link in enumerate(p.axes):
        lines.append(f"  axis {a}: alpha {link.alpha * 1e6:.1f} us, bandwidth {1 / link.beta / 1e9:.2f} GB/s")
    if p.world is not None:
        lines.append(f"  all devices (both axes): alpha {p.world.alpha * 1e6:.1f} us, "
                     f"bandwidth {1 / p.world.beta / 1e9:.2f} GB/s")
    lines += [f"  {k}: {v / 1e9:.1f} GFLOP/s (roofline fallback)" for k, v in p.peak_flops.items()]
    lines.append(f"  memory bandwidth {p.memory_bandwidth / 1e9:.1f} GB/s, "
                 f"memory per device {format_bytes(p.memory_per_device)}")
    for dtype, families in p.compute.items():
        for family, c in families.items():
            unit = COMPUTE_FAMILIES[family]
            rate = "GFLOP/s" if unit == "FLOPs" else "GB/s"
            lines.append(f"  {dtype} {family}: floor fwd {c.fwd[0] * 1e6:.1f} us / bwd {c.bwd[0] * 1e6:.1f} us "
                         f"at {c.work[0]:.3g} {unit}; largest {c.work[-1]:.3g} {unit}: fwd "
                         f"{c.work[-1] / c.fwd[-1] / 1e9:.2f} {rate}, bwd {c.work[-1] / c.bwd[-1] / 1e9:.2f} "
                         f"{rate} (of forward work)")
    if p.optimizer is not None:
        lines.append(f"  optimizer (AdamW): {p.optimizer.per_tensor * 1e6:.1f} us per tensor + "
                     f"{p.optimizer.per_byte * 1e9:.3f} ns per byte")
    if p.overlap is not None:
        lines.append(f"  overlap of an async all-reduce with compute: {p.overlap:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoshard profile", description=__doc__.split("\n")[0])
    add_profile_arguments(parser)
    return run_profile(parser.parse_args(argv))
