#!/usr/bin/env bash
# Issue 14's GPU figure: slide-embed --model uni (ViT-L/16, 224 px, 1024-d class token) end to end
# from a store, tiles/s at each precision, on the GPU (BACKEND=cuda, the default) or any backend.
# UNI's published weights are gated, and the speed does not depend on their values: the weight
# file is random, in timm's layout at UNI's shapes (bench/random_vit_weights.py). The store is
# sample_data's CMU-1-Small-Region.svs listed COPIES times (default 6) in a manifest, tiled at
# 0.5 µm/px, 224 px, with tile origins STRIDE px apart (default 32: 1966 tissue tiles a copy, the
# thousands of a whole slide). The first H200 run (50 copies of 43 tiles, STRIDE=224) measured 470
# tiles/s at tf32, bf16 and fp16 alike. Not the host side: slide-embed with a trivial ViT (width 16,
# depth 1) on those stores runs 2600 tiles/s on 2 cores, per-slide work included. Most likely the
# precision: activations and weights stay f32 at every --precision (issue 11 item 6), so cuBLAS's
# bf16 and fp16 compute types read the same f32 bytes as TF32.
#   [BACKEND=cuda] [PRECISIONS="fp32 tf32 bf16 fp16"] [COPIES=6] [STRIDE=32] [BATCH=64] bench/uni_gpu_embed.sh [BUILD_DIR]
# Prints one line per precision: tiles, seconds, tiles/s (slide-embed's own summary).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
backend=${BACKEND:-cuda}
copies=${COPIES:-6}
stride=${STRIDE:-32}
batch=${BATCH:-64}
precisions=${PRECISIONS:-fp32 tf32 bf16 fp16}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=${PYTHON:-python3}

"$py" "$here/bench/random_vit_weights.py" uni "$tmp/uni.safetensors"
slide=$here/sample_data/slides/CMU-1-Small-Region.svs
{
  echo "slide_id,path"
  for i in $(seq 1 "$copies"); do echo "cmu1-copy$i,$slide"; done
} > "$tmp/slides.csv"
"$build/apps/slide-tile" --manifest "$tmp/slides.csv" -o "$tmp/store" --mpp 0.5 --tile-size 224 --stride "$stride" -q
for p in $precisions; do
  log=$tmp/embed-$p.jsonl
  "$build/apps/slide-embed" "$tmp/store" -o "$tmp/bags-$p" --model uni --weights "$tmp/uni.safetensors" \
    --backend "$backend" --precision "$p" --batch-size "$batch" --log-json 2> "$log" > /dev/null ||
    { echo "uni $backend $p: slide-embed failed:"; tail -3 "$log"; continue; }
  "$py" - "$log" "$backend" "$p" <<'EOF'
import json, sys
log, backend, precision = sys.argv[1:4]
for line in open(log):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if r.get("msg") == "summary" or r.get("event") == "summary" or "tiles_per_s" in r:
        f = r.get("fields", r)
        print("uni (ViT-L/16) %s %s: %s tiles in %.1f s, %.1f tiles/s" % (
            backend, precision, f.get("tiles"), float(f.get("seconds", 0)), float(f.get("tiles_per_s", 0))))
EOF
done
