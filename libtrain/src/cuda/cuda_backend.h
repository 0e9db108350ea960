// The `cuda` backend: backend.h's op list on an NVIDIA GPU, f32. Convolutions on cuDNN's legacy
// (fixed-function) API, linear layers and matmul on cuBLAS, everything else on our own kernels
// (kernels.cu), whose per-element arithmetic is the reference backend's (kernels/formulas.h).
//
// Why cuDNN's legacy convolution calls rather than its graph API: each maps one to one onto an op
// of the list (forward, backward data, backward filter), they take the workspace we allocate from
// the budgeted allocator, and their heuristics report determinism per algorithm (our bit-for-bit
// invariants need deterministic ones). cuDNN 9 still ships and supports them (libcudnn_cnn); the
// graph API, through the cudnn-frontend C++ library (not packaged with the toolkit), is the way to
// the fused conv-bias-add-ReLU inference path (issue 11, step 0) and will replace these calls as
// fusion lands. Batch norm uses our kernels so that its statistics (biased variance to normalise,
// unbiased for the running average, saved inverse std) match the op list's definition exactly.
//
// Precision: f32 storage throughout. The products follow the backend's MathPrecision (backend.h,
// --precision): fp32 asks cuDNN for FMA math (CUDNN_FMA_MATH: no TF32 tensor cores) and cuBLAS
// for CUBLAS_COMPUTE_32F (no TF32 unless NVIDIA_TF32_OVERRIDE=1 is set in the environment); tf32
// and bf16 let cuDNN use TF32 tensor cores (CUDNN_DEFAULT_MATH) and give cuBLAS the
// CUBLAS_COMPUTE_32F_FAST_TF32 / _FAST_16BF compute types (conv_plan.h). Half-precision storage
// (fp16 activations with loss scaling) is not built yet.
//
// Device state: one stream, one cuDNN handle, one cuBLAS handle and one caching allocator per
// device, created on first use and kept for the life of the process (tensors may outlive any one
// Backend object). Every kernel and library call is queued on that stream, so device memory can be
// reused in stream order (caching_allocator.h). Calls that return a number to the host (the loss,
// a label check, download) synchronise the stream. Threads: one thread calls a device's ops (the
// one that made the backend, whose current device make_cuda_backend sets); cuDNN and cuBLAS
// handles are not shared across threads.
#pragma once

#include <memory>

#include "slide/train/backend.h"
#include "slide/train/caching_allocator.h"

namespace slide::train::cuda {

// The number of devices this process sees (after CUDA_VISIBLE_DEVICES). Unlike device_probe.h's
// device_count, which says 0, a missing driver is an error: kUnavailable with CUDA's error text.
[[nodiscard]] Result<int> usable_device_count();

// A backend on GPU `device`. Errors: kUnavailable when there is no driver, no device, or no
// device `device` (the message says which, with CUDA's error text).
[[nodiscard]] Result<std::unique_ptr<Backend>> make_cuda_backend(int device);

// The device's caching allocator (created on first use). Errors: those of make_cuda_backend.
[[nodiscard]] Result<CachingDeviceAllocator*> device_allocator(int device);

}  // namespace slide::train::cuda
