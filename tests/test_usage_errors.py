"""Click's own usage errors are one ``pbstk: error:`` line and exit 2, as README and docs/status.md promise for
bad input (issue 44 item 3). Before, a missing argument, an unknown command or option and a bad choice printed
Click's three-line ``Usage:`` / ``Try`` / ``Error:`` block."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from pbs_toolkit.cli.main import cli

CASES = {
    "missing argument": (["launch"], "Missing argument 'MODEL'", "pbstk launch --help"),
    "unknown command": (["lanch", "M"], "No such command 'lanch'", "pbstk --help"),
    "unknown option": (["status", "--bogus"], "No such option '--bogus'", "pbstk status --help"),
    "unknown option of pbstk": (["--bogus", "status"], "No such option '--bogus'", "pbstk --help"),
    "bad choice": (["launch", "M", "--scheduler", "nope"], "'nope' is not one of", "pbstk launch --help"),
    "extra argument": (["wait", "a", "b"], "unexpected extra argument", "pbstk wait --help"),
    "nested command": (["ssh", "close", "--bogus"], "No such option '--bogus'", "pbstk ssh close --help"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_usage_error_is_one_error_line_and_exit_2(case: str) -> None:
    args, words, hint = CASES[case]
    result = CliRunner().invoke(cli, args, prog_name="pbstk")
    assert result.exit_code == 2, (args, result.output)
    assert result.stdout == "", result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pbstk: error: ") and words in lines[0], lines[0]
    assert lines[0].endswith(f"Try '{hint}'."), lines[0]


def test_the_installed_command_prints_one_line_and_no_traceback() -> None:
    done = subprocess.run([sys.executable, "-m", "pbs_toolkit", "launch"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == "pbstk: error: Missing argument 'MODEL'. Try 'pbstk launch --help'.\n"


def test_a_group_called_with_nothing_still_shows_its_help() -> None:
    result = CliRunner().invoke(cli, ["ssh"], prog_name="pbstk")
    assert "Usage: pbstk ssh" in result.output and "pbstk: error:" not in result.output
