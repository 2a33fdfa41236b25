"""The benches' back-to-back step timing (bench/runtime_speed.py ``_loop_turn``) gives the job's step
while every rank is stepping: ranks held together by a collective each step run at the slowest
rank's pace, and the settle steps are timed from the first rank's leave of the barrier to the last
rank's end."""
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from runtime_speed import _loop_turn  # noqa: E402

SLOW = 0.04     # seconds the last rank spends in each step; the others spend none


def test_a_turn_held_together_by_a_collective_is_timed_at_the_slowest_ranks_pace():
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = SimpleNamespace(times=[], settle_times=[], phases=[], unmeasured_turns=0)
    token = torch.zeros(1)

    def step() -> None:
        cfg.phases.append({})
        if rank == world - 1:
            time.sleep(SLOW)
        dist.all_reduce(token)

    cfg.step = step
    _loop_turn(cfg, dist.barrier, settle=1, steps=3)
    assert len(cfg.settle_times) == 1 and len(cfg.times) == 1 and len(cfg.phases) == 3
    assert cfg.settle_times[0] >= 0.9 * SLOW, (rank, cfg.settle_times)
    assert 0.9 * SLOW <= cfg.times[0] < 2 * SLOW, (rank, cfg.times)
    assert cfg.unmeasured_turns == 0
