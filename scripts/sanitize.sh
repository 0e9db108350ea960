#!/usr/bin/env bash
# A sanitizer build of slidestream (CUDA, fuzz targets and benchmarks off) and ctest on it: MODE
# `address` (AddressSanitizer + UndefinedBehaviorSanitizer, the default) builds build-asan/, `thread`
# (ThreadSanitizer) builds build-tsan/. CI runs only a slice of each mode (ctest label `sanitize`,
# tests/sanitize's two builds; see tests/fuzz/README.md); run this before a release and after
# touching threads or memory.
#   scripts/sanitize.sh [address|thread] [CTEST_ARGS...]     e.g. scripts/sanitize.sh address -L unit
# Every finding stops its test (halt_on_error) and prints a stack. Leak checking is off: OpenSlide's
# glib, HDF5 and Open MPI keep allocations for the process's life. OMP_NUM_THREADS=1 under
# ThreadSanitizer: libgomp is not instrumented, and its barriers read as races. scripts/tsan.supp
# holds the reports inside other uninstrumented libraries (OpenSlide, Open MPI), each with its reason.
# A thread build's libtrain_tests leaves out the suite's files that start no thread of ours
# (tests/CMakeLists.txt, slide_libtrain_threadless_tests).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-address}
shift || true
case "$mode" in
  address) dir=build-asan; flags="address,undefined" ;;
  thread) dir=build-tsan; flags="thread" ;;
  *) echo "usage: scripts/sanitize.sh [address|thread] [CTEST_ARGS...]" >&2; exit 2 ;;
esac
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSLIDE_WARNINGS_AS_ERRORS=ON \
  -DSLIDE_SANITIZE="$flags" -DSLIDE_WITH_CUDA=OFF -DSLIDE_BUILD_BENCH=OFF
cmake --build "$dir" -j"$(nproc)"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:detect_stack_use_after_return=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/scripts/tsan.supp"
if [[ "$mode" == thread ]]; then export OMP_NUM_THREADS=1; fi
ctest --test-dir "$dir" --output-on-failure --timeout 1800 "$@"
