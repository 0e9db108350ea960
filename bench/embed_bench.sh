#!/usr/bin/env bash
# slide-embed against PyTorch on the CPU (../shared/peers/torch_peer.py embed --model resnet50: CLAM's
# truncated ResNet-50, layer3 + global average pooling, 1024-d), in one run, same thread count:
#  1. compute only: 224-px tiles, batch 32, tiles/s of each and the ratio (target >= 2x), and the
#     fraction of the machine's measured FP32 peak (oneDNN sgemm on the same threads) each reaches;
#  2. Vision Transformers (ViT-B/16, ViT-L/16), compute only, against torchvision's on the same threads;
#  3. bf16 on CPUs with bf16 instructions: ours at --precision bf16 against ours at fp32 and PyTorch's
#     autocast bf16 (bench/torch_bf16_peer.py);
#  4. end to end from a store (LMDB read + JPEG decode on worker threads + forward + HDF5 bags):
#     CMU-1-Small-Region tiled at 0.5 um/px into 224-px tiles, slide-embed's tiles/s and peak RSS.
#
# usage: bench/embed_bench.sh   (needs a build in $BUILD (default build/) and Debian's python3-torch
#        python3-torchvision; the machine should be otherwise idle: figures from a loaded machine are noise)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build}
shared=${SLIDE_SHARED:-$here/../shared}
threads=${THREADS:-2}
export OMP_NUM_THREADS=$threads
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "threads $threads; load average $(cut -d' ' -f1-3 /proc/loadavg)"
peak=$("$build/bench/sgemm_peak" | sed -E 's/.*gflops=([0-9.]+).*/\1/')
echo "sgemm peak ${peak} GFLOP/s"
# Multiply-adds per 224-px image of ResNet-50 up to layer3: torchvision's 4.09G for the whole model
# less layer4 (0.81G, counted conv by conv) and fc.
gmacs=3.28
ours=$("$build/bench/embed_step" --model resnet50 --batch 32 --size 224 --steps 4)
peer=$(/usr/bin/python3 "$shared/peers/torch_peer.py" embed --model resnet50 --batch 32 --size 224 \
         --threads "$threads" --steps 4)
o=$(sed -E 's/.*images_per_s=([0-9.]+).*/\1/' <<<"$ours"); p=$(sed -E 's/.*images_per_s=([0-9.]+).*/\1/' <<<"$peer")
printf 'compute   resnet50/layer3  slide-embed %7.2f tiles/s   pytorch %7.2f tiles/s   ratio %.2fx (target >= 2x)   of peak: %4.1f%% vs %4.1f%%\n' \
  "$o" "$p" "$(awk -v a="$o" -v b="$p" 'BEGIN{print a/b}')" \
  "$(awk -v i="$o" -v g="$gmacs" -v k="$peak" 'BEGIN{print 100*i*g*2/k}')" \
  "$(awk -v i="$p" -v g="$gmacs" -v k="$peak" 'BEGIN{print 100*i*g*2/k}')"

# Vision Transformers, compute only: torchvision's vit_b_16 / vit_l_16 (the peer) against libtrain's
# VisionTransformer of the same shape (embed_step), 224 px, class-token features, batch 16. The peer's
# matrix products go through the system BLAS: say which (install-deps.sh --bench installs OpenBLAS).
blas=$(readlink -f /etc/alternatives/libblas.so.3-x86_64-linux-gnu 2>/dev/null || echo unknown)
echo "pytorch's BLAS: $blas"
case "$blas" in *openblas*|*mkl*|*blis*) ;; *) echo "warning: the peer runs on the reference BLAS: its ViT figures are not a fair peer";; esac
# Multiply-adds per 224-px image (197 tokens): ViT-B/16 17.6G, ViT-L/16 61.6G (Dosovitskiy et al. 2021).
for spec in vit_b_16:17.6 vit_l_16:61.6; do
  m=${spec%%:*}; g=${spec##*:}
  ours=$("$build/bench/embed_step" --model "$m" --batch 16 --size 224 --steps 3)
  peer=$(/usr/bin/python3 "$shared/peers/torch_peer.py" embed --model "$m" --batch 16 --size 224 \
           --threads "$threads" --steps 3)
  o=$(sed -E 's/.*images_per_s=([0-9.]+).*/\1/' <<<"$ours"); p2=$(sed -E 's/.*images_per_s=([0-9.]+).*/\1/' <<<"$peer")
  printf 'compute   %-16s slide-embed %7.2f tiles/s   pytorch %7.2f tiles/s   ratio %.2fx (target >= 1.5x)   of peak: %4.1f%% vs %4.1f%%\n' \
    "$m" "$o" "$p2" "$(awk -v a="$o" -v b="$p2" 'BEGIN{print a/b}')" \
    "$(awk -v i="$o" -v g="$g" -v k="$peak" 'BEGIN{print 100*i*g*2/k}')" \
    "$(awk -v i="$p2" -v g="$g" -v k="$peak" 'BEGIN{print 100*i*g*2/k}')"
done

# bf16 (--precision bf16), compute only, where the CPU has bf16 instructions (AVX512_BF16 or AMX;
# elsewhere both sides would run f32): ours against our fp32 and against PyTorch's bf16 inference
# (bench/torch_bf16_peer.py: torch.autocast, oneDNN's bf16 kernels underneath).
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  for spec in resnet50:32 vit_b_16:16 vit_l_16:16; do
    m=${spec%%:*}; b=${spec##*:}
    f32=$("$build/bench/embed_step" --model "$m" --batch "$b" --size 224 --steps 3)
    ours=$("$build/bench/embed_step" --model "$m" --batch "$b" --size 224 --steps 3 --precision bf16)
    peer=$(/usr/bin/python3 "$here/bench/torch_bf16_peer.py" --model "$m" --batch "$b" --size 224 \
             --threads "$threads" --steps 3)
    f=$(sed -E 's/.*images_per_s=([0-9.]+).*/\1/' <<<"$f32"); o=$(sed -E 's/.*images_per_s=([0-9.]+).*/\1/' <<<"$ours")
    p3=$(sed -E 's/.*images_per_s=([0-9.]+).*/\1/' <<<"$peer")
    printf 'bf16      %-16s slide-embed %7.2f tiles/s (%.2fx its fp32)   pytorch autocast bf16 %7.2f tiles/s   ratio %.2fx\n' \
      "$m" "$o" "$(awk -v a="$o" -v b="$f" 'BEGIN{print a/b}')" "$p3" "$(awk -v a="$o" -v b="$p3" 'BEGIN{print a/b}')"
  done
else
  echo "bf16      skipped: this CPU has no bf16 instructions (AVX512_BF16 or AMX), so --precision bf16 runs as fp32"
fi

# End to end from a store.
"$build/apps/slide-tile" "$here/sample_data/slides/CMU-1-Small-Region.svs" --mpp 0.5 --tile-size 224 --min-tissue 0 \
  -o "$tmp/store" -q >/dev/null 2>&1
/usr/bin/python3 "$here/scripts/convert_torchvision_weights.py" --random resnet50 "$tmp/r50.safetensors" >/dev/null
/usr/bin/python3 - "$build/apps/slide-embed" "$tmp" "$threads" "$p" <<'PY'
import os, re, subprocess, sys
exe, tmp, threads, peer = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
p = subprocess.Popen([exe, tmp + "/store", "-o", tmp + "/bags", "--weights", tmp + "/r50.safetensors",
                      "--model", "resnet50", "--threads", threads, "--decode-threads", "1", "--batch-size", "32"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
err = p.stderr.read(); p.stderr.close()
_, status, ru = os.wait4(p.pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, err
tiles = int(re.search(r" tiles=(\d+)", err).group(1)); rate = float(re.search(r"tiles_per_s=([0-9.]+)", err).group(1))
print("end2end   resnet50/layer3  slide-embed %7.2f tiles/s (%d tiles of CMU-1, decode + HDF5 included)   "
      "vs pytorch compute only %.2f: %.2fx   peak RSS %.0f MB" % (rate, tiles, peer, rate / peer, ru.ru_maxrss / 1024))
PY
