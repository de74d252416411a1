#!/usr/bin/env bash
# One start of the tiny model with the cpu preset on this machine (the e2e tests' unit of cost): launch --wait,
# optionally a short bench, cancel; under benchmarks/cpu/tree_time.py, which prints the wall time and the CPU seconds of
# everything, vLLM's processes included. Extra arguments go to `pbstk launch`.
#   VLLM_VENV=/path/.venv-vllm bash benchmarks/cpu/bench_cpu_start.sh
#   VLLM_VENV=... bash benchmarks/cpu/bench_cpu_start.sh --env VLLM_ENABLE_V1_MULTIPROCESSING=1  # 3rd process back
#   BENCH=1 ...   also `pbstk bench -c 1,8 --num-prompts 16 --input-len 32 --output-len 96` (output tok/s)
# Writes only under a fresh mktemp -d (model, run directory, XDG dirs), removed at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${VLLM_VENV:?set VLLM_VENV to a venv made by scripts/setup_cpu_vllm.sh}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$VLLM_VENV/bin/python" scripts/make_tiny_model.py "$work/tiny" >/dev/null 2>&1
export XDG_CONFIG_HOME="$work/config" XDG_STATE_HOME="$work/state" XDG_DATA_HOME="$work/data"
export PBSTK_RUNS_ROOT="$work/runs" PBSTK_JIT_DIR="$work/jit" PBSTK_VENV="$VLLM_VENV" PBSTK_HUB_LOOKUP=0
export VLLM_CACHE_ROOT="$work/vllm-cache" PBSTK_PORT=$((20000 + RANDOM % 200 * 100))
# the model-class facts vLLM otherwise learns in an extra process (tests/test_e2e_vllm.py FILL_MODELINFO)
VLLM_CACHE_ROOT="$work/vllm-cache" "$VLLM_VENV/bin/python" -c '
import vllm.model_executor.models.registry as registry
registry._run_in_subprocess = lambda fn: fn()
registry.ModelRegistry.models["Qwen3ForCausalLM"].inspect_model_cls()' >/dev/null 2>&1 || true
pbstk=$PWD/.venv/bin/pbstk
cat >"$work/one.sh" <<'SH'
set -euo pipefail
t0=$(date +%s.%N)
job=$("$1" launch "$2" --preset cpu --profile local --name cpu-start --port auto --wait --timeout 600 --json "${@:3}" \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["job_id"])')
echo "ready after $(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$t0" "$(date +%s.%N)") s"
if [ -n "${BENCH:-}" ]; then
  "$1" bench "$job" --client builtin -c 1,8 --num-prompts 16 --input-len 32 --output-len 96 --json \
    | python3 -c 'import json, sys; print("output tok/s:", {r["concurrency"]: round(r["output_throughput"]) for r in json.load(sys.stdin)["results"]})'
fi
"$1" cancel "$job" >/dev/null
SH
uptime
python3 benchmarks/cpu/tree_time.py bash "$work/one.sh" "$pbstk" "$work/tiny" "$@"
