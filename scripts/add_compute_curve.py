"""Add a compute curve autoshard learned to measure after a profile was measured, without measuring
the whole profile again (:func:`autoshard.profile.compute.add_measured_curve`: the curve timed now on
every rank, brought to the profile's moment by the drift of a related family).

Run on the machine the profile describes, with as many ranks as it was measured with, e.g.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 --standalone scripts/add_compute_curve.py \\
        configs/hardware/cpu-gloo.yaml attention_narrow

Rank 0 rewrites the YAML in place and prints the curve.
"""
from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from autoshard.hardware import COMPUTE_FAMILIES, load_hardware
from autoshard.profile.compute import COMPUTE_OPS, add_measured_curve
from autoshard.profile.timing import _ensure_initialised


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="the profile's YAML file (rewritten in place)")
    ap.add_argument("family", choices=sorted(COMPUTE_OPS), help="the compute family to measure and add")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--iters", type=int, default=10, help="timed runs per size (median kept)")
    args = ap.parse_args()
    _ensure_initialised()
    hw = load_hardware(args.profile)
    if args.family in hw.compute.get(args.dtype, {}):
        print(f"{args.profile} already has a {args.dtype} {args.family} curve; nothing to add", file=sys.stderr)
        return 1
    added = add_measured_curve(hw, args.family, iters=args.iters, dtype=args.dtype)
    if dist.get_rank() == 0:
        added.save(args.profile)
        curve = added.compute[args.dtype][args.family]
        unit = COMPUTE_FAMILIES[args.family]
        for work, fwd, bwd in zip(curve.work, curve.fwd, curve.bwd):
            print(f"{args.family} {work:.3g} {unit}: forward {1e3 * fwd:.4f} ms, backward {1e3 * bwd:.4f} ms")
        print(added.description[len(hw.description):].strip())
    dist.barrier()      # every rank stays in the group until rank 0 has written the profile
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
