#!/usr/bin/env python3
"""What vllm-router adds per request on this CPU: latency and throughput direct vs through the router.

A trivial, fast HTTP/1.1 backend (asyncio, keep-alive, a fixed chat-completion answer: no model, so what is
measured is the HTTP path itself) runs in its own process on 127.0.0.1; the real router (``vllm-router`` next to
this Python, started by ``pbs_toolkit.services.router.process.start_router`` exactly as a service starts it) has it as
its only worker (``--workers N``: N backends behind the router, direct traffic spread over them round-robin). A
closed-loop client (``http.client`` connections with keep-alive, one thread per concurrent request) sends
``POST /v1/chat/completions`` for ``--seconds`` per level, first straight to the backend, then to the router, at
each concurrency of ``--concurrency``. It prints requests/s and p50/p99 latency of both, the latency the router
adds (router minus direct), the throughput ratio (router / direct) and the CPU time the router process spent per
request (from /proc: independent of how busy the machine is). The client, the backend and the router share this
machine's cores, so latency and throughput are an upper bound of the router's cost on a real network path.

    python benchmarks/cpu/bench_router.py [--seconds 5] [--concurrency 1,16,64] [--workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pbs_toolkit.services.router.process import open_admin, start_router, stop_router  # noqa: E402
from pbs_toolkit.transports.local import LocalRunner  # noqa: E402

ROUTER = Path(sys.executable).parent / "vllm-router"
PAYLOAD = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
ANSWER = (b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant",'
          b'"content":"word"},"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}')


def _serve(port: int, ready: Any) -> None:
    """The backend: answers every request at once, keeps connections open (HTTP/1.1)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:].strip())
                if length:
                    await reader.readexactly(length)
                body = b"" if head.startswith(b"GET /health") else ANSWER
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=512)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load(urls: list[str], concurrency: int, seconds: float) -> tuple[list[float], int, float]:
    """Closed loop: ``concurrency`` threads, each one request after the other for ``seconds``.
    Returns (latencies in s, failed requests, wall seconds)."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    failed = [0] * concurrency
    start = time.perf_counter()
    stop_at = start + seconds

    def client(i: int) -> None:
        # http.client, not requests: the client must cost less than what is measured (requests adds ~0.5 ms)
        parts = urlsplit(urls[i % len(urls)])
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/v1/chat/completions", body=PAYLOAD, headers=HEADERS)
                response = conn.getresponse()
                response.read()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                conn.close()
                ok = False
            if ok:
                latencies[i].append(time.perf_counter() - t0)
            else:
                failed[i] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [x for per in latencies for x in per], sum(failed), time.perf_counter() - start


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU time of ``pids`` so far (Linux /proc; 0 elsewhere): what the router itself spends,
    independent of how busy the shared machine is."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def router_pids(wrapper: int) -> list[int]:
    """The router process(es) under the wrapper ``start_router`` leaves (its children)."""
    try:
        return [int(p) for p in Path(f"/proc/{wrapper}/task/{wrapper}/children").read_text().split()]
    except OSError:
        return []


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per level and target (default 5)")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated levels (default 1,16,64)")
    parser.add_argument("--workers", type=int, default=1, help="backends behind the router (default 1)")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    if not ROUTER.exists():
        print(f"{ROUTER} is missing: pip install vllm-router", file=sys.stderr)
        return 2

    ctx = multiprocessing.get_context("spawn")
    backends, urls = [], []
    for _ in range(args.workers):
        port, ready = free_port(), ctx.Event()
        proc = ctx.Process(target=_serve, args=(port, ready), daemon=True)
        proc.start()
        if not ready.wait(15):
            raise SystemExit("the backend did not start")
        backends.append(proc)
        urls.append(f"http://127.0.0.1:{port}")

    runner = LocalRunner()
    with tempfile.TemporaryDirectory(prefix="pbstk-bench-router-") as tmp:
        info = start_router(runner, os.path.join(tmp, "router"), command=[str(ROUTER)])
        try:
            with open_admin(runner, info) as admin:
                for url in urls:
                    admin.add_worker(url)
            load([info.url], 4, 1.0)  # warm-up: connections, router pools
            load(urls, 4, 1.0)
            rows, cpu_us = [], []
            pids = router_pids(info.pid)
            for level in levels:
                for name, targets in (("direct", urls), ("router", [info.url])):
                    cpu0 = cpu_seconds(pids)
                    lat, failed, wall = load(targets, level, args.seconds)
                    if name == "router":
                        cpu_us.append((cpu_seconds(pids) - cpu0) / max(1, len(lat)) * 1e6)
                    rows.append((name, level, len(lat), failed, len(lat) / wall, pct(lat, 0.5), pct(lat, 0.99)))
        finally:
            stop_router(runner, info, timeout=5)
    for proc in backends:
        proc.terminate()

    print(f"vllm-router {info.policy}, {args.workers} backend(s), {args.seconds:g} s per level, "
          f"{os.cpu_count()} CPUs shared by client, backend and router")
    print(f"{'target':<8} {'conc':>5} {'requests':>9} {'failed':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for name, level, n, failed, rps, p50, p99 in rows:
        print(f"{name:<8} {level:>5} {n:>9} {failed:>7} {rps:>9.0f} {p50:>8.2f} {p99:>8.2f}")
    print()
    print(f"{'conc':>5} {'added p50 ms':>13} {'added p99 ms':>13} {'throughput router/direct':>25} "
          f"{'router CPU us/req':>18}")
    for i, level in enumerate(levels):
        direct, routed = rows[2 * i], rows[2 * i + 1]
        print(f"{level:>5} {routed[5] - direct[5]:>13.2f} {routed[6] - direct[6]:>13.2f} "
              f"{routed[4] / direct[4] if direct[4] else float('nan'):>25.2f} {cpu_us[i]:>18.0f}")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    total_failed = sum(r[3] for r in rows)
    if total_failed:
        print(f"{total_failed} requests failed", file=sys.stderr)
    return 1 if total_failed else 0


if __name__ == "__main__":
    sys.exit(main())
