#!/usr/bin/env python3
"""How long weight verification takes: ``pbstk stage --verify-only`` (hashes every byte) against the launch
preflight (sizes from the manifest only), on a Hub cache laid out by hand in a temporary directory.

Usage::

    PYTHONPATH=. python benchmarks/cpu/bench_stage.py [--mb 256] [--shards 4] [--files 12]

It prints one line per measurement. The numbers decide the design in docs/weights.md: the preflight runs at every
launch, so it must not read the weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pbs_toolkit.settings.profiles import Profile
from pbs_toolkit.transports.local import LocalRunner
from pbs_toolkit.weights.preflight import staged_problem
from pbs_toolkit.weights.stage import WORKER

REPO = "bench/model"


def build(hf_home: Path, mb: int, shards: int, small: int) -> None:
    repo = hf_home / "hub" / ("models--" + REPO.replace("/", "--"))
    commit = "ab" * 20
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    tree = {}
    files = {f"model-{k:05d}-of-{shards:05d}.safetensors": os.urandom(mb * (1 << 20) // shards) for k in range(shards)}
    files.update({f"extra-{k}.json": json.dumps({"k": k}).encode() for k in range(small)})
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{blob}")
        tree[name] = {"size": len(data), "blob_id": "0" * 40, "lfs_sha256": blob}
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "trees").mkdir()
    (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}))


def download(args: argparse.Namespace) -> None:
    """``stage_model`` of a model the stand-in Hub serves: loopback, so this is pbstk's and huggingface_hub's
    overhead plus hashing, not a network's speed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from standins.hub import FakeHub

    from pbs_toolkit.weights.stage import stage_model

    files = {f"model-{k:05d}-of-{args.shards:05d}.safetensors": os.urandom(args.mb * (1 << 20) // args.shards)
             for k in range(args.shards)}
    files.update({f"extra-{k}.json": json.dumps({"k": k}).encode() for k in range(args.files)})
    with tempfile.TemporaryDirectory() as tmp, FakeHub() as hub:
        hub.add(REPO, files)
        os.environ["HF_ENDPOINT"] = hub.url
        profile = Profile(name="bench", hf_home=tmp, venv=args.venv, hf_hub_offline=True)
        t0 = time.perf_counter()
        report = stage_model(LocalRunner(), profile, REPO)
        took = time.perf_counter() - t0
        assert report.ok, report.failures()
        print(f"pbstk stage (download from loopback + verify), {args.mb} MB, {len(files)} files: {took:.2f} s "
              f"({args.mb / took:.0f} MB/s)")
        t0 = time.perf_counter()
        assert stage_model(LocalRunner(), profile, REPO).ok
        print(f"pbstk stage again (nothing to download, verify only): {time.perf_counter() - t0:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--files", type=int, default=12, help="small files besides the shards")
    parser.add_argument("--venv", help="also time `pbstk stage` (download + verify) with this environment's "
                        "huggingface_hub, from the loopback Hub stand-in of tests/standins/hub.py")
    args = parser.parse_args()
    if args.venv:
        download(args)
    with tempfile.TemporaryDirectory() as tmp:
        hf_home = Path(tmp)
        build(hf_home, args.mb, args.shards, args.files)
        for jobs in (1, 4):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, str(WORKER), "--repo", REPO, "--cache", str(hf_home / "hub"),  # noqa: S603
                                  "--verify-only", "--jobs", str(jobs)], capture_output=True, text=True,
                                 check=True).stdout
            took = time.perf_counter() - t0
            assert '"ok": true' in out, out
            print(f"verify-only (sha256 of every byte), {args.mb} MB, {args.shards + args.files} files, "
                  f"{jobs} hashing thread(s): {took:.2f} s ({args.mb / took:.0f} MB/s)")
        profile = Profile(name="bench", hf_home=str(hf_home), hf_hub_offline=True)
        runner = LocalRunner()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert staged_problem(runner, profile, REPO) is None
            times.append(time.perf_counter() - t0)
        print(f"launch preflight (manifest + one stat command), {args.shards + args.files} files: "
              f"median {sorted(times)[2] * 1000:.1f} ms over 5 runs")


if __name__ == "__main__":
    main()
