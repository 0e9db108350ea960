// The ThreadSanitizer entries' self-check (ctest sanitize_tsan_selfcheck, on tests/sanitize's
// TSan build): two threads increment one plain int with no synchronisation, a data race that
// ThreadSanitizer must report; the entry passes only when run_sanitized.sh's output holds that
// report. If this entry ever fails, the tsan entries prove nothing (instrumentation lost, reports
// not seen).
#include <cstdio>
#include <thread>

namespace {
int counter = 0;  // deliberately unsynchronised
void bump() {
  for (int i = 0; i < 100000; ++i) counter = counter + 1;
}
}  // namespace

int main() {
  std::thread a(bump), b(bump);
  a.join();
  b.join();
  std::printf("counter %d\n", counter);
  return 0;
}
