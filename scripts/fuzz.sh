#!/usr/bin/env bash
# Runs every fuzz target (tests/fuzz/) for SECONDS each, one after the other, and prints a table:
# target, seconds, executions, new corpus units, crashes. The targets are built by
# scripts/build.sh when a clang++ with libFuzzer is installed (Debian: clang libclang-rt-14-dev),
# in tests/sanitize's ASan build, under build/tests/sanitize/build-asan/tests/fuzz/; BUILD_DIR=<dir>
# picks another main build. Name targets after SECONDS
# to run only those (fuzz_store_mdb and fuzz_bag, which stop at LMDB's and HDF5's own crashes on
# corrupt files, run only when named). The inputs found go to <build>/tests/fuzz/work/corpus/<target>/
# (kept between runs); a crash's input to <build>/tests/fuzz/work/artifacts/<target>/ and the exit
# status is 1.
#   scripts/fuzz.sh SECONDS [TARGET...]
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:?usage: scripts/fuzz.sh SECONDS [TARGET...]}
shift
build=${BUILD_DIR:-build}
bin_dir="$build/tests/sanitize/build-asan/tests/fuzz"
work="$build/tests/fuzz/work"
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(fuzz_tile_record fuzz_slide_record fuzz_csv fuzz_file_stem fuzz_store_meta fuzz_manifest fuzz_safetensors
    fuzz_geojson fuzz_state_json fuzz_sweep_grid)
fi
mkdir -p "$work/logs"
status=0
rows=()
for t in "${targets[@]}"; do
  if [[ ! -x "$bin_dir/$t" ]]; then
    echo "fuzz.sh: $bin_dir/$t is missing (build with scripts/build.sh; needs clang++ and libFuzzer)" >&2
    exit 2
  fi
  log="$work/logs/$t.log"
  before=$(ls "$work/artifacts/$t" 2>/dev/null | wc -l)
  echo "fuzz.sh: $t for $seconds s (log: $log)"
  start=$(date +%s)
  tests/fuzz/run_target.sh "$bin_dir/$t" "$seconds" "$work" >"$log" 2>&1
  rc=$?
  took=$(($(date +%s) - start))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  added=$(sed -n 's/^stat::new_units_added: *//p' "$log" | tail -1)
  after=$(ls "$work/artifacts/$t" 2>/dev/null | wc -l)
  crashes=$((after - before))
  if ((rc != 0)); then
    status=1
    echo "fuzz.sh: $t FAILED (exit $rc); last lines of $log:" >&2
    grep -E "ERROR|runtime error|property failed|Test unit written" "$log" | head -5 >&2
  fi
  rows+=("$(printf '%-20s %6s %12s %8s %8s %5s' "$t" "$took" "${execs:-?}" "${added:-?}" "$crashes" "$rc")")
done
printf '\n%-20s %6s %12s %8s %8s %5s\n' target seconds executions new_units crashes exit
printf '%s\n' "${rows[@]}"
exit $status
