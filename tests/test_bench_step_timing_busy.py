"""bench/runtime_speed.py ``busy_step``: the job's step from every rank's step ends, measured only
while every rank was stepping."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from runtime_speed import busy_step  # noqa: E402


def test_ranks_in_step_give_their_step():
    moments = [[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]
    assert busy_step(moments) == pytest.approx(1.0)


def test_a_rank_without_a_core_is_made_up_by_the_others_not_timed_by_its_own_clock():
    # two ranks on one core's worth of work each 1 s a step when they share: rank 1 waits 2 s
    # without the core while rank 0 runs alone at 0.5 s a step, then they share again
    rank0 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    rank1 = [0.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    # window 0 .. 4 s: rank 0 made 6 steps, rank 1 made 2: a mean of 4 steps in 4 s
    assert busy_step([rank0, rank1]) == pytest.approx(1.0)


def test_the_last_ranks_steps_after_the_first_rank_stopped_are_not_timed():
    # rank 1 runs on alone (0.5 s a step) once rank 0 has stopped at 3 s: only 0 .. 3 s counts
    rank0 = [0.0, 1.0, 2.0, 3.0]
    rank1 = [0.0, 1.0, 2.0, 2.5, 3.0, 3.5]
    assert busy_step([rank0, rank1]) == pytest.approx(3.0 / 3.5)


def test_fractions_of_a_step_count_by_interpolation():
    rank0 = [0.0, 2.0, 4.0]
    rank1 = [1.0, 2.0, 3.0, 5.0]      # starts 1 s late; at 4 s half through its third step
    # window 1 .. 4 s: rank 0 made 1.5 steps, rank 1 made 2.5
    assert busy_step([rank0, rank1]) == pytest.approx(3.0 / 2.0)


def test_no_moment_with_every_rank_stepping_is_no_measurement():
    assert busy_step([[0.0, 1.0, 2.0], [2.5, 3.0, 4.0]]) is None
