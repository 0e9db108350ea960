#!/usr/bin/env bash
# Runs one command of the sanitizer suite (ctest label `sanitize`) and fails when it fails or when
# any process under it (the command, or a binary an e2e test starts) wrote an AddressSanitizer,
# UndefinedBehaviorSanitizer or ThreadSanitizer report. Reports go to files under LOGDIR (emptied first), not only to
# stderr: an e2e test that expects a tool to fail on a corrupt input would otherwise pass when the
# tool failed through a sanitizer finding. Each report stops its process (halt_on_error).
# Leak checking is off: OpenSlide's glib and libtiff keep allocations for the process's life.
#   run_sanitized.sh LOGDIR COMMAND [ARGS...]
set -uo pipefail
logdir=$1
shift
rm -rf "$logdir"
mkdir -p "$logdir"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:detect_stack_use_after_return=0:log_path=$logdir/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logdir/ubsan"
# The ThreadSanitizer build's binaries (tests/fuzz's thread role): scripts/tsan.supp names what is
# suppressed in uninstrumented libraries (OpenSlide's glib, libdeflate) and why. (clang 14's TSan
# runtime also reads UBSAN_OPTIONS, whose log_path then wins: its reports land in ubsan.PID files,
# which fail the entry all the same.)
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:log_path=$logdir/tsan:suppressions=$(cd "$(dirname "$0")/../.." && pwd)/scripts/tsan.supp"
"$@"
rc=$?
shopt -s nullglob
reports=("$logdir"/*)
if ((${#reports[@]} > 0)); then
  for f in "${reports[@]}"; do
    echo "== sanitizer report $f:"
    cat "$f"
  done
  echo "FAILED: ${#reports[@]} sanitizer report(s) under $logdir (command exit $rc)"
  exit 1
fi
exit "$rc"
