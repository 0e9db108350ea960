// Host-side logic of the cuda backend's convolutions, in plain C++ (no CUDA types) so that it is
// unit-tested on the CPU: the algorithm-cache key, and the order in which cuDNN's candidate
// algorithms are tried.
//
// cuDNN's heuristics (cudnnGetConvolution*Algorithm_v7) return candidates sorted by expected
// speed, each with a status, a workspace size and whether it is deterministic. We try, in that
// order, only candidates that cuDNN can run and that are deterministic (so that two runs, and N
// ranks against one, give the same bits: the project's invariant); the first whose workspace the
// budgeted allocator grants is used and cached for the shape. A workspace refused by the budget
// moves on to the next (usually smaller) candidate instead of failing the step. A convolution for
// which cuDNN has no deterministic algorithm (choose_candidates) runs on its non-deterministic
// ones, with a warning naming it, rather than stopping the run: PyTorch's default does the same
// (torch.backends.cudnn.deterministic off), and a first GPU run should not end on a
// configuration nobody could try beforehand.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "slide/train/backend.h"

namespace slide::train::cuda {

// The math of the cuda backend's products at a MathPrecision (backend.h), as plain values:
//   convolutions: kFma is CUDNN_FMA_MATH (FMA kernels only: exact f32), kTensorOp is
//     CUDNN_DEFAULT_MATH, which on Ampere and newer permits TF32 tensor cores for f32 tensors
//     (PyTorch's torch.backends.cudnn.allow_tf32 chooses between the same two). cuDNN's legacy
//     calls have no bf16 compute for f32 tensors, so kBf16 convolutions run in TF32 (more accurate
//     than bf16, as the contract allows). kTensorOpConvert (kFp16) is
//     CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION: f32 tensors down-converted to f16 for tensor cores.
//   GEMMs (linear, matmul, attention): cuBLAS's compute type for f32 A, B and C: CUBLAS_COMPUTE_32F,
//     CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_32F_FAST_16BF ("allows down-converting inputs
//     to bfloat16 or TF32", cublas_api.h) or CUBLAS_COMPUTE_32F_FAST_16F (to half or TF32).
enum class ConvMath : uint8_t { kFma = 0, kTensorOp = 1, kTensorOpConvert = 2 };
enum class GemmCompute : uint8_t { kF32 = 0, kF32FastTf32 = 1, kF32Fast16Bf = 2, kF32Fast16F = 3 };
inline ConvMath conv_math(MathPrecision p) {
  switch (p) {
    case MathPrecision::kTf32:
    case MathPrecision::kBf16:
      return ConvMath::kTensorOp;
    case MathPrecision::kFp16:
      return ConvMath::kTensorOpConvert;
    case MathPrecision::kFp32:
      break;
  }
  return ConvMath::kFma;
}
inline GemmCompute gemm_compute(MathPrecision p) {
  switch (p) {
    case MathPrecision::kTf32:
      return GemmCompute::kF32FastTf32;
    case MathPrecision::kBf16:
      return GemmCompute::kF32Fast16Bf;
    case MathPrecision::kFp16:
      return GemmCompute::kF32Fast16F;
    case MathPrecision::kFp32:
      break;
  }
  return GemmCompute::kF32;
}

// kForwardFused: cudnnConvolutionBiasActivationForward (Backend::fused_conv2d_inference), whose
// algorithm is chosen and cached apart from the plain forward's.
enum class ConvDirection : uint8_t { kForward = 0, kBackwardData = 1, kBackwardFilter = 2, kForwardFused = 3 };

// The tensors' storage type: f32, or the half-precision storage of the inference graph (backend.h).
enum class ConvStorage : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

struct ConvKey {
  ConvDirection direction = ConvDirection::kForward;
  int64_t N = 0, C = 0, H = 0, W = 0, K = 0, R = 0, S = 0;
  int stride = 1, pad = 0;
  ConvMath math = ConvMath::kFma;  // an algorithm chosen for FMA math is not the tensor-op one's
  ConvStorage storage = ConvStorage::kF32;  // nor one chosen for f32 tensors the f16 one's
  bool nhwc = false;                        // nor NCHW's the channels-last one's
  bool operator==(const ConvKey&) const = default;
};

struct ConvKeyHash {
  size_t operator()(const ConvKey& k) const {
    size_t h = static_cast<size_t>(k.direction);
    for (int64_t v : {k.N, k.C, k.H, k.W, k.K, k.R, k.S, int64_t{k.stride}, int64_t{k.pad}, static_cast<int64_t>(k.math),
                      static_cast<int64_t>(k.storage), int64_t{k.nhwc}})
      h = h * 1000003u ^ std::hash<int64_t>{}(v);
    return h;
  }
};

// Whether an N x C x H x W tensor fits cuDNN's legacy descriptors: int dimensions and strides, so at
// most 2^31 - 1 elements (PyTorch splits the batch of a larger convolution for the same reason:
// "cudnn: tensor too large"). A larger one is refused as kResourceExhausted, so that a step's
// out-of-memory recovery and the planner's search treat it as a micro-batch too large to run.
inline bool fits_cudnn_descriptor(int64_t n, int64_t c, int64_t h, int64_t w) {
  constexpr int64_t kMax = 2147483647;
  if (n < 0 || c < 0 || h < 0 || w < 0) return false;
  int64_t e = 1;
  for (int64_t d : {n, c, h, w}) {
    if (d > kMax || (d > 0 && e > kMax / d)) return false;
    e *= d;
  }
  return true;
}

// One of cuDNN's answers (cudnnConvolution*AlgoPerf_t), reduced to what the choice needs.
struct AlgoCandidate {
  int algo = 0;
  bool runnable = false;       // status == CUDNN_STATUS_SUCCESS
  bool deterministic = false;  // determinism == CUDNN_DETERMINISTIC
  size_t workspace_bytes = 0;
  int math_type = -1;  // the cudnnMathType_t it was reported with (perf.mathType); -1: none
};

// The candidates to try, in order: runnable and deterministic ones in cuDNN's order; then, only
// when `allow_nondeterministic`, runnable non-deterministic ones. Duplicates (the same algorithm
// with the same math type listed twice) are kept once; the same algorithm with another math type
// (cuDNN's heuristics list one per math type under tensor-op math, each with its own workspace
// and kernels) is another candidate.
inline std::vector<AlgoCandidate> order_candidates(const std::vector<AlgoCandidate>& candidates,
                                                   bool allow_nondeterministic) {
  std::vector<AlgoCandidate> out;
  auto add = [&](const AlgoCandidate& c) {
    for (const auto& o : out)
      if (o.algo == c.algo && o.math_type == c.math_type) return;
    out.push_back(c);
  };
  for (const auto& c : candidates)
    if (c.runnable && c.deterministic) add(c);
  if (allow_nondeterministic)
    for (const auto& c : candidates)
      if (c.runnable && !c.deterministic) add(c);
  return out;
}

// The candidates a convolution tries: the deterministic ones (order_candidates) when cuDNN has
// any; else its runnable non-deterministic ones, *deterministic then false (the caller warns).
// Empty: cuDNN can run nothing for the shape.
inline std::vector<AlgoCandidate> choose_candidates(const std::vector<AlgoCandidate>& candidates,
                                                    bool* deterministic) {
  std::vector<AlgoCandidate> out = order_candidates(candidates, false);
  *deterministic = !out.empty();
  if (out.empty()) out = order_candidates(candidates, true);
  return out;
}

// A convolution's key in words, for messages: "backward filter 256x64x56x56 (f16, channels last)
// * 64x3x3, stride 1, pad 1, tensor-op math".
inline std::string describe(const ConvKey& k) {
  static const char* const kDirection[] = {"forward", "backward data", "backward filter", "fused forward"};
  static const char* const kStorage[] = {"f32", "f16", "bf16"};
  static const char* const kMath[] = {"FMA math", "tensor-op math", "tensor-op math with f16 conversion"};
  auto n = [](int64_t v) { return std::to_string(v); };
  return std::string(kDirection[static_cast<int>(k.direction)]) + " " + n(k.N) + "x" + n(k.C) + "x" + n(k.H) + "x" +
         n(k.W) + " (" + kStorage[static_cast<int>(k.storage)] + (k.nhwc ? ", channels last" : "") + ") * " + n(k.K) +
         "x" + n(k.R) + "x" + n(k.S) + ", stride " + std::to_string(k.stride) + ", pad " + std::to_string(k.pad) +
         ", " + kMath[static_cast<int>(k.math)];
}

}  // namespace slide::train::cuda
