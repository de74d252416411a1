"""``render`` and ``launch --dry-run`` connect nowhere. For a remote host, ``~`` in the runs root and the
profile's paths is the REMOTE home: rendered as ``"$HOME"/...`` for the remote shell, never this machine's home.
The SSH host here is a closed loopback port: any connection attempt would fail the command (exit 4)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import MODEL, pbstk, wait_for

from pbs_toolkit import paths
from pbs_toolkit.jobs.store import JobStore

#: nothing listens there (port 9, discard): a connection attempt is refused at once
UNREACHABLE = "pbstk-nobody@127.0.0.1:9"


@pytest.fixture
def local_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This machine's home for the test, and the profiles' own ``runs_root: ~/pbstk-runs`` (no PBSTK_RUNS_ROOT)."""
    home = tmp_path / "localhome"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("PBSTK_RUNS_ROOT")
    return home


def _scripts(stdout: str) -> tuple[str, str]:
    job, start = stdout.split("# ===== start_vllm.sh =====\n", 1)
    return job.split("\n", 1)[1], start


def test_render_for_a_remote_host_keeps_home_for_the_remote_shell(local_home: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBSTK_SSH_HOST", UNREACHABLE)
    result = pbstk("render", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--venv", "~/envs/vllm")
    assert result.exit_code == 0, result.output
    assert str(local_home) not in result.stdout
    job, start = _scripts(result.stdout)
    assert "\nRUN_DIR=\"$HOME\"/pbstk-runs/qwen3-vl-2b-instruct-" in job
    assert "\nRUN_DIR=\"$HOME\"/pbstk-runs/qwen3-vl-2b-instruct-" in start
    assert '\nVENV="$HOME"/envs/vllm\n' in start
    assert '\nVLLM_CACHE_DIR="$HOME"/.cache/pbstk-vllm\n' in start  # generic-pbspro: ~/.cache/pbstk-vllm
    # PBS does not expand $HOME in directives: no -o/-e, the job redirects its own output into the run dir
    assert "#PBS -o" not in job and "#PBS -e" not in job
    assert 'exec >>"$RUN_DIR/pbs.out" 2>>"$RUN_DIR/pbs.err"' in job
    if shutil.which("shellcheck"):
        for name, text in (("job.pbs", job), ("start_vllm.sh", start)):
            (tmp_path / name).write_text(text)
        argv = ["shellcheck", str(tmp_path / "job.pbs"), str(tmp_path / "start_vllm.sh")]
        check = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)  # noqa: S603
        assert check.returncode == 0, check.stdout


def test_remote_model_directory_is_not_looked_up_here(local_home: Path) -> None:
    result = pbstk("render", "~/models/my-model", "--preset", "dp4", "--profile", "generic-pbspro",
                   "--name", "mine", "--run-dir", "/remote/runs/x")
    assert result.exit_code == 2  # no ssh host: a local path must exist here
    path = paths.user_config_dir() / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"ssh_host: '{UNREACHABLE}'\n")
    remote = pbstk("render", "~/models/my-model", "--preset", "dp4", "--profile", "generic-pbspro",
                   "--name", "mine", "--run-dir", "/remote/runs/x")
    assert remote.exit_code == 0, remote.output
    assert '\nMODEL="$HOME"/models/my-model\n' in remote.stdout


def test_launch_dry_run_connects_nowhere(local_home: Path) -> None:
    result = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--ssh", UNREACHABLE,
                   "--dry-run")
    assert result.exit_code == 0, result.output
    assert "would write $HOME/pbstk-runs/qwen3-vl-2b-instruct-" in result.stdout
    assert 'RUN_DIR="$HOME"/pbstk-runs/' in result.stdout and str(local_home) not in result.stdout
    as_json = pbstk("launch", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--ssh", UNREACHABLE,
                    "--dry-run", "--json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["run_dir"].startswith("$HOME/pbstk-runs/")
    assert JobStore().all() == [] and JobStore().intents() == []
    assert not (local_home / "pbstk-runs").exists()


def test_local_profile_still_expands_this_machines_home(local_home: Path) -> None:
    result = pbstk("render", MODEL, "--profile", "local")
    assert result.exit_code == 0, result.output
    assert f"\nRUN_DIR={local_home}/pbstk-runs/qwen3-vl-2b-instruct-" in result.stdout
    assert "#PBS -o " + str(local_home) in result.stdout


def _ready(run_dir: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((run_dir / "server.json").read_text())
    except (OSError, ValueError):
        return None
    assert state.get("phase") not in ("failed", "exited"), (run_dir / "vllm.log").read_text()[-2000:]
    return state if state.get("phase") == "ready" else None


def test_home_relative_job_runs_where_the_remote_home_is(local_home: Path, tmp_path: Path, fakepbs: Path,
                                                        standins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline pair, placed where the remote shell puts ``$HOME/...``, runs under the fake PBS (jobs start
    with the submitter's HOME) and reaches READY; its output lands in the run directory without -o/-e."""
    config = paths.user_config_dir() / "config.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f"ssh_host: '{UNREACHABLE}'\naddress: loopback\nbind_host: 127.0.0.1\n")
    result = pbstk("render", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto")
    assert result.exit_code == 0, result.output
    job, start = _scripts(result.stdout)
    relative = job.split('RUN_DIR="$HOME"/', 1)[1].split("\n", 1)[0]
    remote_home = tmp_path / "remotehome"
    run_dir = remote_home / relative
    run_dir.mkdir(parents=True)
    (run_dir / "job.pbs").write_text(job)
    (run_dir / "start_vllm.sh").write_text(start)
    env = {**os.environ, "HOME": str(remote_home)}
    submitted = subprocess.run(["qsub", str(run_dir / "job.pbs")], capture_output=True, text=True,  # noqa: S603,S607
                               env=env, cwd=remote_home, timeout=30, check=False)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    try:
        wait_for(lambda: _ready(run_dir), 30, "server.json to say ready")
        assert (run_dir / "pbs.out").read_text().startswith(f"pbstk: job {job_id} on ")
    finally:
        subprocess.run(["qdel", job_id], capture_output=True, timeout=30, check=False)  # noqa: S603,S607
