#!/usr/bin/env bash
# slide-train evaluate: the fused inference path (embed.h's FeatureExtractor cut at "fc": batch norm
# folded into the convolutions, ReLU and residual adds fused, blocked layouts; the default) beside
# the training engine's forward in inference mode (--no-fused), in one run: ResNet-18 on the
# LC25000 lung subset (360 patches) at 224 px, batch 32, end to end (LMDB read + JPEG decode on
# the pool + forward + softmax and metrics), tiles/s of each and the ratio. The checkpoint is a
# 1-epoch run on 36 of the patches (the weights do not matter for speed). Both paths must report
# the same accuracy (checked). The two run alternately, ROUNDS times; medians are printed.
#
# usage: [ROUNDS=3] bench/evaluate_bench.sh   (needs slide-tile and slide-train in $BUILD (default build/);
#        figures from a loaded machine are noise: the load average is printed with them)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build}
threads=${THREADS:-2}
rounds=${ROUNDS:-3}
export OMP_NUM_THREADS=$threads
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
lc=$here/sample_data/patches/lc25000-lung-subset
for c in lung_aca lung_n lung_scc; do
  mkdir -p "$tmp/few/$c"
  ls "$lc/$c" | sort | head -12 | while read -r f; do ln -s "$lc/$c/$f" "$tmp/few/$c/$f"; done
done
"$build/apps/slide-tile" --patches "$lc" --tile-size 224 -o "$tmp/store" -q >/dev/null 2>&1
"$build/apps/slide-tile" --patches "$tmp/few" --tile-size 224 -o "$tmp/few_store" -q >/dev/null 2>&1
"$build/apps/slide-train" --data "$tmp/few_store" --out "$tmp/run" --model resnet18 --epochs 1 --batch-size 12 \
  --threads "$threads" -q >/dev/null 2>&1
ckpt=$tmp/run/checkpoints/epoch-1-step-0
echo "threads $threads; rounds $rounds; load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
run() {  # $1: out dir, then extra flags; prints tiles_per_s accuracy
  "$build/apps/slide-train" --threads "$threads" --batch-size 32 -q evaluate --checkpoint "$ckpt" --data "$tmp/store" \
    --out "$1" "${@:2}"
  /usr/bin/python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); print(m["tiles_per_s"], m["accuracy"], m["inference"])' "$1/metrics.json"
}
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
fused=(); engine=()
for ((r = 1; r <= rounds; ++r)); do  # alternately: this host drifts by tens of percent
  read -r f fa fi < <(run "$tmp/fused")
  read -r e ea ei < <(run "$tmp/engine" --no-fused)
  [ "$fi" = fused ] && [ "$ei" = engine ] || { echo "paths not as asked: $fi $ei" >&2; exit 1; }
  [ "$fa" = "$ea" ] || { echo "accuracy differs: fused $fa, engine $ea" >&2; exit 1; }
  printf '  round %d: fused %6.2f tiles/s, engine %6.2f tiles/s\n' "$r" "$f" "$e"
  fused+=("$f"); engine+=("$e")
done
f=$(printf '%s\n' "${fused[@]}" | median); e=$(printf '%s\n' "${engine[@]}" | median)
printf 'evaluate  resnet18 224px  fused %6.2f tiles/s   engine (--no-fused) %6.2f tiles/s   ratio %.2fx   (medians; accuracy %s both; load average after: %s)\n' \
  "$f" "$e" "$(awk -v a="$f" -v b="$e" 'BEGIN{print a/b}')" "$fa" "$(cut -d' ' -f1-3 /proc/loadavg)"
