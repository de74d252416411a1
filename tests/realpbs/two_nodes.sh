#!/usr/bin/env bash
# A second execution host for the real-OpenPBS tier (CONTRIBUTING.md "The real-OpenPBS tier"): a second pbs_mom
# on this machine, in a network namespace and a UTS namespace of its own, so that the real server places a
# `select=2` job on two hosts and PBS_NODEFILE lists both. Run after the team's realpbs/up.sh (one server,
# scheduler, comm and MoM in the namespace `pbsns`, where this host's short name is 10.231.0.1).
#
#   the server's namespace `pbsns`  10.231.1.1 (veth p2a) <-> 10.231.1.2 (veth p2b)  namespace `pbsns2`
#   host name `<short name>-n2` (hostname inside its UTS namespace too), PBS_HOME /var/spool/pbs-n2,
#   PBS_CONF_FILE /etc/pbs-n2.conf; a node of 64 CPUs and 8 `ngpus`, like the first. Also an execjob_end hook,
#   pbstk_slow_end (slow_end_hook.py), that keeps jobs named *slowexit* in state E for 20 s.
#
# usage: two_nodes.sh [up|down]   (idempotent both ways; `down` deletes the node and everything made here)
set -euo pipefail
[ -x /opt/pbs/sbin/pbs_mom ] || { echo "no /opt/pbs: build OpenPBS first (realpbs/build.sh)" >&2; exit 1; }
ip netns list | grep -qw pbsns || { echo "no namespace pbsns: run realpbs/up.sh first" >&2; exit 1; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NS=pbsns
NS2=pbsns2
HEAD=$(hostname -s)
NODE2=${HEAD}-n2
HOME2=/var/spool/pbs-n2
CONF2=/etc/pbs-n2.conf
HOSTS1=/etc/netns/$NS/hosts
IN1=(ip netns exec "$NS")
IN2=(ip netns exec "$NS2")

qmgr1() { "${IN1[@]}" /opt/pbs/bin/qmgr -c "$1"; }

# The line for NODE2 in the server's hosts file, rewritten in place: the running server's /etc/hosts is a bind
# mount of this very file (ip netns exec), so a new file (sed -i, mv) would not be seen by it.
set_node2_line() {
  local kept
  kept=$(grep -v -w -- "$NODE2" "$HOSTS1" || true)
  if [ "$1" = add ]; then printf '%s\n10.231.1.2 %s\n' "$kept" "$NODE2" >"$HOSTS1"; else printf '%s\n' "$kept" >"$HOSTS1"; fi
}

mom2_pid() {
  local pid
  pid=$(cat "$HOME2/mom_priv/mom.lock" 2>/dev/null || true)
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

up() {
  # a server namespace made again since (realpbs/up.sh after a reboot) has lost its end of the pair: the second
  # host would stay "down,unresolvable" however often this ran; start it afresh
  if ip netns list | grep -qw "$NS2" && ! "${IN1[@]}" ip link show p2a >/dev/null 2>&1; then
    echo "$NS has no link to $NS2 (made again since?): removing the second host and adding it afresh"
    down
  fi
  if ! ip netns list | grep -qw "$NS2"; then
    ip netns add "$NS2"
    "${IN2[@]}" ip link set lo up
    ip link add p2a type veth peer name p2b
    ip link set p2a netns "$NS"
    ip link set p2b netns "$NS2"
    "${IN1[@]}" ip addr add 10.231.1.1/24 dev p2a
    "${IN1[@]}" ip link set p2a up
    "${IN2[@]}" ip addr add 10.231.1.2/24 dev p2b
    "${IN2[@]}" ip link set p2b up
    "${IN2[@]}" ip route add default via 10.231.1.1
  fi
  mkdir -p "/etc/netns/$NS2"
  printf '127.0.0.1 localhost\n10.231.0.1 %s\n10.231.1.2 %s\n' "$HEAD" "$NODE2" >"/etc/netns/$NS2/hosts"
  grep -qw -- "$NODE2" "$HOSTS1" || set_node2_line add
  printf 'PBS_EXEC=/opt/pbs\nPBS_HOME=%s\nPBS_SERVER=%s\nPBS_START_SERVER=0\nPBS_START_SCHED=0\nPBS_START_COMM=0\nPBS_START_MOM=1\nPBS_LEAF_ROUTERS=%s\nPBS_MOM_NODE_NAME=%s\nPBS_CORE_LIMIT=unlimited\nPBS_SCP=/usr/bin/scp\n' \
    "$HOME2" "$HEAD" "$HEAD" "$NODE2" >"$CONF2"
  if [ ! -d "$HOME2/mom_priv" ]; then
    mkdir -p "$HOME2"/{mom_priv/jobs,mom_priv/hooks/tmp,mom_logs,aux,checkpoint,spool,undelivered}
    chmod 1777 "$HOME2/spool" "$HOME2/undelivered"
    chmod 0751 "$HOME2/mom_priv" "$HOME2/mom_priv/jobs"; chmod 0750 "$HOME2/mom_priv/hooks" "$HOME2/mom_priv/hooks/tmp"; chmod 0700 "$HOME2/checkpoint"
    cp /var/spool/pbs/pbs_environment "$HOME2/pbs_environment"
    # shellcheck disable=SC2016  # a literal $clienthost: MoM's own config syntax
    printf '$clienthost %s\n' "$HEAD" >"$HOME2/mom_priv/config"
  fi
  if [ -z "$(mom2_pid)" ]; then
    # its own host name (UTS namespace) as well as its own address: what a job's `hostname` says on that node
    # shellcheck disable=SC2016  # expanded by that inner sh
    "${IN2[@]}" unshare --uts /bin/sh -c 'hostname "$1" && shift && exec "$@"' sh "$NODE2" \
      env PBS_CONF_FILE="$CONF2" /opt/pbs/sbin/pbs_mom
  fi
  qmgr1 "list node $NODE2" >/dev/null 2>&1 || qmgr1 "create node $NODE2"
  # the tier's qdel-in-state-E test: jobs named *slowexit* stay in E for 20 s (slow_end_hook.py)
  qmgr1 "list hook pbstk_slow_end" >/dev/null 2>&1 || qmgr1 "create hook pbstk_slow_end event=execjob_end"
  qmgr1 "import hook pbstk_slow_end application/x-python default $HERE/slow_end_hook.py"
  qmgr1 "set node $NODE2 resources_available.ncpus = 64"
  qmgr1 "set node $NODE2 resources_available.ngpus = 8"
  for _ in $(seq 1 60); do
    "${IN1[@]}" /opt/pbs/bin/pbsnodes "$NODE2" 2>/dev/null | grep -q 'state = free' && break
    sleep 1
  done
  "${IN1[@]}" /opt/pbs/bin/pbsnodes -a | grep -E '^[^ ]|state = '
}

down() {
  qmgr1 "delete hook pbstk_slow_end" >/dev/null 2>&1 || true
  if "${IN1[@]}" /opt/pbs/bin/qmgr -c "list node $NODE2" >/dev/null 2>&1; then
    qmgr1 "delete node $NODE2" || true
  fi
  local pid
  pid=$(mom2_pid || true)
  if [ -n "$pid" ]; then
    kill -TERM "$pid"
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  fi
  ip netns list | grep -qw "$NS2" && ip netns del "$NS2"  # takes the veth pair (p2a too) with it
  rm -rf "/etc/netns/$NS2" "$CONF2" "$HOME2"
  set_node2_line remove
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 [up|down]" >&2; exit 2 ;;
esac
