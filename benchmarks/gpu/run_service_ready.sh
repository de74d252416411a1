#!/usr/bin/env bash
# Issue 21's GPU proof (items 1, 2 and 7) on a lent 2-GPU machine, local scheduler, one GPU per replica, real vLLM:
#   ready     `pbstk serve --replicas 2 --policy power_of_two --wait`: when each replica's server first answered
#             /health, when the router first listed it, when serve returned; the first request through the URL.
#   keepalive `pbstk serve --replicas 1 --keep-alive` (walltime 5 min, handover 4 min: the successor is eligible
#             1 min after the first started) under a request loop: which GPU each job got, whether the successor
#             started at the preset's own --gpu-memory-utilization, failed requests across the handover.
# Usage, from the checkout root there (after staging vLLM, benchmarks/gpu/setup_device.sh):
#   bash benchmarks/gpu/run_service_ready.sh OUT_DIR ready|keepalive [...]
set -euo pipefail
out=${1:?usage: run_service_ready.sh OUT_DIR ready|keepalive [...]}
shift
mkdir -p "$out"
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
if [ ! -x /tmp/pbstk-site/bin/vllm-router ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/pbstk-site gpu-stage/router/*.whl
fi
profile="$out/profile.yaml"
{ sed -e 's/^name: .*/name: local-2gpu-router/' -e 's/^gpus_per_node: .*/gpus_per_node: 1/' \
    benchmarks/gpu/local-h200x2.yaml
  echo "router_command: /tmp/pbstk-site/bin/vllm-router"; } >"$profile"
model=/root/qwen3-1.7b
common=(--profile "$profile" --served-model-name qwen3-1.7b --vllm-arg=--load-format=dummy --preset single-eager)
pbstk() { python3 -m pbs_toolkit "$@"; }

for what in "$@"; do
  start=$(date +%s)
  case "$what" in
    ready)
      python3 benchmarks/gpu/watch_service.py ready svc-ready >"$out/ready-watch.txt" 2>&1 &
      watcher=$!
      pbstk serve "$model" --name svc-ready --replicas 2 --policy power_of_two "${common[@]}" --wait --timeout 480
      date +%s.%N >"$out/ready-returned"
      pbstk status svc-ready | tee "$out/ready-status.txt"
      eval "$(pbstk env svc-ready)"
      curl -s -o /dev/null -w 'first request through the URL: %{http_code}\n' "$OPENAI_BASE_URL/completions" \
        -H "Authorization: Bearer $OPENAI_API_KEY" -H 'Content-Type: application/json' \
        -d '{"model": "qwen3-1.7b", "prompt": "hi", "max_tokens": 4}' | tee -a "$out/ready-status.txt"
      wait "$watcher" || true
      python3 benchmarks/gpu/watch_service.py report "$out/ready-watch.txt" "$out/ready-returned" | tee "$out/ready.txt"
      pbstk cancel svc-ready ;;
    keepalive)
      pbstk serve "$model" --name svc-ka --replicas 1 --keep-alive --walltime 00:05:00 --handover 4m "${common[@]}" \
        --wait --timeout 480
      python3 benchmarks/gpu/watch_service.py handover svc-ka | tee "$out/keepalive.txt"
      nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv >>"$out/keepalive.txt" || true
      pbstk status svc-ka | tee -a "$out/keepalive.txt"
      pbstk cancel svc-ka ;;
    *) echo "unknown: $what" >&2; exit 2 ;;
  esac
  echo "== $what took $(( $(date +%s) - start )) s"
done
tar czf "$out/logs.tgz" --exclude='api_key' --exclude='*api_key*' -C ~/pbstk-runs . 2>/dev/null || true  # without the servers' keys
cp -r ~/.local/state/pbstk/services "$out/services" 2>/dev/null || true
