"""Where the test suite's CPU goes: each test's CPU seconds, its own and every process it started, on 2 shared cores.

CI runs the suite on 2 cores and it is CPU-bound there (about 91% of both cores busy for the whole run), so its
wall time is its CPU divided by about 1.8; a test's wall time says little (it waits, or waits for CPU). As a pytest
plugin this puts each pytest-xdist worker in a cgroup (v1 ``cpuacct``, so: Linux, root) of its own: every process a
test starts, detached servers and jobs included, is counted with the worker that started it, and each test's CPU
is the group's usage before and after it. Then the report sums it per test and per file.

    PYTHONPATH=benchmarks/cpu SUITE_CPU_OUT=/tmp/suite-cpu .venv/bin/python -m pytest -p suite_cpu -n 6 \\
        --dist loadgroup tests                      # with the environment scripts/test.sh sets
    python benchmarks/cpu/suite_cpu.py /tmp/suite-cpu [--top 40]

A process a test leaves running is counted with the tests that follow it on that worker; the groups are left
behind (they cannot be removed while a process is in them) and are empty once those processes end.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CGROUP = Path("/sys/fs/cgroup/cpuacct")
_state: dict[str, Any] = {"group": None, "rows": []}


def _usage() -> float:
    group: Path = _state["group"]
    return int((group / "cpuacct.usage").read_text()) / 1e9


def pytest_configure(config: Any) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    group = CGROUP / f"suite-cpu-{worker}-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        raise SystemExit(f"suite_cpu: cannot use {CGROUP} ({exc}): it needs cgroup v1 cpuacct and root") from exc
    _state["group"] = group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    cpu, wall = _usage(), time.monotonic()
    yield
    _state["rows"].append({"test": item.nodeid, "cpu": _usage() - cpu, "wall": time.monotonic() - wall})


def pytest_sessionfinish(session: Any) -> None:
    group = _state["group"]
    if group is None:
        return
    out = Path(os.environ.get("SUITE_CPU_OUT", "suite-cpu"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{group.name}.json").write_text(json.dumps({"total": _usage(), "rows": _state["rows"]}))


def report(folder: Path, top: int) -> None:
    rows: list[dict[str, Any]] = []
    total = 0.0
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        total += doc["total"]
        rows += doc["rows"]
    per_file: collections.Counter[str] = collections.Counter()
    for row in rows:
        per_file[row["test"].split("::")[0]] += row["cpu"]
    print(f"{len(rows)} tests, {total:.0f} CPU s in all ({sum(r['cpu'] for r in rows):.0f} inside tests)")
    print("\nCPU s  file")
    for name, cpu in per_file.most_common(top):
        print(f"{cpu:6.1f}  {name}")
    print("\nCPU s  wall s  test")
    for row in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        print(f"{row['cpu']:6.1f}  {row['wall']:6.1f}  {row['test']}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="SUITE_CPU_OUT of the run")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    report(args.folder, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
