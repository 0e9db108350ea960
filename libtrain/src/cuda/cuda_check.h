// Every CUDA runtime, cuDNN and cuBLAS call of the cuda backend goes through one of the macros
// below, which turn a failure into a Status naming the call, the source line and the library's
// own error name and text. The mapping keeps the engine's error vocabulary (status.h):
//   out of device memory (cudaErrorMemoryAllocation, cuDNN's *_ALLOCATION_FAILED, cuBLAS's
//   ALLOC_FAILED)                                   -> kResourceExhausted, so OOM recovery,
//                                                      --batch-size auto and the planner work
//                                                      on the GPU as on the CPU;
//   no device, no or too old a driver               -> kUnavailable;
//   cuDNN NOT_SUPPORTED, cuBLAS NOT_SUPPORTED /
//   ARCH_MISMATCH                                   -> kUnimplemented;
//   cuDNN BAD_PARAM, cuBLAS INVALID_VALUE           -> kInvalidArgument (a bug of ours: the op
//                                                      checks run first);
//   anything else (launch failures, illegal address, internal errors)  -> kInternal.
// Only src/cuda/ includes this header (CUDA types stay out of public headers).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "slide/core/status.h"

namespace slide::train::cuda {

using slide::core::Status;

// `call` is the call's text, `where` "file:line". OK for success.
Status cuda_status(cudaError_t error, const char* call, const char* where);
Status cudnn_status(cudnnStatus_t error, const char* call, const char* where);
Status cublas_status(cublasStatus_t error, const char* call, const char* where);

}  // namespace slide::train::cuda

#define SLIDE_CUDA_STR2(x) #x
#define SLIDE_CUDA_STR(x) SLIDE_CUDA_STR2(x)
#define SLIDE_CUDA_WHERE __FILE__ ":" SLIDE_CUDA_STR(__LINE__)

#define SLIDE_CUDA_CHECK(call) \
  SLIDE_RETURN_IF_ERROR(::slide::train::cuda::cuda_status((call), #call, SLIDE_CUDA_WHERE))
#define SLIDE_CUDNN_CHECK(call) \
  SLIDE_RETURN_IF_ERROR(::slide::train::cuda::cudnn_status((call), #call, SLIDE_CUDA_WHERE))
#define SLIDE_CUBLAS_CHECK(call) \
  SLIDE_RETURN_IF_ERROR(::slide::train::cuda::cublas_status((call), #call, SLIDE_CUDA_WHERE))
// After a kernel launch: launch-configuration errors are reported by cudaGetLastError at once;
// errors while the kernel runs surface at the next synchronising call.
#define SLIDE_CUDA_CHECK_LAUNCH(what) \
  SLIDE_RETURN_IF_ERROR(::slide::train::cuda::cuda_status(cudaGetLastError(), what, SLIDE_CUDA_WHERE))
