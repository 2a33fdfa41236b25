"""The step-waits bench's arithmetic (the machine's period, CPU over cores, idle) and its wait trace."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_waits as sw  # noqa: E402


def _steps(starts: list[float], cpu: float, waiting: float) -> list[dict]:
    return [{"start": t, "cpu": cpu, "waiting": waiting, "waits": 3} for t in starts]


def test_summary_is_the_machines_step_not_a_ranks():
    # two ranks on one core; the machine's step runs from the last rank's start to its next start
    ranks = [_steps([0.0, 1.0, 2.0, 3.0], cpu=0.4, waiting=0.3),
             _steps([0.2, 1.1, 2.3, 3.3], cpu=0.5, waiting=0.1)]
    s = sw.summarize(ranks, n_cores=1)
    assert s["period_ms"] == pytest.approx(1000.0)        # periods 0.9, 1.2, 1.0: the last step only ends one
    assert s["cpu_over_cores_ms"] == pytest.approx(900.0)
    assert s["idle_ms"] == pytest.approx(100.0)           # 0.0, 0.3, 0.1
    assert s["waiting_ms"] == pytest.approx(200.0)        # mean over ranks
    assert s["waits_per_step"] == 3
    assert sw.summarize(ranks, n_cores=2)["idle_ms"] == pytest.approx(550.0)   # 0.9-0.45, 1.2-0.45, 1.0-0.45


def test_the_wait_trace_times_every_runtime_wait_and_restores_it():
    from autoshard.runtime.collectives import MeshComm

    real = MeshComm.wait
    trace = sw.WaitTrace()
    try:
        class Work:
            def wait(self) -> bool:
                return True

        comm = MeshComm.__new__(MeshComm)
        comm.watch = None
        MeshComm.wait(comm, Work())
        MeshComm.wait(comm, Work())
        assert len(trace.spans) == 2 and all(b >= a for a, b in trace.spans)
    finally:
        trace.restore()
    assert MeshComm.wait is real
