"""Progress of long stages (autoshard.progress): plain start/end lines with elapsed seconds when
stderr is not a terminal (logs, pipes, CI), a spinner and one line per stage on a terminal; what the
command line and ``autoshard.plan(..., progress=True)`` print on stderr."""
from __future__ import annotations

import io
import re

import pytest

from autoshard import cli
from autoshard.progress import Progress


def _stage_lines(err: str, message: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"autoshard: {message}")]


def _assert_stage(err: str, message: str) -> None:
    lines = _stage_lines(err, message)
    assert len(lines) == 2, f"{message!r}: expected a start and an end line, got {lines}\n{err}"
    assert lines[0] == f"autoshard: {message} ...", lines
    assert re.fullmatch(rf"autoshard: {re.escape(message)}: done in \d+\.\d\d s", lines[1]), lines


def test_plan_command_logs_every_stage_as_plain_lines(capsys, tmp_path) -> None:
    """stderr captured (not a terminal): one line when each stage starts, one with its seconds when it
    ends, in order; no spinner frames, carriage returns or colour codes; stdout keeps the plan."""
    out_file = tmp_path / "plan.json"
    assert cli.main(["plan", "mlp", "--mesh", "2x2", "--hardware", "cpu-gloo", "--out", str(out_file)]) == 0
    captured = capsys.readouterr()
    err = captured.err
    for message in ("capturing mlp on meta tensors", "enumerating strategies on mesh 2x2",
                    "building the cost graph"):
        _assert_stage(err, message)
    solve = [line for line in err.splitlines() if line.startswith("autoshard: solving the ILP (highs")]
    assert len(solve) == 2 and solve[0].endswith(" ...") and re.search(r": done in \d+\.\d\d s$", solve[1]), err
    starts = [line for line in err.splitlines() if line.startswith("autoshard: ") and line.endswith(" ...")]
    assert [s.split(" ")[1] for s in starts] == ["capturing", "enumerating", "building", "solving"], starts
    assert "\r" not in err and "\x1b[" not in err, "spinner frames or colour codes in a log"
    assert "autoshard:" not in captured.out and "autoshard plan for mlp" in captured.out


def test_enumerate_and_capture_commands_log_their_stages(capsys) -> None:
    assert cli.main(["enumerate", "mlp", "--mesh", "2x2"]) == 0
    err = capsys.readouterr().err
    _assert_stage(err, "capturing mlp on meta tensors")
    _assert_stage(err, "enumerating strategies on mesh 2x2")
    assert cli.main(["capture", "mlp"]) == 0
    _assert_stage(capsys.readouterr().err, "capturing mlp on meta tensors")


def test_library_plan_progress_and_silence(capsys) -> None:
    import autoshard
    from autoshard.models import build_model

    model, args, kwargs = build_model("mlp", device="meta")
    autoshard.plan(model, args, kwargs, mesh=(2, 2), hardware="cpu-gloo", progress=True)
    err = capsys.readouterr().err
    _assert_stage(err, "capturing MLP on meta tensors")       # no name= given: the module's class
    _assert_stage(err, "building the cost graph")
    autoshard.plan(model, args, kwargs, mesh=(2, 2), hardware="cpu-gloo")
    assert "autoshard:" not in capsys.readouterr().err, "progress=False (the default) prints nothing"


def test_failed_stage_says_so_and_times_every_stage() -> None:
    stream = io.StringIO()
    progress = Progress(stream=stream)
    with progress.stage("first", "a"):
        pass
    with pytest.raises(ValueError):
        with progress.stage("second", "b"):
            raise ValueError("boom")
    lines = stream.getvalue().splitlines()
    assert lines[:2] == ["autoshard: first ...", lines[1]] and lines[1].startswith("autoshard: first: done in ")
    assert lines[2] == "autoshard: second ..." and re.fullmatch(
        r"autoshard: second: failed after \d+\.\d\d s \(ValueError\)", lines[3]), lines
    assert set(progress.seconds) == {"a", "b"}
    silent = io.StringIO()
    quiet = Progress(enabled=False, stream=silent)
    with quiet.stage("third"):
        pass
    assert silent.getvalue() == "" and "third" in quiet.seconds


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_line_per_stage_after_the_spinner() -> None:
    stream = _Terminal()
    with Progress(stream=stream).stage("solving"):
        pass
    text = stream.getvalue()
    assert "autoshard: solving ..." not in text, "the start line is the spinner's on a terminal"
    assert re.search(r"autoshard: solving: done in \d+\.\d\d s\n$", text), text
