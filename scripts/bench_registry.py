"""Time endpoint-registry writes: one write into a 100-entry registry, and 50 concurrent writers, per format.

Usage: python scripts/bench_registry.py [--repeats N] [--writers N]
Prints plain numbers with units; nothing is written outside a temporary directory.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

from pbs_toolkit.registries import FORMATS, EndpointEntry, read_endpoints, write_endpoint


def _entry(index: int) -> EndpointEntry:
    return EndpointEntry(
        f"model-{index}", f"org/model-{index}", f"http://node{index:03d}:8000/v1", "VLLM_KEY"
    )


def _seed(path: Path, count: int) -> None:
    for index in range(count):
        write_endpoint(path, _entry(index))


def median_write_s(path: Path, repeats: int) -> float:
    """Median seconds of one write_endpoint that adds a new alias to the registry at ``path``."""
    times = []
    for index in range(repeats):
        start = time.perf_counter()
        write_endpoint(path, _entry(10_000 + index))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _writer(path: str, index: int, go: multiprocessing.synchronize.Event) -> None:
    go.wait()
    write_endpoint(path, _entry(20_000 + index))


def concurrent_writers_s(path: Path, writers: int) -> float:
    """Seconds from releasing ``writers`` started processes until the last one has written its entry."""
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    processes = [ctx.Process(target=_writer, args=(str(path), i, go)) for i in range(writers)]
    for process in processes:
        process.start()
    start = time.perf_counter()
    go.set()
    for process in processes:
        process.join()
    elapsed = time.perf_counter() - start
    if any(process.exitcode != 0 for process in processes):
        raise SystemExit(f"{path}: a writer failed")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100, help="entries in the registry before timing")
    parser.add_argument("--repeats", type=int, default=21, help="single writes timed per format")
    parser.add_argument("--writers", type=int, default=50, help="concurrent writer processes per format")
    args = parser.parse_args()
    # Import the format libraries once up front so that the first timed write does not pay for them.
    import filelock  # noqa: F401
    import libcst  # noqa: F401
    import tomlkit  # noqa: F401
    import yaml  # noqa: F401

    print(f"registry with {args.entries} entries; median of {args.repeats} writes; {args.writers} writers")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            path = Path(tmp) / f"endpoints.{fmt}"
            _seed(path, args.entries)
            one = median_write_s(path, args.repeats)
            many = concurrent_writers_s(path, args.writers)
            total = len(read_endpoints(path))
            expected = args.entries + args.repeats + args.writers
            if total != expected:
                raise SystemExit(f"{path}: {total} entries after the run, expected {expected}")
            print(
                f"{fmt:5} one write: {one * 1000:8.2f} ms   "
                f"{args.writers} concurrent writers: {many:6.2f} s ({many / args.writers * 1000:.1f} ms each)"
            )


if __name__ == "__main__":
    main()
