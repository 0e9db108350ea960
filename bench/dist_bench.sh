#!/usr/bin/env bash
# Data-parallel scaling on this machine (2 cores), in one run: training images/s of slide-train with
# 1 rank x 2 threads against 2 ranks x 1 thread (mpirun, the same global batch), the time each
# step spends in the gradient all-reduce (waiting for the slower rank included), and the same two
# layouts for PyTorch DDP (gloo; bench/ddp_peer.py); then the all-reduce alone, ours against a
# blocking MPI_Allreduce (bench/allreduce_bench.cpp). Efficiency = images/s of 2 ranks x 1 thread /
# images/s of 1 rank x 2 threads (the same cores, so 1.0 is perfect scaling).
# Ours: the real LC25000 lung patches (sample_data, 360 tiles) at SIZE px, decoded once into RAM,
# timed over the second epoch (the first warms the allocator). The peer: random tiles.
#
# usage: bench/dist_bench.sh   (needs a build in $BUILD, default build/, with MPI; Debian's
#        python3-torch and python3-torchvision; MODEL, SIZE, BATCH override resnet18, 112, 32)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build}
model=${MODEL:-resnet18}; size=${SIZE:-112}; batch=${BATCH:-32}
# Root in a container; no core binding (1 rank x 2 threads needs both cores). Shared-memory
# single copy (CMA) stays on: where ptrace is forbidden, add OMPI_MCA_btl_vader_single_copy_mechanism=none.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  OMPI_MCA_hwloc_base_binding_policy=none
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$build/apps/slide-tile" --patches "$here/sample_data/patches/lc25000-lung-subset" --tile-size "$size" \
  -o "$tmp/lc" -q >/dev/null 2>&1

# ours RANKS THREADS [slide-train options] -> "images_per_s all_reduce_ms_per_step step_ms"
ours() {
  local out="$tmp/run_$1x$2${3:-}"
  OMP_NUM_THREADS=$2 mpirun -np "$1" "$build/apps/slide-train" --data "$tmp/lc" --val-fraction 0 --model "$model" \
    --batch-size "$batch" --epochs 2 --threads 1 --cache ram --no-augment --out "$out" --log-json "${@:3}" \
    2>"$out.log" >/dev/null
  /usr/bin/python3 - "$out.log" "$batch" <<'PY'
import json, math, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
start = next(r for r in recs if r["msg"] == "training")
steps, tiles = int(start["steps_per_epoch"]), int(start["train_tiles"])
e = [r for r in recs if r["msg"] == "epoch"][-1]
ips, ar = float(e["images_per_s"]), float(e["all_reduce_s"])
print("%.2f %.1f %.1f" % (ips, 1000 * ar / steps, 1000 * tiles / ips / steps))
PY
}
peer() { /usr/bin/python3 "$here/bench/ddp_peer.py" --ranks "$1" --threads "$2" --model "$model" --batch "$batch" \
           --size "$size" --steps 6 | sed -E 's/.*images_per_s=([0-9.]+).*/\1/'; }

read -r o1 _ s1 <<<"$(ours 1 2)"
read -r o2 ar2 s2 <<<"$(ours 2 1)"
read -r o3 ar3 s3 <<<"$(ours 2 1 --no-overlap)"
p1=$(peer 1 2); p2=$(peer 2 1)
params=$(/usr/bin/python3 -c "import torchvision; m=torchvision.models.$model(num_classes=3); print(sum(p.numel() for p in m.parameters()))")
echo "$model ${size}px, global batch $batch, $(nproc) cores; gradient all-reduce $(awk -v p="$params" 'BEGIN{printf "%.1f MB", p*4/1e6}') per step"
printf '%-22s %12s %12s %10s\n' "" "slide-train" "pytorch DDP" "ratio"
printf '%-22s %8.2f img/s %8.2f img/s %9.2fx\n' "1 rank x 2 threads" "$o1" "$p1" "$(awk -v a="$o1" -v b="$p1" 'BEGIN{print a/b}')"
printf '%-22s %8.2f img/s %8.2f img/s %9.2fx\n' "2 ranks x 1 thread" "$o2" "$p2" "$(awk -v a="$o2" -v b="$p2" 'BEGIN{print a/b}')"
printf '%-22s %12.2f %12.2f\n' "scaling efficiency" "$(awk -v a="$o2" -v b="$o1" 'BEGIN{print a/b}')" \
  "$(awk -v a="$p2" -v b="$p1" 'BEGIN{print a/b}')"
printf 'slide-train 2 ranks: step %.0f ms, of which %.1f ms (%.1f%%) in the gradient all-reduce (1 rank x 2 threads: step %.0f ms)\n' \
  "$s2" "$ar2" "$(awk -v a="$ar2" -v b="$s2" 'BEGIN{print 100*a/b}')" "$s1"
printf 'slide-train 2 ranks, buckets all-reduced after backward (--no-overlap): %.2f img/s, step %.0f ms, %.1f ms waiting in the all-reduce (overlap: %.2fx the images/s)\n' \
  "$o3" "$s3" "$ar3" "$(awk -v a="$o2" -v b="$o3" 'BEGIN{print a/b}')"
echo "the all-reduce alone (OMP_NUM_THREADS=1):"
OMP_NUM_THREADS=1 mpirun -np 2 "$build/bench/allreduce_bench"
