#!/usr/bin/env bash
# Packs what the GPU checks need into .device/slide-gpu-bundle.tar.xz, for a GPU machine that has
# CUDA's libraries but none of our Debian packages (the device machines this project is sometimes
# lent: nvcc, PyTorch and NVIDIA's pip wheels of cuBLAS, cuDNN and NCCL; no OpenSlide, oneDNN, HDF5,
# Open MPI; nothing can be installed there). scripts/device-run.sh unpacks and runs it there.
#
# What goes in, under build/ as in our build tree (so bench/gpu_bench.sh's BUILD= can point at it):
#   - the gpu-labelled test binaries, slide-tile/-train/-embed and the step benchmarks, with their
#     debug sections stripped (symbols kept) and DT_RPATH set to the bundle's lib/ (RPATH, not
#     RUNPATH: it also serves the libraries' own dependencies);
#   - lib/: every shared library they load from this machine (ldd), but glibc's own and NVIDIA's
#     (cuBLAS, cuBLASLt, cuDNN, NCCL, the driver), which must be the device's: those come from
#     LD_LIBRARY_PATH there. cudart is ours (its version is the one nvcc compiled against; any newer
#     driver runs it).
# The tree's sources and sample_data/ travel with the working tree; the bundle holds binaries only.
#   scripts/device-bundle.sh [BUILD_DIR]        (default build/, configured with CUDA on)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=.device
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/slide-gpu-bundle
mkdir -p "$root/lib"

for tool in patchelf objcopy ldd xz; do
  command -v "$tool" > /dev/null || { echo "device-bundle: $tool is missing (patchelf: apt-get install patchelf)" >&2; exit 1; }
done

bins=(tests/gpu_tests tests/cuda_ops_tests tests/cuda_check_tests tests/nccl_tests
      apps/slide-tile apps/slide-train apps/slide-embed bench/train_step bench/embed_step bench/memory_bench)
for b in "${bins[@]}"; do
  if [[ ! -x "$build/$b" ]]; then
    echo "device-bundle: $build/$b is missing (a build with CUDA on: scripts/build.sh -DSLIDE_WITH_CUDA=ON)" >&2
    exit 1
  fi
done

# glibc and the loader come from the device (its glibc is newer than Debian 12's 2.36); NVIDIA's
# libraries from its wheels or CUDA install, matched to its driver.
skip='^(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64|libcuda|libcublas|libcublasLt|libcudnn.*|libnccl|libnvidia-.*)\.so'
declare -A libs=()
for b in "${bins[@]}"; do
  mkdir -p "$root/build/$(dirname "$b")"
  objcopy --strip-debug "$build/$b" "$root/build/$b"
  patchelf --force-rpath --set-rpath '$ORIGIN/../../lib' "$root/build/$b"
  while read -r name path; do
    [[ "$path" == /* ]] || { echo "device-bundle: $b needs $name, which ldd did not find here" >&2; exit 1; }
    if [[ ! "$name" =~ $skip ]]; then libs[$name]=$path; fi
  done < <(ldd "$build/$b" | awk '$2 == "=>" {print $1, $3}')
done
for name in "${!libs[@]}"; do
  cp -L "${libs[$name]}" "$root/lib/$name"
  chmod u+w "$root/lib/$name"
  patchelf --force-rpath --set-rpath '$ORIGIN' "$root/lib/$name"
done
{
  echo "built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
  echo "host: $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -1)"
  echo "nvcc: $(/usr/local/cuda/bin/nvcc --version | tail -1)"
  echo "GPU code (nvcc --generate-code): $(grep -o -- '--generate-code=[^ ]*' "$build/build.ninja" | sort -u | tr '\n' ' ')"
  echo "libraries: ${#libs[@]}"
} > "$root/MANIFEST"

mkdir -p "$out"
tar -C "$stage" -cf - slide-gpu-bundle | xz -T0 -6 > "$out/slide-gpu-bundle.tar.xz.part"
mv "$out/slide-gpu-bundle.tar.xz.part" "$out/slide-gpu-bundle.tar.xz"
size=$(du -k "$out/slide-gpu-bundle.tar.xz" | cut -f1)
echo "device-bundle: $out/slide-gpu-bundle.tar.xz, $((size / 1024)) MiB, ${#bins[@]} binaries, ${#libs[@]} libraries"
cat "$root/MANIFEST"
if ((size > 56 * 1024)); then
  echo "device-bundle: over 56 MiB; the device tool carries at most 64 MiB with the working tree" >&2
  exit 1
fi
