#!/usr/bin/env python3
"""How long the CLI takes to start: median wall time of ``pbstk --help`` and of one ``pbstk render``, plus
the slowest imports of ``--help`` (``python -X importtime``). Goal: ``--help`` at most 120 ms, and at most 0.3x
of vec-inf's ``--help`` measured on the same machine in the same run (absolute times vary with the machine).

    python benchmarks/cpu/bench_cli.py            # N=15 runs each
    python benchmarks/cpu/bench_cli.py -n 30 --top 20
    python benchmarks/cpu/bench_cli.py --compare /tmp/vecinf/bin/vec-inf   # + the ratio to vec-inf 0.9.0's --help

Runs with an empty temporary XDG config and HF_HOME so a user's config cannot change what is measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_HELP_MS = 120.0
#: pbstk --help / the --compare command's --help
GOAL_RATIO = 0.3
RENDER_ARGS = ["render", "Qwen/Qwen3-VL-2B-Instruct", "--preset", "dp4", "--profile", "generic-pbspro"]


def pbstk_argv() -> list[str]:
    """This environment's own ``pbstk`` (beside its python: on a fresh machine only the venv has one), else
    ``python -m pbs_toolkit``; never another ``pbstk`` that happens to come first on PATH."""
    exe = Path(sys.executable).with_name("pbstk")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "pbs_toolkit"]


def median_ms(argv: list[str], runs: int, env: dict[str, str]) -> tuple[float, float]:
    """(median, min) wall time in milliseconds; fails loudly when the command fails."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = subprocess.run(argv, capture_output=True, env=env)  # noqa: S603 - argument list
        times.append((time.perf_counter() - start) * 1000)
        if result.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.decode()[-500:]}")
    return statistics.median(times), min(times)


def import_offenders(env: dict[str, str], top: int) -> list[tuple[int, int, str]]:
    """(cumulative us, self us, module) of the slowest imports of ``pbstk --help``, slowest first."""
    code = "import sys; sys.argv = ['pbstk', '--help']; from pbs_toolkit.cli.main import main; main()"
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", code],  # noqa: S603
                            capture_output=True, text=True, env=env)
    rows = []
    for line in result.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        self_us, cumulative_us, name = (part.strip() for part in line[len("import time:"):].split("|", 2))
        rows.append((int(cumulative_us), int(self_us), name))
    return sorted(rows, reverse=True)[:top]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", "--runs", type=int, default=15)
    parser.add_argument("--top", type=int, default=15, help="how many import offenders to show")
    parser.add_argument("--compare", metavar="EXE", help="another CLI (vec-inf) whose --help is timed the same way")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PBSTK_")}
        env.update(XDG_CONFIG_HOME=f"{tmp}/config", XDG_STATE_HOME=f"{tmp}/state", HF_HOME=f"{tmp}/hf",
                   PBSTK_RUNS_ROOT=f"{tmp}/runs")
        base = pbstk_argv()
        subprocess.run([*base, "--help"], capture_output=True, env=env)  # noqa: S603 - warm the page cache
        help_med, help_min = median_ms([*base, "--help"], args.runs, env)
        render_med, render_min = median_ms([*base, *RENDER_ARGS], args.runs, env)
        offenders = import_offenders(env, args.top)
        other = None
        if args.compare:
            subprocess.run([args.compare, "--help"], capture_output=True, env=env)  # noqa: S603 - warm the cache
            other = median_ms([args.compare, "--help"], args.runs, env)

    verdict = "ok" if help_med <= GOAL_HELP_MS else f"SLOWER than the {GOAL_HELP_MS:.0f} ms goal"
    print(f"pbstk --help   median {help_med:6.1f} ms  (min {help_min:6.1f}, n={args.runs})  {verdict}")
    print(f"pbstk render   median {render_med:6.1f} ms  (min {render_min:6.1f}, n={args.runs})  "
          f"[{' '.join(RENDER_ARGS)}]")
    if other is not None:
        ratio = help_med / other[0]
        verdict = "ok" if ratio <= GOAL_RATIO else f"above the {GOAL_RATIO}x goal"
        print(f"{args.compare} --help median {other[0]:6.1f} ms  (min {other[1]:6.1f}):  "
              f"pbstk/that = {ratio:.2f}x  {verdict}")
    print("\nslowest imports of --help (python -X importtime; microseconds, cumulative includes children):")
    print(f"{'cumulative':>11} {'self':>8}  module")
    for cumulative, self_us, name in offenders:
        print(f"{cumulative:>11} {self_us:>8}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
