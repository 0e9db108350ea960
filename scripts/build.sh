#!/usr/bin/env bash
# Configures and builds slidestream into build/ (warnings are errors). Extra arguments go to cmake's
# configure step, e.g. scripts/build.sh -DSLIDE_WITH_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSLIDE_WARNINGS_AS_ERRORS=ON "$@"
cmake --build build -j"$(nproc)"
