#!/usr/bin/env python3
"""Does a worker that another user adds to a service's router get requests (and with them the service's key)?

The real vllm-router (this venv's), started by pbstk as a service's router, a stand-in replica (tests/standins/vllm)
that wants the service's key, and a rogue worker on loopback that records every request. For SECONDS, a thread
re-adds the rogue every 50 ms through the router's public URL (``POST /add_worker?url=ROGUE``, no token) while a
client sends authenticated chat requests through the same URL. Printed per isolation mode: the client's requests
and answers, what the rogue received, the admin calls' answers, and the client's request rate.

    python benchmarks/cpu/bench_router_rogue.py                    # 20 s, router_isolation netns, then none
    python benchmarks/cpu/bench_router_rogue.py --seconds 5 --isolation netns
    python benchmarks/cpu/bench_router_rogue.py --overhead --seconds 10   # what the front costs, no rogue
    python benchmarks/cpu/bench_router_rogue.py --streams 128 --seconds 8  # streamed chunks/s, the front's CPU a chunk
    python benchmarks/cpu/bench_router_rogue.py --streams 128 --pace-ms 5 --seconds 8  # a chunk every 5 ms a stream

Measured here (2 shared CPU cores, loopback): netns: the rogue got 0 requests; none: about a third of them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pbs_toolkit.services.router.process import start_router, stop_router  # noqa: E402
from pbs_toolkit.transports.local import LocalRunner  # noqa: E402

ROUTER = Path(sys.executable).parent / "vllm-router"
KEY = "bench-service-key"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def rogue_server() -> tuple[ThreadingHTTPServer, Counter[str]]:
    seen: Counter[str] = Counter()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen[self.path + (" with the key" if KEY in (self.headers.get("Authorization") or "") else "")] += 1
            body = b'{"choices": [{"message": {"role": "assistant", "content": "stolen"}}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def replica() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_API_KEY": KEY, "PBSTK_TEST_STANDIN_DELAY": "0"}
    proc = subprocess.Popen(  # noqa: S603 - argument list
        [sys.executable, str(ROOT / "tests" / "standins" / "vllm"), "serve", "m", "--host", "127.0.0.1",
         "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("the stand-in replica did not start")


def front_cpu_s(run_dir: str) -> float:
    """CPU seconds (user + system) used so far by the router's front: all its relay processes."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if f"{run_dir}/router_front.py".encode() in cmdline:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def sse_server(tokens: int, pace_s: float) -> socket.socket:
    """A fast streaming stand-in replica: ``tokens`` SSE chunks per completion, each its own send, as fast as it can
    (the stand-in vLLM's Python HTTP server would be the bottleneck, not the front), or one every ``pace_s`` (then
    no two chunks travel together, as with a real engine's tokens)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    chunk = b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'
    other = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'

    def handle(sock: socket.socket) -> None:
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            data = b""
            while b"\r\n\r\n" not in data:
                more = sock.recv(65536)
                if not more:
                    return
                data += more
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                           if line.startswith(b"content-length:")), 0)
            while len(body) < length:
                body += sock.recv(65536)
            if b"completions" not in head.split(b"\r\n")[0]:
                sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (len(other), other))
                return
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            for _ in range(tokens):
                sock.sendall(chunk)
                if pace_s:
                    time.sleep(pace_s)
            sock.sendall(b"data: [DONE]\n\n")

    def accept() -> None:
        while True:
            try:
                sock, _ = lsock.accept()
            except OSError:
                return  # closed: the run is over
            threading.Thread(target=handle, args=(sock,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return lsock


def stream(isolation: str, seconds: float, streams: int, tokens: int, pace_s: float) -> None:
    """``streams`` raw-socket clients in a loop, each streaming ``tokens`` chunks per request from a fast stand-in:
    chunks/s, and the front's CPU a chunk (both of its hops: worker -> router and router -> client)."""
    upstream = sse_server(tokens, pace_s)
    runner = LocalRunner()
    with tempfile.TemporaryDirectory() as tmp:
        info = start_router(runner, f"{tmp}/router", command=[str(ROUTER)],
                            worker_urls=[f"http://127.0.0.1:{upstream.getsockname()[1]}"],
                            isolate=isolation == "netns")
        chunks: list[int] = [0] * streams
        body = json.dumps({**CHAT, "max_tokens": tokens, "stream": True}).encode()
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                   b"content-type: application/json\r\nauthorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
                   % (KEY.encode(), len(body), body))

        def client(i: int, deadline: float) -> None:
            while time.monotonic() < deadline:
                with socket.create_connection(("127.0.0.1", info.port), timeout=60) as sock:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.sendall(request)
                    tail = b""
                    while True:
                        data = sock.recv(65536)
                        if not data:
                            break
                        chunks[i] += (tail + data).count(b"data: {")
                        tail = data[-6:]

        try:
            for _ in range(2):  # warm up: the router's pool of connections, the front's processes
                client(0, time.monotonic() + 0.5)
            chunks[0] = 0
            cpu0 = front_cpu_s(info.run_dir)
            start = time.monotonic()
            threads = [threading.Thread(target=client, args=(i, start + seconds)) for i in range(streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - start
            cpu = front_cpu_s(info.run_dir) - cpu0
        finally:
            stop_router(runner, info, timeout=3)
            upstream.close()
    total = sum(chunks)
    front = (f", the front used {cpu:.2f} CPU s ({1e6 * cpu / max(total, 1):.1f} us a chunk, both hops)"
             if isolation == "netns" else "")
    pace = f", one each {1000 * pace_s:g} ms" if pace_s else ""
    print(f"router_isolation {isolation}: {streams} streams x {tokens} chunks{pace} for {seconds:g} s: "
          f"{total} chunks ({total / elapsed:.0f}/s){front}", flush=True)


def run(isolation: str, seconds: float, attack: bool = True) -> None:
    proc, replica_url = replica()
    rogue, seen = rogue_server()
    rogue_url = f"http://127.0.0.1:{rogue.server_address[1]}"
    runner = LocalRunner()
    with tempfile.TemporaryDirectory() as tmp:
        info = start_router(runner, f"{tmp}/router", command=[str(ROUTER)], worker_urls=[replica_url],
                            isolate=isolation == "netns")
        stop = threading.Event()
        adds: Counter[str] = Counter()

        def attacker() -> None:
            while not stop.is_set():
                try:
                    adds[str(requests.post(f"{info.url}/add_worker", params={"url": rogue_url}, timeout=2)
                             .status_code)] += 1
                except requests.RequestException as exc:
                    adds[type(exc).__name__] += 1
                stop.wait(0.05)

        thread = threading.Thread(target=attacker)
        answers: Counter[str] = Counter()
        try:
            if attack:
                thread.start()
            start = time.monotonic()
            with requests.Session() as client:
                while time.monotonic() - start < seconds:
                    try:
                        answers[str(client.post(f"{info.url}/v1/chat/completions", json=CHAT, timeout=10,
                                                headers={"Authorization": f"Bearer {KEY}"}).status_code)] += 1
                    except requests.RequestException as exc:
                        answers[type(exc).__name__] += 1
            elapsed = time.monotonic() - start
        finally:
            stop.set()
            if attack:
                thread.join(10)
            stop_router(runner, info, timeout=3)
            proc.kill()
            rogue.shutdown()
            rogue.server_close()
    sent = sum(answers.values())
    stolen = sum(n for path, n in seen.items() if path.startswith("/v1/"))
    if not attack:
        print(f"router_isolation {isolation}: {seconds:g} s, no rogue: {sent} requests ({sent / elapsed:.0f}/s), "
              f"answers {dict(answers)}")
        return
    print(f"router_isolation {isolation}: {seconds:g} s, rogue re-added every 50 ms")
    print(f"  client: {sent} authenticated requests ({sent / elapsed:.0f}/s), answers {dict(answers)}")
    print(f"  rogue:  {stolen} requests ({100 * stolen / max(sent, 1):.0f} %), all it got: {dict(seen) or 'nothing'}")
    print(f"  admin:  /add_worker answers {dict(adds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--isolation", choices=("netns", "none", "both"), default="both")
    parser.add_argument("--overhead", action="store_true",
                        help="no rogue: the client's request rate through the front and straight to the router")
    parser.add_argument("--streams", type=int, default=0,
                        help="no rogue: this many streaming clients; chunks/s and the front's CPU per chunk")
    parser.add_argument("--tokens", type=int, default=200, help="chunks per streamed answer (--streams)")
    parser.add_argument("--pace-ms", type=float, default=0.0,
                        help="--streams: the stand-in sends a chunk every this many ms (default: back to back)")
    args = parser.parse_args()
    for isolation in ("netns", "none") if args.isolation == "both" else (args.isolation,):
        if args.streams:
            stream(isolation, args.seconds, args.streams, args.tokens, args.pace_ms / 1000)
        else:
            run(isolation, args.seconds, attack=not args.overhead)


if __name__ == "__main__":
    main()
