#!/usr/bin/env bash
# For whoever has an NVIDIA GPU: builds with CUDA required, then runs every gpu-labelled test (the
# device probe and the cuda backend's op-by-op parity suite against the reference backend) and
# prints each result. Usage: scripts/gpu-check.sh [extra cmake args]
# (A GPU machine without our Debian packages: scripts/device-bundle.sh on a build machine, then
# scripts/device-run.sh on the GPU machine.)
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || {
  echo "gpu-check: nvidia-smi found no GPU (or no driver); the gpu tests would only skip" >&2
  exit 1
}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSLIDE_WARNINGS_AS_ERRORS=ON -DSLIDE_WITH_CUDA=ON "$@"
cmake --build build -j"$(nproc)"
ctest --test-dir build -L gpu --output-on-failure
ctest --test-dir build -R cuda_check --output-on-failure
# The GPU benchmark: compute-only and end-to-end slide-train, the PyTorch peer when importable,
# slide-embed (bench/gpu_bench.sh; figures for the notes).
bench/gpu_bench.sh
