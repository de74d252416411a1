"""``pbstk clean``: ended jobs' run directories and records go, nothing else does. Real directories, real jobs
under the fake PBS with the stand-in vLLM, and a real sshd on loopback for the login-node side."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import launch, pbstk, wait_recorded

from pbs_toolkit.jobs.store import FINAL_AT_KEY, JobRecord, JobStore


def runs() -> Path:
    return Path(os.environ["PBSTK_RUNS_ROOT"])


def ended_job(name: str, *, days_ago: float = 30.0, run_dir: Path | None = None, job_id: str | None = None,
              markers: bool = True) -> JobRecord:
    """A record of a job that ended ``days_ago``, with a run directory as a launch leaves it."""
    job_id = job_id or f"{abs(hash(name)) % 10_000}.fakepbs"
    run_dir = run_dir or runs() / f"{name}-20260101-000000-abcd"
    run_dir.mkdir(parents=True, exist_ok=True)
    if markers:
        (run_dir / "pbstk-job.json").write_text("{}\n")
        (run_dir / "job_id").write_text(job_id + "\n")
    (run_dir / "vllm.log").write_text("log\n")
    record = JobRecord(job_id=job_id, scheduler="pbs", profile="generic-pbspro", model="org/m",
                       served_model_name="org/m", preset="dp4", name=name, run_dir=str(run_dir),
                       created=time.time() - 86400 * (days_ago + 1))
    store = JobStore()
    store.add(record)
    store.set_final_state(record, "FINISHED")
    store.update_extra(record, **{FINAL_AT_KEY: time.time() - 86400 * days_ago})
    return record


def ids() -> set[str]:
    return {r.job_id for r in JobStore().all()}


def test_clean_removes_ended_jobs_only(fakepbs: Path, standins: Path) -> None:
    running = launch("--name", "running")
    ended = launch("--name", "ended")
    assert pbstk("cancel", "ended").exit_code == 0
    wait_recorded(ended.job_id, "CANCELLED")
    log = Path(os.environ["XDG_STATE_HOME"]) / "pbstk" / "run_dirs.log"
    assert ended.run_dir in log.read_text().splitlines()

    recent = pbstk("clean")  # default 7d: it ended seconds ago
    assert recent.exit_code == 0 and recent.stdout == "", recent.output
    assert "removed 0 job(s); left 1 not ended, 1 ended less than 7d ago" in recent.stderr
    dry = pbstk("clean", "--older-than", "0", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert dry.stdout.startswith(f"would remove {ended.job_id} (ended, CANCELLED ")
    assert Path(ended.run_dir).is_dir() and ids() == {running.job_id, ended.job_id}

    result = pbstk("clean", "--older-than", "0", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(i["job_id"], i["action"]) for i in report["items"]] == [(ended.job_id, "removed")]
    assert report["active"] == 1
    assert not Path(ended.run_dir).exists() and Path(running.run_dir).is_dir()
    assert ids() == {running.job_id}
    assert ended.run_dir not in log.read_text().splitlines() and running.run_dir in log.read_text().splitlines()
    assert pbstk("status", running.job_id).exit_code == 0
    pbstk("cancel", "running")


def test_only_pbstk_run_directories_inside_the_runs_root_are_deleted(isolated_user: Path, tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.txt").write_text("keep\n")
    old = ended_job("old")
    linked_target = tmp_path / "elsewhere" / "linked-20260101-000000-abcd"
    link = ended_job("linked", run_dir=linked_target)
    Path(runs(), "linked-20260101-000000-abcd").symlink_to(linked_target, target_is_directory=True)
    store = JobStore()
    conn_fix(store, link.job_id, str(runs() / "linked-20260101-000000-abcd"))
    foreign = ended_job("foreign", run_dir=outside)  # recorded, markers and all, but outside the runs root
    other_id = ended_job("other")
    (Path(other_id.run_dir) / "job_id").write_text("999.fakepbs\n")
    unmarked = ended_job("unmarked", markers=False)
    young = ended_job("young", days_ago=1)
    gone = ended_job("gone")
    for p in Path(gone.run_dir).iterdir():
        p.unlink()
    Path(gone.run_dir).rmdir()

    result = pbstk("clean", "--json")
    assert result.exit_code == 0, result.output
    items = {i["name"]: i for i in json.loads(result.stdout)["items"]}
    assert items["old"]["action"] == "removed" and not Path(old.run_dir).exists()
    assert items["gone"]["action"] == "removed" and items["gone"]["detail"] == "run directory already gone"
    assert items["linked"]["action"] == "skipped" and "symlink" in items["linked"]["detail"]
    assert items["foreign"]["action"] == "skipped" and "not directly inside the runs root" in items["foreign"]["detail"]
    assert items["other"]["action"] == "skipped" and "names another job" in items["other"]["detail"]
    assert items["unmarked"]["action"] == "skipped" and "no pbstk marker" in items["unmarked"]["detail"]
    assert "young" not in items and Path(young.run_dir).is_dir()
    assert (outside / "data.txt").read_text() == "keep\n" and (linked_target / "vllm.log").exists()
    assert Path(other_id.run_dir).is_dir() and Path(unmarked.run_dir).is_dir()
    assert ids() == {link.job_id, foreign.job_id, other_id.job_id, unmarked.job_id, young.job_id}


def conn_fix(store: JobStore, job_id: str, run_dir: str) -> None:
    import sqlite3

    conn = sqlite3.connect(store.path)
    conn.execute("UPDATE jobs SET run_dir = ? WHERE job_id = ?", (run_dir, job_id))
    conn.commit()
    conn.close()


@pytest.mark.parametrize("bad", ["7", "7x", "-1d", "d", "1.5.0h"])
def test_a_bad_duration_is_refused(isolated_user: Path, bad: str) -> None:
    result = pbstk("clean", "--older-than", bad)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"pbstk: error: --older-than {bad!r}: expected a duration")
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_scheduler_that_does_not_answer_keeps_its_jobs(fakepbs: Path, standins: Path) -> None:
    running = launch("--name", "running")
    old = ended_job("old")

    def faults(**kw: Any) -> None:
        (fakepbs / "faults.json").write_text(json.dumps(kw))

    faults(qstat_script=[{"rc": 2, "stderr": "qstat: Permission denied\n"}])
    result = pbstk("clean")
    assert result.exit_code == 0, result.output
    assert "pbstk: warning: could not ask about 1 job(s) via this machine (qstat failed" in result.stderr
    assert result.stdout.startswith(f"removed {old.job_id} ")
    assert ids() == {running.job_id} and Path(running.run_dir).is_dir()
    faults()
    pbstk("cancel", "running")


@pytest.mark.ssh
def test_clean_over_ssh_removes_the_run_directory_on_the_login_node(fakepbs: Path, standins: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import MODEL, launched_id
    from sshd import start_sshd

    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    passed = {k: v for k, v in os.environ.items() if k.startswith(("FAKEPBS_", "PBSTK_TEST_"))}
    with start_sshd(tmp_path / "login", passed) as info:
        monkeypatch.setenv("PBSTK_SSH_CONFIG", str(info.ssh_config))
        monkeypatch.setenv("PBSTK_KNOWN_HOSTS", str(info.known_hosts))
        job = launched_id(pbstk("launch", MODEL, "--ssh", "pbstk-test", "--name", "remote", "--preset", "dp4",
                                "--profile", "generic-pbspro", "--port", "auto"))
        record = JobStore().find(job)
        assert record.transport == "pbstk-test"
        assert pbstk("cancel", job).exit_code == 0
        wait_recorded(job, "CANCELLED")
        before = info.log.read_text(errors="replace").count("Accepted publickey")
        result = pbstk("clean", "--older-than", "0")
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"removed {job} (remote, CANCELLED "), result.output
        assert info.log.read_text(errors="replace").count("Accepted publickey") - before == 1  # one connection
    assert not Path(record.run_dir).exists() and ids() == set()
