// The cuda backend's error mapping (cuda_check.h), which needs the CUDA libraries but no device:
// it runs in every CUDA build (label unit).
#include <doctest/doctest.h>
#include <dlfcn.h>

#include <cstring>
#include <string>

#include "../../libtrain/src/cuda/cublas_api.h"
#include "../../libtrain/src/cuda/cuda_check.h"

using slide::core::StatusCode;
using namespace slide::train::cuda;

namespace {

// Whether cuBLAS was in the process before main: this binary links slide::train (the cuda backend
// with it) and does not link cuBLAS, as the tools do not.
const bool cublas_loaded_at_start = [] {
  void* lib = dlopen(cublas_library_name(), RTLD_NOW | RTLD_NOLOAD);
  if (lib != nullptr) dlclose(lib);
  return lib != nullptr;
}();

}  // namespace

TEST_CASE("cuBLAS is opened on first use, not at process start (cublas_api.h)") {
  CHECK_FALSE(cublas_loaded_at_start);
  auto blas = cublas_api();
  REQUIRE_MESSAGE(blas.ok(), blas.status().to_string());
  // Calls go through the table into the library: no device needed for these two.
  const std::string text = (*blas)->cublasGetStatusString(CUBLAS_STATUS_NOT_INITIALIZED);
  CHECK(text.find("not initialized") != std::string::npos);  // cuBLAS 13: "the library was not initialized"
  int version = 0;
  void* lib = dlopen(cublas_library_name(), RTLD_NOW | RTLD_NOLOAD);
  CHECK(lib != nullptr);
  if (lib != nullptr) {
    // cublasGetProperty needs no handle: the library answers with its own major version, the one
    // the file name promises (libcublas.so.<major>).
    using GetProperty = cublasStatus_t (*)(libraryPropertyType, int*);
    void* sym = dlsym(lib, "cublasGetProperty");
    REQUIRE(sym != nullptr);
    GetProperty get_property = nullptr;
    std::memcpy(&get_property, &sym, sizeof(sym));
    CHECK(get_property(MAJOR_VERSION, &version) == CUBLAS_STATUS_SUCCESS);
    CHECK(std::string(cublas_library_name()) == "libcublas.so." + std::to_string(version));
    dlclose(lib);
  }
  auto again = cublas_api();
  REQUIRE(again.ok());
  CHECK(*again == *blas);  // opened once
  // A cuBLAS error's message carries cuBLAS's own text for it.
  const std::string failed = (*blas)->cublasGetStatusString(CUBLAS_STATUS_EXECUTION_FAILED);
  CHECK(!failed.empty());
  CHECK(failed != text);
  CHECK(cublas_status(CUBLAS_STATUS_EXECUTION_FAILED, "c", "w").message().find(failed) != std::string::npos);
}

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
