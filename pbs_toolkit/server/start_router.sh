
# --- the body of start_router.sh: static; every setting is a variable of the header above -------------------
# shellcheck shell=bash
# The settings the header assigns (services/router/script.py render_start_script), declared so that shellcheck
# of this body alone flags a misspelt one; `declare NAME` without a value keeps the header's. SPARE_PORT_LO and
# SPARE_PORT_HI come with the free-port rule (server/start/free_port.sh), between the header and this body.
declare RUN_DIR BIND_HOST ADVERTISE ADDRESS_MODE ADDRESS_SUFFIX POLICY SEED_URL VENV START_WAIT_S STOP_WAIT_S ISOLATE
declare -a ROUTER_CMD ROUTER_ARGV
declare SPARE_PORT_LO SPARE_PORT_HI
# A service's vllm-router, the one start procedure for all of them: run detached by pbstk on this machine or a
# login node (profile `router: local`/`login`), or as a small CPU job's entry script (`router: job`). It chooses
# free ports on this host, starts the router bound to BIND_HOST, and once the router answers /list_workers writes
# RUN_DIR/router.json (host = ADVERTISE, else this node's address as ADDRESS_MODE names it, port,
# prometheus_port, pid; 0644, no secret in it) for pbstk to read. With ISOLATE=1 the router runs behind pbstk's front (router_front.py: the router in a private
# network namespace, only service traffic passed on, its admin API wanting the token in router.token). SIGTERM (a cancel, the walltime) is passed on to the router, which then drains; KILL after
# STOP_WAIT_S. The job ends when the router does.
set -uo pipefail
cd "$RUN_DIR" || exit 1
LOG="$RUN_DIR/router.log"
rm -f "$RUN_DIR/router.json"

pbstk_log() { printf '%(%Y-%m-%dT%H:%M:%S%z)T pbstk-router: %s\n' -1 "$*" >>"$LOG"; }  # builtin time
pbstk_fail() { pbstk_log "error: $1"; echo "pbstk: $1" >&2; exit "${2:-1}"; }

if [ -n "$VENV" ]; then
  # shellcheck disable=SC1091  # the user's environment, not ours to lint
  source "$VENV/bin/activate" || pbstk_fail "cannot activate the Python environment $VENV"
fi
command -v -- "${ROUTER_CMD[0]}" >/dev/null 2>&1 \
  || pbstk_fail "router command ${ROUTER_CMD[0]} not found on $(hostname) (profile key router_command)" 127

if [ "$ISOLATE" = 1 ]; then
  # the front's admin token (0600, written by pbstk): from a file into the environment, never into argv
  PBSTK_ROUTER_TOKEN=$(<"$RUN_DIR/router.token") || pbstk_fail "cannot read $RUN_DIR/router.token"
  export PBSTK_ROUTER_TOKEN
  # the router's own Python (next to its command: a venv's, new enough), else python3 on PATH
  FRONT_PY=$(command -v -- "${ROUTER_CMD[0]}" 2>/dev/null)
  FRONT_PY=${FRONT_PY%/*}/python3
  [ -x "$FRONT_PY" ] || FRONT_PY=$(command -v python3) \
    || pbstk_fail "python3 not found on $(hostname): the router's front needs it" 127
fi

NODE=$(hostname -s 2>/dev/null || hostname)
case "$ADDRESS_MODE" in
  loopback) ADDRESS=127.0.0.1 ;;
  fqdn) ADDRESS=$(hostname -f 2>/dev/null || hostname) ;;
  ip) ADDRESS=$(hostname -i 2>/dev/null | awk '{ print $1 }') ;;
  *) ADDRESS=$NODE ;;
esac
ADDRESS="$ADDRESS$ADDRESS_SUFFIX"
# a loopback bind is only reachable as itself
case "$BIND_HOST" in 127.*) ADDRESS=$BIND_HOST ;; esac
[ -n "$ADVERTISE" ] && ADDRESS=$ADVERTISE
# what router.json may carry without escaping: a host name or an address
[[ $ADDRESS =~ ^[A-Za-z0-9.:_-]+$ ]] || pbstk_fail "this node's address ${ADDRESS@Q} is not a plain host name"
case "$BIND_HOST" in
  0.0.0.0 | "") REACH=127.0.0.1 ;;
  ::) REACH=::1 ;;
  *) REACH=$BIND_HOST ;;
esac

# does the router answer GET /list_workers with 200? (bash's /dev/tcp: no curl needed on the node)
pbstk_answers() {
  # shellcheck disable=SC2016  # the inner script's own positional parameters
  timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "GET /list_workers HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n" "$1" >&3
    read -r _ code _ <&3 && [ "$code" = 200 ]' pbstk-probe "$REACH" "$1" 2>/dev/null
}

# take the start-up worker out again: POST /remove_worker?url=SEED_URL answered with 200 (behind the front, with
# its admin token from the environment: printf is a builtin, so the token never reaches an argv)
pbstk_unseed() {
  local url=${2//\[/%5B}
  url=${url//\]/%5D}
  # shellcheck disable=SC2016  # the inner script's own positional parameters
  timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "POST /remove_worker?url=%s HTTP/1.0\r\nHost: %s\r\nContent-Length: 0\r\nConnection: close\r\n" "$3" "$1" >&3
    [ -z "${PBSTK_ROUTER_TOKEN:-}" ] || printf "X-Pbstk-Router-Token: %s\r\n" "$PBSTK_ROUTER_TOKEN" >&3
    printf "\r\n" >&3
    read -r _ code _ <&3 && [ "$code" = 200 ]' pbstk-unseed "$REACH" "$1" "$url" 2>/dev/null
}

CHILD=
# shellcheck disable=SC2317  # invoked by the trap below
pbstk_stop() {
  trap '' TERM INT HUP
  if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then
    pbstk_log "stopping the router (pid $CHILD)"
    kill -TERM "$CHILD" 2>/dev/null
    local n=$((STOP_WAIT_S * 10))
    while [ "$n" -gt 0 ] && kill -0 "$CHILD" 2>/dev/null; do sleep 0.1; n=$((n - 1)); done
    kill -KILL "$CHILD" 2>/dev/null
  fi
  exit 143
}
trap pbstk_stop TERM INT HUP

# what router.json may carry without escaping: RUN_DIR with its backslashes and quotes escaped
JSON_RUN_DIR=${RUN_DIR//\\/\\\\}
JSON_RUN_DIR=${JSON_RUN_DIR//\"/\\\"}
PORT=0 PROM_PORT=0
for attempt in 1 2 3 4; do
  # two free ports on this host by the free-port rule (free_port.sh), the second not the first
  if ! pbstk_free_port PORT "$REACH" "$SPARE_PORT_LO" "$SPARE_PORT_HI" \
      || ! pbstk_free_port PROM_PORT "$REACH" "$SPARE_PORT_LO" "$SPARE_PORT_HI" "$PORT"; then
    pbstk_fail "no free port in $SPARE_PORT_LO..$SPARE_PORT_HI on $NODE"
  fi
  pbstk_log "starting ${ROUTER_CMD[0]} on $BIND_HOST:$PORT (prometheus $PROM_PORT), attempt $attempt"
  log_from=$(stat -c %s "$LOG" 2>/dev/null || echo 0)
  # the command line pbstk built (services/router/process.py router_argv), with this node's ports and Python put in; a
  # policy the router refuses to start with fewer than 2 workers (power_of_two) has its own Prometheus endpoint
  # (bound before the router waits for workers) as its start-up worker, removed before router.json is written
  argv=("${ROUTER_ARGV[@]//"@PORT@"/$PORT}")
  argv=("${argv[@]//"@PROM_PORT@"/$PROM_PORT}")
  argv=("${argv[@]//"@PYTHON@"/${FRONT_PY:-}}")
  SEED=${SEED_URL//"@PROM_PORT@"/$PROM_PORT}
  "${argv[@]}" >>"$LOG" 2>&1 &
  CHILD=$!
  waited=0
  while ! pbstk_answers "$PORT"; do
    if ! kill -0 "$CHILD" 2>/dev/null; then
      wait "$CHILD"; rc=$?
      # a lost race for the port: try new ones
      tail -c +"$((log_from + 1))" "$LOG" | grep -qi 'address already in use' && { CHILD=; continue 2; }
      pbstk_fail "the router exited ($rc) before it answered; see $LOG" "$rc"
    fi
    [ "$waited" -ge $((START_WAIT_S * 5)) ] && { kill -KILL "$CHILD" 2>/dev/null
      pbstk_fail "the router did not answer within $START_WAIT_S s; see $LOG"; }
    sleep 0.2 & wait $!
    waited=$((waited + 1))
  done
  if [ -n "$SEED" ] && ! pbstk_unseed "$PORT" "$SEED"; then
    kill -KILL "$CHILD" 2>/dev/null
    pbstk_fail "the router did not remove its start-up worker $SEED; see $LOG"
  fi
  printf '{"host": "%s", "port": %s, "prometheus_port": %s, "pid": %s, "policy": "%s", "run_dir": "%s"}\n' \
    "$ADDRESS" "$PORT" "$PROM_PORT" "$CHILD" "$POLICY" "$JSON_RUN_DIR" >"$RUN_DIR/router.json.tmp"
  chmod 0644 "$RUN_DIR/router.json.tmp" && mv -f "$RUN_DIR/router.json.tmp" "$RUN_DIR/router.json"
  pbstk_log "ready at http://$ADDRESS:$PORT"
  while :; do
    wait "$CHILD"; rc=$?
    kill -0 "$CHILD" 2>/dev/null || break
  done
  pbstk_log "the router exited ($rc)"
  exit "$rc"
done
pbstk_fail "could not bind a free port in 4 attempts; see $LOG"
