"""Runtime failure modes, each in its own small torchrun job (scripts in tests/runtime_scripts/).

A mesh that does not match the job, a rank that leaves or stalls mid-step, a batch the plan's input
sharding does not divide, and a rank that skips backward on one step must end the job with a clear
error on every rank, never a hang.
Every job runs under a wall-clock limit; a job that outlives it is killed (its whole process group)
and the test fails as a hang.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import autoshard
from autoshard.models import build_model
from autoshard.specs import ShardSpec

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "runtime_scripts"
COLLECTIVE_TIMEOUT_S = 10           # what the scripts pass to init_mesh(timeout=...)


def _torchrun(script: str, nproc: int, *args: str, limit_s: float) -> tuple[int, str, float]:
    """Run ``script`` under torchrun on ``nproc`` local ranks: (exit status, stdout + stderr, seconds).

    ``--monitor-interval 2``: torchrun stops every worker as soon as one fails; polling every 2 s
    (instead of 0.1 s) gives the other ranks time to print the error they get themselves."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           "--monitor-interval=2", str(SCRIPTS / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)          # torchrun and its workers: the session we started
        out, _ = proc.communicate()
        pytest.fail(f"{script} did not finish within {limit_s:.0f} s (a hang); output:\n{out[-6000:]}")
    return proc.returncode, out, time.monotonic() - start


def _raised(out: str) -> dict[int, str]:
    """Rank -> the rest of its ``RANK <r> RAISED ...`` line."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^RANK (\d+) RAISED (.*)$", out, re.MULTILINE)}


def _plan_file(tmp_path: Path, mesh: tuple[int, int], baseline: str, batch: int = 8) -> tuple[Path, autoshard.Plan]:
    """A plan for the ``mlp`` preset, made once and saved (every rank of the job loads this file)."""
    model, args, kwargs = build_model("mlp", batch=batch)          # meta: nothing allocated
    plan = autoshard.plan(model, args, kwargs, mesh=mesh, hardware="h100-nvlink", baseline=baseline)
    return plan.save(tmp_path / f"mlp-{baseline}-{mesh[0]}x{mesh[1]}.json"), plan


# -- (a) mesh size != world size --------------------------------------------------------------------

def test_mesh_larger_than_the_job_is_a_mesh_error_on_every_rank():
    code, out, seconds = _torchrun("mesh_mismatch.py", 2, "2x2", limit_s=60)
    assert code != 0, f"the job succeeded:\n{out[-4000:]}"
    assert "GOT A MESH" not in out
    raised = _raised(out)
    assert sorted(raised) == [0, 1], f"ranks that reported an error: {sorted(raised)}\n{out[-4000:]}"
    for rank, line in raised.items():
        assert line.startswith("MeshError: "), f"rank {rank}: {line}"
        # names both sizes: the mesh's 4 devices and the job's 2 ranks
        assert re.search(r"\b4\b", line) and re.search(r"\b2\b", line), f"rank {rank}: {line}"


# -- (b) a rank that leaves or stalls mid-step ------------------------------------------------------

def test_rank_that_exits_mid_step_makes_the_others_fail_not_hang(tmp_path):
    """Rank 1 of 2 exits right before the forward of step 2. gloo notices at once that the peer's
    sockets closed: the survivor's collective raises ``Connection closed by peer`` (or ``Read
    error ... Connection reset by peer``), well before the 10 s collective timeout."""
    path, _ = _plan_file(tmp_path, (1, 2), "megatron")
    code, out, seconds = _torchrun("rank_failure.py", 2, str(path), "exit", limit_s=90)
    assert "RANK 1 LEAVES" in out, out[-4000:]
    assert "RANK 0 STEP 1 DONE" in out, out[-4000:]
    assert "RANK 0 STEP 2 DONE" not in out, f"rank 0 finished step 2 without rank 1:\n{out[-4000:]}"
    assert code != 0
    raised = _raised(out)
    assert list(raised) == [0], f"ranks that reported an error: {sorted(raised)}\n{out[-4000:]}"
    m = re.match(r"in step 2 after ([\d.]+)s: RuntimeError: (.*)", raised[0])
    assert m, f"{raised[0]}\n{out[-4000:]}"
    assert re.search(r"Connection (closed|reset) by peer", m.group(2)), raised[0]
    assert float(m.group(1)) < COLLECTIVE_TIMEOUT_S, f"noticed only after {m.group(1)} s: {raised[0]}"
    assert seconds < 60, f"the job took {seconds:.0f} s"


def test_rank_that_stalls_mid_step_makes_the_others_time_out(tmp_path):
    """Rank 1 of 4 (2x2 mesh) stops taking part in step 2 without exiting (it sleeps 45 s). The
    survivors' collectives, on the mesh's axis groups, must fail once the 10 s timeout passed to
    ``init_mesh`` expires (gloo: ``Timed out waiting 10000ms for recv/send operation``), not when
    rank 1 finally exits.

    Fails today: ``init_mesh`` passes its timeout to ``init_process_group`` only; the per-axis groups
    that ``init_device_mesh`` creates for a 2x2 mesh get gloo's 30-minute default, so the survivors
    wait until rank 1's process exits (``Connection closed by peer`` after 45 s)."""
    stall_s = 45
    path, _ = _plan_file(tmp_path, (2, 2), "megatron")
    code, out, seconds = _torchrun("rank_failure.py", 4, str(path), "stall", str(stall_s), limit_s=stall_s + 45)
    assert "RANK 1 STALLS" in out, out[-4000:]
    assert code != 0
    raised = _raised(out)
    assert sorted(raised) == [0, 2, 3], f"ranks that reported an error: {sorted(raised)}\n{out[-4000:]}"
    slack = 10
    for rank, line in raised.items():
        m = re.match(r"in step 2 after ([\d.]+)s: RuntimeError: (.*)", line)
        assert m, f"rank {rank}: {line}\n{out[-4000:]}"
        assert float(m.group(1)) < COLLECTIVE_TIMEOUT_S + slack, \
            f"rank {rank} failed only after {m.group(1)} s, not within the {COLLECTIVE_TIMEOUT_S} s timeout: {line}"
    assert any(f"Timed out waiting {COLLECTIVE_TIMEOUT_S * 1000}ms" in line for line in raised.values()), \
        f"no survivor reports the {COLLECTIVE_TIMEOUT_S} s timeout: {raised}"


# -- (c) a batch the mesh does not divide -----------------------------------------------------------

def test_plan_rejects_a_batch_the_mesh_does_not_divide():
    model, args, kwargs = build_model("mlp", batch=6)
    with pytest.raises(autoshard.MeshError, match=r"batch size 6 .*not divisible by the 4 devices"):
        autoshard.plan(model, args, kwargs, mesh=(2, 2))


def test_indivisible_global_batch_is_a_clear_error_on_every_rank(tmp_path):
    """The plan (made for batch 8) shards the input's dim 0 over the 2 ranks; the call passes a global
    batch of 5. Every rank must raise a ValueError (``MeshError`` is one) that names the input, the
    batch it got and what it needs (the planned shape, or divisibility) before any collective: every
    rank sees the same global shape, so all of them raise and none is left waiting in a collective.

    Without a check (HEAD d99a3f2), ``shard_input`` (``torch.chunk``) silently splits 5 rows as 3 + 2:
    rank 1 aborts in gloo (SIGABRT, "Received data size doesn't match expected size") and rank 0
    gets ``Connection reset by peer``; on a 2x2 mesh a batch of 6 chunks into 3 pieces, so rank 3
    gets an IndexError and the others ``Connection closed by peer``."""
    path, plan = _plan_file(tmp_path, (1, 2), "data_parallel")
    spec = ShardSpec.parse(plan.nodes["x"].outputs[0])
    assert spec.dims[0], f"the plan does not shard the batch dim of x ({spec}): nothing to divide"
    code, out, seconds = _torchrun("indivisible_batch.py", 2, str(path), "5", limit_s=60)
    assert code != 0, f"the job succeeded:\n{out[-4000:]}"
    assert not re.search(r"^RANK \d+ RAN$", out, re.MULTILINE), f"a rank ran the step:\n{out[-4000:]}"
    raised = _raised(out)
    assert sorted(raised) == [0, 1], f"ranks that reported an error: {sorted(raised)}\n{out[-4000:]}"
    for rank, line in raised.items():
        assert "(ValueError: True)" in line, f"rank {rank} raised no ValueError: {line}"
        assert "args[0]" in line and re.search(r"\b5\b", line) and re.search(r"divisi|divides|\b8\b", line), \
            f"rank {rank}: the message should name the input (args[0]), its batch (5) and the planned 8 or " \
            f"divisibility: {line}"


# -- (d) a rank that skips backward on one step -------------------------------------------------------

@pytest.mark.timeout(150)
@pytest.mark.parametrize("skip_step", [1, 3])
def test_rank_that_skips_backward_is_a_named_error_on_every_rank_in_seconds(tmp_path, skip_step):
    """Data parallel on 2x2: every backward all-reduces the gradients over the 4 ranks. Rank 2 calls the
    model on step ``skip_step`` but not backward. The others wait in the gradient all-reduce that rank 2
    never joins; rank 2's next forward would pair its collectives (all-gathers of the output) with
    theirs. Every rank must raise ``SkippedBackwardError`` naming rank 2 and the step, with the default
    ``check_inputs``, within seconds (not the 30 s collective timeout): rank 2 at its next call, the
    others in the backward they wait in.

    Fails before the store-based step watch: every rank raises gloo's ``Timed out waiting 30000ms``
    after 30 s (rank 2 in its next forward's all-gather)."""
    path, plan = _plan_file(tmp_path, (2, 2), "data_parallel")
    assert any(c.phase == "bwd" and c.kind == "all_reduce" for c in plan.comm), plan.comm
    code, out, seconds = _torchrun("skip_backward.py", 4, str(path), str(skip_step), limit_s=120)
    assert f"RANK 2 SKIPS BACKWARD in step {skip_step}" in out, out[-4000:]
    for rank in range(4):
        for step in range(1, skip_step):
            assert f"RANK {rank} STEP {step} DONE" in out, f"rank {rank} step {step}:\n{out[-4000:]}"
    raised = _raised(out)
    assert sorted(raised) == [0, 1, 2, 3], f"ranks that reported an error: {sorted(raised)}\n{out[-4000:]}"
    for rank, line in raised.items():
        step = skip_step + 1 if rank == 2 else skip_step      # rank 2 at its next call; the others in backward
        m = re.match(rf"in step {step} after ([\d.]+)s: SkippedBackwardError: (.*)", line)
        assert m, f"rank {rank}: {line}\n{out[-4000:]}"
        assert float(m.group(1)) < 5, f"rank {rank} raised only after {m.group(1)} s: {line}"
        assert m.group(2).startswith(f"rank 2 did not run backward on training step {skip_step} ") and \
            "while ranks 0, 1, 3 did" in m.group(2) and "same training loop on every rank" in m.group(2), line
