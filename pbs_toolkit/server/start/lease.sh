# --- the lease of pbstk run (docs/campaigns.md "The lease"): the head ends the job once the run is gone ---
# `pbstk run` rewrites RUN_DIR/lease (a new content each time) every few seconds while COMMAND runs. When the
# content has not changed for LEASE_S seconds of this node's own clock (no clock of another machine is compared),
# the run was killed, its machine sleeps or its SSH connection dropped: the watcher writes RUN_DIR/ended_lease,
# logs "lease lapsed: ..." (pbstk status reads that line), waits until no request runs or waits (at most
# LEASE_DRAIN_S; the /metrics read is idle.sh's) and stops vLLM with SIGTERM; the job then ends with code 0.
LEASE_PID=0
LEASE_DRAIN_S=30
# shellcheck disable=SC2317  # runs in the background watcher
pbstk_lease_drain() {  # (several API servers: drained once the engine made no progress for a second, idle.sh)
  local running waiting _success progress several last='' until=$((SECONDS + LEASE_DRAIN_S))
  while [ "$SECONDS" -lt "$until" ] && kill -0 "$SERVER_PID" 2>/dev/null; do
    read -r running waiting _success progress several < <(pbstk_idle_metrics 2>/dev/null) || return 0
    [ "$((running + waiting))" -gt 0 ] || return 0
    [ "$several" = 1 ] && [ "$progress" = "$last" ] && return 0
    last=$progress
    sleep 1
  done
}
pbstk_lease_watch() {
  local since=$SECONDS last='' seen step=$((LEASE_S / 6))
  [ "$step" -lt 1 ] && step=1
  [ "$step" -gt 30 ] && step=30
  rm -f "$RUN_DIR/ended_lease"
  while kill -0 "$SERVER_PID" 2>/dev/null; do
    sleep "$step"
    seen=$(cat "$RUN_DIR/lease" 2>/dev/null) || seen=''
    if [ -n "$seen" ] && [ "$seen" != "$last" ]; then
      since=$SECONDS
      last=$seen
    fi
    # -gt: SECONDS counts whole seconds; never end early
    if [ $((SECONDS - since)) -gt "$LEASE_S" ]; then
      date +%s >"$RUN_DIR/ended_lease"
      pbstk_log "lease lapsed: no renewal from pbstk run for ${LEASE_S}s; draining, then stopping vLLM (pid $SERVER_PID)"
      pbstk_lease_drain
      kill -TERM "$SERVER_PID" 2>/dev/null
      return 0
    fi
  done
}
pbstk_lease_start() {
  [ "${LEASE_S:-0}" -gt 0 ] && [ "$WRITE_SERVER" = true ] || return 0
  pbstk_lease_watch &
  LEASE_PID=$!
  pbstk_log "lease: vLLM is stopped when pbstk run has not renewed $RUN_DIR/lease for ${LEASE_S}s"
}
# (the job after its lease lapsed ends like an idle stop: idle.sh's pbstk_watched_end, marker ended_lease)
