# --- several nodes (docs: RUN_DIR/nodes/K.json, head.json, stop). A header without these is one node ---
: "${NNODES:=1}" "${NODE_ENGINE:=single}" "${TP:=1}" "${PP:=1}" "${DP:=1}" "${DP_LOCAL:=1}"
: "${NODE_LAUNCHER:=ssh}" "${NCCL_IFNAME:=}" "${GLOO_IFNAME:=}"
# A node's copy is started as `start_vllm.sh --node [K]` (a scheduler's launcher and ssh may pass no environment;
# the backend's lines in the header set PBSTK_JOB_ID/PBSTK_NODEFILE for them; under mpiexec the
# rank comes from the node's place in the host list) or with PBSTK_NODE_RANK exported (local launcher).
NODE_RANK=${PBSTK_NODE_RANK:-}
NODE_ROLE=false
if [ "${1:-}" = --node ]; then
  NODE_ROLE=true
  NODE_RANK=${2:-$NODE_RANK}
fi
[ -n "$NODE_RANK" ] && NODE_ROLE=true
[ "$NNODES" -gt 1 ] || NODE_ROLE=false  # one node: today's script, whatever the environment says
LAUNCHER=false
[ "$NNODES" -gt 1 ] && [ "$NODE_ROLE" = false ] && LAUNCHER=true
NODE=${PBSTK_NODE_HOST:-$(hostname -s 2>/dev/null || hostname)}
HOSTFILE="$RUN_DIR/nodes/hostfile"
if [ "$NODE_ROLE" = true ] && [ -z "$NODE_RANK" ]; then
  # mpiexec: the position of this host's short name in the de-duplicated host list, else the launcher's rank
  NODE_RANK=$(awk -v h="$NODE" '{ sub(/\..*/, "") } $0 == h { print NR - 1; exit }' "$HOSTFILE" 2>/dev/null)
  NODE_RANK=${NODE_RANK:-${PALS_NODEID:-${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-}}}}}
fi
LOG="$RUN_DIR/vllm.log"
[ "$NODE_ROLE" = true ] && [ "${NODE_RANK:-0}" != 0 ] && LOG="$RUN_DIR/vllm.node$NODE_RANK.log"
STATE="$RUN_DIR/server.json"
NODE_STATE=
[ "$NODE_ROLE" = true ] && NODE_STATE="$RUN_DIR/nodes/${NODE_RANK:-unknown}.json"
# server.json is the head's (and the launcher's before the nodes start); workers write only their node marker
WRITE_SERVER=true
[ "$NODE_ROLE" = true ] && [ "$NODE_RANK" != 0 ] && WRITE_SERVER=false
# A scheduler may spool job output until the job ends: log straight into the run directory instead, line by line.
exec >>"$LOG" 2>&1
export PYTHONUNBUFFERED=1

ATTEMPT=0
EAGER_FALLBACK=false
PORT=0
SERVER_PID=0
ADDRESS=
REASON=

# The time from printf's builtin, not $(date): no process per line, and a stop signal's trap is never held up by a
# command substitution (markers.sh pbstk_marker_get says why that matters).
pbstk_log() { printf 'pbstk: %(%H:%M:%S)T %s\n' -1 "$*"; }
# One second in the background: a stop signal's trap runs at once (bash defers it until a foreground command ends).
pbstk_sleep() { sleep 1 & wait $! 2>/dev/null; }

