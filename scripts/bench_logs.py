#!/usr/bin/env python3
"""Benchmark ``pbstk logs``: ``-n 100`` on a 1 GB log (target <= 100 ms, memory independent of the file size),
``-n 1000000`` on a log of a million lines (linear in N: compared with ``tail -n``), and ``-f`` latency (target: a
new line shown within 0.5 s).

Runs against a fake job record in a temporary XDG state dir (no scheduler needed for ``-n``; ``-f`` uses the
``local`` scheduler's view of a job that is not final). Prints numbers; deletes the big file at the end.

    python scripts/bench_logs.py [--size-mb 1024] [--runs 5] [--many-lines 1000000] [--only-many-lines]
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

LINE = b"INFO 11-22 02:38:28 [loggers.py:123] Engine 000: Avg prompt throughput: 515.5 tokens/s, Avg generation " \
       b"throughput: 256.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.6%\n"


def write_log(path: Path, size_mb: int) -> None:
    block = LINE * (1024 * 1024 // len(LINE))
    with open(path, "wb") as fh:
        for _ in range(size_mb * 1024 * 1024 // len(block)):
            fh.write(block)
        fh.write(b"the very last line\n")


def child_rss_mb(argv: list[str], env: dict[str, str]) -> tuple[float, float, bytes]:
    """(wall s, peak RSS MiB, stdout) of one child process, via wait4's rusage."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE)  # noqa: S603 - argument list
    out = proc.stdout.read() if proc.stdout else b""
    _, _, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = 0
    return wall, usage.ru_maxrss / 1024, out


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
    wall, peak, out = child_rss_mb([sys.executable, "-m", "pbs_toolkit.cli.main", "logs", job, "-n", str(n)], env)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--many-lines", type=int, default=1_000_000, help="N for the -n N case (0: skip it)")
    parser.add_argument("--only-many-lines", action="store_true", help="run only the -n N case")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pbstk-bench-logs-") as tmp:
        root = Path(tmp)
        run_dir = root / "run"
        run_dir.mkdir()
        env = {**os.environ, "XDG_STATE_HOME": str(root / "state"), "XDG_CONFIG_HOME": str(root / "config"),
               "XDG_DATA_HOME": str(root / "data")}
        job = record_job(env, run_dir)
        # the local scheduler's markers: a live pid makes the job RUNNING, so `logs -f` keeps following
        (run_dir / ".local-job").mkdir()
        (run_dir / ".local-job" / "pid").write_text(f"{os.getpid()}\n")
        log = run_dir / "vllm.log"
        small = root / "small.log"
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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

        # the CLI as a user runs it: process start included
        cli = [sys.executable, "-m", "pbs_toolkit.cli.main", "logs", job, "-n", "100"]
        walls, rss = [], []
        for _ in range(args.runs):
            wall, peak, out = child_rss_mb(cli, env)
            assert out.count(b"\n") == 100, out[-200:]
            walls.append(wall)
            rss.append(peak)
        write_log(small, 1)
        small_rss = []
        os.replace(log, root / "big.log")
        os.replace(small, log)
        for _ in range(args.runs):
            _, peak, _ = child_rss_mb(cli, env)
            small_rss.append(peak)
        startup = []
        for _ in range(args.runs):  # the interpreter + click start alone, for reference
            wall, _, _ = child_rss_mb([sys.executable, "-m", "pbs_toolkit.cli.main", "--version"], env)
            startup.append(wall)
        print(f"pbstk logs -n 100 on {args.size_mb} MB: median wall {statistics.median(walls) * 1e3:.0f} ms "
              f"(process start alone {statistics.median(startup) * 1e3:.0f} ms, so reading ~"
              f"{(statistics.median(walls) - statistics.median(startup)) * 1e3:.0f} ms); "
              f"peak RSS {max(rss):.1f} MiB vs {max(small_rss):.1f} MiB on a 1 MB log")
        (root / "big.log").unlink()  # free the space now

        # -f latency: append a line, time until the follower prints it
        follower = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "pbs_toolkit.cli.main", "logs", job, "-f", "-n", "0"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
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
        for i in range(args.runs * 2):
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
