# --- several models in one job (docs/multi-model.md; only in the script of a multi-model job) ---
# Each other model (CO_MODEL_K, K = 1..CO_MODELS) gets its own vLLM: its planned GPUs (CUDA_VISIBLE_DEVICES), a
# free port of the job's window, its served name and arguments, its own log (vllm.model<K+1>.log). Models on
# other GPUs start side by side; one that shares a GPU with a model still starting waits until that one listens
# (vLLM binds its port only once its engine is up, so models sharing a GPU never start at once). The first model
# starts as in a one-model job on MAIN_GPUS once no other model sharing them is starting (with swapping, once all
# listen); the job is READY when all listen (pbstk_others_ready).
# server.json's `models` field lists `SERVED@PORT` of the others (the keeper registers each with the router);
# they all stop when the script ends, however it ends (a stop signal, the first model's exit, a failure).
# Swapping (SWAP_MAX_AWAKE > 0; docs/multi-model.md "Swapping"): a model with CO_SWAP_K (MAIN_SWAP for the first)
# true starts with vLLM's sleep mode, its development endpoints (VLLM_SERVER_DEV_MODE=1) behind the job's key
# (pbstk_dev_guard.py, --middleware), and falls asleep as soon as it listens, so that the next model of its GPUs
# finds their memory free; then pbstk_swapper.py (beside them) wakes and sleeps them as requests come.
declare MAIN_GPUS MAIN_SERVED CO_MODELS SWAP_MAX_AWAKE SWAP_SLEEP_AFTER_S MAIN_SWAP SWAP_DIR
declare LOG_PREFIX_RE EXCEPTION_RE FATAL_WRAPPER_RE
CO_PIDS=()
CO_NAMES=()  # SERVED@PORT of each of CO_PIDS, in the same order
CO_LIST=''
SWAP_ARGS=()

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

# shellcheck disable=SC2317  # invoked by the EXIT trap (groups.sh)
pbstk_kill_models() {
  local pid
  [ -n "${CO_WATCH_PID:-}" ] && kill "$CO_WATCH_PID" 2>/dev/null
  for pid in "${CO_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${CO_PIDS[@]}"; do pbstk_wait_gone "$pid" "$END_GRACE_S"; done
  for pid in "${CO_PIDS[@]}"; do pbstk_end_group "$pid" "the vLLM of another model (pid $pid)"; done  # groups.sh
  for pid in "${CO_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  CO_PIDS=()
}

# pbstk_exited_model VAR: VAR = SERVED@PORT of the first other model whose vLLM exited (gone, or a zombie this
# script has not reaped), or the name of another process of CO_PIDS that did (the swapper); "" while all run.
pbstk_exited_model() {
  local k state
  printf -v "$1" '%s' ''
  for k in "${!CO_PIDS[@]}"; do
    state=Z
    [ -r "/proc/${CO_PIDS[$k]}/stat" ] && read -r _ _ state _ <"/proc/${CO_PIDS[$k]}/stat" 2>/dev/null
    [ "$state" != Z ] && continue
    printf -v "$1" '%s' "${CO_NAMES[$k]:-a process of this job (pid ${CO_PIDS[$k]})}"
    return
  done
}

# pbstk_model_failed (the USR1 trap: the watcher below saw another model's vLLM exit): the job FAILS naming that
# model and its port, not as a cancel (a stop signal's CANCELLED), so status and the service's keeper say which
# model died; the service replaces the job, all its models.
# shellcheck disable=SC2317  # invoked by the trap below
pbstk_model_failed() {
  local who
  trap '' TERM INT HUP USR1  # once, as pbstk_stop
  pbstk_exited_model who
  pbstk_kill_server
  case $who in
    *@*) who="the vLLM of another model of this job, ${who%@*} (port ${who##*@})," ;;
  esac
  pbstk_fail "$who exited; ending the job (the service replaces it)"
}

# pbstk_swap_env: the environment of a swapping model's vLLM (its development endpoints, their guard)
pbstk_swap_env() {
  printf '%s\n' VLLM_SERVER_DEV_MODE=1 "PYTHONPATH=$SWAP_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    "PBSTK_DEV_GUARD_KEY_FILE=$RUN_DIR/api_key"
}

# pbstk_keyed VAR METHOD PORT PATH WAIT: VAR = the answer (status line, headers and body, on one line) of this
# node's model server on PORT to METHOD PATH with the job's key (a bash builtin writes it: never in a process's
# arguments), each line awaited at most WAIT seconds; false when nothing answered
pbstk_keyed() {
  local keyed_line keyed_got=''  # names no caller's VAR is likely to have (printf -v sets the nearest one)
  exec 4<>"/dev/tcp/$PROBE_HOST/$3" 2>/dev/null || return 1
  printf '%s %s HTTP/1.0\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Length: 0\r\n\r\n' \
    "$2" "$4" "$PROBE_HOST" "$(<"$RUN_DIR/api_key")" >&4
  while IFS= read -r -t "$5" keyed_line <&4; do keyed_got+=$keyed_line; done
  keyed_got+=$keyed_line
  exec 4<&-
  printf -v "$1" '%s' "$keyed_got"
  [ -n "$keyed_got" ]
}

# pbstk_swap_post PORT PATH: POST PATH to this node's model server on PORT with the job's key; true on a 200
pbstk_swap_post() {
  local answer
  pbstk_keyed answer POST "$1" "$2" 600 && [[ ${answer#* } == 200[[:space:]]* ]]  # a wake or sleep may be slow
}

# pbstk_model_answers PORT SERVED: the server on PORT of this node lists SERVED in its /v1/models (asked with the
# job's key): it is this model's vLLM, not another process that took the port first
pbstk_model_answers() {
  local body
  pbstk_keyed body GET "$1" /v1/models 10 || return 1
  [[ $body == *"\"id\":\"$2\""* || $body == *"\"id\": \"$2\""* ]]
}

# pbstk_root_cause VAR FILE SINCE: VAR = why the vLLM logging to FILE (after byte SINCE) died, as find_fatal
# (vllm/startup.py) names it: the last exception line that is no wrapper, else the last wrapper, without vLLM's
# "(EngineCore pid=N) ERROR date [file:line]" prefix, cut to 300 characters; "" when there is none
pbstk_root_cause() {
  local _line _msg _cause='' _wrapper=''  # _names: VAR may be the caller's "cause"
  while IFS= read -r _line; do
    _msg=${_line%$'\r'}
    [[ $_msg =~ $LOG_PREFIX_RE ]] && _msg=${_msg:${#BASH_REMATCH[0]}}
    [[ $_msg =~ $EXCEPTION_RE ]] || continue
    if [[ $_msg =~ $FATAL_WRAPPER_RE ]]; then _wrapper=$_msg; else _cause=$_msg; fi
  done < <(tail -c +"$(($3 + 1))" "$2" 2>/dev/null | grep -E 'Error|Exception')
  _cause=${_cause:-$_wrapper}
  [ "${#_cause}" -le 300 ] || _cause="${_cause:0:297}..."
  printf -v "$1" '%s' "$_cause"
}

# pbstk_launch_model K: start model K's vLLM on a free port (none of the ports of the models still starting) in
# the background; CO_PID_K, CO_PORT_K, CO_SINCE_K (its log's size before it) and CO_SLOT_K (its entry in CO_PIDS and
# CO_NAMES: a stop while it starts ends it too, by the EXIT trap) say where it is
pbstk_launch_model() {
  local k=$1 model served gpus swap co_port='' cvd log slot pid
  local -a args cmd envs=() avoid=()
  model="CO_MODEL_$k" served="CO_SERVED_$k" gpus="CO_GPUS_$k" swap="CO_SWAP_$k"
  local ref="CO_ARGS_${k}[@]"
  args=("${!ref}")
  cmd=("${VLLM_CMD[@]:0:${#VLLM_CMD[@]}-1}" "${!model}")  # the first model's command, this model last
  pbstk_pick_gpus cvd "${!gpus}"
  [ -n "$cvd" ] && envs+=("CUDA_VISIBLE_DEVICES=$cvd")
  [ "${!swap}" = true ] && mapfile -t -O "${#envs[@]}" envs < <(pbstk_swap_env)
  log="$RUN_DIR/vllm.model$((k + 1)).log"
  if [ "${#API_KEY_ARGS[@]}" -gt 0 ]; then  # vLLM <= 0.22 prints the key in its "non-default args" line (setup.sh)
    (umask 077 && : >>"$log") && chmod go= "$log" 2>/dev/null
  fi
  for slot in "${CO_STARTING[@]}"; do pbstk_co_get slot PORT "$slot"; avoid+=("$slot"); done
  pbstk_free_port co_port "$PROBE_HOST" "$PORT_LO" "$PORT_HI" "${avoid[@]}" \
    || pbstk_fail "no free port in $PORT_LO..$PORT_HI on $NODE for model ${!served}"
  pbstk_gpu_wait "model ${!served}" "${cvd:-${CUDA_VISIBLE_DEVICES:-}}" "$(pbstk_gpus_per_node)" "${args[@]}"
  pbstk_log "model ${!served}: starting vLLM on $ADDRESS:$co_port (GPUs ${cvd:-all of the job}), log $log"
  printf -v "CO_SINCE_$k" '%s' "$(stat -c %s "$log" 2>/dev/null || echo 0)"
  pbstk_spawn pid env "${envs[@]}" "${cmd[@]}" "${args[@]}" --host "$BIND_HOST" --port "$co_port" \
    "${API_KEY_ARGS[@]}" >>"$log" 2>&1  # in a process group of its own (groups.sh)
  printf -v "CO_PID_$k" '%s' "$pid"
  printf -v "CO_PORT_$k" '%s' "$co_port"
  pbstk_co_get slot SLOT "$k"
  [ -n "$slot" ] || { slot=${#CO_NAMES[@]}; printf -v "CO_SLOT_$k" '%s' "$slot"; }  # CO_NAMES: never unset
  CO_PIDS[slot]=$pid
  CO_NAMES[slot]="${!served}@$co_port"
}

# pbstk_co_get VAR NAME K: VAR = the value of CO_NAME_K ("" when unset); no $(...), as the polling loops of
# markers.sh: a cancel's TERM must not arrive while bash parses a command substitution
pbstk_co_get() { local _v="CO_$2_$3"; printf -v "$1" '%s' "${!_v:-}"; }

# pbstk_gpus_overlap A B: do two planned GPU lists share a GPU ("" is all of the job's, which shares every one)?
pbstk_gpus_overlap() {
  local a b
  [ -z "$1" ] || [ -z "$2" ] && return 0
  for a in ${1//,/ }; do for b in ${2//,/ }; do [ "$a" = "$b" ] && return 0; done; done
  return 1
}

# pbstk_look_at_models: one look at each model of CO_STARTING: one that answers as itself is up (a swapping one then
# falls asleep); one that died lost a port race (a port taken between the free-port look and vLLM's bind: it starts
# again on another, up to PORT_SPAN times) or fails the job with the cause from its log
pbstk_look_at_models() {
  local k served swap log races cause pid port since slot
  local -a left=()
  for k in "${CO_STARTING[@]}"; do
    served="CO_SERVED_$k" swap="CO_SWAP_$k" log="$RUN_DIR/vllm.model$((k + 1)).log"
    pbstk_co_get pid PID "$k"
    pbstk_co_get port PORT "$k"
    pbstk_co_get since SINCE "$k"
    if pbstk_port_in_use "$PROBE_HOST" "$port" && pbstk_model_answers "$port" "${!served}"; then
      pbstk_log "model ${!served} is listening on $ADDRESS:$port"
      if [ "${!swap}" = true ]; then
        pbstk_swap_post "$port" '/sleep?level=1' || pbstk_fail "model ${!served} did not fall asleep (see $log)"
        pbstk_log "model ${!served} is asleep until a request for it comes"
      fi
      continue
    fi
    left+=("$k")
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid" 2>/dev/null
    pbstk_end_group "$pid" "model ${!served}'s vLLM (pid $pid)"  # what it left (groups.sh), before a new start
    pbstk_co_get races RACES "$k"
    if tail -c +"$((since + 1))" "$log" | grep -Eq "$PORT_IN_USE_RE" \
        && [ "$((races += 1))" -lt "$PORT_SPAN" ]; then
      printf -v "CO_RACES_$k" '%s' "$races"
      pbstk_log "model ${!served}: port $port was taken while its vLLM started; trying another one"
      pbstk_launch_model "$k"
      continue
    fi
    pbstk_co_get slot SLOT "$k"
    unset "CO_PIDS[$slot]"  # dead and reaped: the EXIT trap must not signal its pid
    pbstk_root_cause cause "$log" "$since"
    pbstk_kill_server  # the job's own model, when it started beside this one
    pbstk_fail "model ${!served} exited before it was ready${cause:+: $cause} (see $log)"
  done
  CO_STARTING=("${left[@]}")
}

# pbstk_gpus_busy GPUS [K]: does a model still starting, or one before model K still waiting to start, share one of
# GPUS ("" is all of the job's)?
pbstk_gpus_busy() {
  local j gj
  for j in "${CO_STARTING[@]}"; do
    gj="CO_GPUS_$j"
    pbstk_gpus_overlap "$1" "${!gj}" && return 0
  done
  for j in "${CO_WAITING[@]}"; do
    [ "$j" = "${2:-}" ] && break
    gj="CO_GPUS_$j"
    pbstk_gpus_overlap "$1" "${!gj}" && return 0
  done
  return 1
}

# pbstk_launch_free_models: start each waiting model that no model still starting, nor one before it still waiting,
# shares a GPU with (so models on other GPUs start side by side, and on one GPU in the plan's order, each once the
# one before listens: vLLM binds its port once its engine is up, so a model never profiles memory while another
# takes it)
pbstk_launch_free_models() {
  local k gk
  local -a still=()
  for k in "${CO_WAITING[@]}"; do
    gk="CO_GPUS_$k"
    if pbstk_gpus_busy "${!gk}" "$k"; then still+=("$k"); continue; fi
    pbstk_launch_model "$k"
    CO_STARTING+=("$k")
  done
  CO_WAITING=("${still[@]}")
}

# pbstk_start_models: the other models, started by pbstk_launch_free_models; the job's own model starts on the same
# rule (with swapping, once all listen), and pbstk_others_ready (supervise.sh) sees to the rest before READY
pbstk_start_models() {
  local k
  CO_STARTING=() CO_WAITING=()
  for ((k = 1; k <= CO_MODELS; k++)); do CO_WAITING+=("$k"); done
  while true; do
    pbstk_launch_free_models
    if [ "$SWAP_MAX_AWAKE" -gt 0 ]; then
      [ "${#CO_WAITING[@]}" -eq 0 ] && [ "${#CO_STARTING[@]}" -eq 0 ] && break
    else
      pbstk_gpus_busy "$MAIN_GPUS" || break
    fi
    pbstk_look_at_models
    pbstk_sleep
  done
  if [ "${#CO_WAITING[@]}" -gt 0 ] || [ "${#CO_STARTING[@]}" -gt 0 ]; then
    MARKER_EXTRA+=("models_starting=yes")  # so the job is not READY while they start (judge.py)
  else
    pbstk_models_up
  fi
}

# pbstk_models_up: every other model listens: the markers list them, the swapper and the watcher start
pbstk_models_up() {
  local k served swap gpus port entry
  [ -z "${CO_DONE:-}" ] || return 0
  CO_DONE=1
  for ((k = 1; k <= CO_MODELS; k++)); do
    served="CO_SERVED_$k" swap="CO_SWAP_$k" gpus="CO_GPUS_$k"
    pbstk_co_get port PORT "$k"
    CO_LIST+="${CO_LIST:+ }${!served}@$port"
    [ "${!swap}" = true ] || continue
    SWAP_ARGS+=(--model "${!served}" "$port" "${!gpus:-all}" "$RUN_DIR/vllm.model$((k + 1)).log")
  done
  local -a kept=()
  for entry in "${MARKER_EXTRA[@]}"; do [[ $entry == models_starting=* ]] || kept+=("$entry"); done
  MARKER_EXTRA=("${kept[@]}")
  MARKER_EXTRA+=("models=$CO_LIST")
  pbstk_start_swapper
  pbstk_watch_models &
  CO_WATCH_PID=$!
}

# pbstk_others_ready (supervise.sh asks it each second while the job's own model starts): true once every other
# model listens; one look at those still starting, and one that died before it listened fails the job (one that
# lost its port race starts again); one already listening that exits ends the job too, as the watcher would
pbstk_others_ready() {
  local who
  [ -z "${CO_DONE:-}" ] || return 0
  pbstk_look_at_models  # those still starting: up, restarted after a lost port race, or the job fails
  pbstk_exited_model who  # so any that exited now had listened
  if [ -n "$who" ]; then
    pbstk_kill_server
    pbstk_fail "the vLLM of another model of this job, ${who%@*} (port ${who##*@}), exited; ending the job"
  fi
  pbstk_launch_free_models
  [ "${#CO_WAITING[@]}" -eq 0 ] && [ "${#CO_STARTING[@]}" -eq 0 ] || return 1
  pbstk_models_up
}

# pbstk_start_swapper: pbstk_swapper.py in the background (one of CO_PIDS: its exit ends the job too)
pbstk_start_swapper() {
  local py
  [ "$SWAP_MAX_AWAKE" -gt 0 ] || return 0
  # the first model: port 0, its port read from server.json once it is ready (its attempts pick the port)
  [ "$MAIN_SWAP" = true ] && SWAP_ARGS+=(--model "$MAIN_SERVED" 0 "${MAIN_GPUS:-all}" "$LOG")
  for py in python3 python; do
    if "${PY_PREFIX[@]}" "$py" -c 'import sys; sys.exit(sys.version_info < (3, 8))' 2>/dev/null; then
      "${PY_PREFIX[@]}" "$py" "$SWAP_DIR/pbstk_swapper.py" --run-dir "$RUN_DIR" --host "$PROBE_HOST" \
        --max-awake "$SWAP_MAX_AWAKE" --sleep-after "$SWAP_SLEEP_AFTER_S" --script-pid "$$" "${SWAP_ARGS[@]}" \
        >>"$LOG" 2>&1 &
      CO_PIDS+=("$!")
      CO_NAMES+=("the model swapper (pid $!)")
      pbstk_log "swapper: at most $SWAP_MAX_AWAKE model(s) awake on each GPU set (pid $!)"
      return 0
    fi
  done
  pbstk_fail "no python3 (3.8 or later) beside vLLM to run the swapper"
}

# pbstk_watch_models (in the background): the other models' servers, each second; one that exited ends the job
# (USR1: pbstk_model_failed), as the first model's exit does: the service replaces the job. A stop signal to the
# whole job ends this watcher with it (default TERM in a subshell), so a cancel stays a cancel.
pbstk_watch_models() {
  local who
  while true; do
    pbstk_exited_model who
    if [ -n "$who" ]; then
      kill -USR1 "$$"
      return
    fi
    pbstk_sleep
  done
}

# (however the script ends, groups.sh's EXIT trap ends the other models too: pbstk_kill_models)
trap pbstk_model_failed USR1
pbstk_state "$PHASE_STARTING"
pbstk_start_models
if [ "$MAIN_SWAP" = true ]; then  # the first model swaps too: its vLLM (started below) gets what the others got
  mapfile -t pbstk_main_env < <(pbstk_swap_env)  # (after the others started: no other model inherits it)
  export "${pbstk_main_env[@]}"
fi
pbstk_pick_gpus co_main "$MAIN_GPUS"
[ -n "$co_main" ] && export CUDA_VISIBLE_DEVICES=$co_main
