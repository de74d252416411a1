"""The package's shape (issue 22): no module over 500 lines nor function over 60, no import cycle (function-level and
TYPE_CHECKING imports count), no private name imported across modules, no import up a floor (issue 29) or a rung
(issue 44). ``scripts/check_imports.py`` checks; these tests run it on the package, and on small packages made to
break each rule (so the check can fail)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_imports.py"

#: problems known and not yet fixed, as patterns: each must still match a problem (a fixed one is taken off), and
#: nothing else may be a problem.
PENDING: set[str] = set()


def check(package: Path) -> tuple[int, list[str]]:
    result = subprocess.run([sys.executable, str(SCRIPT), str(package)],  # noqa: S603
                            capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout.splitlines() if result.returncode else []


def test_the_package_keeps_the_house_rules() -> None:
    _, problems = check(ROOT / "pbs_toolkit")
    assert [p for p in problems if not any(re.match(k, p) for k in PENDING)] == []
    fixed = {k for k in PENDING if not any(re.match(k, p) for p in problems)}
    assert not fixed, f"fixed now: take {sorted(fixed)} off PENDING"


def write(package: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_a_clean_package_passes(tmp_path: Path) -> None:
    pkg = write(tmp_path / "pkg", {"__init__.py": "", "a.py": "from pkg.b import thing\n",
                                   "b.py": "thing = 1\n__all__ = ['thing']\n", "c.py": "from pkg import __version__\n"})
    assert check(pkg) == (0, [])


def test_function_level_and_type_checking_imports_close_a_circle(tmp_path: Path) -> None:
    pkg = write(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg.b import g\n    return g\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from .. import a\n",
    })
    rc, problems = check(pkg)
    assert rc == 1
    assert problems == ["cycle: pkg.a -> pkg.b -> pkg.sub.c -> pkg.a  (group: pkg.a, pkg.b, pkg.sub.c)"]


def test_private_names_and_long_modules_are_named(tmp_path: Path) -> None:
    pkg = write(tmp_path / "pkg", {"__init__.py": "", "a.py": "_x = 1\ny = _x\n" + "\n" * 500,
                                   "b.py": "def f():\n    from pkg.a import _x, y\n    return _x, y\n"})
    rc, problems = check(pkg)
    assert rc == 1
    assert problems == ["size: pkg/a.py has 502 lines (over 500)", "private: pkg/b.py:2 imports _x from pkg.a"]


def test_a_function_over_60_lines_is_named_and_60_pass(tmp_path: Path) -> None:
    body = "x = 1\n" * 58
    indented = "".join("        " + line for line in body.splitlines(keepends=True))
    pkg = write(tmp_path / "pkg", {"__init__.py": "", "a.py": "def ok():\n" + body.replace("x", "    x") +
                                   "    return x\n\n\nclass C:\n    def long(self):\n" + indented +
                                   "        x = 2\n        return x\n"})
    rc, problems = check(pkg)
    assert rc == 1
    assert problems == ["size: pkg/a.py:64 long has 61 lines (over 60)"]


#: a small package with the real floors' names (scripts/check_imports.py LAYERS): jobs above schedulers and errors
FLOORS = {"__init__.py": "", "errors.py": "class E(Exception):\n    pass\n", "paths.py": "from pkg.errors import E\n",
          "client.py": "from pkg.jobs import run\n", "jobs/__init__.py": "", "jobs/run.py": "from pkg import errors\n",
          "schedulers/__init__.py": "", "schedulers/local.py": "from pkg.errors import E\n"}


def test_floors_pass_when_every_import_goes_down(tmp_path: Path) -> None:
    assert check(write(tmp_path / "pkg", FLOORS)) == (0, [])


def test_an_import_up_a_floor_fails_inside_a_function_too(tmp_path: Path) -> None:
    pkg = write(tmp_path / "pkg", {**FLOORS, "schedulers/local.py": "def f():\n    from pkg.jobs import run\n",
                                   "errors.py": "import pkg.jobs\n"})
    rc, problems = check(pkg)
    assert rc == 1
    assert problems == [
        "layer: pkg/errors.py:1 imports pkg.jobs from floor 6 above its own errors (floor 0)",
        "layer: pkg/schedulers/local.py:2 imports pkg.jobs.run from floor 6 above its own schedulers (floor 3)",
    ]


def test_peers_on_one_floor_do_not_import_each_other(tmp_path: Path) -> None:
    pkg = write(tmp_path / "pkg", {**FLOORS, "vllm/__init__.py": "", "transports/__init__.py": "",
                                   "transports/http.py": "from pkg.vllm import prom\n", "vllm/prom.py": ""})
    rc, problems = check(pkg)
    assert rc == 1
    assert problems == ["layer: pkg/transports/http.py:1 imports pkg.vllm.prom from floor 2 above its own "
                        "transports (floor 2)"]


def test_a_type_hint_from_above_fails_too_and_an_unplaced_package_is_named(tmp_path: Path) -> None:
    pkg = write(tmp_path / "pkg", {**FLOORS, "jobs/run.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from pkg.services.keeper import thing\n", "gadgets/__init__.py": "",
                                   "services/__init__.py": "", "services/keeper.py": "thing = 1\n"})
    rc, problems = check(pkg)
    assert rc == 1
    assert problems == ["layer: pkg.gadgets is on no floor: give it one in LAYERS (scripts/check_imports.py)",
                        "layer: pkg/jobs/run.py:3 imports pkg.services.keeper from floor 9 above its own jobs "
                        "(floor 6) under TYPE_CHECKING: declare a Protocol instead"]


def test_a_module_placed_apart_from_its_package_obeys_its_own_floor(tmp_path: Path) -> None:
    """``settings.yamlio`` is on floor 0 though ``settings`` is on 4: transports may read the user's config
    through it, and it may not import the rest of settings."""
    pkg = write(tmp_path / "pkg", {**FLOORS, "settings/__init__.py": "", "settings/config.py": "",
                                   "settings/yamlio.py": "from pkg import paths\n",
                                   "transports/__init__.py": "",
                                   "transports/ssh.py": "from pkg.settings import yamlio\n"})
    assert check(pkg) == (0, [])
    write(pkg, {"settings/yamlio.py": "def f():\n    from pkg.settings import config\n"})
    assert check(pkg) == (1, ["layer: pkg/settings/yamlio.py:2 imports pkg.settings.config from floor 4 above its "
                              "own settings.yamlio (floor 0)"])


#: services' subpackages on their rungs (scripts/check_imports.py RUNGS): router below models below keeper
RUNGS = {**FLOORS, "services/__init__.py": "", "services/record.py": "", "services/manage.py": "from pkg.services."
         "keeper import slots\n", "services/router/__init__.py": "", "services/router/job.py": "from pkg.services "
         "import record\n", "services/models/__init__.py": "", "services/models/multi.py": "from pkg.services.router "
         "import job\n", "services/models/packing.py": "", "services/keeper/__init__.py": "",
         "services/keeper/slots.py": "", "services/keeper/loop.py": "from pkg.services.models import multi\n"
         "from pkg.services.router.job import x\nfrom pkg.services import manage\n"}


def test_a_subpackage_imports_only_rungs_below_its_own(tmp_path: Path) -> None:
    """The keeper may read models and the router, models the router; services' own top-level modules (record,
    manage...) are on no rung: every rung may import them and they may import every rung."""
    pkg = write(tmp_path / "pkg", RUNGS)
    assert check(pkg) == (0, [])
    write(pkg, {"services/models/multi.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from pkg.services.keeper.slots import A, B\n",
                "services/router/job.py": "def f():\n    from pkg.services.models import packing\n"})
    assert check(pkg) == (1, [
        "layer: pkg/services/models/multi.py:3 imports pkg.services.keeper.slots from services.keeper (rung 3) "
        "above its own services.models (rung 2) under TYPE_CHECKING",
        "layer: pkg/services/router/job.py:2 imports pkg.services.models.packing from services.models (rung 2) "
        "above its own services.router (rung 1)"])
