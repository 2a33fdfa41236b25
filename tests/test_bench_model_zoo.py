"""The model zoo bench's state comparison: rounding is allowed relative to how far training moved an element."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import model_zoo as mz  # noqa: E402


def test_an_element_that_moved_far_may_carry_its_updates_rounding():
    initial = torch.tensor([5.0, 0.5])
    want = torch.tensor([-0.0323, 0.5])            # the first moved by 5, the second not at all
    got = want + torch.tensor([1.4e-6, 0.0])       # rounding of the updates: ~3e-7 of the distance moved
    mz.assert_state_close("sgd w", got, want, initial, mz.ATOL)


def test_a_wrong_value_fails_and_says_where():
    initial = torch.zeros(2, 3)
    want = torch.full((2, 3), 0.1)
    got = want.clone()
    got[1, 2] += 1e-4                              # 10x what a move of 0.1 allows
    with pytest.raises(AssertionError, match=r"sgd w: 1 of 6 elements differ; worst at \(1, 2\)"):
        mz.assert_state_close("sgd w", got, want, initial, mz.ATOL)


def test_an_element_that_did_not_move_keeps_the_tolerance_of_its_value():
    initial = want = torch.tensor([0.03])
    with pytest.raises(AssertionError):
        mz.assert_state_close("sgd b", want + 2e-6, want, initial, mz.ATOL)     # allowed 1e-6 + 3e-7
