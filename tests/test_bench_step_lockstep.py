"""The lockstep bench's table (plans in a fixed order, a plan equal to an earlier one named, the ratio of
the two timings) and its refusal of an odd number of passes (the two modes must alternate evenly)."""
import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_lockstep as sl  # noqa: E402


def test_report_orders_plans_and_gives_lockstep_over_back_to_back(monkeypatch):
    captured: dict = {}
    monkeypatch.setattr(sl, "write", lambda name, data, header, rows, note: captured.update(rows=rows))
    results = [{"model": "mlp-64", "plan": "solved", "modeled_ms": 10.0, "same_as": "replicated"},
               {"model": "mlp-64", "plan": "data_parallel", "modeled_ms": 20.0, "back to back": 21.0,
                "barrier per step": 23.1, "n": 9},
               {"model": "mlp-64", "plan": "replicated", "modeled_ms": 10.0, "back to back": 8.0,
                "barrier per step": 12.0, "n": 9}]
    sl.report(argparse.Namespace(hardware="cpu-gloo", passes=2, rounds=1, steps=1), results, 30.0)
    assert [r[1] for r in captured["rows"]] == ["replicated", "data_parallel", "solved"]
    assert captured["rows"][0][3:] == ["8.0", "12.0", "1.50x"]
    assert captured["rows"][2][3] == "same plan as replicated"


def test_an_odd_number_of_passes_is_refused():
    out = subprocess.run([sys.executable, str(Path(sl.__file__)), "--passes", "3"], capture_output=True, text=True)
    assert out.returncode != 0 and "--passes must be even" in out.stderr
