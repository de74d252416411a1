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

