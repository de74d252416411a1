"""One benchmark level driven from several client processes, for loads one Python process cannot keep up with.

A client process spends a few ms of CPU on each streamed request (reading 256 chunks through httpx: ~5 ms on a 2-core
EPYC; sending a 1 MB image: more), so one process tops out near 200 requests a second there
(``benchmarks/cpu/bench_client_ceiling.py``; two processes: 330-360), below what a multi-GPU server answers. Each worker
process takes every P-th request of the run (the same requests one process would send: a request follows from its
index) and an equal share of the concurrency; all make their requests, then start together; the level's duration
runs from the first start to the last finish. Workers are spawned, not forked: the caller may hold threads (an SSH
transport).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import time
from typing import Any

from pbs_toolkit.errors import ServerFailed
from pbs_toolkit.perf.bench import BenchResult, Outcome, check_load, drive, request_bodies, request_url, summarize
from pbs_toolkit.perf.images import ImageLoad

#: at most this many client processes; fewer on a small host (one per 4 CPUs), and one below MIN_CONCURRENCY
MAX_PROCESSES = 4
MIN_CONCURRENCY = 64
#: seconds a worker may take to start and make its requests
_START_S = 120.0


def auto_processes(concurrency: int, cpus: int | None = None) -> int:
    """Client processes for a level: one, unless the level is wide and the host has CPUs to spare."""
    if concurrency < MIN_CONCURRENCY:
        return 1
    return max(1, min(MAX_PROCESSES, (cpus if cpus is not None else os.cpu_count() or 1) // 4))


def shares(concurrency: int, processes: int) -> list[int]:
    """``concurrency`` split as evenly as can be over ``processes`` (each at least 1)."""
    base, extra = divmod(concurrency, processes)
    return [base + (1 if k < extra else 0) for k in range(processes)]


def _worker(k: int, processes: int, concurrency: int, options: dict[str, Any], barrier: Any, results: Any) -> None:
    try:
        bodies = request_bodies(options["model"], range(k, options["num_prompts"], processes),
                                input_len=options["input_len"], output_len=options["output_len"],
                                seed=options["seed"], images=options["images"])
        barrier.wait(_START_S)
        started = time.time()
        outcomes, _ = asyncio.run(drive(options["url"], bodies, api_key=options["api_key"],
                                        concurrency=concurrency, timeout=options["timeout"]))
        results.put((k, outcomes, started, time.time(), ""))
    except BaseException as exc:  # noqa: BLE001 (a worker reports everything, the parent decides)
        results.put((k, [], 0.0, 0.0, f"{type(exc).__name__}: {exc}"))


def run_benchmark_procs(base_url: str, model: str, *, processes: int, api_key: str | None = None,
                        concurrency: int, num_prompts: int, input_len: int, output_len: int, timeout: float = 600,
                        seed: int = 0, images: ImageLoad | None = None) -> BenchResult:
    """:func:`pbs_toolkit.perf.bench.run_benchmark_sync`'s level from ``processes`` client processes (at most one
    per request in flight and per request)."""
    check_load(concurrency, num_prompts, input_len, output_len)
    processes = max(1, min(processes, concurrency, num_prompts))
    options = {"url": request_url(base_url, images), "model": model, "api_key": api_key, "num_prompts": num_prompts,
               "input_len": input_len, "output_len": output_len, "timeout": timeout, "seed": seed, "images": images}
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(k, processes, share, options, barrier, results), daemon=True)
               for k, share in enumerate(shares(concurrency, processes))]
    for worker in workers:
        worker.start()
    got: list[tuple[int, list[Outcome], float, float, str]] = []
    try:
        while len(got) < processes:
            try:
                got.append(results.get(timeout=_START_S + timeout))
            except queue.Empty:
                raise ServerFailed(f"{processes - len(got)} of {processes} benchmark client processes gave no "
                                   f"result within {_START_S + timeout:.0f} s") from None
    finally:
        for worker in workers:
            worker.join(5)
            if worker.is_alive():
                worker.terminate()
    failed = [error for _, _, _, _, error in got if error]
    if failed:
        raise ServerFailed(f"a benchmark client process failed: {failed[0]}", details=failed[1:])
    outcomes = [outcome for _, part, _, _, _ in sorted(got) for outcome in part]
    duration = max(end for _, _, _, end, _ in got) - min(start for _, _, start, _, _ in got)
    return summarize(outcomes, duration, concurrency, input_len)
