#!/usr/bin/env bash
# Issues 41 and 42 on a lent 1-GPU machine (local scheduler, vLLM 0.22.1, Qwen3-1.7B-shaped, dummy weights):
#   crash    a 1-replica service; kill -9 of its vLLM API server (what the OOM killer does): seconds from the kill
#            to the dead job's last process gone, to its GPU memory free, to READY again and to the first 200;
#            processes and GPU memory of the dead job left after it (0 expected); then the cancel leaves nothing
#   booking  two one-GPU `pbstk launch`es on the one GPU: the second waits PENDING with the reason, then serves once
#            the first is cancelled (seconds from the cancel to READY)
# Usage, from the checkout root there:  bash benchmarks/gpu/run_crash.sh OUT_DIR crash|booking [...]
# STANDINS=1 MODEL=DIR runs it here on tests/standins (no GPU): the script's own check, not a measurement.
set -uo pipefail
out=${1:?usage: run_crash.sh OUT_DIR crash|booking ...}
shift
mkdir -p "$out"
router=/tmp/pbstk-site/bin/vllm-router
model=${MODEL:-/root/qwen3-1.7b}
if [ "${STANDINS:-0}" = 1 ]; then  # a dry run of this script here: tests/standins' vllm and nvidia-smi, no GPU
  export PATH="$PWD/tests/standins:$PATH" PBSTK_TEST_GPU_DIR="$out/gpus" PBSTK_TEST_GPUS=1
  router=$(command -v vllm-router)
else
  # shellcheck source=benchmarks/gpu/setup_device.sh
  source benchmarks/gpu/setup_device.sh
  if [ ! -x "$router" ]; then  # the router wheel and the one dependency the image lacks
    python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/pbstk-site gpu-stage/router/*.whl
  fi
fi
profile="$out/profile.yaml"
# no gpus_per_node, no gpu_memory_gb: the local scheduler learns both from this machine (issue 42)
sed -e 's/^name: .*/name: local-h200/' -e '/^gpus_per_node:/d' benchmarks/gpu/local-h200x2.yaml >"$profile"
{ echo "router_command: $router"; echo "restart_backoff: 1s"; } >>"$profile"
common=(--profile "$profile" --preset single --served-model-name qwen3-1.7b --vllm-arg=--load-format=dummy)
pbstk() { python3 -m pbs_toolkit "$@"; }
now() { date +%s.%N; }
since() { python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.1f}")' "$1" "$(now)"; }
group_left() {  # PGID: "pid name" of each live process of the group
  for f in /proc/[0-9]*/stat; do
    { read -r st <"$f"; } 2>/dev/null || continue
    rest=${st##*) }
    read -r state _ pgrp _ <<<"$rest"
    [ "$pgrp" = "$1" ] && [ "$state" != Z ] && { p=${f#/proc/}; echo "${p%/stat} ${st#*(}"; }
  done
}
gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1; }
apps() { nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | tr '\n' ';'; }
complete() {  # URL KEY: HTTP status of one completion
  curl -s -o /dev/null -w '%{http_code}' -m 60 -H "Authorization: Bearer $2" -H 'Content-Type: application/json' \
    -d '{"model": "qwen3-1.7b", "prompt": "hello", "max_tokens": 8}' "$1/completions"
}

pbstk config show --profile "$profile" | grep -E '^(gpus_per_node|gpu_memory_gb) ' | tee "$out/learned.txt"
for step in "$@"; do
  case "$step" in
    crash)
      t=$(now)
      pbstk serve "$model" "${common[@]}" --name crash --replicas 1 --wait --timeout 500 >"$out/crash-serve.txt" 2>&1
      echo "[crash] READY after $(since "$t") s: $(tail -n 1 "$out/crash-serve.txt")"
      doc=$(pbstk status crash --json)
      job=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])[0]["jobs"][0]["job_id"])' "$doc")
      run_dir=$(pbstk status "$job" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)[0]["run_dir"])')
      api=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["pid"])' "$run_dir/server.json")
      url=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])[0]["url"])' "$doc")
      key=$(pbstk env crash | sed -n "s/^export OPENAI_API_KEY='\{0,1\}\([^']*\)'\{0,1\}$/\1/p")
      echo "[crash] job $job, API server pid $api, its group: $(group_left "$api" | tr '\n' ';')"
      echo "[crash] GPU before the kill: $(gpu_used) MiB used; $(apps)"
      t0=$(now)
      kill -9 "$api"
      gone='' free='' ready='' ok=''
      for _ in $(seq 1 1200); do  # at most 10 minutes, every half second
        [ -z "$gone" ] && [ -z "$(group_left "$api")" ] && gone=$(since "$t0") && echo "[crash] dead job's processes gone after $gone s"
        [ -z "$free" ] && [ "$(gpu_used)" -lt 2048 ] && free=$(since "$t0") && echo "[crash] GPU memory free after $free s"
        if [ -z "$ready" ]; then
          state=$(pbstk status crash --json 2>/dev/null | python3 -c 'import json, sys
d = json.load(sys.stdin)[0]; print(d["state"], d["jobs"][0]["job_id"])' 2>/dev/null)
          [ "${state%% *}" = READY ] && [ "${state#* }" != "$job" ] && ready=$(since "$t0") && echo "[crash] READY again (${state#* }) after $ready s"
        fi
        [ -n "$ready" ] && [ "$(complete "$url" "$key")" = 200 ] && ok=$(since "$t0") && echo "[crash] first 200 after $ok s" && break
        sleep 0.5
      done
      echo "[crash] the dead job: $(pbstk status "$job" --json | python3 -c 'import json, sys; d = json.load(sys.stdin)[0]; print(d["state"], "-", d["reason"])')"
      echo "[crash] its processes left: $(group_left "$api" | wc -l); GPU now: $(gpu_used) MiB used; $(apps)"
      grep -E 'left processes running|still running|waits for GPU memory|GPU memory is free' "$run_dir/vllm.log" | sed 's/^/[crash] log: /'
      pbstk cancel crash >/dev/null
      for _ in $(seq 60); do [ -z "$(apps)" ] && break; sleep 0.5; done
      echo "[crash] after the cancel: GPU $(gpu_used) MiB used; apps: '$(apps)'; vllm processes: $(pgrep -fc '[v]llm serve')"
      pbstk status crash | sed 's/^/[crash] status: /'
      ;;
    booking)
      t=$(now)
      first=$(pbstk launch "$model" "${common[@]}" --name first --wait --timeout 500 --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["job_id"])')
      echo "[booking] first $first READY after $(since "$t") s, GPUs $(cat "$HOME"/pbstk-runs/first-*/.local-job/gpus 2>/dev/null)"
      second=$(pbstk launch "$model" "${common[@]}" --name second --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["job_id"])')
      for _ in $(seq 20); do
        st=$(pbstk status "$second" --json | python3 -c 'import json, sys; d = json.load(sys.stdin)[0]; print(d["state"], "-", d.get("comment"))')
        [ "${st%% *}" = PENDING ] && [ "${st#*- }" != None ] && break
        sleep 0.5
      done
      echo "[booking] second $second: $st"
      pbstk status | sed 's/^/[booking] status: /'
      t0=$(now)
      pbstk cancel "$first" >/dev/null
      pbstk wait "$second" --timeout 500 >/dev/null 2>&1
      echo "[booking] second READY $(since "$t0") s after the first was cancelled: $(pbstk status "$second" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)[0]["state"])')"
      url=$(pbstk env "$second" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["base_url"])')
      key=$(pbstk env "$second" | sed -n "s/^export OPENAI_API_KEY='\{0,1\}\([^']*\)'\{0,1\}$/\1/p")
      echo "[booking] a completion on the second: $(complete "$url" "$key")"
      pbstk cancel "$second" >/dev/null
      ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
