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
