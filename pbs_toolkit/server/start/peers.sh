# --- several nodes: the engine's per-rank flags, the head's ports in head.json, the nodes watching each other ---
pbstk_has_arg() {
  local a
  for a in "${VLLM_ARGS[@]}"; do
    [ "$a" = "$1" ] || [[ $a == "$1="* ]] && return 0
  done
  return 1
}
# A layout flag the preset's arguments do not already carry.
pbstk_add_size() { pbstk_has_arg "$1" || ENGINE_FLAGS+=("$1" "$2"); }
# pbstk_engine_flags HEAD_ADDR RPC_PORT: ENGINE_FLAGS for this node's rank (FACTS: vLLM's multi-node engines).
pbstk_engine_flags() {
  ENGINE_FLAGS=()
  pbstk_has_arg -tp || [ "$TP" -le 1 ] || pbstk_add_size --tensor-parallel-size "$TP"
  pbstk_has_arg -pp || [ "$PP" -le 1 ] || pbstk_add_size --pipeline-parallel-size "$PP"
  case "$NODE_ENGINE" in
    dp)
      pbstk_add_size --data-parallel-size "$DP"
      pbstk_add_size --data-parallel-size-local "$DP_LOCAL"
      ENGINE_FLAGS+=(--data-parallel-address "$1" --data-parallel-rpc-port "$2")
      if [ "$NODE_RANK" -gt 0 ]; then
        ENGINE_FLAGS+=(--headless --data-parallel-start-rank $((NODE_RANK * DP_LOCAL)))
      else
        # vLLM starts one API server per LOCAL rank: a head with one local rank would serve every node's
        # traffic through one process (measured: 23% below in-process DP2 at 256 requests). One per rank, as
        # in-process DP gets; headless workers refuse the flag.
        pbstk_add_size --api-server-count "$DP"
      fi
      ;;
    nnodes)
      ENGINE_FLAGS+=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$1" --master-port "$2")
      [ "$NODE_RANK" -gt 0 ] && ENGINE_FLAGS+=(--headless)
      ;;
    ray)
      if [ "$DP" -gt 1 ]; then
        pbstk_add_size --data-parallel-size "$DP"
        pbstk_add_size --data-parallel-backend ray
      else
        pbstk_add_size --distributed-executor-backend ray
      fi
      ;;
  esac
}

# head.json: what the workers start with; a new attempt number makes every worker restart (eager fallback).
pbstk_write_head() {
  pbstk_marker "$RUN_DIR/head.json" "address=$ADDRESS" "port=$PORT" "rpc_port=$RPC_PORT" "attempt=$ATTEMPT" \
    "eager=$EAGER"
}

# The head, each second: a worker that failed ends the attempt (HEAD_ACTION fail, or eager when it was a compile
# error and eager is not on yet); `stop` with a reason (the launcher saw a node's starter die) fails it too.
pbstk_head_watch() {
  local k marker phase attempt
  [ -n "$HEAD_ACTION" ] && return 0
  for ((k = 1; k < NNODES; k++)); do
    marker="$RUN_DIR/nodes/$k.json"
    pbstk_marker_get attempt "$marker" attempt
    [ "$attempt" = "$ATTEMPT" ] || continue
    pbstk_marker_get phase "$marker" phase
    case "$phase" in "$PHASE_FAILED" | "$PHASE_EXITED") ;; *) continue ;; esac
    FAILED_NODE=$k
    pbstk_marker_get FAILED_RC "$marker" exit_code
    HEAD_ACTION=fail
    # the worker's compile error, or the head's own (its workers lose the head and fail too)
    if [ "$EAGER" = false ] && [ "$NODE_ENGINE" != ray ] \
      && { grep -Eq "$COMPILE_ERROR_RE" "$RUN_DIR/vllm.node$k.log" 2>/dev/null || pbstk_attempt_log | grep -Eq "$COMPILE_ERROR_RE"; }; then
      HEAD_ACTION=eager
    fi
    break
  done
  if [ -z "$HEAD_ACTION" ] && [ -e "$RUN_DIR/stop" ]; then
    HEAD_ACTION=stop
    [ -s "$RUN_DIR/stop" ] && HEAD_ACTION=fail && FAILED_NODE=
  fi
  [ -n "$HEAD_ACTION" ] && [ "$SERVER_PID" -gt 0 ] && kill -TERM "$SERVER_PID" 2>/dev/null
  return 0
}

# The head gives up because of another node: every node stops, the head's markers say which node and why.
pbstk_head_fail() {
  local host lines
  if [ -n "$FAILED_NODE" ]; then
    pbstk_marker_get host "$RUN_DIR/nodes/$FAILED_NODE.json" host
    lines=$(tail -n 20 "$RUN_DIR/vllm.node$FAILED_NODE.log" 2>/dev/null | grep -v "^pbstk: " | tail -n 4)
    lines=${lines//$'\n'/ | }  # one line: a marker's strings hold no newline (pbstk_safe)
    REASON="node $FAILED_NODE (host $host) failed: ${lines:-exit code ${FAILED_RC:-?}}"
  else
    REASON=$(head -c 2000 "$RUN_DIR/stop")
  fi
  : >>"$RUN_DIR/stop"
  pbstk_kill_server
  pbstk_log "error: $REASON"
  pbstk_state "$PHASE_FAILED" "${FAILED_RC:-1}"
  exit 1
}

# Ray: the head's `ray start --head` and a bounded wait until `ray status` counts every node.
pbstk_ray_head() {
  local i count
  pbstk_free_port RPC_PORT "$ADDRESS" "$SPARE_PORT_LO" "$SPARE_PORT_HI" "$PORT" \
    || pbstk_fail "no free port for Ray on $ADDRESS"
  ATTEMPT=1
  pbstk_write_head
  ATTEMPT=0
  pbstk_log "starting the Ray head on $ADDRESS:$RPC_PORT"
  "${CONTAINER_CMD[@]}" ray start --head --node-ip-address="$ADDRESS" --port="$RPC_PORT" --block &  # in the image, if any
  RAY_PID=$!
  for ((i = 0; i < ${RAY_WAIT_S:-600}; i++)); do
    kill -0 "$RAY_PID" 2>/dev/null || pbstk_fail "the Ray head exited before the cluster formed"
    count=$("${CONTAINER_CMD[@]}" ray status --address "$ADDRESS:$RPC_PORT" 2>/dev/null | grep -cE '^ *[0-9]+ node_')
    [ "$count" -ge "$NNODES" ] && { pbstk_log "Ray cluster has $count nodes"; return 0; }
    pbstk_head_watch
    [ "$HEAD_ACTION" = stop ] && pbstk_stop
    [ -n "$HEAD_ACTION" ] && pbstk_head_fail
    pbstk_sleep
  done
  pbstk_fail "the Ray cluster did not reach $NNODES nodes in ${RAY_WAIT_S:-600} s"
}

# A worker: wait for head.json (a newer attempt than SEEN), stop on `stop` or a head that has ended.
pbstk_wait_head() {
  local attempt phase
  while true; do
    [ -e "$RUN_DIR/stop" ] && return 1
    pbstk_marker_get attempt "$RUN_DIR/head.json" attempt
    if [[ $attempt =~ ^[0-9]+$ ]] && [ "$attempt" -gt "$1" ]; then
      pbstk_marker_get HEAD_ADDR "$RUN_DIR/head.json" address
      pbstk_marker_get RPC_PORT "$RUN_DIR/head.json" rpc_port
      pbstk_marker_get HEAD_EAGER "$RUN_DIR/head.json" eager
      ATTEMPT=$attempt
      return 0
    fi
    pbstk_marker_get phase "$STATE" phase
    case "$phase" in "$PHASE_FAILED" | "$PHASE_EXITED" | "$PHASE_CANCELLED") return 1 ;; esac
    pbstk_sleep
  done
}

# A worker's run: one vLLM (or `ray start`) per head attempt; it is READY once the head is.
pbstk_worker() {
  local seen=0 restart head_phase head_attempt
  local -a extra
  while true; do
    pbstk_wait_head "$seen" || { pbstk_state "$PHASE_CANCELLED" 143; exit 143; }
    seen=$ATTEMPT
    extra=()
    [ "$HEAD_EAGER" = true ] && [ "$EAGER" = false ] && { extra=(--enforce-eager); EAGER_FALLBACK=true; }
    pbstk_engine_flags "$HEAD_ADDR" "$RPC_PORT"
    ATTEMPT_START=$(stat -c %s "$LOG" 2>/dev/null || echo 0)
    READY=false
    restart=false
    if [ "$NODE_ENGINE" = ray ]; then
      pbstk_log "attempt $ATTEMPT: joining the Ray cluster at $HEAD_ADDR:$RPC_PORT as $ADDRESS"
      "${CONTAINER_CMD[@]}" ray start --address="$HEAD_ADDR:$RPC_PORT" --node-ip-address="$ADDRESS" --block &
    else
      pbstk_log "attempt $ATTEMPT: starting vLLM node $NODE_RANK on $ADDRESS: ${VLLM_CMD[*]} ${VLLM_ARGS[*]} ${extra[*]} ${ENGINE_FLAGS[*]}"
      "${VLLM_CMD[@]}" "${VLLM_ARGS[@]}" "${extra[@]}" "${ENGINE_FLAGS[@]}" &
    fi
    SERVER_PID=$!
    pbstk_state "$PHASE_STARTING"
    while kill -0 "$SERVER_PID" 2>/dev/null; do
      pbstk_marker_get head_phase "$STATE" phase
      if [ "$READY" = false ] && [ "$head_phase" = "$PHASE_READY" ]; then
        READY=true
        pbstk_state "$PHASE_READY"
        pbstk_log "the head is ready; node $NODE_RANK serves with it"
      fi
      case "$head_phase" in "$PHASE_FAILED" | "$PHASE_EXITED" | "$PHASE_CANCELLED") : >>"$RUN_DIR/stop" ;; esac
      if [ -e "$RUN_DIR/stop" ]; then
        pbstk_log "stop: the job is over; stopping vLLM (pid $SERVER_PID)"
        pbstk_kill_server
        pbstk_state "$PHASE_CANCELLED" 143
        exit 143
      fi
      pbstk_marker_get head_attempt "$RUN_DIR/head.json" attempt
      if [ "$NODE_ENGINE" != ray ] && [ "$head_attempt" != "$seen" ]; then
        pbstk_log "the head started attempt $head_attempt; restarting with it"
        pbstk_kill_server
        restart=true
        break
      fi
      pbstk_sleep
    done
    [ "$restart" = true ] && continue
    wait "$SERVER_PID"
    RC=$?
    if [ "$READY" = true ]; then
      pbstk_log "vLLM exited with code $RC"
      pbstk_state "$PHASE_EXITED" "$RC"
      : >>"$RUN_DIR/stop"
      exit "$RC"
    fi
    pbstk_log "vLLM exited with code $RC before it was ready"
    REASON="vLLM exited with code $RC before it was ready"
    pbstk_state "$PHASE_FAILED" "$RC"
    # The head decides on an eager restart of every node (a compile error here or on the head, whose loss may be
    # what ended this vLLM); wait for its decision, bounded: a new attempt, or `stop`.
    if [ "$HEAD_EAGER" != true ] && [ "$EAGER" = false ] && [ "$NODE_ENGINE" != ray ]; then
      pbstk_attempt_log | grep -Eq "$COMPILE_ERROR_RE" && pbstk_log "graph/compile error: waiting for the head's decision"
      if timeout_wait_head "$seen"; then
        REASON=
        continue
      fi
    fi
    : >>"$RUN_DIR/stop"
    exit "$RC"
  done
}
# The head's decision (a new attempt, or `stop`) comes within a few seconds of our failed marker; 60 s bounds it.
timeout_wait_head() {
  local i attempt
  for ((i = 0; i < 60; i++)); do
    pbstk_marker_get attempt "$RUN_DIR/head.json" attempt
    [[ $attempt =~ ^[0-9]+$ ]] && [ "$attempt" -gt "$1" ] && return 0
    [ -e "$RUN_DIR/stop" ] && return 1
    pbstk_sleep
  done
  return 1
}
# This attempt's part of the log (from ATTEMPT_START, its size when the attempt began).
pbstk_attempt_log() { tail -c +"$((ATTEMPT_START + 1))" "$LOG" 2>/dev/null; }
if [ "$NODE_ROLE" = true ] && [ "$NODE_RANK" -gt 0 ]; then
  pbstk_worker
fi
HEAD_ACTION=
FAILED_NODE=
FAILED_RC=
RPC_PORT=0
RAY_PID=0
[ "$NODE_ROLE" = true ] && [ "$NODE_ENGINE" = ray ] && pbstk_ray_head

