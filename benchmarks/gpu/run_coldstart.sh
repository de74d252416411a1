#!/usr/bin/env bash
# Issue 23 items 4-5 on a lent 2-GPU machine, local scheduler, real vLLM (docs/coldstart.md): where a start's seconds
# go, from `pbstk status --json`'s startup phases, for one model (Qwen3-1.7B-shaped, dummy weights, CUDA graphs):
#   cold           `launch --preset single --wait` with an empty compile cache
#   warm           the same launch again (the cache cold left behind)
#   service        `serve --replicas 2 --wait` with an empty cache: both replicas compile at once (torch >= 2.10
#                  shares the cache safely)
#   service-serial the same with PBSTK_COMPILE_SERIAL=1: the first replica compiles, the second waits for it and
#                  starts from its cache (what torch < 2.10 gets)
# Each step writes STEP.json (the status objects) and one line per job to summary.txt.
# Usage, from the checkout root there (after staging vLLM, benchmarks/gpu/setup_device.sh):
#   bash benchmarks/gpu/run_coldstart.sh OUT_DIR cold warm service service-serial
# Each step is one or two vLLM starts (60-160 s each): run them in separate calls if a call is limited to 10 min;
# the compile cache lives in /tmp/pbstk-coldstart-cache while the machine stays warm.
# CPU check (no GPU, nothing started): bash benchmarks/gpu/run_coldstart.sh --check
set -euo pipefail
if [ "${1:-}" = --check ]; then
  bash -n "$0"
  if command -v shellcheck >/dev/null 2>&1; then shellcheck -x "$0"; fi
  echo "run_coldstart.sh: syntax and shellcheck clean"
  exit 0
fi
out=${1:?usage: run_coldstart.sh OUT_DIR cold|warm|service|service-serial ... (or --check)}
shift
mkdir -p "$out"
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
if [ ! -x /tmp/pbstk-site/bin/vllm-router ] && compgen -G 'gpu-stage/router/*.whl' >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/pbstk-site gpu-stage/router/*.whl
fi
cache=/tmp/pbstk-coldstart-cache
model=/root/qwen3-1.7b
pbstk() { python3 -m pbs_toolkit "$@"; }

# profile SERIAL(0|1) GPUS_PER_JOB: the lent machine's profile, its compile cache here, the router installed above
profile() {
  local file="$out/profile-$1.yaml"
  { sed -e "s/^name: .*/name: coldstart-$1/" -e "s/^gpus_per_node: .*/gpus_per_node: $2/" \
      -e "s|^vllm_cache_root: .*|vllm_cache_root: $cache|" benchmarks/gpu/local-h200x2.yaml
    # the env: mapping ends the base file: the serial switch joins it, before the next top-level key
    if [ "$1" = serial ]; then echo '  PBSTK_COMPILE_SERIAL: "1"'; fi
    echo "router_command: /tmp/pbstk-site/bin/vllm-router"; } >"$file"
  echo "$file"
}
common=(--served-model-name qwen3-1.7b --vllm-arg=--load-format=dummy --preset single)

# summary STEP FILE: one line per job object in FILE: total, then each phase's seconds
summary() {
  python3 - "$1" "$2" <<'EOF' | tee -a "$out/summary.txt"
import json, sys
step, path = sys.argv[1], sys.argv[2]
doc = json.load(open(path))
jobs = doc if isinstance(doc, list) else [doc]
for item in jobs:
    for job in item.get("jobs") or [item]:
        s = job.get("startup") or {}
        phases = s.get("phases") or {}
        shown = " ".join(f"{k}={v}" for k, v in phases.items() if v is not None)
        print(f"{step:15s} {job.get('job_id', '?'):>12s} {job.get('state', '?'):9s} total={s.get('total_s')} {shown}")
EOF
}

for what in "$@"; do
  start=$(date +%s)
  case "$what" in
    cold | warm)
      [ "$what" = cold ] && rm -rf "$cache"
      prof=$(profile concurrent 1)
      job=$(pbstk launch "$model" --name "cs-$what" --profile "$prof" "${common[@]}" --wait --timeout 600 \
        | awk 'NR == 1 { print $2 }')
      pbstk status "$job" --json >"$out/$what.json"
      summary "$what" "$out/$what.json"
      find "$cache" -maxdepth 4 -type d >"$out/$what-cache-dirs.txt" 2>/dev/null || true
      pbstk cancel "$job" ;;
    service | service-serial)
      rm -rf "$cache"
      kind=concurrent
      [ "$what" = service-serial ] && kind=serial
      prof=$(profile "$kind" 1)
      pbstk serve "$model" --name "cs-$what" --replicas 2 --policy round_robin --profile "$prof" "${common[@]}" \
        --wait --timeout 900
      pbstk status "cs-$what" --json >"$out/$what.json"
      summary "$what" "$out/$what.json"
      grep -h "compil" ~/pbstk-runs/*/vllm.log 2>/dev/null | grep "^pbstk:" >"$out/$what-compile-lines.txt" || true
      pbstk cancel "cs-$what" ;;
    *) echo "unknown step: $what" >&2; exit 2 ;;
  esac
  echo "== $what took $(($(date +%s) - start)) s"
done
tar czf "$out/logs.tgz" --exclude='api_key' --exclude='*api_key*' -C ~/pbstk-runs . 2>/dev/null || true  # without the servers' keys
