"""``pbstk render MODEL -o DIR`` writes a pair that runs as written: ``qsub DIR/job.pbs`` by hand (the fake
PBS's real qsub, the stand-in vLLM) reaches READY, its server answering ``/v1/models`` on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from helpers import MODEL, pbstk, wait_for

from pbs_toolkit import paths

#: generic-pbspro answers on its FQDN; tests stay on loopback (config.yaml may set any profile key)
LOOPBACK = "profiles:\n  generic-pbspro:\n    address: loopback\n    bind_host: 127.0.0.1\n"


def loopback_config() -> None:
    path = paths.user_config_dir() / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(LOOPBACK)


def ready_marker(run_dir: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((run_dir / "server.json").read_text())
    except (OSError, ValueError):
        return None
    if state.get("phase") in ("failed", "exited"):
        raise AssertionError(f"server ended: {state}; log: {(run_dir / 'vllm.log').read_text()[-2000:]}")
    return state if state.get("phase") == "ready" else None


def served_models(port: int, key: str) -> list[str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=5) as resp:  # noqa: S310
        return [m["id"] for m in json.loads(resp.read())["data"]]


def test_render_o_dir_then_qsub_reaches_ready(fakepbs: Path, standins: Path, tmp_path: Path) -> None:
    loopback_config()
    out = tmp_path / "rendered"
    result = pbstk("render", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "--port", "auto",
                   "--name", "byhand", "-o", str(out))
    assert result.exit_code == 0, result.output
    job_script = (out / "job.pbs").read_text()
    assert f"RUN_DIR={out}\n" in job_script and f"#PBS -o {out}/pbs.out" in job_script
    assert f"RUN_DIR={out}\n" in (out / "start_vllm.sh").read_text()

    elsewhere = tmp_path / "cwd"  # qsub from another directory: the paths are absolute
    elsewhere.mkdir()
    submitted = subprocess.run(["qsub", str(out / "job.pbs")], capture_output=True, text=True,  # noqa: S603,S607
                               cwd=elsewhere, env=os.environ.copy(), timeout=30, check=False)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    try:
        state = wait_for(lambda: ready_marker(out), 30, "server.json to say ready")
        assert served_models(int(state["port"]), (out / "api_key").read_text().strip()) == [MODEL]  # render's key
        # -k doe: PBS writes the job's output in place, into the run directory the -o directive names
        assert (out / "pbs.out").read_text().startswith(f"pbstk: job {job_id} on ")
    finally:
        subprocess.run(["qdel", job_id], capture_output=True, timeout=30, check=False)  # noqa: S603,S607


def test_render_o_relative_dir_becomes_absolute(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    result = pbstk("render", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "-o", "rel")
    assert result.exit_code == 0, result.output
    assert f"RUN_DIR={tmp_path}/rel\n" in (tmp_path / "rel" / "job.pbs").read_text()


def test_render_o_with_run_dir_keeps_the_given_run_dir(tmp_path: Path) -> None:
    result = pbstk("render", MODEL, "--preset", "dp4", "--profile", "generic-pbspro", "-o", str(tmp_path / "o"),
                   "--run-dir", "/shared/runs/mine")
    assert result.exit_code == 0, result.output
    assert "RUN_DIR=/shared/runs/mine\n" in (tmp_path / "o" / "job.pbs").read_text()
