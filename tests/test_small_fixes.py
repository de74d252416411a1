"""Small refusals and fixes: ``env --local-url`` with its own ``/v1``, ``tune --png`` without matplotlib."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import launch, pbstk

from pbs_toolkit.jobs.store import JobStore


@pytest.mark.parametrize("given", ["http://localhost:9999", "http://localhost:9999/", "http://localhost:9999/v1",
                                   "http://localhost:9999/v1/"])
def test_env_local_url_gets_v1_once(fakepbs: Path, standins: Path, given: str) -> None:
    launch()
    result = pbstk("env", "--timeout", "30", "--local-url", given)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "export OPENAI_BASE_URL=http://localhost:9999/v1" in lines, lines
    assert "export PBSTK_SERVER_ROOT=http://localhost:9999" in lines, lines
    assert "v1/v1" not in result.stdout


def test_tune_png_without_matplotlib_refuses_before_launching(standins: Path, isolated_user: Path,
                                                             tmp_path: Path) -> None:
    fake = tmp_path / "nomatplotlib" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is not installed (test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), *sys.path])}
    png = tmp_path / "chart.png"
    proc = subprocess.run(  # noqa: S603 - argument list
        [sys.executable, "-m", "pbs_toolkit", "tune", "Qwen/Qwen3-1.7B", "--profile", "local-gpu",
         "--presets", "single", "--png", str(png)],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == ["pbstk: error: --png needs matplotlib: pip install 'pbs-toolkit[plot]'"]
    assert JobStore().all() == [] and JobStore().intents() == []
    assert list((isolated_user / "runs").iterdir()) == []
    assert not png.exists()
