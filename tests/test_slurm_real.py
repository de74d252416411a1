"""The Slurm backend against a real Slurm (tests/slurm_cluster.py: slurmctld and two slurmd, n1 and n2, on
loopback) with the stand-in `vllm`: launch -> READY -> logs -> cancel, a job stopped at its time limit, and a
two-node layout whose nodes each report.

pbstk runs as a subprocess (``sys.executable -m pbs_toolkit``) with the cluster's SLURM_CONF and client PATH; the
job inherits sbatch's environment (Slurm's default), so the stand-ins on PATH reach the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import MODEL
from slurm_cluster import SlurmCluster

TESTS = Path(__file__).resolve().parent
STANDINS = TESTS / "standins"


@pytest.fixture
def cli(slurm_cluster: SlurmCluster, tmp_path: Path) -> Any:
    """``cli(*args)``: pbstk in a subprocess with the cluster's environment and the stand-ins first on PATH."""
    record = tmp_path / "record"
    record.mkdir()
    env = {**os.environ, **slurm_cluster.env, "PBSTK_TEST_RECORD": str(record),
           "PYTHONPATH": str(TESTS.parent)}
    env["PATH"] = f"{STANDINS}{os.pathsep}{slurm_cluster.env['PATH']}"

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pbs_toolkit", *args], env=env, capture_output=True,  # noqa: S603
                              text=True, timeout=timeout, check=False)

    yield run
    slurm_cluster.cancel_all()


def _profile(tmp_path: Path, cluster: SlurmCluster, **keys: Any) -> str:
    data = {"scheduler": "slurm", "slurm": {"queue": cluster.partition}, "nodes": 1,
            "gpus_per_node": cluster.gpus_per_node, "cpus_per_node": 1, "walltime": "00:10:00",
            "address": "loopback", "bind_host": "127.0.0.1", "vllm_version": "0.11.0", **keys}
    path = tmp_path / "slurm-test.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _status(cli: Any, job: str) -> dict[str, Any]:
    result = cli("status", job, "--json")
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout)[0])


def _wait_state(cli: Any, job: str, states: tuple[str, ...], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = _status(cli, job)
        if st["state"] in states:
            return st
        time.sleep(1)
    raise AssertionError(f"job {job} not in {states} after {timeout} s: {st}")


def _launch(cli: Any, profile: str, *extra: str) -> str:
    result = cli("launch", MODEL, "--profile", profile, "--port", "auto", "--wait", "--timeout", "90", *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()[0].split()[1]


def test_launch_ready_logs_cancel(slurm_cluster: SlurmCluster, cli: Any, tmp_path: Path) -> None:
    job = _launch(cli, _profile(tmp_path, slurm_cluster), "--preset", "single")
    st = _status(cli, job)
    assert st["state"] == "READY" and st["url"].startswith("http://127.0.0.1:"), st
    queue = slurm_cluster.run("squeue", "--noheader", "--jobs", job, "--format=%T %j")
    assert queue.stdout.split()[0] == "RUNNING", queue
    logs = cli("logs", job)
    assert logs.returncode == 0 and "Starting vLLM server" in logs.stdout, logs.stdout + logs.stderr
    cancelled = cli("cancel", job)
    assert cancelled.returncode == 0, cancelled.stderr
    st = _wait_state(cli, job, ("CANCELLED",), 60)
    deadline = time.monotonic() + 60  # Slurm says COMPLETING until the job's processes are gone (the start script
    while st["scheduler_state"] == "COMPLETING" and time.monotonic() < deadline:  # ends what vLLM left: up to 15 s)
        time.sleep(1)
        st = _status(cli, job)
    assert st["scheduler_state"] == "CANCELLED" and st["final_state"] == "CANCELLED", st
    again = cli("cancel", job)  # already gone: not an error
    assert again.returncode == 0, again.stderr


def test_time_limit_fails_with_walltime_reason(slurm_cluster: SlurmCluster, cli: Any, tmp_path: Path) -> None:
    job = _launch(cli, _profile(tmp_path, slurm_cluster, walltime="00:01:00"), "--preset", "single")
    # Slurm's shortest limit is a minute: move the job's end close instead (checked every ~30 s by slurmctld)
    update = slurm_cluster.run("scontrol", "update", f"JobId={job}", "EndTime=now+2")
    assert update.returncode == 0, update.stderr
    st = _wait_state(cli, job, ("FAILED",), 75)
    assert st["reason"] == "walltime exceeded: the scheduler killed the job", st
    assert st["scheduler_state"] == "TIMEOUT", st
    assert "TIMEOUT" in slurm_cluster.run("squeue", "--noheader", "--states=all", "--jobs", job, "--format=%T").stdout


def test_two_nodes_ready_both_report(slurm_cluster: SlurmCluster, cli: Any, tmp_path: Path) -> None:
    job = _launch(cli, _profile(tmp_path, slurm_cluster, nodes=2), "--preset", "dp8")
    st = _status(cli, job)
    assert st["state"] == "READY" and st["nnodes"] == 2 and st["nodes_ready"] == 2, st
    run_dir = Path(st["run_dir"])
    deadline = time.monotonic() + 30
    while True:  # each node's copy rewrites its own marker when its server answers
        markers = [json.loads((run_dir / "nodes" / f"{k}.json").read_text()) for k in (0, 1)]
        if [m["phase"] for m in markers] == ["ready", "ready"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [(m["rank"], m["phase"]) for m in markers] == [(0, "ready"), (1, "ready")], markers
    assert (run_dir / "nodes.list").read_text().split() == slurm_cluster.nodes
    assert "srun -w" in (run_dir / "vllm.log").read_text()
    assert cli("cancel", job).returncode == 0
    _wait_state(cli, job, ("CANCELLED", "FAILED", "EXITED"), 60)


def test_begin_at_and_after(slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``begin_at`` holds the job (PENDING, BeginTime, the start time as estimate); ``after`` waits for a job."""
    from pbs_toolkit.schedulers.slurm import SlurmScheduler
    from pbs_toolkit.transports import LocalRunner

    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    script = tmp_path / "job.slurm"
    script.write_text("#!/bin/bash\n#SBATCH --time=1\n#SBATCH --output=/dev/null\nsleep 30\n")
    sched, runner = SlurmScheduler(), LocalRunner()
    begin = time.time() + 300
    try:
        _begin_and_after(sched, runner, str(script), str(tmp_path), begin)
    finally:
        slurm_cluster.cancel_all()


def _begin_and_after(sched: Any, runner: Any, script: str, run_dir: str, begin: float) -> None:
    from pbs_toolkit.schedulers import JobRef, SchedState

    later = sched.submit(runner, script, run_dir, "t", begin_at=begin)
    follower = sched.submit(runner, script, run_dir, "t", after=later)
    jobs = sched.query(runner, [JobRef(later, run_dir), JobRef(follower, run_dir)])
    assert jobs[later].state is SchedState.QUEUED and jobs[later].comment == "BeginTime", jobs[later]
    assert jobs[later].estimated_start is not None and abs(jobs[later].estimated_start - begin) < 5
    assert jobs[follower].state is SchedState.QUEUED and jobs[follower].comment == "Dependency", jobs[follower]
    assert sched.cancel(runner, JobRef(later, run_dir)) is True
    assert sched.cancel(runner, JobRef(later, run_dir)) is False  # already gone: not an error
    # the one id asked for is one Slurm never had: squeue fails the call; pbstk reads "not known"
    assert sched.query(runner, [JobRef("999999", run_dir)]) == {}


def test_run_then_usage_from_slurm_accounting(slurm_cluster: SlurmCluster, cli: Any, tmp_path: Path) -> None:
    """``pbstk run`` on Slurm, then ``usage``: the wall time is what Slurm's own accounting says (this cluster
    has no slurmdbd: ``sacct -c`` reads the job-completion log once the job has ended)."""
    profile = _profile(tmp_path, slurm_cluster)
    client = tmp_path / "client.py"
    client.write_text("from openai import OpenAI\nc = OpenAI()\n"
                      "r = c.completions.create(model=c.models.list().data[0].id, prompt='a b c', max_tokens=6)\n"
                      "print(r.usage.completion_tokens)\n")
    ran = cli("run", MODEL, "--profile", profile, "--port", "auto", "--preset", "single", "--name", "su",
              "--", sys.executable, str(client))
    assert ran.returncode == 0 and ran.stdout.strip() == "6", ran.stdout + ran.stderr
    job = json.loads(cli("jobs", "--all", "--json").stdout)[0]["job_id"]
    deadline = time.monotonic() + 60
    while True:  # the completion log gets the job once slurmctld has finished it
        acct = slurm_cluster.run("sacct", "-c", "--noheader", "--parsable2", f"--jobs={job}",
                                 "--format=JobID,Elapsed")
        rows = [line.split("|") for line in acct.stdout.splitlines() if line.startswith(f"{job}|")]
        if rows or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert rows, acct.stdout + acct.stderr
    h, m, s = (int(x) for x in rows[0][1].split(":"))
    result = cli("usage", job, "--json")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)["jobs"][0]
    assert row["walltime_source"] == "sacct -c Elapsed" and row["walltime_s"] == h * 3600 + m * 60 + s, row
    assert (row["requests"], row["prompt_tokens"], row["output_tokens"]) == (1, 3, 6), row
    assert row["ended"] is True and row["gpus"] == 1 and row["nodes"] == 1, row
