#!/usr/bin/env python3
"""A bursty load through a service on this machine: autoscaling (``--min-replicas 1 --max-replicas M``) against a
fixed ``--replicas M``, with the same load.

Each replica is a real local-scheduler job running the stand-in vLLM (tests/standins/vllm) with a fixed capacity
(``--max-num-seqs C``: C requests run at once, the others wait and are reported as ``vllm:num_requests_waiting``,
as in vLLM); every request takes ``--request-s`` seconds on a replica. The router is the real ``vllm-router`` next
to this Python, the keeper the real detached process (ticking every ``--tick`` s). The load alternates bursts of
``--burst`` closed-loop clients with quiet spells of one client, ``--cycles`` times. It prints, per mode: the
requests answered and failed, p50/p99 latency, the replica jobs over time (one character per second), and the
node-hours the replica jobs held (each job one node, from submission until it is gone: queued and draining time
included), then the autoscaled run's node-hours and failures relative to the fixed one, and how often the keeper took a
serving replica out of the router (its log's ``removed ... from the router`` lines, scaling down left out).

``--slow-probes S`` makes each replica answer ``/health`` and ``/v1/models`` only after S seconds while its slots
are full (``PBSTK_TEST_STANDIN_SLOW_PROBES``, as vLLM's API server under overload), with pbstk's probe timeout
``--probe-timeout`` (issue 28: one slow probe used to take the only replica out of the router).

    python benchmarks/cpu/bench_autoscale.py [--max-replicas 3] [--capacity 4] [--burst 16] [--cycles 2]
    python benchmarks/cpu/bench_autoscale.py --max-replicas 2 --slow-probes 2 --probe-timeout 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[2]
ROUTER = Path(sys.executable).parent / "vllm-router"
MODEL = "Qwen/Qwen3-VL-2B-Instruct"


def environment(home: Path, tick: float, slow_probes: float = 0.0, probe_timeout: float = 0.0) -> dict[str, str]:
    """A private pbstk home (config, state, runs) with the stand-ins first on PATH."""
    for sub in ("config/pbstk/profiles", "state", "data", "runs"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    (home / "config/pbstk/profiles/bench.yaml").write_text(
        "name: bench\nscheduler: local\nnodes: 1\ngpus_per_node: 0\ncpus_per_node: 1\nwalltime: '01:00:00'\n"
        f"address: loopback\nbind_host: 127.0.0.1\nport: 8000\nrouter_command: {ROUTER}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PBSTK_")}
    env.update(XDG_CONFIG_HOME=str(home / "config"), XDG_STATE_HOME=str(home / "state"),
               XDG_DATA_HOME=str(home / "data"), PBSTK_RUNS_ROOT=str(home / "runs"),
               PATH=f"{ROOT / 'tests' / 'standins'}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(ROOT),
               PBSTK_SERVICE_POLL_S=str(tick), PBSTK_SERVICE_DRAIN_S="30", PBSTK_TEST_STANDIN_DELAY="0",
               PBSTK_HUB_LOOKUP="0", PBSTK_SSH_PERSIST="0")
    if slow_probes:
        env["PBSTK_TEST_STANDIN_SLOW_PROBES"] = str(slow_probes)
    if probe_timeout:
        env["PBSTK_PROBE_TIMEOUT_S"] = str(probe_timeout)
    return env


def removals(home: Path, name: str) -> int:
    """How often the keeper took a serving replica out of the router (scaling down left out)."""
    try:
        text = (home / "state" / "pbstk" / "services" / name / "keeper.log").read_text()
    except OSError:
        return -1
    return sum(1 for line in text.splitlines() if "from the router" in line and " removed " in line
               and "scaling down" not in line)


def pbstk(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    done = subprocess.run([sys.executable, "-m", "pbs_toolkit", *args], env=env, capture_output=True,  # noqa: S603
                          text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pbstk {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


class Load:
    """Closed-loop clients through the router; the number of clients changes with the phase."""

    def __init__(self, url: str, key: str, request_s: float) -> None:
        self.url, self.key, self.request_s = url, key, request_s
        self.clients = 0
        self.ok = self.failed = 0
        self.latencies: list[float] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def set_clients(self, n: int) -> None:
        self.clients = n
        while len(self.threads) < n:
            t = threading.Thread(target=self.run, args=(len(self.threads),), daemon=True)
            self.threads.append(t)
            t.start()

    def run(self, index: int) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "standin_delay_s": self.request_s}
        session = requests.Session()
        while not self.stop.is_set():
            if index >= self.clients:
                time.sleep(0.05)
                continue
            start = time.monotonic()
            try:
                answer = session.post(self.url + "/completions", json=body, timeout=120,
                                      headers={"Authorization": f"Bearer {self.key}"})
                good = answer.status_code == 200
            except requests.RequestException:
                good = False
            with self.lock:
                if good:
                    self.ok += 1
                    self.latencies.append(time.monotonic() - start)
                else:
                    self.failed += 1

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(130)


def replica_jobs(name: str) -> int:
    """The service's replica jobs that exist now (queued, starting, serving or draining), from its record."""
    from pbs_toolkit.jobs.store import JobStore
    from pbs_toolkit.services import record as records

    rec = records.load(JobStore(), name)
    return sum(len(s.jobs()) + (1 if s.launching else 0) for s in rec.slots) if rec else 0


def run_mode(label: str, env: dict[str, str], serve_args: list[str], args: argparse.Namespace) -> dict[str, Any]:
    os.environ.update(env)  # the in-process store reads below use the same private home
    name = f"bench-{label}"
    pbstk(env, "serve", MODEL, "--profile", "bench", "--preset", "cpu", "--name", name,
          f"--vllm-arg=--max-num-seqs={args.capacity}", "--wait", "--timeout", "300", *serve_args)
    doc = json.loads(pbstk(env, "status", name, "--json"))[0]
    from pbs_toolkit.jobs.store import JobStore
    from pbs_toolkit.services import record as records

    rec = records.load(JobStore(), name)
    assert rec is not None and rec.api_key
    load = Load(doc["url"], rec.api_key, args.request_s)
    timeline: list[int] = []
    node_s = 0.0
    phases = [(args.burst, args.burst_s), (1, args.quiet_s)] * args.cycles
    try:
        for clients, seconds in phases:
            load.set_clients(clients)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                jobs = replica_jobs(name)
                timeline.append(jobs)
                node_s += jobs * 1.0
                time.sleep(1.0)
    finally:
        load.finish()
        pbstk(env, "cancel", name)
    lat = sorted(load.latencies)

    def pick(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")

    return {"label": label, "ok": load.ok, "failed": load.failed, "p50": pick(0.5), "p99": pick(0.99),
            "removals": removals(Path(env["XDG_STATE_HOME"]).parent, name),
            "timeline": timeline, "node_h": node_s / 3600, "max": max(timeline or [0]),
            "last": rec and records.load(JobStore(), name)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=4, help="--max-num-seqs of every replica")
    parser.add_argument("--request-s", type=float, default=0.5, help="seconds one request takes on a replica")
    parser.add_argument("--burst", type=int, default=16, help="clients during a burst")
    parser.add_argument("--burst-s", type=float, default=20.0)
    parser.add_argument("--quiet-s", type=float, default=25.0)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--tick", type=float, default=1.0, help="the keeper's tick (PBSTK_SERVICE_POLL_S)")
    parser.add_argument("--scale-down-idle", default="5s")
    parser.add_argument("--slow-probes", type=float, default=0.0,
                        help="seconds a replica's /health takes while its slots are full (0: answers at once)")
    parser.add_argument("--probe-timeout", type=float, default=0.0, help="PBSTK_PROBE_TIMEOUT_S (0: pbstk's default)")
    args = parser.parse_args()
    if not ROUTER.exists():
        raise SystemExit(f"no vllm-router next to {sys.executable}")
    print(f"load: {args.cycles} x ({args.burst} clients for {args.burst_s:g} s, then 1 client for {args.quiet_s:g} s); "
          f"each request {args.request_s:g} s on a replica of capacity {args.capacity} (--max-num-seqs); "
          f"keeper tick {args.tick:g} s" + (f"; probes answer after {args.slow_probes:g} s while a replica is "
                                             f"full (probe timeout {args.probe_timeout or 3:g} s)"
                                             if args.slow_probes else ""))
    results = []
    with tempfile.TemporaryDirectory(prefix="pbstk-bench-autoscale-") as tmp:
        env = environment(Path(tmp), args.tick, args.slow_probes, args.probe_timeout)
        m = str(args.max_replicas)
        modes = [("auto", ["--min-replicas", "1", "--max-replicas", m, "--scale-down-idle", args.scale_down_idle]),
                 ("fixed", ["--replicas", m])]
        for label, serve_args in modes:
            results.append(run_mode(label, env, serve_args, args))
    print(f"\n{'mode':<28}{'requests':>9}{'failed':>8}{'p50 s':>8}{'p99 s':>8}{'max jobs':>9}{'node-hours':>12}"
          f"{'removals':>9}")
    for r in results:
        m = args.max_replicas
        label = f"autoscale 1..{m}" if r["label"] == "auto" else f"fixed --replicas {m}"
        print(f"{label:<28}{r['ok']:>9}{r['failed']:>8}{r['p50']:>8.2f}{r['p99']:>8.2f}{r['max']:>9}{r['node_h']:>12.4f}"
              f"{r['removals']:>9}")
    print("\nreplica jobs over time (one digit per second; bursts start at 0 s and every "
          f"{args.burst_s + args.quiet_s:g} s):")
    for r in results:
        print(f"  {r['label']:<6} {''.join(str(min(n, 9)) for n in r['timeline'])}")
    auto, fixed = results
    if fixed["node_h"]:
        print(f"\nautoscale used {auto['node_h'] / fixed['node_h']:.2f}x the node-hours of fixed --replicas "
              f"{args.max_replicas}, answered {auto['ok'] / max(fixed['ok'], 1):.2f}x the requests, "
              f"{auto['failed']} failed (fixed: {fixed['failed']})")
    last = auto["last"]
    if last is not None and last.scale.get("last"):
        print(f"autoscale's last decision: {last.scale['last']['action']} ({last.scale['last']['reason']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
