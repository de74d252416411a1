#!/usr/bin/env bash
# Runs `pbstk tune` on a lent GPU machine (see benchmarks/README.md). Usage, from the checkout root there:
#   bash benchmarks/gpu/run_tune.sh OUT_JSON PRESETS [extra pbstk tune args...]
set -euo pipefail
out=${1:?usage: run_tune.sh OUT_JSON PRESETS [args]}
presets=${2:?presets}
shift 2
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -5 || true
python3 -m pbs_toolkit tune /root/qwen3-1.7b --name qwen3-1.7b --profile benchmarks/gpu/local-h200x2.yaml \
  --presets "$presets" -c 1,64,256 --input-len 128 --output-len 256 --rounds 2 \
  --vllm-arg=--load-format=dummy --timeout 400 --output "$out" --append "$@"
