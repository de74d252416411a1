#!/usr/bin/env bash
# Issue 21's GPU proof on a lent 2-GPU machine (local scheduler, one GPU per replica): two replicas behind vllm-router
# started by `pbstk serve`, the same two replicas driven directly at once (the "direct pair": a perfect balancer),
# and in-process dp2, all measured with `vllm bench serve` (random 128 in / 256 out, --ignore-eos) in ONE call on ONE
# machine, with levels long enough (>= 30 s) to be stable. While each level runs, every replica's
# vllm:num_requests_running / _waiting is sampled each second into OUT_DIR/LABEL.load (how the router spreads load).
# Usage, from the checkout root there:  bash benchmarks/gpu/run_service.sh OUT_DIR one|single|service|dp2 [...]
# On one GPU: `single` (the service's replica as a plain job) and `service` with REPLICAS=1 (DIRECT=1: each of its
# levels followed by the same level straight at the replica). CPU_TOP=1 samples each level's processes with `top`
# (OUT_DIR/LABEL.cpu) and prints the mean cores of each kind (client, vllm-api, vllm-engine, router, front).
# POLICIES="round_robin power_of_two" picks the router policies measured for `service` (default power_of_two, the
# profile default); C1=0 skips the one-request level; PAIR=0 skips the direct pair;
# PROMPTS (default 6000) is the number of prompts of each c=256 level (half of it for each side of the pair).
# ISOLATION=none|netns sets the profile's router_isolation (default: the profile default, netns: behind the front).
# CLIENT=builtin measures with `pbstk bench --client builtin` (several client processes) instead of one `vllm bench
# serve` process, which looked like the limit at c=1024 on 2x H200 (session 13: dp2's engines and the service's ran
# about 395 of the 1,024 requests on average, none waiting, at about the requests/s one of pbstk's client processes
# makes there).
# API_SERVERS=N gives every server N vLLM API-server processes.
# LEVELS="256 1024" adds levels to dp2 and service (each PROMPTS prompts, at least 4x the concurrency), REPEAT times
# each (default 1); C256=0 skips the c=256 level that dp2 and service otherwise always run.
# Issue 28's load cases (the keeper's log of each kept in OUT_DIR/NAME-keeper.log, its router removals counted):
#   svc1-c512       a 1-replica service (`serve --replicas 1`) under a c=512 burst of BURST prompts (default 6000)
#   autoscale-c512  `serve --min-replicas 1 --max-replicas 2 --scale-up-waiting 1 --scale-down-idle 60s`, the same
#                   burst; the replica count is sampled each second into OUT_DIR/autoscale-c512.replicas
set -euo pipefail
out=${1:?usage: run_service.sh OUT_DIR one|service|dp2 [...]}
shift
mkdir -p "$out"
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
if [ ! -x /tmp/pbstk-site/bin/vllm-router ]; then  # the router wheel and the one dependency the image lacks
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/pbstk-site gpu-stage/router/*.whl
fi
profile="$out/profile.yaml"
# PORT (default 8000): the first port tried, so that two runs on disjoint GPUs of one machine
# (CUDA_VISIBLE_DEVICES=0,1 and 2,3) do not meet
{ sed -e 's/^name: .*/name: local-gpu2-router/' -e "s/^port: .*/port: ${PORT:-8000}/" benchmarks/gpu/local-h200x2.yaml
  echo "router_command: /tmp/pbstk-site/bin/vllm-router"
  [ -z "${ISOLATION:-}" ] || echo "router_isolation: $ISOLATION"; } >"$profile"
model=/root/qwen3-1.7b
served=qwen3-1.7b
prompts=${PROMPTS:-6000}
common=(--profile "$profile" --served-model-name "$served" --vllm-arg=--load-format=dummy --walltime 01:00:00)
# API_SERVERS=N: every server of this run with N vLLM API-server processes (`--api-server-count N`)
[ -z "${API_SERVERS:-}" ] || common+=("--vllm-arg=--api-server-count=$API_SERVERS")
pbstk() { python3 -m pbs_toolkit "$@"; }

cpu_sample() {  # LABEL: every 2 s each process over 5% of a core ("t %cpu command"), until killed
  command -v top >/dev/null || return 0
  top -b -d 2 -c -w 512 | awk '/^top -/ {t = $3} $1 ~ /^[0-9]+$/ && $9 + 0 >= 5 {
    c = ""; for (i = 12; i <= NF; i++) c = c " " $i; print t, $9, substr(c, 1, 160); fflush()}' >>"$out/$1.cpu"
}

summarise_cpu() {  # LABEL: mean cores per kind of process over the samples (of the level's seconds)
  [ -s "$out/$1.cpu" ] || return 0
  awk '{k = "other"} /pbs_toolkit bench|multiprocessing|load_procs/ {k = "client"} /vllm serve|APIServer/ {k = "vllm-api"}
    /EngineCore/ {k = "vllm-engine"} /router_front/ {k = "front"} /vllm::router|vllm-router/ {k = "router"}
    /keeper/ {k = "keeper"} {s[k] += $2; if (!($1 in seen)) {seen[$1] = 1; n++}}
    END {line = ""; for (k in s) line = line sprintf(" %s %.2f", k, s[k] / 100 / n); print "[" L "] cores:" line}' \
    L="$1" "$out/$1.cpu"
}

bench() {  # LABEL CONCURRENCY PROMPTS [BASE_URL [JOB]]: against BASE_URL (JOB's), else OPENAI_BASE_URL ($target's)
  local base=${4:-${OPENAI_BASE_URL%/v1}} sampler=""
  echo "== $1: c=$2, $3 prompts against $base"
  if [ "${CPU_TOP:-0}" = 1 ]; then cpu_sample "$1" & sampler=$!; fi
  bench_level "$@"
  if [ -n "$sampler" ]; then
    pkill -P "$sampler" 2>/dev/null || true; kill "$sampler" 2>/dev/null || true; wait "$sampler" 2>/dev/null || true
    summarise_cpu "$1"
  fi
}

bench_level() {  # bench's arguments: one level, its figures printed
  local base=${4:-${OPENAI_BASE_URL%/v1}}
  if [ "${CLIENT:-vllm}" = builtin ]; then  # pbstk's own client: one process per 4 CPUs (at most 4) from c=64
    pbstk bench "${5:-$target}" -c "$2" --num-prompts "$3" --client builtin --json \
      >"$out/$1.json" 2>"$out/$1.txt" || true
    python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
for name, key in [("Successful requests", "completed"), ("Failed requests", "failed"),
                  ("Benchmark duration (s)", "duration"), ("Output token throughput (tok/s)", "output_throughput"),
                  ("Mean TTFT (ms)", "mean_ttft_ms"), ("P99 TTFT (ms)", "p99_ttft_ms"),
                  ("Mean TPOT (ms)", "mean_tpot_ms"), ("Mean E2EL (ms)", "mean_e2el_ms"),
                  ("vLLM mean E2E (ms)", "server_e2e_ms")]:
    if key not in r:  # the time vLLM itself counted (a service: its replicas together)
        continue
    value = r[key] if isinstance(r[key], int) else round(r[key] or 0, 2)
    print((name + ":").ljust(40), value)' "$out/$1.json" \
      2>/dev/null | sed "s/^/[$1] /" || tail -n 3 "$out/$1.txt"
    return 0
  fi
  vllm bench serve --backend openai --base-url "$base" --endpoint /v1/completions --model "$served" \
    --tokenizer "$model" --dataset-name random --random-input-len 128 --random-output-len 256 --ignore-eos \
    --max-concurrency "$2" --num-prompts "$3" --save-result --result-dir "$out" --result-filename "$1.json" \
    >"$out/$1.txt" 2>&1 || true
  grep -E "Successful|Failed|Benchmark duration|Output token throughput|Mean TTFT|P99 TTFT|Mean TPOT" "$out/$1.txt" \
    | sed "s/^/[$1] /" || true
}

sample_load() {  # LABEL URL...: one line per second "t url running waiting" until killed
  local label=$1; shift
  while :; do
    for u in "$@"; do
      curl -s -m 1 "$u/metrics" | awk -v t="$(date +%s)" -v u="$u" '
        /^vllm:num_requests_running\{/ {r+=$NF} /^vllm:num_requests_waiting\{/ {w+=$NF}
        END {print t, u, r+0, w+0}' || true
    done
    sleep 1
  done >>"$out/$label.load"
}

summarise_load() {  # LABEL: mean running/waiting per url over the seconds where anything ran
  [ -f "$out/$1.load" ] || return 0
  awk '$3+$4>0 {n[$2]++; r[$2]+=$3; w[$2]+=$4} END {for (u in n) printf "[%s] %s mean running %.1f waiting %.1f (%d samples)\n", L, u, r[u]/n[u], w[u]/n[u], n[u]}' \
    L="$1" "$out/$1.load"
}

with_load() {  # LABEL URLS(space-separated) -- command...: run the command while sampling the urls' load
  local label=$1 urls=$2; shift 3
  # shellcheck disable=SC2086  # the urls are split on purpose
  sample_load "$label" $urls & local sampler=$!
  "$@"
  kill "$sampler" 2>/dev/null || true; wait "$sampler" 2>/dev/null || true
  summarise_load "$label"
}

base_of() {  # JOB: its server's base URL, without /v1
  pbstk env "$1" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["base_url"].removesuffix("/v1"))'
}

levels() {  # LABEL-PREFIX [BASE JOB]: each of LEVELS past c=256 (which with_load measures), REPEAT times each (-1, -2,
  # ...); with a replica's BASE URL and JOB, each one is followed by the same level straight at that replica (-direct)
  local c r n=${REPEAT:-1} count suffix
  for c in ${LEVELS:-}; do
    [ "$c" = 256 ] && continue
    count=$(( prompts > 4 * c ? prompts : 4 * c ))
    for r in $(seq "$n"); do
      suffix=$([ "$n" = 1 ] || echo "-$r")
      bench "$1-c$c$suffix" "$c" "$count"
      [ -z "${2:-}" ] || bench "$1-direct-c$c$suffix" "$c" "$count" "$2" "$3"
    done
  done
}

keeper_log() {  # SERVICE: its keeper's log beside the results, and how often a replica left the router
  local log="${XDG_STATE_HOME:-$HOME/.local/state}/pbstk/services/$1/keeper.log"
  cp "$log" "$out/$1-keeper.log" 2>/dev/null || true
  local removed added
  removed=$(grep -c 'from the router' "$out/$1-keeper.log" 2>/dev/null) || true
  added=$(grep -c 'added' "$out/$1-keeper.log" 2>/dev/null) || true
  echo "[$1] keeper: ${removed:-0} removal(s) from the router, ${added:-0} addition(s)," \
    "$(grep -c 'is busy (the router' "$out/$1-keeper.log") look(s) found busy by the router's view," \
    "$(grep -c "router's figures could not be read" "$out/$1-keeper.log") without the router's figures"
  # the router's own complaints (the front's "a connection ended while ..." lines, a router panic, its errors):
  # where a client's "server disconnected" comes from
  pbstk logs "$1" -n 1000000 2>/dev/null | grep -E -i 'connection ended|panick|error|warn' | tail -n 300 \
    >"$out/$1-router-errors.log" || true
  echo "[$1] router log: $(grep -c 'connection ended' "$out/$1-router-errors.log") connection(s) ended early," \
    "$(grep -c -i 'panick' "$out/$1-router-errors.log") panic(s)"
}

count_replicas() {  # SERVICE: one line per second "t routable wanted" (its status) until killed
  while :; do
    echo "$(date +%s) $(pbstk status "$1" --json 2>/dev/null | python3 -c 'import json, sys; d = json.load(sys.stdin)[0]; print(d["ready"], d["replicas"])' 2>/dev/null)"
    sleep 1
  done >>"$out/$1.replicas"
}

plain() {  # NAME PRESET GPUS: an in-process job of that preset, its levels (as a service's), then cancelled
  pbstk launch "$model" --name "$1" --preset "$2" --gpus-per-node "$3" "${common[@]}" --wait --timeout 420
  eval "$(pbstk env "$1")"; target=$1
  local b; b=$(base_of "$1")
  [ "${C256:-1}" = 0 ] || with_load "$1-c256" "$b" -- bench "$1-c256" 256 "$prompts"
  with_load "$1-levels" "$b" -- levels "$1"
  [ -z "${BURST_DP2:-}" ] || bench "$1-c512" 512 "$burst"
  pbstk cancel "$1"
}

burst=${BURST:-6000}
# the c=512 runs keep sessions 10-11's replica (256 sequences; `single` has a DP rank's 512 since session 12), so that
# one replica is over capacity under the burst and its figures compare
svc_common=(--preset single --vllm-arg=--max-num-seqs=256 --gpus-per-node 1 --policy power_of_two)

for what in "$@"; do
  start=$(date +%s)
  case "$what" in
    one)
      pbstk launch "$model" --name one --preset single --gpus-per-node 1 "${common[@]}" --wait --timeout 420
      eval "$(pbstk env one)"; target=one
      bench one-c1 1 32; bench one-c128 128 $((prompts / 2))
      pbstk cancel one ;;
    dp2) plain dp2 dp2 2 ;;
    single) plain single single 1 ;;  # a service's replica as a plain job: a 1-replica service's reference
    service)  # REPLICAS (default 2) replicas, one GPU each
      n=${REPLICAS:-2}
      for policy in ${POLICIES:-power_of_two}; do
        svc="svc-${policy//_/-}$([ "$n" = 2 ] || echo "-x$n")"
        pbstk serve "$model" --name "$svc" --replicas "$n" --preset single --gpus-per-node 1 \
          --policy "$policy" "${common[@]}" --wait --timeout 420
        pbstk status "$svc"
        eval "$(pbstk env "$svc")"; target=$svc
        urls=$(for i in $(seq 0 $((n - 1))); do base_of "$svc-r$i"; done | tr '\n' ' ')
        [ "${C1:-1}" = 0 ] || bench "$svc-c1" 1 32
        [ "${C256:-1}" = 0 ] || with_load "$svc-c256" "$urls" -- bench "$svc-c256" 256 "$prompts"
        # DIRECT=1 (one replica): each level also straight at the replica, the router and its front left out
        if [ "${DIRECT:-0}" = 1 ] && [ "$n" = 1 ]; then
          with_load "$svc-levels" "$urls" -- levels "$svc" "$(base_of "$svc-r0")" "$svc-r0"
        else
          with_load "$svc-levels" "$urls" -- levels "$svc"
        fi
        keeper_log "$svc"
        # the direct pair: the same two replicas driven at once, half the load each (a perfect balancer)
        if [ "${PAIR:-1}" != 0 ] && [ "$n" = 2 ]; then
          r0=$(base_of "$svc-r0"); r1=$(base_of "$svc-r1")
          pair() { bench "$svc-pair-r0-c128" 128 $((prompts / 2)) "$r0" "$svc-r0" & local a=$!
                   bench "$svc-pair-r1-c128" 128 $((prompts / 2)) "$r1" "$svc-r1"; wait "$a"; }
          with_load "$svc-pair" "$r0 $r1" -- pair
        fi
        pbstk status "$svc" --json >"$out/$svc-status.json" || true
        pbstk cancel "$svc"
      done ;;
    svc1-c512)
      pbstk serve "$model" --name svc1 --replicas 1 "${svc_common[@]}" "${common[@]}" --wait --timeout 420
      eval "$(pbstk env svc1)"; target=svc1
      bench svc1-c512 512 "$burst"
      pbstk status svc1
      keeper_log svc1
      pbstk cancel svc1 ;;
    autoscale-c512)
      pbstk serve "$model" --name auto --min-replicas 1 --max-replicas 2 --scale-up-waiting 1 --scale-down-idle 60s \
        "${svc_common[@]}" "${common[@]}" --wait --timeout 420
      eval "$(pbstk env auto)"; target=auto
      count_replicas auto & counter=$!
      t0=$(date +%s)
      bench autoscale-c512 512 "$burst"
      kill "$counter" 2>/dev/null || true; wait "$counter" 2>/dev/null || true
      # the load reached the router when vllm bench serve's main run began: its JSON's end time less its duration
      # (the client's own start, ~20 s of imports and 12,000 prompts made on a lent host, is not the burst's)
      load0=$(python3 -c 'import datetime, json, sys; d = json.load(open(sys.argv[1]))
print(round(datetime.datetime.strptime(d["date"], "%Y%m%d-%H%M%S").timestamp() - d["duration"]))' \
        "$out/autoscale-c512.json" 2>/dev/null) || load0=$t0
      awk -v t0="$load0" -v b="$t0" '$2 >= 2 && !s {print "[autoscale-c512] 2 replicas ready " $1 - t0 " s after the load reached the router (" t0 - b " s after the client started)"; s=1}' "$out/auto.replicas" || true
      echo "[autoscale-c512] the load reached the router at $(date -d "@$load0" +%T)"
      pbstk status auto
      keeper_log auto
      pbstk cancel auto ;;
    *) echo "unknown: $what" >&2; exit 2 ;;
  esac
  echo "== $what took $(( $(date +%s) - start )) s"
done
tar czf "$out/logs.tgz" --exclude='api_key' --exclude='*api_key*' -C ~/pbstk-runs . 2>/dev/null || true  # without the servers' keys
