#!/usr/bin/env python3
"""How much one ``pbstk status`` costs the scheduler and the login node, for 1, 10 and 200 tracked jobs.

Submits real jobs (a trivial script) to the fake PBS in ``tests/fakepbs``, records them in a temporary job
store, then runs ``pbstk status --json`` as a user would (a fresh process) and counts:

  * ``qstat`` invocations (goal: 1, whatever the number of jobs), from the fake's ``calls.log``;
  * SSH connections when the jobs were submitted through a login node (goal: 1), from the test sshd's log
    (``Accepted publickey`` lines), with the same jobs behind the real sshd of ``tests/sshd.py``;
  * wall time of the whole command.

The jobs have finished by the time status runs (``qstat -x`` still lists them), so each status call also
reads every job's ``server.json`` and log tail: the per-job cost over SFTP shows in the SSH numbers.

``--hung N`` measures something else: N running jobs whose ``server.json`` names a port where a socket accepts
connections and never answers (a wedged server). Probes run concurrently, so one status call should cost about
one probe timeout (``PBSTK_PROBE_TIMEOUT_S``, default 3 s), not N of them.

Runs standalone: ``python benchmarks/cpu/bench_status.py [--sizes 1,10,200] [--hung 10]``. Everything lives in a temp
directory that is removed at the end; nothing of the user's ~/.config or job list is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FAKEPBS_BIN = ROOT / "tests" / "fakepbs" / "bin"
JOB_SCRIPT = "#!/bin/bash\n#PBS -N bench\n#PBS -l select=1:ncpus=1\n#PBS -l walltime=00:05:00\ntrue\n"


def qstat_calls(fakepbs_home: Path) -> int:
    path = fakepbs_home / "calls.log"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line and json.loads(line)["tool"] == "qstat")


def submit_jobs(count: int, runs: Path, env: dict[str, str]) -> list[tuple[str, str]]:
    """``count`` trivial jobs through the fake qsub; (job id, run dir) each, once all have finished."""

    def one(index: int) -> tuple[str, str]:
        run_dir = runs / f"bench-{index:04d}"
        run_dir.mkdir(parents=True)
        script = run_dir / "job.pbs"
        script.write_text(JOB_SCRIPT)
        out = subprocess.run(["qsub", "-o", str(run_dir / "pbs.out"), "-e", str(run_dir / "pbs.err"),  # noqa: S603,S607
                              str(script)], env=env, capture_output=True, text=True, check=True)
        return out.stdout.strip(), str(run_dir)

    with ThreadPoolExecutor(max_workers=8) as pool:
        jobs = list(pool.map(one, range(count)))
    jobs_dir = Path(env["FAKEPBS_HOME"]) / "jobs"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        states = [json.loads((jobs_dir / f"{job_id.split('.')[0]}.json").read_text())["attrs"]["job_state"]
                  for job_id, _ in jobs]
        if all(state == "F" for state in states):
            return jobs
        time.sleep(0.2)
    raise SystemExit("the fake PBS jobs did not finish within 120 s")


def fresh_store(state_dir: Path, jobs: list[tuple[str, str]], transport: str) -> None:
    """A new job store holding ``jobs`` as active (not yet final) records."""
    os.environ["XDG_STATE_HOME"] = str(state_dir)  # JobStore() reads it through platformdirs
    from pbs_toolkit.jobs.store import JobRecord, JobStore

    store = JobStore()
    for index, (job_id, run_dir) in enumerate(jobs):
        store.add(JobRecord(job_id=job_id, scheduler="pbs", profile="generic-pbspro", model="org/bench",
                            served_model_name="org/bench", preset="single", name=f"bench-{index:04d}",
                            run_dir=run_dir, transport=transport, created=time.time() + index))


def measure(env: dict[str, str], state_dir: Path, fakepbs_home: Path, sshd_log: Path | None) -> dict[str, Any]:
    calls = qstat_calls(fakepbs_home)
    logins = sshd_log.read_text(errors="replace").count("Accepted publickey") if sshd_log else 0
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pbs_toolkit", "status", "--json"],  # noqa: S603
                          env={**env, "XDG_STATE_HOME": str(state_dir)}, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"pbstk status failed ({proc.returncode}): {proc.stderr.strip()}")
    states = [s["state"] for s in json.loads(proc.stdout)]
    return {
        "qstat": qstat_calls(fakepbs_home) - calls,
        "ssh": (sshd_log.read_text(errors="replace").count("Accepted publickey") - logins) if sshd_log else None,
        "wall_s": wall,
        "states": {s: states.count(s) for s in sorted(set(states))},
    }


def hung_servers(count: int, tmp: Path, env: dict[str, str], fakepbs_home: Path) -> None:
    """``count`` running jobs whose servers accept and never answer: time one ``pbstk status``."""
    import socket

    sockets = []
    jobs = []
    script = "#!/bin/bash\n#PBS -N hung\n#PBS -l select=1:ncpus=1\n#PBS -l walltime=00:05:00\nsleep 120\n"
    try:
        for index in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)  # accepts (the kernel does) and never answers
            sockets.append(sock)
            run_dir = tmp / "hung" / f"job-{index:03d}"
            run_dir.mkdir(parents=True)
            (run_dir / "job.pbs").write_text(script)
            (run_dir / "server.json").write_text(json.dumps(
                {"phase": "ready", "host": "localhost", "address": "127.0.0.1", "port": sock.getsockname()[1]}))
            out = subprocess.run(["qsub", "-o", str(run_dir / "pbs.out"), "-e", str(run_dir / "pbs.err"),  # noqa: S603,S607
                                  str(run_dir / "job.pbs")], env=env, capture_output=True, text=True, check=True)
            jobs.append((out.stdout.strip(), str(run_dir)))
        state_dir = tmp / "state-hung"
        fresh_store(state_dir, jobs, "")
        result = measure(env, state_dir, fakepbs_home, None)
        states = ", ".join(f"{k} {v}" for k, v in result["states"].items())
        print(f"{count} hung servers: one `pbstk status` took {result['wall_s']:.2f} s "
              f"({result['qstat']} qstat call; states: {states})")
    finally:
        subprocess.run(["qdel", *[job_id for job_id, _ in jobs]], env=env, capture_output=True, check=False)  # noqa: S603,S607
        for sock in sockets:
            sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,10,200", help="numbers of tracked jobs (comma-separated)")
    parser.add_argument("--no-ssh", action="store_true", help="skip the measurements through sshd")
    parser.add_argument("--hung", type=int, default=0, help="instead: N running jobs whose servers never answer")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",") if n.strip()]

    tmp = Path(tempfile.mkdtemp(prefix="pbstk-bench-status-"))
    try:
        fakepbs_home = tmp / "fakepbs"
        fakepbs_home.mkdir()
        for sub in ("config", "data", "home"):
            (tmp / sub).mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PBSTK_", "FAKEPBS_"))}
        env.update({
            "PATH": f"{FAKEPBS_BIN}{os.pathsep}{os.environ['PATH']}", "FAKEPBS_HOME": str(fakepbs_home),
            "FAKEPBS_EXITING_DELAY": "0", "XDG_CONFIG_HOME": str(tmp / "config"),
            "XDG_DATA_HOME": str(tmp / "data"), "PBSTK_RUNS_ROOT": str(tmp / "runs"),
            "PBSTK_SSH_PERSIST": "0",  # each status pays its own connection (bench_ssh_reuse.py measures the holder)
        })
        os.environ.update(env)
        if args.hung:
            hung_servers(args.hung, tmp, env, fakepbs_home)
            return
        t0 = time.perf_counter()
        jobs = submit_jobs(max(sizes), tmp / "runs", env)
        print(f"submitted {len(jobs)} fake PBS jobs in {time.perf_counter() - t0:.1f} s (all finished)\n")

        rows = []
        for n in sizes:
            state_dir = tmp / f"state-local-{n}"
            fresh_store(state_dir, jobs[:n], "")
            rows.append(("local", n, measure(env, state_dir, fakepbs_home, None)))

        if not args.no_ssh:
            sys.path.insert(0, str(ROOT / "tests"))
            try:
                from sshd import start_sshd
            except ImportError as exc:
                print(f"(SSH part skipped: {exc})")
            else:
                try:
                    with start_sshd(tmp / "login", {"FAKEPBS_HOME": str(fakepbs_home)}) as info:
                        ssh_env = {**env, "PBSTK_SSH_CONFIG": str(info.ssh_config),
                                   "PBSTK_KNOWN_HOSTS": str(info.known_hosts)}
                        ssh_env.pop("SSH_AUTH_SOCK", None)
                        for n in sizes:
                            state_dir = tmp / f"state-ssh-{n}"
                            fresh_store(state_dir, jobs[:n], info.alias)
                            rows.append(("ssh", n, measure(ssh_env, state_dir, fakepbs_home, info.log)))
                except BaseException as exc:  # pytest.skip when sshd is not installed
                    if type(exc).__name__ != "Skipped":
                        raise
                    print(f"(SSH part skipped: {exc})")

        print(f"{'via':<6}{'jobs':>6}{'qstat calls':>13}{'SSH conns':>11}{'wall s':>9}  states")
        for via, n, r in rows:
            ssh = "-" if r["ssh"] is None else str(r["ssh"])
            states = ", ".join(f"{k} {v}" for k, v in r["states"].items())
            print(f"{via:<6}{n:>6}{r['qstat']:>13}{ssh:>11}{r['wall_s']:>9.2f}  {states}")
        bad = [(via, n) for via, n, r in rows if r["qstat"] != 1 or r["ssh"] not in (None, 1)]
        print("\ngoal (1 qstat and at most 1 SSH connection per status):", "met" if not bad else f"MISSED for {bad}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
