"""What a waiting user sees, against the fake PBS with real processes: the job id the moment qsub returned it,
the progress line (one per change off a terminal, one live line on a real pty), the scheduler's estimated start,
Ctrl-C that leaves the job queued with the commands to resume or cancel it, and ``status``'s uptime and walltime
left with the ten-minute flag.
"""

from __future__ import annotations

import json
import os
import pty
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, pbstk, status_of, wait_for

from pbs_toolkit.jobs.store import JobStore

LAUNCH = ["launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto"]


@pytest.fixture
def pbs(fakepbs: Path, standins: Path) -> Path:
    return fakepbs


def fake_state(home: Path, job_id: str) -> str:
    """The fake PBS's own idea of the job's state (its job file, as qstat prints it)."""
    return str(json.loads((home / "jobs" / f"{job_id.split('.')[0]}.json").read_text())["attrs"]["job_state"])


def qstat_json(job_id: str) -> dict[str, Any]:
    out = subprocess.run(["qstat", "-x", "-f", "-F", "json", job_id], capture_output=True, text=True,  # noqa: S603,S607
                         timeout=30, check=True).stdout
    return dict(json.loads(out)["Jobs"][job_id])


def read_line(proc: subprocess.Popen[str], timeout: float = 30.0) -> str:
    """One line of ``proc``'s stdout within ``timeout`` (the process keeps running). A thread reads, so a line
    already in the pipe's buffer is not mistaken for silence."""
    lines: queue.Queue[str] = proc.lines  # type: ignore[attr-defined]
    return lines.get(timeout=timeout)


def pbstk_process(*args: str) -> subprocess.Popen[str]:
    """``pbstk ARGS`` as its own process; its stdout lines arrive in ``proc.lines`` as they are printed."""
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", *args], text=True,  # noqa: S603
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    proc.lines = lines  # type: ignore[attr-defined]
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True).start()
    return proc


def interrupt(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group: a qstat running just then gets it too);
    then the rest of stdout and stderr (the process must end by itself)."""
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=30)  # a few lines: the pipe cannot fill
    assert proc.stderr is not None
    err = proc.stderr.read()
    time.sleep(0.1)  # the reader thread takes the last stdout lines
    out = []
    while not proc.lines.empty():  # type: ignore[attr-defined]
        out.append(proc.lines.get())  # type: ignore[attr-defined]
    return "".join(out), err


# -- launch --wait: the id at once, Ctrl-C leaves the job queued ---------------------------------------


def test_launch_wait_prints_the_id_at_once_and_ctrl_c_leaves_the_job_queued(
        pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "120")
    monkeypatch.setenv("FAKEPBS_ESTIMATED_START", "600")
    proc = pbstk_process(*LAUNCH, "--name", "queued", "--wait")
    try:
        first = read_line(proc)
        assert first.startswith("submitted "), first
        job = first.split()[1]
        assert read_line(proc).startswith("run directory: ")
        assert read_line(proc) == "next:\n"
        assert proc.poll() is None  # still waiting: the id came before the wait, not after it
        wait_for(lambda: fake_state(pbs, job) == "Q" and len((pbs / "calls.log").read_text().splitlines()) > 2,
                 what="a qstat poll")
    finally:
        out, err = interrupt(proc)
    assert proc.returncode == 130, err
    lines = err.splitlines()
    assert f"  pbstk wait {job}" in lines and f"  pbstk cancel {job}" in lines, err
    assert "Traceback" not in err and "pbstk: interrupted" in err
    # off a terminal: one progress line per change, with the scheduler's words and its estimated start
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == 1, err
    assert re.fullmatch(r"\[\s+\d+s\] PENDING  \(PBS Q\) Not Running: Not enough free nodes available; "
                        r"est\. start \d\d:\d\d \(in (9|10)m\d\ds\)", progress[0]), progress
    assert "ready:" not in out
    # the job was left alone: still queued at the scheduler, not recorded as ended, no qdel
    assert fake_state(pbs, job) == "Q" and qstat_json(job)["job_state"] == "Q"
    assert JobStore().find(job).final_state is None
    assert "qdel" not in (pbs / "calls.log").read_text()
    assert status_of(job)["state"] == "PENDING"


def test_update_endpoint_ctrl_c_names_the_same_registration_and_leaves_the_job(
        pbs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "120")
    job = pbstk(*LAUNCH, "--name", "reg").stdout.split()[1]
    registry = tmp_path / "my endpoints.py"
    proc = pbstk_process("update-endpoint", job, "--registry", str(registry), "--alias", "m1")
    try:
        wait_for(lambda: "qstat" in (pbs / "calls.log").read_text(), what="the wait's first qstat")
        time.sleep(0.5)
    finally:
        _, err = interrupt(proc)
    assert proc.returncode == 130, err
    lines = err.splitlines()
    assert f"  pbstk update-endpoint {job} --registry '{registry}' --alias m1" in lines, err
    assert f"  pbstk cancel {job}" in lines and "Traceback" not in err
    assert not registry.exists() and fake_state(pbs, job) == "Q"


def test_wait_ctrl_c_names_the_commands_and_leaves_the_job(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "120")
    result = pbstk(*LAUNCH, "--name", "later")
    job = result.stdout.split()[1]
    proc = pbstk_process("wait", job, "--json")
    try:
        wait_for(lambda: "qstat" in (pbs / "calls.log").read_text(), what="the wait's first qstat")
        time.sleep(0.5)
    finally:
        out, err = interrupt(proc)
    assert proc.returncode == 130
    assert out == ""  # --json: nothing half-written on stdout
    assert err.splitlines()[-2:] == [f"  pbstk wait {job}", f"  pbstk cancel {job}"], err
    assert not any(line.startswith("[") for line in err.splitlines())  # no progress lines in JSON mode
    assert fake_state(pbs, job) == "Q"


def test_launch_json_stays_one_document(pbs: Path) -> None:
    result = pbstk(*LAUNCH, "--name", "js", "--wait", "--json", "--timeout", "60")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # the whole of stdout is one JSON document
    assert data["state"] == "READY" and data["job_id"].endswith(".fakepbs")
    assert not any(line.startswith("[") for line in result.stderr.splitlines())
    pbstk("cancel", data["job_id"])


# -- the live line on a real terminal -------------------------------------------------------------------


#: a live-line frame whose clock reads 2 s or more ("[    2s]")
TICKED_2S = re.compile(rb"\[\s*([2-9]|\d\d+)s\]")


def run_on_pty(args: list[str], until: Callable[[bytes], bool] | None, env: dict[str, str], *,
               until_exit: bool = False) -> tuple[int, str]:
    """Run ``pbstk ARGS`` with stderr on a pseudo-terminal (stdout a pipe); read the terminal until what it
    showed satisfies ``until`` (at most 60 s: a loaded machine may take seconds to start Python), then Ctrl-C it
    (unless ``until_exit``: then wait for it to end). Returns the exit code and what the terminal showed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "pbs_toolkit", *args], stdin=subprocess.DEVNULL,  # noqa: S603
                            stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    shown = b""

    def drain(deadline: float, enough: Callable[[bytes], bool] = lambda got: False) -> bytes:
        got = b""
        while time.monotonic() < deadline and not enough(shown + got):
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the terminal's other side closed: the process ended
                    break
                if not chunk:
                    break
                got += chunk
            elif proc.poll() is not None and not ready:
                break
        return got

    try:
        shown += drain(time.monotonic() + 60, until or (lambda got: False))
        if proc.poll() is None and not until_exit:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        shown += drain(time.monotonic() + 1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
        os.close(master)
    return proc.returncode, shown.decode()


def test_live_line_on_a_terminal_ticks_in_place_and_ends_cleanly(pbs: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "120")
    monkeypatch.setenv("FAKEPBS_ESTIMATED_START", "90")
    job = pbstk(*LAUNCH, "--name", "tty").stdout.split()[1]
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "200"}
    env.pop("NO_COLOR", None)
    # Ctrl-C once the line has been drawn 3 times and its clock reads 2 s (not after a fixed time: on a loaded
    # machine Python alone may take seconds to start)
    rc, shown = run_on_pty(["wait", job], lambda got: got.count(b"PENDING") >= 3 and bool(TICKED_2S.search(got)),
                           env)
    assert rc == 130, shown
    text = shown.replace("\r\n", "\n")  # the terminal's own newline translation
    live, _, after = text.partition("\n")
    assert "\r" in live and live.count("PENDING") >= 3, repr(live)
    frames = [f for f in live.split("\r") if f.strip()]
    elapsed = [int(m.group(1)) for f in frames if (m := re.match(r"\[\s*(\d+)s\]", f))]
    assert elapsed == sorted(elapsed) and elapsed[-1] >= 2, frames  # ticks while nothing changes
    assert len(elapsed) >= elapsed[-1], frames  # redrawn at least every second
    assert "est. start" in frames[-1] and "\x1b[33mPENDING\x1b[0m" in frames[-1], repr(frames[-1])
    assert after.splitlines()[0].startswith("pbstk: interrupted; job "), repr(after)  # on its own line
    assert f"  pbstk wait {job}" in after.splitlines() and f"  pbstk cancel {job}" in after.splitlines()

    rc, shown = run_on_pty(["wait", job], lambda got: b"PENDING" in got, {**env, "NO_COLOR": "1"})
    assert rc == 130 and "\x1b" not in shown and "PENDING" in shown, repr(shown)
    assert fake_state(pbs, job) == "Q"


def test_live_line_is_finished_before_the_error(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "fatal")
    env = {**os.environ, "TERM": "xterm", "NO_COLOR": "1"}
    rc, shown = run_on_pty([*LAUNCH, "--name", "bad", "--wait", "--timeout", "60"], None, env, until_exit=True)
    assert rc == 5, shown
    lines = shown.replace("\r\n", "\n").split("\n")
    error = next(i for i, line in enumerate(lines) if "pbstk: error:" in line)
    assert lines[error].startswith("pbstk: error: job ") and "is FAILED" in lines[error], lines
    assert "\r" in lines[error - 1] and "FAILED" in lines[error - 1], lines  # the live line, finished first


# -- status: uptime, walltime left, the ten-minute flag, estimated start ----------------------------------


def test_status_shows_uptime_and_walltime_left_and_flags_the_last_ten_minutes(pbs: Path) -> None:
    ending = pbstk(*LAUNCH, "--name", "ending", "--walltime", "00:10:03").stdout.split()[1]
    long = pbstk(*LAUNCH, "--name", "long", "--walltime", "02:00:00").stdout.split()[1]

    def both_running() -> list[dict[str, Any]] | None:
        sts = json.loads(pbstk("status", ending, long, "--json").stdout)
        return sts if all(s["uptime_s"] is not None for s in sts) else None

    first_ending, first_long = wait_for(both_running, what="both jobs running")
    assert first_ending["walltime_s"] == 603 and first_long["walltime_s"] == 7200
    assert abs(first_long["walltime_left_s"] - (7200 - first_long["uptime_s"])) <= 1
    assert not first_long["walltime_ending"]
    for st in (first_ending, first_long):
        assert st["walltime_ending"] == (st["walltime_left_s"] <= 600)
    flagged = wait_for(lambda: (s := status_of(ending))["walltime_ending"] and s, what="the ten-minute flag")
    assert flagged["walltime_left_s"] <= 600 and flagged["uptime_s"] >= 3
    time.sleep(1.2)
    later = status_of(ending)
    assert later["uptime_s"] > flagged["uptime_s"] and later["walltime_left_s"] < flagged["walltime_left_s"]

    table = pbstk("status").stdout.splitlines()
    assert table[0].split()[:7] == ["JOB", "NAME", "STATE", "SCHED", "UPTIME", "WALLTIME-LEFT", "URL"], table[0]
    row = {line.split()[0]: line for line in table[1:]}
    assert re.search(r" R\s+\d+s\s+9m\d\ds!\s", row[ending]) and "ending in 9m" in row[ending], row[ending]
    assert re.search(r" R\s+\d+s\s+1h5\dm\s", row[long]) and "ending in" not in row[long], row[long]
    pbstk("cancel", ending, long)


def test_status_of_a_queued_job_has_the_estimated_start(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "120")
    monkeypatch.setenv("FAKEPBS_ESTIMATED_START", "1800")
    before = time.time()
    job = pbstk(*LAUNCH, "--name", "calendared").stdout.split()[1]
    st = status_of(job)
    assert st["state"] == "PENDING" and st["uptime_s"] is None and st["walltime_left_s"] is None
    assert before + 1800 - 2 <= st["estimated_start"] <= time.time() + 1800
    assert not st["walltime_ending"]
    pbstk("cancel", job)


# -- the pieces, without processes ------------------------------------------------------------------------


def qstat_doc(asked_at: int, **attrs: Any) -> str:
    return json.dumps({"timestamp": asked_at, "pbs_version": "23.06.06", "pbs_server": "pbs01",
                       "Jobs": {"7.pbs01": {"job_state": "R", **attrs}}})


def test_pbs_uptime_from_stime_while_it_agrees_with_pbs_own_counter() -> None:
    from pbs_toolkit.schedulers.pbs import TIME_FORMAT, parse_status

    now = 1_800_000_000
    stime = time.strftime(TIME_FORMAT, time.localtime(now - 250))
    job = parse_status(qstat_doc(now, stime=stime, resources_used={"walltime": "00:02:00"},
                                 Resource_List={"walltime": "01:00:00"}))["7.pbs01"]
    assert job.uptime_s == 250 and job.walltime_s == 3600  # the MoM's counter lags: stime is exact
    # a login node in another time zone: stime is hours off, PBS's own counter wins
    job = parse_status(qstat_doc(now, stime=time.strftime(TIME_FORMAT, time.localtime(now - 3600 - 250)),
                                 resources_used={"walltime": "00:04:10"}))["7.pbs01"]
    assert job.uptime_s == 250 and job.walltime_s is None
    job = parse_status(qstat_doc(now, stime="not a time", estimated="odd", Resource_List={"walltime": 5400}))
    assert job["7.pbs01"].uptime_s is None and job["7.pbs01"].walltime_s == 5400  # odd fields never garble


def test_pbs_estimated_start_only_while_queued() -> None:
    from pbs_toolkit.schedulers.pbs import TIME_FORMAT, parse_status

    when = 1_800_000_600
    est = {"exec_vnode": "(x1:ncpus=64)", "start_time": time.strftime(TIME_FORMAT, time.localtime(when))}
    assert parse_status(qstat_doc(when - 600, job_state="Q", estimated=est))["7.pbs01"].estimated_start == when
    assert parse_status(qstat_doc(when - 600, estimated=est))["7.pbs01"].estimated_start is None  # running


def test_local_jobs_report_uptime_and_their_walltime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pbs_toolkit.schedulers import JobRef
    from pbs_toolkit.schedulers.local import LocalScheduler
    from pbs_toolkit.transports import LocalRunner

    monkeypatch.setenv("HOME", str(tmp_path))
    script = tmp_path / "job.pbs"
    script.write_text("#!/bin/bash\nsleep 300\n")
    sched = LocalScheduler(id_source=lambda: 1)
    ref = JobRef(sched.submit(LocalRunner(), str(script), str(tmp_path), "t", walltime_s=605), str(tmp_path))
    try:
        first = sched.query(LocalRunner(), [ref])[ref.job_id]
        assert first.uptime_s is not None and first.uptime_s < 5 and first.walltime_s == 605
        later = wait_for(lambda: (j := sched.query(LocalRunner(), [ref])[ref.job_id]).uptime_s > first.uptime_s
                         and j, what="the uptime to grow")
        assert later.walltime_s == 605
    finally:
        sched.cancel(LocalRunner(), ref)


def test_estimated_start_and_durations_read_well() -> None:
    from pbs_toolkit.cli.progress import estimated_start
    from pbs_toolkit.durations import short

    assert [short(s) for s in (0, 59.9, 60, 605, 3599, 3600, 7199, 90000)] == [
        "0s", "59s", "1m00s", "10m05s", "59m59s", "1h00m", "1h59m", "1d01h"]
    now = 1_800_000_000
    at = time.strftime("%H:%M", time.localtime(now + 2700))
    assert estimated_start(now + 2700, now) == f"est. start {at} (in 45m00s)"
    assert estimated_start(now - 120, now).endswith("(2m00s ago)")
