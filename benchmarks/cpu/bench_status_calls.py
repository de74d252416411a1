"""Scheduler calls per status poll, for N jobs: pbstk against vec-inf's way of asking.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/cpu/bench_status_calls.py [--jobs 1,4,16]

Every scheduler client (qstat, squeue, sacct, scontrol) is wrapped in a counting shim placed first on PATH, N
jobs are submitted for real, and one status poll is made; the shims' log is the measurement:

- **pbstk**: ``pbs_toolkit.jobs.status.status(records)`` (what ``pbstk status`` runs) for N records, against
  the fake PBS of the test suite, and against the real two-node Slurm of the test suite (tests/slurm_cluster.py)
  when a backend named ``slurm`` is registered and the Slurm packages are installed.
- **vec-inf**: its calls replayed against the same real Slurm. ``vec-inf status JOB_ID`` runs
  ``scontrol show job JOB_ID --oneliner`` once per job (``ModelStatusMonitor._get_raw_status_output`` in
  vec_inf/client/_helper.py); ``vec-inf status`` without an id first lists jobs with ``squeue --me --noheader``
  and runs ``scontrol show job -o ID`` per listed job to keep its own (``VecInfClient.fetch_running_jobs`` in
  vec_inf/client/api.py), then the per-job status call above (VectorInstitute/vector-inference at 7806bfe).

Without Slurm installed the vec-inf columns are the call counts read from that source (marked ``*``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from pbs_toolkit.jobs.status import status  # noqa: E402
from pbs_toolkit.jobs.store import JobRecord  # noqa: E402
from pbs_toolkit.schedulers import BACKENDS  # noqa: E402

FAKEPBS_BIN = ROOT / "tests" / "fakepbs" / "bin"
COUNTED = ("qstat", "squeue", "sacct", "scontrol")


class Shims:
    """A directory of counting wrappers around the scheduler clients that ``path`` finds."""

    def __init__(self, directory: Path, path: str) -> None:
        self.directory, self.log = directory, directory / "calls.log"
        directory.mkdir(parents=True, exist_ok=True)
        for tool in COUNTED:
            real = shutil.which(tool, path=path)
            if real is None:
                continue
            shim = directory / tool
            shim.write_text("#!/bin/sh\n"
                            f"printf '%s\\n' {shlex.quote(tool)} >> {shlex.quote(str(self.log))}\n"
                            f'exec {shlex.quote(real)} "$@"\n')
            shim.chmod(0o755)
        self.path = f"{directory}{os.pathsep}{path}"

    def counted(self, action: Callable[[], object]) -> tuple[Counter[str], float]:
        """Calls made by ``action()`` (with the shims first on PATH) and its wall time in seconds."""
        self.log.write_text("")
        old = os.environ["PATH"]
        os.environ["PATH"] = self.path
        try:
            start = time.perf_counter()
            action()
            elapsed = time.perf_counter() - start
        finally:
            os.environ["PATH"] = old
        return Counter(self.log.read_text().split()), elapsed


def records(scheduler: str, ids: list[str], work: Path) -> list[JobRecord]:
    out = []
    for job_id in ids:
        run_dir = work / f"run-{job_id}"
        run_dir.mkdir(parents=True, exist_ok=True)
        out.append(JobRecord(job_id=job_id, scheduler=scheduler, profile="bench", model="org/m",
                             served_model_name="m", preset="bench", name=f"bench-{job_id}", run_dir=str(run_dir)))
    return out


def quiet_status(recs: list[JobRecord]) -> None:
    status(recs, store=None, warn=lambda _line: None)


@contextmanager
def fake_pbs(work: Path) -> Iterator[dict[str, str]]:
    home = work / "fakepbs"
    home.mkdir()
    env = {"FAKEPBS_HOME": str(home), "FAKEPBS_KILL_DELAY": "1", "FAKEPBS_EXITING_DELAY": "0.2"}
    os.environ.update(env)
    try:
        yield env
    finally:
        jobs = [p.stem for p in (home / "jobs").glob("*.json")] if (home / "jobs").is_dir() else []
        if jobs:
            subprocess.run([str(FAKEPBS_BIN / "qdel"), *jobs], capture_output=True, check=False)  # noqa: S603


def pbs_poll(work: Path, n: int) -> tuple[Counter[str], float]:
    script = work / "job.sh"
    script.write_text("#!/bin/bash\nsleep 120\n")
    path = f"{FAKEPBS_BIN}{os.pathsep}{os.environ['PATH']}"
    ids = []
    for _ in range(n):
        result = subprocess.run([str(FAKEPBS_BIN / "qsub"), "-l", "walltime=00:05:00", "-o", str(work),  # noqa: S603
                                 "-e", str(work), str(script)], capture_output=True, text=True, check=True,
                                cwd=work)
        ids.append(result.stdout.strip())
    shims = Shims(work / f"shims-pbs-{n}", path)
    return shims.counted(lambda: quiet_status(records("pbs", ids, work / "runs")))


def slurm_polls(work: Path, sizes: list[int]) -> dict[int, dict[str, tuple[Counter[str], float]]]:
    """pbstk (when the backend exists) and vec-inf's calls against the real Slurm, for each N."""
    from slurm_cluster import missing_packages, start_slurm_cluster

    if missing_packages():
        return {}
    results: dict[int, dict[str, tuple[Counter[str], float]]] = {}
    with start_slurm_cluster(work / "slurm") as cluster:
        os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
        shims = Shims(work / "shims-slurm", cluster.env["PATH"])
        for n in sizes:
            ids = [cluster.run("sbatch", "--parsable", f"--output={work}/%j.out", "--job-name=bench-vec-inf",
                               "--wrap=sleep 300").stdout.strip() for _ in range(n)]
            row = {}
            if "slurm" in BACKENDS:
                row["pbstk"] = shims.counted(lambda ids=ids: quiet_status(records("slurm", ids, work / "runs")))
            row["vec-inf status ID (each job)"] = shims.counted(
                lambda ids=ids: [client("scontrol", "show", "job", i, "--oneliner") for i in ids])
            row["vec-inf status (all)"] = shims.counted(vec_inf_status_all)
            results[n] = row
            cluster.cancel_all()
    return results


def vec_inf_status_all() -> None:
    """``vec-inf status`` without an id: fetch_running_jobs (squeue, then scontrol per job), then get_status."""
    listed = client("squeue", "--me", "--noheader")
    ids = [line.split()[0] for line in listed.splitlines() if line.strip()]
    for job_id in ids:
        client("scontrol", "show", "job", "-o", job_id)
    for job_id in ids:
        client("scontrol", "show", "job", job_id, "--oneliner")


def client(*argv: str) -> str:
    """A Slurm client found on the current PATH (the shims); its stdout."""
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout  # noqa: S603 - argument list


def cell(result: tuple[Counter[str], float] | None) -> str:
    if result is None:
        return "n/a"
    calls, seconds = result
    detail = " + ".join(f"{count} {tool}" for tool, count in sorted(calls.items())) or "0"
    return f"{sum(calls.values())} ({detail}; {seconds * 1000:.0f} ms)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="1,4,16", help="comma list of job counts N (default 1,4,16)")
    sizes = [int(n) for n in parser.parse_args().jobs.split(",")]
    with tempfile.TemporaryDirectory(prefix="pbstk-bench-calls-") as tmp:
        work = Path(tmp)
        for sub in ("config", "state", "data"):
            (work / "xdg" / sub).mkdir(parents=True)
            os.environ[f"XDG_{sub.upper()}_HOME"] = str(work / "xdg" / sub)
        pbs: dict[int, tuple[Counter[str], float]] = {}
        with fake_pbs(work):
            for n in sizes:
                (work / f"pbs-{n}").mkdir()
                pbs[n] = pbs_poll(work / f"pbs-{n}", n)
        slurm = slurm_polls(work, sizes)
    print("| N jobs | pbstk, PBS (fake qstat) | pbstk, Slurm (real) | vec-inf `status ID` per job | "
          "vec-inf `status` (all) |")
    print("|---|---|---|---|---|")
    for n in sizes:
        row = slurm.get(n, {})
        each = cell(row.get("vec-inf status ID (each job)")) if row else f"{n} scontrol *"
        every = cell(row.get("vec-inf status (all)")) if row else f"{1 + 2 * n} (1 squeue + {2 * n} scontrol) *"
        print(f"| {n} | {cell(pbs[n])} | {cell(row.get('pbstk'))} | {each} | {every} |")


if __name__ == "__main__":
    main()
