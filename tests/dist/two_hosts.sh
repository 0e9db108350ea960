#!/usr/bin/env bash
# Two simulated hosts on this machine, for testing slide-train's ranks across a network (issue 21):
# two network namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2), each process run in it
# also given a UTS namespace with its own host name, so Open MPI sees two nodes (its shared-memory
# transport and session directories are per host name) and talks TCP between them over the veth.
# mpirun runs in the first namespace and starts its daemon on the second through an rsh agent that
# enters that namespace (`ip netns exec`), where a cluster would use ssh.
#
#   tests/dist/two_hosts.sh up [RATE]     make the namespaces (RATE: a tc tbf limit on the link,
#                                         e.g. 1gbit; default none); removes stale ones first
#   tests/dist/two_hosts.sh mpirun ARGS   mpirun across the two hosts (--map-by node: rank r on
#                                         host r % 2), e.g. `mpirun -np 2 slide-train ...`
#   tests/dist/two_hosts.sh agent HOST CMD  the rsh agent mpirun calls (not for people)
#   tests/dist/two_hosts.sh down          remove everything (the namespaces take the veth along)
#
# Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2, util-linux, Open MPI. `up` exits 77 when
# namespaces cannot be made here (not root, no permission), which callers report as a skip.
# SLIDE_TWO_HOSTS names the namespaces (default slide2h), so two rigs can coexist.
set -euo pipefail

tag="${SLIDE_TWO_HOSTS:-slide2h}"
ns1="${tag}_h1" ns2="${tag}_h2"
addr1=10.77.0.1 addr2=10.77.0.2
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
state="${TMPDIR:-/tmp}/${tag}"

down() {
  ip netns del "$ns1" 2>/dev/null || true
  ip netns del "$ns2" 2>/dev/null || true
  rm -rf "$state"
}

case "${1:-}" in
  up)
    rate="${2:-}"
    down
    if ! ip netns add "$ns1" 2>/dev/null; then
      echo "two_hosts: cannot make network namespaces here (needs root and CAP_NET_ADMIN)" >&2
      exit 77
    fi
    ip netns add "$ns2"
    ip link add "${tag}_v1" type veth peer name "${tag}_v2"
    ip link set "${tag}_v1" netns "$ns1"
    ip link set "${tag}_v2" netns "$ns2"
    ip -n "$ns1" addr add "$addr1/24" dev "${tag}_v1"
    ip -n "$ns2" addr add "$addr2/24" dev "${tag}_v2"
    for n in "$ns1" "$ns2"; do ip -n "$n" link set lo up; done
    ip -n "$ns1" link set "${tag}_v1" up
    ip -n "$ns2" link set "${tag}_v2" up
    if [ -n "$rate" ]; then
      ip netns exec "$ns1" tc qdisc add dev "${tag}_v1" root tbf rate "$rate" burst 256kb latency 50ms
      ip netns exec "$ns2" tc qdisc add dev "${tag}_v2" root tbf rate "$rate" burst 256kb latency 50ms
    fi
    mkdir -p "$state"
    printf '%s slots=2\n%s slots=2\n' "$addr1" "$addr2" > "$state/hosts"
    echo "two_hosts: $ns1 ($addr1) and $ns2 ($addr2) up${rate:+, link limited to $rate}" >&2
    ;;
  agent)
    # mpirun calls: agent HOST COMMAND... (as ssh would be called); the command is one shell line.
    host="$2"
    shift 2
    case "$host" in
      "$addr1") n="$ns1" ;;
      "$addr2") n="$ns2" ;;
      *) echo "two_hosts agent: unknown host $host" >&2; exit 1 ;;
    esac
    exec ip netns exec "$n" unshare --uts /bin/sh -c "hostname ${n//_/-} && $*"
    ;;
  mpirun)
    shift
    [ -f "$state/hosts" ] || { echo "two_hosts: not up (run: $0 up)" >&2; exit 1; }
    exec ip netns exec "$ns1" unshare --uts /bin/sh -c 'hostname "$0" && exec mpirun "$@"' \
      "${ns1//_/-}" --hostfile "$state/hosts" --map-by node --oversubscribe \
      --mca plm_rsh_agent "$self agent" \
      --mca btl tcp,vader,self --mca btl_vader_single_copy_mechanism none \
      --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 "$@"
    ;;
  down)
    down
    ;;
  *)
    sed -n '2,20p' "$0" >&2
    exit 2
    ;;
esac
