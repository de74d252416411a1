#!/usr/bin/env python3
"""The most pbstk's built-in load generator (``pbstk bench|tune --client builtin``) can drive on this host.

A server process of its own (standard library only) answers every request at once with ``--output-len`` streamed
chat chunks, as fast as it can write them; the client (``pbs_toolkit.perf.bench.run_benchmark_sync``) keeps
``--concurrency`` requests open, first text only, then with ``--images`` base64 PNGs of ``--image-size`` each.
``--processes N`` (default: what ``tune`` and ``bench`` use at that concurrency on this host,
``pbs_toolkit.perf.load_procs.auto_processes``) adds the same runs from N client processes. Printed for each:
requests/s, output tokens/s and, from one process, the client's own CPU per request. A GPU figure near these may be
the client's, not the server's: on 4x H200 (2026-11-28) a VL dp4 and tp2dp2 both stopped near 30 requests/s at c=64
and c=256 with one 512x512 image a request, whatever their decode speed.

    PYTHONPATH=$PWD python benchmarks/cpu/bench_client_ceiling.py [--concurrency 256] [--prompts 512] [--images 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pbs_toolkit.perf.bench import run_benchmark_sync  # noqa: E402
from pbs_toolkit.perf.images import image_load  # noqa: E402
from pbs_toolkit.perf.load_procs import auto_processes, run_benchmark_procs  # noqa: E402

_CHUNK = ("data: " + json.dumps({"object": "chat.completion.chunk",
                                 "choices": [{"index": 0, "delta": {"content": " w"}}]}) + "\n\n").encode()


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:  # keep-alive: one request after another on this connection
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = json.loads(await reader.readexactly(length))
            tokens = int(body.get("max_tokens") or 16)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for index in range(tokens):
                writer.write(_frame(_CHUNK))
                if index % 16 == 15:
                    await writer.drain()
            usage = {"choices": [], "usage": {"prompt_tokens": 128, "completion_tokens": tokens}}
            writer.write(_frame(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()) + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


def _serve(sock: socket.socket) -> None:
    async def main() -> None:
        server = await asyncio.start_server(_answer, sock=sock, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--image-size", default="512x512")
    parser.add_argument("--processes", type=int, default=None)
    args = parser.parse_args()
    processes = args.processes or auto_processes(args.concurrency)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    server = multiprocessing.Process(target=_serve, args=(sock,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    print(f"client ceiling, c={args.concurrency}, {args.prompts} requests of {args.output_len} streamed tokens "
          f"({multiprocessing.cpu_count()} CPUs here, Python {sys.version.split()[0]})")
    try:
        for count in sorted({0, args.images}):
            load = image_load(count, args.image_size)
            what = f"{count} image(s) of {args.image_size}" if count else "text only"
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            res = run_benchmark_sync(url, "m", concurrency=args.concurrency, num_prompts=args.prompts,
                                     input_len=128, output_len=args.output_len, images=load)
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
            print(f"  {what:24} 1 process:   {res.completed}/{args.prompts} ok, {res.request_throughput:7.1f} "
                  f"requests/s, {res.output_throughput:9.0f} tokens/s; client CPU {1000 * cpu / args.prompts:.1f} "
                  f"ms a request (making it included)")
            if processes > 1:
                wall0 = time.perf_counter()
                res = run_benchmark_procs(url, "m", processes=processes, concurrency=args.concurrency,
                                          num_prompts=args.prompts, input_len=128, output_len=args.output_len,
                                          images=load)
                print(f"  {what:24} {processes} processes: {res.completed}/{args.prompts} ok, "
                      f"{res.request_throughput:7.1f} requests/s, {res.output_throughput:9.0f} tokens/s "
                      f"({time.perf_counter() - wall0:.1f} s with starting the processes)")
    finally:
        server.terminate()
        server.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
