#!/usr/bin/env bash
# slide-train's engine against PyTorch on the CPU (../shared/peers/torch_peer.py train), in one run:
# ResNet-18 and ResNet-50, 224 px, batch 32, SGD-momentum steps on random tiles, the same thread
# count; images/s of each, the ratio, and the fraction of the machine's measured FP32 peak
# (oneDNN sgemm on the same threads) that each reaches.
#
# Shared and virtual machines drift by tens of percent from minute to minute, so the two sides
# run alternately, ROUNDS times (default 3), each with the sgemm peak measured beside it: the
# figures are medians over the rounds, and the ratio of the medians comes with the range of the
# per-round ratios.
#
# usage: [ROUNDS=3] [THREADS=2] bench/train_bench.sh
#   (needs a build in build/ and Debian's python3-torch python3-torchvision)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
shared=${SLIDE_SHARED:-$here/../shared}
threads=${THREADS:-2}
rounds=${ROUNDS:-3}
export OMP_NUM_THREADS=$threads
ips() { sed -E 's/.*images_per_s=([0-9.]+).*/\1/'; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
echo "threads $threads; rounds $rounds; $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
# Training FLOPs per 224-px image: 3x the forward multiply-adds x 2 (forward, backward data,
# backward weights); forward MACs from torchvision's model docs: ResNet-18 1.81G, ResNet-50 4.09G.
for spec in resnet18:1.81 resnet50:4.09; do
  model=${spec%%:*}; gmacs=${spec##*:}
  ours=(); peer=(); peaks=(); ratios=()
  for ((r = 1; r <= rounds; ++r)); do
    k=$("$here/build/bench/sgemm_peak" | sed -E 's/.*gflops=([0-9.]+).*/\1/')
    o=$("$here/build/bench/train_step" --model "$model" --batch 32 --size 224 --steps 4 | ips)
    p=$(/usr/bin/python3 "$shared/peers/torch_peer.py" train --model "$model" --batch 32 --size 224 \
          --threads "$threads" --steps 4 | ips)
    ours+=("$o"); peer+=("$p"); peaks+=("$k"); ratios+=("$(awk -v a="$o" -v b="$p" 'BEGIN{print a/b}')")
    printf '  %s round %d: slide-train %6.2f img/s, pytorch %6.2f img/s, ratio %.2fx, sgemm %.0f GFLOP/s\n' \
      "$model" "$r" "$o" "$p" "${ratios[-1]}" "$k"
  done
  o=$(printf '%s\n' "${ours[@]}" | median); p=$(printf '%s\n' "${peer[@]}" | median)
  k=$(printf '%s\n' "${peaks[@]}" | median)
  lo=$(printf '%s\n' "${ratios[@]}" | sort -g | head -1); hi=$(printf '%s\n' "${ratios[@]}" | sort -g | tail -1)
  printf '%-9s slide-train %7.2f img/s   pytorch %7.2f img/s   ratio %.2fx (rounds %.2f-%.2f; target >= 1.5x)   of peak: %4.1f%% vs %4.1f%%\n' \
    "$model" "$o" "$p" "$(awk -v a="$o" -v b="$p" 'BEGIN{print a/b}')" "$lo" "$hi" \
    "$(awk -v i="$o" -v g="$gmacs" -v k="$k" 'BEGIN{print 100*i*g*6/k}')" \
    "$(awk -v i="$p" -v g="$gmacs" -v k="$k" 'BEGIN{print 100*i*g*6/k}')"
done
