#!/usr/bin/env bash
# Issue 31's GPU figures on a lent 1- or 2-GPU machine (local scheduler, vLLM 0.22.1), each phase in ONE call:
#   packed  three models (Qwen3 0.6B, 1.7B, 4B-shaped, dummy weights) packed by `pbstk serve` on one GPU: each
#           model's output tok/s at c=64 through the service alone, then all three at once, against the same
#           model launched alone (`--preset single`) on the same machine
#   swap    three models (1.7B, 4B, 8B-shaped) swapped on ONE GPU with `--max-awake 1` (the profile says 32 GB
#           per GPU so that the plan cannot keep them awake together): the time to the first token of one
#           streamed request for a sleeping model (the other sleeps, it wakes, it answers), three rounds,
#           against a fresh `pbstk launch` of the same 8B to READY; the swapper's log and `status`
#   each    `pbstk run` of the three packed models with `--each` running one `vllm bench serve` per model,
#           against three separate `pbstk run`s of the same command; then `pbstk usage --json` of both
#           (SOLO=0: without its second half; WIDE=q4:4b:256: also that model alone at c=256, through the
#           service; the models' KV cache lines of vLLM's logs in packed-kv.txt)
#   solo    only packed's second half (each model launched alone); sep: only each's second half (the separate runs);
#           MODELS="q17:1.7b q4:4b" picks which (NAME:SIZE, default all three)
# Usage, from the checkout root there:  bash benchmarks/gpu/run_models.sh OUT_DIR packed|swap|each|solo|sep [...]
# PROMPTS (default 1000) prompts per bench (128 in / 256 out, --ignore-eos). To share a machine with another run on
# other GPUs: CUDA_VISIBLE_DEVICES=2, PORT (the first port tried, default 8000), CACHE_ROOT (vLLM's compile cache, so
# that two runs never write one cache entry at once; default /tmp/vllm-compile-cache).
set -euo pipefail
out=${1:?usage: run_models.sh OUT_DIR packed|swap|each|solo|sep [...]}
shift
mkdir -p "$out"
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
if [ ! -x /tmp/pbstk-site/bin/vllm-router ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/pbstk-site gpu-stage/router/*.whl
fi
for size in 0.6b 4b 8b; do
  [ -f "/root/qwen3-$size/config.json" ] || python3 benchmarks/gpu/mkmodel_qwen3.py "$size" "/root/qwen3-$size"
done
prompts=${PROMPTS:-1000}
pbstk() { python3 -m pbs_toolkit "$@"; }
profile() {  # NAME GPUS GPU_GB: a copy of the lent machine's profile with the router, NAME.yaml in OUT_DIR
  { sed -e "s/^name: .*/name: $1/" -e "s/^gpus_per_node: .*/gpus_per_node: $2/" -e "s/^port: .*/port: ${PORT:-8000}/" \
      -e "s|^vllm_cache_root: .*|vllm_cache_root: ${CACHE_ROOT:-/tmp/vllm-compile-cache}|" benchmarks/gpu/local-h200x2.yaml
    echo "gpu_memory_gb: $3"; echo "router_command: /tmp/pbstk-site/bin/vllm-router"; } >"$out/$1.yaml"
  echo "$out/$1.yaml"
}
real_gb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | awk '{print int($1 / 1024)}')
dummy=(--vllm-arg=--load-format=dummy)

bench() {  # LABEL MODEL(served) TOKENIZER CONCURRENCY [BASE_URL]
  local base=${5:-${OPENAI_BASE_URL%/v1}}
  vllm bench serve --backend openai --base-url "$base" --endpoint /v1/completions --model "$2" --tokenizer "$3" \
    --dataset-name random --random-input-len 128 --random-output-len 256 --ignore-eos --max-concurrency "$4" \
    --num-prompts "$prompts" --save-result --result-dir "$out" --result-filename "$1.json" >"$out/$1.txt" 2>&1 || true
  grep -E "Successful|Failed|Output token throughput|P99 TTFT" "$out/$1.txt" | sed "s/^/[$1] /" || true
}

ttft() {  # LABEL SERVED: seconds to the first streamed token of one chat request through the service
  python3 - "$1" "$2" <<'PY' | tee -a "$out/swap-ttft.txt"
import json, os, sys, time, urllib.request
label, model = sys.argv[1:]
body = json.dumps({"model": model, "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 8,
                   "stream": True}).encode()
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
    "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
t0 = time.time()
with urllib.request.urlopen(req, timeout=600) as resp:
    for line in resp:
        if line.startswith(b"data: ") and b"delta" in line:
            break
print(f"[{label}] {model}: first token after {time.time() - t0:.2f} s")
PY
}

# the eval command of `each` and `sep`: one `vllm bench serve` against the run's server (its root comes from run's
# environment, PBSTK_SERVER_ROOT); its arguments: prompts, result dir, the result's prefix, then the model
# shellcheck disable=SC2016  # expanded by the inner shell, in the run
cmd=(bash -c 'exec vllm bench serve --base-url "$PBSTK_SERVER_ROOT" --backend openai --endpoint /v1/completions \
  --dataset-name random --random-input-len 128 --random-output-len 256 --ignore-eos --max-concurrency 64 \
  --num-prompts "$1" --save-result --result-dir "$2" --result-filename "$3-$4.json" --model "$4" \
  --tokenizer /root/qwen3-1.7b' bench "$prompts" "$out")
models=${MODELS:-q06:0.6b q17:1.7b q4:4b}  # NAME:SIZE of the models that `solo` and `sep` run

solo() {  # PROFILE: each of MODELS launched alone (`--preset single`), the same bench as packed's
  local m
  for m in $models; do
    pbstk launch "/root/qwen3-${m##*:}" --name "solo-${m%%:*}" --served-model-name "${m%%:*}" --preset single \
      --gpus-per-node 1 --profile "$1" "${dummy[@]}" --wait --timeout 900
    eval "$(pbstk env "solo-${m%%:*}")"
    bench "solo-${m%%:*}" "${m%%:*}" "/root/qwen3-${m##*:}" 64
    pbstk cancel "solo-${m%%:*}"
  done
}

separate() {  # PROFILE: one `pbstk run` a model of MODELS (the eval of `each`, alone), then everyone's usage
  local m t0
  t0=$(date +%s)
  for m in $models; do
    pbstk run "/root/qwen3-${m##*:}" --name "sep-${m%%:*}" --served-model-name "${m%%:*}" --preset single \
      --gpus-per-node 1 --profile "$1" "${dummy[@]}" -- "${cmd[@]}" sep "${m%%:*}" >"$out/sep-${m%%:*}.txt" 2>&1 || true
  done
  echo "[each] separate runs of $models: $(( $(date +%s) - t0 )) s" | tee -a "$out/each-run.txt"
  pbstk usage --json >"$out/usage.json" || true
  pbstk usage | tee "$out/usage.txt" || true
}

for what in "$@"; do
  start=$(date +%s)
  case "$what" in
    packed)
      p=$(profile packed1 1 "$real_gb")
      pbstk serve /root/qwen3-0.6b:name=q06 /root/qwen3-1.7b:name=q17 /root/qwen3-4b:name=q4 --name packed \
        --profile "$p" --dry-run | tee "$out/packed-plan.txt"
      pbstk serve /root/qwen3-0.6b:name=q06 /root/qwen3-1.7b:name=q17 /root/qwen3-4b:name=q4 --name packed \
        --profile "$p" "${dummy[@]}" --wait --timeout 900
      pbstk status packed | tee "$out/packed-status.txt"
      eval "$(pbstk env packed)"
      for m in q06:0.6b q17:1.7b q4:4b; do bench "packed-${m%%:*}-alone" "${m%%:*}" "/root/qwen3-${m##*:}" 64; done
      for m in q06:0.6b q17:1.7b q4:4b; do bench "packed-${m%%:*}-together" "${m%%:*}" "/root/qwen3-${m##*:}" 64 & done
      wait
      if [ -n "${WIDE:-}" ]; then  # NAME:SIZE:C, e.g. q4:4b:256: a level where the KV cache a share gives matters
        bench "packed-${WIDE%%:*}-c${WIDE##*:}" "${WIDE%%:*}" "/root/qwen3-$(cut -d: -f2 <<<"$WIDE")" "${WIDE##*:}"
      fi
      # each model's memory as vLLM counted it (its share, weights, KV cache): what the plan gave out, used
      for f in ~/pbstk-runs/packed-*/vllm*.log; do
        grep -E 'Model loading took|Available KV cache memory|GPU KV cache size|Maximum concurrency' "$f" \
          | sed "s|^|[packed-kv] $(basename "$f"): |" || true
      done | tee "$out/packed-kv.txt"
      pbstk cancel packed
      [ "${SOLO:-1}" = 0 ] || solo "$p" ;;
    solo)  # only the models alone (MODELS), for a call that packed's cut left without them
      solo "$(profile packed1 1 "$real_gb")" ;;
    swap)
      p=$(profile swap1 1 36)  # 36 GB a GPU on paper: 8B (0.70) cannot stay awake beside 4B (0.45) or 1.7B (0.30)
      pbstk serve /root/qwen3-1.7b:name=q17 /root/qwen3-4b:name=q4 /root/qwen3-8b:name=q8 --name swap \
        --profile "$p" --max-awake 1 --dry-run | tee "$out/swap-plan.txt"
      t0=$(date +%s)
      pbstk serve /root/qwen3-1.7b:name=q17 /root/qwen3-4b:name=q4 /root/qwen3-8b:name=q8 --name swap \
        --profile "$p" --max-awake 1 "${dummy[@]}" --wait --timeout 900
      echo "[swap] three models READY after $(( $(date +%s) - t0 )) s" | tee -a "$out/swap-ttft.txt"
      eval "$(pbstk env swap)"
      for round in 1 2 3; do for m in q17 q4 q8; do ttft "round$round" "$m"; done; done
      pbstk status swap | tee "$out/swap-status.txt"
      pbstk status swap --json >"$out/swap-status.json"
      pbstk logs swap --replica 0 -n 100000 | grep -E "swapper|asleep|listening" >"$out/swap-log.txt" || true
      pbstk cancel swap
      t0=$(date +%s)
      pbstk launch /root/qwen3-8b --name fresh-q8 --served-model-name q8 --preset single --gpus-per-node 1 \
        --profile "$p" --vllm-arg=--gpu-memory-utilization=0.77 "${dummy[@]}" --wait --timeout 900
      echo "[fresh] q8 alone READY after $(( $(date +%s) - t0 )) s" | tee -a "$out/swap-ttft.txt"
      eval "$(pbstk env fresh-q8)"
      ttft fresh q8
      pbstk cancel fresh-q8 ;;
    each)
      p=$(profile each1 1 "$real_gb")
      t0=$(date +%s)
      pbstk run /root/qwen3-0.6b:name=q06 /root/qwen3-1.7b:name=q17 /root/qwen3-4b:name=q4 --name each \
        --profile "$p" "${dummy[@]}" --each -- "${cmd[@]}" each '{model}' \
        2>&1 | tee "$out/each-run.txt" | grep -E "Output token throughput|MODEL|q06|q17|q4" || true
      echo "[each] one run over three models: $(( $(date +%s) - t0 )) s" | tee -a "$out/each-run.txt"
      separate "$p" ;;
    sep)  # only the separate runs (MODELS), for a call that each's cut left without them
      p=$(profile each1 1 "$real_gb")
      separate "$p" ;;
    *) echo "unknown: $what" >&2; exit 2 ;;
  esac
  echo "== $what took $(( $(date +%s) - start )) s"
done
