#!/usr/bin/env bash
# Issue 30 on a lent 4-GPU machine: Qwen3-VL-2B-shaped (benchmarks/gpu/mkmodel_vl.py, dummy weights), served by
# pbstk with images. Each PHASE fits one device call; run them in calls that follow at once (the machine keeps
# /root, /tmp and the compile cache while it stays warm). From the checkout root there:
#   bash benchmarks/gpu/run_vl.sh OUT_DIR chat       dp4: an image chat through update-endpoint's registry entry
#                                                    (openai client, base64 PNG), then the text-only switch: the same
#                                                    chat refused by vLLM, and both KV cache sizes from vLLM's log
#   bash benchmarks/gpu/run_vl.sh OUT_DIR tune P,Q   `pbstk tune` of presets P,Q on image+text load (1 image of
#                                                    512x512 + 128 tokens in, 256 out) at c=1,64,256, appended to
#                                                    OUT_DIR/vl-tune.json (same method, so the table is one;
#                                                    CLIENT=vllm for `vllm bench serve`, default pbstk's own)
# GPUS=2 does the same on a 2-GPU machine (chat with dp2; tune dp2,tp2,tp2-eager there); PRESET picks chat's preset
# (GPUS=1 PRESET=single: one GPU of a machine that runs something else on the others, CUDA_VISIBLE_DEVICES=3;
# PORT and CACHE_ROOT as in run_models.sh).
set -euo pipefail
out=${1:?usage: run_vl.sh OUT_DIR chat|tune PRESETS}
what=${2:?chat or tune}
mkdir -p "$out"
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
model=/root/qwen3-vl-2b
[ -f "$model/config.json" ] || python3 benchmarks/gpu/mkmodel_vl.py "$model"
profile="$out/profile.yaml"
gpus=${GPUS:-4}
sed -e "s/^name: .*/name: local-gpu$gpus/" -e "s/^gpus_per_node: .*/gpus_per_node: $gpus/" -e "s/^port: .*/port: ${PORT:-8000}/" \
  -e "s|^vllm_cache_root: .*|vllm_cache_root: ${CACHE_ROOT:-/tmp/vllm-compile-cache}|" \
  -e "s/^description: .*/description: lent $gpus-GPU machine, no scheduler/" benchmarks/gpu/local-h200x2.yaml >"$profile"
# the image has no flashinfer, and this model's engine imports vLLM's FlashInfer sampler unless told not to
common=(--profile "$profile" --served-model-name qwen3-vl-2b --vllm-arg=--load-format=dummy --walltime 01:00:00
  --env VLLM_USE_FLASHINFER_SAMPLER=0)
pbstk() { python3 -m pbs_toolkit "$@"; }
t0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - t0 )) s: $*"; }
kv_line() {  # JOB: vLLM's own KV cache size and start-up lines from the job's log
  local dir
  dir=$(pbstk status "$1" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)[0]["run_dir"])')
  grep -rhE "GPU KV cache size|Maximum concurrency for|Encoder cache will be initialized|init engine .* took" \
    "$dir" 2>/dev/null | sed "s/^/[$1] /" | head -12 || true
}

case "$what" in
  chat)
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    python3 -c 'import vllm, transformers, PIL; print("vllm", vllm.__version__, "transformers", transformers.__version__, "PIL", PIL.__version__)' || true
    for variant in vl vl-text; do
      extra=(); [ "$variant" = vl-text ] && extra=(--text-only)
      stamp "launch $variant: ${PRESET:-dp$gpus} ${extra[*]}"
      pbstk launch "$model" --name "$variant" --preset "${PRESET:-dp$gpus}" "${common[@]}" "${extra[@]}" --wait --timeout 420
      pbstk update-endpoint "$variant" --registry "$out/endpoints.py"
      eval "$(pbstk env "$variant")"
      stamp "chat with $variant through $out/endpoints.py"
      python3 benchmarks/gpu/vl_chat.py "$out/endpoints.py" "$variant" --images 1 || echo "[$variant] vl_chat exit $?"
      kv_line "$variant"
      pbstk status "$variant"
      pbstk cancel "$variant"
    done ;;
  tune)
    presets=${3:?tune PRESETS}
    stamp "tune $presets"
    # CLIENT (default builtin): `vllm bench serve` spent ~30 s a level importing vLLM on the 4x H100 hosts, 90 s a
    # preset, and two presets did not fit one call; pbstk's client starts at once and warms each level up as vLLM's
    pbstk tune "$model" --name vl --presets "$presets" "${common[@]}" --images 1 --image-size 512x512 \
      -c 1,64,256 --input-len 128 --output-len 256 --rounds 2 --timeout 420 --client "${CLIENT:-builtin}" \
      --output "$out/vl-tune.json" --append
    for dir in ~/pbstk-runs/*; do grep -hE "GPU KV cache size" -r "$dir" 2>/dev/null | head -1 | sed "s|^|[$(basename "$dir")] |"; done || true
    ;;
  *) echo "unknown phase: $what" >&2; exit 2 ;;
esac
stamp "done"
