#!/bin/bash
# How long a server outlives a `pbstk run` killed with SIGKILL during COMMAND (docs/campaigns.md "The lease"):
# for each lease given, one run on the local scheduler with the stand-in vLLM, `kill -9` of pbstk once COMMAND
# runs, then the seconds until `pbstk status` says FINISHED, and its reason. Everything lives in a temporary
# directory (user dirs, runs root); the orphaned COMMAND is stopped at the end.
#
#     bash benchmarks/cpu/lease_lapse.sh 3s 10s
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
pbstk=$repo/.venv/bin/pbstk
home=$(mktemp -d)
trap 'rm -rf "$home"' EXIT
export XDG_CONFIG_HOME=$home/config XDG_STATE_HOME=$home/state XDG_DATA_HOME=$home/data
export PBSTK_RUNS_ROOT=$home/runs PBSTK_JIT_DIR=$home/jit PBSTK_SSH_PERSIST=0 PBSTK_HUB_LOOKUP=0
export PATH=$repo/tests/standins:$PATH PBSTK_TEST_RECORD=$home
model=$(cd "$repo/tests" && "$repo/.venv/bin/python" -c 'import helpers; print(helpers.MODEL)')
for lease in "${@:-3s}"; do
  name=lapse-$lease pidfile=$home/$lease.pid
  # shellcheck disable=SC2016  # COMMAND's own $$ and $1, expanded by its sh
  "$pbstk" run "$model" --profile local-gpu --gpus-per-node 1 --preset single --port auto --name "$name" \
    --lease "$lease" -- sh -c 'echo $$ > "$1"; exec sleep 600' sh "$pidfile" 2>/dev/null &
  run=$!
  until [ -s "$pidfile" ]; do sleep 0.1; done
  kill -9 "$run"
  wait "$run" 2>/dev/null || true
  trap 'kill -9 -- "-$(cat "$pidfile")" 2>/dev/null; rm -rf "$home"' EXIT  # the orphaned COMMAND, whatever happens
  start=$(date +%s.%N)
  until "$pbstk" status "$name" --json 2>/dev/null | grep -q '"state": "FINISHED"'; do sleep 0.2; done
  end=$(date +%s.%N)
  reason=$("$pbstk" status "$name" --json | "$repo/.venv/bin/python" -c \
    'import json, sys; d = json.load(sys.stdin); print((d[0] if isinstance(d, list) else d)["reason"])')
  printf 'lease %s: killed run -> FINISHED after %.1f s (%s)\n' "$lease" "$(echo "$end - $start" | bc)" "$reason"
  kill -9 -- "-$(cat "$pidfile")" 2>/dev/null || true
done
