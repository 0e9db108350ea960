#!/usr/bin/env bash
# Is the data path the bottleneck? slide-train end to end on a real store (the LC25000 lung
# subset, 360 patches, 224 px; one epoch of ResNet-18, batch 32: LMDB reads, JPEG decode on the
# --threads workers, flips/rotations, normalisation, prefetch one micro-batch ahead) with
# `--cache none` (decode every step) and `--cache ram` (decode once), beside the compute-only
# figure of the same step (bench/train_step on random tensors). The three run alternately, ROUNDS
# times (default 3), and the medians are printed. Both slide-train runs must give the same loss.
#
# usage: [ROUNDS=3] [THREADS=2] bench/train_e2e_bench.sh   (needs a build in $BUILD, default build/)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build}
threads=${THREADS:-2}
rounds=${ROUNDS:-3}
export OMP_NUM_THREADS=$threads
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$build/apps/slide-tile" --patches "$here/sample_data/patches/lc25000-lung-subset" --tile-size 224 -o "$tmp/store" -q \
  >/dev/null 2>&1
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
e2e() {  # $1: cache mode; prints "img/s loss" of the epoch
  rm -rf "$tmp/run"
  "$build/apps/slide-train" --data "$tmp/store" --out "$tmp/run" --model resnet18 --epochs 1 --batch-size 32 \
    --threads "$threads" --cache "$1" 2>&1 | sed -nE 's/.*epoch 1\/1: [0-9]+ in [0-9.]+ s \(([0-9.]+) img\/s.*loss ([0-9.]+)\).*/\1 \2/p'
}
none=(); ram=(); compute=()
for ((r = 1; r <= rounds; ++r)); do
  read -r n nl < <(e2e none)
  read -r m ml < <(e2e ram)
  c=$("$build/bench/train_step" --model resnet18 --batch 32 --size 224 --steps 4 | sed -E 's/.*images_per_s=([0-9.]+).*/\1/')
  [ "$nl" = "$ml" ] || { echo "the loss differs between --cache none ($nl) and ram ($ml)" >&2; exit 1; }
  printf '  round %d: --cache none %6.2f img/s, --cache ram %6.2f img/s, compute only %6.2f img/s (loss %s both)\n' \
    "$r" "$n" "$m" "$c" "$nl"
  none+=("$n"); ram+=("$m"); compute+=("$c")
done
n=$(printf '%s\n' "${none[@]}" | median); m=$(printf '%s\n' "${ram[@]}" | median)
c=$(printf '%s\n' "${compute[@]}" | median)
printf 'resnet18 224px batch 32, %s threads: --cache none %.2f img/s (%.0f%% of compute only), --cache ram %.2f img/s (%.0f%%), compute only %.2f img/s\n' \
  "$threads" "$n" "$(awk -v a="$n" -v b="$c" 'BEGIN{print 100*a/b}')" "$m" "$(awk -v a="$m" -v b="$c" 'BEGIN{print 100*a/b}')" "$c"
