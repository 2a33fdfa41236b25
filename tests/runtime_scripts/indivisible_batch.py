"""torchrun helper of tests/test_runtime_errors.py: a global batch the plan's input sharding does not divide.

Usage: torchrun --nproc_per_node=N indivisible_batch.py PLAN.json BATCH

Every rank loads the same plan (for the ``mlp`` preset, made for a batch the mesh divides) and calls
the parallel module with the same global batch of BATCH rows. Prints
``RANK <r> RAISED <type> (ValueError: <bool>): <message>`` for the error it gets (then lets it
propagate), or ``RANK <r> RAN`` if the step went through.
"""
import os
import sys

import torch

import autoshard
from autoshard.models import build_model
from autoshard.plans import Plan
from autoshard.runtime import capture_meta


def say(line: str) -> None:
    """One line to stdout in one write, so that lines of different ranks never interleave."""
    os.write(1, (line + "\n").encode())


plan_path, batch = sys.argv[1], int(sys.argv[2])
plan = Plan.load(plan_path)
model, (x,), _ = build_model("mlp", device="cpu", batch=8)
graph = capture_meta(model, (x,), name=plan.model_name)
mesh = autoshard.init_mesh(tuple(plan.mesh_shape), timeout=10)
rank = int(os.environ["RANK"])
pm = autoshard.parallelize(model, plan, mesh, graph=graph)
xb = torch.randn(batch, x.shape[1], generator=torch.Generator().manual_seed(0))   # the same on every rank
try:
    pm(xb).pow(2).mean().backward()
except Exception as e:
    say(f"RANK {rank} RAISED {type(e).__name__} (ValueError: {isinstance(e, ValueError)}): {e}")
    raise
say(f"RANK {rank} RAN")
