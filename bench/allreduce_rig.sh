#!/usr/bin/env bash
# The ring all-reduce on the two-host rig (tests/dist/two_hosts.sh) at two link speeds, against the
# cost model of bench/allreduce_model.py (issue 21, items 3 and 5): for each RATE, 2 ranks across
# the namespaces run build/bench/allreduce_bench (our Communicator: the ring from 4 MiB, and Open
# MPI's blocking MPI_Allreduce; each figure the median of 10 after a warm-up); then the model's
# time at line rate for the same sizes, and the fraction of it reached. Also a plain TCP stream in
# both directions at once (Python sockets, 24 MB, median of 10): what this host moves through the
# veth at all. Needs root (network namespaces); build/ built.
#
# usage: bench/allreduce_rig.sh [RATE...]   (default: 1gbit 10gbit)
# BENCH_MPIRUN_ARGS: more mpirun options (e.g. "--mca btl_tcp_flags send,put,inplace,need-ack,need-csum,hetero-rdma",
# Open MPI's default, which slide-train replaces: set_mpi_transport_defaults).
set -euo pipefail
cd "$(dirname "$0")/.."
export SLIDE_TWO_HOSTS=slidebench OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_hwloc_base_binding_policy=none
work="$(mktemp -d /tmp/allreduce_rig.XXXXXX)"
trap 'tests/dist/two_hosts.sh down; rm -rf "$work"' EXIT
rates=("$@")
[ ${#rates[@]} -gt 0 ] || rates=(1gbit 10gbit)
floats=(1048576 6000000 11180000)  # 4.2, 24 and 44.7 MB (ResNet-18's gradients)
cat > "$work/tcp.py" <<'PY'
import socket, statistics, sys, threading, time
N = 24_000_000
buf = bytes(N)
def recv(s):
    got, mv = 0, bytearray(1 << 20)
    while got < N:
        r = s.recv_into(mv, min(len(mv), N - got))
        if r == 0:
            sys.exit("eof")
        got += r
def both_ways(s):
    t = threading.Thread(target=s.sendall, args=(buf,))
    t.start()
    recv(s)
    t.join()
if sys.argv[1] == "server":
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("10.77.0.2", 5555))
    ls.listen(1)
    s, _ = ls.accept()
    for _ in range(11):
        both_ways(s)
else:
    for _ in range(50):
        try:
            s = socket.create_connection(("10.77.0.2", 5555))
            break
        except OSError:
            time.sleep(0.1)
    ms = []
    for _ in range(11):
        t0 = time.perf_counter()
        both_ways(s)
        ms.append(1000 * (time.perf_counter() - t0))
    print("%.2f" % statistics.median(ms[1:]))
PY
: > "$work/measured"
for rate in "${rates[@]}"; do
  tests/dist/two_hosts.sh up "$rate" 2>/dev/null
  gbits="$(awk -v r="$rate" 'BEGIN { v = r + 0; if (r ~ /gbit$/) print v; else if (r ~ /mbit$/) print v / 1000; else print v }')"
  ip netns exec slidebench_h2 /usr/bin/python3 "$work/tcp.py" server &
  tcp_ms="$(ip netns exec slidebench_h1 /usr/bin/python3 "$work/tcp.py" client)"
  wait
  echo "== $rate: plain TCP, 24 MB each way at once: $tcp_ms ms ($(awk -v t="$tcp_ms" -v g="$gbits" 'BEGIN { printf "%.0f", 100 * 24e6 * 8 / (g * 1e9) / (t / 1000) }')% of the link)"
  tests/dist/two_hosts.sh mpirun ${BENCH_MPIRUN_ARGS:-} -np 2 build/bench/allreduce_bench "${floats[@]}" | tee "$work/out"
  awk -v g="$gbits" '$1 ~ /^[0-9]+$/ && NF == 5 { printf "2 %s %d %s\n", g, $1 * 4, $2 }' "$work/out" >> "$work/measured"
done
echo "== the ring model at line rate (bench/allreduce_model.py --rig), against our all-reduce:"
/usr/bin/python3 bench/allreduce_model.py --rig "$work/measured" --net-alpha-us 50
