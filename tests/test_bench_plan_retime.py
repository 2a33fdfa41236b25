"""The retime bench's comparison of a fidelity run with its plans timed again, and its refusals."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import plan_retime as pr  # noqa: E402


def _plan(modeled_s: float, then_ms: float, now_ms: float, modeled_now_s: float | None = None) -> dict:
    return {"modeled_s": modeled_now_s or modeled_s, "modeled_then_s": modeled_s,
            "measured_then_ms": then_ms, "measured_ms": now_ms}


def _model(**plans: dict) -> dict:
    return {"plans": plans, "ddp_ms": 40.0, "ddp_then_ms": 50.0}


def test_errors_then_and_now_are_over_the_same_plans_priced_as_in_the_run():
    m = _model(data_parallel=_plan(0.036, 50.0, 36.0), replicated=_plan(0.055, 78.0, 57.0),
               recompute=_plan(0.050, 75.0, 55.0), skipped={"modeled_s": 0.1, "modeled_then_s": 0.1,
                                                           "measured_then_ms": 90.0, "error": "run failed"})
    c = pr.compare(m)
    assert c["plans"] == 3 and c["same_models"]
    rho_then, median_then, worst_then = c["then"]
    rho_now, median_now, worst_now = c["now"]
    assert median_then == pytest.approx((78 - 55) / 78)               # errors 0.28, 0.295, 0.333
    assert worst_then == pytest.approx((75 - 50) / 75)
    assert median_now == pytest.approx((57 - 55) / 57)                 # errors 0, 0.035, 0.091
    assert worst_now == pytest.approx((55 - 50) / 55)
    assert rho_then == pytest.approx(1.0) and rho_now == pytest.approx(1.0)
    assert c["dp_over_ddp_then"] == pytest.approx(1.0) and c["dp_over_ddp_now"] == pytest.approx(0.9)


def test_a_plan_that_models_otherwise_now_is_reported():
    m = _model(data_parallel=_plan(0.036, 50.0, 36.0), replicated=_plan(0.055, 78.0, 57.0, modeled_now_s=0.06))
    assert not pr.compare(m)["same_models"]


def test_a_run_or_model_that_is_not_there_is_refused_before_any_launch(tmp_path, monkeypatch):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "bench" / "plan_retime.py"), *args],
                              capture_output=True, text=True, timeout=120)

    missing = run("--from-run", "no_such_fidelity_run")
    assert missing.returncode != 0 and "name a finished bench/plan_fidelity.py run" in missing.stderr
    runs = sorted(p.stem for p in (ROOT / "bench" / "results").glob("plan_fidelity*.json")
                  if (ROOT / "bench" / "results" / f"{p.stem}-profile.yaml").exists())
    assert runs, "no committed fidelity run with its profile"
    models = [m["model"] for m in json.loads((ROOT / "bench" / "results" / f"{runs[-1]}.json").read_text())["models"]]
    wrong = run("--from-run", runs[-1], "--models", "gpt2-7:1x1")
    assert wrong.returncode != 0 and "gpt2-7:1x1: not in" in wrong.stderr and models[0] in wrong.stderr
