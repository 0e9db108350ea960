// The argument checks of backend.h's op list, shared by every backend so that the contract
// (shapes, dtypes, ranges) is enforced once and identically. Each validate_* returns the op's
// extents or kInvalidArgument naming the op and the offending tensor; kUnimplemented when the
// dtype is not one the calling backend has (`dtypes`).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "slide/train/augment.h"
#include "slide/train/backend.h"

namespace slide::train::detail {

// Which floating dtypes a backend implements, whether it reads blocked layouts (tensor.h), and
// on which device its tensors are.
// `device` is where the backend's tensors live: every tensor of a call must be there.
// `half`: f16 and bf16 storage (backend.h, "Half-precision storage"), which a backend sets only
// for the ops that take it (with_half below).
struct DTypes {
  bool f32 = true;
  bool f64 = false;
  bool blocked = false;
  Device device = Device::kCpu;
  bool half = false;
  // Shapes and dtypes only, on whatever device each tensor is: the memory planner asks a backend
  // about its placeholders (on no device) beside the model's weights (on the backend's device).
  bool any_device = false;
};
// `d` with f16 / bf16 storage accepted: for the ops of backend.h's half-precision list.
inline DTypes with_half(DTypes d) {
  d.half = true;
  return d;
}
// `d` for a question about shapes and dtypes only, whatever device each tensor is on (any_device).
inline DTypes shapes_only(DTypes d) {
  d.any_device = true;
  return d;
}
inline bool is_half(DType t) { return t == DType::kF16 || t == DType::kBF16; }

struct ConvDims {
  int64_t N, C, H, W, K, R, S, P, Q;
};
struct BnDims {
  int64_t N, C, HW;
};
struct PoolDims {
  int64_t N, C, H, W, P, Q;
};
struct LinearDims {
  int64_t N, I, O;
};

[[nodiscard]] Result<ConvDims> validate_conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                                       Conv2dParams p, const Tensor& y, DTypes dtypes);
// Also: the weights prepared by `self`, residual (may be null) of y's shape, y not aliasing x.
[[nodiscard]] Result<ConvDims> validate_fused_conv2d_inference(const Backend* self, const Tensor& x,
                                                               const FusedConvWeights& w, Conv2dParams p,
                                                               const Tensor* residual, const Tensor& y, DTypes dtypes);
[[nodiscard]] Result<ConvDims> validate_conv2d_backward_data(const Tensor& dy, const Tensor& w, Conv2dParams p,
                                                             const Tensor& dx, DTypes dtypes);
// With dtypes.half (backend.h, "Half-precision storage"): x and dy of one half type, dw and db
// f32; the batch norm checks below likewise take x, y, dy and dx of one half type with the
// per-channel tensors f32. Without it, every floating tensor of one dtype.
[[nodiscard]] Result<ConvDims> validate_conv2d_backward_weights(const Tensor& x, const Tensor& dy, Conv2dParams p,
                                                                const Tensor& dw, const Tensor& db, DTypes dtypes);
[[nodiscard]] Result<BnDims> validate_batch_norm_training(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                                          const Tensor& running_mean, const Tensor& running_var,
                                                          const Tensor& y, const Tensor& save_mean,
                                                          const Tensor& save_invstd, DTypes dtypes);
[[nodiscard]] Result<BnDims> validate_batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                                           const Tensor& running_mean, const Tensor& running_var,
                                                           const Tensor& y, DTypes dtypes);
// Synchronised batch norm's pieces (backend.h: batch_norm_stats ... batch_norm_backward_elemt):
// x [N,C,H,W] (N may be 0), dy / y / dx of x's shape and the per-channel tensors [C], all in x's
// dtype (with dtypes.half: x, y, dy, dx of one half type and the per-channel tensors f32); the sums f64, plain, on the backend's device: stats [C+1], devs [C], sums [2C].
[[nodiscard]] Result<BnDims> validate_batch_norm_stats(const Tensor& x, const Tensor& stats, DTypes dtypes);
[[nodiscard]] Result<BnDims> validate_batch_norm_deviations(const Tensor& x, const Tensor& stats, const Tensor& devs,
                                                            DTypes dtypes);
[[nodiscard]] Result<BnDims> validate_batch_norm_forward_from_stats(const Tensor& x, const Tensor& gamma,
                                                                    const Tensor& beta, const Tensor& stats,
                                                                    const Tensor& devs, const Tensor& running_mean,
                                                                    const Tensor& running_var, const Tensor& y,
                                                                    const Tensor& save_mean, const Tensor& save_invstd,
                                                                    DTypes dtypes);
[[nodiscard]] Result<BnDims> validate_batch_norm_backward_reduce(const Tensor& x, const Tensor& dy,
                                                                 const Tensor& save_mean, const Tensor& save_invstd,
                                                                 const Tensor& sums, const Tensor& dgamma,
                                                                 const Tensor& dbeta, DTypes dtypes);
[[nodiscard]] Result<BnDims> validate_batch_norm_backward_elemt(const Tensor& x, const Tensor& dy, const Tensor& gamma,
                                                                const Tensor& save_mean, const Tensor& save_invstd,
                                                                const Tensor& stats, const Tensor& sums,
                                                                const Tensor& dx, DTypes dtypes);
[[nodiscard]] Result<BnDims> validate_batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma,
                                                          const Tensor& save_mean, const Tensor& save_invstd,
                                                          const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                                                          DTypes dtypes);
// y (and z when given) have x's shape and dtype.
[[nodiscard]] Status validate_same_shape(const char* op, const Tensor& x, const Tensor& y, const Tensor* z,
                                         DTypes dtypes);
// Forward (y) or backward (dy and dx) of max pooling; the others null.
[[nodiscard]] Result<PoolDims> validate_max_pool(const char* op, const Tensor& x, Pool2dParams p, const Tensor* y,
                                                 const Tensor* dy, const Tensor* dx, DTypes dtypes);
// x[N,C,H,W] and pooled[N,C].
[[nodiscard]] Result<BnDims> validate_global_avg_pool(const char* op, const Tensor& x, const Tensor& pooled,
                                                      DTypes dtypes);
[[nodiscard]] Result<LinearDims> validate_linear(const char* op, const Tensor& x, const Tensor& w, const Tensor* b,
                                                 const Tensor& y, DTypes dtypes);
// x[N,I], dy[N,O], dw[O,I], db[O] or undefined; x and dy of one half type with dw and db f32 where
// dtypes.half (backend.h, "Half-precision storage"), else all of one dtype.
[[nodiscard]] Result<LinearDims> validate_linear_backward_weights(const Tensor& x, const Tensor& dy, const Tensor& dw,
                                                                  const Tensor& db, DTypes dtypes);
// logits/probs[N,C], labels[N] i32 in range, class_weights[C] or undefined, smoothing in [0, 1),
// out[N,C].
[[nodiscard]] Result<LinearDims> validate_cross_entropy(const char* op, const Tensor& logits, const Tensor& labels,
                                                        const Tensor& class_weights, double label_smoothing,
                                                        const Tensor& out, DTypes dtypes);

// --- Attention MIL ops ---
struct MatmulDims {
  int64_t M, K, N;
};
// x and y (and z when given) [R,C] of one shape (the row softmax): returns {R, C} as {N, I, I}.
// add's operands: a, b and y of one dtype (validate_same_shape), or, with dtypes.half, a and y f32
// and b f16 / bf16 (a residual stream in f32 taking a half-precision branch).
[[nodiscard]] Status validate_add(const Tensor& a, const Tensor& b, const Tensor& y, DTypes dtypes);
[[nodiscard]] Result<LinearDims> validate_rows(const char* op, const Tensor& x, const Tensor& y, const Tensor* z,
                                               DTypes dtypes);
// y[M,N] = op(a)[M,K] op(b)[K,N]; y must not share storage with a or b.
[[nodiscard]] Result<MatmulDims> validate_matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                                                 const Tensor& y, DTypes dtypes);

// Backend::upload / download: `host` a plain tensor in host memory, `dev` a plain tensor on
// `device`, same shape and dtype; `op` names the transfer in the message.
// cast: x and y of one shape, plain, on the backend's device, each f32, f16 or bf16 (or f64 where
// the backend has it).
[[nodiscard]] Status validate_cast(const Tensor& x, const Tensor& y, DTypes dtypes);
// gather_augment's shapes: tiles u8 [N,S,S,3], records u8 [B, sizeof(AugmentRecord)], images f32
// [B,3,S,S], plain, on the backend's device. Returns B.
[[nodiscard]] Result<int64_t> validate_gather_augment(const Tensor& tiles, const Tensor& records, const Tensor& images,
                                                      DTypes dtypes);
// A record's index in [0, n) and its crop box inside an S x S tile (host-readable records).
[[nodiscard]] Status validate_augment_record(const AugmentRecord& r, int64_t n, int64_t size);
[[nodiscard]] Status validate_transfer(const char* op, const Tensor& host, const Tensor& dev, Device device);

// --- Vision Transformer ops ---
// x and y [R,C] of one shape, gamma and beta [C], eps > 0: returns {R, C} as {N, I, I}.
[[nodiscard]] Result<LinearDims> validate_layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                                     double eps, const Tensor& y, DTypes dtypes);
// perm a permutation of 0..rank-1 (rank 1..6), y.shape[i] == x.shape[perm[i]], y not sharing x's
// storage.
[[nodiscard]] Status validate_permute(const Tensor& x, const std::vector<int>& perm, const Tensor& y, DTypes dtypes);

// Multi-head self-attention (Backend::attention_forward): qkv [B*T, 3*C] and out [B*T, C], both
// plain, of one dtype that `dtypes` allows and on its device, B = batch >= 1 dividing the rows,
// heads >= 1 dividing C, scale finite, out not sharing qkv's storage. Returns {B, T, H, Dh = C / H}.
// (Defined in attention.cpp, beside the op's default.)
struct AttentionDims {
  int64_t B, T, H, Dh;
};
[[nodiscard]] Result<AttentionDims> validate_attention(const Tensor& qkv, int64_t batch, int64_t heads, double scale,
                                                       const Tensor& out, DTypes dtypes);

}  // namespace slide::train::detail
