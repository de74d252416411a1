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
