// The machine's measured FP32 peak for the training benchmark's "fraction of peak": oneDNN's
// sgemm (dnnl_sgemm) on square matrices, threads from OMP_NUM_THREADS; prints the best GFLOP/s.
// usage: sgemm_peak [N=2048] [repeats=5]
#include <dnnl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::atol(argv[1]) : 2048;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  std::vector<float> a(static_cast<size_t>(n * n), 1.0f), b(a), c(a.size(), 0.0f);
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (dnnl_sgemm('N', 'N', n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n) != dnnl_success) return 1;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * n * n * n / s / 1e9);
  }
  std::printf("sgemm n=%ld gflops=%.1f\n", n, best);
  return 0;
}
