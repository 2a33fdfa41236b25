"""The step decomposition bench's arithmetic (modeled against measured parts) and its local stand-ins for
the runtime's collectives."""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_decomposition as sd  # noqa: E402


def _phases(fwd: float, bwd: float, opt: float) -> dict:
    return {"fwd": fwd, "bwd": bwd, "opt": opt}


def test_parts_pair_each_modeled_term_with_its_measured_difference():
    result = {"modeled_ms": {"compute": 80.0, "reshard": 4.0, "bucket_copies": 2.0, "comm": 2.0,
                             "grad_sync": 12.0, "optimizer": 9.0, "sync_wait": 3.0, "total": 110.0},
              "measured_ms": {"plain": {"mean": _phases(20, 40, 7), "slowest": _phases(22, 44, 8)},
                              sd.LOCAL: {"mean": _phases(25, 50, 7), "slowest": _phases(28, 55, 8)},
                              "runtime": {"mean": _phases(36, 70, 7), "slowest": _phases(37, 72, 8)},
                              "loop": 121.0, "loop, local collectives": 95.0}}
    p = sd.parts(result)
    assert p["compute"] == (82.0, 75.0)              # compute + copies vs the stand-in runtime's mean
    assert p["spread"] == (3.0, 8.0)                 # modeled wait; slowest (83) less mean (75)
    assert p["collectives"] == (16.0, 26.0)          # comm + resharding + sync less copies; (37 + 72) - (28 + 55)
    assert p["optimizer"] == (9.0, 7.0)
    assert p["step"] == (110.0, 116.0)               # 37 + 72 + 7
    assert p["loop without collectives"] == (91.0, 95.0)    # compute + optimizer + copies; the local loop's step
    assert p["loop collectives"] == (19.0, 26.0)     # comm + resharding + sync + sync_wait less copies; 121 - 95
    assert p["loop step"] == (110.0, 121.0)


def test_loop_turns_without_a_moment_of_every_rank_stepping_are_counted_not_timed():
    nan = float("nan")
    samples = {"plain": [[1.0]], sd.LOOPS[0]: [[nan, nan], [2.0, 2.0]], sd.LOOPS[1]: [[3.0, 3.0]]}
    assert sd._drop_untimed_turns(samples, "m p") == {sd.LOOPS[0]: 1, sd.LOOPS[1]: 0}
    assert samples[sd.LOOPS[0]] == [[2.0, 2.0]]
    with pytest.raises(RuntimeError, match="m p: no 'loop' turn"):
        sd._drop_untimed_turns({"plain": [[1.0]], sd.LOOPS[0]: [[nan, nan]], sd.LOOPS[1]: [[1.0, 1.0]]}, "m p")
    results = [{"model": "cnn-12", "plan": "solved", "iters": 24, "untimed_loop_turns": {sd.LOOPS[1]: 3, sd.LOOPS[0]: 0}}]
    assert sd._untimed_cell(results) == "Untimed loop turns (of 24): cnn-12 solved loop, local collectives 3. "
    assert sd._untimed_cell([{**results[0], "untimed_loop_turns": {}}]) == ""


@pytest.fixture
def local_collectives():
    real = {name: getattr(dist, name) for name in sd.LocalCollectives.NAMES}
    local = sd.LocalCollectives()
    try:
        yield local
    finally:
        local.restore()
    assert {name: getattr(dist, name) for name in sd.LocalCollectives.NAMES} == real


def test_stand_in_collectives_fill_their_outputs_with_this_ranks_data_and_complete_at_once(local_collectives):
    local_collectives.on = True
    piece = torch.arange(3.0)
    gathered = torch.zeros(6)
    assert dist.all_gather_single(gathered, piece, group=None, async_op=True).wait() is True
    assert gathered.tolist() == [0.0, 1.0, 2.0, 0.0, 0.0, 0.0]       # this rank's piece in block 0
    scattered = torch.zeros(2)
    assert dist.reduce_scatter_single(scattered, torch.arange(4.0), group=None) is None
    assert scattered.tolist() == [0.0, 1.0]                          # block 0, unreduced
    exchanged = torch.zeros(2, 2)
    dist.all_to_all_single(exchanged, torch.ones(2, 2), async_op=True)
    assert exchanged.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    reduced = torch.full((2,), 5.0)
    assert dist.all_reduce(reduced, async_op=True).is_completed()
    assert reduced.tolist() == [5.0, 5.0]                            # a stand-in all-reduce leaves it


def test_stand_ins_off_go_through_to_torch(local_collectives):
    for call in (lambda: dist.all_reduce(torch.ones(1)),
                 lambda: dist.all_gather_single(torch.zeros(2), torch.ones(1))):
        with pytest.raises(ValueError, match="process group"):       # none initialised here
            call()
