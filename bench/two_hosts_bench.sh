#!/usr/bin/env bash
# Data-parallel training across two hosts on a slow link (issue 21, item 4): the images/s that
# 2 ranks on the two-host rig (tests/dist/two_hosts.sh) keep when the link between them is limited
# to RATE, against the same run with the link unlimited, side by side in one run. Each rank has
# one oneDNN thread; the gradient all-reduce (ResNet-18: 44.7 MB a step) crosses the veth.
#
# usage: bench/two_hosts_bench.sh [RATE [MODEL [TILE_PX [BATCH]]]]
#        defaults: 1gbit resnet18 64 32. Needs root (network namespaces); build/ built.
# BENCH_MPIRUN_ARGS: more mpirun options, e.g. "-x SLIDE_ALLREDUCE_RING_MIN=999999999999" (no ring).
# BENCH_TRAIN_ARGS: more slide-train options, e.g. "--bucket-mb 5".
# Prints, per link: the second epoch's images/s and all-reduce seconds (the first warms up), then
# the fraction kept, then the slow link's all-reduce timeline over the second epoch's steps
# (slide-train --dist-timeline, summarised by bench/timeline_summary.py): when each bucket started
# and completed against the end of backward.
set -euo pipefail
cd "$(dirname "$0")/.."
rate="${1:-1gbit}" model="${2:-resnet18}" px="${3:-64}" batch="${4:-32}"
export SLIDE_TWO_HOSTS=slidebench OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_hwloc_base_binding_policy=none OMP_NUM_THREADS=1
work="$(mktemp -d /tmp/two_hosts_bench.XXXXXX)"
trap 'tests/dist/two_hosts.sh down; rm -rf "$work"' EXIT
build/apps/slide-tile --patches sample_data/patches/lc25000-lung-subset --tile-size "$px" -o "$work/store" -q

run() {  # $1: label, $2: rate ("" = unlimited)
  tests/dist/two_hosts.sh up $2 2>/dev/null
  local log="$work/$1.log"
  tests/dist/two_hosts.sh mpirun ${BENCH_MPIRUN_ARGS:-} -np 2 build/apps/slide-train --data "$work/store" --out "$work/$1" \
    --model "$model" --batch-size "$batch" --epochs 2 --threads 1 --compute-threads 1 --cache ram \
    --no-augment --seed 1 --dist-timeline "$work/$1.timeline.csv" ${BENCH_TRAIN_ARGS:-} 2> "$log" > /dev/null
  local line
  line="$(grep ' epoch=2 ' "$log")"
  local ips ars
  ips="$(sed -E 's/.*images_per_s=([0-9.]+).*/\1/' <<<"$line")"
  ars="$(sed -E 's/.*all_reduce_s=([0-9.]+).*/\1/' <<<"$line")"
  printf '%-12s %12s %14s\n' "$1" "$ips" "$ars" >&2
  echo "$ips"
}
printf '%-12s %12s %14s\n' "link" "images/s" "all-reduce s" >&2
fast="$(run unlimited "")"
slow="$(run "$rate" "$rate")"
awk -v f="$fast" -v s="$slow" -v r="$rate" 'BEGIN { printf "kept at %s: %.0f%% of the unlimited images/s\n", r, 100 * s / f }'
steps="$(awk -F, 'NR > 1 { if ($1 > m) m = $1 } END { print m }' "$work/$rate.timeline.csv")"
echo "all-reduce timeline at $rate, second epoch:"
/usr/bin/python3 bench/timeline_summary.py "$work/$rate.timeline.csv" --from-step $((steps / 2 + 1))
