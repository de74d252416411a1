#!/usr/bin/env bash
# Issue 43, item 1, on a lent 1-GPU machine (local scheduler, vLLM 0.22.1, Qwen3-1.7B-shaped, dummy weights): the
# `single` preset with 1, 2 and 4 vLLM API-server processes (`--api-server-count N`, given as a --vllm-arg, which
# replaces the preset's), each at c=256, 512 and 1024 with pbstk's own client in several processes (`pbstk bench
# --client builtin`, 128 in / 256 out, 4 x c prompts a level, warm-ups first). For every N>1: `/metrics` read four
# times after the levels (vLLM's multi-process Prometheus directory: any API server's answer is the sum of all), and
# `pbstk metrics` / `pbstk status` of the job, so that the readers are seen to count every process's requests.
# Usage, from the checkout root there:  bash benchmarks/gpu/run_api_servers.sh OUT_DIR [COUNTS, default "1 2 4"]
set -uo pipefail
out=${1:?usage: run_api_servers.sh OUT_DIR [COUNTS]}
counts=${2:-1 2 4}
levels=${LEVELS:-256,512,1024}
mkdir -p "$out"
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
pbstk() { python3 -m pbs_toolkit "$@"; }
profile="$out/profile.yaml"
sed -e 's/^name: .*/name: local-h200/' -e '/^gpus_per_node:/d' benchmarks/gpu/local-h200x2.yaml >"$profile"
for n in $counts; do
  name=api$n
  t=$(date +%s)
  pbstk launch /root/qwen3-1.7b --name "$name" --preset single --profile "$profile" --served-model-name qwen3-1.7b \
    --vllm-arg=--load-format=dummy "--vllm-arg=--api-server-count=$n" --wait --timeout 400 >"$out/$name-launch.txt" 2>&1
  echo "[$name] READY after $(( $(date +%s) - t )) s: $(tail -n 1 "$out/$name-launch.txt")"
  pbstk bench "$name" -c "$levels" --client builtin --json >"$out/$name.json" 2>"$out/$name.txt"
  python3 - "$out/$name.json" "$name" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(f"[{sys.argv[2]}] c={r['max_concurrency']}: {r['output_throughput']:.0f} tok/s, {r['completed']} ok "
          f"{r['failed']} failed, TTFT mean {r['mean_ttft_ms']:.0f} p99 {r['p99_ttft_ms']:.0f} ms, "
          f"TPOT mean {r['mean_tpot_ms']:.1f} ms, E2E p99 {r.get('p99_e2el_ms') or 0:.0f} ms")
PY
  if [ "$n" -gt 1 ]; then
    url=$(pbstk env "$name" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["base_url"])')
    for i in 1 2 3 4; do
      curl -s -m 10 "${url%/v1}/metrics" >"$out/$name-metrics-$i.txt"
      echo "[$name] /metrics read $i: $(grep -E '^vllm:request_success_total' "$out/$name-metrics-$i.txt" \
        | awk '{s += $NF} END {print s}') successes, $(grep -c '^vllm:' "$out/$name-metrics-$i.txt") samples, pid labels: $(grep -c 'pid="' "$out/$name-metrics-$i.txt")"
    done
    pbstk metrics "$name" --json >"$out/$name-pbstk-metrics.json" 2>&1
    echo "[$name] pbstk metrics: $(head -c 400 "$out/$name-pbstk-metrics.json" | tr '\n' ' ')"
    grep -c 'Avg prompt throughput' ~/pbstk-runs/"$name"-*/vllm.log | sed "s/^/[$name] stats log lines: /"
    grep -h -i 'disabling stats\|api server\|APIServer' ~/pbstk-runs/"$name"-*/vllm.log | head -n 4 | sed "s/^/[$name] log: /"
  fi
  pbstk status "$name" | sed "s/^/[$name] status: /"
  pbstk cancel "$name" >/dev/null
  for _ in $(seq 60); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break; sleep 1; done
done
