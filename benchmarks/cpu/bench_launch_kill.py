#!/usr/bin/env python3
"""Orphans left by ``kill -9`` of ``pbstk launch``: kill it at N evenly spaced moments, count jobs nobody knows.

Each round starts ``pbstk launch`` (a fresh process: ``sys.executable -m pbs_toolkit``) against the fake PBS of
``tests/fakepbs`` with a slow ``qsub`` (``slow_qsub``: the job exists before qsub prints its id, as on a loaded
server), sends SIGKILL after a delay that sweeps the launch from its start to past its end, then asks a fresh
``pbstk jobs --all --json`` which jobs it knows. An orphan is a job the fake PBS still runs that ``pbstk jobs``
does not list: the user cannot see it nor cancel it with pbstk. Every job is deleted after each round.

    python benchmarks/cpu/bench_launch_kill.py [--moments 15] [--slow-qsub 1.0]

Everything lives in a temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKEPBS_BIN = ROOT / "tests" / "fakepbs" / "bin"
STANDINS = ROOT / "tests" / "standins"


def fake_jobs(home: Path) -> dict[str, str]:
    out = {}
    for path in (home / "jobs").glob("*.json"):
        data = json.loads(path.read_text())
        out[data["id"]] = data["attrs"]["job_state"]
    return out


def one_round(delay: float, env: dict[str, str], home: Path, settle: float) -> tuple[int, int]:
    """(jobs submitted, orphans) after killing a launch ``delay`` seconds in."""
    argv = [sys.executable, "-m", "pbs_toolkit", "launch", "org/model", "--preset", "dp4", "--profile",
            "generic-pbspro", "--port", "auto", "--name", f"kill-{delay:.2f}"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: S603
    time.sleep(delay)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(settle)  # a qsub whose parent died still finishes (it runs in its own session): let it
    listed = subprocess.run([sys.executable, "-m", "pbs_toolkit", "jobs", "--all", "--json"],  # noqa: S603
                            env=env, capture_output=True, text=True, check=False)
    known = {r["job_id"] for r in json.loads(listed.stdout or "[]")} if listed.returncode == 0 else set()
    jobs = fake_jobs(home)
    live = {job for job, state in jobs.items() if state != "F"}
    orphans = len(live - known)
    if jobs:
        subprocess.run(["qdel", *jobs], env=env, capture_output=True, check=False)  # noqa: S603,S607
    for path in (home / "jobs").glob("*.json"):
        path.unlink()
    return len(jobs), orphans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moments", type=int, default=15, help="kill moments, evenly spread")
    parser.add_argument("--slow-qsub", type=float, default=1.0, help="seconds qsub waits before printing the id")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pbstk-bench-kill-"))
    try:
        home = tmp / "fakepbs"
        home.mkdir()
        for sub in ("config", "data", "state", "runs"):
            (tmp / sub).mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PBSTK_", "FAKEPBS_"))}
        env.update({
            "PATH": os.pathsep.join([str(FAKEPBS_BIN), str(STANDINS), os.environ["PATH"]]),
            "FAKEPBS_HOME": str(home), "FAKEPBS_QUEUE_DELAY": "30", "XDG_CONFIG_HOME": str(tmp / "config"),
            "XDG_DATA_HOME": str(tmp / "data"), "XDG_STATE_HOME": str(tmp / "state"),
            "PBSTK_RUNS_ROOT": str(tmp / "runs"),
        })
        (home / "faults.json").write_text(json.dumps({"slow_qsub": args.slow_qsub}))
        # how long an undisturbed launch takes sets the sweep
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pbs_toolkit", "launch", "org/model", "--preset", "dp4",  # noqa: S603
                        "--profile", "generic-pbspro", "--port", "auto", "--name", "calibrate"],
                       env=env, capture_output=True, check=True)
        whole = time.perf_counter() - start
        subprocess.run(["qdel", *fake_jobs(home)], env=env, capture_output=True, check=False)  # noqa: S603,S607
        for path in (home / "jobs").glob("*.json"):
            path.unlink()
        print(f"an undisturbed launch takes {whole:.2f} s (qsub sleeps {args.slow_qsub:g} s before its answer)")
        total_orphans = submitted = 0
        for index in range(args.moments):
            delay = whole * 1.1 * index / max(1, args.moments - 1)
            jobs, orphans = one_round(delay, env, home, args.slow_qsub + 0.5)
            submitted += jobs
            total_orphans += orphans
            print(f"  kill -9 at {delay:5.2f} s: {jobs} job(s) submitted, {orphans} orphan(s)")
        print(f"{args.moments} kills: {submitted} jobs submitted, {total_orphans} orphans")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
