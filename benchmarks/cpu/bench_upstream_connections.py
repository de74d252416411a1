#!/usr/bin/env python3
"""What a new connection per request costs vLLM's API server stack (FastAPI on uvicorn, one process, as vLLM's):
the router front passes each request to a worker on a connection of its own (``connection: close``), where the
router alone and ``vllm bench serve`` keep connections open.

A FastAPI app streams ``--tokens`` server-sent events ``--token-ms`` apart (a completion's shape) from one uvicorn
process; an aiohttp client keeps ``--concurrency`` requests open for ``--seconds``, first on kept-alive
connections, then on a new connection per request. Printed for each: requests/s and the server process's CPU per
request (/proc: independent of how busy the machine is). Needs fastapi, uvicorn and aiohttp (a vLLM environment).
``--serve PORT`` only serves (the replicas of ``bench_service_latency.py --uvicorn PYTHON``):

    /path/to/vllm-venv/bin/python benchmarks/cpu/bench_upstream_connections.py [--concurrency 64] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path


def serve(port: int, tokens: int, token_s: float) -> None:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def completions() -> StreamingResponse:
        async def events():  # type: ignore[no-untyped-def]
            for _ in range(tokens):
                yield b'data: {"choices": [{"index": 0, "text": "word "}]}\n\n'
                await asyncio.sleep(token_s)
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", backlog=2048)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, concurrency: int, seconds: float, keep_alive: bool) -> tuple[int, int]:
    import aiohttp

    done, failed = [0], [0]
    stop_at = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0, force_close=not keep_alive)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def loop() -> None:
            while time.monotonic() < stop_at:
                try:
                    async with session.post(url, json={"prompt": "hi"}) as response:
                        body = await response.read()
                    done[0] += response.status == 200 and body.endswith(b"[DONE]\n\n")
                except aiohttp.ClientError:
                    failed[0] += 1
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done[0], failed[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--token-ms", type=float, default=5.0)
    parser.add_argument("--serve", type=int, metavar="PORT", help="only serve on PORT (bench_service_latency.py)")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.tokens, args.token_ms / 1e3)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port, args.tokens, args.token_ms / 1e3))
    server.start()
    url = f"http://127.0.0.1:{port}/v1/completions"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            break
        except OSError:
            time.sleep(0.1)
    asyncio.run(drive(url, 8, 1.0, True))  # warm-up
    print(f"uvicorn, {args.tokens} events {args.token_ms:g} ms apart, c={args.concurrency}, {args.seconds:g} s each")
    print(f"{'connections':<24} {'requests':>8} {'failed':>6} {'req/s':>7} {'server CPU us/req':>18}")
    try:
        for name, keep in (("kept alive", True), ("new one per request", False), ("kept alive", True),
                           ("new one per request", False)):
            cpu0 = cpu_s(server.pid or 0)
            t0 = time.monotonic()
            done, failed = asyncio.run(drive(url, args.concurrency, args.seconds, keep))
            wall = time.monotonic() - t0
            per = (cpu_s(server.pid or 0) - cpu0) / max(1, done) * 1e6
            print(f"{name:<24} {done:>8} {failed:>6} {done / wall:>7.0f} {per:>18.0f}")
    finally:
        server.terminate()
        server.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
