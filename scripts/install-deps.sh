#!/usr/bin/env bash
# Installs every build, test and benchmark dependency of slidestream from Debian's packages.
# Idempotent and non-interactive: safe to run on every CI run and on a developer's machine.
# CUDA, cuDNN and NCCL are not Debian packages: they are expected under /usr/local/cuda
# (the build turns CUDA off when they are absent; see SLIDE_WITH_CUDA in CMakeLists.txt).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libopenslide-dev liblmdb-dev lmdb-utils libtiff-dev libturbojpeg0-dev libjpeg62-turbo-dev libpng-dev
  libcli11-dev nlohmann-json3-dev doctest-dev
  libgeos-dev  # annotations: polygon geometry (libtile/src/annotations.cpp)
  libcairo2-dev fonts-dejavu-core  # figures: titles, colour bars, axes (libtile/src/figure.cpp)
  libhdf5-dev liblzf-dev libssl-dev libdnnl-dev libopenmpi-dev openmpi-bin
  iproute2 util-linux  # the two-host test rig (tests/dist/two_hosts.sh: ip netns, unshare)
  libeigen3-dev  # stain normalisation: the symmetric eigensolver (libtrain/src/stain.cpp)
  python3 python3-lmdb python3-openslide python3-numpy python3-pil python3-h5py
  python3-torch python3-torchvision  # the numerics test against torchvision, and the training peer
  clang libclang-rt-14-dev  # the fuzz targets (tests/fuzz/: clang++ and its libFuzzer runtime)
)
# Tests only, and not worth failing the install for (the tests that need them skip, saying why):
# report.html rendered by a real browser (tests/e2e/test_slide_train.py TestReport).
optional_packages=(chromium-headless-shell)
# Benchmarks only (the Python peers and the gigapixel slide builder): `install-deps.sh --bench`.
# libopenblas0-pthread: Debian's PyTorch runs a ViT's matrix products through the system BLAS
# (about 50x slower on the reference BLAS), so the ViT peer gets OpenBLAS.
bench_packages=(python3-opencv libvips-tools time libopenblas0-pthread)

want=("${packages[@]}")
if [[ "${1:-}" == "--bench" ]]; then want+=("${bench_packages[@]}"); fi

missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
optional_missing=()
for p in "${optional_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || optional_missing+=("$p")
done
if ((${#missing[@]} == 0 && ${#optional_missing[@]} == 0)); then
  echo "install-deps: all ${#want[@]} packages present"
  exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
if ((${#missing[@]} > 0)); then
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if ((${#optional_missing[@]} > 0)); then
  echo "install-deps: installing ${optional_missing[*]} (optional)"
  $SUDO apt-get install -y -qq --no-install-recommends "${optional_missing[@]}" ||
    echo "install-deps: warning: ${optional_missing[*]} not installed; the tests that need them skip" >&2
fi
