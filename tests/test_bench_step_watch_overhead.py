"""The step-watch overhead bench's table: the ratio of the two modules' medians and the per-rank ranges
of the watch's own time, in milliseconds."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_watch_overhead as swo  # noqa: E402


def test_report_gives_with_over_without_and_the_ranks_ranges(monkeypatch):
    captured: dict = {}
    monkeypatch.setattr(swo, "write", lambda name, data, header, rows, note: captured.update(name=name, rows=rows))
    own = [{"before_forward": 1e-4, "backward_started": 2e-5, "reads": 0.1},
           {"before_forward": 3e-4, "backward_started": 5e-5, "reads": 0.2}]
    results = [{"model": "cnn-12:8x32", "plan": "replicated", "modeled_ms": 7.0,
                "median_ms": {"with watch": 6.3, "without": 6.0}, "times_s": {},
                "watch_own_per_step_per_rank": own}]
    swo.report(argparse.Namespace(hardware="cpu-gloo", rounds=2, steps=1), results, 12.0)
    assert captured["name"] == "step_watch_overhead"
    assert captured["rows"] == [["cnn-12:8x32", "replicated", "6.00", "6.30", "1.050x", "0.100-0.300", "0.020-0.050",
                                 "0.20"]]
