# --- start body: each vLLM in a process group of its own, ended whole, so nothing it started outlives the job ---
# vLLM's engine core and its workers outlive a SIGKILLed API server (vllm-project/vllm#55510; FACTS section 11):
# reparented, they keep the GPU memory and every later start on those GPUs fails. So each vLLM (the job's own and
# every other model's) starts as a background job with job control on for that one `&`: bash gives it a process
# group of its own whose id is its pid, and everything vLLM starts inherits that group whoever becomes their
# parent. When vLLM exits, however it exits, and when the job stops it, what is left of its group is ended:
# SIGTERM, then SIGKILL END_GRACE_S seconds later. (setsid would also give it a group, but it leaves the job's
# session too, which a batch scheduler ends when the job ends: the scheduler's own net under this one. pbstk's local
# supervisor ends the job's group and every process that carries its token the same way.)
: "${END_GRACE_S:=${PBSTK_END_GRACE_S:-15}}"

# pbstk_spawn VAR CMD...: CMD in the background in a process group of its own; VAR = its pid (= the group's id)
pbstk_spawn() {
  local _var=$1
  shift
  set -m
  "$@" &
  printf -v "$_var" '%s' "$!"
  set +m
}

# pbstk_group_left VAR PGID: VAR = "PID (NAME)" of each live process of group PGID (a zombie is gone: it holds no
# memory), comma-separated; "" when none. Builtins and /proc only: it runs in loops a stop signal may interrupt.
pbstk_group_left() {
  local _f _st _rest _name _out=''
  printf -v "$1" '%s' ''
  kill -0 -- "-$2" 2>/dev/null || return 0  # no process at all in the group: the usual case, no scan
  for _f in /proc/[0-9]*/stat; do
    { read -r _st <"$_f"; } 2>/dev/null || continue
    _rest=${_st##*) }  # after "(comm) ": state, ppid, pgrp, ...
    [ "${_rest%% *}" = Z ] && continue
    _rest=${_rest#* }
    _rest=${_rest#* }
    [ "${_rest%% *}" = "$2" ] || continue
    _name=${_st#*(}
    _name=${_name%) *}
    _out+="${_out:+, }${_f:6:-5} ($_name)"
  done
  printf -v "$1" '%s' "$_out"
}

# pbstk_end_group PGID WHAT: end what is left of process group PGID (WHAT: whose group, for the log), SIGTERM then
# SIGKILL after END_GRACE_S; returns once no live process of it is left (or, after SIGKILL, a few seconds later)
pbstk_end_group() {
  local pgid=$1 left until killed=false
  [[ $pgid =~ ^[0-9]+$ ]] && [ "$pgid" -gt 1 ] || return 0
  pbstk_group_left left "$pgid"
  [ -n "$left" ] || return 0
  pbstk_log "$2 left processes running: $left; ending them (SIGTERM, SIGKILL after ${END_GRACE_S} s)"
  kill -TERM -- "-$pgid" 2>/dev/null
  until=$((SECONDS + END_GRACE_S))
  while [ -n "$left" ]; do
    if [ "$SECONDS" -ge "$until" ]; then
      if [ "$killed" = true ]; then
        pbstk_log "still there 5 s after SIGKILL: $left"
        return 1
      fi
      pbstk_log "still running ${END_GRACE_S} s after SIGTERM: $left; killing them"
      kill -KILL -- "-$pgid" 2>/dev/null
      killed=true
      until=$((SECONDS + 5))
    fi
    sleep 0.2 &
    wait $! 2>/dev/null
    pbstk_group_left left "$pgid"
  done
  return 0
}

# pbstk_wait_gone PID SECONDS: wait at most SECONDS for process PID (a child of this script) to end; false if it
# still runs then
pbstk_wait_gone() {
  local until=$((SECONDS + $2)) state
  while [ "$SECONDS" -lt "$until" ]; do
    state=Z
    [ -r "/proc/$1/stat" ] && read -r _ _ state _ <"/proc/$1/stat" 2>/dev/null
    [ "$state" = Z ] && return 0
    sleep 0.2 &
    wait $! 2>/dev/null
  done
  return 1
}

# pbstk_at_exit (the EXIT trap, set once here; the parts add no EXIT trap of their own): however the script ends
# (vLLM's exit, a failure, a stop signal), the other models of the job (models.sh), what is left of vLLM's group,
# and the compile lock (coldstart.sh)
# shellcheck disable=SC2317  # invoked by the trap below
pbstk_at_exit() {
  declare -F pbstk_kill_models >/dev/null && pbstk_kill_models
  [ "${SERVER_PID:-0}" -gt 0 ] && pbstk_end_group "$SERVER_PID" "vLLM (pid $SERVER_PID)"
  pbstk_compile_release
}
trap pbstk_at_exit EXIT
