"""The ``local`` scheduler: the job script runs detached on this machine under a small supervisor.

First the scheduler alone with trivial job scripts (session, PBS variables, $HOME, walltime, cancel of the
whole process group), then ``pbstk launch/status/cancel`` end to end with the stand-in ``vllm``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import helpers
import pytest
from helpers import MODEL, launched_id, pbstk, status_of

from pbs_toolkit.jobs.store import JobStore
from pbs_toolkit.schedulers import JobRef, Outcome, SchedState
from pbs_toolkit.schedulers.local import LocalScheduler
from pbs_toolkit.transports import LocalRunner

wait_for = partial(helpers.wait_for, interval=0.1)  # the poll interval these tests have always used
wait_recorded = partial(helpers.wait_recorded, interval=0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill -0: count it as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def group_members(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


# -- the scheduler alone ----------------------------------------------------------------------------


@pytest.fixture
def job_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return run_dir


def write_script(run_dir: Path, body: str) -> str:
    script = run_dir / "job.pbs"
    script.write_text(f"#!/bin/bash\n{body}\n")
    return str(script)


#: the job store numbers local jobs in a launch; these tests use the backend alone
_IDS = itertools.count(1)


def submit(run_dir: Path, body: str, walltime_s: int = 600) -> tuple[str, JobRef]:
    job_id = LocalScheduler(id_source=_IDS.__next__).submit(LocalRunner(), write_script(run_dir, body),
                                                             str(run_dir), "t", walltime_s=walltime_s)
    return job_id, JobRef(job_id, str(run_dir))


def query(ref: JobRef) -> Any:
    return LocalScheduler().query(LocalRunner(), [ref]).get(ref.job_id)


def finished(ref: JobRef, timeout: float = 15.0) -> Any:
    return wait_for(lambda: (j := query(ref)) is not None and j.state is SchedState.FINISHED and j,
                    timeout, f"{ref.job_id} to finish")


REPORT = """
{ echo "pwd=$PWD"; echo "sid=$(ps -o sid= -p $$ | tr -d ' ')"; echo "pgid=$(ps -o pgid= -p $$ | tr -d ' ')"
  env | grep '^PBS_'; } >"$PBS_O_WORKDIR/report.tmp" && mv "$PBS_O_WORKDIR/report.tmp" "$PBS_O_WORKDIR/report"
"""


def test_job_runs_detached_in_home_with_the_pbs_variables(job_dir: Path) -> None:
    job_id, ref = submit(job_dir, REPORT + "sleep 300 & sleep 300 & wait")
    assert job_id.endswith(".local")
    report_file = job_dir / "report"
    wait_for(report_file.exists, what="the job's report")
    report = dict(line.split("=", 1) for line in report_file.read_text().splitlines())
    assert report["pwd"] == os.environ["HOME"]  # like PBS: jobs start in $HOME
    assert report["PBS_JOBID"] == job_id
    assert report["PBS_O_WORKDIR"] == str(job_dir)
    assert report["PBS_ENVIRONMENT"] == "PBS_BATCH"
    assert Path(report["PBS_NODEFILE"]).read_text().strip()
    pid = int((job_dir / ".local-job" / "pid").read_text())
    assert int(report["sid"]) == pid == int(report["pgid"])  # its own session and process group
    assert int(report["sid"]) != os.getsid(0)
    job = query(ref)
    assert job.state is SchedState.RUNNING and job.raw_state == "R"

    members = group_members(pid)
    assert len(members) >= 4  # supervisor, timeout, job script, two sleeps
    assert LocalScheduler().cancel(LocalRunner(), ref) is True
    wait_for(lambda: not [p for p in members if alive(p)], 10, "every process of the group to be gone")
    job = finished(ref)
    assert job.outcome is Outcome.CANCELLED  # said directly, not as an imitated scheduler exit code
    assert LocalScheduler().cancel(LocalRunner(), ref) is False  # already ended


def test_job_outlives_the_process_that_submitted_it(job_dir: Path) -> None:
    script = write_script(job_dir, "sleep 300")
    code = ("import sys; from pbs_toolkit.schedulers.local import LocalScheduler; "
            "from pbs_toolkit.transports import LocalRunner; "
            "print(LocalScheduler(id_source=lambda: 1).submit(LocalRunner(), sys.argv[1], sys.argv[2], 't'))")
    out = subprocess.run([sys.executable, "-c", code, script, str(job_dir)],  # noqa: S603
                         capture_output=True, text=True, timeout=30, check=True)
    ref = JobRef(out.stdout.strip(), str(job_dir))
    time.sleep(0.3)  # the submitter is gone; give a SIGHUP or group kill time to land
    assert query(ref).state is SchedState.RUNNING
    assert LocalScheduler().cancel(LocalRunner(), ref) is True
    assert finished(ref).outcome is Outcome.CANCELLED


def test_walltime_is_enforced(job_dir: Path) -> None:
    _, ref = submit(job_dir, "sleep 300", walltime_s=1)
    job = finished(ref, timeout=10)
    assert job.outcome is Outcome.WALLTIME and job.outcome_code is None


def test_walltime_comes_from_submit_not_from_the_script_text(job_dir: Path) -> None:
    # a directive-looking line is the script's business: the walltime is the one the profile gave at submit
    _, ref = submit(job_dir, "#PBS -l walltime=00:00:01\nsleep 2; exit 0", walltime_s=60)
    job = finished(ref, timeout=10)
    assert job.outcome is Outcome.EXITED and job.outcome_code == 0


def test_exit_code_and_hard_kill(job_dir: Path, tmp_path: Path) -> None:
    _, ref = submit(job_dir, "exit 3")
    job = finished(ref)
    assert job.outcome is Outcome.EXITED and job.outcome_code == job.exit_status == 3

    other = tmp_path / "other"
    other.mkdir()
    _, ref = submit(other, "sleep 300")
    pid = int((other / ".local-job" / "pid").read_text())
    os.killpg(pid, 9)  # no supervisor left to write an exit status
    job = finished(ref)
    assert job.outcome is Outcome.KILLED and job.outcome_code == 9 and job.exit_status is None
    assert "gone" in (job.comment or "")


def test_query_of_an_unknown_run_dir_is_absent(tmp_path: Path) -> None:
    assert LocalScheduler().query(LocalRunner(), [JobRef("1.local", str(tmp_path / "nothing"))]) == {}


# -- pbstk end to end with the stand-in vllm --------------------------------------------------------


LAUNCH = ["launch", MODEL, "--profile", "local-gpu", "--gpus-per-node", "1", "--preset", "single",
          "--port", "auto"]


def test_launch_from_another_process_status_cancel(standins: Path) -> None:
    # launched by a separate `pbstk` process that exits at once: the server must outlive it
    # the package's own entry point through this interpreter: nothing on PATH is assumed
    proc = subprocess.run([sys.executable, "-m", "pbs_toolkit", *LAUNCH, "--name", "loc"],  # noqa: S603
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split()[1]
    result = pbstk("wait", job, "--timeout", "30")
    assert result.exit_code == 0 and "ready: http://127.0.0.1:" in result.stdout, result.output

    st = status_of(job)
    assert st["state"] == "READY" and st["scheduler_state"] == "R"
    started = [json.loads(line) for line in (standins / "argv.jsonl").read_text().splitlines()]
    env = started[-1]["env"]
    record = JobStore().find(job)
    assert env["PBS_JOBID"] == job and env["PBS_O_WORKDIR"] == record.run_dir
    assert Path(env["PBS_NODEFILE"]).is_file()
    assert record.api_key and "VLLM_API_KEY" not in env  # vLLM reads it from a 0600 --config file
    assert record.api_key not in " ".join(started[-1]["argv"])  # never on the command line
    assert Path(record.run_dir, "vllm_api_key.yaml").read_text() == f"api-key: '{record.api_key}'\n"

    server = json.loads(Path(record.run_dir, "server.json").read_text())
    server_pid = server["pid"]
    group = int(Path(record.run_dir, ".local-job", "pid").read_text())
    # vLLM in a process group of its own (its engine with it, server/start/groups.sh), apart from the job's
    assert alive(server_pid) and server_pid in group_members(server_pid) and server_pid not in group_members(group)
    assert len(group_members(server_pid)) >= 2  # the stand-in's engine core, a process of its own as vLLM's

    result = pbstk("cancel", job)
    assert result.stdout.strip() == f"{job}: cancelled"
    wait_for(lambda: not group_members(server_pid) and not group_members(group), 10, "the server process to be gone")
    st = wait_recorded(job, "CANCELLED")
    assert "signal" in st["reason"]


def test_local_fatal_finished_and_walltime(standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "fatal")
    fatal = launched_id(pbstk(*LAUNCH, "--name", "oom"))
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "exit-after-ready")
    monkeypatch.setenv("PBSTK_TEST_STANDIN_SECONDS", "1.5")
    brief = launched_id(pbstk(*LAUNCH, "--name", "brief"))
    monkeypatch.setenv("PBSTK_TEST_STANDIN_MODE", "hang")
    slow = launched_id(pbstk(*LAUNCH, "--name", "slow", "--walltime", "00:00:03"))

    st = wait_for(lambda: (s := status_of(slow))["state"] == "STARTING" and s, what="STARTING")
    assert st["phase"]
    st = wait_recorded(fatal, "FAILED")
    assert "CUDA out of memory" in st["reason"]
    assert any("CUDA out of memory" in line for line in st["log_excerpt"])
    st = wait_recorded(brief, "FINISHED")
    assert st["exit_status"] == 0
    st = wait_recorded(slow, "FAILED", timeout=20)
    assert "walltime exceeded" in st["reason"]


def test_the_backend_reads_the_job_store_only_through_what_launch_hands_it(job_dir: Path) -> None:
    """schedulers/ sits below jobs/ (CONTRIBUTING.md "Layout"): a bare backend opens no job store of its own."""
    from pbs_toolkit.errors import SchedulerError, UsageError

    script = write_script(job_dir, "sleep 300")
    with pytest.raises(SchedulerError, match="id_source"):
        LocalScheduler().submit(LocalRunner(), script, str(job_dir), "t")
    with pytest.raises(UsageError, match="find_job"):
        LocalScheduler(id_source=lambda: 1).submit(LocalRunner(), script, str(job_dir), "t", after="7.host.local")
    assert not (job_dir / "job_id").exists()  # refused before anything was written
