"""The generic layers name no scheduler: everything PBS- or Slurm-specific lives in ``schedulers/<backend>/`` (and
the profile YAMLs that choose one). A new backend then touches its own directory and the registry only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pbs_toolkit.schedulers import BACKENDS

PACKAGE = Path(__file__).resolve().parent.parent / "pbs_toolkit"
#: scheduler words; the package's own names (pbs_toolkit, pbs-toolkit, pbstk) are not among them
WORDS = re.compile(r"\bPBS\b|pbs(dsh|nodefile)|PBS_[A-Z]|qsub|qstat|qdel|[Ss]lurm|SLURM_|sbatch|squeue|scancel|srun")
BACKEND_DIRS = [d for d in (PACKAGE / "schedulers").iterdir() if d.is_dir() and (d / "__init__.py").exists()]
# the registry lists the backends by class: its imports name them
ALLOWED = {PACKAGE / "schedulers" / "__init__.py"}


def _generic_files() -> list[Path]:
    files = []
    for path in sorted(PACKAGE.rglob("*")):
        if not path.is_file() or path.suffix in (".pyc",) or path in ALLOWED:
            continue
        if any(path.is_relative_to(d) for d in BACKEND_DIRS):
            continue
        if path.parent == PACKAGE / "settings" / "profiles" and path.suffix == ".yaml":
            continue
        files.append(path)
    return files


def test_generic_layers_name_no_scheduler() -> None:
    hits = []
    for path in _generic_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if WORDS.search(line):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not hits, "scheduler names in generic layers:\n" + "\n".join(hits)


def test_the_check_sees_the_generic_files() -> None:
    names = {str(p.relative_to(PACKAGE)) for p in _generic_files()}
    assert {"server/start/launcher.sh", "server/start_vllm.sh.j2", "jobs/status.py", "schedulers/base.py"} <= names


#: files allowed to branch on a backend's name: none
NAME_BRANCH_EXEMPT: set[Path] = set()
#: calls that take a backend's name: naming one there is choosing a backend in generic code
_BY_NAME = {"get_scheduler", "backend_class"}


def _names_in(node: ast.AST) -> list[str]:
    """The backend names a comparison operand spells: ``"pbs"``, or inside ``("pbs", "slurm")``."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and i.value in BACKENDS]


def _about_backend(name: str, other: ast.AST) -> bool:
    """``"local"`` is also the local transport's name (``runner.name``) and a router place: it counts as a
    backend's name where the other side is about a scheduler (``profile.scheduler``, ``scheduler.name``)."""
    text = ast.unparse(other).lower()
    return name != "local" or "sched" in text or "backend" in text


def backend_name_branches(source: str) -> list[tuple[int, str]]:
    """Where ``source`` compares something with a backend's name as a string (``x == "local"``,
    ``x in ("pbs", "slurm")``, ``case "slurm":``) or picks one by name (``get_scheduler("pbs")``)."""
    hits: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for a, b in zip(operands, operands[1:]):
                if any(_about_backend(n, b) for n in _names_in(a)) or any(_about_backend(n, a) for n in _names_in(b)):
                    hits.append((node.lineno, ast.unparse(node)))
                    break
        elif isinstance(node, ast.Match):
            for case in node.cases:
                values = [p.value for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue)]
                if any(_about_backend(n, node.subject) for v in values for n in _names_in(v)):
                    hits.append((case.pattern.lineno, f"case {ast.unparse(case.pattern)}"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in _BY_NAME:
            if any(n for arg in node.args for n in _names_in(arg)):
                hits.append((node.lineno, ast.unparse(node)))
    return hits


def test_generic_code_never_branches_on_a_backend_name() -> None:
    """A backend's behaviour is an attribute of its class (``Scheduler.runs_on_submit_host``, ``node_launchers``,
    ...): generic code that tests ``profile.scheduler == "local"`` breaks the day a second backend needs the same."""
    hits = []
    for path in _generic_files():
        if path.suffix != ".py" or path in NAME_BRANCH_EXEMPT:
            continue
        for number, text in backend_name_branches(path.read_text(encoding="utf-8")):
            hits.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {text}")
    assert not hits, "generic code branches on a backend's name:\n" + "\n".join(hits)


@pytest.mark.parametrize(("code", "found"), [
    ('if profile.scheduler != "local":\n    pass\n', True),
    ('ok = rec.scheduler in ("pbs", "slurm")\n', True),
    ('ok = "slurm" == name\n', True),
    ('match profile.scheduler:\n    case "local":\n        pass\n', True),
    ('s = get_scheduler("pbs")\n', True),
    ('here = runner.name == "local"\n', False),  # the local transport, not the backend
    ('if place == "local":\n    pass\n', False),  # a router place
    ('if profile.scheduler == other:\n    pass\n', False),
])
def test_the_name_check_sees_a_branch(code: str, found: bool) -> None:
    assert bool(backend_name_branches(code)) is found
