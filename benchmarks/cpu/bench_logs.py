#!/usr/bin/env python3
"""Benchmark ``pbstk logs``: ``-n 100`` on a 1 GB log against ``pbstk --version`` of the same install (bar: at most
1.5x, medians of ``--runs``; memory independent of the file size), ``-n 1000000`` on a log of a million lines
(linear in N: compared with ``tail -n``), and ``-f`` latency (target: a new line shown within 0.5 s).

Runs against a job recorded in a temporary job store (temporary XDG dirs and HOME: nothing of the user's is read
or written; no scheduler needed for ``-n``; ``-f`` uses the ``local`` scheduler's view of a job that is not final).
Prints numbers; deletes the big file at the end.

    python benchmarks/cpu/bench_logs.py [--size-mb 1024] [--runs 5] [--many-lines 1000000] [--only-many-lines]
    python benchmarks/cpu/bench_logs.py --many-lines 0 --runs 21 --pbstk /other/venv/bin/pbstk   # another install

The CLI is timed as a user runs it: this environment's ``pbstk`` console script (``--pbstk``: another one, e.g.
a checkout of an older commit in its own venv, for before/after numbers in one run on one machine), interleaved
with ``pbstk --version`` of the same install, wall and CPU time (user + system, steadier than wall time on a loaded
machine). Both run with their bytecode cached, as an installed package runs: in a temporary
``PYTHONPYCACHEPREFIX``, filled by one unmeasured run of each (so a checkout without ``__pycache__``, or
``PYTHONDONTWRITEBYTECODE`` in the environment, does not charge the compiler to the command that imports more).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_cli import pbstk_argv

#: ``pbstk logs JOB -n 100`` on a 1 GB log / ``pbstk --version``, medians (issue 44 item 5b)
GOAL_RATIO = 1.5

LINE = b"INFO 11-22 02:38:28 [loggers.py:123] Engine 000: Avg prompt throughput: 515.5 tokens/s, Avg generation " \
       b"throughput: 256.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.6%\n"


def write_log(path: Path, size_mb: int) -> None:
    block = LINE * (1024 * 1024 // len(LINE))
    with open(path, "wb") as fh:
        for _ in range(size_mb * 1024 * 1024 // len(block)):
            fh.write(block)
        fh.write(b"the very last line\n")


def child_run(argv: list[str], env: dict[str, str]) -> tuple[float, float, float, bytes]:
    """(wall s, CPU s, peak RSS MiB, stdout) of one child process, via wait4's rusage."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE)  # noqa: S603 - argument list
    out = proc.stdout.read() if proc.stdout else b""
    _, _, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = 0
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out


def child_rss_mb(argv: list[str], env: dict[str, str]) -> tuple[float, float, bytes]:
    """(wall s, peak RSS MiB, stdout) of one child process."""
    wall, _, peak, out = child_run(argv, env)
    return wall, peak, out


def bench_many_lines(root: Path, env: dict[str, str], job: str, log: Path, n: int) -> None:
    """``-n N`` with N = a million: the whole tail is the answer, so the cost must grow linearly with N.

    Times ``tail_bytes`` in this process, ``pbstk logs -n N`` as a user runs it (output to a pipe, peak RSS), and
    coreutils ``tail -n N`` on the same file for reference. Each runs once: the old code took minutes.
    """
    from pbs_toolkit.jobs.logs import tail_bytes
    from pbs_toolkit.transports.local import LocalRunner

    with open(log, "wb") as fh:
        fh.write(b"an older line that -n must not show\n" * 1000)
        block = LINE * 10_000
        for _ in range(n // 10_000):
            fh.write(block)
        fh.write(LINE * (n % 10_000))
    print(f"wrote {n} lines ({log.stat().st_size / 1e6:.0f} MB) for -n {n}")
    # the CLI first: a forked child's peak RSS starts from this process's RSS at the fork
    wall, peak, out = child_rss_mb([*pbstk_argv(), "logs", job, "-n", str(n)], env)
    assert out.count(b"\n") == n, out[:100]
    print(f"pbstk logs -n {n}: {wall:.2f} s wall, peak RSS {peak:.0f} MiB (the output itself is "
          f"{len(out) / 2**20:.0f} MiB)")
    del out
    t0 = time.perf_counter()
    data, _ = tail_bytes(LocalRunner(), str(log), n)
    took = time.perf_counter() - t0
    assert data.count(b"\n") == n and data.startswith(LINE), data[:100]
    del data
    print(f"tail_bytes(n={n}): {took:.2f} s")
    t0 = time.perf_counter()
    subprocess.run(["tail", "-n", str(n), str(log)], stdout=subprocess.DEVNULL, check=True)  # noqa: S603,S607
    print(f"coreutils tail -n {n}: {time.perf_counter() - t0:.2f} s")
    log.unlink()


def record_job(env: dict[str, str], run_dir: Path) -> str:
    code = (
        "from pbs_toolkit.jobs.store import JobRecord, JobStore\n"
        f"JobStore().add(JobRecord(job_id='999.bench', scheduler='local', profile='local', model='m', "
        f"served_model_name='m', preset='cpu', name='bench', run_dir={str(run_dir)!r}))\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True)  # noqa: S603
    return "999.bench"


def bench_cli_start(pbstk: list[str], job: str, env: dict[str, str], log: Path, size_mb: int, runs: int) -> None:
    """``pbstk logs JOB -n 100`` as a user runs it, the process's start included, against ``pbstk --version`` of
    the same install (the bar: 1.5x); then its peak RSS against a 1 MB log (it must not grow with the file)."""
    cli = [*pbstk, "logs", job, "-n", "100"]
    version = [*pbstk, "--version"]
    for argv in (cli, version):  # unmeasured: fills the bytecode cache (PYTHONPYCACHEPREFIX) and the page cache
        child_run(argv, env)
    walls, cpus, rss, version_walls, version_cpus = [], [], [], [], []
    for _ in range(runs):  # interleaved, so a change in the machine's load falls on both alike
        wall, cpu, peak, out = child_run(cli, env)
        assert out.count(b"\n") == 100, out[-200:]
        walls.append(wall)
        cpus.append(cpu)
        rss.append(peak)
        wall, cpu, _, out = child_run(version, env)
        assert out.startswith(b"pbstk"), out
        version_walls.append(wall)
        version_cpus.append(cpu)
    small = log.with_name("small.log")
    write_log(small, 1)
    big = log.with_name("big.log")
    os.replace(log, big)
    os.replace(small, log)
    small_rss = [child_run(cli, env)[2] for _ in range(runs)]
    big.unlink()  # free the space now
    ms = lambda values: f"{statistics.median(values) * 1e3:.0f} ms"  # noqa: E731
    ratio = statistics.median(walls) / statistics.median(version_walls)
    verdict = "ok" if ratio <= GOAL_RATIO else f"ABOVE the {GOAL_RATIO}x bar"
    print(f"{' '.join(cli[:-4])} logs JOB -n 100 on {size_mb} MB: median wall {ms(walls)} (min "
          f"{min(walls) * 1e3:.0f} ms), CPU {ms(cpus)}; --version: median wall {ms(version_walls)} (min "
          f"{min(version_walls) * 1e3:.0f} ms), CPU {ms(version_cpus)} ({runs} runs each, interleaved)")
    print(f"ratio logs -n 100 / --version: wall {ratio:.2f}x ({verdict}), CPU "
          f"{statistics.median(cpus) / statistics.median(version_cpus):.2f}x; peak RSS {max(rss):.1f} MiB vs "
          f"{max(small_rss):.1f} MiB on a 1 MB log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--many-lines", type=int, default=1_000_000, help="N for the -n N case (0: skip it)")
    parser.add_argument("--only-many-lines", action="store_true", help="run only the -n N case")
    parser.add_argument("--pbstk", type=lambda text: [text], default=pbstk_argv(),
                        help="the pbstk command to time (default: this environment's)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pbstk-bench-logs-") as tmp:
        root = Path(tmp)
        run_dir = root / "run"
        run_dir.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PBSTK_") and k != "PYTHONDONTWRITEBYTECODE"}
        env.update(XDG_STATE_HOME=str(root / "state"), XDG_CONFIG_HOME=str(root / "config"),
                   XDG_DATA_HOME=str(root / "data"), HOME=str(root / "home"),
                   PYTHONPYCACHEPREFIX=str(root / "pycache"))
        (root / "home").mkdir()
        job = record_job(env, run_dir)
        # the local scheduler's markers: a live process group makes the job RUNNING, so `logs -f` keeps following
        # (the pid marker names a group: this process leads none, a child in a session of its own does)
        holder = subprocess.Popen(["sleep", "3600"], start_new_session=True)  # noqa: S603,S607
        (run_dir / ".local-job").mkdir()
        (run_dir / ".local-job" / "pid").write_text(f"{holder.pid}\n")
        try:
            bench_all(args, root, env, job, run_dir / "vllm.log")
        finally:
            holder.kill()
            holder.wait()


def bench_all(args: argparse.Namespace, root: Path, env: dict[str, str], job: str, log: Path) -> None:
    """Every measurement but the many-lines one, in order; ``log`` is the job's vLLM log."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if args.many_lines > 0:
        bench_many_lines(root, env, job, log, args.many_lines)
    if args.only_many_lines:
        return

    begin = time.perf_counter()
    write_log(log, args.size_mb)
    print(f"wrote {log.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - begin:.1f} s")

    # tail_bytes in this process: time and the RSS it adds
    from pbs_toolkit.jobs.logs import tail_bytes
    from pbs_toolkit.transports.local import LocalRunner

    runner = LocalRunner()
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        data, _ = tail_bytes(runner, str(log), 100)
        times.append(time.perf_counter() - t0)
    assert data.count(b"\n") == 100 and data.endswith(b"the very last line\n")
    print(f"tail_bytes(n=100) on {args.size_mb} MB: median {statistics.median(times) * 1e3:.2f} ms "
          f"(max {max(times) * 1e3:.2f} ms)")

    bench_cli_start(args.pbstk, job, env, log, args.size_mb, args.runs)

    bench_follow(job, env, log, args.runs)


def bench_follow(job: str, env: dict[str, str], log: Path, runs: int) -> None:
    """``pbstk logs -f``: append a line, time until the follower prints it (target 0.5 s)."""
    follower = subprocess.Popen(  # noqa: S603
        [sys.executable, "-m", "pbs_toolkit.cli.main", "logs", job, "-f", "-n", "0"],
        env=env, stdout=subprocess.PIPE, bufsize=0,
    )
    seen: dict[str, float] = {}
    assert follower.stdout is not None

    def reader() -> None:
        assert follower.stdout is not None
        for raw in iter(follower.stdout.readline, b""):
            seen.setdefault(raw.decode().strip(), time.perf_counter())

    threading.Thread(target=reader, daemon=True).start()
    time.sleep(1.5)  # let it start and print the (empty) tail
    lags = []
    for i in range(runs * 2):
        text = f"bench line {i}"
        t0 = time.perf_counter()
        with open(log, "ab") as fh:
            fh.write(text.encode() + b"\n")
        deadline = t0 + 5
        while text not in seen and time.perf_counter() < deadline:
            time.sleep(0.002)
        lags.append(seen.get(text, float("inf")) - t0)
        time.sleep(0.137)  # not in step with the poll interval
    follower.terminate()
    follower.wait()
    print(f"pbstk logs -f: new line shown after median {statistics.median(lags) * 1e3:.0f} ms, "
          f"max {max(lags) * 1e3:.0f} ms (target 500 ms)")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"(bench process peak RSS {usage.ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
