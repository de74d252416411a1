# --- markers: server.json (the head's), RUN_DIR/nodes/K.json (every node's), head.json (for the workers) ---
# One line of JSON each, written with no escaping at all: a string value is first cut down to characters JSON
# takes as they are (pbstk_safe), so a hostile host name, job id or reason can neither break nor extend a marker,
# and a number is checked to be one (else null). Keys of numbers and of booleans; every other key is a string.
PBSTK_NUMBER_KEYS=" rank nnodes port rpc_port pid attempt exit_code updated "
PBSTK_BOOL_KEYS=" eager eager_fallback "
# Fields a feature adds to every server.json (KEY=VALUE words; a number's KEY goes into PBSTK_NUMBER_KEYS).
MARKER_EXTRA=()

# pbstk_safe VAR VALUE: VAR = VALUE with a control character (newline, tab, ...) as a space, " as ', \ as /, and
# anything else that is neither a letter, a digit, punctuation nor a space as ? (a byte that is not UTF-8 too).
pbstk_safe() {
  local s=$2
  s=${s//[[:cntrl:]]/ }
  s=${s//\"/\'}
  s=${s//\\/\/}
  s=${s//[^[:alnum:][:punct:] ]/?}
  printf -v "$1" '%s' "$s"
}

# pbstk_marker FILE KEY=VALUE...: FILE as one line of JSON, in that order, replaced atomically (readers never see
# half a file). Builtins only, as pbstk_marker_get, for the same reason.
pbstk_marker() {
  local file=$1 kv key value json='' sep=''
  shift
  for kv in "$@"; do
    key=${kv%%=*}
    value=${kv#*=}
    if [[ $PBSTK_NUMBER_KEYS == *" $key "* ]]; then
      [[ $value =~ ^(0|-?[1-9][0-9]*)$ ]] || value=null
    elif [[ $PBSTK_BOOL_KEYS == *" $key "* ]]; then
      [ "$value" = true ] || value=false
    else
      pbstk_safe value "$value"
      value="\"$value\""
    fi
    json+="$sep\"$key\": $value"
    sep=', '
  done
  printf '%s\n' "{$json}" >"$file.tmp.$$" && mv -f "$file.tmp.$$" "$file"
}

# pbstk_marker_get VAR FILE KEY: VAR = KEY's value in a marker above ("" when it has none or null; strings without
# their quotes). No string in a marker holds " or \ (pbstk_safe), so a string ends at the next ", any other value
# at the next , or }. Builtins only, no $(...): the polling loops call it each second, and bash 5.2 can fail to run
# a trap (a cancel's TERM) that arrives while it parses a command substitution ("trap: unexpected EOF while looking
# for matching `)'").
pbstk_marker_get() {
  local _line='' _re="\"$3\": (\"([^\"]*)\"|([^,}]*))"
  [ -r "$2" ] && IFS= read -r _line 2>/dev/null <"$2"
  printf -v "$1" '%s' ""
  [[ $_line =~ $_re ]] || return 0
  [ "${BASH_REMATCH[3]}" = null ] || printf -v "$1" '%s' "${BASH_REMATCH[2]}${BASH_REMATCH[3]}"
}

# The markers of this node in phase $1 (exit code $2, if any): server.json (the head's, and the launcher's
# before the nodes start) and, on a node of several, RUN_DIR/nodes/K.json.
pbstk_state() {
  local now multi=()
  printf -v now '%(%s)T' -1
  [ "$NNODES" -gt 1 ] && multi=("nnodes=$NNODES") && [ -n "$REASON" ] && multi+=("reason=$REASON")
  if [ "$WRITE_SERVER" = true ]; then
    pbstk_marker "$STATE" "phase=$1" "job_id=${PBSTK_JOB_ID:-}" "host=$NODE" "address=$ADDRESS" "port=$PORT" \
      "pid=$SERVER_PID" "attempt=$ATTEMPT" "eager_fallback=$EAGER_FALLBACK" "${multi[@]}" "${MARKER_EXTRA[@]}" \
      "exit_code=${2:-}" "updated=$now"
  fi
  if [ -n "$NODE_STATE" ]; then
    pbstk_node_state "$NODE_STATE" "${NODE_RANK:-}" "$1" "${2:-}"
  fi
}

# pbstk_node_state FILE RANK PHASE EXIT_CODE: one node's marker.
pbstk_node_state() {
  local now reason=()
  printf -v now '%(%s)T' -1
  [ -z "$REASON" ] || reason=("reason=$REASON")
  mkdir -p "${1%/*}" 2>/dev/null
  pbstk_marker "$1" "rank=$2" "nnodes=$NNODES" "host=$NODE" "address=$ADDRESS" "phase=$3" "pid=$SERVER_PID" \
    "exit_code=$4" "attempt=$ATTEMPT" "${reason[@]}" "updated=$now"
}

pbstk_fail() {
  pbstk_log "error: $1"
  [ "$NNODES" -gt 1 ] && REASON=$1
  pbstk_state "$PHASE_FAILED" "${2:-1}"
  # the launcher failed before any node started: the head's marker says why
  [ "$LAUNCHER" = true ] && pbstk_node_state "$RUN_DIR/nodes/0.json" 0 "$PHASE_FAILED" "${2:-1}"
  [ "$NNODES" -gt 1 ] && : >"$RUN_DIR/stop"
  exit "${2:-1}"
}

# A stop signal before vLLM runs (a cancel during the site setup, the compile wait, the node launch) ends the job
# as a stopped one, from the first line the log gets: the log says so and the marker says cancelled (143), as
# after vLLM started. server.sh's and launcher.sh's traps replace this one once there is something to stop.
# shellcheck disable=SC2317  # invoked by the trap below
pbstk_stop_early() {
  trap '' TERM INT HUP  # once (see pbstk_stop)
  pbstk_log "received a stop signal before vLLM started; ending the job"
  [ "$NNODES" -gt 1 ] && : >>"$RUN_DIR/stop"
  pbstk_state "$PHASE_CANCELLED" 143
  exit 143
}
trap pbstk_stop_early TERM INT HUP

