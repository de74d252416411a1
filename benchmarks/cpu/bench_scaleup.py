#!/usr/bin/env python3
"""How soon an autoscaled service adds a replica under a burst far above its capacity, with slow probes (issue 28:
on 4x H100 the keeper scaled up 50-54 s after a c=512 burst began, at its default 15 s poll interval).

One service ``--min-replicas 1 --max-replicas 2`` of the stand-in vLLM (tests/standins/vllm) on the local scheduler,
behind the real vllm-router, kept by the real detached keeper (``PBSTK_SERVICE_POLL_S`` = ``--poll``). Each replica
takes ``--capacity`` requests into its engine (``--max-num-seqs`` and ``PBSTK_TEST_STANDIN_ADMIT``), holds the rest
before it unreported, and answers ``/health``, ``/v1/models`` and ``/metrics`` only after ``--slow-probes`` s while
full, as vLLM's API server under overload. Once the service is READY, ``--burst`` closed-loop clients start; the
script prints the seconds from the burst's start to the keeper's ``scale up`` line, and the keeper's log from the
burst on (the keeper logs a tick's duration when it is long).

    python benchmarks/cpu/bench_scaleup.py [--poll 15] [--slow-probes 4] [--burst 16] [--capacity 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench_autoscale import MODEL, ROUTER, Load, environment, pbstk


def keeper_lines(home: Path, name: str) -> list[str]:
    try:
        return (home / "state" / "pbstk" / "services" / name / "keeper.log").read_text().splitlines()
    except OSError:
        return []


def stamp(line: str) -> float | None:
    try:
        return datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError:
        return None


def measure(args: argparse.Namespace, home: Path) -> float | None:
    env = environment(home, args.poll, args.slow_probes, args.probe_timeout)
    env["PBSTK_TEST_STANDIN_ADMIT"] = str(args.capacity)
    name = "scaleup"
    pbstk(env, "serve", MODEL, "--profile", "bench", "--preset", "cpu", "--name", name, "--min-replicas", "1",
          "--max-replicas", "2", "--scale-up-waiting", "1", "--scale-down-idle", "10m",
          f"--vllm-arg=--max-num-seqs={args.capacity}", "--wait", "--timeout", "300")
    doc = json.loads(pbstk(env, "status", name, "--json"))[0]
    import os

    os.environ.update(env)
    from pbs_toolkit.jobs.store import JobStore
    from pbs_toolkit.services import record as records

    rec = records.load(JobStore(), name)
    assert rec is not None and rec.api_key
    time.sleep(args.settle)  # somewhere inside the keeper's poll interval
    before = len(keeper_lines(home, name))
    load = Load(doc["url"], rec.api_key, args.request_s)
    start = time.time()
    load.set_clients(args.burst)
    up = None
    try:
        while time.time() - start < args.limit and up is None:
            up = next((stamp(x) for x in keeper_lines(home, name)[before:] if " scale up to " in x), None)
            time.sleep(0.2)
    finally:
        load.finish()
        pbstk(env, "cancel", name)
    print(f"burst of {args.burst} clients began at {time.strftime('%H:%M:%S', time.localtime(start))}"
          f".{int(start % 1 * 10)}; the keeper's log since:")
    for line in keeper_lines(home, name)[before:]:
        print("   ", line)
    print(f"requests: {load.ok} answered, {load.failed} failed")
    return None if up is None else up - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--poll", type=float, default=15.0, help="PBSTK_SERVICE_POLL_S")
    parser.add_argument("--slow-probes", type=float, default=4.0)
    parser.add_argument("--probe-timeout", type=float, default=0.0, help="PBSTK_PROBE_TIMEOUT_S (0: default 3 s)")
    parser.add_argument("--capacity", type=int, default=2)
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--request-s", type=float, default=0.5)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds from READY to the burst")
    parser.add_argument("--limit", type=float, default=120.0, help="give up after so many seconds")
    args = parser.parse_args()
    if not ROUTER.exists():
        raise SystemExit(f"no vllm-router next to {sys.executable}")
    with tempfile.TemporaryDirectory(prefix="pbstk-bench-scaleup-") as tmp:
        took = measure(args, Path(tmp))
    print(f"poll {args.poll:g} s, slow probes {args.slow_probes:g} s: scale-up "
          + (f"{took:.0f} s after the burst began (log stamps are whole seconds)" if took is not None
             else f"not within {args.limit:g} s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
