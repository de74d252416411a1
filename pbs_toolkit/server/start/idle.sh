# --- idle reclaim (--idle-cancel; docs/idle.md): the head watches its own /metrics in the background ---
# No request running or waiting and no request finished (vllm:request_success_total unchanged) for IDLE_CANCEL_S
# seconds: it writes RUN_DIR/ended_idle, logs "ended idle: ..." (pbstk status reads that line) and stops vLLM with
# SIGTERM (vLLM finishes what it runs); the job then ends with code 0. A /metrics that does not answer is not idle.
IDLE_PID=0
# shellcheck disable=SC2317  # the reads below run in the background watcher
pbstk_idle_metrics() {
  local line running=0 waiting=0 success=
  exec 3<>"/dev/tcp/$PROBE_HOST/$PORT" || return 1
  printf 'GET /metrics HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n' "$PROBE_HOST" >&3
  while IFS= read -r -t 10 line <&3; do
    line=${line%$'\r'}
    case $line in
      vllm:num_requests_running*) line=${line##* }; running=$((running + ${line%%.*})) ;;
      vllm:num_requests_waiting*) line=${line##* }; waiting=$((waiting + ${line%%.*})) ;;
      vllm:request_success_total*) success+="${line##* },"
    esac
  done
  exec 3<&-
  echo "$running $waiting ${success:-none}"
}
pbstk_idle_watch() {
  local since=$SECONDS last='' running waiting success step=$((IDLE_CANCEL_S / 6))
  [ "$step" -lt 1 ] && step=1
  [ "$step" -gt 30 ] && step=30
  rm -f "$RUN_DIR/ended_idle"
  while kill -0 "$SERVER_PID" 2>/dev/null; do
    sleep "$step"
    if ! read -r running waiting success < <(pbstk_idle_metrics 2>/dev/null) || [ -z "$success" ] ||
      [ "$running" -gt 0 ] || [ "$waiting" -gt 0 ] || [ "$success" != "$last" ]; then
      since=$SECONDS
    fi
    last=$success
    # -gt: SECONDS counts whole seconds, so "2 more" may be 1.01 s of real time; never stop early
    if [ $((SECONDS - since)) -gt "$IDLE_CANCEL_S" ]; then
      date +%s >"$RUN_DIR/ended_idle"
      pbstk_log "ended idle: no request for ${IDLE_CANCEL_S}s; stopping vLLM (pid $SERVER_PID)"
      kill -TERM "$SERVER_PID" 2>/dev/null
      return 0
    fi
  done
}
pbstk_idle_start() {
  [ "${IDLE_CANCEL_S:-0}" -gt 0 ] && [ "$WRITE_SERVER" = true ] || return 0
  pbstk_idle_watch &
  IDLE_PID=$!
  pbstk_log "idle reclaim: vLLM is stopped after ${IDLE_CANCEL_S}s without a request"
}
# After vLLM exited: stop the watcher WATCHER_PID; if it was the one that stopped vLLM (RUN_DIR/MARKER: an idle
# stop, a lapsed lease, lease.sh), the job ends normally (code 0), whatever code SIGTERM gave vLLM.
pbstk_watched_end() {  # WATCHER_PID MARKER
  [ "$1" -gt 0 ] && kill "$1" 2>/dev/null
  [ -f "$RUN_DIR/$2" ] && [ "$READY" = true ] || return 0
  pbstk_state "$PHASE_EXITED" 0
  [ "$NNODES" -gt 1 ] && : >>"$RUN_DIR/stop"
  exit 0
}

