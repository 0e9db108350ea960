#!/usr/bin/env bash
# slide-train and slide-embed on one GPU (issue 11's performance section), for whoever has one:
#  1. ResNet-50 training, 224 px: the compute-only step (bench/train_step --backend cuda, random
#     tensors, batch $BATCH) beside PyTorch's on the same GPU (bench/torch_gpu_peer.py train:
#     torchvision's resnet50, SGD, at $PRECISION: fp32 with TF32 off, as ours under fp32 (cuDNN FMA
#     math); tf32 (the default) with cudnn/matmul allow_tf32 on, as ours under tf32; bf16 under
#     torch.autocast(bfloat16), which also stores activations in bf16, unlike ours), when $PYTHON
#     imports a CUDA PyTorch; then
#     slide-train --precision $PRECISION end to end from a store (the LC25000 lung subset at 224 px
#     listed $REPEAT times, --cache $CACHE: device on cuda, as issue 11 asks, else ram), the last
#     epoch's images/s. NVIDIA's DeepLearningExamples
#     figure for an A100 80GB is printed beside it (938 img/s TF32, 2,470 img/s AMP; no figure is on
#     file for other GPUs).
#  2. slide-embed of the same store with the trained weights at the default cut (ResNet-50: layer3,
#     CLAM's features), tiles/s.
# BACKEND=cpu MODEL=resnet18 BATCH=16 REPEAT=2 EPOCHS=1 runs the script's own logic on a CPU (90 s on 2 cores).
#
# usage: [BATCH=128] [REPEAT=8] [EPOCHS=3] [BACKEND=cuda] [PRECISION=tf32] [CACHE=device|ram|none|auto]
#        [PYTHON=python3] [SKIP_COMPUTE=1] bench/gpu_bench.sh   (a build in $BUILD, default build/)
# SKIP_COMPUTE=1 leaves out part 1's compute-only figures (scripts/device-run.sh times them apart).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build}
batch=${BATCH:-128}
repeat=${REPEAT:-8}
epochs=${EPOCHS:-3}
backend=${BACKEND:-cuda}
model=${MODEL:-resnet50}
precision=${PRECISION:-tf32}
if [[ "$backend" == cuda ]]; then cache=${CACHE:-device}; else cache=${CACHE:-ram}; fi
py=${PYTHON:-python3}  # a Python with a CUDA PyTorch, for the peer (on the device machines, the first on PATH)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
echo "device: ${gpu:-none found by nvidia-smi}; backend $backend; $model, batch $batch, precision $precision"

if [[ "${SKIP_COMPUTE:-0}" != 1 ]]; then
  echo "== compute only (random tensors, 224 px)"
  "$build/bench/train_step" --backend "$backend" --model "$model" --batch "$batch" --size 224 --steps 10 \
    --precision "$precision"
  if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    "$py" "$here/bench/torch_gpu_peer.py" train --model "$model" --batch "$batch" --precision "$precision"
  else
    echo "peer: no CUDA PyTorch importable by $py (PYTHON=... names another)"
  fi
fi

echo "== slide-train end to end (store of $((360 * repeat)) tiles, --cache $cache, $epochs epochs)"
"$build/apps/slide-tile" --patches "$here/sample_data/patches/lc25000-lung-subset" --tile-size 224 -o "$tmp/store" -q \
  >/dev/null 2>&1 || true
stores=(); for ((i = 0; i < repeat; ++i)); do stores+=("$tmp/store"); done
"$build/apps/slide-train" --backend "$backend" --precision "$precision" --data "${stores[@]}" --out "$tmp/run" --model "$model" \
  --epochs "$epochs" --batch-size "$batch" --val-fraction 0 --cache "$cache" --threads "$(nproc)" -q
ips=$("$py" -c 'import json,sys; h=[json.loads(l) for l in open(sys.argv[1])]; print("%.1f" % h[-1]["images_per_s"])' \
  "$tmp/run/metrics.jsonl")
case "$gpu" in
  *A100*80GB*) ref="NVIDIA DeepLearningExamples ResNet-50 on A100 80GB: 938 img/s TF32, 2470 img/s AMP" ;;
  *) ref="no reference figure on file for this device" ;;
esac
echo "slide-train $model $precision --cache $cache last epoch: $ips img/s ($ref)"

echo "== slide-embed $model at its default cut (resnet50: layer3, CLAM's features), the weights trained above"
"$build/apps/slide-embed" "$tmp/store" -o "$tmp/bags" --weights "$tmp/run/checkpoints/epoch-$epochs-step-0" \
  --backend "$backend" --precision "$precision" --batch-size "$batch" --threads "$(nproc)" 2>&1 | grep -E "summary" || true
