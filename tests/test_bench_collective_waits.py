"""The collective-waits bench's arithmetic (per collective: after the group's last rank, blocked,
arrival spread, price) and its tracer's install and restore."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import collective_waits as cw  # noqa: E402

AXES = {"0,2": [0], "1,3": [0], "0,1": [1], "2,3": [1], "0,1,2,3": [0, 1]}


def _turn(starts, calls):
    return {"starts": starts, "calls": calls}


def _rank(rank: int, skew: float) -> list[dict]:
    """Three steps (the last only ends the one before, as the bench runs them), each: a forward all-reduce on axis 0 then a backward one
    on the world; rank r issues each ``skew * r`` late, waits at once, and every wait returns 1 ms
    after the group's last rank issued."""
    calls, starts = [], []
    for step in range(3):
        t = 10.0 * step
        starts.append(t + skew * rank)
        axis0 = [0, 2] if rank % 2 == 0 else [1, 3]
        last0 = t + 1.0 + skew * max(axis0)
        calls.append(["all_reduce", axis0, 4096, "fwd", t + 1.0 + skew * rank, t + 1.0 + skew * rank, last0 + 0.001])
        last = t + 5.0 + skew * 3
        calls.append(["all_reduce", [0, 1, 2, 3], 8192, "bwd", t + 5.0 + skew * rank, t + 5.0 + skew * rank,
                      last + 0.001])
    return [_turn(starts, calls)]


def test_each_collective_is_timed_from_its_groups_last_rank_and_priced():
    ranks = [_rank(r, skew=0.002) for r in range(4)]
    priced = []

    def price(kind, nbytes, axes):
        priced.append((kind, nbytes, axes))
        return 0.0005 * len(axes)

    s = cw.summarize(ranks, AXES, price)
    assert s["period_ms"] == pytest.approx(10_000.0)
    first, second = s["collectives"]
    assert (first["kind"], first["phase"], first["axes"], first["bytes"]) == ("all_reduce", "fwd", [0], 4096)
    assert first["after_last_ms"] == pytest.approx(1.0)
    assert first["spread_ms"] == pytest.approx(4.0)            # ranks 0 and 2 (1 and 3): 2 x 2 ms apart
    assert first["priced_ms"] == pytest.approx(0.5)
    assert second["axes"] == [0, 1] and second["after_last_ms"] == pytest.approx(1.0)
    assert second["spread_ms"] == pytest.approx(6.0)
    assert first["blocked_ms"] == pytest.approx(3.0)           # 5, 1, 5, 1 ms: the early rank of each pair waits
    assert second["blocked_ms"] == pytest.approx(4.0)          # 7, 5, 3, 1 ms
    assert ("all_reduce", 8192, (0, 1)) in priced


def test_a_collective_never_waited_for_is_an_error_not_a_number():
    ranks = [_rank(r, skew=0.0) for r in range(4)]
    ranks[2][0]["calls"][1][6] = None
    with pytest.raises(RuntimeError, match="never waited for"):
        cw.summarize(ranks, AXES, lambda *a: 1.0)


def test_ranks_that_issued_different_sequences_are_an_error():
    ranks = [_rank(r, skew=0.0) for r in range(4)]
    ranks[1][0]["calls"].pop()
    with pytest.raises(RuntimeError, match="not the same sequence"):
        cw.summarize(ranks, AXES, lambda *a: 1.0)


def test_the_tracer_wraps_the_collectives_and_the_wait_and_restores_them():
    import torch.distributed as dist

    from autoshard.runtime.collectives import MeshComm

    real_wait, real = MeshComm.wait, {n: getattr(dist, n) for n in cw.TRACED if hasattr(dist, n)}
    trace = cw.CollectiveTrace()
    try:
        assert MeshComm.wait is not real_wait and all(getattr(dist, n) is not f for n, f in real.items())
    finally:
        trace.restore()
    assert MeshComm.wait is real_wait and all(getattr(dist, n) is f for n, f in real.items())
