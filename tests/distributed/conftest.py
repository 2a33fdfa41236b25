"""The distributed suite runs inside ONE torchrun launch: every rank runs pytest on these files.

The process group (gloo) is created once per session; tests build the meshes they need.
Run: OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 --standalone -m pytest tests/distributed -q

Output comes from rank 0 only. Ranks 1-3 write their pytest output to ``rank<N>.log`` in the log
folder (``$AUTOSHARD_DIST_LOG_DIR``, else a folder under the temp dir named after the torchrun run)
and, at the end of the session, ``rank<N>.report.json``: their exit status and failing tests with
tracebacks. Rank 0 waits for those reports (with a timeout: a rank that crashed writes none) and
prints, after its own summary, which ranks failed, their failing test ids and tracebacks, and the
log of a rank that sent no report. A failure on any rank fails that rank's pytest, hence torchrun's
exit status; rank 0 also exits non-zero when another rank failed.
"""
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))   # op_cases, runtime_harness
sys.path.insert(1, os.path.dirname(os.path.dirname(__file__)))   # handler_utils

REPORT_WAIT_S = float(os.environ.get("AUTOSHARD_DIST_REPORT_WAIT_S", "300"))
COLLECTIVE_TIMEOUT_S = 300
_TRACEBACK_LINES = 60       # per failing test, in rank 0's report of another rank's failures
_LOG_TAIL_LINES = 80        # of a rank that sent no report

_failures: list[dict] = []  # this rank's failing test reports (nodeid, phase, traceback)


def log_dir() -> Path:
    """Where ranks other than 0 write their output and reports (created if missing)."""
    path = os.environ.get("AUTOSHARD_DIST_LOG_DIR") or os.path.join(
        tempfile.gettempdir(), f"autoshard-distributed-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def _report_path(rank: int) -> Path:
    return log_dir() / f"rank{rank}.report.json"


def _printed_path() -> Path:
    """Written by rank 0 once it has printed every rank's report: the others exit only after it (a
    rank that exits with a failure makes torchrun kill the rest, rank 0 mid-report included)."""
    return log_dir() / "rank0.printed"


@pytest.hookimpl(trylast=True)   # after the terminal reporter is made (see _quiet_other_ranks)
def pytest_configure(config):
    if "RANK" not in os.environ:
        raise pytest.UsageError("tests/distributed must run under torchrun --nproc_per_node=4 "
                                "(see scripts/test.sh)")
    rank = int(os.environ["RANK"])
    _report_path(rank).unlink(missing_ok=True)   # a stale report of an earlier run in the same folder
    if rank == 0:
        _printed_path().unlink(missing_ok=True)
    if not dist.is_initialized():    # a rendezvous: every rank has removed its stale report after it
        # a collective waits this long for the slowest rank: with cold inductor caches a compiled
        # test's first graph builds C++ kernels for minutes on 2 cores while the other ranks wait
        # (one such wait passed 120 s)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    if dist.get_world_size() != 4:
        raise pytest.UsageError(f"the distributed suite needs 4 ranks, got {dist.get_world_size()}")
    _quiet_other_ranks(config)


def _quiet_other_ranks(config) -> None:
    """Ranks other than 0: the terminal reporter writes to ``rank<N>.log`` instead of the terminal."""
    rank = int(os.environ["RANK"])
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if rank == 0 or reporter is None:
        return
    from _pytest._io import TerminalWriter

    log = open(log_dir() / f"rank{rank}.log", "w", buffering=1)
    config._autoshard_rank_log = log
    reporter._tw = TerminalWriter(log)
    reporter._tw.hasmarkup = False


def pytest_runtest_logreport(report):
    if report.failed:
        _failures.append({"test": report.nodeid, "phase": report.when, "traceback": report.longreprtext})


def pytest_sessionfinish(session, exitstatus):
    """Ranks other than 0 report to rank 0 (a file: no collective, so a rank that died cannot hang
    the others here); rank 0 fails when another rank failed."""
    rank = int(os.environ["RANK"])
    if rank != 0:
        tmp = _report_path(rank).with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": rank, "exitstatus": int(exitstatus), "failures": _failures}))
        tmp.replace(_report_path(rank))           # atomic: rank 0 never reads half a report
        return
    session.config._autoshard_others = others = _collect_reports(int(os.environ.get("WORLD_SIZE", "4")))
    if any(r is None or r["exitstatus"] not in (0, 5) for r in others.values()) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _collect_reports(world: int) -> dict[int, dict | None]:
    """Rank -> its report, or None if none came within REPORT_WAIT_S."""
    deadline = time.monotonic() + REPORT_WAIT_S
    reports: dict[int, dict | None] = {}
    pending = set(range(1, world))
    while pending:
        for r in sorted(pending):
            if _report_path(r).exists():
                reports[r] = json.loads(_report_path(r).read_text())
                pending.discard(r)
        if pending and time.monotonic() > deadline:
            reports.update({r: None for r in pending})
            break
        if pending:
            time.sleep(0.2)
    return reports


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    others = getattr(config, "_autoshard_others", None)
    if others is None:       # not rank 0
        return
    tr = terminalreporter
    bad = {r: rep for r, rep in sorted(others.items()) if rep is None or rep["exitstatus"] not in (0, 5)}
    if not bad:
        tr.write_line(f"ranks 1-{len(others)}: same result, no failures (their output: {log_dir()}/rank<N>.log)")
        return
    tr.write_sep("=", f"FAILED on rank(s) {', '.join(map(str, bad))}", red=True)
    for r, rep in bad.items():
        log = log_dir() / f"rank{r}.log"
        if rep is None:
            tr.write_line(f"rank {r}: no report within {REPORT_WAIT_S:.0f} s (crashed or hung); "
                          f"the end of its log {log}:")
            lines = log.read_text(errors="replace").splitlines() if log.exists() else ["(no log)"]
            for line in lines[-_LOG_TAIL_LINES:]:
                tr.write_line(f"  [rank {r}] {line}")
            continue
        tr.write_line(f"rank {r}: pytest exit status {rep['exitstatus']}, {len(rep['failures'])} failing "
                      f"test report(s) (whole output: {log})")
        for f in rep["failures"]:
            tr.write_sep("_", f"rank {r}: {f['test']} ({f['phase']})")
            lines = f["traceback"].splitlines()
            if len(lines) > _TRACEBACK_LINES:
                lines = [f"... ({len(lines) - _TRACEBACK_LINES} lines above, see {log})"] + lines[-_TRACEBACK_LINES:]
            for line in lines:
                tr.write_line(line)
    tr.write_sep("=", f"FAILED on rank(s) {', '.join(map(str, bad))}: {', '.join(sorted({f['test'] for rep in bad.values() if rep for f in rep['failures']})) or 'see above'}", red=True)


def pytest_unconfigure(config):
    if int(os.environ["RANK"]) == 0:
        _printed_path().write_text("done")
    else:
        deadline = time.monotonic() + REPORT_WAIT_S + 60
        while not _printed_path().exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    log = getattr(config, "_autoshard_rank_log", None)
    if log is not None:
        log.close()


@pytest.fixture(scope="session")
def rank() -> int:
    return dist.get_rank()
