# shellcheck shell=bash
# shellcheck disable=SC2154  # the settings (RUN_DIR, MODEL, PHASE_*, ...) come from the rendered header above
# The static body of every rendered start_vllm.sh (pbs_toolkit/server/start_vllm.sh): plain bash that reads the
# settings header the launch rendered in front of it; no Jinja here, so shellcheck checks this file as it runs.
set -uo pipefail
LOG="$RUN_DIR/vllm.log"
STATE="$RUN_DIR/server.json"
# PBS spools job output until the job ends: log straight into the run directory instead, line by line.
exec >>"$LOG" 2>&1
export PYTHONUNBUFFERED=1

ATTEMPT=0
EAGER_FALLBACK=false
PORT=0
SERVER_PID=0
ADDRESS=
NODE=$(hostname -s 2>/dev/null || hostname)

pbstk_log() { echo "pbstk: $(date '+%H:%M:%S') $*"; }

# A JSON string for $1: backslash, quote and every control character escaped (RFC 8259 section 7), so a
# hostile host name, job id or address cannot break or extend server.json. Builtins only: it runs on every marker write.
pbstk_json_str() {
  local s=$1 bs=\\ q='"' i hex ch esc
  s=${s//"$bs"/"$bs$bs"}
  s=${s//"$q"/"$bs$q"}
  for ((i = 1; i < 32; i++)); do
    printf -v hex '%02x' "$i"
    printf -v ch '%b' "\\x$hex"
    [[ $s == *"$ch"* ]] || continue
    printf -v esc '\\u%04x' "$i"
    s=${s//"$ch"/"$esc"}
  done
  printf '"%s"' "$s"
}

# A JSON number for $1, or null: the marker never carries a bare word where a number belongs.
pbstk_json_int() { if [[ $1 =~ ^-?[0-9]+$ ]]; then printf '%s' "$1"; else printf 'null'; fi; }

# server.json is replaced atomically so readers never see half a file.
pbstk_state() {
  local phase=$1 exit_code=${2:-null} tmp="$STATE.tmp.$$"
  {
    printf '{"phase": %s, "job_id": %s, ' "$(pbstk_json_str "$phase")" "$(pbstk_json_str "${PBS_JOBID:-}")"
    printf '"host": %s, "address": %s, ' "$(pbstk_json_str "$NODE")" "$(pbstk_json_str "$ADDRESS")"
    printf '"port": %s, "pid": %s, ' "$(pbstk_json_int "$PORT")" "$(pbstk_json_int "$SERVER_PID")"
    printf '"attempt": %s, "eager_fallback": %s, ' "$(pbstk_json_int "$ATTEMPT")" "$EAGER_FALLBACK"
    printf '"exit_code": %s, "updated": %s}\n' "$(pbstk_json_int "$exit_code")" "$(date +%s)"
  } >"$tmp" && mv -f "$tmp" "$STATE"
}

pbstk_fail() { pbstk_log "error: $1"; pbstk_state "$PHASE_FAILED" "${2:-1}"; exit "${2:-1}"; }

pbstk_state "$PHASE_SETUP"

# --- site setup from the profile: its lines run here, at the top level, exactly as written ---
if [ "${#SITE_SETUP[@]}" -gt 0 ]; then
  eval "$(printf '%s\n' "${SITE_SETUP[@]}")"
fi
if [ -n "$VENV" ]; then
  # shellcheck disable=SC1090,SC1091
  source "$VENV/bin/activate" || pbstk_fail "cannot activate the Python environment $VENV"
fi
for pbstk_kv in "${ENV_EXPORTS[@]}"; do
  export "${pbstk_kv?}"
done
unset pbstk_kv
if [ "$PROXY" = true ]; then
  # Compute nodes reach the internet only through the proxy; keep local traffic off it.
  export no_proxy="localhost,127.0.0.1,$NODE${no_proxy:+,$no_proxy}"
  export NO_PROXY="$no_proxy"
fi
[ -n "$HF_HOME_DIR" ] && export HF_HOME="$HF_HOME_DIR"
[ "$HF_HUB_OFFLINE_ON" = true ] && export HF_HUB_OFFLINE=1
if [ -n "$VLLM_CACHE_DIR" ]; then
  # torch.compile cache off $HOME (quota) and shared between jobs: later starts skip compilation.
  export VLLM_CACHE_ROOT="$VLLM_CACHE_DIR"
  mkdir -p "$VLLM_CACHE_ROOT"
fi

# --- vLLM puts ZMQ IPC sockets under $TMPDIR; a Unix socket path must fit in 107 bytes, and a PBS job's
# TMPDIR (/var/tmp/pbs.<full job id>) plus vLLM's 37-character names can exceed that ---
TMPDIR=${TMPDIR:-}
if [ "${#TMPDIR}" -gt 60 ]; then
  pbstk_log "TMPDIR=$TMPDIR is too long for vLLM's IPC sockets; using a short one under /tmp"
  TMPDIR=$(mktemp -d /tmp/pbstk.XXXXXX) || pbstk_fail "cannot create a temporary directory under /tmp"
  export TMPDIR
fi

# --- API key: read from a 0600 file into the environment; never on the command line ---
if [ -f "$RUN_DIR/api_key" ]; then
  VLLM_API_KEY=$(<"$RUN_DIR/api_key")
  export VLLM_API_KEY
fi

# --- GPUs: PBS may put UUIDs (GPU-5f2c...) in CUDA_VISIBLE_DEVICES; vLLM needs indices ---
pbstk_map_gpu_uuids() {
  local cvd=${CUDA_VISIBLE_DEVICES:-} table uuid idx
  local -a uuids indices=()
  case "$cvd" in *GPU-*) ;; *) return 0 ;; esac
  command -v nvidia-smi >/dev/null 2>&1 || pbstk_fail "CUDA_VISIBLE_DEVICES holds GPU UUIDs but nvidia-smi is not on PATH"
  table=$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader) || pbstk_fail "nvidia-smi failed"
  IFS=',' read -ra uuids <<<"$cvd"
  for uuid in "${uuids[@]}"; do
    uuid=${uuid//[[:space:]]/}
    idx=$(awk -F', *' -v u="$uuid" '$2 == u { print $1 }' <<<"$table")
    [ -n "$idx" ] || pbstk_fail "GPU $uuid from CUDA_VISIBLE_DEVICES is not listed by nvidia-smi"
    indices+=("$idx")
  done
  pbstk_log "mapped CUDA_VISIBLE_DEVICES=$cvd to $(IFS=,; echo "${indices[*]}")"
  CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${indices[*]}")
  export CUDA_VISIBLE_DEVICES
}
pbstk_map_gpu_uuids

# --- the address clients use to reach this node ---
case "$ADDRESS_MODE" in
  loopback) ADDRESS=127.0.0.1 ;;
  fqdn) ADDRESS=$(hostname -f 2>/dev/null || hostname) ;;
  ip) ADDRESS=$(hostname -i 2>/dev/null | awk '{ print $1 }') ;;
  *) ADDRESS=$NODE ;;
esac
ADDRESS="$ADDRESS$ADDRESS_SUFFIX"

# --- port: with FIXED_PORT exactly the requested one (--port N), refused when it is taken. Otherwise a free one
# in the window of PORT_SPAN ports from the requested one. Each try starts at a random place in the window and
# goes round it, so servers started together on one node rarely pick the same port; one that loses the race
# anyway (vLLM could not bind) tries again from another random place, up to PORT_SPAN times ---
PROBE_HOST=$BIND_HOST
[ "$PROBE_HOST" = "0.0.0.0" ] && PROBE_HOST=127.0.0.1
pbstk_port_in_use() { (exec 3<>"/dev/tcp/$PROBE_HOST/$1") 2>/dev/null; }
if [ "$FIXED_PORT" = true ]; then
  PORT_HI=$PORT_LO
else
  PORT_HI=$((PORT_LO + PORT_SPAN - 1))
  [ "$PORT_HI" -gt 65535 ] && PORT_HI=65535
fi
PORT_RACES=0
# The first free port going round the window from $1.
pbstk_pick_port() {
  local count=$((PORT_HI - PORT_LO + 1)) i port
  for ((i = 0; i < count; i++)); do
    port=$((PORT_LO + ($1 - PORT_LO + i) % count))
    pbstk_port_in_use "$port" || { echo "$port"; return 0; }
  done
  return 1
}

# --- the server ---
if [ "$VLLM_ENTRYPOINT" = api_server ]; then
  VLLM_CMD=(python -m vllm.entrypoints.openai.api_server --model "$MODEL")
else
  VLLM_CMD=(vllm serve "$MODEL")
fi
if [ -n "${PBSTK_VLLM_LAUNCHER:-}" ]; then
  # A wrapper that receives the vLLM command as arguments (profiling, containers, tests).
  VLLM_CMD=("$PBSTK_VLLM_LAUNCHER" "${VLLM_CMD[@]}")
elif [ "$VLLM_ENTRYPOINT" = api_server ]; then
  if ! python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)' 2>/dev/null; then
    pbstk_fail "vLLM is not installed in the job's environment (python: $(command -v python || echo none)); set the profile's venv or setup lines, or pass --venv" 127
  fi
elif ! command -v vllm >/dev/null 2>&1; then
  pbstk_fail "vLLM is not installed in the job's environment (no vllm on PATH); set the profile's venv or setup lines, or pass --venv" 127
fi

# shellcheck disable=SC2317  # invoked by the trap below
pbstk_stop() {
  pbstk_log "received a stop signal; stopping vLLM (pid $SERVER_PID)"
  if [ "$SERVER_PID" -gt 0 ]; then
    kill -TERM "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
  fi
  pbstk_state "$PHASE_CANCELLED" 143
  exit 143
}
trap pbstk_stop TERM INT HUP

# Runs one attempt; sets RC and READY. Readiness here is "the port accepts connections": vLLM binds it
# only once the engine is up. pbstk itself checks /health and /v1/models.
pbstk_attempt() {
  local -a extra=("$@")
  ATTEMPT=$((ATTEMPT + 1))
  READY=false
  # PORT stays a number for server.json when no port is free (an assignment from a failed $(...) empties it);
  # $RANDOM here, not inside $(...): a subshell may repeat the parent's sequence
  local picked start=$((PORT_LO + RANDOM % (PORT_HI - PORT_LO + 1)))
  if ! picked=$(pbstk_pick_port "$start"); then
    [ "$FIXED_PORT" = true ] && pbstk_fail "port $PORT_LO is already in use on $NODE (another server?); launch with --port auto"
    pbstk_fail "no free port in $PORT_LO..$PORT_HI on $NODE"
  fi
  PORT=$picked
  ATTEMPT_START=$(stat -c %s "$LOG" 2>/dev/null || echo 0)
  pbstk_log "attempt $ATTEMPT: starting vLLM on $ADDRESS:$PORT: ${VLLM_CMD[*]} ${VLLM_ARGS[*]} --host $BIND_HOST --port $PORT ${extra[*]}"
  if command -v stdbuf >/dev/null 2>&1; then
    stdbuf -oL -eL "${VLLM_CMD[@]}" "${VLLM_ARGS[@]}" --host "$BIND_HOST" --port "$PORT" "${extra[@]}" &
  else
    "${VLLM_CMD[@]}" "${VLLM_ARGS[@]}" --host "$BIND_HOST" --port "$PORT" "${extra[@]}" &
  fi
  SERVER_PID=$!
  pbstk_state "$PHASE_STARTING"
  while kill -0 "$SERVER_PID" 2>/dev/null; do
    if [ "$READY" = false ] && pbstk_port_in_use "$PORT"; then
      READY=true
      pbstk_state "$PHASE_READY"
      pbstk_log "vLLM is listening on $ADDRESS:$PORT"
    fi
    sleep 1 &
    wait $! 2>/dev/null
  done
  wait "$SERVER_PID"
  RC=$?
}

pbstk_attempt_log() { tail -c +"$((ATTEMPT_START + 1))" "$LOG" 2>/dev/null; }

EXTRA=()
[ "$EAGER" = true ] && EXTRA=(--enforce-eager)
while true; do
  pbstk_attempt "${EXTRA[@]}"
  # Checked before READY: another server may have answered on our port while vLLM was still importing,
  # and our vLLM then failed to bind it.
  if [ "$RC" != 0 ] && pbstk_attempt_log | grep -Eq "$PORT_IN_USE_RE"; then
    if [ "$FIXED_PORT" = true ]; then
      pbstk_fail "port $PORT was taken while vLLM started; launch with --port auto" "$RC"
    fi
    PORT_RACES=$((PORT_RACES + 1))
    if [ "$PORT_RACES" -lt "$PORT_SPAN" ]; then
      pbstk_log "port $PORT was taken while vLLM started; trying another one (lost $PORT_RACES of at most $PORT_SPAN races)"
      continue
    fi
    pbstk_log "lost the race for a port $PORT_SPAN times; giving up"
  fi
  if [ "$READY" = true ]; then
    break
  fi
  if [ "$EAGER" = false ] && pbstk_attempt_log | grep -Eq "$COMPILE_ERROR_RE"; then
    pbstk_log "vLLM failed before it was ready with a graph/compile error (exit $RC); restarting once with --enforce-eager"
    EAGER=true
    EAGER_FALLBACK=true
    EXTRA=(--enforce-eager)
    continue
  fi
  break
done
if [ "$READY" = true ]; then
  pbstk_log "vLLM exited with code $RC"
  pbstk_state "$PHASE_EXITED" "$RC"
else
  pbstk_log "vLLM exited with code $RC before it was ready"
  pbstk_state "$PHASE_FAILED" "$RC"
fi
exit "$RC"
