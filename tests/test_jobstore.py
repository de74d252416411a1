"""The job store: private files, concurrent writers, lookup by id / id prefix / name, no key in output."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pbs_toolkit.cli.main import cli
from pbs_toolkit.errors import JobNotFound, UsageError
from pbs_toolkit.jobstore import JobRecord, JobStore

SECRET = "sk-test-NEVER-PRINT-ME-0123456789"


def make(job_id: str, name: str = "m", *, created: float | None = None, transport: str = "",
         final_state: str | None = "FINISHED") -> JobRecord:
    return JobRecord(job_id=job_id, scheduler="pbs", profile="generic-pbspro", model="org/model",
                     served_model_name="org/model", preset="dp4", name=name, run_dir=f"/runs/{name}-{job_id}",
                     transport=transport, created=created or time.time(), api_key=SECRET,
                     api_key_env="PBSTK_KEY_M", final_state=final_state)


def test_files_are_private(isolated_user: Path) -> None:
    store = JobStore()
    store.add(make("1.pbs01"))
    assert store.path == isolated_user / "state" / "pbstk" / "jobs.sqlite3"
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700


def test_private_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        store = JobStore(tmp_path / "fresh" / "jobs.sqlite3")
        store.add(make("1.pbs01"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600


def test_round_trip_and_final_state() -> None:
    store = JobStore()
    record = make("7.pbs01", final_state=None)
    record.extra = {"layout": "DP4", "gpus": 4}
    store.add(record)
    got = store.find("7.pbs01")
    assert got == record
    store.set_final_state(got, "FAILED", final_reason="walltime exceeded", exit_status=-29)
    again = store.find("7.pbs01")
    assert again.final_state == "FAILED"
    assert again.extra == {"layout": "DP4", "gpus": 4, "final_reason": "walltime exceeded", "exit_status": -29}
    store.remove(again)
    assert store.all() == []


def test_find_by_id_prefix_and_name() -> None:
    store = JobStore()
    store.add(make("101.pbs01.site.gov", "alpha", created=1000))
    store.add(make("102.pbs01.site.gov", "beta", created=2000))
    store.add(make("1795316065960.local", "gamma", created=3000))
    assert store.find("101.pbs01.site.gov").name == "alpha"
    assert store.find("102").name == "beta"  # what users copy from a truncated qstat table
    assert store.find("1795316065960").name == "gamma"
    assert store.find("alpha").job_id == "101.pbs01.site.gov"
    assert store.find(None).name == "gamma"  # newest
    with pytest.raises(JobNotFound, match="unknown job 'nope'"):
        store.find("nope")


def test_same_name_twice_finds_the_newest() -> None:
    store = JobStore()
    store.add(make("5.pbs01", "again", created=1000))
    store.add(make("9.pbs01", "again", created=2000))
    assert store.find("again").job_id == "9.pbs01"


def test_same_id_on_two_hosts_is_ambiguous() -> None:
    store = JobStore()
    store.add(make("5.pbs", "here", transport=""))
    store.add(make("5.pbs", "there", transport="polaris"))
    assert len(store.all()) == 2  # the key is (transport, job_id)
    with pytest.raises(UsageError, match="ambiguous"):
        store.find("5.pbs")
    assert store.find("there").transport == "polaris"


def test_empty_store() -> None:
    with pytest.raises(JobNotFound, match="no jobs launched yet"):
        JobStore().find(None)
    assert JobStore().all() == []


def _writer(path: str, worker: int, count: int) -> None:
    store = JobStore(Path(path))
    for i in range(count):
        record = make(f"{worker * 1000 + i}.pbs01", f"w{worker}", final_state=None)
        store.add(record)
        store.set_final_state(record, "FINISHED", final_reason=f"by {worker}")
        store.update_extra(record, n=i)


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "state" / "jobs.sqlite3"
    workers, count = 8, 25
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), w, count)) for w in range(workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    records = JobStore(path).all()
    assert len(records) == workers * count
    assert all(r.final_state == "FINISHED" and r.extra["final_reason"] == f"by {r.name[1:]}" for r in records)
    assert sorted(r.extra["n"] for r in records) == sorted(list(range(count)) * workers)


def test_no_command_prints_the_api_key() -> None:
    store = JobStore()
    store.add(make("1.pbs01", "done"))
    store.add(make("2.pbs01", "failed", final_state="FAILED"))
    runner = CliRunner()
    for args in (["jobs", "--json"], ["jobs", "--all", "--json"], ["jobs", "--all"],
                 ["status", "--all", "--json"], ["status", "--all"], ["status", "done", "--json"]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, result.output
        assert SECRET not in result.output, args
    listed = json.loads(runner.invoke(cli, ["jobs", "--all", "--json"]).stdout)
    assert {r["job_id"] for r in listed} == {"1.pbs01", "2.pbs01"}
    assert all("api_key" not in r and r["api_key_env"] == "PBSTK_KEY_M" for r in listed)
