"""Registry hygiene: the entries a job wrote leave with it (cancel, its end), are removable by hand
(``update-endpoint --remove``), leave no lock or temp file beside the user's registry, and the job store that
records them upgrades from schema 2. Real jobs under the fake PBS with the stand-in vLLM."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
from conftest import FAKEPBS_BIN
from helpers import launch, marker, pbstk, wait_recorded

from pbs_toolkit.endpoints.entry import EndpointEntry
from pbs_toolkit.endpoints.registry import read_endpoints, write_endpoint
from pbs_toolkit.jobs.store import SCHEMA_VERSION, JobRecord, JobStore, RegistryEntry

#: each format with an entry of the user's own (and a comment) that must survive byte for byte
OTHERS = {
    "py": 'ENDPOINTS = {\n    # keep me\n    "other": {"model": "m", "url": "http://o:1/v1", "key": "K"},\n}\n',
    "toml": '# keep me\n[[endpoint]]\nendpoint_id = "other"\nmodel = "m"\nurl = "http://o:1/v1"\nkey = "K"\n',
    "yaml": "endpoints:\n  other:\n    model: m\n    url: http://o:1/v1\n    key_env: K\n",
    # pbstk's own json is rewritten in its canonical layout (the tools' py/toml keep any layout and comment)
    "json": json.dumps({"endpoints": {"other": {"model": "m", "url": "http://o:1/v1", "key_env": "K"}}}, indent=2)
    + "\n",
}


def registered(path: Path, *extra: str) -> None:
    result = pbstk("update-endpoint", "--registry", str(path), "--timeout", "30", *extra)
    assert result.exit_code == 0, result.output


def job_url(record: JobRecord) -> str:
    m = marker(record)
    return f"http://{m['address']}:{m['port']}/v1"


def test_cancel_removes_the_entry_and_keeps_the_rest_byte_for_byte(fakepbs: Path, standins: Path,
                                                                   tmp_path: Path) -> None:
    record = launch("--name", "qwen")
    paths = {}
    for fmt, text in OTHERS.items():
        (tmp_path / fmt).mkdir()
        paths[fmt] = tmp_path / fmt / f"endpoints.{fmt}"
        paths[fmt].write_text(text)
        registered(paths[fmt])
        assert read_endpoints(paths[fmt])["qwen"].url == job_url(record)
        # the lock lives in the state dir: the registry's directory holds the registry and nothing else
        assert os.listdir(paths[fmt].parent) == [f"endpoints.{fmt}"]
    assert list((Path(os.environ["XDG_STATE_HOME"]) / "pbstk" / "locks").glob("*.lock"))
    result = pbstk("cancel", "qwen")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{record.job_id}: cancelled\n"
    for fmt, path in paths.items():
        assert path.read_text() == OTHERS[fmt], fmt
        assert f"pbstk: note: removed 'qwen' -> {job_url(record)} from {path}" in result.stderr
        assert os.listdir(path.parent) == [f"endpoints.{fmt}"]
    assert JobStore().registry_entries() == []


def test_keep_flags_leave_the_entry(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    kept_by_cancel = tmp_path / "a.py"
    kept_after_end = tmp_path / "b.py"
    first = launch("--name", "first")
    registered(kept_by_cancel)
    second = launch("--name", "second")
    registered(kept_after_end, "--keep-after-end")
    result = pbstk("cancel", "first", "--keep-endpoint")
    assert result.exit_code == 0 and "removed" not in result.stderr, result.output
    result = pbstk("cancel", "second")
    assert result.exit_code == 0 and "removed" not in result.stderr, result.output
    for job in (first, second):
        wait_recorded(job.job_id, "CANCELLED")
    assert read_endpoints(kept_by_cancel)["first"].url == job_url(first)
    assert read_endpoints(kept_after_end)["second"].url == job_url(second)
    # and an explicit --remove JOB takes a kept entry out too
    result = pbstk("update-endpoint", "--remove", first.job_id)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{kept_by_cancel}: removed first -> {job_url(first)}\n"
    assert read_endpoints(kept_by_cancel) == {}


def test_a_job_that_ends_by_itself_takes_its_entry_with_it(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    record = launch("--name", "ends")
    path = tmp_path / "endpoints.toml"
    path.write_text(OTHERS["toml"])
    registered(path)
    subprocess.run([str(FAKEPBS_BIN / "qdel"), record.job_id], check=True)  # noqa: S603 - not through pbstk
    wait_recorded(record.job_id, "CANCELLED")
    assert path.read_text() == OTHERS["toml"]
    result = pbstk("status", "--all")  # already removed: nothing more to say
    assert result.exit_code == 0 and "removed" not in result.stderr, result.output


def test_a_repointed_alias_is_left_and_an_unwritable_registry_does_not_fail_the_cancel(
        fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    record = launch("--name", "job")
    repointed, readonly, gone = tmp_path / "r.py", tmp_path / "ro.py", tmp_path / "gone" / "g.yaml"
    gone.parent.mkdir()
    for path in (repointed, readonly, gone):
        registered(path)
    write_endpoint(repointed, EndpointEntry("job", "m", "http://newer:9/v1", "K"))  # the user re-pointed it
    readonly.chmod(0o444)  # read-only on purpose: never replaced, even by root
    before = readonly.read_bytes()
    gone.unlink()
    gone.parent.rmdir()
    result = pbstk("cancel", "job")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{record.job_id}: cancelled\n"
    lines = result.stderr.splitlines()
    assert any(line.startswith(f"pbstk: note: left 'job' in {repointed}: it now points to http://newer:9/v1")
               for line in lines), lines
    warnings = [line for line in lines if line.startswith("pbstk: warning: ")]
    assert len(warnings) == 1 and str(readonly) in warnings[0], lines
    assert f"pbstk update-endpoint --remove job --registry {readonly}" in warnings[0]
    assert not any("error" in line for line in lines), lines
    assert read_endpoints(repointed)["job"].url == "http://newer:9/v1"
    assert readonly.read_bytes() == before
    assert not gone.parent.exists()


def test_remove_by_alias_is_atomic_byte_for_byte_and_idempotent(fakepbs: Path, standins: Path,
                                                                tmp_path: Path) -> None:
    launch("--name", "qwen")
    for fmt, text in OTHERS.items():
        path = tmp_path / f"endpoints.{fmt}"
        path.write_text(text)
        registered(path, "--alias", "mine")
        mode = path.stat().st_mode
        result = pbstk("update-endpoint", "--remove", "mine", "--registry", str(path))
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"{path}: removed mine -> http://"), result.output
        assert path.read_text() == text and path.stat().st_mode == mode
        assert os.listdir(tmp_path).count(path.name) == 1
        again = pbstk("update-endpoint", "--remove", "--alias", "mine", "--registry", str(path))
        assert again.exit_code == 0 and again.stdout == ""
        assert again.stderr == f"pbstk: note: no entry 'mine' in {path}; nothing removed\n"
        assert path.read_text() == text
        # the user's own entry goes too when asked for, and a missing --format is refused like for adding
        gone = pbstk("update-endpoint", "--remove", "other", "--registry", str(path), "--json")
        assert gone.exit_code == 0 and json.loads(gone.stdout)[0]["outcome"] == "removed"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_dir()) == sorted(f"endpoints.{f}" for f in OTHERS)
    odd = pbstk("update-endpoint", "--remove", "x", "--registry", str(tmp_path / "e.txt"))
    assert odd.exit_code == 8 and "cannot tell the registry format" in odd.stderr
    assert pbstk("update-endpoint", "--remove").exit_code == 2
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    refused = pbstk("update-endpoint", "--remove", "x", "--registry", str(fifo))
    assert refused.exit_code == 8 and "not a regular file" in refused.stderr, refused.output


def test_a_schema_2_store_upgrades_to_3_and_records_entries(isolated_user: Path) -> None:
    path = isolated_user / "state" / "pbstk" / "jobs.sqlite3"
    path.parent.mkdir(parents=True, mode=0o700)
    conn = sqlite3.connect(path)
    conn.executescript("""
CREATE TABLE jobs (job_id TEXT NOT NULL, transport TEXT NOT NULL, scheduler TEXT NOT NULL, profile TEXT NOT NULL,
    model TEXT NOT NULL, served_model_name TEXT NOT NULL, preset TEXT NOT NULL, name TEXT NOT NULL,
    run_dir TEXT NOT NULL, created REAL NOT NULL, api_key TEXT, api_key_env TEXT, final_state TEXT,
    extra TEXT NOT NULL DEFAULT '{}', spec TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (transport, job_id));
CREATE TABLE intents (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, transport TEXT NOT NULL,
    run_dir TEXT NOT NULL, created REAL NOT NULL, launcher TEXT NOT NULL, record TEXT NOT NULL);
CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
PRAGMA user_version = 2;
""")
    conn.execute("INSERT INTO jobs VALUES ('7.pbs01', '', 'pbs', 'generic-pbspro', 'org/m', 'org/m', 'dp4', "
                 "'old', '/runs/old', 1000.0, NULL, NULL, 'FINISHED', '{}', '{}')")
    conn.commit()
    conn.close()
    store = JobStore()
    record = store.find("old")
    assert record.final_state == "FINISHED"
    store.add_registry_entry(RegistryEntry(record.job_id, "", "/r/e.py", "py", "old", "http://n:1/v1"))
    assert [e.alias for e in store.registry_entries(record)] == ["old"]
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    conn.close()
    result = pbstk("jobs", "--all")
    assert result.exit_code == 0 and "7.pbs01" in result.stdout
    assert not list(path.parent.glob("*.corrupt-*"))


@pytest.mark.parametrize("fmt", ["py", "yaml"])
def test_update_endpoint_leaves_nothing_beside_the_registry(fakepbs: Path, standins: Path, tmp_path: Path,
                                                            fmt: str) -> None:
    launch()
    (tmp_path / "reg").mkdir()
    path = tmp_path / "reg" / f"endpoints.{fmt}"
    registered(path)
    registered(path, "--alias", "second")
    assert os.listdir(path.parent) == [path.name]


def test_wait_that_sees_the_end_removes_the_entry(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    record = launch("--name", "waited")
    path = tmp_path / "endpoints.py"
    path.write_text(OTHERS["py"])
    registered(path)
    subprocess.run([str(FAKEPBS_BIN / "qdel"), record.job_id], check=True)  # noqa: S603 - not through pbstk
    result = pbstk("wait", record.job_id, "--timeout", "30")
    assert result.exit_code == 5, result.output
    assert f"pbstk: note: removed 'waited' -> {job_url(record)} from {path}" in result.stderr
    assert path.read_text() == OTHERS["py"]
