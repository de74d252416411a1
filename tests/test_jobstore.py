"""The job store: private files, concurrent writers, lookup by id / id prefix / name, no key in output."""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pbs_toolkit.cli.main import cli
from pbs_toolkit.errors import JobNotFound, UsageError
from pbs_toolkit.jobs.spec import LaunchSpec
from pbs_toolkit.jobs.store import JobRecord, JobStore

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
    record.spec = LaunchSpec(layout="DP4", gpus=4, vllm_args=["--max-model-len", "4096"], params_b=8.0)
    record.extra = {"sched_absence": 1}
    store.add(record)
    got = store.find("7.pbs01")
    assert got == record
    store.set_final_state(got, "FAILED", final_reason="walltime exceeded", exit_status=-29)
    again = store.find("7.pbs01")
    assert again.final_state == "FAILED" and again.spec == record.spec
    ended = again.extra.pop("final_at")  # when it was recorded as ended: `pbstk clean --older-than` counts from it
    assert isinstance(ended, float) and abs(time.time() - ended) < 60
    assert again.extra == {"sched_absence": 1, "final_reason": "walltime exceeded", "exit_status": -29}
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


# -- corrupt or foreign state: reported, never a traceback --------------------------------------------------


def _seed() -> JobStore:
    store = JobStore()
    store.add(make("1.pbs01", "good", final_state=None))
    store.add(make("2.pbs01", "other", final_state=None))
    return store


def _cli_ok(*args: str) -> Any:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and result.exception is None
    return result


def test_garbage_store_is_moved_aside_and_launch_still_works(isolated_user: Path) -> None:
    path = JobStore().path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"this is not sqlite\x00\xff" * 200)
    result = _cli_ok("jobs", "--all")
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, result.stderr
    aside = list(path.parent.glob("jobs.sqlite3.corrupt-*"))
    assert len(aside) == 1 and str(path) in warnings[0] and str(aside[0]) in warnings[0]
    assert aside[0].read_bytes().startswith(b"this is not sqlite")
    store = JobStore()
    store.add(make("3.pbs01", "after"))
    assert [r.job_id for r in store.all()] == ["3.pbs01"]
    assert "warning" not in _cli_ok("jobs", "--all").stderr  # said once, not on every command


def test_a_store_with_a_foreign_schema_is_moved_aside(isolated_user: Path) -> None:
    path = JobStore().path
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE jobs (id INTEGER, what TEXT)")
    conn.commit()
    conn.close()
    result = _cli_ok("jobs", "--all")
    assert "not a pbstk job store" in result.stderr and "corrupt-" in result.stderr
    JobStore().add(make("3.pbs01", "after"))


def test_one_bad_row_affects_that_row_only() -> None:
    store = JobStore()
    store.add(make("1.pbs01", "good"))
    store.add(make("2.pbs01", "other"))
    store.add(make("3.pbs01", "badextra"))  # recorded final: `status --all` needs no scheduler
    store.add(make("4.pbs01", "badstate"))
    conn = sqlite3.connect(store.path)
    conn.execute("UPDATE jobs SET extra = '{not json' WHERE job_id = '3.pbs01'")
    conn.execute("UPDATE jobs SET final_state = 'EXPLODED' WHERE job_id = '4.pbs01'")
    conn.execute("ALTER TABLE jobs ADD COLUMN surprise TEXT DEFAULT 'x'")
    conn.commit()
    conn.close()
    for args in (["jobs", "--all"], ["jobs", "--all", "--json"], ["status", "--all", "--json"]):
        result = _cli_ok(*args)
        warnings = [line for line in result.stderr.splitlines() if line.startswith("pbstk: warning:")]
        assert len(warnings) == 1 and "4.pbs01" in warnings[0] and "EXPLODED" in warnings[0], result.stderr
    listed = {r["job_id"]: r for r in json.loads(_cli_ok("jobs", "--all", "--json").stdout)}
    assert set(listed) == {"1.pbs01", "2.pbs01", "3.pbs01"}  # the unknown state is skipped, the rest shown
    assert "broken_record" in listed["3.pbs01"]["extra"]
    store.add(make("5.pbs01", "new"))  # writing still works with the extra column
    store.update_extra(store.find("3.pbs01"), fixed=True)  # and a rewrite heals the bad JSON
    assert "broken_record" in store.find("3.pbs01").extra and store.find("3.pbs01").extra["fixed"] is True


def test_a_locked_store_is_one_line_exit_10(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _seed()
    monkeypatch.setenv("PBSTK_STORE_TIMEOUT", "0.3")
    conn = sqlite3.connect(store.path)
    conn.execute("BEGIN EXCLUSIVE")
    try:
        result = CliRunner().invoke(cli, ["cancel", "good"])
    finally:
        conn.rollback()
        conn.close()
    assert result.exit_code == 10, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pbstk: error: the job store ") and str(store.path) in lines[0]
    assert "locked" in lines[0]


def test_a_newer_schema_is_refused_not_moved(isolated_user: Path) -> None:
    store = _seed()
    conn = sqlite3.connect(store.path)
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    result = CliRunner().invoke(cli, ["jobs"])
    assert result.exit_code == 10 and "newer pbstk" in result.stderr
    assert not list(store.path.parent.glob("*.corrupt-*"))


def test_unrecorded_launches_are_mentioned_and_dead_empty_ones_dropped(tmp_path: Path) -> None:
    import subprocess

    store = JobStore()
    store.add_intent(make("", "remote", transport="login1", final_state=None))
    store.add_intent(make("", "dead", final_state=None))
    gone = subprocess.Popen(["sleep", "0"])  # noqa: S603,S607
    gone.wait()
    conn = sqlite3.connect(store.path)
    conn.execute("UPDATE intents SET launcher = ? WHERE name = 'dead'", (f"{os.uname().nodename}:{gone.pid}:1",))
    conn.commit()
    conn.close()
    result = _cli_ok("jobs")
    assert "the launch of 'remote' via login1 is not recorded yet" in result.stderr
    assert "'dead'" not in result.stderr  # its launcher is gone and its run directory never existed
    assert [i.name for i in store.intents()] == ["remote"]


_SCHEMA_1 = """
CREATE TABLE jobs (job_id TEXT NOT NULL, transport TEXT NOT NULL, scheduler TEXT NOT NULL, profile TEXT NOT NULL,
    model TEXT NOT NULL, served_model_name TEXT NOT NULL, preset TEXT NOT NULL, name TEXT NOT NULL,
    run_dir TEXT NOT NULL, created REAL NOT NULL, api_key TEXT, api_key_env TEXT, final_state TEXT,
    extra TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (transport, job_id));
CREATE TABLE intents (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, transport TEXT NOT NULL,
    run_dir TEXT NOT NULL, created REAL NOT NULL, launcher TEXT NOT NULL, record TEXT NOT NULL);
CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
PRAGMA user_version = 1;
"""
_OLD_EXTRA = {"vllm_args": ["--max-model-len", "4096"], "layout": "TP2xDP2", "tensor_parallel": 2,
              "data_parallel": 2, "pipeline_parallel": 1, "gpus": 4, "eager": True, "vllm_version": "0.11.0",
              "ssh_host": None, "vllm_cache_root": "/shared/cache", "params_b": 8.03, "venv": "/sw/venv",
              "final_reason": "walltime exceeded", "sched_absence": 2}


def test_a_schema_1_store_is_migrated_launch_keys_into_spec(isolated_user: Path) -> None:
    """A store written before LaunchSpec (launch keys in ``extra``) keeps working: the rows are migrated once,
    the launch keys become ``record.spec`` and ``extra`` keeps the runtime bookkeeping."""
    path = isolated_user / "state" / "pbstk" / "jobs.sqlite3"
    path.parent.mkdir(parents=True, mode=0o700)
    conn = sqlite3.connect(path)
    conn.executescript(_SCHEMA_1)
    conn.execute("INSERT INTO jobs VALUES ('9.pbs01', '', 'pbs', 'generic-pbspro', 'org/m', 'org/m', 'tp2dp2', "
                 "'old', '/runs/old', 1000.0, ?, 'PBSTK_KEY_OLD', 'FAILED', ?)", (SECRET, json.dumps(_OLD_EXTRA)))
    conn.execute("INSERT INTO jobs VALUES ('10.pbs01', '', 'pbs', 'generic-pbspro', 'org/m', 'org/m', 'dp4', "
                 "'bad', '/runs/bad', 2000.0, NULL, NULL, 'FINISHED', '{not json')")
    conn.commit()
    conn.close()
    record = JobStore().find("9.pbs01")
    assert record.spec == LaunchSpec(vllm_args=["--max-model-len", "4096"], layout="TP2xDP2", tensor_parallel=2,
                                     data_parallel=2, gpus=4, eager=True, vllm_version="0.11.0",
                                     vllm_cache_root="/shared/cache", params_b=8.03, venv="/sw/venv")
    assert record.extra == {"final_reason": "walltime exceeded", "sched_absence": 2}
    conn = sqlite3.connect(path)
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    rows = dict(conn.execute("SELECT job_id, extra FROM jobs").fetchall())
    spec = json.loads(conn.execute("SELECT spec FROM jobs WHERE job_id = '9.pbs01'").fetchone()[0])
    conn.close()
    assert version == 4 and spec["layout"] == "TP2xDP2"
    assert json.loads(rows["9.pbs01"]) == {"final_reason": "walltime exceeded", "sched_absence": 2}
    assert rows["10.pbs01"] == "{not json"  # left as it was: read with a warning, as before
    listed = {r["job_id"]: r for r in json.loads(_cli_ok("jobs", "--all", "--json").stdout)}
    assert listed["9.pbs01"]["spec"]["gpus"] == 4 and "layout" not in listed["9.pbs01"]["extra"]
    assert not list(path.parent.glob("*.corrupt-*"))


def _schema_1_store(path: Path) -> None:
    path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.executescript(_SCHEMA_1)
    conn.execute("INSERT INTO jobs VALUES ('9.pbs01', '', 'pbs', 'generic-pbspro', 'org/m', 'org/m', 'tp2dp2', "
                 "'old', '/runs/old', 1000.0, NULL, NULL, 'FAILED', ?)", (json.dumps(_OLD_EXTRA),))
    conn.commit()
    conn.close()


def _layout_of_old_job(_: int) -> str:
    return JobStore().find("9.pbs01").spec.layout


def test_processes_opening_a_schema_1_store_at_once_migrate_it_once(isolated_user: Path) -> None:
    path = isolated_user / "state" / "pbstk" / "jobs.sqlite3"
    _schema_1_store(path)
    with multiprocessing.get_context("fork").Pool(4) as pool:
        assert pool.map(_layout_of_old_job, range(8)) == ["TP2xDP2"] * 8
    assert not list(path.parent.glob("*.corrupt-*"))


def test_a_schema_1_store_locked_by_a_writer_is_one_line_saying_locked(isolated_user: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The migration waits for the writer's lock like any write; when that times out the line says so, and the
    next call, with the lock gone, migrates."""
    path = isolated_user / "state" / "pbstk" / "jobs.sqlite3"
    _schema_1_store(path)
    monkeypatch.setenv("PBSTK_STORE_TIMEOUT", "0.3")
    holder = sqlite3.connect(path)
    holder.execute("BEGIN IMMEDIATE")  # a writer: readers go on, the migration's BEGIN IMMEDIATE waits
    try:
        result = CliRunner().invoke(cli, ["jobs"])
    finally:
        holder.rollback()
        holder.close()
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 10 and len(lines) == 1 and "locked" in lines[0], result.output
    assert _cli_ok("jobs", "--all", "--json") and JobStore().find("9.pbs01").spec.layout == "TP2xDP2"


def test_an_old_run_dir_record_is_readopted_with_its_spec(tmp_path: Path) -> None:
    """``pbstk-job.json`` written before LaunchSpec held the launch keys in ``extra``: re-adoption reads them."""
    from pbs_toolkit.jobs.store import read_run_dir_record

    run = tmp_path / "run"
    run.mkdir()
    (run / "job_id").write_text("12.pbs01\n")
    old = {k: v for k, v in make("x").public().items() if k not in ("job_id", "final_state", "spec")}
    (run / "pbstk-job.json").write_text(json.dumps({**old, "extra": _OLD_EXTRA}))
    record = read_run_dir_record(str(run))
    assert record is not None and record.job_id == "12.pbs01"
    assert record.spec.layout == "TP2xDP2" and record.spec.venv == "/sw/venv"
    assert "layout" not in record.extra and record.extra["sched_absence"] == 2


def test_a_spec_of_the_wrong_shape_falls_back_field_by_field() -> None:
    spec = LaunchSpec.from_dict({"gpus": "4", "eager": 1, "params_b": 7, "vllm_args": "x", "layout": "DP4",
                                 "unknown": True})
    assert spec == LaunchSpec(layout="DP4", params_b=7.0)
    assert LaunchSpec.from_dict(["not", "a", "dict"]) == LaunchSpec()
