"""The project's own shell scripts (``scripts/``, ``benchmarks/``, ``.ci/run``) pass shellcheck, as the rendered
job scripts do (tests/test_render.py, tests/test_multinode_render.py). The GPU scripts run only on lent machines,
where a quoting slip costs a device call: this is the check they get here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def project_scripts() -> list[Path]:
    found = sorted({*ROOT.glob("scripts/*.sh"), *ROOT.glob("benchmarks/**/*.sh"), ROOT / ".ci" / "run"})
    return [path for path in found if path.is_file()]


def test_the_projects_own_shell_scripts_pass_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    scripts = project_scripts()
    assert ROOT / "benchmarks" / "gpu" / "session.sh" in scripts and len(scripts) >= 10, scripts
    # -x follows the `source`s (setup_device.sh, the staged install script where it exists) from the checkout root,
    # where the scripts run
    check = subprocess.run(["shellcheck", "-x", *[str(p.relative_to(ROOT)) for p in scripts]],  # noqa: S603,S607
                           cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
