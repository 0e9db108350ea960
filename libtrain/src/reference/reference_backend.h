// The reference backend: every op of backend.h as plain loops over plain tensors, in f32 or f64.
// It is the oracle that other backends and the gradient checks are tested against: written for
// obviousness, not speed (no blocking, no threads).
#pragma once

#include <memory>

#include "slide/train/backend.h"

namespace slide::train {

// With `simulated_conv_workspace`, each convolution pass takes a workspace of
// simulated_conv_workspace_bytes from `alloc` for its length, as cuDNN's passes do on cuda, and
// conv_workspace_bytes reports it: the memory planner's workspace accounting runs and is tested on
// the simulated device (tests/libtrain/test_offload.cpp). Like cuda, it refuses a convolution
// with a tensor past cuDNN's 2^31-1 elements as kResourceExhausted (cuda/conv_plan.h).
std::unique_ptr<Backend> make_reference_backend(Allocator& alloc, bool simulated_conv_workspace = false);

// The simulated workspace of a convolution pass, in bytes of `dtype`: one sample's im2col matrix,
// C*R*S*P*Q elements (what a GEMM-based algorithm lowers one image to); backward data adds one
// sample of dx (C*H*W), backward weights one copy of dw (K*C*R*S), so that the passes differ. A
// model of the kind of bytes cuDNN asks for, not cuDNN's figures (those are the cuda backend's).
// 1x1 convolutions of stride 1 without padding need none (a GEMM on x itself).
size_t simulated_conv_workspace_bytes(ConvPass pass, int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, int64_t R,
                                      int64_t S, int64_t P, int64_t Q, Conv2dParams p, DType dtype);

}  // namespace slide::train
