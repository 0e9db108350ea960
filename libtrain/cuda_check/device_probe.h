// Minimal CUDA probe: device count and a round trip through one kernel.
#pragma once

namespace slide::train::cuda {

// Number of CUDA devices usable by this process; 0 when there is no device or no driver.
int device_count();

// Runs y[i] = a * x[i] + y[i] for n floats on device 0 and copies y back. Returns 0 on success,
// else the cudaError_t value. Requires device_count() > 0.
int saxpy_roundtrip(int n, float a, const float* x, float* y);

}  // namespace slide::train::cuda
