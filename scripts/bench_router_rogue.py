#!/usr/bin/env python3
"""Does a worker that another user adds to a service's router get requests (and with them the service's key)?

The real vllm-router (this venv's), started by pbstk as a service's router, a stand-in replica (tests/standins/vllm)
that wants the service's key, and a rogue worker on loopback that records every request. For SECONDS, a thread
re-adds the rogue every 50 ms through the router's public URL (``POST /add_worker?url=ROGUE``, no token) while a
client sends authenticated chat requests through the same URL. Printed per isolation mode: the client's requests
and answers, what the rogue received, the admin calls' answers, and the client's request rate.

    python scripts/bench_router_rogue.py                    # 20 s, router_isolation netns, then none
    python scripts/bench_router_rogue.py --seconds 5 --isolation netns
    python scripts/bench_router_rogue.py --overhead --seconds 10   # what the front costs, no rogue
    python scripts/bench_router_rogue.py --streams 16 --seconds 10  # streamed chunks/s, the front's CPU a chunk

Measured here (2 shared CPU cores, loopback): netns: the rogue got 0 requests; none: about a third of them.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pbs_toolkit.services.router import start_router, stop_router  # noqa: E402
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


def front_cpu_s(wrapper_pid: int) -> float:
    """CPU seconds (user + system) used so far by the router's front, the child of pbstk's wrapper."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == wrapper_pid and b"router_front.py" in cmdline:
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def stream(isolation: str, seconds: float, streams: int, tokens: int) -> None:
    """``streams`` clients in a loop, each streaming ``tokens`` chunks per request: chunks/s, and the front's CPU."""
    proc, replica_url = replica()
    runner = LocalRunner()
    with tempfile.TemporaryDirectory() as tmp:
        info = start_router(runner, f"{tmp}/router", command=[str(ROUTER)], worker_urls=[replica_url],
                            isolate=isolation == "netns")
        chunks: list[int] = [0] * streams
        body = {**CHAT, "max_tokens": tokens, "stream": True}

        def client(i: int, deadline: float) -> None:
            with requests.Session() as session:
                while time.monotonic() < deadline:
                    with session.post(f"{info.url}/v1/chat/completions", json=body, stream=True, timeout=60,
                                      headers={"Authorization": f"Bearer {KEY}"}) as answer:
                        chunks[i] += sum(1 for line in answer.iter_lines() if line.startswith(b"data: {"))

        try:
            cpu0 = front_cpu_s(info.pid)
            start = time.monotonic()
            threads = [threading.Thread(target=client, args=(i, start + seconds)) for i in range(streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - start
            cpu = front_cpu_s(info.pid) - cpu0
        finally:
            stop_router(runner, info, timeout=3)
            proc.kill()
    total = sum(chunks)
    front = (f", the front used {cpu:.1f} CPU s ({1e6 * cpu / max(total, 1):.0f} us a chunk)"
             if isolation == "netns" else "")
    print(f"router_isolation {isolation}: {streams} streams x {tokens} tokens for {seconds:g} s: "
          f"{total} chunks ({total / elapsed:.0f}/s){front}")


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
    args = parser.parse_args()
    for isolation in ("netns", "none") if args.isolation == "both" else (args.isolation,):
        if args.streams:
            stream(isolation, args.seconds, args.streams, args.tokens)
        else:
            run(isolation, args.seconds, attack=not args.overhead)


if __name__ == "__main__":
    main()
