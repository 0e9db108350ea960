#!/usr/bin/env bash
# Runs one fuzz target: replays every file of tests/fuzz/regressions/<target>/ (inputs that once
# crashed it; each must now pass), then fuzzes for SECONDS starting from tests/fuzz/corpus/<target>/
# plus what earlier runs found (WORK/corpus/<target>/, outside the source tree), with the tokens of
# tests/fuzz/dict/<target>.dict when there is one. A crash leaves its input in WORK/artifacts/<target>/
# and fails. The ctest entries (label fuzz) and scripts/fuzz.sh call it. SLIDE_FUZZ_SEED=N fixes
# libFuzzer's seed (ctest sets 1; the number of executions in SECONDS still depends on the machine).
#   run_target.sh BINARY SECONDS WORK
set -euo pipefail
bin=$1 seconds=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
t=$(basename "$bin")
mkdir -p "$work/corpus/$t" "$work/artifacts/$t"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

shopt -s nullglob
regressions=("$here/regressions/$t"/*)
if ((${#regressions[@]} > 0)); then
  echo "== $t: replaying ${#regressions[@]} regression input(s)"
  "$bin" -rss_limit_mb=2048 -timeout=20 "${regressions[@]}"
fi
seed_arg=()
if [[ -n "${SLIDE_FUZZ_SEED:-}" ]]; then seed_arg=(-seed="$SLIDE_FUZZ_SEED"); fi
seeds=()
if [[ -d "$here/corpus/$t" ]]; then seeds=("$here/corpus/$t"); fi
# dict/<target>.dict, when there is one: tokens libFuzzer splices into inputs (JSON keys, values).
dict_arg=()
if [[ -f "$here/dict/$t.dict" ]]; then dict_arg=(-dict="$here/dict/$t.dict"); fi
echo "== $t: fuzzing for $seconds s"
exec "$bin" "${seed_arg[@]}" "${dict_arg[@]}" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$work/artifacts/$t/" "$work/corpus/$t" "${seeds[@]}"
