"""One duration grammar for every duration option (issue 32): ``90s``, ``5m``, ``1h30m``, plain seconds, ``0``/``off``
only where they mean something, the same bounds everywhere. The grammar itself, then each option through the CLI
(tests/helpers.py ``pbstk``): a good value passes its option (the command goes on to its next check or does its
work), a bad one is one ``pbstk: error:`` line naming the option, exit 2, nothing launched."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import MODEL, pbstk

from pbs_toolkit.durations import MAX_S, parse, seconds_of
from pbs_toolkit.errors import UsageError
from pbs_toolkit.jobs.store import JobStore

GOOD = {"90s": 90, "5m": 300, "1h30m": 5400, "2d12h": 216000, "1.5h": 5400, "1w": 604800, "1h0m5s": 3605,
        "45": 45, "1H30M": 5400, " 10m ": 600, "365d": MAX_S}
#: refused by every option: exponents, signs, inf/nan, units out of order or twice, no number, unknown units,
#: below 1 s (0.4 used to become "off" for --idle-cancel), above a year (1e9 and 1e3 used to differ)
BAD = ["1e3", "1e9", "1e-9", "0.4", "-5", "+5", "inf", "nan", "30m1h", "1h1h", "h", "5x", "1.5.0h", "1 h", "366d",
       "1h30", "soon"]


@pytest.mark.parametrize(("text", "seconds"), GOOD.items())
def test_the_grammar_reads_units_largest_first(text: str, seconds: float) -> None:
    assert parse(text, "--x") == seconds


@pytest.mark.parametrize("text", BAD)
def test_the_grammar_refuses_with_one_message_naming_the_option(text: str) -> None:
    with pytest.raises(UsageError) as err:
        parse(text, "--some-option", off=True)
    assert err.value.message.startswith(f"--some-option {text!r}: expected a duration from 1 s to 365d")


def test_zero_and_off_only_where_they_mean_something() -> None:
    for zero in ("0", "0s", "0m", "0h0m"):
        assert parse(zero, "--idle-cancel", off=True) == 0
        assert parse(zero, "--older-than", zero=True) == 0
        with pytest.raises(UsageError):
            parse(zero, "--handover")
    assert parse("off", "--idle-cancel", off=True) == 0
    with pytest.raises(UsageError):
        parse("off", "--older-than", zero=True)
    # a plain number needs its unit where it is refused (bare=False), zero aside
    assert seconds_of("7", bare=False) is None and seconds_of("0", bare=False) == 0
    # timeouts and intervals may be fractions of a second
    assert parse("0.05", "--watch", minimum=0.001) == 0.05


# -- each option --------------------------------------------------------------------------------------------------

LOCAL = ("--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single", "--port", "auto")


def _refused(result: object, option: str) -> None:
    output = getattr(result, "output", "")
    assert getattr(result, "exit_code", None) == 2, output
    assert output.count("pbstk: error:") == 1 and f"pbstk: error: {option} " in output, output
    assert "Traceback" not in output


@pytest.mark.parametrize("bad", ["0.4", "1e-9", "1e3", "1e9"])
def test_idle_cancel(isolated_user: Path, tmp_path: Path, bad: str) -> None:
    for text, seconds in (("1h30m", 5400), ("0s", 0), ("90", 90), ("off", 0)):
        out = tmp_path / text
        result = pbstk("render", MODEL, *LOCAL, "--idle-cancel", text, "-o", str(out))
        assert result.exit_code == 0, result.output
        assert f"IDLE_CANCEL_S={seconds}\n" in (out / "start_vllm.sh").read_text()
    _refused(pbstk("launch", MODEL, *LOCAL, "--idle-cancel", bad), "--idle-cancel")
    assert JobStore().all() == []


def test_handover_and_scale_down_idle(isolated_user: Path) -> None:
    # good values pass their option: the command stops at a later check (an unknown profile), not at the duration
    later = pbstk("serve", MODEL, "--profile", "nosuchprofile", "--keep-alive", "--handover", "1h30m")
    assert later.exit_code != 0 and "--handover" not in later.output and "nosuchprofile" in later.output, later.output
    later = pbstk("serve", MODEL, "--profile", "nosuchprofile", "--max-replicas", "2", "--scale-down-idle", "1h30m")
    assert later.exit_code != 0 and "--scale-down-idle" not in later.output, later.output
    for bad in ("0", "0s", "1e3", "0.4", "30m1h"):
        _refused(pbstk("serve", MODEL, "--handover", bad), "--handover")
        _refused(pbstk("serve", MODEL, "--max-replicas", "2", "--scale-down-idle", bad), "--scale-down-idle")


def test_clean_older_than_and_usage_since(isolated_user: Path) -> None:
    for good in ("0", "0s", "1h30m", "7d", "2w"):
        result = pbstk("clean", "--older-than", good, "--dry-run")
        assert result.exit_code == 0, result.output
        assert pbstk("usage", "--since", good).exit_code == 0
    for bad in ("7", "1e3", "0.4", "30m1h", "-1d"):
        _refused(pbstk("clean", "--older-than", bad), "--older-than")
    _refused(pbstk("usage", "--since", "366d"), "--since")


def test_timeouts_and_intervals(isolated_user: Path) -> None:
    # a good value passes: `wait` then looks for the job (exit 7), it does not refuse the timeout
    for good in ("1h30m", "90s", "0.5", "45"):
        assert pbstk("wait", "nosuchjob", "--timeout", good).exit_code == 7
    for bad in ("1e3", "inf", "nan", "-1", "30m1h", "0"):
        _refused(pbstk("wait", "nosuchjob", "--timeout", bad), "--timeout")
    assert pbstk("env", "nosuchjob", "--timeout", "0s").exit_code == 7  # 0: no wait, where it means that
