// gpu-labelled: runs one kernel on device 0; exits 77 (ctest's skip code) without a device.
#include <doctest/doctest.h>

#include <cstdio>
#include <vector>

#include "device_probe.h"

TEST_CASE("saxpy round trip on device 0") {
  const int n = 1000;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i);
    y[i] = 1.0f;
  }
  REQUIRE(slide::train::cuda::saxpy_roundtrip(n, 2.0f, x.data(), y.data()) == 0);
  for (int i = 0; i < n; ++i) CHECK(y[i] == doctest::Approx(2.0f * i + 1.0f));
}

int main(int argc, char** argv) {
  if (slide::train::cuda::device_count() == 0) {
    std::printf("no CUDA device: skipping gpu tests\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
