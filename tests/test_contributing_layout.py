"""CONTRIBUTING.md's module listing is generated from the docstrings: it must match the package as it is."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_layout_in_contributing_matches_the_package() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "layout.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_shipped_module_and_template_is_described() -> None:
    listing = subprocess.run([sys.executable, str(ROOT / "scripts" / "layout.py")],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert "(no docstring)" not in listing
    assert "(not described in scripts/layout.py)" not in listing
    for path in (ROOT / "pbs_toolkit").rglob("*.py"):
        if path.name != "__init__.py":
            assert f" {path.name} " in listing, path
