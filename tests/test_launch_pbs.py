"""launch -> status -> cancel against the fake PBS (real qsub/qstat/qdel executables, real job processes).

Every state a user can meet is reached for real: PENDING with the scheduler's comment, STARTING, READY,
FAILED with the log's error lines, FINISHED, CANCELLED, walltime, LOST (vanished, rejected after qsub),
transient qstat failures, history off. The stand-in ``vllm`` plays the server (PBSTK_TEST_STANDIN_MODE).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from conftest import read_calls
from helpers import MODEL, path_without, pbstk, set_faults, status_of, wait_for, wait_recorded

from pbs_toolkit.jobs.store import JobStore


def launch(name: str, *extra: str) -> Result:
    return pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto",
                 "--name", name, *extra)


def launched_id(result: Result) -> str:
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert first.startswith("submitted "), result.stdout
    return first.split()[1]


def wait_state(job: str, *states: str, timeout: float = 15.0) -> dict[str, Any]:
    seen: list[str] = []

    def check() -> dict[str, Any] | None:
        st = status_of(job)
        seen.append(st["state"])
        return st if st["state"] in states else None

    try:
        return dict(wait_for(check, timeout, f"{job} to be {'/'.join(states)}"))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; states seen: {seen[-5:]}") from None


def fake_job(home: Path, job_id: str) -> dict[str, Any]:
    return dict(json.loads((home / "jobs" / f"{job_id.split('.')[0]}.json").read_text()))


def marker(job: str) -> dict[str, Any] | None:
    path = Path(JobStore().find(job).run_dir) / "server.json"
    try:
        return dict(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError):
        return None


@pytest.fixture
def pbs(fakepbs: Path, standins: Path) -> Path:
    return fakepbs


# -- the happy path ---------------------------------------------------------------------------------


def test_launch_wait_status_cancel(pbs: Path) -> None:
    result = launch("happy", "--wait")
    job = launched_id(result)
    assert "ready: http://" in result.stdout
    assert read_calls(pbs, "qsub")[0][-1].endswith("/job.pbs")  # a file, never stdin

    st = status_of(job)
    assert st["state"] == "READY" and st["scheduler_state"] == "R"
    assert st["url"].endswith(f":{st['port']}/v1")
    table = pbstk("status").stdout
    assert job in table and "READY" in table

    result = pbstk("cancel", job)
    assert result.exit_code == 0 and result.stdout.strip() == f"{job}: cancelled"
    st = wait_state(job, "CANCELLED")  # already while PBS says E; recorded only at F
    st = wait_recorded(job, "CANCELLED")
    assert st["scheduler_state"] == "F" and st["exit_status"] in (143, 271)

    before = len(read_calls(pbs, "qstat"))
    st = status_of(job)  # recorded: no scheduler query any more
    assert st["state"] == "CANCELLED" and "signal" in st["reason"]
    assert len(read_calls(pbs, "qstat")) == before
    assert pbstk("cancel", job).stdout.strip() == f"{job}: already ended"


def test_cancel_while_pbs_is_ending_the_job_is_not_an_error(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real OpenPBS answers qdel of a job in state E with "Request invalid for state of job" (exit 168,
    tests/test_realpbs_nodes.py): the job is ending by itself, so a cancel then says so and succeeds."""
    monkeypatch.setenv("FAKEPBS_EXITING_DELAY", "30")  # E for 30 s after the job's end
    job = launched_id(launch("ending", "--wait"))
    assert pbstk("cancel", job).stdout.strip() == f"{job}: cancelled"
    wait_for(lambda: fake_job(pbs, job)["attrs"]["job_state"] == "E", 30, f"{job} to be E")
    again = pbstk("cancel", job)
    assert again.exit_code == 0, again.output
    assert again.stdout.strip() == f"{job}: already ended"
    assert read_calls(pbs, "qdel")[-1][-1] == job  # it did ask PBS


def test_pending_shows_the_schedulers_comment_then_cancel(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    job = launched_id(launch("queued"))
    st = status_of(job)
    assert st["state"] == "PENDING" and st["scheduler_state"] == "Q"
    assert st["comment"] == "Not Running: Not enough free nodes available"
    assert "Not enough free nodes available" in pbstk("status").stdout

    assert pbstk("cancel", job).exit_code == 0
    st = wait_state(job, "CANCELLED")
    assert st["reason"] == "deleted before it ran" and st["exit_status"] is None


def test_starting_while_vllm_loads(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "hang")  # logs startup lines, never listens
    job = launched_id(launch("slow"))
    st = wait_for(lambda: (s := status_of(job))["state"] == "STARTING" and s["phase"] != "job started" and s,
                  what="a STARTING phase read from the log")
    assert st["scheduler_state"] == "R"
    pbstk("cancel", job)
    wait_state(job, "CANCELLED")


def test_fatal_start_fails_with_the_logs_error_lines(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "fatal")
    result = launch("oom-wait", "--wait", "--timeout", "30")
    assert result.exit_code == 5, result.output
    assert "is FAILED" in result.stderr and "CUDA out of memory" in result.stderr

    job = launched_id(launch("oom"))  # no --wait: status finds it, records it, and keeps the reason
    st = wait_recorded(job, "FAILED")
    assert "CUDA out of memory" in st["reason"]
    for _ in range(2):  # live, then from the record (no scheduler query)
        table = pbstk("status", job).stdout
        assert "FAILED" in table and "CUDA out of memory" in table
        assert "  | torch.OutOfMemoryError: CUDA out of memory" in table
        assert "  | RuntimeError: Engine core initialization failed" in table


def test_exit_after_ready_is_finished(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "exit-after-ready")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_SECONDS", "1.5")  # the start script checks the port every 1 s
    job = launched_id(launch("brief"))
    st = wait_recorded(job, "FINISHED")
    assert st["reason"] == "exited normally"
    assert fake_job(pbs, job)["attrs"]["Exit_status"] == 0


def test_walltime_exceeded_is_failed(pbs: Path) -> None:
    job = launched_id(launch("short", "--walltime", "00:00:03"))
    st = wait_recorded(job, "FAILED", timeout=20)
    assert st["exit_status"] == -29
    assert "walltime exceeded" in st["reason"]


# -- the scheduler forgets, refuses or stutters -----------------------------------------------------


def test_vanished_job_is_lost(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_LOST_AFTER_S", "0")  # LOST after 3 answers without it, however quick
    job = launched_id(launch("ghost", "--wait"))
    set_faults(pbs, vanish=[job])  # unknown to qstat from now on; its processes are killed
    st = wait_recorded(job, "LOST")
    assert "no longer knows" in st["reason"]


def _ended_with_marker(pbs: Path, job: str) -> None:
    wait_for(lambda: (marker(job) or {}).get("phase") == "exited", what="server.json phase exited")
    wait_for(lambda: fake_job(pbs, job)["attrs"]["job_state"] == "F", what="job F")


@pytest.mark.parametrize("fault", [{"history": False}, {"vanish": ["JOB"]}])
def test_forgotten_after_exit_the_marker_wins(pbs: Path, monkeypatch: pytest.MonkeyPatch,
                                              fault: dict[str, Any]) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "exit-after-ready")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_SECONDS", "1.5")
    job = launched_id(launch("forgotten"))
    _ended_with_marker(pbs, job)  # no status call yet: nothing recorded before the fault
    set_faults(pbs, **{k: [job] if v == ["JOB"] else v for k, v in fault.items()})
    st = status_of(job)
    assert st["scheduler_state"] is None  # qstat no longer knows it
    assert st["state"] == "FINISHED", st
    assert JobStore().find(job).final_state == "FINISHED"


def test_rejected_after_qsub_is_lost(pbs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_LOST_AFTER_S", "0")
    set_faults(pbs, reject_after_submit=True)
    job = launched_id(launch("dropped"))
    assert [status_of(job)["state"] for _ in range(2)] == ["UNKNOWN", "UNKNOWN"]  # one answer is not proof
    assert JobStore().find(job).final_state is None
    st = status_of(job)
    assert st["state"] == "LOST"
    assert JobStore().find(job).final_state == "LOST"


@pytest.fixture
def backoff(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The delays ``run_with_retry`` would sleep, recorded instead of slept."""
    from pbs_toolkit.schedulers import base, pbs

    delays: list[float] = []
    original = base.run_with_retry

    def recorded(*args: Any, **kw: Any) -> Any:
        return original(*args, **kw, sleep=delays.append)

    # the base runs the sequence (submit, query, cancel); the backend itself retries its extra calls
    monkeypatch.setattr(base, "run_with_retry", recorded)
    monkeypatch.setattr(pbs, "run_with_retry", recorded)
    return delays


def test_transient_qstat_failures_are_retried_with_backoff(pbs: Path, backoff: list[float]) -> None:
    job = launched_id(launch("flaky", "--wait"))
    set_faults(pbs, qstat_unavailable=2)
    before = len(read_calls(pbs, "qstat"))
    st = status_of(job)
    assert st["state"] == "READY" and st["scheduler_state"] == "R"
    assert backoff == [1.0, 2.0]
    assert len(read_calls(pbs, "qstat")) - before == 3
    pbstk("cancel", job)


def test_scheduler_down_longer_than_the_retries_changes_nothing(
    pbs: Path, backoff: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    ready = launched_id(launch("up", "--wait"))
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")
    queued = launched_id(launch("waiting"))
    set_faults(pbs, qstat_unavailable=50)
    result = pbstk("status", "--json")
    assert result.exit_code == 0, result.output
    states = {s["job_id"]: s for s in json.loads(result.stdout)}
    assert len(backoff) == 3  # 4 tries
    assert states[ready]["state"] == "READY"  # the server itself still answers
    assert states[queued]["state"] == "UNKNOWN"  # not FAILED, not LOST
    assert "could not reach the scheduler" in states[queued]["reason"]
    assert all(r.final_state is None for r in JobStore().all())
    set_faults(pbs)
    assert status_of(queued)["state"] == "PENDING"


# -- one query per poll -----------------------------------------------------------------------------


def test_one_batched_qstat_for_all_jobs_and_none_for_recorded_ones(
    pbs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKEPBS_QUEUE_DELAY", "60")  # no job runs: nothing but the query is measured
    jobs = [launched_id(launch(f"batch{i}")) for i in range(3)]
    before = len(read_calls(pbs, "qstat"))
    result = pbstk("status")
    assert result.exit_code == 0
    calls = read_calls(pbs, "qstat")[before:]
    assert calls == [["-x", "-f", "-F", "json", *reversed(jobs)]]  # newest first, one call

    pbstk("cancel", jobs[0])
    wait_recorded(jobs[0], "CANCELLED")
    before = len(read_calls(pbs, "qstat"))
    assert pbstk("status", "--all").exit_code == 0
    assert read_calls(pbs, "qstat")[before:] == [["-x", "-f", "-F", "json", jobs[2], jobs[1]]]


# -- bad input: one clear line, non-zero exit, nothing lost from the job store ----------------------


def _store_snapshot() -> list[dict[str, Any]]:
    return [r.public() for r in JobStore().all()]


@pytest.fixture
def existing_job(pbs: Path) -> str:
    """One recorded job, so each failure can show that nothing in the store was lost."""
    return launched_id(launch("keeper"))


def _fails_cleanly(result: Result, code: int, text: str) -> list[str]:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("pbstk: error: ") and text in lines[0], result.stderr
    return lines


def test_qsub_missing(existing_job: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = _store_snapshot()
    with monkeypatch.context() as patch:  # undone before the fakepbs fixture's cleanup needs qdel
        patch.setenv("PATH", path_without(tmp_path / "bin", "qsub", "qstat", "qdel"))
        result = launch("nosub")
    _fails_cleanly(result, 3, "qsub not found")
    assert _store_snapshot() == before
    runs = Path(os.environ["PBSTK_RUNS_ROOT"])
    assert not [p for p in runs.iterdir() if p.name.startswith("nosub-")]  # run directory removed


@pytest.mark.parametrize(
    ("how", "message"),
    [("fault", "qsub: Job rejected by all possible destinations"),
     ("account", "qsub: Account_Name is required to be set.")],
)
def test_qsub_rejects_verbatim(existing_job: str, pbs: Path, monkeypatch: pytest.MonkeyPatch,
                               how: str, message: str) -> None:
    before = _store_snapshot()
    if how == "fault":
        set_faults(pbs, qsub_reject=message)
    else:
        monkeypatch.setenv("FAKEPBS_REQUIRE_ACCOUNT", "1")
    result = launch("refused")
    lines = _fails_cleanly(result, 3, message)
    assert len(lines) == 1
    assert _store_snapshot() == before
    runs = Path(os.environ["PBSTK_RUNS_ROOT"])
    assert not [p for p in runs.iterdir() if p.name.startswith("refused-")]


def test_unknown_job_id(existing_job: str) -> None:
    before = _store_snapshot()
    for command in (["status", "nope"], ["cancel", "nope"], ["logs", "nope"]):
        result = pbstk(*command)
        lines = _fails_cleanly(result, 7, "unknown job 'nope'")
        assert len(lines) == 1
    assert _store_snapshot() == before


# -- Ctrl-C during submit ---------------------------------------------------------------------------


def test_ctrl_c_during_submit_is_held_until_the_job_is_recorded(
    pbs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGINT right after qsub returned: ``_defer_interrupts`` records the job, then exits 130."""
    from pbs_toolkit.schedulers.pbs import PBSScheduler

    original = PBSScheduler.submit

    def submit_then_ctrl_c(self: PBSScheduler, *args: Any, **kw: Any) -> str:
        job_id = original(self, *args, **kw)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler has run by now
        return job_id

    monkeypatch.setattr(PBSScheduler, "submit", submit_then_ctrl_c)
    result = launch("interrupted")
    assert result.exit_code == 130 and "interrupted" in result.stderr
    records = JobStore().all()
    assert [r.name for r in records] == ["interrupted"]
    record = records[0]
    assert record.job_id.endswith(".fakepbs") and record.job_id == fake_job(pbs, record.job_id)["id"]
    assert record.api_key and Path(record.run_dir, "job.pbs").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    pbstk("cancel", record.job_id)


def test_interrupt_raised_inside_submit_is_adopted_from_the_run_dir(pbs: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt *raised* (not signalled) after qsub bypasses the deferral: the job qsub accepted is
    not recorded by that launch, but its id is in RUN_DIR/job_id, so the next read of the store adopts it."""
    from pbs_toolkit.schedulers.pbs import PBSScheduler

    original = PBSScheduler.submit

    def submit_then_raise(self: PBSScheduler, *args: Any, **kw: Any) -> str:
        original(self, *args, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(PBSScheduler, "submit", submit_then_raise)
    result = launch("halfway")
    assert result.exit_code == 130
    assert "job 1.fakepbs WAS submitted but not recorded" in result.stderr and "qdel 1.fakepbs" in result.stderr
    assert len(read_calls(pbs, "qsub")) == 1
    assert "the launch of 'halfway' is not recorded yet" in pbstk("jobs").stderr  # its launcher (we) still runs
    gone = subprocess.Popen(["sleep", "0"])  # noqa: S603,S607
    gone.wait()
    with sqlite3.connect(JobStore().path) as conn:  # as if that launch had been a process that is gone now
        conn.execute("UPDATE intents SET launcher = ?", (f"{os.uname().nodename}:{gone.pid}:1",))
    conn.close()
    listed = pbstk("jobs")
    assert "adopted job 1.fakepbs" in listed.stderr
    assert [r.job_id for r in JobStore().all()] == ["1.fakepbs"]
    assert pbstk("cancel", "1.fakepbs").stdout.strip() == "1.fakepbs: cancelled"
