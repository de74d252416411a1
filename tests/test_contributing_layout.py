"""CONTRIBUTING.md's module listing is generated from the docstrings: it must match the package as it is."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def layout() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layout_script", ROOT / "scripts" / "layout.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_layout_in_contributing_matches_the_package() -> None:
    assert layout().main(["--check"]) == 0, "run: python scripts/layout.py --write"


def test_every_shipped_module_and_template_is_described() -> None:
    listing = "\n".join(layout().listing())
    assert "(no docstring)" not in listing
    assert "(not described in scripts/layout.py)" not in listing
    for path in (ROOT / "pbs_toolkit").rglob("*.py"):
        if path.name != "__init__.py":
            assert f" {path.name} " in listing, path
