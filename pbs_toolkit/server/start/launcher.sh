# --- several nodes, launcher role (the job script's copy, on the first node): one copy of this script per node ---
NODE_PIDS=()
# GPUs per node: DP_LOCAL replicas of TP GPUs, or the TP x PP model spread evenly over the nodes.
pbstk_gpus_per_node() {
  if [ "$NODE_ENGINE" = dp ] || [ "$DP" -gt 1 ]; then echo $((DP_LOCAL * TP)); else echo $((TP * PP / NNODES)); fi
}

# local launcher: node K of this machine gets its own slice of its GPUs (and its own loopback address).
pbstk_local_gpus() {
  local k=$1 per all
  per=$(pbstk_gpus_per_node)
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=',' read -ra all <<<"$CUDA_VISIBLE_DEVICES"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    mapfile -t all < <(nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>/dev/null | awk -F', *' '{ print $1 }')
  else
    return 0
  fi
  [ "${#all[@]}" -ge $((per * NNODES)) ] \
    || pbstk_fail "this machine has ${#all[@]} GPUs; $NNODES nodes of $per GPUs need $((per * NNODES))"
  (IFS=,; echo "${all[*]:$((k * per)):$per}")
}

# Starts every node's copy through NODE_LAUNCHER; their pids (one for mpiexec) go to NODE_PIDS.
pbstk_start_nodes() {
  local script k bash_path
  script="$RUN_DIR/start_vllm.sh"
  bash_path=$(command -v bash)
  case "$NODE_LAUNCHER" in
    mpiexec)
      pbstk_log "starting $NNODES nodes: mpiexec -n $NNODES --ppn 1 --hostfile $HOSTFILE"
      mpiexec -n "$NNODES" --ppn 1 --hostfile "$HOSTFILE" "$bash_path" "$script" --node &
      NODE_PIDS+=($!)
      ;;
    ssh)
      "$bash_path" "$script" --node 0 &
      NODE_PIDS+=($!)
      for ((k = 1; k < NNODES; k++)); do
        pbstk_log "starting node $k on ${HOSTS[k]}: ssh"
        ssh -o BatchMode=yes "${HOSTS[k]}" "$(printf '%q ' "$bash_path" "$script" --node "$k")" </dev/null &
        NODE_PIDS+=($!)
      done
      ;;
    local)
      for ((k = 0; k < NNODES; k++)); do
        local gpus
        gpus=$(pbstk_local_gpus "$k") || exit 1
        pbstk_log "starting node $k (${HOSTS[k]}) on this machine: address 127.0.0.$((2 + k))${gpus:+, GPUs $gpus}"
        env PBSTK_NODE_RANK="$k" PBSTK_NNODES="$NNODES" PBSTK_NODE_ADDRESS="127.0.0.$((2 + k))" \
          PBSTK_NODE_HOST="${HOSTS[k]}" ${gpus:+CUDA_VISIBLE_DEVICES="$gpus"} "$bash_path" "$script" &
        NODE_PIDS+=($!)
      done
      ;;
    *)
      # a scheduler's own launcher: its function comes with the backend's lines in the header
      declare -F "pbstk_launch_node_$NODE_LAUNCHER" >/dev/null \
        || pbstk_fail "this job's scheduler has no node launcher $NODE_LAUNCHER (profile key node_launcher)"
      for ((k = 0; k < NNODES; k++)); do
        "pbstk_launch_node_$NODE_LAUNCHER" "$k" "${HOSTS[k]}" "$bash_path" "$script"
      done
      ;;
  esac
}

# shellcheck disable=SC2317  # invoked by the trap below
pbstk_launcher_stop() {
  trap '' TERM INT HUP  # once (see pbstk_stop)
  pbstk_log "received a stop signal; stopping every node"
  : >"$RUN_DIR/stop"
  LAUNCH_RC=143
  kill -TERM "${NODE_PIDS[@]}" 2>/dev/null
}

# The launcher: the host list, the launcher program, then one copy per node; it waits for all of them. The first
# copy to end (failed, or vLLM exited) ends the job: `stop` tells the others, who get STOP_GRACE seconds.
pbstk_launch_nodes() {
  local k pid rc stop_at=
  mkdir -p "$RUN_DIR/nodes"
  rm -f "$RUN_DIR/stop" "$RUN_DIR/head.json" "$RUN_DIR"/nodes/*.json
  if [ "$NODE_LAUNCHER" = local ]; then
    for ((k = 0; k < NNODES; k++)); do echo "$NODE-node$k"; done >"$HOSTFILE"
  else
    [ -r "${PBSTK_NODEFILE:-}" ] || pbstk_fail "PBSTK_NODEFILE is not set or not readable: cannot find the job's nodes"
    awk 'NF && !seen[$1]++ { print $1 }' "$PBSTK_NODEFILE" >"$HOSTFILE"
    command -v "$NODE_LAUNCHER" >/dev/null 2>&1 \
      || pbstk_fail "$NODE_LAUNCHER not found on $NODE: cannot start the other nodes (profile key node_launcher)" 127
  fi
  mapfile -t HOSTS <"$HOSTFILE"
  [ "${#HOSTS[@]}" -eq "$NNODES" ] \
    || pbstk_fail "the job has ${#HOSTS[@]} nodes (${HOSTS[*]}); the layout needs $NNODES"
  LAUNCH_RC=0
  trap pbstk_launcher_stop TERM INT HUP
  pbstk_start_nodes
  while [ "${#NODE_PIDS[@]}" -gt 0 ]; do
    for k in "${!NODE_PIDS[@]}"; do
      pid=${NODE_PIDS[k]}
      kill -0 "$pid" 2>/dev/null && continue
      wait "$pid"
      rc=$?
      unset 'NODE_PIDS[k]'
      pbstk_log "node starter $k exited with code $rc"
      [ "$LAUNCH_RC" = 0 ] && LAUNCH_RC=$rc
      : >"$RUN_DIR/stop"
    done
    if [ -e "$RUN_DIR/stop" ] && [ -z "$stop_at" ]; then
      stop_at=$SECONDS
    fi
    if [ -n "$stop_at" ] && [ $((SECONDS - stop_at)) -gt "${STOP_GRACE:-60}" ] && [ "${#NODE_PIDS[@]}" -gt 0 ]; then
      pbstk_log "nodes still running ${STOP_GRACE:-60} s after stop; killing them"
      kill -KILL "${NODE_PIDS[@]}" 2>/dev/null
    fi
    pbstk_sleep
  done
  # the head's marker was written by the node itself; an unset exit (all 0) still means the server ended
  exit "$LAUNCH_RC"
}

if [ "$LAUNCHER" = true ]; then
  pbstk_launch_nodes
fi
if [ "$NODE_ROLE" = true ]; then
  if ! [[ $NODE_RANK =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NNODES" ]; then
    NODE_STATE="$RUN_DIR/nodes/unknown-$NODE.json"
    pbstk_fail "cannot tell this node's rank ($NODE is not in $HOSTFILE and the launcher set no rank)"
  fi
  export PBSTK_NODE_RANK=$NODE_RANK PBSTK_NNODES=$NNODES
fi
# profile key stage_to: this node's copy of the weights on its own disk (server/stage_copy.sh, docs/weights.md)
[ -n "${STAGE_TO:-}" ] && pbstk_stage_copy

