// Launch geometry of the cuda backend's own kernels, in plain C++ so that it is unit-tested on the
// CPU. Every element-wise kernel is a grid-stride loop (each thread handles elements i, i + grid *
// block, ...), so any n is covered by a bounded grid.
#pragma once

#include <algorithm>
#include <cstdint>

namespace slide::train::kernels {

struct Launch1d {
  int64_t blocks = 0;  // 0 when n == 0: launch nothing
  int threads = 0;
};

// Blocks of `threads` for n elements: ceil(n / threads), at most max_blocks (then each thread loops).
// 256 threads and 65,535 x 8 blocks cover an H100's 132 SMs at full occupancy many times over.
inline Launch1d launch_1d(int64_t n, int threads = 256, int64_t max_blocks = 65535 * 8) {
  if (n <= 0) return {};
  return {std::min<int64_t>((n + threads - 1) / threads, max_blocks), threads};
}

}  // namespace slide::train::kernels
