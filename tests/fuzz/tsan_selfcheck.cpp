// The ThreadSanitizer entries' self-check (ctest sanitize_tsan_selfcheck, WILL_FAIL): two threads
// increment one plain int with no synchronisation, a data race that ThreadSanitizer must report
// and run_sanitized.sh must turn into a failed entry. If this entry ever passes, the tsan entries
// prove nothing (instrumentation lost, reports not seen).
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
