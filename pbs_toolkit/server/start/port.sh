# --- port: with FIXED_PORT exactly the requested one (--port N), refused when it is taken. Otherwise a free one
# in the window of PORT_SPAN ports from the requested one. Each try starts at a random place in the window and
# goes round it, so servers started together on one node rarely pick the same port; one that loses the race
# anyway (vLLM could not bind) tries again from another random place, up to PORT_SPAN times ---
PROBE_HOST=$BIND_HOST
[ "$PROBE_HOST" = "0.0.0.0" ] && PROBE_HOST=127.0.0.1
pbstk_port_in_use() { (exec 3<>"/dev/tcp/$PROBE_HOST/$1") 2>/dev/null; }
if [ "$FIXED_PORT" = true ]; then
  PORT_HI=$PORT_LO
else
  PORT_HI=$((PORT_LO + PORT_SPAN - 1))
  [ "$PORT_HI" -gt 65535 ] && PORT_HI=65535
fi
PORT_RACES=0
# The first free port going round the window from $1.
pbstk_pick_port() {
  local count=$((PORT_HI - PORT_LO + 1)) i port
  for ((i = 0; i < count; i++)); do
    port=$((PORT_LO + ($1 - PORT_LO + i) % count))
    pbstk_port_in_use "$port" || { echo "$port"; return 0; }
  done
  return 1
}

