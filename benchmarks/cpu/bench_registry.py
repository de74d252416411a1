"""Time endpoint-registry writes: one write into a 100-entry registry, and 50 concurrent writers, per format;
then the cost of one upsert into a large (default 4 MB) verifiers ``endpoints.py``.

Usage: python benchmarks/cpu/bench_registry.py [--repeats N] [--writers N] [--big-mb MB]
Prints plain numbers with units; nothing is written outside a temporary directory.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pbs_toolkit.endpoints.registry import FORMATS, EndpointEntry, read_endpoints, write_endpoint


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


# Run in a fresh interpreter so that its peak RSS is the upsert's own, not this process's: VmHWM belongs to the
# memory map that exec replaces (ru_maxrss would carry this process's high-water mark across exec).
_CHILD = """
import re, sys, time
from pbs_toolkit.endpoints.registry import EndpointEntry, write_endpoint
import filelock  # noqa: F401  imported up front: the timing is the edit, not the imports
def hwm():
    return int(re.search(r"^VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read(), re.M).group(1))
base = hwm()
start, cpu = time.perf_counter(), time.process_time()
write_endpoint(sys.argv[1], EndpointEntry("bench-new", "org/bench", "http://bench:8000/v1", "VLLM_KEY"))
elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
print(elapsed, cpu, base, hwm())
"""


def big_py_file(path: Path, megabytes: float) -> int:
    """Write a verifiers ``endpoints.py`` of about ``megabytes`` MB (one entry per 4 lines); its entry count."""
    lines = ['"""A large registry."""\n', "\n", "ENDPOINTS = {\n"]
    size, count = 0, 0
    while size < megabytes * 1_000_000:
        line = (
            f'    "model-{count}": {{"model": "org/model-{count}", "url": "http://node{count:05d}:8000/v1", '
            f'"key": "VLLM_KEY"}},  # entry {count}\n'
        )
        lines.append(line)
        size += len(line)
        count += 1
    lines.append("}\n")
    path.write_text("".join(lines))
    return count


def big_upsert(directory: Path, megabytes: float) -> tuple[float, float, float, float, int]:
    """(seconds, CPU seconds, peak RSS MB, interpreter RSS MB before the write, file bytes) of one upsert that
    appends an entry to a ``megabytes`` MB endpoints.py, measured in a child process (``resource.getrusage``)."""
    path = directory / "big_endpoints.py"
    big_py_file(path, megabytes)
    size = path.stat().st_size
    answer = subprocess.run(  # noqa: S603 - argument list
        [sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=False
    )
    if answer.returncode != 0:
        raise SystemExit(f"{path}: the upsert failed: {answer.stderr.strip()[-500:]}")
    elapsed, cpu, base_kb, peak_kb = answer.stdout.split()
    return float(elapsed), float(cpu), int(peak_kb) / 1024, int(base_kb) / 1024, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100, help="entries in the registry before timing")
    parser.add_argument("--repeats", type=int, default=21, help="single writes timed per format")
    parser.add_argument("--writers", type=int, default=50, help="concurrent writer processes per format")
    parser.add_argument("--big-mb", type=float, default=4.0, help="size of the large endpoints.py (0: skip)")
    parser.add_argument("--only-big", action="store_true", help="measure only the large endpoints.py")
    args = parser.parse_args()
    # Import the format libraries once up front so that the first timed write does not pay for them.
    import filelock  # noqa: F401
    import tomlkit  # noqa: F401
    import yaml  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        if args.big_mb > 0:
            seconds, cpu, peak, base, size = big_upsert(Path(tmp), args.big_mb)
            print(f"py    one upsert into a {size / 1e6:.1f} MB endpoints.py: {seconds:6.2f} s ({cpu:.2f} s CPU), "
                  f"peak RSS {peak:7.1f} MB (interpreter before the write {base:.1f} MB)")
        if args.only_big:
            return
        print(f"registry with {args.entries} entries; median of {args.repeats} writes; {args.writers} writers")
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
