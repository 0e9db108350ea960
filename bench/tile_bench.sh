#!/usr/bin/env bash
# slide-tile against the CLAM-style Python peer (../shared/peers/tile_peer.py) on a gigapixel slide,
# in one run: tiles/s and peak RSS of each, the ratios, and the decode+encode ceiling.
#
# usage: bench/tile_bench.sh [BIG_SLIDE.tif]   (default: builds one with make-big-slide.sh in a temp dir)
# needs: scripts/install-deps.sh --bench, and a build in build/
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
shared=${SLIDE_SHARED:-$here/../shared}
bin=$here/build/apps/slide-tile
limit=$here/build/bench/jpeg_limit
threads=${THREADS:-2}
work=$(mktemp -d "${TMPDIR:-/tmp}/slide_bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
slide=${1:-}
if [[ -z "$slide" ]]; then
  slide=$work/big.tif
  "$shared/tools/make-big-slide.sh" "$slide" >/dev/null
fi
echo "slide: $slide ($(du -h "$slide" | cut -f1)), tile 256 px, quality 90, min tissue 0.5, threads $threads"

# Runs a command under GNU time; prints "<stdout last line> peak_rss_mb=<MB>".
measure() {
  local out rss
  out=$(/usr/bin/time -f "%M" -o "$work/time.txt" "$@" 2>"$work/stderr.txt" | tail -n 1) || { cat "$work/stderr.txt" >&2; return 1; }
  rss=$(( $(tail -n 1 "$work/time.txt") / 1024 ))
  echo "$out peak_rss_mb=$rss"
}
# Our tool prints its summary on stderr; turn it into the peer's "tiles= seconds= tiles_per_s=" line.
# The pass-through store is kept: the ceiling decodes and encodes exactly its tiles.
ours() {
  local store=$work/ours_$1; shift
  /usr/bin/time -f "%M" -o "$work/time.txt" "$bin" "$slide" --mpp 0.499 --tile-size 256 --jpeg-quality 90 \
    --min-tissue 0.5 --threads "$threads" -q -o "$store" "$@" 2>"$work/stderr.txt" || { cat "$work/stderr.txt" >&2; return 1; }
  local line tiles secs
  line=$(grep '^summary:' "$work/stderr.txt")
  tiles=$(sed -E 's/.* ([0-9]+) tiles written in ([0-9.e+]+) s.*/\1/' <<<"$line")
  secs=$(sed -E 's/.* ([0-9]+) tiles written in ([0-9.e+]+) s.*/\2/' <<<"$line")
  awk -v n="$tiles" -v s="$secs" -v m="$(tail -n 1 "$work/time.txt")" \
    'BEGIN { printf "tiles=%d seconds=%.2f tiles_per_s=%.1f peak_rss_mb=%d\n", n, s, n / s, m / 1024 }'
}
rate() { sed -E 's/.*tiles_per_s=([0-9.]+).*/\1/' <<<"$1"; }

peer=$(measure /usr/bin/python3 "$shared/peers/tile_peer.py" "$slide" "$work/peer.lmdb" --tile 256 --min-tissue 0.5 --quality 90)
rm -rf "$work/peer.lmdb"
reenc=$(ours reencode --no-passthrough)
rm -rf "$work/ours_reencode"
pass=$(ours passthrough)
# The same tiles slide-tile kept (blank glass would make a flattering ceiling).
ceiling=$("$limit" "$slide" --threads "$threads" --quality 90 --store "$work/ours_passthrough")
rm -rf "$work/ours_passthrough"

printf '%-34s %s\n' "peer (tile_peer.py, 1 thread)" "$peer"
printf '%-34s %s\n' "slide-tile re-encode" "$reenc"
printf '%-34s %s\n' "slide-tile pass-through" "$pass"
printf '%-34s %s\n' "decode+encode ceiling" "$ceiling"
awk -v p="$(rate "$peer")" -v r="$(rate "$reenc")" -v t="$(rate "$pass")" -v c="$(rate "$ceiling")" 'BEGIN {
  printf "ratio re-encode / peer        %.2fx (target >= 2.5x)\n", r / p
  printf "ratio re-encode / ceiling     %.0f%% (target >= 80%%)\n", 100 * r / c
  printf "ratio pass-through / peer     %.2fx (target >= 10x)\n", t / p
}'
