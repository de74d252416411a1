#!/usr/bin/env bash
# Issue 15's GPU proof on the lent 2x H200 (local scheduler, one GPU per replica): two replicas behind vllm-router
# started by `pbstk serve` against one replica at half the load and against in-process dp2, all measured with
# `vllm bench serve` (random 128 in / 256 out, --ignore-eos), levels long enough (>= 30 s) to be stable.
# Usage, from the checkout root there:  bash benchmarks/gpu/run_service.sh OUT_DIR one|service|dp2 [...]
# POLICIES="round_robin power_of_two" picks the router policies measured for `service` (default round_robin).
set -euo pipefail
out=${1:?usage: run_service.sh OUT_DIR one|service|dp2 [...]}
shift
mkdir -p "$out"
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
if [ ! -x /tmp/pbstk-site/bin/vllm-router ]; then  # the router wheel and the one dependency the image lacks
  python3 -m pip install -q --no-index --no-deps --target /tmp/pbstk-site gpu-stage/router/*.whl
fi
profile="$out/profile.yaml"
{ sed 's/^name: .*/name: local-h200x2-router/' benchmarks/gpu/local-h200x2.yaml
  echo "router_command: /tmp/pbstk-site/bin/vllm-router"; } >"$profile"
model=/root/qwen3-1.7b
served=qwen3-1.7b
common=(--profile "$profile" --served-model-name "$served" --vllm-arg=--load-format=dummy --walltime 01:00:00)

bench() {  # LABEL CONCURRENCY PROMPTS: the current OPENAI_BASE_URL/OPENAI_API_KEY
  local base=${OPENAI_BASE_URL%/v1}
  echo "== $1: c=$2, $3 prompts against $base"
  vllm bench serve --backend openai --base-url "$base" --endpoint /v1/completions --model "$served" \
    --tokenizer "$model" --dataset-name random --random-input-len 128 --random-output-len 256 --ignore-eos \
    --max-concurrency "$2" --num-prompts "$3" --save-result --result-dir "$out" --result-filename "$1.json" \
    2>&1 | grep -E "Successful|Failed|Benchmark duration|Output token throughput|Mean TTFT|P99 TTFT|Mean TPOT" || true
}

for what in "$@"; do
  start=$(date +%s)
  case "$what" in
    one)
      python3 -m pbs_toolkit launch "$model" --name one --preset single --gpus-per-node 1 "${common[@]}" --wait --timeout 420
      eval "$(python3 -m pbs_toolkit env one)"
      bench one-c1 1 32; bench one-c128 128 3000
      python3 -m pbs_toolkit cancel one ;;
    dp2)
      python3 -m pbs_toolkit launch "$model" --name dp2 --preset dp2 --gpus-per-node 2 "${common[@]}" --wait --timeout 420
      eval "$(python3 -m pbs_toolkit env dp2)"
      bench dp2-c256 256 6000
      python3 -m pbs_toolkit cancel dp2 ;;
    service)
      for policy in ${POLICIES:-round_robin}; do
        python3 -m pbs_toolkit serve "$model" --name "svc-$policy" --replicas 2 --preset single --gpus-per-node 1 \
          --policy "$policy" "${common[@]}" --wait --timeout 420
        python3 -m pbs_toolkit status "svc-$policy"
        eval "$(python3 -m pbs_toolkit env "svc-$policy")"
        bench "svc-$policy-c1" 1 32; bench "svc-$policy-c256" 256 6000
        python3 -m pbs_toolkit cancel "svc-$policy"
      done ;;
    *) echo "unknown: $what" >&2; exit 2 ;;
  esac
  echo "== $what took $(( $(date +%s) - start )) s"
done
tar czf "$out/logs.tgz" -C ~/pbstk-runs . 2>/dev/null || true
