#!/usr/bin/env bash
# One `single` server on a lent GPU, benchmarked by both clients of `pbstk bench` (built-in and
# `vllm bench serve`), to check that they agree. Usage from the checkout root: run_bench_clients.sh OUT_DIR
set -euo pipefail
out=${1:?usage: run_bench_clients.sh OUT_DIR}
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
pbstk() { python3 -m pbs_toolkit "$@"; }
pbstk launch /root/qwen3-1.7b --name clients --preset single --profile benchmarks/gpu/local-h200x2.yaml \
  --vllm-arg=--load-format=dummy --wait --timeout 400
trap 'pbstk cancel clients' EXIT
pbstk bench clients --client builtin -c 1,64 --input-len 128 --output-len 256 --json >"$out/bench-builtin.json"
pbstk bench clients --client vllm -c 1,64 --input-len 128 --output-len 256 --json >"$out/bench-vllm.json"
pbstk bench clients --client builtin -c 1,64 --input-len 128 --output-len 256
pbstk bench clients --client vllm -c 1,64 --input-len 128 --output-len 256
pbstk doctor clients
