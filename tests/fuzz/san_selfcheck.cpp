// The sanitizer suite's self-check (ctest sanitize_asan_selfcheck, on tests/sanitize's ASan
// build): a heap-buffer-overflow read, which AddressSanitizer must report; the entry passes only
// when run_sanitized.sh's output holds that report. If this entry ever fails, the sanitizer
// suite's other entries prove nothing (instrumentation lost, reports not seen).
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char**) {
  std::vector<int> v(static_cast<size_t>(4 + argc % 2));
  volatile int* p = v.data();
  const int past_the_end = p[v.size() + 1];
  std::printf("read %d past the end\n", past_the_end);
  return 0;
}
