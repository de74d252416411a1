#!/usr/bin/env bash
# `pbstk run` end to end on this machine (issue 24's transcript): a tiny generated model served by the real vLLM
# on CPU (local scheduler), scripts/eval_demo.py (three chat completions through the `openai` package) run against
# it, the server cancelled when it ends, then `pbstk usage`. Needs what scripts/demo.sh installs (.venv, .venv-vllm).
# Everything lives under a temporary directory (its own XDG dirs): nothing of yours is touched.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/pbstk-campaign.XXXXXX")
cd "$work"
export XDG_CONFIG_HOME=$work/xdg/config XDG_STATE_HOME=$work/xdg/state XDG_DATA_HOME=$work/xdg/data
export PBSTK_RUNS_ROOT=$work/runs PBSTK_VENV=$root/.venv-vllm PBSTK_HUB_LOOKUP=0
export PATH=$root/.venv/bin:$PATH
"$root/.venv-vllm/bin/python" "$root/scripts/make_tiny_model.py" tiny-qwen3 >/dev/null 2>&1
mkdir -p configs
echo "\$ pbstk run ./tiny-qwen3 --preset cpu --profile local --name eval-demo --port auto --registry configs/endpoints.py -- python eval_demo.py"
rc=0
pbstk run ./tiny-qwen3 --preset cpu --profile local --name eval-demo --port auto --registry configs/endpoints.py \
  -- python "$root/scripts/eval_demo.py" || rc=$?
echo "[exit status: $rc]"
echo "\$ pbstk usage"
pbstk usage
echo "(all of it in $work)"
exit "$rc"
