"""Error lines stay one line (issue 21, item 22): a user value with a newline is shown escaped, ``--replicas``
does not advertise a million, ``env`` on an ended job does not suggest waiting, and ``cancel --all`` exists."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import MODEL, pbstk, status_of, wait_for

from pbs_toolkit.cli.main import one_line

NL = "a\nb\rc"


def assert_one_error_line(args: list[str]) -> str:
    result = pbstk(*args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
    assert result.exit_code not in (0, 1), (args, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: "), (args, result.stderr)
    assert "Traceback" not in result.output
    return lines[0]


FUZZED = [
    ["launch", MODEL, "--dry-run", "--api-key-env", NL],  # printed the name raw before
    ["launch", MODEL, "--dry-run", "--queue", NL],
    ["render", MODEL, "--account", NL],
    ["render", MODEL, "--walltime", NL],
    ["render", MODEL, "--preset", NL],
    ["render", MODEL, "--profile", NL],
    ["render", MODEL, "--venv", NL],
    ["render", MODEL, "--hf-home", NL],
    ["render", MODEL, "--runs-root", NL],
    ["render", MODEL, "--vllm-version", NL],
    ["render", MODEL, "--served-model-name", NL],
    ["render", MODEL, "--env", NL],
    ["render", MODEL, "--port", NL],
    ["render", MODEL, "--nodes", NL],
    ["render", MODEL, "--vllm-arg", NL],
    ["render", MODEL, "--output", NL],
    ["render", NL],
    ["serve", MODEL, "--name", NL],
    ["serve", MODEL, "--replicas", NL],
    ["presets", "show", NL],
    ["profiles", "show", NL],
    ["config", "show", "--profile", NL],
]


@pytest.mark.parametrize("args", FUZZED, ids=lambda a: " ".join(a[:1] + a[2:3]).replace("\n", "_"))
def test_newlines_in_values_give_one_error_line(args: list[str]) -> None:
    line = assert_one_error_line(args)
    assert "\r" not in line


def test_newlines_in_job_references_give_one_error_line(fakepbs: Path, standins: Path) -> None:
    job = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto",
                "--name", "one").stdout.split()[1]
    for command in ("status", "logs", "cancel", "env", "wait", "doctor", "metrics", "tunnel", "update-endpoint"):
        assert_one_error_line([command, f"{job}\n{job}"])
    pbstk("cancel", job)


def test_the_boundary_escapes_control_characters() -> None:
    assert one_line("plain text, é ok") == "plain text, é ok"
    assert one_line("bad queue a\nb\r\x1b[31m\t") == "bad queue a\\nb\\r\\x1b[31m\\t"


def test_replicas_errors_name_no_million() -> None:
    for value, needle in (("x", "not a whole number of replicas"), ("2.5", "not a whole number"),
                          ("0", "at least 1 replica"), ("5000", "at most 1000 replicas")):
        line = assert_one_error_line(["serve", MODEL, "--replicas", value])
        assert needle in line and "1000000" not in line, line


def test_env_on_an_ended_job_does_not_suggest_waiting(fakepbs: Path, standins: Path) -> None:
    job = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto",
                "--name", "gone", "--wait", "--timeout", "30").stdout.split()[1]
    assert pbstk("cancel", job).exit_code == 0
    wait_for(lambda: status_of(job)["state"] == "CANCELLED", timeout=30, what="CANCELLED")
    line = assert_one_error_line(["env", job])
    assert "CANCELLED, not READY" in line and "wait" not in line and "pbstk launch" in line, line


def test_cancel_all_stops_every_active_job_and_says_which(fakepbs: Path, standins: Path) -> None:
    assert pbstk("cancel").exit_code == 2  # neither JOB nor --all
    ids = [pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto",
                 "--name", name).stdout.split()[1] for name in ("first", "second")]
    assert_one_error_line(["cancel", ids[0], "--all"])
    result = pbstk("cancel", "--all")
    assert result.exit_code == 0, result.output
    assert sorted(result.stdout.splitlines()) == sorted(f"{j}: cancelled" for j in ids)
    for job in ids:
        wait_for(lambda job=job: status_of(job)["state"] == "CANCELLED", timeout=30, what=f"{job} CANCELLED")
    again = pbstk("cancel", "--all")  # nothing stopped twice: ended (or not yet recorded as ended) jobs only
    assert again.exit_code == 0 and "cancelled" not in again.stdout, again.output
    lines = again.stdout.splitlines()
    assert lines == ["no active jobs or services to cancel"] or all(line.endswith(": already ended") for line in lines)
