"""Every command and code snippet of README.md is run by a test as written, so the README cannot
drift from the code (tests/readme_commands.py extracts them and says how each is covered):

- the ```bash block's ``autoshard`` commands run in order in a fresh folder, through
  ``autoshard.cli.main`` (what the ``autoshard`` console script calls; scripts/demo.sh runs the
  console script), optional ``[--flag]`` placeholders expanded to every combination; a
  command that reads a file an earlier one writes (``explain plan.json``) runs after it;
- the ```python snippets of "Using it as a library" run in-process in a fresh folder; the two of
  "Training with a plan" need torchrun and run on 4 gloo ranks in the distributed suite
  (tests/distributed/test_readme_snippets.py, their undefined names - model, example_batch, data,
  net, example_x - bound by small models there);
- ``python bench/op_coverage.py`` and ``python bench/update_readme.py`` run as written in a copy of
  bench/ (they write bench/results/ and README.md): op_coverage's table must equal the committed
  one, and update_readme must leave the README unchanged (its tables equal bench/results/);
- the timing benchmarks (the other ``python bench/*.py``: 20 s to 20 minutes each, and timings on a
  shared CI machine would say nothing) are NOT run: each is checked only to accept its exact
  arguments (its ``argparse`` parses them; the script is stopped there), in one subprocess;
- ``scripts/demo.sh`` and ``scripts/test.sh`` are excluded by name (CI runs test.sh, the demo is
  itself) and must stay in the README; the ``autoshard.profile`` command (minutes on 4 ranks) is
  the demo's own first command, checked to appear in scripts/demo.sh as written.

A README command or snippet that is not classified in tests/readme_commands.py fails
test_every_command_and_snippet_is_classified.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import readme_commands as rc
from autoshard import cli

ROOT = rc.ROOT


def test_every_command_and_snippet_is_classified() -> None:
    commands = rc.all_commands()
    unclassified = [c for c in commands if c not in rc.COMMANDS]
    assert not unclassified, (f"README commands not classified in tests/readme_commands.py COMMANDS (run "
                              f"as written, demo/CI, or for a slow benchmark argument-checked): {unclassified}")
    stale = [c for c in rc.COMMANDS if c not in commands]
    assert not stale, f"classified commands the README no longer has: {stale}"
    keys = [s.key for s in rc.snippets()]
    assert len(keys) == len(set(keys)), f"two python snippets start alike: {keys}"
    unclassified = [k for k in keys if k not in rc.SNIPPETS]
    assert not unclassified, f"README python snippets not classified in SNIPPETS: {unclassified}"
    assert not [k for k in rc.SNIPPETS if k not in keys], "classified snippets the README no longer has"
    assert set(rc.COMMANDS.values()) <= {rc.RUN, rc.DEMO_RUNS, rc.SETUP, rc.ARGS}
    assert set(rc.SNIPPETS.values()) <= {rc.RUN, rc.RUN_DISTRIBUTED}
    if any(how == rc.RUN_DISTRIBUTED for how in rc.SNIPPETS.values()):
        assert (ROOT / "tests" / "distributed" / "test_readme_snippets.py").is_file()


def test_classification_finds_what_it_should() -> None:
    """The extraction itself: a new bash line, inline benchmark command or snippet is picked up."""
    text = ("```bash\nautoshard ops   # list\n    # a comment line\nscripts/x.sh\n```\n"
            "Run `python bench/a.py && python bench/b.py --quick`, see `autoshard plan --outputs local`.\n"
            "```python\nimport torch\nfrom x import y\nz = 1   # note\n```\n")
    assert rc.bash_commands(text) == ["autoshard ops", "scripts/x.sh"]
    assert rc.inline_commands(text) == ["python bench/a.py", "python bench/b.py --quick"]
    assert rc.inline_references(text) == ["autoshard plan --outputs local"]
    assert [s.key for s in rc.snippets(text)] == ["z = 1"]


def test_setup_commands_stay_in_the_readme_and_are_the_only_ones_excluded() -> None:
    bash = rc.bash_commands()
    for command in rc.SETUP_COMMANDS:
        assert command in bash, f"{command} is no longer in the README's quick start"
    assert {c for c, how in rc.COMMANDS.items() if how == rc.SETUP} == set(rc.SETUP_COMMANDS)


def test_demo_runs_the_readme_commands_it_covers() -> None:
    covered = [c for c, how in rc.COMMANDS.items() if how == rc.DEMO_RUNS]
    missing = [c for c in covered if not rc.demo_runs(c)]
    assert not missing, f"scripts/demo.sh does not run these README commands as written: {missing}"


def test_inline_autoshard_references_name_real_commands_and_flags() -> None:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for ref in rc.inline_references():
        words = ref.split()
        assert words[1] in commands, f"README mentions `{ref}`: there is no command {words[1]!r}"
        options = {s: a for a in commands[words[1]]._actions for s in a.option_strings}
        for i, word in enumerate(words):
            if word.startswith("--"):
                assert word in options, f"README mentions `{ref}`: {words[1]} has no option {word}"
                choices = options[word].choices
                if choices and i + 1 < len(words):
                    assert words[i + 1] in choices, f"`{ref}`: {word} takes one of {choices}"


# -- the command-line block --------------------------------------------------------------------------

def _cli_commands() -> list[str]:
    return [c for c in rc.bash_commands() if rc.COMMANDS.get(c) == rc.RUN]


def _writes(command: str) -> set[str]:
    words = shlex.split(command)
    return {words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--out", "--json")}


def _chains() -> list[list[str]]:
    """The block's commands, each with the earlier ones that write a file it reads (run first);
    a command another one needs runs inside that one's chain only."""
    commands = _cli_commands()
    needs = {c: [p for p in commands[:i] if _writes(p) & set(shlex.split(c))] for i, c in enumerate(commands)}
    needed = {p for ps in needs.values() for p in ps}
    return [needs[c] + [c] for c in commands if c not in needed]


@pytest.mark.parametrize("chain", _chains(), ids=lambda chain: chain[-1].split(" [")[0][:60])
def test_command_line_block_runs_as_written(chain, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    for command in chain:
        for expanded in rc.expansions(command):
            argv = shlex.split(expanded)
            assert argv[0] == "autoshard", expanded
            status = cli.main(argv[1:])
            captured = capsys.readouterr()
            assert status == 0, f"`{expanded}` exited {status}: {captured.err[-2000:]}"
            assert captured.out.strip(), f"`{expanded}` printed nothing"
        for path in _writes(command):
            assert (tmp_path / path).is_file(), f"`{command}` did not write {path}"


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


# -- python snippets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key", [k for k, how in rc.SNIPPETS.items() if how == rc.RUN])
def test_library_snippet_runs_as_written(key, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code = rc.snippet(key).code
    exec(compile(code, f"README.md snippet {key!r}", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip(), "the snippet prints what it shows"


# -- benchmarks --------------------------------------------------------------------------------------

def _bench_copy(tmp_path: Path) -> Path:
    """A copy of bench/ and README.md laid out as in the repository (benchmarks write into bench/results/
    and update_readme into README.md next to them)."""
    shutil.copytree(ROOT / "bench", tmp_path / "bench", ignore=shutil.ignore_patterns("__pycache__", "*.png"))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[0] == "python", command
    done = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=_env())
    assert done.returncode == 0, f"`{command}` exited {done.returncode}: {done.stderr[-3000:]}"
    return done


def test_op_coverage_runs_as_written_and_gives_the_committed_table(tmp_path) -> None:
    copy = _bench_copy(tmp_path)
    (copy / "bench" / "results" / "op_coverage.md").unlink()
    _run("python bench/op_coverage.py", copy)
    made = (copy / "bench" / "results" / "op_coverage.md").read_text()
    assert made == (ROOT / "bench" / "results" / "op_coverage.md").read_text(), \
        "the op coverage table changed: run `python bench/op_coverage.py && python bench/update_readme.py`"


def test_gpu_compute_report_runs_as_written_and_gives_the_committed_table(tmp_path) -> None:
    """The GPU table is reproducible without a GPU: the report re-prices the committed measurements."""
    command = next(c for c in rc.COMMANDS if c.startswith("python bench/gpu_op_compute.py report"))
    copy = _bench_copy(tmp_path)
    (copy / "bench" / "results" / "gpu_op_compute.md").unlink()
    _run(command, copy)
    made = (copy / "bench" / "results" / "gpu_op_compute.md").read_text()
    assert made == (ROOT / "bench" / "results" / "gpu_op_compute.md").read_text(), \
        f"the GPU compute table changed: run `{command} && python bench/update_readme.py`"


def test_update_readme_runs_as_written_and_changes_nothing(tmp_path) -> None:
    copy = _bench_copy(tmp_path)
    _run("python bench/update_readme.py", copy)
    assert (copy / "README.md").read_text() == rc.readme_text(), \
        "README.md's benchmark tables differ from bench/results/: run `python bench/update_readme.py`"


_ARGCHECK = r"""
import argparse, json, runpy, sys
from pathlib import Path

class Accepted(BaseException):
    pass

parse_args = argparse.ArgumentParser.parse_args

def parse_then_stop(self, args=None, namespace=None):
    parse_args(self, args, namespace)       # exits 2 on arguments the script does not take
    raise Accepted

argparse.ArgumentParser.parse_args = parse_then_stop
results = {}
for command in json.loads(sys.argv[1]):
    script, *args = command.split()[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
        results[command] = "ran to the end without parsing arguments"
    except Accepted:
        results[command] = "accepted"
    except SystemExit as e:
        results[command] = f"argparse refused the arguments (exit {e.code})"
    finally:
        sys.path.pop(0)
print(json.dumps(results))
"""


def test_slow_benchmarks_accept_their_exact_arguments() -> None:
    """Argument check only (see the module docstring): each script's argparse parses the README's exact
    arguments and the script is stopped there, nothing measured."""
    commands = [c for c, how in rc.COMMANDS.items() if how == rc.ARGS]
    for command in commands:
        assert command.startswith("python bench/") and (ROOT / command.split()[1]).is_file(), command
        assert "argparse" in (ROOT / command.split()[1]).read_text(), \
            f"{command}: the script takes no argparse options, so its arguments cannot be checked without running it"
    done = subprocess.run([sys.executable, "-c", _ARGCHECK, json.dumps(commands)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    refused = {c: r for c, r in results.items() if r != "accepted"}
    assert not refused and set(results) == set(commands), refused
