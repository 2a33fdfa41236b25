"""torchrun helper of tests/test_runtime_errors.py: init_mesh with a mesh larger than the job.

Usage: torchrun --nproc_per_node=2 mesh_mismatch.py 2x2
Each rank prints ``RANK <r> RAISED <type>: <message>`` for the error it gets, then lets it propagate.
"""
import os
import sys

import autoshard


def say(line: str) -> None:
    """One line to stdout in one write, so that lines of different ranks never interleave."""
    os.write(1, (line + "\n").encode())


shape = tuple(int(s) for s in sys.argv[1].split("x"))
try:
    autoshard.init_mesh(shape, timeout=10)
except Exception as e:
    say(f"RANK {os.environ['RANK']} RAISED {type(e).__name__}: {e}")
    raise
say(f"RANK {os.environ['RANK']} GOT A MESH")
