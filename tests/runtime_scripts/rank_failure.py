"""torchrun helper of tests/test_runtime_errors.py: rank 1 leaves (or stalls) in the middle of training.

Usage: torchrun --nproc_per_node=N rank_failure.py PLAN.json MODE [STALL_SECONDS]

Every rank loads the same plan (for the ``mlp`` preset), builds the mesh with a 10 s collective timeout
and runs SGD steps. At step 2, right before the forward, rank 1 either exits (MODE ``exit``) or
stops taking part for STALL_SECONDS (MODE ``stall``: it sleeps, then exits) while the other ranks
run the step. Exit status 0 on rank 1, so that torchrun (which stops every worker as soon as one
fails) does not kill the survivors before their own error shows; to the survivors, a process that
is gone is gone whatever its exit status.

Prints ``RANK <r> STEP <s> DONE`` and ``RANK <r> RAISED in step <s> after <t>s: <type>: <message>``
(then lets the error propagate); rank 1 prints ``RANK 1 LEAVES`` / ``RANK 1 STALLS``.
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


TIMEOUT_S = 10

plan_path, mode = sys.argv[1], sys.argv[2]
stall_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
plan = Plan.load(plan_path)
model, (x,), _ = build_model("mlp", device="cpu", batch=8)
# captured before the process group exists, so that no rank waits on another's capture in a collective
graph = capture_meta(model, (x,), name=plan.model_name)
mesh = autoshard.init_mesh(tuple(plan.mesh_shape), timeout=TIMEOUT_S)
rank = int(os.environ["RANK"])
pm = autoshard.parallelize(model, plan, mesh, graph=graph)
opt = torch.optim.SGD(pm.parameters(), lr=0.1)
for step in (1, 2, 3):
    if step == 2 and rank == 1:
        if mode == "exit":
            say("RANK 1 LEAVES")
            os._exit(0)
        say("RANK 1 STALLS")
        time.sleep(stall_s)
        os._exit(0)
    start = time.monotonic()
    try:
        opt.zero_grad()
        pm(x).pow(2).mean().backward()
        opt.step()
    except Exception as e:
        say(f"RANK {rank} RAISED in step {step} after {time.monotonic() - start:.1f}s: {type(e).__name__}: {e}")
        raise
    say(f"RANK {rank} STEP {step} DONE")
