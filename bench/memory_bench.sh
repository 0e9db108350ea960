#!/usr/bin/env bash
# Memory (issue 6): ResNet-18 and ResNet-50 training at 224 px on the CPU, with and without
# activation checkpointing (per ResNet stage): measured peak of live tensors and images/s at one
# batch, the planner's peak, and the largest batch the planner fits in a 4 GiB budget each way;
# then the published figures of the peers beside our ratios, in one run.
#
# BACKEND=cuda (PRECISION=tf32) runs it on a GPU: device peaks, and offload measured as well.
#
# usage: bench/memory_bench.sh [BUILD_DIR]   (default build/; BATCH, STEPS, THREADS, BUDGET, BACKEND, PRECISION override)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
threads=${THREADS:-2}
export OMP_NUM_THREADS=$threads
echo "threads $threads; batch ${BATCH:-16} at 224 px; budget ${BUDGET:-4G}"
out=$("$build/bench/memory_bench" --batch "${BATCH:-16}" --steps "${STEPS:-3}" --budget "${BUDGET:-4G}" \
  --backend "${BACKEND:-cpu}" --precision "${PRECISION:-fp32}")
echo "$out"
# The peers' published figures (not rerun here: TFLMS needs a GPU and TensorFlow 1.x):
#  - TFLMS (Le et al., 2018, "TFLMS: Large Model Support in TensorFlow by Graph Rewriting"):
#    ResNet-50 trains with a 4.7x larger batch by swapping activations to host memory.
#  - Chen et al. (2016), "Training Deep Nets with Sublinear Memory Cost": sqrt(n) segments
#    cost about 30% more compute (one more forward per segment).
r50=$(grep '^resnet50 .*checkpointing' <<<"$out" || true)
if [ -n "$r50" ]; then
  batch_ratio=$(sed -E 's/.*largest batch in [^ ]+ x([0-9.]+).*/\1/' <<<"$r50")
  extra=$(sed -E 's/.*time per image \+(-?[0-9]+)%.*/\1/' <<<"$r50")
  printf 'resnet50  largest batch: checkpointing x%s here   TFLMS (swapping, GPU) x4.7\n' "$batch_ratio"
  printf 'resnet50  extra time per image: +%s%% here   Chen et al. sqrt(n) checkpointing about +30%%\n' "$extra"
fi
off=$(grep '^resnet50 .*offload (stage' <<<"$out" || true)
if [ -n "$off" ]; then
  off_ratio=$(sed -E 's/.*largest batch in [^ ]+ x([0-9.]+).*/\1/' <<<"$off")
  printf 'resnet50  largest batch: offload (stage, two segments resident, planned) x%s here   TFLMS x4.7\n' "$off_ratio"
fi
both=$(grep '^resnet50 .*both' <<<"$out" || true)
if [ -n "$both" ]; then
  both_ratio=$(sed -E 's/.*largest batch in [^ ]+ x([0-9.]+).*/\1/' <<<"$both")
  printf 'resnet50  largest batch: checkpoint block + offload stage (planned) x%s here   TFLMS x4.7\n' "$both_ratio"
fi
