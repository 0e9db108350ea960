// cuBLAS, opened by the cuda backend when it first needs it (dlopen) instead of linked: linking
// cuBLAS loads cuBLASLt, whose static initialisers take about 0.12 s and 215 MB of resident memory
// in every process that links it, before main (measured 2026-11-29: an empty program linked with
// -lcublas, /usr/bin/time: 0.11-0.13 s and 220 MB against 0.00 s and 4 MB with cudart, cuDNN and
// NCCL alone). Every CPU run of slide-train and slide-embed paid it, and --help, each rank of the
// launcher and each sweep trial.
//
// The functions are those of cublas_v2.h, under their cublas_v2.h names (the members below are
// declared through the same macros, cublasCreate -> cublasCreate_v2, ...), so a call reads
// blas->cublasGemmEx(...) and the error names it. The library is the one this build compiled
// against: libcublas.so.<CUDA major> (SLIDE_CUBLAS_SONAME), looked up as the loader looks up any
// library (the executable's RUNPATH, LD_LIBRARY_PATH, ldconfig's cache), then at the toolkit's
// path this build was configured with (SLIDE_CUBLAS_PATH). Only src/cuda/ includes this header.
#pragma once

#include <cublas_v2.h>

#include "slide/core/status.h"

namespace slide::train::cuda {

// cublasGemmEx and cublasGemmStridedBatchedEx have C++ overloads besides (cublas_api.h's wrappers
// taking a cudaDataType compute type): their pointers' types are the C functions' signatures,
// which cublas_api.cpp checks against the declarations (the cast selects that overload exactly or
// does not compile).
using CublasGemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                        const void*, const void*, cudaDataType, int, const void*, cudaDataType, int,
                                        const void*, void*, cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
using CublasGemmStridedBatchedEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                                      int, const void*, const void*, cudaDataType, int, long long int,
                                                      const void*, cudaDataType, int, long long int, const void*,
                                                      void*, cudaDataType, int, long long int, int, cublasComputeType_t,
                                                      cublasGemmAlgo_t);

// The cuBLAS functions the cuda backend calls: X(name, pointer type).
#define SLIDE_CUBLAS_FUNCTIONS(X)                                                                     \
  X(cublasCreate, decltype(&::cublasCreate))                                                          \
  X(cublasDestroy, decltype(&::cublasDestroy))                                                        \
  X(cublasSetStream, decltype(&::cublasSetStream))                                                    \
  X(cublasSetMathMode, decltype(&::cublasSetMathMode))                                                \
  X(cublasGetStatusString, decltype(&::cublasGetStatusString))                                        \
  X(cublasGemmEx, ::slide::train::cuda::CublasGemmEx)                                                 \
  X(cublasGemmStridedBatchedEx, ::slide::train::cuda::CublasGemmStridedBatchedEx)

struct CublasApi {
#define SLIDE_CUBLAS_MEMBER(f, T) T f = nullptr;
  SLIDE_CUBLAS_FUNCTIONS(SLIDE_CUBLAS_MEMBER)
#undef SLIDE_CUBLAS_MEMBER
};

// The process's cuBLAS, opened on the first call (thread-safe) and kept open; later calls return
// the same table, or the same error. Errors: kUnavailable naming the library and the loader's
// message when it cannot be opened, or the function it lacks (another cuBLAS than this build's).
[[nodiscard]] slide::core::Result<const CublasApi*> cublas_api();

// The library's file name, as dlopen is given it first (libcublas.so.<CUDA major>).
const char* cublas_library_name();

}  // namespace slide::train::cuda
