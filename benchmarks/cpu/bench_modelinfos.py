"""What a start under a new compile-cache key pays for vLLM's registry, with and without the shared modelinfos.

pbstk keys VLLM_CACHE_ROOT per torch/vLLM version, model and layout (server/start/coldstart.sh). vLLM keeps what
its registry learnt of a model class in VLLM_CACHE_ROOT/modelinfos; without an entry it learns it in a fresh
Python process that imports torch and vLLM. Each measurement is a fresh interpreter that inspects one class:

    .venv-vllm/bin/python benchmarks/cpu/bench_modelinfos.py [--arch Qwen3ForCausalLM]

prints the seconds of the inspection under a new key alone (what every new model/layout paid before) and under a
new key whose modelinfos is the shared one (what it pays now, after the first start of the class anywhere).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import sys, time
from vllm.model_executor.models.registry import ModelRegistry
t = time.perf_counter()
ModelRegistry.models[sys.argv[1]].inspect_model_cls()
print(f"{time.perf_counter() - t:.2f}")
"""


def inspect_seconds(cache_root: Path, arch: str) -> float:
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache_root), VLLM_LOGGING_LEVEL="WARNING")
    out = subprocess.run([sys.executable, "-c", PROBE, arch], env=env, capture_output=True, text=True,  # noqa: S603
                         check=True, timeout=600)
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="Qwen3ForCausalLM", help="a model class vLLM registers lazily")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        alone = inspect_seconds(root / "key-a", args.arch)
        (root / "modelinfos").mkdir()
        for key in ("key-b", "key-c"):
            (root / key).mkdir()
            (root / key / "modelinfos").symlink_to(root / "modelinfos")
        first = inspect_seconds(root / "key-b", args.arch)  # the first start of the class, anywhere
        shared = inspect_seconds(root / "key-c", args.arch)  # any later new key
    print(f"{args.arch}: new key, own modelinfos: {alone:.2f} s; first key on the shared one: {first:.2f} s; "
          f"a later new key on the shared one: {shared:.2f} s")


if __name__ == "__main__":
    main()
