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

