#!/usr/bin/env bash
# The GPU checks on a lent device machine, in one command that ends within its 10-minute limit:
# unpacks .device/slide-gpu-bundle.tar.xz (scripts/device-bundle.sh, made here beforehand), finds
# the device's own cuBLAS, cuDNN and NCCL, and runs, in this order, each under a timeout taken from
# what is left of BUDGET_S (default 540 s):
#   1. the device probe and the CUDA error mapping (gpu_tests, cuda_check_tests);
#   2. the cuda backend against the reference backend, op by op (cuda_ops_tests: the parity suite);
#   3. NCCL (nccl_tests; the two-GPU cases skip on one GPU);
#   4. slide-train / evaluate / slide-embed on the GPU against the cpu backend
#      (tests/e2e/test_slide_train_gpu.py, with the bundle's tools);
#   5. compute-only ResNet-50 training steps at 224 px, fp32, tf32, bf16 and fp16 (bench/train_step;
#      bf16 and fp16 on half-precision activations, as slide-train's --activations auto);
#   6. bench/memory_bench on cuda: device peak measured against the planner's, with checkpointing,
#      activation offload and both, their time, and the largest batch each fits in 16 GiB;
#   7. slide-embed --model uni from a store at fp32, tf32, bf16 and fp16 (bench/uni_gpu_embed.sh);
#   8. the compute-only figures beside PyTorch's on the same GPU (bench/torch_gpu_peer.py):
#      ResNet-50 training at fp32, tf32, bf16 and fp16 (bench/train_step; bf16 / fp16 channels last,
#      fp16 NCHW and tf32 channels last beside them), and ViT-L/16 class-token
#      features at batch 64 (bench/embed_step --model vit_l_16; the peer is timm's UNI architecture);
#      ResNet-50 layer3 embedding at fp16 and tf32 (bench/embed_step, issue 11's embedding target);
#      then issue 11's training target end to end: slide-train ResNet-50 from a store with --cache
#      device at tf32 and fp16, and slide-embed of that store (bench/gpu_bench.sh);
#   9. where the time goes: Nsight Compute's per-kernel GPU time (one metric, gpu__time_duration) of
#      a ResNet-50 training step at tf32 and at fp16 (half-precision activations), a ViT-L/16
#      embedding batch at bf16 and a ResNet-50 layer3
#      embedding batch at fp16, summarised per kernel by bench/ncu_summary.py (ncu.*.csv in $OUT);
#  10. where step 2 failed: step 2 again under compute-sanitizer's memcheck.
# STEPS="probe slide_train_gpu_e2e peer_*" runs only the steps whose names match one of the
# patterns (the bundle's unpacking and the library search always run).
# Everything goes to $OUT/gpu-check.log (the device tool brings $OUT back) and one line per step to
# $OUT/summary.txt. Usage, through the device tool, from the repository root:
#   run(command="scripts/device-run.sh", carry=[".device"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${OUT:-/tmp/slide-gpu-out}
mkdir -p "$out"
log=$out/gpu-check.log
summary=$out/summary.txt
: > "$log"
: > "$summary"
budget=${BUDGET_S:-540}
start=$(date +%s)
say() { echo "$*" | tee -a "$log"; }
note() { echo "$*" | tee -a "$summary" >> "$log"; }

bundle=/tmp/slide-gpu-bundle
if [[ ! -f .device/slide-gpu-bundle.tar.xz ]]; then
  note "FAIL bundle: .device/slide-gpu-bundle.tar.xz is missing (scripts/device-bundle.sh here, then carry .device)"
  exit 1
fi
rm -rf "$bundle"
# tar's xz, or Python's lzma where the device has no xz.
tar -C /tmp -xJf .device/slide-gpu-bundle.tar.xz 2>> "$log" ||
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall("/tmp")' .device/slide-gpu-bundle.tar.xz ||
  { note "FAIL bundle: could not unpack"; exit 1; }
cat "$bundle/MANIFEST" >> "$log"
build=$bundle/build

say "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | tee -a "$log" "$summary"
say "$(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"), $(ldd --version 2>&1 | head -1), $(nproc) cores"

# NVIDIA's libraries as the device has them: pip wheels (site-packages/nvidia/*/lib), a CUDA
# install, or the system's library directories. The first directory holding each wins.
dirs=()
for name in libcublas.so.13 libcublasLt.so.13 libcudnn.so.9 libnccl.so.2; do
  found=$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n {print $NF; exit}')
  if [[ -z "$found" ]]; then
    found=$(find -H /usr /opt /root -xdev -name "$name" 2>/dev/null | head -1)
  fi
  if [[ -z "$found" ]]; then
    note "FAIL libraries: $name not found on the device"
  else
    d=$(dirname "$found")
    [[ " ${dirs[*]-} " == *" $d "* ]] || dirs+=("$d")
    say "$name: $found"
  fi
done
LD_LIBRARY_PATH=$(IFS=:; echo "${dirs[*]-}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
missing=0
for b in "$build"/tests/* "$build"/apps/* "$build"/bench/*; do
  if ldd "$b" | grep -q "not found"; then
    say "$(basename "$b") cannot load: $(ldd "$b" | grep 'not found' | tr -s ' \t\n' ' ')"
    missing=1
  fi
done
((missing == 0)) && say "every binary's libraries resolve"

# step NAME SECONDS COMMAND...: runs under a timeout capped by what is left of the budget.
failed=0
selected() {
  [[ -z "${STEPS:-}" ]] && return 0
  local p
  for p in $STEPS; do [[ "$1" == $p ]] && return 0; done
  return 1
}
step() {
  local name=$1 want=$2
  shift 2
  selected "$name" || return 0
  local left=$((budget - ($(date +%s) - start)))
  if ((left < 20)); then
    note "SKIP $name: the budget of ${budget} s is spent"
    return
  fi
  local t=$((want < left ? want : left))
  say "== $name (timeout ${t} s): $*"
  local t0=$(date +%s)
  timeout -k 10 "$t" "$@" >> "$log" 2>&1
  local rc=$?
  local secs=$(($(date +%s) - t0))
  case $rc in
    0) note "PASS $name (${secs} s)" ;;
    77) note "SKIP $name: exit 77, no usable device (${secs} s)" ;;
    124|137) note "TIMEOUT $name after ${secs} s"; failed=1 ;;
    *) note "FAIL $name: exit $rc (${secs} s)"; failed=1 ;;
  esac
}

step probe 60 "$build/tests/gpu_tests"
if grep -q "^SKIP probe: exit 77" "$summary"; then
  note "no usable device: nothing else run"
  cat "$summary"
  exit 77
fi
step cuda_check 60 "$build/tests/cuda_check_tests"
step cuda_ops_parity 300 "$build/tests/cuda_ops_tests"
step nccl 90 "$build/tests/nccl_tests"
# A Python with numpy for the e2e test (on the device, the python3 first on PATH holds PyTorch).
py=""
for p in python3 /usr/bin/python3; do
  if command -v "$p" > /dev/null && "$p" -c 'import numpy' 2> /dev/null; then py=$(command -v "$p"); break; fi
done
[[ -n "$py" ]] || { note "FAIL python: no python3 with numpy"; py=python3; }
step slide_train_gpu_e2e 240 env SLIDE_TILE="$build/apps/slide-tile" SLIDE_TRAIN="$build/apps/slide-train" \
  SLIDE_EMBED="$build/apps/slide-embed" SLIDE_SAMPLE_DIR="$repo/sample_data" \
  PYTHONPATH="$repo/tests/e2e" "$py" "$repo/tests/e2e/test_slide_train_gpu.py" -v
for precision in fp32 tf32 bf16 fp16; do
  step "resnet50_step_$precision" 90 "$build/bench/train_step" --backend cuda --model resnet50 --batch 128 \
    --size 224 --steps 10 --precision "$precision"
done
# bf16 / fp16 above run channels last (--channels-last auto); the same step NCHW beside it, and
# tf32 channels last (--channels-last on: f32 activations NHWC).
step resnet50_step_fp16_nchw 90 "$build/bench/train_step" --backend cuda --model resnet50 --batch 128 \
  --size 224 --steps 10 --precision fp16 --channels-last off
step resnet50_step_tf32_nhwc 90 "$build/bench/train_step" --backend cuda --model resnet50 --batch 128 \
  --size 224 --steps 10 --precision tf32 --channels-last on
# Issue 13's table and issue 11's planner check on the device: ResNet-50 at 224 px, batch 64, with
# nothing, checkpointing, offload and both; measured device peak beside the planner's, images/s,
# and the largest batch each fits in 16 GiB.
step memory_resnet50 150 "$build/bench/memory_bench" --backend cuda --precision tf32 --models resnet50 \
  --batch 64 --steps 3 --budget 16G
grep -E "checkpoint=|measured on the device|checkpointing:|to the host and back" "$log" | tail -10 >> "$summary"
# The host link's bandwidth (pinned memory, 1 GiB each way), which bounds activation offload.
step pcie_bandwidth 60 "$py" -c '
import time, torch
n = 1 << 30
h, d = torch.empty(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8, device="cuda")
for what, dst, src in (("host to device", d, h), ("device to host", h, d)):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    print("pcie %s: %.1f GB/s (pinned, 1 GiB copies)" % (what, 5 * n / (time.perf_counter() - t0) / 1e9))
'
grep -E "^pcie " "$log" >> "$summary"
# Issue 14's GPU figure: UNI (ViT-L/16) end to end from a store, tiles/s per precision.
step uni_embed 180 env PYTHON="$py" COPIES=4 bench/uni_gpu_embed.sh "$build"
grep -E "^uni \(ViT-L/16\)" "$log" >> "$summary"
step peer_resnet50_train 120 "$py" bench/torch_gpu_peer.py train --model resnet50 --batch 128 \
  --precision fp32,tf32,bf16,fp16
for precision in fp32 tf32 bf16 fp16; do
  step "vit_l16_embed_$precision" 90 "$build/bench/embed_step" --backend cuda --model vit_l_16 --batch 64 \
    --steps 10 --precision "$precision"
done
step peer_uni_embed 120 "$py" bench/torch_gpu_peer.py embed --model uni --batch 64 --precision fp32,tf32,bf16,fp16
# Issue 11's embedding target (ResNet-50 layer3, fp16, 5,000 tiles/s on one H100): the compute with
# each batch's upload and download (bench/embed_step), at fp16 and tf32.
for precision in fp16 tf32; do
  step "resnet50_layer3_embed_$precision" 60 "$build/bench/embed_step" --backend cuda --model resnet50 \
    --batch 256 --steps 10 --precision "$precision"
done
grep -E "^mode=|^peer: " "$log" >> "$summary"
# Issue 11's training target, end to end: slide-train ResNet-50 from a store (the LC25000 subset
# listed 8 times, 2880 tiles) with --cache device, 2 epochs, the last epoch's images/s beside
# NVIDIA's DeepLearningExamples figure; then slide-embed of that store at layer3 (bench/gpu_bench.sh,
# its compute-only part left out: timed above).
for precision in tf32 fp16; do
  step "resnet50_train_e2e_$precision" 150 env BUILD="$build" PYTHON="$py" SKIP_COMPUTE=1 PRECISION="$precision" \
    REPEAT=8 EPOCHS=2 BATCH=128 bench/gpu_bench.sh
done
grep -E "^slide-train .* last epoch|info  summary bags_written" "$log" >> "$summary"
# Where the time goes, kernel by kernel (a single metric keeps ncu's cost per kernel small; clocks as
# they run, not locked to base, as ncu did on these machines).
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1 || true)
if [[ -n "$ncu" ]]; then
  step profile_resnet50_train_tf32 150 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$out/ncu.resnet50.csv" "$build/bench/train_step" --backend cuda --model resnet50 --batch 64 \
    --size 224 --steps 1 --precision tf32
  [[ -f "$out/ncu.resnet50.csv" ]] && "$py" bench/ncu_summary.py "$out/ncu.resnet50.csv" --top 20 | tee -a "$log" "$summary"
  # Training on half-precision activations (fp16: cuDNN's half convolutions, NCHW), beside tf32's.
  step profile_resnet50_train_fp16 150 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$out/ncu.resnet50_fp16.csv" "$build/bench/train_step" --backend cuda --model resnet50 --batch 64 \
    --size 224 --steps 1 --precision fp16
  [[ -f "$out/ncu.resnet50_fp16.csv" ]] && "$py" bench/ncu_summary.py "$out/ncu.resnet50_fp16.csv" --top 20 |
    tee -a "$log" "$summary"
  step profile_vit_l16_embed_bf16 150 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$out/ncu.vit_l16.csv" "$build/bench/embed_step" --backend cuda --model vit_l_16 --batch 64 \
    --steps 1 --precision bf16
  [[ -f "$out/ncu.vit_l16.csv" ]] && "$py" bench/ncu_summary.py "$out/ncu.vit_l16.csv" --top 20 | tee -a "$log" "$summary"
  # Issue 11's embedding target: the CNN inference graph at fp16 (channels last, cuDNN's half
  # convolutions and the epilogue kernel); an H200 ran it slower than tf32 (3234 against 3396 img/s).
  step profile_resnet50_layer3_embed_fp16 120 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$out/ncu.resnet50_layer3.csv" "$build/bench/embed_step" --backend cuda --model resnet50 --batch 256 \
    --steps 1 --precision fp16
  [[ -f "$out/ncu.resnet50_layer3.csv" ]] && "$py" bench/ncu_summary.py "$out/ncu.resnet50_layer3.csv" --top 20 |
    tee -a "$log" "$summary"
elif selected profile_resnet50_train_tf32; then
  note "SKIP profiles: no ncu on the device"
fi
# Where the parity suite failed: the same binary under compute-sanitizer's memcheck with the time
# that is left (an out-of-bounds access or a launch error names its kernel and its line there).
if grep -qE "^(FAIL|TIMEOUT) cuda_ops_parity" "$summary"; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [[ -n "$cs" ]]; then
    step cuda_ops_memcheck 200 "$cs" --tool memcheck --error-exitcode 3 --print-limit 20 "$build/tests/cuda_ops_tests"
  fi
fi
say "== done in $(($(date +%s) - start)) s"
cat "$summary"
exit $failed
