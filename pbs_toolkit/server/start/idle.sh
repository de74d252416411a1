# --- idle reclaim (--idle-cancel; docs/idle.md): the head watches its own /metrics in the background ---
# No request running or waiting and no progress (vllm:request_success_total, the token counters and the engine's steps
# unchanged) for IDLE_CANCEL_S seconds: it writes RUN_DIR/ended_idle, logs "ended idle: ..." (pbstk status reads that
# line) and stops vLLM with SIGTERM (vLLM finishes what it runs); the job then ends with code 0. A /metrics that does
# not answer is not idle. With several API-server processes (`--api-server-count`: no python_/process_ samples in
# /metrics) the requests gauges keep the last busy step's value once the engine is idle (vLLM 0.22.1 said "7
# running" minutes after the load): there only progress counts (perf/scrape.py does the same).
IDLE_PID=0
# shellcheck disable=SC2317  # the reads below run in the background watcher
pbstk_idle_metrics() {  # prints "RUNNING WAITING SUCCESS PROGRESS SEVERAL" (SEVERAL: 1 with several API servers)
  local line value running=0 waiting=0 success='' progress='' several=1
  exec 3<>"/dev/tcp/$PROBE_HOST/$PORT" || return 1
  printf 'GET /metrics HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n' "$PROBE_HOST" >&3
  while IFS= read -r -t 10 line <&3; do
    line=${line%$'\r'}
    value=${line##* }
    case $line in  # (not vllm:num_requests_waiting_by_reason, which splits the same requests again)
      'vllm:num_requests_running{'* | 'vllm:num_requests_running '*) running=$((running + ${value%%.*})) ;;
      'vllm:num_requests_waiting{'* | 'vllm:num_requests_waiting '*) waiting=$((waiting + ${value%%.*})) ;;
      vllm:request_success_total*) success+="$value," ;;
      vllm:generation_tokens_total* | vllm:prompt_tokens_total* | vllm:iteration_tokens_total_count*)
        progress+="$value," ;;
      python_* | process_*) several=0 ;;
    esac
  done
  exec 3<&-
  echo "$running $waiting ${success:-none} ${progress:-none} $several"
}
pbstk_idle_watch() {
  local since=$SECONDS last='' last_progress='' running waiting success progress several step=$((IDLE_CANCEL_S / 6))
  [ "$step" -lt 1 ] && step=1
  [ "$step" -gt 30 ] && step=30
  rm -f "$RUN_DIR/ended_idle"
  while kill -0 "$SERVER_PID" 2>/dev/null; do
    sleep "$step"
    if ! read -r running waiting success progress several < <(pbstk_idle_metrics 2>/dev/null) || [ -z "$success" ] ||
      [ "$success" != "$last" ] || [ "$progress" != "$last_progress" ] ||
      { [ "$several" = 0 ] && [ $((running + waiting)) -gt 0 ]; }; then
      since=$SECONDS
    fi
    last=$success last_progress=$progress
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

