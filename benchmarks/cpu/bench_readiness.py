#!/usr/bin/env python3
"""Benchmark readiness -> registry: how long after ``/v1/models`` first answers does ``pbstk update-endpoint``
write the registry? Target: <= 1 s.

Each run launches a job under the fake PBS (``tests/fakepbs``) with the stand-in vLLM (``tests/standins``),
which starts answering after ``PBSTK_TEST_STANDIN_DELAY`` seconds. This script polls ``/v1/models`` itself
in a tight loop to timestamp the first answer, and compares it with the registry file's mtime.

    python benchmarks/cpu/bench_readiness.py [--runs 5] [--delay 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def one_run(root: Path, delay: float, index: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PBSTK_", "FAKEPBS_"))}
    home = root / f"run{index}"
    for sub in ("config", "state", "data", "runs", "fakepbs"):
        (home / sub).mkdir(parents=True)
    env.update({
        "XDG_CONFIG_HOME": str(home / "config"), "XDG_STATE_HOME": str(home / "state"),
        "XDG_DATA_HOME": str(home / "data"), "PBSTK_RUNS_ROOT": str(home / "runs"),
        "FAKEPBS_HOME": str(home / "fakepbs"), "FAKEPBS_KILL_DELAY": "1",
        "PBSTK_TEST_STANDIN_DELAY": str(delay),
        "PATH": os.pathsep.join([str(REPO / "tests" / "standins"), str(REPO / "tests" / "fakepbs" / "bin"),
                                 env["PATH"]]),
    })
    pbstk = [sys.executable, "-m", "pbs_toolkit.cli.main"]
    subprocess.run([*pbstk, "launch", "Qwen/Qwen3-VL-2B-Instruct", "--preset", "dp4",  # noqa: S603 - argument list
                    "--profile", "generic-pbspro", "--port", "auto", "--name", f"bench{index}"],
                   env=env, check=True, capture_output=True)
    registry = home / "endpoints.json"
    updater = subprocess.Popen([*pbstk, "update-endpoint", "--registry", str(registry), "--timeout", "60"],  # noqa: S603
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = next((home / "runs").iterdir())
    key = (run_dir / "api_key").read_text()
    marker: dict[str, object] = {}
    first = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and first is None:
        try:
            marker = json.loads((run_dir / "server.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.01)
            continue
        if not marker.get("port") or not marker.get("address"):
            time.sleep(0.01)
            continue
        url = f"http://{marker['address']}:{marker['port']}/v1/models"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=1) as answer:  # noqa: S310 - loopback
                if answer.status == 200:
                    first = time.time()
        except (OSError, urllib.error.URLError):
            time.sleep(0.005)
    if updater.wait(timeout=60) != 0 or first is None:
        raise SystemExit(f"run {index}: update-endpoint failed (rc {updater.returncode})")
    lag = registry.stat().st_mtime - first
    subprocess.run([*pbstk, "cancel", f"bench{index}"], env=env, capture_output=True, check=False)  # noqa: S603
    return lag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--delay", type=float, default=2.0, help="seconds the stand-in takes to start answering")
    args = parser.parse_args()
    # ignore_cleanup_errors: the fake PBS may still be writing a cancelled job's output
    with tempfile.TemporaryDirectory(prefix="pbstk-bench-ready-", ignore_cleanup_errors=True) as tmp:
        lags = [one_run(Path(tmp), args.delay, i) for i in range(args.runs)]
        time.sleep(1.5)  # let the cancelled jobs end before their directories go
    print("lags (s): " + ", ".join(f"{x:.3f}" for x in lags))
    print(f"readiness -> registry written: median {statistics.median(lags):.3f} s, max {max(lags):.3f} s "
          f"over {args.runs} runs (target <= 1 s)")


if __name__ == "__main__":
    main()
