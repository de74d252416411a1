# vLLM's output line by line into the log where stdbuf is there
LINE_BUFFERED=()
command -v stdbuf >/dev/null 2>&1 && LINE_BUFFERED=(stdbuf -oL -eL)
# A multi-model job's other models (models.sh) may still be starting beside this one: READY waits for them too
type -t pbstk_others_ready >/dev/null || pbstk_others_ready() { :; }
# Runs one attempt; sets RC and READY. Readiness here is "the port accepts connections": vLLM binds it
# only once the engine is up. pbstk itself checks /health and /v1/models.
pbstk_attempt() {
  local -a extra=("$@")
  ATTEMPT=$((ATTEMPT + 1))
  READY=false
  # PORT stays a number for server.json when no port is free (pbstk_free_port assigns only what it found)
  if ! pbstk_free_port PORT "$PROBE_HOST" "$PORT_LO" "$PORT_HI"; then
    [ "$FIXED_PORT" = true ] && pbstk_fail "port $PORT_LO is already in use on $NODE (another server?); launch with --port auto"
    pbstk_fail "no free port in $PORT_LO..$PORT_HI on $NODE"
  fi
  if [ "$NODE_ROLE" = true ]; then
    # the head: its engine port, then head.json, before its vLLM starts (the workers start from it)
    if [ "$NODE_ENGINE" != ray ]; then
      pbstk_free_port RPC_PORT "$ADDRESS" "$SPARE_PORT_LO" "$SPARE_PORT_HI" "$PORT" \
        || pbstk_fail "no free port for the engine's RPC on $ADDRESS"
    fi
    pbstk_engine_flags "$ADDRESS" "$RPC_PORT"
    extra+=("${ENGINE_FLAGS[@]}")
    pbstk_write_head
  fi
  ATTEMPT_START=$(stat -c %s "$LOG" 2>/dev/null || echo 0)
  pbstk_gpu_wait vLLM "${CUDA_VISIBLE_DEVICES:-}" "$(pbstk_gpus_per_node)" "${VLLM_ARGS[@]}" "${extra[@]}"
  pbstk_log "attempt $ATTEMPT: starting vLLM on $ADDRESS:$PORT: ${VLLM_CMD[*]} ${VLLM_ARGS[*]} --host $BIND_HOST --port $PORT ${extra[*]} ${API_KEY_ARGS[*]}"
  pbstk_spawn SERVER_PID "${LINE_BUFFERED[@]}" "${VLLM_CMD[@]}" "${VLLM_ARGS[@]}" --host "$BIND_HOST" --port "$PORT" \
    "${extra[@]}" "${API_KEY_ARGS[@]}"
  pbstk_startup_mark vllm
  pbstk_state "$PHASE_STARTING"
  while kill -0 "$SERVER_PID" 2>/dev/null; do
    if [ "$READY" = false ] && pbstk_others_ready && pbstk_port_in_use "$PROBE_HOST" "$PORT"; then
      READY=true
      pbstk_state "$PHASE_READY"
      pbstk_coldstart_ready
      pbstk_log "vLLM is listening on $ADDRESS:$PORT"
      pbstk_idle_start
      pbstk_lease_start
    fi
    [ "$NNODES" -gt 1 ] && pbstk_head_watch
    pbstk_sleep
  done
  wait "$SERVER_PID"
  RC=$?
  pbstk_end_group "$SERVER_PID" "vLLM (pid $SERVER_PID, exit $RC)"  # its engine outlives a SIGKILL (groups.sh)
}

EXTRA=()
[ "$EAGER" = true ] && EXTRA=(--enforce-eager)
while true; do
  pbstk_attempt "${EXTRA[@]}"
  case "$HEAD_ACTION" in
    stop)
      pbstk_log "stop: the job is over"
      pbstk_state "$PHASE_CANCELLED" 143
      exit 143
      ;;
    fail) pbstk_head_fail ;;
    eager)
      pbstk_log "node $FAILED_NODE failed before it was ready with a graph/compile error; restarting every node with --enforce-eager"
      HEAD_ACTION=
      EAGER=true
      EAGER_FALLBACK=true
      EXTRA=(--enforce-eager)
      continue
      ;;
  esac
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
pbstk_compile_release  # a start that never got ready leaves the compile to the next engine
pbstk_watched_end "$IDLE_PID" ended_idle
pbstk_watched_end "$LEASE_PID" ended_lease
if [ "$READY" = true ]; then
  pbstk_log "vLLM exited with code $RC"
  pbstk_state "$PHASE_EXITED" "$RC"
else
  pbstk_log "vLLM exited with code $RC before it was ready"
  pbstk_state "$PHASE_FAILED" "$RC"
fi
[ "$NNODES" -gt 1 ] && : >>"$RUN_DIR/stop"
exit "$RC"
