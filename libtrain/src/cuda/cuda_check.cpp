#include "cuda_check.h"

#include <string>

#include "cublas_api.h"

namespace slide::train::cuda {
namespace {

// The status of a failed call. cuDNN and cuBLAS may leave the CUDA runtime error of a call of
// their own (an internal cudaMalloc that failed) as this thread's last error, where the next kernel
// launch's check (cudaGetLastError, kernels.h) would report it as its own: cleared here, as
// PyTorch clears it after a cuDNN or out-of-memory error it recovers from. (A sticky error, a
// faulted context, stays: every later call reports it.)
Status make(slide::core::StatusCode code, const char* library, const char* call, const char* where, const char* name,
            const char* text) {
  (void)cudaGetLastError();
  return Status(code, std::string(library) + ": " + call + " failed at " + where + ": " + name + (text ? ": " : "") +
                          (text ? text : ""));
}

}  // namespace

Status cuda_status(cudaError_t error, const char* call, const char* where) {
  using slide::core::StatusCode;
  if (error == cudaSuccess) return slide::core::ok_status();
  StatusCode code = StatusCode::kInternal;
  switch (error) {
    case cudaErrorMemoryAllocation: code = StatusCode::kResourceExhausted; break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInvalidDevice: code = StatusCode::kUnavailable; break;
    case cudaErrorInvalidValue: code = StatusCode::kInvalidArgument; break;
    default: break;
  }
  return make(code, "CUDA", call, where, cudaGetErrorName(error), cudaGetErrorString(error));
}

Status cudnn_status(cudnnStatus_t error, const char* call, const char* where) {
  using slide::core::StatusCode;
  if (error == CUDNN_STATUS_SUCCESS) return slide::core::ok_status();
  // cuDNN 9 groups its codes by thousands: 1xxx not initialised, 2xxx bad parameter, 3xxx not
  // supported, 4xxx internal error, 5xxx execution failed (cudnn_graph.h).
  // The codes of a broken installation or driver first: kUnavailable (cuda_check.h), not a shape
  // cuDNN cannot run (kUnimplemented, which the convolutions answer by trying another algorithm
  // or the unfused path).
  const int value = static_cast<int>(error);
  StatusCode code = StatusCode::kInternal;
  if (error == CUDNN_STATUS_NOT_INITIALIZED || error == CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH ||
      error == CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED || error == CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER ||
      error == CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART ||
      error == CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING ||
      error == CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE)
    code = StatusCode::kUnavailable;
  else if (error == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
      error == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)
    code = StatusCode::kResourceExhausted;
  else if (value / 1000 == 2)
    code = StatusCode::kInvalidArgument;
  else if (value / 1000 == 3)
    code = StatusCode::kUnimplemented;
  return make(code, "cuDNN", call, where, cudnnGetErrorString(error), nullptr);
}

Status cublas_status(cublasStatus_t error, const char* call, const char* where) {
  using slide::core::StatusCode;
  if (error == CUBLAS_STATUS_SUCCESS) return slide::core::ok_status();
  StatusCode code = StatusCode::kInternal;
  switch (error) {
    case CUBLAS_STATUS_ALLOC_FAILED: code = StatusCode::kResourceExhausted; break;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH: code = StatusCode::kUnimplemented; break;
    case CUBLAS_STATUS_INVALID_VALUE: code = StatusCode::kInvalidArgument; break;
    case CUBLAS_STATUS_NOT_INITIALIZED: code = StatusCode::kUnavailable; break;
    default: break;
  }
  // The status's name from cuBLAS itself: loaded by then, as a cuBLAS call returned it.
  auto blas = cublas_api();
  const std::string name = blas.ok() ? (*blas)->cublasGetStatusString(error)
                                     : "cuBLAS status " + std::to_string(static_cast<int>(error));
  return make(code, "cuBLAS", call, where, name.c_str(), nullptr);
}

}  // namespace slide::train::cuda
