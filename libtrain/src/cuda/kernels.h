// The cuda backend's own kernels (cuDNN and cuBLAS do convolution and matrix products). Each
// launcher queues its kernel on `stream` and returns cudaGetLastError(): launch errors at once,
// errors while running at the next synchronising call. The per-element arithmetic is
// kernels/formulas.h's, the same functions the reference backend runs on the CPU.
//
// Shapes are the op list's (backend.h); tensors are f32, row-major, on the device, except where a
// launcher takes a CastType: f16 / bf16 storage (backend.h, "Half-precision storage"), 16-bit
// patterns converted by formulas.h, arithmetic in f32 (or double for sums). Per-channel
// reductions accumulate in double, in one block per channel (or row), so their results differ from
// the CPU's only by the order of the additions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "slide/train/augment.h"

namespace slide::train::cuda {

enum class Unary { kRelu, kTanh, kSigmoid, kGelu };
// kGelu's gradient is taken from the forward's input x (passed as `y` below), the others' from
// the output.
enum class UnaryGrad { kRelu, kTanh, kSigmoid, kGelu };
enum class Binary { kAdd, kMul };

// CastType is declared here for the half-precision launchers (it also names cast's types below).
enum class CastType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// y = f(x) over n elements (y may be x), x and y of storage t.
cudaError_t launch_unary(Unary f, CastType t, const void* x, void* y, int64_t n, cudaStream_t stream);
// dx = f'(y) dy over n elements, from the forward's output y; y, dy and dx of storage t (in f32,
// rounded once).
cudaError_t launch_unary_grad(UnaryGrad f, CastType t, const void* y, const void* dy, void* dx, int64_t n,
                              cudaStream_t stream);
// y = a op b over n elements (y may be a or b), a and y of storage ta and b of tb: ta == tb, or ta
// f32 and tb half (an f32 residual taking a half-precision branch). Other pairs:
// cudaErrorInvalidValue.
cudaError_t launch_binary(Binary op, CastType ta, const void* a, CastType tb, const void* b, void* y, int64_t n,
                          cudaStream_t stream);
// y[r, c] = row[c] for y [rows, cols] of storage t (a linear layer's bias, which the GEMM then adds
// to with beta = 1: one rounding of bias + product).
cudaError_t launch_fill_rows(CastType t, void* y, const void* row, int64_t rows, int64_t cols, cudaStream_t stream);

// y[n, k, i] += b[k] for y [N, K, inner] (the bias of a convolution, inner = P Q, or of a linear
// layer, inner = 1).
cudaError_t launch_bias_add(float* y, const float* b, int64_t N, int64_t K, int64_t inner, cudaStream_t stream);
// db[k] += sum over n, i of dy[n, k, i] (the bias gradient, same layouts), summed in double from dy
// of storage t; db f32.
cudaError_t launch_bias_grad(CastType t, const void* dy, float* db, int64_t N, int64_t K, int64_t inner,
                             cudaStream_t stream);

// Batch norm over x [N, C, HW] (backend.h). Training writes y, save_mean, save_invstd and updates
// the running statistics; backward overwrites dx and accumulates dgamma, dbeta. x, y, dy and dx are
// of storage t (f32, or f16 / bf16 for half-precision activations: read as f32 values, each output
// rounded once), NCHW, or channels last when nhwc (stored [N][HW][C]: channels-last training);
// gamma, beta, the running and saved statistics and dgamma, dbeta are f32. Each channel is cut into
// kernels::bn_segments(N, HW, nhwc) segments whose partial sums are reduced per channel in a fixed
// order: NCHW a block per channel segment, channels last a block per 32 channels of a segment of
// rows (kernels::bn_nhwc_segment); `scratch` is the caller's device f64 array of
// kernels::bn_forward_scratch_doubles / bn_backward_scratch_doubles (N, C, HW, nhwc) values.
// Batch norm + ReLU (backend.h batch_norm_relu_*): `relu` applies ReLU to the stored y; `relu_y`
// (that op's output, of x's storage and layout; null: none) masks dy as relu_backward would, as
// the backward passes read it.
cudaError_t launch_bn_forward_training(CastType t, bool nhwc, const void* x, const float* gamma, const float* beta,
                                       double eps, double momentum, float* running_mean, float* running_var, void* y,
                                       float* save_mean, float* save_invstd, bool relu, int64_t N, int64_t C,
                                       int64_t HW, double* scratch, cudaStream_t stream);
cudaError_t launch_bn_forward_inference(CastType t, bool nhwc, const void* x, const float* gamma, const float* beta,
                                        const float* running_mean, const float* running_var, double eps, void* y,
                                        int64_t N, int64_t C, int64_t HW, cudaStream_t stream);
cudaError_t launch_bn_backward(CastType t, bool nhwc, const void* x, const void* dy, const void* relu_y,
                               const float* gamma, const float* save_mean, const float* save_invstd, void* dx,
                               float* dgamma, float* dbeta, int64_t N, int64_t C, int64_t HW, double* scratch,
                               cudaStream_t stream);

// Synchronised batch norm's pieces (backend.h: batch_norm_stats ... batch_norm_backward_elemt), with
// the storage and layout rule above (NCHW or channels last, as the backend's pieces take them).
// The one-rank launches are these pieces run in turn, so over one rank
// the two agree bit for bit. The sums are f64 device arrays: stats [C+1] (count at C), devs [C],
// sums [2C]; `partials` is the caller's f64 scratch of kernels::bn_partials (N, C, HW, nhwc) values (twice
// that for backward_reduce). N may be 0.
cudaError_t launch_bn_stats(CastType t, bool nhwc, const void* x, double* stats, int64_t N, int64_t C, int64_t HW,
                            double* partials, cudaStream_t stream);
cudaError_t launch_bn_deviations(CastType t, bool nhwc, const void* x, const double* stats, double* devs, int64_t N,
                                 int64_t C, int64_t HW, double* partials, cudaStream_t stream);
cudaError_t launch_bn_forward_from_stats(CastType t, bool nhwc, const void* x, const float* gamma, const float* beta,
                                         const double* stats, const double* devs, double eps, double momentum,
                                         float* running_mean, float* running_var, void* y, float* save_mean,
                                         float* save_invstd, bool relu, int64_t N, int64_t C, int64_t HW,
                                         cudaStream_t stream);
cudaError_t launch_bn_backward_reduce(CastType t, bool nhwc, const void* x, const void* dy, const void* relu_y,
                                      const float* save_mean, const float* save_invstd, double* sums, float* dgamma,
                                      float* dbeta, int64_t N, int64_t C, int64_t HW, double* partials,
                                      cudaStream_t stream);
cudaError_t launch_bn_backward_elemt(CastType t, bool nhwc, const void* x, const void* dy, const void* relu_y,
                                     const float* gamma, const float* save_mean, const float* save_invstd,
                                     const double* stats, const double* sums, void* dx, int64_t N, int64_t C,
                                     int64_t HW, cudaStream_t stream);

// Max pooling of x [N, C, H, W] to y [N, C, P, Q] of storage t (f32, or half-precision
// activations), both NCHW or both channels last (nhwc: x [N, H, W, C] and y [N, P, Q, C] as
// stored), the first maximum of each window; backward (x, dy, dx alike) gathers, for each input
// position, dy of the windows whose first maximum it is, in output order (the CPU's order:
// bit-identical sums), in f32, rounded once.
cudaError_t launch_max_pool_forward(CastType t, bool nhwc, const void* x, void* y, int64_t N, int64_t C, int64_t H,
                                    int64_t W, int64_t P, int64_t Q, int kernel, int stride, int pad,
                                    cudaStream_t stream);
// The fused inference convolution's epilogue on storage t: y = ReLU(c + b[k] + z) over [N, K, inner]
// ([N, inner, K] when nhwc; c, z, y alike; no ReLU unless `relu`; z null: none), in f32, rounded
// once; y may be c or z.
cudaError_t launch_conv_epilogue(CastType t, bool nhwc, const void* c, const void* b, const void* z, void* y, int64_t N,
                                 int64_t K, int64_t inner, bool relu, cudaStream_t stream);
cudaError_t launch_max_pool_backward(CastType t, bool nhwc, const void* x, const void* dy, void* dx, int64_t N,
                                     int64_t C, int64_t H, int64_t W, int64_t P, int64_t Q, int kernel, int stride,
                                     int pad, cudaStream_t stream);
// y[n, c] = mean of x's HW values of (n, c); dx's values of (n, c) = dy[n, c] / HW; x and dx NCHW,
// or channels last when nhwc ([N][HW][C]); y and dy [N, C]; storage t, in double, rounded to f32
// then t.
cudaError_t launch_global_avg_pool_forward(CastType t, bool nhwc, const void* x, void* y, int64_t N, int64_t C,
                                           int64_t HW, cudaStream_t stream);
cudaError_t launch_global_avg_pool_backward(CastType t, bool nhwc, const void* dy, void* dx, int64_t N, int64_t C,
                                            int64_t HW, cudaStream_t stream);

// Row softmax of x [R, C] and its backward. The second forward takes rows ld apart (ld >= C, in x
// and y alike; attention pads its score rows to kernels::attention_scores_ld, and the values past C
// are not touched) and writes y of storage ty (attention's probabilities in half precision, the
// operand of its second GEMM).
cudaError_t launch_softmax_forward(const float* x, float* y, int64_t R, int64_t C, cudaStream_t stream);
cudaError_t launch_softmax_forward(const float* x, CastType ty, void* y, int64_t R, int64_t C, int64_t ld,
                                   cudaStream_t stream);
cudaError_t launch_softmax_backward(const float* y, const float* dy, float* dx, int64_t R, int64_t C,
                                    cudaStream_t stream);

// Softmax cross-entropy (backend.h; the weighted smoothed target of kernels/formulas.h). `sums` is
// device scratch of 2 + 2N doubles (forward: the two totals {sum_n -sum_c t_nc logp_nc,
// sum_n w[y_n]} land in sums[0..1]; the rest is per-row scratch); backward's `weight_sums` is two
// doubles (sum_n w[y_n], sum_c w[c]). `bad_label` is one int that the caller sets to
// kNoBadLabel before the call: a sample whose label is outside [0, C) lowers it to that sample's
// index (the first such sample's, with atomicMin). weights may be null (all 1).
inline constexpr int kNoBadLabel = 0x7f7f7f7f;  // cudaMemsetAsync(bad_label, 0x7f, sizeof(int))
cudaError_t launch_cross_entropy_forward(const float* logits, const int32_t* labels, const float* weights,
                                         double smoothing, float* probs, double* sums, int* bad_label, int64_t N,
                                         int64_t C, cudaStream_t stream);
cudaError_t launch_cross_entropy_backward(const float* probs, const int32_t* labels, const float* weights,
                                          double smoothing, float* dlogits, double* weight_sums, int* bad_label,
                                          int64_t N, int64_t C, cudaStream_t stream);

// y = x converted between f32, f16 and bf16 (kernels/formulas.h), n elements; storage as the
// types say (f32: float; f16 / bf16: uint16_t bit patterns).
cudaError_t launch_cast(const void* x, CastType from, void* y, CastType to, int64_t n, cudaStream_t stream);
// out[0] = sum of x_i^2 over n elements, in double: `blocks` blocks (at most kSumOfSquaresBlocks)
// write their partial sums to partial[0 .. blocks), then one block adds them (a fixed tree: the
// same inputs give the same bits on every run). partial holds `blocks` doubles, out one.
inline constexpr int64_t kSumOfSquaresBlocks = 1024;
cudaError_t launch_sum_of_squares(const float* x, int64_t n, double* partial, int64_t blocks, double* out,
                                  cudaStream_t stream);
// y = alpha x over n elements (y may be x).
cudaError_t launch_scale(const float* x, double alpha, float* y, int64_t n, cudaStream_t stream);
// Layer norm of each row of x [R, C] (backend.h): one block per row, double accumulation; x of
// storage tx and y of ty (gamma, beta f32); y may be x when tx == ty.
cudaError_t launch_layer_norm_forward(CastType tx, const void* x, const float* gamma, const float* beta, double eps,
                                      CastType ty, void* y, int64_t R, int64_t C, cudaStream_t stream);
// y = x permuted: rank <= 6, y_extent[i] = x's extent of perm[i], in_stride[i] = x's row-major
// stride of dimension perm[i].
struct PermuteGeometry {
  int rank = 0;
  int64_t y_extent[6] = {0};
  int64_t in_stride[6] = {0};
};
// Elements of element_bytes (4: f32; 2: f16 / bf16 patterns), moved as they are.
cudaError_t launch_permute(size_t element_bytes, const void* x, void* y, int64_t n, PermuteGeometry g,
                           cudaStream_t stream);

// Optimizer updates over n parameters (momentum_buf null without momentum).
cudaError_t launch_sgd_update(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
                              double momentum, double dampening, double weight_decay, bool nesterov, bool first_step,
                              cudaStream_t stream);
cudaError_t launch_adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                                double beta1, double beta2, double eps, double weight_decay, double c1, double c2,
                                cudaStream_t stream);

// Backend::gather_augment: one block per image b of B, images [B, 3, S, S] from tiles [N, S, S, 3]
// u8 and `records` (B AugmentRecords, 8-byte aligned). The crop and brightness are computed twice
// per pixel (once for the image's mean grey, once for the output) instead of stored. An index
// outside [0, N) gives an image of NaN (the host checks the records before they are uploaded).
cudaError_t launch_gather_augment(const uint8_t* tiles, int64_t N, int64_t S, const AugmentRecord* records, int64_t B,
                                  float* images, cudaStream_t stream);

}  // namespace slide::train::cuda
