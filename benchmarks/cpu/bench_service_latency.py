#!/usr/bin/env python3
"""Where a service's time to first token goes: the same stand-in replicas driven directly, through vllm-router
alone (``router_isolation: none``) and through vllm-router behind pbstk's front (``netns``), at one concurrency.

``--replicas`` stand-in vLLM servers (``tests/standins/vllm``, each streaming ``--tokens`` tokens
``--token-ms`` apart, ``--max-num-seqs`` above the load so nothing queues in them) run on 127.0.0.1; the routers
are started by ``pbs_toolkit.services.router.process.start_router`` exactly as a service starts them (``--policy``, the
defaults pbstk adds, ``--router-arg`` appended). A closed-loop client of ``--procs`` processes (asyncio, a new
connection per request, as ``vllm bench serve`` opens them) keeps ``--concurrency`` streaming chat requests open
for ``--seconds`` per target; TTFT is the time from connect to the first body byte (the stand-in sends its first
token with its head). Printed: requests, failed, requests/s, tokens/s, TTFT p50/p99, end-to-end p50/p99, the
ratio of tokens/s and p99 TTFT to the direct run, and the CPU per request that the router and the front spent and
that the replicas spent (/proc). ``--uvicorn PYTHON``: replicas on vLLM's API-server stack (FastAPI on uvicorn,
``bench_upstream_connections.py --serve``), which keeps connections open as vLLM does.
Everything shares this machine's cores: run it where the cores are not shared with other work.

    python benchmarks/cpu/bench_service_latency.py [--concurrency 256] [--seconds 20] [--targets direct,router,front]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench_router import ROUTER, cpu_seconds, free_port, pct  # noqa: E402

from pbs_toolkit.services.router.process import start_router, stop_router  # noqa: E402
from pbs_toolkit.transports.local import LocalRunner  # noqa: E402

STANDIN = ROOT / "tests" / "standins" / "vllm"


def request_bytes(host: str, port: int, tokens: int) -> bytes:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                       "stream": True}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), port, len(body)) + body)


async def _one(host: str, port: int, request: bytes) -> tuple[float, float, float] | None:
    """One streamed request: (start, TTFT s, end-to-end s), or None when it failed."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        first = await reader.read(65536)
        ttft = time.perf_counter() - t0
        rest = [first]
        while data := await reader.read(65536):
            rest.append(data)
        end = time.perf_counter() - t0
    finally:
        writer.close()
    ok = head.split(b" ", 2)[1] == b"200" and b"[DONE]" in b"".join(rest)
    return (t0, ttft, end) if ok else None


def client(urls: list[str], concurrency: int, seconds: float, tokens: int, out: Any) -> None:
    """One client process: ``concurrency`` loops of one request after the other until ``seconds`` are over."""
    done: list[tuple[float, float, float]] = []
    failed = [0]
    stop_at = time.perf_counter() + seconds

    async def loop(i: int) -> None:
        parts = urlsplit(urls[i % len(urls)])
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        request = request_bytes(host, port, tokens)
        while time.perf_counter() < stop_at:
            try:
                got = await asyncio.wait_for(_one(host, port, request), 120)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError):
                got = None
            if got is None:
                failed[0] += 1
            else:
                done.append(got)

    async def main() -> None:
        await asyncio.gather(*(loop(i) for i in range(concurrency)))

    asyncio.run(main())
    out.put((done, failed[0]))


def drive(urls: list[str], concurrency: int, seconds: float, tokens: int, procs: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    shares = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    workers = [ctx.Process(target=client, args=(urls[i % len(urls):] + urls[:i % len(urls)], n, seconds, tokens,
                                                queue)) for i, n in enumerate(shares) if n]
    for w in workers:
        w.start()
    results = [queue.get() for _ in workers]
    for w in workers:
        w.join()
    done = [d for r in results for d in r[0]]
    failed = sum(r[1] for r in results)
    # the steady part: requests started after the first 15 % of the level and ended before its end
    t_min = min((d[0] for d in done), default=0.0)
    warm, end = t_min + 0.15 * seconds, t_min + seconds
    steady = [d for d in done if d[0] >= warm and d[0] + d[2] <= end]
    window = end - warm
    return {"requests": len(done), "failed": failed, "rps": len(steady) / window,
            "tok_s": len(steady) * tokens / window,
            "ttft_p50": pct([d[1] for d in steady], 0.5), "ttft_p99": pct([d[1] for d in steady], 0.99),
            "e2e_p50": pct([d[2] for d in steady], 0.5), "e2e_p99": pct([d[2] for d in steady], 0.99)}


def start_replicas(n: int, tokens: int, token_ms: float, seqs: int,
                   uvicorn: str | None) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """The stand-in vLLM (HTTP/1.0: a connection per request), or with ``uvicorn`` (a Python with FastAPI and
    uvicorn) vLLM's API-server stack, which keeps connections open, streaming the same tokens."""
    env = {**os.environ, "PBSTK_TEST_STANDIN_DELAY": "0", "PBSTK_TEST_STANDIN_TOKEN_S": str(token_ms / 1000)}
    procs, urls = [], []
    for _ in range(n):
        port = free_port()
        argv = [uvicorn, str(Path(__file__).parent / "bench_upstream_connections.py"), "--serve", str(port), "--tokens",
                str(tokens), "--token-ms", str(token_ms)] if uvicorn else [
            sys.executable, str(STANDIN), "serve", "m", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
            str(seqs)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,  # noqa: S603 - an argument list
                                      stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (the router's wrapper, the front, its relay processes, the router)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=20.0, help="per target (default 20)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="streamed tokens per request (default 32)")
    parser.add_argument("--token-ms", type=float, default=20.0, help="ms between two tokens (default 20)")
    parser.add_argument("--procs", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--policy", default="power_of_two", help="the router's policy (default: the profile's)")
    parser.add_argument("--targets", default="direct,router,front")
    parser.add_argument("--uvicorn", metavar="PYTHON", help="replicas on FastAPI/uvicorn run by PYTHON (keep-alive)")
    parser.add_argument("--router", type=Path, default=ROUTER, help="the vllm-router command (default: beside python)")
    parser.add_argument("--router-arg", action="append", default=[], help="appended to the router's arguments")
    args = parser.parse_args()
    targets = args.targets.split(",")
    if not args.router.exists():
        print(f"{args.router} is missing: pip install vllm-router", file=sys.stderr)
        return 2
    replicas, urls = start_replicas(args.replicas, args.tokens, args.token_ms, max(256, 2 * args.concurrency),
                                    args.uvicorn)
    runner, rows = LocalRunner(), []
    try:
        time.sleep(2)
        drive(urls, 8, 1.0, args.tokens, 1)  # warm-up
        for target in targets:
            info = None
            if target != "direct":
                info = start_router(runner, tempfile.mkdtemp(prefix="pbstk-bench-svc-") + "/router",
                                    command=[str(args.router)], worker_urls=urls, policy=args.policy,
                                    isolate=target == "front", extra_args=args.router_arg)
            try:
                if info:
                    drive([info.url], 8, 1.0, args.tokens, 1)
                pids, served = descendants(info.pid) if info else [], [p.pid for p in replicas]
                cpu0, served0 = cpu_seconds(pids), cpu_seconds(served)
                row = drive([info.url] if info else urls, args.concurrency, args.seconds, args.tokens, args.procs)
                row["cpu_us"] = (cpu_seconds(pids) - cpu0) / max(1, row["requests"]) * 1e6
                row["replica_us"] = (cpu_seconds(served) - served0) / max(1, row["requests"]) * 1e6
                rows.append((target, row))
            finally:
                if info:
                    stop_router(runner, info, timeout=5)
    finally:
        for p in replicas:
            p.kill()
            p.wait()
    print(f"{args.replicas} stand-in replicas, {args.tokens} tokens {args.token_ms:g} ms apart, c={args.concurrency}, "
          f"{args.seconds:g} s per target, policy {args.policy} {' '.join(args.router_arg)}, {os.cpu_count()} CPUs")
    print(f"{'target':<7} {'requests':>8} {'failed':>6} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'e2e p50':>8} {'e2e p99':>8} {'tok/s x':>8} {'p99 x':>6} {'CPU us/req':>10} {'replicas us/req':>15}")
    base = dict(rows).get("direct")
    for target, r in rows:
        ratio = r["tok_s"] / base["tok_s"] if base else float("nan")
        p99x = r["ttft_p99"] / base["ttft_p99"] if base else float("nan")
        print(f"{target:<7} {r['requests']:>8.0f} {r['failed']:>6.0f} {r['rps']:>7.0f} {r['tok_s']:>8.0f} "
              f"{r['ttft_p50']:>9.1f} {r['ttft_p99']:>9.1f} {r['e2e_p50']:>8.0f} {r['e2e_p99']:>8.0f} "
              f"{ratio:>8.3f} {p99x:>6.2f} {r['cpu_us']:>10.0f} {r['replica_us']:>15.0f}")
    return 1 if any(r["failed"] for _, r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
