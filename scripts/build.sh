#!/usr/bin/env bash
# Configures and builds slidestream into build/ (warnings are errors). Extra arguments go to cmake's
# configure step, e.g. scripts/build.sh -DSLIDE_WITH_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
# -g1 (line tables: file:line in backtraces and sanitizer reports, no variable locations) instead
# of RelWithDebInfo's -g: the same -O2 code, and slide_train_main.cpp compiles in 35 s instead of
# 54 s here (2026-11-29). For a debugger's view of locals, configure with -DCMAKE_BUILD_TYPE=Debug.
# The libraries and tools in unity batches (SLIDE_UNITY_BUILD): 335 CPU-seconds instead of 541 for
# them here (2026-11-29), a fresh build being what this script is for; and the test suites of
# several files (libtrain's, libtile's, cache's, apps/'): 159 CPU-seconds instead of ~235 for them
# here (2026-11-29). For a build edited file by file, configure without it (cmake -S . -B build-dev
# -G Ninja): a change recompiles its file only.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" -DSLIDE_WARNINGS_AS_ERRORS=ON -DSLIDE_UNITY_BUILD=ON "$@"
cmake --build build -j"$(nproc)"
