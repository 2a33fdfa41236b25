"""The replicated-plans bench's model specs and its table (a plan equal to the solved one is timed once)."""
import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import replicated_plans as rp  # noqa: E402


def test_model_specs_are_preset_batch_and_seq():
    assert rp.parse_model("gpt2-tiny:8x64") == ("gpt2-tiny", 8, 64)
    for bad in ("gpt2-tiny", "gpt2-tiny:8", "gpt2-tiny:ax64", ":8x64"):
        with pytest.raises(SystemExit, match="preset:BATCHxSEQ"):
            rp.parse_model(bad)


def _plan(total_ms: float, split_ops: int, ops: int = 57) -> dict:
    return {"modeled_ms": {"total": total_ms},
            "sharding": {"split_ops": split_ops, "ops": ops, "sharded_params": 0, "params": 42}}


def _timed(config: str, ms: float, loss: float, plan: dict | None = None) -> dict:
    r = {"model": "m:8x64", "config": config, "median_ms": ms, "min_ms": ms, "max_ms": ms, "n": 5,
         "step0_loss": loss}
    return {**r, "plan": plan} if plan else r


def test_report_uses_the_solved_plans_time_for_a_data_parallel_plan_equal_to_it(tmp_path, monkeypatch):
    monkeypatch.setattr(rp, "write", lambda name, data, header, rows, note: captured.update(rows=rows, data=data))
    captured: dict = {}
    results = [_timed("solved", 20.0, 7.5, _plan(13.0, 46)),
               {"model": "m:8x64", "config": "data_parallel", "same_as": "solved", "plan": _plan(13.0, 46)},
               _timed("torch DDP", 19.5, 7.5000005)]
    args = argparse.Namespace(models="m:8x64", hardware="cpu-gloo", rounds=3, steps=2, warmup=1)
    rp.report(args, results, 60.0)
    row = captured["rows"][0]
    assert row[:6] == ["m 8 x 64", "46 of 57 compute ops sharded", "13.0 / 13.0", "20.0",
                       "20.0 (same plan)", "19.5"]
    assert row[6:8] == ["1.03x", "yes"]                 # 20.0 / 19.5, within the target
    assert captured["data"]["summary"][0]["fastest"] == "torch DDP"


def test_a_replicated_plan_reads_as_such():
    assert rp._sharding(_plan(1.0, 0, 70)) == "none: replicated"
