"""``render -o DIR`` then a hand submission: the job serves with the key in ``DIR/api_key`` (0600), and
``pbstk adopt JOBID DIR`` (or ``status DIR``) puts it under pbstk's commands.

Before: ``render -o`` wrote no key, so a job submitted from DIR served unauthenticated, and pbstk could not
follow it. Jobs run under the fake PBS (a real ``qsub`` executable) with the stand-in vLLM.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import MODEL, pbstk, until

from pbs_toolkit.jobs.store import JobStore

RENDER = ["--profile", "generic-pbspro", "--preset", "dp2", "--port", "auto"]


def _render(out: Path, *extra: str) -> str:
    result = pbstk("render", MODEL, *RENDER, "-o", str(out), *extra)
    assert result.exit_code == 0, result.output
    return result.stdout


def _qsub(script: Path) -> str:
    done = subprocess.run(["qsub", str(script)], capture_output=True, text=True, check=True)  # noqa: S603,S607
    return done.stdout.strip()


def test_render_writes_a_private_key_and_says_how_to_use_it(tmp_path: Path) -> None:
    out = tmp_path / "job"
    old = os.umask(0)  # the file must be 0600 because it is created so, not because of the caller's umask
    try:
        stdout = _render(out)
    finally:
        os.umask(old)
    key_file = out / "api_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text().strip()
    assert len(key) >= 32
    assert f"{out}/api_key" in stdout and "pbstk adopt JOBID" in stdout, stdout
    assert key not in stdout
    marker = json.loads((out / "pbstk-job.json").read_text())
    assert marker["run_dir"] == str(out) and "api_key" not in marker and key not in json.dumps(marker)
    assert not list(out.glob(".*pbstk-tmp"))
    # rendering again keeps the key (a job submitted from DIR may already serve with it)
    _render(out)
    assert key_file.read_text().strip() == key
    _render(out, "--no-api-key")
    assert not key_file.exists()


def test_hand_submitted_job_is_authenticated_and_adoptable(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    out = tmp_path / "byhand"
    _render(out, "--name", "byhand")
    key = (out / "api_key").read_text().strip()
    job_id = _qsub(out / "job.pbs")
    adopted = pbstk("adopt", job_id, str(out))
    assert adopted.exit_code == 0, adopted.output
    record = JobStore().find(job_id)
    assert record.api_key == key and record.run_dir == str(out) and record.name == "byhand"
    waited = pbstk("wait", job_id, "--timeout", "60")
    assert waited.exit_code == 0, waited.output  # READY needs /v1/models with the key: the server uses it
    server = json.loads((out / "server.json").read_text())
    url = f"http://{server['address']}:{server['port']}/v1/models"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=5)  # noqa: S310 - loopback
    assert refused.value.code == 401
    by_dir = pbstk("status", str(out), "--json")
    assert by_dir.exit_code == 0 and json.loads(by_dir.stdout)[0]["job_id"] == job_id, by_dir.output
    again = pbstk("adopt", job_id, str(out))
    assert again.exit_code == 2 and "already recorded" in again.stderr, again.output
    pbstk("cancel", job_id)


def test_status_of_a_run_dir_adopts_a_running_job(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    out = tmp_path / "unadopted"
    _render(out, "--name", "unadopted")
    job_id = _qsub(out / "job.pbs")
    early = pbstk("status", str(out))
    if early.exit_code:  # not running yet: no id in DIR, so the error says how to adopt it
        assert f"pbstk adopt JOBID {out}" in early.stderr, early.output
    until(lambda: json.loads((out / "server.json").read_text() or "{}").get("job_id") if (out / "server.json").exists()
          else None, 30, "the job to write its id")
    result = pbstk("status", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["job_id"] == job_id
    pbstk("cancel", job_id)


def test_adopt_refuses_a_directory_pbstk_did_not_write(tmp_path: Path) -> None:
    result = pbstk("adopt", "12.server", str(tmp_path))
    assert result.exit_code == 2 and "pbstk-job.json" in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    bad = pbstk("adopt", "12 server;x", str(tmp_path))
    assert bad.exit_code == 2 and "bad job id" in bad.stderr, bad.output
