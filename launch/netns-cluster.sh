#!/usr/bin/env bash
# An emulated multi-host cluster on one machine: K network namespaces joined by veth pairs to a bridge
# that lives in a namespace of its own, each link shaped with tc (rate, optional delay), each host with
# its own name and address.  Only namespaces and addresses this script creates are touched.
#
#   launch/netns-cluster.sh up K [--rate 1gbit|none] [--delay 0ms] [--prefix tg] [--subnet 10.77.0]
#   launch/netns-cluster.sh hosts [--prefix tg] [--slots K]  # prints host:K,host:K,... for -H (K = 1)
#   launch/netns-cluster.sh exec HOST CMD...           # run a command inside a host
#   launch/netns-cluster.sh counters [--prefix tg] [--since FILE]  # bytes sent/received by each host's eth0
#   launch/netns-cluster.sh down [--prefix tg]
#
# Hosts are PREFIX-h0 .. PREFIX-h{K-1} at SUBNET.1 .. SUBNET.K; the bridge is in PREFIX-sw.  Every host's
# eth0 is shaped on egress, and its switch port on egress towards the host, so each direction of each
# link is limited to RATE (a full-duplex NIC).  Inside a host, /etc/hosts lists every host (ip netns exec
# bind-mounts /etc/netns/NAME/hosts).  mpirun reaches the hosts through launch/netns-rsh.
# Several ranks per host (hosts --slots 2): traffic between ranks of one host never touches eth0 (Open MPI's
# shared-memory btl; gloo/TCP to the host's own address is delivered through lo, unshaped), so eth0's
# counters are the bytes that cross that host's link.  counters > FILE saves a reading; counters --since FILE
# prints the bytes since then (the same format), e.g. around one run.
set -euo pipefail
cmd="${1:-}"; shift || true
prefix=tg; rate=1gbit; delay=""; subnet=10.77.0; k=""; slots=1; since=""
while (($#)); do
  case "$1" in
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --subnet) subnet="$2"; shift 2 ;;
    --slots) slots="$2"; shift 2 ;;
    --since) since="$2"; shift 2 ;;
    *) if [ -z "$k" ] && [[ "$1" =~ ^[0-9]+$ ]] && [ "$cmd" = up ]; then k="$1"; shift; else break; fi ;;
  esac
done
[[ "$prefix" =~ ^[a-z][a-z0-9]{0,7}$ ]] || { echo "netns-cluster: --prefix must be 1-8 lowercase letters/digits" >&2; exit 2; }
[[ "$slots" =~ ^[1-9][0-9]{0,2}$ ]] || { echo "netns-cluster: --slots must be a rank count 1..999" >&2; exit 2; }
hosts_of() { ip netns list | awk '{print $1}' | grep -E "^${prefix}-h[0-9]+$" | sort -V; }
shape() {  # ns dev: rate limit (and delay) on the egress of dev; --rate none leaves the link unshaped
  local ns="$1" dev="$2"
  if [ "$rate" = none ]; then
    [ -z "$delay" ] || ip netns exec "$ns" tc qdisc replace dev "$dev" root netem delay "$delay"
    return 0
  fi
  if [ -n "$delay" ]; then
    ip netns exec "$ns" tc qdisc replace dev "$dev" root handle 1: netem delay "$delay"
    ip netns exec "$ns" tc qdisc replace dev "$dev" parent 1: handle 2: tbf rate "$rate" burst 256kb latency 100ms
  else
    ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$rate" burst 256kb latency 100ms
  fi
}
case "$cmd" in
  up)
    [[ "$k" =~ ^[0-9]+$ ]] && ((k >= 1 && k <= 200)) || { echo "netns-cluster: up needs a host count 1..200" >&2; exit 2; }
    [ -z "$(hosts_of)" ] || { echo "netns-cluster: cluster '$prefix' already exists (run down first)" >&2; exit 1; }
    sw="${prefix}-sw"
    ip netns add "$sw"
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    ip -n "$sw" link set lo up
    hostsfile=$(mktemp)
    printf '127.0.0.1 localhost\n' > "$hostsfile"
    for ((i = 0; i < k; i++)); do printf '%s.%d %s-h%d\n' "$subnet" $((i + 1)) "$prefix" "$i" >> "$hostsfile"; done
    for ((i = 0; i < k; i++)); do
      h="${prefix}-h$i"
      ip netns add "$h"
      ip -n "$h" link add eth0 type veth peer name "p$i" netns "$sw"
      ip -n "$h" addr add "$subnet.$((i + 1))/24" dev eth0
      ip -n "$h" link set lo up
      ip -n "$h" link set eth0 up
      ip -n "$sw" link set "p$i" master br0
      ip -n "$sw" link set "p$i" up
      shape "$h" eth0
      shape "$sw" "p$i"
      mkdir -p "/etc/netns/$h"
      cp "$hostsfile" "/etc/netns/$h/hosts"
    done
    rm -f "$hostsfile"
    echo "netns-cluster: $k hosts ${prefix}-h0..${prefix}-h$((k - 1)) on $subnet.0/24, links $rate${delay:+ delay $delay}"
    ;;
  hosts)
    hosts_of | sed "s/\$/:$slots/" | paste -sd, ;;
  exec)
    h="$1"; shift
    prefix="${h%-h*}"          # the host name says which cluster it belongs to
    hosts_of | grep -qx -- "$h" || { echo "netns-cluster: no host '$h' in cluster '$prefix'" >&2; exit 2; }
    exec ip netns exec "$h" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$h" "$@" ;;
  counters)
    [ -z "$since" ] || [ -r "$since" ] || { echo "netns-cluster: cannot read '$since'" >&2; exit 2; }
    for h in $(hosts_of); do
      tx=$(ip netns exec "$h" cat /sys/class/net/eth0/statistics/tx_bytes)
      rx=$(ip netns exec "$h" cat /sys/class/net/eth0/statistics/rx_bytes)
      if [ -n "$since" ]; then   # minus the reading saved in FILE (a host missing there counts from 0)
        read -r tx0 rx0 < <(awk -v h="$h" '$1 == h {sub("tx_bytes=", "", $2); sub("rx_bytes=", "", $3); print $2, $3}' "$since")
        tx=$((tx - ${tx0:-0})); rx=$((rx - ${rx0:-0})); tx0=""; rx0=""
      fi
      printf '%s tx_bytes=%s rx_bytes=%s\n' "$h" "$tx" "$rx"
    done ;;
  down)
    for h in $(hosts_of); do ip netns del "$h"; rm -rf "/etc/netns/$h"; done
    ip netns list | awk '{print $1}' | grep -qx "${prefix}-sw" && ip netns del "${prefix}-sw"
    echo "netns-cluster: '$prefix' removed" ;;
  *)
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
