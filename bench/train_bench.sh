#!/usr/bin/env bash
# slide-train's engine against PyTorch on the CPU (../shared/peers/torch_peer.py train), in one run:
# ResNet-18 and ResNet-50, 224 px, batch 32, SGD-momentum steps on random tiles, the same thread
# count; images/s of each, the ratio, and the fraction of the machine's measured FP32 peak
# (oneDNN sgemm on the same threads) that each reaches.
#
# usage: bench/train_bench.sh   (needs a build in build/ and Debian's python3-torch python3-torchvision)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
shared=${SLIDE_SHARED:-$here/../shared}
threads=${THREADS:-2}
export OMP_NUM_THREADS=$threads
peak=$("$here/build/bench/sgemm_peak" | sed -E 's/.*gflops=([0-9.]+).*/\1/')
echo "threads $threads; sgemm peak ${peak} GFLOP/s"
# Training FLOPs per 224-px image: 3x the forward multiply-adds x 2 (forward, backward data,
# backward weights); forward MACs from torchvision's model docs: ResNet-18 1.81G, ResNet-50 4.09G.
for spec in resnet18:1.81 resnet50:4.09; do
  model=${spec%%:*}; gmacs=${spec##*:}
  ours=$("$here/build/bench/train_step" --model "$model" --batch 32 --size 224 --steps 4)
  peer=$(/usr/bin/python3 "$shared/peers/torch_peer.py" train --model "$model" --batch 32 --size 224 \
           --threads "$threads" --steps 4)
  o=$(sed -E 's/.*images_per_s=([0-9.]+).*/\1/' <<<"$ours"); p=$(sed -E 's/.*images_per_s=([0-9.]+).*/\1/' <<<"$peer")
  printf '%-9s slide-train %7.2f img/s   pytorch %7.2f img/s   ratio %.2fx (target >= 1.5x)   of peak: %4.1f%% vs %4.1f%%\n' \
    "$model" "$o" "$p" "$(awk -v a="$o" -v b="$p" 'BEGIN{print a/b}')" \
    "$(awk -v i="$o" -v g="$gmacs" -v k="$peak" 'BEGIN{print 100*i*g*6/k}')" \
    "$(awk -v i="$p" -v g="$gmacs" -v k="$peak" 'BEGIN{print 100*i*g*6/k}')"
done
