#!/usr/bin/env bash
# A test cluster on one machine: N "hosts" as Linux network namespaces, each
# with its own loopback and one interface, eth0, at 198.18.0.I/24 (I = 1..N,
# from the benchmarking range 198.18.0.0/15), all joined by a bridge that
# lives in a namespace of its own. Nothing is added to the machine's own
# network namespace, so no traffic can leave the machine and the machine's
# own addresses are out of the hosts' reach.
#
#   scripts/netns-cluster.sh up N [PREFIX]    make hosts PREFIX-h1..PREFIX-hN
#   scripts/netns-cluster.sh down [PREFIX]    remove them (and their bridge)
#   scripts/netns-cluster.sh exec I CMD...    run CMD on host I (as `ip netns
#                                             exec PREFIX-hI CMD...`; the
#                                             prefix from $KUNGFU_NETNS_PREFIX)
#   scripts/netns-cluster.sh check            exit 0 if namespaces can be made
#
# PREFIX (default: $KUNGFU_NETNS_PREFIX, else "kf") names the namespaces, so
# that clusters of tests that run at the same time do not meet: every
# cluster has the same addresses, but on a bridge of its own.
#
# Needs root (CI and these machines run as root) and iproute2. Shared memory
# works within a host as on any machine, and each host has a /dev/shm of its
# own (a tmpfs under /run/kungfu-netns, mounted over /dev/shm for whatever
# `exec` runs there), as real machines do; the rest of the file system is
# shared. TCP goes between hosts over the bridge, as across real machines.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

ns_of() { echo "$1-h$2"; }

# where each host's /dev/shm lives
shm_root=/run/kungfu-netns

up() {
  local n=$1 p=$2
  [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 250)) || {
    echo "netns-cluster: N must be 1..250, not '$n'" >&2
    exit 2
  }
  if ip netns list | grep -q "^$p-"; then
    echo "netns-cluster: namespaces named $p-* exist already (down $p first)" >&2
    exit 1
  fi
  local sw="$p-sw"
  # a step that fails leaves nothing behind
  trap 'down "$p"' ERR
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  for ((i = 1; i <= n; i++)); do
    local h
    h=$(ns_of "$p" "$i")
    ip netns add "$h"
    ip -n "$h" link set lo up
    # eth0 in the host, its other end hI on the switch's bridge
    ip -n "$h" link add eth0 type veth peer name "h$i" netns "$sw"
    ip -n "$sw" link set "h$i" master br0 up
    ip -n "$h" addr add "198.18.0.$i/24" dev eth0
    ip -n "$h" link set eth0 up
    mkdir -p "$shm_root/$h"
    mount -t tmpfs -o mode=1777 "kungfu-$h" "$shm_root/$h"
  done
  # a veth pair carries traffic once both ends are up, and the bridge
  # (without STP) forwards from its ports' first frame: wait for the links
  local h i
  for ((i = 1; i <= n; i++)); do
    h=$(ns_of "$p" "$i")
    for _ in $(seq 50); do
      ip -n "$h" -o link show eth0 | grep -q 'state UP' && continue 2
      sleep 0.1
    done
    echo "netns-cluster: eth0 of $h did not come up" >&2
    down "$p"
    exit 1
  done
  trap - ERR
  echo "netns-cluster: $n hosts up: $(ns_of "$p" 1) (198.18.0.1) .. $(ns_of "$p" "$n") (198.18.0.$n)"
}

down() {
  local p=$1 ns
  for ns in $(ip netns list | awk '{print $1}' | grep "^$p-\(h[0-9]*\|sw\)$" || true); do
    # a process left in a namespace keeps its interfaces, not the name
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns del "$ns"
  done
  for ns in $(ls "$shm_root" 2>/dev/null | grep "^$p-h[0-9]*$" || true); do
    umount -l "$shm_root/$ns" 2>/dev/null || true
    rmdir "$shm_root/$ns" 2>/dev/null || true
  done
}

check() {
  [ "$(id -u)" = 0 ] || {
    echo "netns-cluster: needs root (to make network namespaces)" >&2
    exit 1
  }
  command -v ip >/dev/null || {
    echo "netns-cluster: needs iproute2 (ip)" >&2
    exit 1
  }
  local probe="kfprobe$$"
  if ! ip netns add "$probe" 2>/dev/null; then
    echo "netns-cluster: cannot make a network namespace here" >&2
    exit 1
  fi
  local ok=0
  ip -n "$probe" link add eth0 type veth peer name eth1 2>/dev/null || ok=1
  ip netns del "$probe"
  ((ok == 0)) || {
    echo "netns-cluster: cannot make veth pairs here" >&2
    exit 1
  }
}

cmd=${1:-}
shift || true
prefix_default=${KUNGFU_NETNS_PREFIX:-kf}
case "$cmd" in
  up)
    (($# >= 1)) || usage
    check
    up "$1" "${2:-$prefix_default}"
    ;;
  down) down "${1:-$prefix_default}" ;;
  exec)
    (($# >= 2)) || usage
    i=$1
    shift
    h=$(ns_of "$prefix_default" "$i")
    # the host's own /dev/shm, in the mount namespace ip netns exec makes
    exec ip netns exec "$h" sh -c 'mount --bind "$0" /dev/shm && exec "$@"' "$shm_root/$h" "$@"
    ;;
  check) check ;;
  *) usage ;;
esac
