# shellcheck shell=bash
# --- node-local copy of the weights (profile key stage_to; docs/weights.md) ---
# Included between the settings header and the body only when the profile sets stage_to. Each node's copy of the
# start script (started by the site's node launcher, NODE_LAUNCHER) copies the verified model once from the shared
# filesystem to its own disk, one copy per node, at most STAGE_PARALLEL nodes at once (profile key
# stage_to_parallel); every size is checked against the manifest `pbstk stage` wrote (a model directory: against
# the source's sizes), and vLLM loads the copy. The copy is made under a temporary name and renamed only once it
# is complete, so a half copy never looks like a model.
# Its time is a start-up phase: RUN_DIR/phases/stage-copy (node K > 0: stage-copy.node<K>) gets start=<epoch>,
# then end=<epoch>, bytes=<n> and to=<dir>.

# "size<TAB>file" lines of what must be there: the manifest's list, else every file under the source directory
pbstk_stage_sizes() {
  if [ -n "$2" ]; then
    python3 -c 'import json, sys
for f in json.load(open(sys.argv[1]))["files"]:
    print("%d\t%s" % (f["size"], f["file"]))' "$2"
  else
    (cd -- "$1" && find -L . -type f -printf '%s\t%P\n')
  fi
}

# whether directory $1 holds every file of the sizes list $2 with its size (the first difference is logged)
pbstk_stage_check() {
  local size file got
  while IFS=$'\t' read -r size file; do
    got=$(stat -L -c %s -- "$1/$file" 2>/dev/null) || { pbstk_log "stage copy: $1/$file is missing"; return 1; }
    [ "$got" = "$size" ] || { pbstk_log "stage copy: $1/$file is $got bytes, expected $size"; return 1; }
  done <"$2"
}

# node K copies once node K-STAGE_PARALLEL has finished: at most STAGE_PARALLEL nodes read the shared filesystem at
# once (markers on the shared run directory, no lock: flock is not reliable on every parallel filesystem)
pbstk_stage_wait_turn() {
  local before=$((${NODE_RANK:-0} - STAGE_PARALLEL)) marker
  { [ "$NODE_ROLE" = true ] && [ "$before" -ge 0 ]; } || return 0
  marker="$RUN_DIR/phases/stage-copy"
  [ "$before" -gt 0 ] && marker="$marker.node$before"
  pbstk_log "stage copy: waiting for node $before's copy (at most $STAGE_PARALLEL nodes copy at once)"
  until grep -q '^end=' "$marker" 2>/dev/null; do
    [ -e "$RUN_DIR/stop" ] && pbstk_fail "stage_to: the job is stopping"
    sleep 1
  done
}

pbstk_stage_copy() {
  local src repo commit manifest="" key dest tmp sizes marker total
  marker="$RUN_DIR/phases/stage-copy"
  [ "$NODE_ROLE" = true ] && [ "${NODE_RANK:-0}" != 0 ] && marker="$RUN_DIR/phases/stage-copy.node$NODE_RANK"
  if [ -d "$MODEL" ]; then
    src=$MODEL
    key=$(printf '%s' "$MODEL" | cksum | cut -d' ' -f1)
  else
    repo="${HF_HOME:-$HOME/.cache/huggingface}/hub/models--${MODEL//\//--}"
    commit=$STAGE_REVISION
    [[ $commit =~ ^[0-9a-f]{40}$ ]] || commit=$(cat "$repo/refs/$STAGE_REVISION" 2>/dev/null)
    manifest="$repo/pbstk-manifests/$commit.json"
    { [ -n "$commit" ] && [ -f "$manifest" ]; } \
      || pbstk_fail "stage_to: $MODEL is not staged in ${HF_HOME:-the default cache} (run pbstk stage $MODEL)"
    src="$repo/snapshots/$commit"
    key=$commit
  fi
  dest="$STAGE_TO/pbstk-models/$(basename -- "$MODEL" | tr -c 'A-Za-z0-9._\n-' _)-$key"
  mkdir -p -- "$RUN_DIR/phases" "$STAGE_TO/pbstk-models" \
    || pbstk_fail "stage_to: cannot create $STAGE_TO/pbstk-models on $NODE"
  pbstk_stage_wait_turn
  echo "start=$(date +%s)" >"$marker"
  pbstk_startup_mark stage  # the start-up timeline's stage_copy phase (docs/coldstart.md)
  sizes=$(mktemp "${TMPDIR:-/tmp}/pbstk-sizes.XXXXXX") || pbstk_fail "stage_to: cannot create a temporary file"
  pbstk_stage_sizes "$src" "$manifest" >"$sizes" || pbstk_fail "stage_to: cannot list $src"
  if [ -d "$dest" ] && pbstk_stage_check "$dest" "$sizes"; then
    pbstk_log "stage copy: $dest is already on $NODE"
  else
    pbstk_log "stage copy: $src -> $dest on $NODE"
    tmp=$(mktemp -d "$STAGE_TO/pbstk-models/.copy.XXXXXX") || pbstk_fail "stage_to: cannot write to $STAGE_TO on $NODE"
    if ! cp -RL -- "$src/." "$tmp/" || ! pbstk_stage_check "$tmp" "$sizes"; then
      rm -rf -- "$tmp"
      pbstk_fail "stage_to: copying $src to $STAGE_TO on $NODE failed (space on the node's disk?)"
    fi
    # a node's other job may have finished the same copy first: then that one is used
    mv -T -- "$tmp" "$dest" 2>/dev/null || rm -rf -- "$tmp"
    pbstk_stage_check "$dest" "$sizes" || pbstk_fail "stage_to: $dest on $NODE does not match the staged model"
  fi
  total=$(awk -F'\t' '{ s += $1 } END { print s + 0 }' "$sizes")
  rm -f -- "$sizes"
  printf 'end=%s\nbytes=%s\nto=%s\n' "$(date +%s)" "$total" "$dest" >>"$marker"
  pbstk_startup_mark staged
  MODEL=$dest
}
