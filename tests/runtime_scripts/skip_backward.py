"""torchrun helper of tests/test_runtime_errors.py: rank 2 skips ``loss.backward()`` on one training step.

Usage: torchrun --nproc_per_node=4 skip_backward.py PLAN.json SKIP_STEP

Every rank loads the same plan (for the ``mlp`` preset), builds the mesh with a 30 s collective timeout
and runs SGD steps 1..SKIP_STEP+3 with the default ``check_inputs``. On step SKIP_STEP rank 2 calls the
model but not backward. The others (whose backward all-reduces the gradients with rank 2 in a
data-parallel plan) must not wait for the timeout, and rank 2's next forward must not pair its
collectives with their backward's: every rank should raise ``SkippedBackwardError`` within seconds.

Prints ``RANK <r> STEP <s> DONE`` and ``RANK <r> RAISED in step <s> after <t>s: <type>: <message>``
(measured from the start of that step), then exits with status 0 (so that torchrun, which stops every
worker as soon as one fails, does not stop the others before their own error shows); the test reads
the lines.
"""
import os
import sys
import time

import torch

import autoshard
from autoshard.models import build_model
from autoshard.plans import Plan
from autoshard.runtime import capture_meta


def say(line: str) -> None:
    """One line to stdout in one write, so that lines of different ranks never interleave."""
    os.write(1, (line + "\n").encode())


SKIPPER = 2
plan_path, skip_step = sys.argv[1], int(sys.argv[2])
plan = Plan.load(plan_path)
torch.manual_seed(0)
model, (x,), _ = build_model("mlp", device="cpu", batch=8)
graph = capture_meta(model, (x,), name=plan.model_name)
mesh = autoshard.init_mesh(tuple(plan.mesh_shape), timeout=30)
rank = int(os.environ["RANK"])
pm = autoshard.parallelize(model, plan, mesh, graph=graph)
opt = torch.optim.SGD(pm.parameters(), lr=0.1)
for step in range(1, skip_step + 4):
    start = time.monotonic()
    try:
        opt.zero_grad()
        loss = pm(x).pow(2).mean()
        if step == skip_step and rank == SKIPPER:
            say(f"RANK {rank} SKIPS BACKWARD in step {step}")
        else:
            loss.backward()
            opt.step()
    except Exception as e:
        say(f"RANK {rank} RAISED in step {step} after {time.monotonic() - start:.1f}s: {type(e).__name__}: {e}")
        break
    say(f"RANK {rank} STEP {step} DONE")
