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

