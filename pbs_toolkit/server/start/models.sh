# --- several models in one job (docs/multi-model.md; only in the script of a multi-model job) ---
# Each other model (CO_MODEL_K, K = 1..CO_MODELS) gets its own vLLM: its planned GPUs (CUDA_VISIBLE_DEVICES), a
# free port of the job's window, its served name and arguments, its own log (vllm.model<K+1>.log). They start
# one after the other, each once the previous one listens (vLLM binds its port only once its engine is up, so
# models sharing a GPU never start at once), then the first model starts as in a one-model job on MAIN_GPUS.
# server.json's `models` field lists `SERVED@PORT` of the others (the keeper registers each with the router);
# they all stop when the script ends, however it ends (a stop signal, the first model's exit, a failure).
declare MAIN_GPUS CO_MODELS
CO_PIDS=()
CO_LIST=''

# pbstk_pick_gpus VAR PLANNED: the planned GPU indices as CUDA_VISIBLE_DEVICES entries: the job's own entries
# (a scheduler's UUIDs) when it names enough of them, else the indices themselves; "" for none planned.
pbstk_pick_gpus() {
  local var=$1 out='' sep='' i
  local -a have=() want=()
  [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && IFS=, read -r -a have <<<"$CUDA_VISIBLE_DEVICES"
  [ -n "$2" ] && IFS=, read -r -a want <<<"$2"
  for i in "${want[@]}"; do
    if [ "${#have[@]}" -gt "$i" ]; then out+="$sep${have[$i]}"; else out+="$sep$i"; fi
    sep=,
  done
  printf -v "$var" '%s' "$out"
}

# shellcheck disable=SC2317  # invoked by the EXIT trap below
pbstk_kill_models() {
  local pid
  [ -n "${CO_WATCH_PID:-}" ] && kill "$CO_WATCH_PID" 2>/dev/null
  for pid in "${CO_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${CO_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  CO_PIDS=()
}

# pbstk_start_model K: start model K and wait until it listens (or fail the job: it died first)
pbstk_start_model() {
  local k=$1 model served gpus co_port='' cvd log pid
  local -a args cmd
  model="CO_MODEL_$k" served="CO_SERVED_$k" gpus="CO_GPUS_$k"
  local ref="CO_ARGS_${k}[@]"
  args=("${!ref}")
  cmd=("${VLLM_CMD[@]:0:${#VLLM_CMD[@]}-1}" "${!model}")  # the first model's command, this model last
  pbstk_free_port co_port "$PROBE_HOST" "$PORT_LO" "$PORT_HI" || pbstk_fail "no free port in $PORT_LO..$PORT_HI on $NODE for model ${!served}"
  pbstk_pick_gpus cvd "${!gpus}"
  log="$RUN_DIR/vllm.model$((k + 1)).log"
  pbstk_log "model ${!served}: starting vLLM on $ADDRESS:$co_port (GPUs ${cvd:-all of the job}), log $log"
  if [ -n "$cvd" ]; then
    CUDA_VISIBLE_DEVICES=$cvd "${cmd[@]}" "${args[@]}" --host "$BIND_HOST" --port "$co_port" "${API_KEY_ARGS[@]}" >>"$log" 2>&1 &
  else
    "${cmd[@]}" "${args[@]}" --host "$BIND_HOST" --port "$co_port" "${API_KEY_ARGS[@]}" >>"$log" 2>&1 &
  fi
  pid=$!
  CO_PIDS+=("$pid")
  until pbstk_port_in_use "$PROBE_HOST" "$co_port"; do
    kill -0 "$pid" 2>/dev/null || pbstk_fail "model ${!served} exited before it was ready (see $log)"
    pbstk_sleep
  done
  pbstk_log "model ${!served} is listening on $ADDRESS:$co_port"
  CO_LIST+="${CO_LIST:+ }${!served}@$co_port"
}

# pbstk_watch_models (in the background): the other models' servers, each second; one that exited (gone, or a
# zombie this script has not reaped) ends the job, as the first model's exit does: the service replaces the job
pbstk_watch_models() {
  local pid state
  while true; do
    for pid in "${CO_PIDS[@]}"; do
      state=Z
      [ -r "/proc/$pid/stat" ] && read -r _ _ state _ <"/proc/$pid/stat" 2>/dev/null
      [ "$state" != Z ] && continue
      pbstk_log "error: the vLLM of another model of this job (pid $pid) exited; ending the job (the service replaces it)"
      kill -TERM "$$"
      return
    done
    pbstk_sleep
  done
}

trap 'pbstk_kill_models; pbstk_compile_release' EXIT  # the compile lock's release (coldstart.sh) kept
pbstk_state "$PHASE_STARTING"
for ((co_k = 1; co_k <= CO_MODELS; co_k++)); do
  pbstk_start_model "$co_k"
done
MARKER_EXTRA+=("models=$CO_LIST")
pbstk_watch_models &
CO_WATCH_PID=$!
pbstk_pick_gpus co_main "$MAIN_GPUS"
[ -n "$co_main" ] && export CUDA_VISIBLE_DEVICES=$co_main
