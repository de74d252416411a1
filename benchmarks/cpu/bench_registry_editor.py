"""One ``update-endpoint`` write into a verifiers ``endpoints.py``, by the byte-offset editor pbstk ships
(``endpoints/py_dict.py`` over ``py_locate.py``) and by a libcst editor (``registry_cst.py`` beside this file).

Usage: python benchmarks/cpu/bench_registry_editor.py [--entries 10 100 1000] [--repeats 7]

For each editor, registry size and edit (``add`` a new alias, ``replace`` the value of one in the middle), a
fresh interpreter runs ``write_endpoint`` (lock, read, edit, atomic rename: what ``update-endpoint`` does once
the server is ready) ``--repeats`` times, putting the file back before each, and reports the median wall time,
the median CPU time (less sensitive to other load on the machine), the child's peak RSS (VmHWM: its own, since
exec replaces the memory map), the part of it the writes added over the interpreter with everything imported,
and tracemalloc's peak of one more write (Python objects only: the memory of libcst's native parser is in the
RSS figures, not in tracemalloc's). Both editors must write the same file for every case. libcst's import, which
a user's ``pbstk`` would pay once per edit, is timed on its own. Needs libcst (``pip install libcst``); nothing
is written outside a temporary directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EDITORS = ("bytes", "libcst")
EDITS = ("add", "replace")


def registry_text(count: int) -> str:
    """An ``endpoints.py`` of ``count`` entries as a campaign writes them, with a docstring and comments."""
    lines = ['"""Endpoints for verifiers."""\n', "\n", "ENDPOINTS = {\n", "    # campaign entries\n"]
    for index in range(count):
        lines.append(f'    "model-{index}": {{"model": "org/model-{index}", "url": "http://node{index:05d}:8000/v1", '
                     f'"key": "VLLM_KEY"}},  # entry {index}\n')
    return "".join([*lines, "}\n"])


def _hwm_kb() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1))  # type: ignore[union-attr]


def _use_libcst_editor() -> None:
    """Put the libcst editor behind the ``py`` format, through the interface every format has."""
    import registry_cst

    from pbs_toolkit.endpoints.formats import FORMATS

    class LibcstFormat:
        name, suffixes, holds_secrets = "py", (".py",), False
        check, parse, remove = (staticmethod(registry_cst.check), staticmethod(registry_cst.parse),
                                staticmethod(registry_cst.remove))

        def upsert(self, text: str | None, entry: object, path: Path, api_key: str | None) -> tuple[str, bool]:
            return registry_cst.upsert(text, entry, path), False  # type: ignore[arg-type]

    FORMATS["py"] = LibcstFormat()


def child(editor: str, path: Path, edit: str, count: int, repeats: int, out: Path) -> None:
    """The measurement, in a fresh interpreter: prints ``median_s median_cpu_s rss_kb rss_added_kb traced_bytes``."""
    import tracemalloc

    import filelock  # noqa: F401  imported up front: the timing is the edit, not the imports
    import tomlkit  # noqa: F401
    import yaml  # noqa: F401

    from pbs_toolkit.endpoints.registry import EndpointEntry, write_endpoint

    if editor == "libcst":
        _use_libcst_editor()
    alias = "campaign-new" if edit == "add" else f"model-{count // 2}"
    entry = EndpointEntry(alias, "Qwen/Qwen3-VL-2B-Instruct", "http://gpu01:8000/v1", "VLLM_KEY")
    original = path.read_bytes()
    base = _hwm_kb()
    times, cpu_times = [], []
    for _ in range(repeats):
        path.write_bytes(original)
        start, cpu = time.perf_counter(), time.process_time()
        write_endpoint(path, entry)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    peak = _hwm_kb()
    path.write_bytes(original)
    tracemalloc.start()
    write_endpoint(path, entry)
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    out.write_bytes(path.read_bytes())
    print(statistics.median(times), statistics.median(cpu_times), peak, peak - base, traced)


def _run_child(editor: str, path: Path, edit: str, count: int, repeats: int, out: Path) -> list[float]:
    answer = subprocess.run(  # noqa: S603 - argument list
        [sys.executable, __file__, "--child", editor, str(path), edit, str(count), str(repeats), str(out)],
        capture_output=True, text=True, check=False,
    )
    if answer.returncode != 0:
        raise SystemExit(f"{editor} {edit} {count}: failed: {answer.stderr.strip()[-800:]}")
    return [float(x) for x in answer.stdout.split()]


def import_seconds(module: str, repeats: int = 5) -> float:
    """Median seconds of ``import module`` in a fresh interpreter."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: S603
                                 check=True).stdout) for _ in range(repeats)]
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[10, 100, 1000], help="registry sizes")
    parser.add_argument("--repeats", type=int, default=7, help="timed writes per case (the median is shown)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if importlib.util.find_spec("libcst") is None:
        raise SystemExit("bench_registry_editor: needs libcst (pip install libcst)")
    if args.child:
        editor, path, edit, count, repeats, out = args.child
        child(editor, Path(path), edit, int(count), int(repeats), Path(out))
        return
    print(f"one write_endpoint into endpoints.py; median of {args.repeats}; a fresh interpreter per row")
    print(f"{'editor':7} {'entries':>7} {'file KB':>8} {'edit':8} {'median ms':>10} {'CPU ms':>8} {'peak RSS MB':>12} "
          f"{'RSS added MB':>13} {'tracemalloc MB':>15}")
    with tempfile.TemporaryDirectory() as tmp:
        for count in args.entries:
            path = Path(tmp) / "endpoints.py"
            source = registry_text(count)
            for edit in EDITS:
                results = {}
                for editor in EDITORS:
                    path.write_text(source)
                    out = Path(tmp) / f"{editor}.out"
                    seconds, cpu, peak, added, traced = _run_child(editor, path, edit, count, args.repeats, out)
                    results[editor] = out.read_bytes()
                    print(f"{editor:7} {count:7d} {len(source) / 1000:8.1f} {edit:8} {seconds * 1000:10.1f} "
                          f"{cpu * 1000:8.1f} "
                          f"{peak / 1024:12.1f} {added / 1024:13.1f} {traced / 1e6:15.1f}")
                if results["bytes"] != results["libcst"]:
                    raise SystemExit(f"{count} entries, {edit}: the two editors wrote different files")
    print(f"import libcst in a fresh interpreter (paid once per pbstk command that edits): "
          f"{import_seconds('libcst') * 1000:.0f} ms")


if __name__ == "__main__":
    main()
