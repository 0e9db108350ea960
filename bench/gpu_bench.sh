#!/usr/bin/env bash
# slide-train and slide-embed on one GPU (issue 11's performance section), for whoever has one:
#  1. ResNet-50 training, 224 px: the compute-only step (bench/train_step --backend cuda, random
#     tensors, batch $BATCH) beside PyTorch's on the same GPU (torchvision's resnet50, SGD, FP32
#     at $PRECISION: fp32 with TF32 off, as ours under fp32 (cuDNN FMA math); tf32 (the default) with
#     cudnn/matmul allow_tf32 on, as ours under tf32; bf16 under torch.autocast(bfloat16), which
#     also stores activations in bf16, unlike ours), when a CUDA PyTorch is importable; then
#     slide-train --precision $PRECISION end to end from a store (the LC25000 lung subset at 224 px
#     listed $REPEAT times, --cache ram), the last epoch's images/s. NVIDIA's DeepLearningExamples
#     figure for an A100 80GB is printed beside it (938 img/s TF32, 2,470 img/s AMP; no figure is on
#     file for other GPUs).
#  2. slide-embed of the same store with the trained weights at the default cut (ResNet-50: layer3,
#     CLAM's features), tiles/s.
# BACKEND=cpu MODEL=resnet18 BATCH=16 REPEAT=2 EPOCHS=1 runs the script's own logic on a CPU (90 s on 2 cores).
#
# usage: [BATCH=128] [REPEAT=8] [EPOCHS=3] [BACKEND=cuda] [PRECISION=tf32] bench/gpu_bench.sh   (a build in $BUILD, default build/)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build}
batch=${BATCH:-128}
repeat=${REPEAT:-8}
epochs=${EPOCHS:-3}
backend=${BACKEND:-cuda}
model=${MODEL:-resnet50}
precision=${PRECISION:-tf32}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
echo "device: ${gpu:-none found by nvidia-smi}; backend $backend; $model, batch $batch, precision $precision"

echo "== compute only (random tensors, 224 px)"
"$build/bench/train_step" --backend "$backend" --model "$model" --batch "$batch" --size 224 --steps 10 \
  --precision "$precision"
if /usr/bin/python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  /usr/bin/python3 - "$model" "$batch" "$precision" <<'EOF'
import contextlib, statistics, sys, time
import torch, torchvision
model, batch, precision = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tf32 = precision != "fp32"                       # fp32: no TF32 tensor cores, as ours
torch.backends.cudnn.allow_tf32 = tf32
torch.backends.cuda.matmul.allow_tf32 = tf32
autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16"
            else contextlib.nullcontext())
torch.backends.cudnn.benchmark = True
m = getattr(torchvision.models, model)(num_classes=3).cuda()
x = torch.randn(batch, 3, 224, 224, device="cuda")
y = torch.randint(0, 3, (batch,), device="cuda")
opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
lossf = torch.nn.CrossEntropyLoss()
times = []
for i in range(12):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with autocast:
        loss = lossf(m(x), y)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
print("peer: PyTorch %s %s images_per_s=%.1f (%s, cudnn.benchmark)" %
      (torch.__version__, model, batch / statistics.median(times[2:]),
       {"fp32": "FP32, TF32 off", "tf32": "TF32 on", "bf16": "autocast bf16"}[precision]))
EOF
else
  echo "peer: no CUDA PyTorch importable by /usr/bin/python3 (pip install torch torchvision in a venv to compare)"
fi

echo "== slide-train end to end (store of $((360 * repeat)) tiles, --cache ram, $epochs epochs)"
"$build/apps/slide-tile" --patches "$here/sample_data/patches/lc25000-lung-subset" --tile-size 224 -o "$tmp/store" -q \
  >/dev/null 2>&1 || true
stores=(); for ((i = 0; i < repeat; ++i)); do stores+=("$tmp/store"); done
"$build/apps/slide-train" --backend "$backend" --precision "$precision" --data "${stores[@]}" --out "$tmp/run" --model "$model" \
  --epochs "$epochs" --batch-size "$batch" --val-fraction 0 --cache ram --threads "$(nproc)" -q
ips=$(/usr/bin/python3 -c 'import json,sys; h=[json.loads(l) for l in open(sys.argv[1])]; print("%.1f" % h[-1]["images_per_s"])' \
  "$tmp/run/metrics.jsonl")
case "$gpu" in
  *A100*80GB*) ref="NVIDIA DeepLearningExamples ResNet-50 on A100 80GB: 938 img/s TF32, 2470 img/s AMP" ;;
  *) ref="no reference figure on file for this device" ;;
esac
echo "slide-train $model last epoch: $ips img/s ($ref)"

echo "== slide-embed $model at its default cut (resnet50: layer3, CLAM's features), the weights trained above"
"$build/apps/slide-embed" "$tmp/store" -o "$tmp/bags" --weights "$tmp/run/checkpoints/epoch-$epochs-step-0" \
  --backend "$backend" --precision "$precision" --batch-size "$batch" --threads "$(nproc)" 2>&1 | grep -E "summary" || true
