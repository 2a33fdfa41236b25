"""What the command line prints: plain text when asked or piped, help with defaults, a fingerprint
line that names what it covers."""
from __future__ import annotations

import re

import pytest

from autoshard import cli

BOX = set("━┃┏┓┗┛│─┡┩╇╈")


@pytest.mark.parametrize("argv", [["ops"], ["ops", "--plain"], ["capture", "mlp", "--plain"]],
                         ids=["ops-piped", "ops-plain", "capture-plain"])
def test_plain_output_has_no_colour_boxes_wrapping_or_padding(capsys, argv) -> None:
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out and not BOX & set(out), "colours or box drawing in plain output"
    assert not [line for line in out.splitlines() if line != line.rstrip()], "lines padded with spaces"
    assert "…" not in out, "a cell cut with an ellipsis"


def test_ops_lists_whole_op_names(capsys) -> None:
    assert cli.main(["ops"]) == 0
    assert "transformers.grouped_mm_fallback.default" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["ops", "capture", "enumerate", "plan", "explain"])
def test_every_command_takes_plain(capsys, command) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.build_parser().parse_args([command, "--help"])
    assert stop.value.code == 0
    assert "--plain" in capsys.readouterr().out


def test_help_shows_defaults_only_where_there_is_one(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, default in [("--hardware", "h100-nvlink"), ("--solver", "highs"), ("--fallback", "error"),
                            ("--time-limit", "60.0"), ("--outputs", "global")]:
        assert re.search(rf"{option} .*?\(default: {re.escape(default)}\)", text), f"{option}: no default shown"
    assert "(default: None)" not in text and "(default: False)" not in text


def test_every_option_of_every_command_has_help() -> None:
    import argparse

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}" for name, sub in commands.items()
               for action in sub._actions if not action.help]
    assert not missing, f"options with no help text: {missing}"


def test_capture_says_what_the_fingerprint_covers(capsys) -> None:
    assert cli.main(["capture", "mlp", "--batch", "4"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "fingerprint" in first and "(4," in first and "other input shapes" in first


def test_missing_handler_error_names_the_flag(tmp_path, capsys) -> None:
    """The library says fallback='replicate'; the command line names its own flag."""
    factory = tmp_path / "opaque.py"
    factory.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})\n"
        "import custom_ops_lib\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.randn(8, 8))\n\n"
        "    def forward(self, x):\n"
        "        return torch.ops.astest.opaque_scaled_mm(x, self.w, 2.0).sum()\n\n"
        "def factory():\n"
        "    return Net(), (torch.randn(4, 8),)\n")
    assert cli.main(["enumerate", f"{factory}:factory", "--mesh", "2x2"]) == 2
    err = capsys.readouterr().err
    assert "no sharding handler for astest.opaque_scaled_mm" in err, err
    assert "--fallback replicate" in err and "fallback='replicate'" not in err, err
