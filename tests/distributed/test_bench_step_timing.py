"""The benches' back-to-back step timing (bench/runtime_speed.py ``_loop_turn``) gives every rank the
job's step: from the moment the last rank ended the step before to the moment the last rank ends
this one, not the rank's own clock (on which a plan whose ranks never wait for each other can be
timed faster than the job runs)."""
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from runtime_speed import _loop_turn  # noqa: E402

SLOW = 0.04     # seconds the last rank spends in each step; the others spend none


def test_a_turns_steps_are_timed_on_the_last_rank_to_end_them():
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = SimpleNamespace(times=[], settle_times=[], phases=[])

    def step() -> None:
        cfg.phases.append({})
        if rank == world - 1:
            time.sleep(SLOW)

    cfg.step = step
    _loop_turn(cfg, dist.barrier, settle=1, steps=3)
    assert len(cfg.settle_times) == 1 and len(cfg.times) == 3 and len(cfg.phases) == 3
    assert min(cfg.settle_times + cfg.times) >= 0.9 * SLOW, (rank, cfg.settle_times, cfg.times)
    assert sum(cfg.settle_times + cfg.times) < 4 * SLOW + 0.5
