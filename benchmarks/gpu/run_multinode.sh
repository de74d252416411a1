#!/usr/bin/env bash
# Issue 14's GPU proof on the lent 2x H200 machine, each GPU standing in for one node (local scheduler, one
# loopback address per "node"): in-process dp2 against 2-node native DP and 2-node TP, with `pbstk tune` (which
# launches with pbstk itself and benchmarks with `vllm bench serve`). Usage, from the checkout root there:
#   bash benchmarks/gpu/run_multinode.sh OUT_DIR inprocess-dp2|2node-dp|2node-tp [...]
set -euo pipefail
out=${1:?usage: run_multinode.sh OUT_DIR LAYOUT...}
shift
mkdir -p "$out"
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
for layout in "$@"; do
  case "$layout" in
    inprocess-dp2) args=(--presets dp2) ;;
    2node-dp) args=(--presets dp2 --gpus-per-node 1 --nodes 2) ;;
    2node-tp) args=(--presets tp2 --gpus-per-node 1 --nodes 2) ;;
    2node-dp-api2) args=(--presets dp2 --gpus-per-node 1 --nodes 2 --vllm-arg=--api-server-count=2) ;;
    *) echo "unknown layout $layout" >&2; exit 2 ;;
  esac
  echo "== $layout: pbstk tune ${args[*]}"
  start=$(date +%s)
  python3 -m pbs_toolkit tune /root/qwen3-1.7b --name "qwen3-1.7b-$layout" \
    --profile benchmarks/gpu/local-h200x2.yaml "${args[@]}" -c 1,64,256 --input-len 128 --output-len 256 \
    --rounds 2 --vllm-arg=--load-format=dummy --timeout 420 --output "$out/$layout.json" \
    || { echo "== $layout failed; logs:"; tail -n 40 ~/pbstk-runs/*"$layout"*/vllm*.log; }
  echo "== $layout took $(( $(date +%s) - start )) s"
  tar czf "$out/$layout-logs.tgz" --exclude='api_key' --exclude='*api_key*' -C ~/pbstk-runs . 2>/dev/null || true
done
