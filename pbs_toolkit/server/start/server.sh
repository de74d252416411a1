# --- the server ---
if [ "$VLLM_ENTRYPOINT" = api_server ]; then
  VLLM_CMD=(python -m vllm.entrypoints.openai.api_server --model "$MODEL")
else
  VLLM_CMD=(vllm serve "$MODEL")
fi
if [ -n "${PBSTK_VLLM_LAUNCHER:-}" ]; then
  # A wrapper that receives the vLLM command as arguments (profiling, containers, tests).
  VLLM_CMD=("$PBSTK_VLLM_LAUNCHER" "${VLLM_CMD[@]}")
elif [ -n "$CONTAINER_IMAGE" ]; then
  :  # vLLM is in the image: pbstk_coldstart_prepare checks the runtime and the image
elif [ "$VLLM_ENTRYPOINT" = api_server ]; then
  if ! python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)' 2>/dev/null; then
    pbstk_fail "vLLM is not installed in the job's environment (python: $(command -v python || echo none)); set the profile's venv or setup lines, or pass --venv" 127
  fi
elif ! command -v vllm >/dev/null 2>&1; then
  pbstk_fail "vLLM is not installed in the job's environment (no vllm on PATH); set the profile's venv or setup lines, or pass --venv" 127
fi
pbstk_coldstart_prepare  # cold start: container, keyed compile cache, node-local JIT caches, compile wait

# shellcheck disable=SC2317  # invoked by the trap below
pbstk_stop() {
  # once: a second TERM (the scheduler signals the whole job, the launcher forwards) must not interrupt this
  # handler; bash 5.2 may even fail to parse a trap that lands inside a $(...) here
  trap '' TERM INT HUP
  pbstk_log "received a stop signal; stopping vLLM (pid $SERVER_PID)"
  [ "$NNODES" -gt 1 ] && : >>"$RUN_DIR/stop"
  pbstk_kill_server
  pbstk_state "$PHASE_CANCELLED" 143
  exit 143
}
pbstk_kill_server() {
  [ "${IDLE_PID:-0}" -gt 0 ] && kill "$IDLE_PID" 2>/dev/null  # the idle watcher (--idle-cancel), if any
  [ "${LEASE_PID:-0}" -gt 0 ] && kill "$LEASE_PID" 2>/dev/null  # the lease watcher (pbstk run), if any
  if [ "$SERVER_PID" -gt 0 ]; then
    # vLLM's own shutdown first (its engine with it), then whatever of its group is left (groups.sh)
    kill -TERM "$SERVER_PID" 2>/dev/null
    pbstk_wait_gone "$SERVER_PID" "$END_GRACE_S"
    pbstk_end_group "$SERVER_PID" "vLLM (pid $SERVER_PID)"
    wait "$SERVER_PID" 2>/dev/null
  fi
  if [ "${RAY_PID:-0}" -gt 0 ]; then
    kill -TERM "$RAY_PID" 2>/dev/null
    wait "$RAY_PID" 2>/dev/null
  fi
}
trap pbstk_stop TERM INT HUP

