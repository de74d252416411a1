"""The generic layers name no scheduler: everything PBS- or Slurm-specific lives in ``schedulers/<backend>/`` (and
the profile YAMLs that choose one). A new backend then touches its own directory and the registry only."""

from __future__ import annotations

import re
from pathlib import Path

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
    assert {"server/start_vllm.sh", "server/start_vllm.sh.j2", "jobs/status.py", "schedulers/base.py"} <= names
