"""The step decomposition bench's arithmetic (modeled against measured parts) and its all-reduce skip."""
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
    result = {"modeled_ms": {"compute": 80.0, "reshard": 0.0, "bucket_copies": 2.0, "comm": 2.0,
                             "grad_sync": 12.0, "optimizer": 9.0, "sync_wait": 3.0, "total": 106.0},
              "measured_ms": {"plain": {"mean": _phases(20, 40, 7), "slowest": _phases(22, 44, 8)},
                              "runtime, no collectives": {"mean": _phases(25, 50, 7), "slowest": _phases(28, 55, 8)},
                              "runtime": {"mean": _phases(36, 70, 7), "slowest": _phases(37, 72, 8)}}}
    p = sd.parts(result)
    assert p["compute"] == (82.0, 75.0)              # compute + resharding + copies vs no-collective mean
    assert p["spread"] == (3.0, 8.0)                 # modeled wait; slowest (83) less mean (75)
    assert p["collectives"] == (12.0, 26.0)          # comm + sync less copies; (37 + 72) - (28 + 55)
    assert p["optimizer"] == (9.0, 7.0)
    assert p["step"] == (106.0, 116.0)               # 37 + 72 + 7


def test_the_all_reduce_skip_completes_at_once_and_restores_torch():
    real = dist.all_reduce
    skip = sd.SkippedAllReduce()
    try:
        assert dist.all_reduce is skip
        skip.on = True
        assert skip(object(), async_op=True).wait() is True
        assert skip(object()) is None
        skip.on = False
        with pytest.raises(ValueError, match="process group"):    # through to torch: none initialised here
            skip(torch.ones(1))
    finally:
        skip.restore()
    assert dist.all_reduce is real
