// The cuda backend's error mapping (cuda_check.h), which needs the CUDA libraries but no device:
// it runs in every CUDA build (label unit).
#include <doctest/doctest.h>

#include <string>

#include "../../libtrain/src/cuda/cuda_check.h"

using slide::core::StatusCode;
using namespace slide::train::cuda;

TEST_CASE("CUDA runtime errors: out of memory is RESOURCE_EXHAUSTED, no device UNAVAILABLE; the call is named") {
  CHECK(cuda_status(cudaSuccess, "x", "f:1").ok());
  auto oom = cuda_status(cudaErrorMemoryAllocation, "cudaMalloc(&p, 1 << 40)", "cuda_backend.cpp:42");
  CHECK(oom.code() == StatusCode::kResourceExhausted);
  CHECK(oom.message().find("cudaMalloc(&p, 1 << 40) failed at cuda_backend.cpp:42: cudaErrorMemoryAllocation") !=
        std::string::npos);
  CHECK(cuda_status(cudaErrorNoDevice, "c", "w").code() == StatusCode::kUnavailable);
  CHECK(cuda_status(cudaErrorInsufficientDriver, "c", "w").code() == StatusCode::kUnavailable);
  CHECK(cuda_status(cudaErrorIllegalAddress, "c", "w").code() == StatusCode::kInternal);
}

TEST_CASE("cuDNN and cuBLAS errors map to the engine's codes") {
  CHECK(cudnn_status(CUDNN_STATUS_SUCCESS, "x", "w").ok());
  CHECK(cudnn_status(CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED, "c", "w").code() ==
        StatusCode::kResourceExhausted);
  CHECK(cudnn_status(CUDNN_STATUS_NOT_SUPPORTED, "c", "w").code() == StatusCode::kUnimplemented);
  auto bad = cudnn_status(CUDNN_STATUS_BAD_PARAM, "cudnnConvolutionForward(...)", "f:7");
  CHECK(bad.code() == StatusCode::kInvalidArgument);
  CHECK(bad.message().find("cuDNN: cudnnConvolutionForward(...) failed at f:7: CUDNN_STATUS_BAD_PARAM") !=
        std::string::npos);
  CHECK(cublas_status(CUBLAS_STATUS_SUCCESS, "x", "w").ok());
  CHECK(cublas_status(CUBLAS_STATUS_ALLOC_FAILED, "c", "w").code() == StatusCode::kResourceExhausted);
  CHECK(cublas_status(CUBLAS_STATUS_NOT_SUPPORTED, "c", "w").code() == StatusCode::kUnimplemented);
  CHECK(cublas_status(CUBLAS_STATUS_EXECUTION_FAILED, "c", "w").message().find("cuBLAS") != std::string::npos);
}
