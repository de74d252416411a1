#!/usr/bin/env python3
"""What the SSH connection holder saves: logins and wall time of ``pbstk status`` over SSH, with and without it.

A real sshd on loopback (``tests/sshd.py``) plays the login node, the fake PBS in ``tests/fakepbs`` runs behind
it, and a temporary job store tracks a few finished jobs submitted there. Then, as a user would (fresh
processes), ``pbstk status --json`` runs ``--runs`` times (default 20) in each mode:

  * direct (``PBSTK_SSH_PERSIST=0``, the old behaviour): every command logs in;
  * held (``PBSTK_SSH_PERSIST=600``): the first command starts the holder (one login), the rest reuse it.

It prints the logins counted from sshd's log (``Accepted publickey``; goal: ``--runs`` vs 1), the median wall
time of a direct command (cold: a new SSH login each time), of a held command reusing the holder (warm) and of
a held command that must start the holder first (measured ``--cold`` times, each after ``pbstk ssh close``),
and the cold/warm ratio. Everything lives in a temp directory removed at the end; every holder is closed.

    python benchmarks/cpu/bench_ssh_reuse.py [--runs 20] [--jobs 3] [--cold 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from bench_status import FAKEPBS_BIN, JOB_SCRIPT, fresh_store  # noqa: E402


def queued_jobs(count: int, runs: Path, env: dict[str, str]) -> list[tuple[str, str]]:
    """``count`` trivial jobs that stay queued (``FAKEPBS_QUEUE_DELAY``): every status asks qstat over SSH."""
    jobs = []
    for index in range(count):
        run_dir = runs / f"bench-{index:04d}"
        run_dir.mkdir(parents=True)
        (run_dir / "job.pbs").write_text(JOB_SCRIPT)
        out = subprocess.run(["qsub", str(run_dir / "job.pbs")], env=env, capture_output=True, text=True,  # noqa: S603,S607
                             check=True)
        jobs.append((out.stdout.strip(), str(run_dir)))
    return jobs


def logins(log: Path) -> int:
    return log.read_text(errors="replace").count("Accepted publickey")


def pbstk(env: dict[str, str], *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pbs_toolkit", *args], env=env,  # noqa: S603
                          capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"pbstk {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return wall, proc


def status_runs(env: dict[str, str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        wall, proc = pbstk(env, "status", "--json")
        states = {s["state"] for s in json.loads(proc.stdout)}
        assert states == {"PENDING"}, states
        times.append(wall)
    return times


def first_command(host: str, persist: float, times: int) -> list[float]:
    """In this process: a new runner's first command (``true``), i.e. the login (direct) or the holder round trip
    (held, warm), without Python's start-up and imports, which every ``pbstk`` process pays either way."""
    from pbs_toolkit.transports.ssh import SSHRunner

    walls = []
    for _ in range(times):
        start = time.perf_counter()
        with SSHRunner(host, persist=persist) as runner:
            assert runner.run(["true"]).ok
        walls.append(time.perf_counter() - start)
    return walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="status commands per mode")
    parser.add_argument("--jobs", type=int, default=3, help="tracked jobs")
    parser.add_argument("--cold", type=int, default=5, help="holder starts to time")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="pbstk-bench-ssh-"))
    sockets = Path(tempfile.mkdtemp(prefix="pbstk-b-"))  # short: a Unix socket path has 108 bytes
    env: dict[str, str] = {}
    jobs: list[tuple[str, str]] = []
    try:
        fakepbs_home = tmp / "fakepbs"
        fakepbs_home.mkdir()
        for sub in ("config", "data", "state"):
            (tmp / sub).mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PBSTK_", "FAKEPBS_"))}
        env.pop("SSH_AUTH_SOCK", None)
        env.update({
            "PATH": f"{FAKEPBS_BIN}{os.pathsep}{os.environ['PATH']}", "FAKEPBS_HOME": str(fakepbs_home),
            "FAKEPBS_QUEUE_DELAY": "3600", "XDG_CONFIG_HOME": str(tmp / "config"),
            "XDG_DATA_HOME": str(tmp / "data"), "XDG_STATE_HOME": str(tmp / "state"),
            "PBSTK_RUNS_ROOT": str(tmp / "runs"), "PBSTK_SSH_SOCKET_DIR": str(sockets),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        })
        os.environ.update(env)
        jobs = queued_jobs(args.jobs, tmp / "runs", env)

        sys.path.insert(0, str(ROOT / "tests"))
        from sshd import start_sshd

        fake_env = {k: v for k, v in env.items() if k.startswith("FAKEPBS_")}
        with start_sshd(tmp / "login", fake_env) as info:
            env.update({"PBSTK_SSH_CONFIG": str(info.ssh_config), "PBSTK_KNOWN_HOSTS": str(info.known_hosts)})
            fresh_store(tmp / "state", jobs, info.alias)

            before = logins(info.log)
            direct = status_runs({**env, "PBSTK_SSH_PERSIST": "0"}, args.runs)
            direct_logins = logins(info.log) - before

            held_env = {**env, "PBSTK_SSH_PERSIST": "600"}
            before = logins(info.log)
            held = status_runs(held_env, args.runs)
            held_logins = logins(info.log) - before

            os.environ.update(env)
            import paramiko  # noqa: F401 - imported before timing: both modes need it

            first_direct = first_command(info.alias, 0, 10)
            first_held = first_command(info.alias, 600, 10)
            cold = []
            for _ in range(args.cold):
                pbstk(held_env, "ssh", "close", "--all")
                cold.extend(status_runs(held_env, 1))
            pbstk(held_env, "ssh", "close", "--all")

        baseline = [pbstk(env, "--version")[0] for _ in range(5)]
        warm = statistics.median(held[1:])
        cold_direct = statistics.median(direct)
        print(f"{args.runs} x `pbstk status --json` over SSH ({args.jobs} tracked jobs, loopback sshd)\n")
        print(f"{'mode':<34}{'logins':>8}{'median s':>10}{'min s':>8}{'max s':>8}")
        print(f"{'direct (PBSTK_SSH_PERSIST=0)':<34}{direct_logins:>8}{cold_direct:>10.3f}{min(direct):>8.3f}"
              f"{max(direct):>8.3f}")
        print(f"{'held, reusing the holder (warm)':<34}{held_logins:>8}{warm:>10.3f}{min(held[1:]):>8.3f}"
              f"{max(held[1:]):>8.3f}")
        print(f"{'held, starting the holder (cold)':<34}{args.cold:>8}{statistics.median(cold):>10.3f}"
              f"{min(cold):>8.3f}{max(cold):>8.3f}")
        print(f"{'baseline: pbstk --version':<34}{'-':>8}{statistics.median(baseline):>10.3f}{min(baseline):>8.3f}"
              f"{max(baseline):>8.3f}")
        direct_first, held_first = statistics.median(first_direct), statistics.median(first_held)
        print(f"\nin-process, a new runner's first command (median of 10): direct {direct_first:.3f} s"
              f", through the warm holder {held_first:.3f} s ({direct_first / held_first:.1f}x)")
        print(f"\nlogins: {direct_logins} direct vs {held_logins} held (goal {args.runs} vs 1): "
              f"{'met' if (direct_logins, held_logins) == (args.runs, 1) else 'MISSED'}")
        print(f"wall: direct/warm = {cold_direct / warm:.2f}x, holder start/warm = "
              f"{statistics.median(cold) / warm:.2f}x")
    finally:
        if env:
            subprocess.run([sys.executable, "-m", "pbs_toolkit", "ssh", "close", "--all"],  # noqa: S603
                           env={**env, "PBSTK_SSH_PERSIST": "600"}, capture_output=True, check=False)
        if env:
            subprocess.run(["qdel", *[job for job, _ in jobs]], env=env, capture_output=True, check=False)  # noqa: S603,S607
        shutil.rmtree(sockets, ignore_errors=True)  # a holder left behind exits once its socket is gone
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
