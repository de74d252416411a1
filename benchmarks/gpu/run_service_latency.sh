#!/usr/bin/env bash
# Issue 28 item 6 on a lent 2-GPU machine, in ONE call (budget: well under 9 minutes): where a service's p99 TTFT and
# throughput go against in-process dp2. Measured with `vllm bench serve` (random 128 in / 256 out, --ignore-eos),
# each at c=256 and c=1024:
#   svc-netns   `pbstk serve --replicas 2` (power_of_two, the profile default), behind pbstk's front
#   svc-none    the same two replicas behind a second vllm-router started as pbstk starts it, without the front
#               (router_isolation: none), so the front's cost is measured on the very same replicas
#   dp2         in-process dp2 on the same two GPUs (after the service is cancelled)
# and printed as one table: output tok/s, TTFT p50/p99, failed, and the ratio of each to dp2 at that concurrency.
# Usage, from the checkout root there (vLLM 0.22.1 and the router staged under gpu-stage/ as for run_service.sh):
#   bash benchmarks/gpu/run_service_latency.sh OUT_DIR
# PROMPTS256 (default 4000) and PROMPTS1024 (default 6000) set each level's prompts (~25-35 s a level on 2x H200).
set -euo pipefail
out=${1:?usage: run_service_latency.sh OUT_DIR}
mkdir -p "$out"
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
if [ ! -x /tmp/pbstk-site/bin/vllm-router ]; then  # the router wheel and the one dependency the image lacks
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/pbstk-site gpu-stage/router/*.whl
fi
router=/tmp/pbstk-site/bin/vllm-router
profile="$out/profile.yaml"
{ sed 's/^name: .*/name: local-gpu2-latency/' benchmarks/gpu/local-h200x2.yaml
  echo "router_command: $router"; } >"$profile"
model=/root/qwen3-1.7b
served=qwen3-1.7b
common=(--profile "$profile" --served-model-name "$served" --vllm-arg=--load-format=dummy --walltime 01:00:00)
pbstk() { python3 -m pbs_toolkit "$@"; }
t0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - t0 )) s: $*"; }

bench() {  # LABEL CONCURRENCY PROMPTS BASE_URL
  stamp "$1: c=$2, $3 prompts against $4"
  timeout 150 vllm bench serve --backend openai --base-url "$4" --endpoint /v1/completions --model "$served" \
    --tokenizer "$model" --dataset-name random --random-input-len 128 --random-output-len 256 --ignore-eos \
    --max-concurrency "$2" --num-prompts "$3" --save-result --result-dir "$out" --result-filename "$1.json" \
    >"$out/$1.txt" 2>&1 || echo "[$1] vllm bench serve failed, see $out/$1.txt"
}

levels() {  # PREFIX BASE_URL: the two concurrencies against one URL
  bench "$1-c256" 256 "${PROMPTS256:-4000}" "$2"
  bench "$1-c1024" 1024 "${PROMPTS1024:-6000}" "$2"
}

base_of() {  # JOB: its server's base URL, without /v1
  pbstk env "$1" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["base_url"].removesuffix("/v1"))'
}

# the second router, as pbstk starts one (services/router/process.py start_router), without the front
plain_router() {  # start|stop RUN_DIR [WORKER_URL...]
  python3 - "$router" "$@" <<'EOF'
import sys
from pbs_toolkit.services.router.process import load_info, start_router, stop_router
from pbs_toolkit.transports.local import LocalRunner
command, what, run_dir, *workers = sys.argv[1:]
if what == "start":
    print(start_router(LocalRunner(), run_dir, command=[command], worker_urls=workers, policy="power_of_two",
                       isolate=False).url)
else:
    info = load_info(LocalRunner(), run_dir)
    if info:
        stop_router(LocalRunner(), info, timeout=10)
EOF
}

stamp "service: 2 replicas behind the front"
pbstk serve "$model" --name svc --replicas 2 --preset single --gpus-per-node 1 "${common[@]}" --wait --timeout 300
r0=$(base_of svc-r0)
r1=$(base_of svc-r1)
eval "$(pbstk env svc)"
levels svc-netns "${OPENAI_BASE_URL%/v1}"
plain=$(plain_router start "$out/plain-router" "$r0" "$r1")
levels svc-none "$plain"
plain_router stop "$out/plain-router"
pbstk status svc --json >"$out/svc-status.json" || true
pbstk cancel svc

stamp "in-process dp2"
pbstk launch "$model" --name dp2 --preset dp2 --gpus-per-node 2 "${common[@]}" --wait --timeout 300
eval "$(pbstk env dp2)"  # dp2's own key (the service's answers 401 there: every request of a run failed so)
levels dp2 "$(base_of dp2)"
pbstk cancel dp2
stamp "done"

python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {p.stem: json.loads(p.read_text()) for p in out.glob("*-c*.json")}
print(f"{'run':<16} {'done':>6} {'failed':>6} {'out tok/s':>10} {'x dp2':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'x dp2':>6}")
for c in ("c256", "c1024"):
    base = rows.get(f"dp2-{c}", {})
    for what in ("dp2", "svc-netns", "svc-none"):
        r = rows.get(f"{what}-{c}")
        if not r:
            print(f"{what + '-' + c:<16} (no result)")
            continue
        tput = r["output_throughput"] / base["output_throughput"] if base else float("nan")
        p99 = r["p99_ttft_ms"] / base["p99_ttft_ms"] if base else float("nan")
        print(f"{what + '-' + c:<16} {r['completed']:>6} {r['failed']:>6} {r['output_throughput']:>10.0f} {tput:>6.3f} "
              f"{r['median_ttft_ms']:>9.0f} {r['p99_ttft_ms']:>9.0f} {p99:>6.2f}")
EOF
tar czf "$out/logs.tgz" --exclude='api_key' --exclude='*api_key*' -C ~/pbstk-runs . 2>/dev/null || true  # without the servers' keys
