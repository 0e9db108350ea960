// Backend: the one op list that layers, losses and optimizers are written against (DESIGN.md,
// "The engine"). `reference` (plain loops, the test oracle) implements it first; `cpu` (oneDNN)
// and `cuda` (cuDNN) mirror it op for op. Only backend.cpp knows which backends were built.
//
// Conventions, for every op:
// - Tensors are row-major on the backend's device; images are NCHW. Image tensors may come in a
//   channel-blocked Layout (tensor.h) on a backend that produces them (cpu): such a backend reads
//   any mix of layouts and chooses its outputs' (written to Tensor::layout()); the others take
//   plain tensors only (kInvalidArgument), but for cuda's channels-last half-precision activations
//   of the inference graph (fused_conv2d_inference and max_pool2d_forward read and write them). Parameters and their gradients are always plain.
//   All floating tensors
//   of one call share a dtype (f32; f64 on the reference backend for gradient checks), except
//   where "Half-precision storage" below says otherwise. Labels are i32.
// - Outputs are allocated by the caller with the documented shape; an op writes them whole.
// - Backward ops *overwrite* input gradients (dx) and *accumulate* (+=) into parameter gradients
//   (dw, db, dgamma, dbeta), as llm.c does, so gradient accumulation over micro-batches is
//   free; zero parameter gradients before the first micro-batch.
// - Errors: kInvalidArgument when shapes, dtypes or devices disagree (the message names the op
//   and the shapes), kUnimplemented when the backend lacks the op or the dtype. Ops never
//   allocate from a budgeted allocator behind the caller's back except where documented.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "slide/core/status.h"
#include "slide/train/tensor.h"

namespace slide::train {

// 2-D convolution / pooling geometry. Output extent: (in + 2 * pad - kernel) / stride + 1
// (PyTorch's Conv2d and MaxPool2d with dilation 1, floor mode).
struct Conv2dParams {
  int stride = 1;
  int pad = 0;
};
// The three passes of a convolution, for Backend::conv_workspace_bytes.
enum class ConvPass { kForward, kBackwardData, kBackwardWeights };

struct Pool2dParams {
  int kernel = 2;
  int stride = 2;
  int pad = 0;  // padded positions never win a max (PyTorch pads max pooling with -inf)
};
int64_t conv_out_extent(int64_t in, int64_t kernel, int stride, int pad);

class CopyEngine;
class Backend;

// The math precision of the matrix products: the convolutions (forward, backward data, backward
// weights, the fused inference one), linear layers, matmul and attention's products. Parameters,
// their gradients and optimizer state are f32 whatever the precision (the master weights of
// mixed-precision training), activations too unless a model keeps them in half precision
// (activation_dtype, "Half-precision storage" below), and accumulation is in f32 or wider. The precision
// says how coarsely a product's operands may be rounded before they are multiplied, with
// oneDNN's fpmath_mode and cuBLAS's CUBLAS_COMPUTE_32F_FAST_* meaning: a backend may use any
// type at least as accurate as the one named (at least as many exponent and mantissa bits).
//   kFp32: no rounding (cuDNN's FMA math, cuBLAS's plain f32, oneDNN strict).
//   kTf32: operands rounded to TF32 (8 exponent, 10 mantissa bits), NVIDIA's tensor-core f32
//          (PyTorch's allow_tf32). cuda: cuDNN tensor-op math and CUBLAS_COMPUTE_32F_FAST_TF32;
//          cpu: f32 (oneDNN 2.6 has no TF32 mode; f32 is more accurate, so allowed).
//   kBf16: operands rounded to bfloat16 (8 exponent, 7 mantissa bits). cuda: cuBLAS
//          CUBLAS_COMPUTE_32F_FAST_16BF; its convolutions in TF32 tensor-op math (cuDNN's
//          legacy calls offer no bf16 compute on f32 tensors); cpu: where the CPU has bf16
//          instructions (AVX512_BF16 or AMX, cpu_has_bf16_instructions), the operands are rounded
//          to bf16 by oneDNN reorders and the primitives run on bf16 kernels with f32 outputs;
//          f32 elsewhere.
//   kFp16: operands rounded to IEEE binary16 (5 exponent, 10 mantissa bits): beyond 65504 an
//          operand becomes inf, below 2^-24 zero, so training needs dynamic loss scaling
//          (loss_scaler.h; the trainer's TrainOptions::loss_scaler). cuda: cuDNN
//          CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION (f32 tensors down-converted to f16 for tensor
//          cores) and CUBLAS_COMPUTE_32F_FAST_16F; cpu: f32 (oneDNN 2.6's fpmath_mode::f16 is
//          set, but none of its f32 kernels acts on it).
// The reference backend rounds every product operand to the named type exactly (round to nearest,
// ties to even: kernels/formulas.h round_to_tf32 / round_to_bf16 / round_to_f16), the least
// accurate result the contract allows; its f64 calls (gradient checks) round through f32 the same
// way.
enum class MathPrecision : uint8_t { kFp32 = 0, kTf32 = 1, kBf16 = 2, kFp16 = 3 };
const char* math_precision_name(MathPrecision p);  // "fp32", "tf32", "bf16", "fp16"
// Whether this CPU has bf16 instructions that the cpu backend uses under kBf16: oneDNN's
// effective ISA is avx512_core_bf16 (AVX512_BF16) or above (AMX), as capped by ONEDNN_MAX_CPU_ISA.
// Without them the cpu backend's bf16 products are f32.
bool cpu_has_bf16_instructions();
// "fp32", "tf32", "bf16" or "fp16". Errors: kInvalidArgument naming the accepted values.
[[nodiscard]] Result<MathPrecision> parse_math_precision(const std::string& name);

// The weights of a fused inference convolution, prepared by one backend (prepare_fused_conv2d):
// w [K,C,R,S] and b [K] (zeros when the model's convolution has none), plain, on that backend's
// device; a backend may keep more (cpu: the weights reordered into the blocked layout each
// primitive wants, made on first use and kept). Immutable to its users; not thread-safe (like the
// backend that made it).
class FusedConvWeights {
 public:
  FusedConvWeights(const Backend* owner, Tensor w, Tensor b) : owner_(owner), w_(std::move(w)), b_(std::move(b)) {}
  virtual ~FusedConvWeights() = default;
  const Tensor& weight() const { return w_; }
  const Tensor& bias() const { return b_; }
  const Backend* owner() const { return owner_; }

 private:
  const Backend* owner_;
  Tensor w_, b_;
};

// A point in a device's queue of ops (a CUDA event on cuda): work on another queue (a
// communicator's stream) can be ordered after it on the device, so the host need not wait
// (Backend::fence, Communicator::start_after). Destroying it does not wait for it.
class DeviceFence {
 public:
  virtual ~DeviceFence() = default;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;
  virtual Allocator& allocator() = 0;

  // --- Host <-> device ----------------------------------------------------------------------------
  // upload copies `host` (a plain tensor in host memory) into `dst` (a plain tensor of this
  // backend's device, same shape and dtype); download copies `src` (this backend's) into `host`.
  // On return `host` may be reused (upload) or read (download): a device backend waits for its
  // copy. The one door between host code and a device tensor: code outside the backends reads a
  // tensor's elements only after download (docs/design.md, section 5). Host backends copy bytes.
  // Errors: kInvalidArgument (shapes or dtypes differ, a tensor on the wrong device or in a blocked
  // layout), the device's.
  [[nodiscard]] virtual Status upload(const Tensor& host, Tensor& dst);
  [[nodiscard]] virtual Status download(const Tensor& src, Tensor& host);
  // Returns once every op queued so far on this backend's device has finished: before another
  // party (a communicator on its own stream) reads what the ops wrote. Host backends run ops to
  // completion before returning: nothing to wait for. Errors: the device's.
  [[nodiscard]] virtual Status synchronize() { return slide::core::ok_status(); }
  // Asynchronous copies between this device and host memory, beside the ops (copy_engine.h; for
  // activation offload), or null: offload then copies synchronously with upload / download.
  // Owned by the backend (or its device); the training thread calls it.
  virtual CopyEngine* copy_engine() { return nullptr; }
  // A copy engine of its own (another copy stream on cuda), for a second user beside the training
  // thread's offload: the trainer's input batches, started from its prefetch thread. Null where
  // the backend has none (host backends; cuda when the stream cannot be made): upload instead.
  // (Defined in transfer.cpp, where CopyEngine is complete.)
  virtual std::unique_ptr<CopyEngine> new_copy_engine();
  // A fence after every op queued so far on this backend's device, or null where ops are complete
  // when they return (host backends: nothing to order after). Errors: the device's.
  [[nodiscard]] virtual Result<std::unique_ptr<DeviceFence>> fence() { return std::unique_ptr<DeviceFence>(); }

  // The math precision of this backend's matrix products (MathPrecision above), kFp32 until set.
  // A backend forgets what it cached for the previous precision (oneDNN primitives; cuDNN's
  // algorithm choices are keyed by it). Set it before ops run, from one thread (as every op).
  // Errors: none on the built-in backends; a backend that cannot honour a precision says
  // kUnimplemented.
  [[nodiscard]] virtual Status set_math_precision(MathPrecision p) {
    math_precision_ = p;
    return slide::core::ok_status();
  }
  MathPrecision math_precision() const { return math_precision_; }

  // --- Half-precision storage ---------------------------------------------------------------------
  // A few ops also take f16 or bf16 tensors (one of the two per call), so that a model can keep
  // its activations and weights in half precision (half the bytes to move, and cuBLAS's f16 / bf16
  // tensor-core GEMMs and convolutions on operands that need no conversion): the Vision
  // Transformer's trunk and a CNN's inference graph.
  //   linear_forward, linear_gelu_forward, gelu_forward, sigmoid_forward, mul, permute,
  //   attention_forward: every floating tensor of the call of one half type;
  //   add: all of one type, or a and y f32 with b half (y = a + b in f32: the residual stream
  //   kept in f32, as torch.autocast keeps it, taking a half-precision branch);
  //   layer_norm_forward: x and y each f32 or half, gamma and beta f32 (statistics in f32 or
  //   wider from the values as stored);
  //   fused_conv2d_inference: x, residual and y of one half type, the weights as prepared (f32:
  //   the backend keeps half copies); max_pool2d_forward: x and y of one half type (a CNN's
  //   inference graph: InferenceGraph::run). These two may write channels last (cuda: Layout::kNhwc,
  //   y relabelled; with a residual, y keeps the residual's layout) and read it; to_plain undoes it.
  // Training a CNN on half-precision activations (layers.h enable_half_activations, as
  // torch.autocast with f32 master weights), plain NCHW:
  //   conv2d_forward, conv2d_backward_data, relu_forward / _backward, max_pool2d_backward,
  //   global_avg_pool_forward / _backward, linear_backward_data: every floating tensor of one half
  //   type (the layer casts its f32 weights to the half type each forward);
  //   conv2d_backward_weights, linear_backward_weights: x and dy of one half type, dw and db f32
  //   (the master gradients; += as always). The weight product may be rounded once to the half
  //   type before it is added (cuda's convolutions: cuDNN writes a half-precision filter gradient,
  //   as PyTorch's autocast convolutions do; cuBLAS accumulates linear's into f32 directly), so
  //   under fp16 a large loss scale can overflow it to inf: the loss scaler skips that step;
  //   db is summed unrounded;
  //   batch_norm_forward_training / _inference / _backward and the synchronised pieces: x, y, dy,
  //   dx of one half type; gamma, beta, the running and saved statistics, dgamma, dbeta f32.
  // Channels last in training (enable_half_activations with Layout::kNhwc, or enable_channels_last
  // at f32; PyTorch's channels_last): on a backend with to_channels_last (cuda; the reference
  // emulates it), these training ops also take their image tensors channels last: conv2d_forward /
  // _backward_data / _backward_weights (x, y, dy, dx), batch_norm_forward_training / _inference /
  // _backward and the synchronised pieces (x, y, dy, dx), relu_forward / _backward, add,
  // max_pool2d_forward / _backward, global_avg_pool_forward (x) / _backward (dx). The image tensors
  // of one call share one layout (plain or kNhwc; a mix is kInvalidArgument naming the op); filters,
  // biases, per-channel tensors, pooled features [N, C] and every gradient of a parameter stay
  // plain. An op writes its image outputs in its image inputs' layout and labels them so (y and dx
  // as x; conv2d_backward_data's dx as dy); global_avg_pool_backward, whose only image tensor is
  // dx, writes dx in the layout dx is labelled with. The values are the plain op's, bit for bit on
  // the reference; only their order in memory differs.
  // Products accumulate in f32 or wider; each output element is rounded once to its dtype (round to
  // nearest even, kernels/formulas.h), except that attention may round its probabilities to the
  // half type before the second product (cuda: the operand of a tensor-core GEMM), as PyTorch's
  // half-precision attention does, and the fused convolution may round the convolution's output
  // before adding bias and residual (cuda: cuDNN's half-precision convolution, then one kernel;
  // conv2d_forward's bias likewise). The reference backend computes in f32 from the stored values
  // and rounds the output once (the weight products too): the oracle. cuda implements these; cpu
  // keeps f32 storage (its bf16 runs through oneDNN's f32-in, bf16-compute primitives) and answers
  // kUnimplemented.
  //
  // The dtype in which a model should keep its activations on this backend at its math precision:
  // f16 / bf16 where the backend has the half-precision ops above and the precision is kFp16 /
  // kBf16 (cuda), else f32 (models may always run f32).
  virtual DType activation_dtype() const { return DType::kF32; }

  // Bytes the device could still give, before any budget: the host's available memory
  // (sysconf's available pages) for backends in host memory, the GPU's free memory
  // (cudaMemGetInfo) on cuda. For choices such as --cache auto. Errors: the device's.
  [[nodiscard]] virtual Result<size_t> available_memory_bytes();

  // --- Layout ------------------------------------------------------------------------------------
  // x in the plain layout: x itself when it is plain, else a reordered copy (same shape and
  // dtype) from this backend's allocator. For host code that reads elements (synchronised batch
  // norm, tests). Errors: the allocator's; kUnimplemented on a backend without blocked layouts.
  [[nodiscard]] virtual Result<Tensor> to_plain(const Tensor& x) {
    if (x.layout() == Layout::kPlain) return x;
    return slide::core::unimplemented(std::string("to_plain: ") + name() + " has no " + layout_name(x.layout()) +
                                      " layout");
  }
  // x [N, C, H, W] channels last (Layout::kNhwc: stored [N][H][W][C], PyTorch's channels_last):
  // x itself when it is already, else a relaid-out copy (same shape and dtype, labelled kNhwc)
  // from this backend's allocator. The entry into channels-last training (layers.h Cast).
  // Errors: kInvalidArgument (not rank 4, or in a blocked layout); the allocator's; kUnimplemented
  // on a backend without channels last (cpu keeps its own blocked layouts).
  [[nodiscard]] virtual Result<Tensor> to_channels_last(const Tensor& x) {
    if (x.layout() == Layout::kNhwc) return x;
    return slide::core::unimplemented(std::string("to_channels_last: ") + name() + " has no channels-last layout");
  }

  // --- Convolution (cross-correlation, as PyTorch) ---------------------------------------------
  // y[N,K,P,Q] = sum_{c,r,s} x[N,C,H,W] (padded) * w[K,C,R,S] + b[K]; b may be undefined.
  [[nodiscard]] virtual Status conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Conv2dParams p,
                                              Tensor& y) = 0;
  // dx[N,C,H,W] = the transpose of the above applied to dy[N,K,P,Q].
  [[nodiscard]] virtual Status conv2d_backward_data(const Tensor& dy, const Tensor& w, Conv2dParams p, Tensor& dx) = 0;
  // dw[K,C,R,S] += sum_n x (*) dy; db[K] += sum_{n,p,q} dy (db may be undefined).
  [[nodiscard]] virtual Status conv2d_backward_weights(const Tensor& x, const Tensor& dy, Conv2dParams p, Tensor& dw,
                                                       Tensor& db) = 0;
  // Bytes this backend takes from its allocator, beyond the operands, for the length of one
  // convolution pass of these shapes: x [N,C,H,W], w [K,C,R,S], y [N,K,P,Q] as in conv2d_forward
  // (backward data: dx, w, dy; backward weights: x, dw, dy); only shapes and dtypes are read, so
  // the memory planner's placeholder tensors do. cuda: cuDNN's workspace for the algorithm that
  // pass would run (the one cached for the shape, else the first of cuda/conv_plan.h's order, which
  // it takes when the budget grants its workspace; a refused workspace only ever means a smaller
  // one); the simulated device with a simulated workspace (reference_backend.h); 0 elsewhere (the
  // cpu backend's scratch is the planner's own model of it, planner.cpp). Errors, where a backend
  // has workspaces: kInvalidArgument for inconsistent shapes; the library's.
  [[nodiscard]] virtual Result<size_t> conv_workspace_bytes(ConvPass pass, const Tensor& x, const Tensor& w,
                                                            Conv2dParams p, const Tensor& y);

  // --- Fused inference convolution (the inference graph's, inference_graph.h) -------------------
  // A convolution of an inference graph: batch norm folded into its weights and bias, the residual
  // add and the ReLU of a ResNet block fused into it (cuDNN's y = act(alpha1 conv(x) + alpha2 z +
  // bias), oneDNN's sum and eltwise post-ops):
  //   y[N,K,P,Q] = act(conv(x, w) + b[K] + z),   act = ReLU when `relu`, else the identity,
  // z = *residual ([N,K,P,Q]) or nothing when residual is null. y may be *residual (in place: the
  // block's shortcut is overwritten by its output), never x. The weights come prepared for this
  // backend (prepare_fused_conv2d), so that a backend reorders or uploads them once, not per batch.
  // Errors: those of conv2d_forward, kInvalidArgument for a residual of another shape or weights
  // prepared by another backend.
  [[nodiscard]] virtual Result<std::shared_ptr<const FusedConvWeights>> prepare_fused_conv2d(const Tensor& w,
                                                                                            const Tensor& b);
  // This default composes conv2d_forward, add and relu_forward (the reference: one more pass over y
  // per fused op, and a scratch tensor of y's size with a residual); cpu and cuda fuse.
  [[nodiscard]] virtual Status fused_conv2d_inference(const Tensor& x, const FusedConvWeights& w, Conv2dParams p,
                                                      bool relu, const Tensor* residual, Tensor& y);

  // --- Batch normalisation over (N, H, W) per channel (Ioffe & Szegedy, 2015) -------------------
  // Training: mean/var of the batch (biased var for normalising; PyTorch updates the running var
  // with the unbiased one): running = (1 - momentum) * running + momentum * batch.
  // y = gamma * (x - mean) * invstd + beta, invstd = 1 / sqrt(var + eps); save_mean[C] and
  // save_invstd[C] are written for backward. x, y: [N,C,H,W]; the rest [C].
  [[nodiscard]] virtual Status batch_norm_forward_training(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                                           double eps, double momentum, Tensor& running_mean,
                                                           Tensor& running_var, Tensor& y, Tensor& save_mean,
                                                           Tensor& save_invstd) = 0;
  // Inference: the running statistics instead of the batch's.
  [[nodiscard]] virtual Status batch_norm_forward_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                                            const Tensor& running_mean, const Tensor& running_var,
                                                            double eps, Tensor& y) = 0;
  // dx (overwritten), dgamma += sum dy * xhat, dbeta += sum dy. dx may be dy (in place: each
  // backend reads the whole channel's dy for the sums before it writes dx, then each element of dx
  // from dy's same element; oneDNN's batch normalization supports it).
  [[nodiscard]] virtual Status batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma,
                                                   const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx,
                                                   Tensor& dgamma, Tensor& dbeta) = 0;
  // Bytes batch_norm_forward_training (backward: batch_norm_backward) takes from this backend's
  // allocator, beyond its operands, for its length, for x [N,C,H,W] (only the shape is read, as in
  // conv_workspace_bytes): cuda's f64 partial sums (kernels/launch.h bn_forward_scratch_doubles,
  // bn_backward_scratch_doubles); the simulated device's with a simulated workspace, the same
  // figure; 0 elsewhere (the cpu backend's scratch is the planner's own model, planner.cpp).
  [[nodiscard]] virtual size_t batch_norm_scratch_bytes(bool backward, const Tensor& x);

  // --- Batch norm followed by ReLU, one op where the backend fuses the pair ------------------------
  // (cuda: the normalising pass applies ReLU, the backward passes mask dy as they read it; cuDNN's
  // CUDNN_BATCHNORM_OPS_BN_ACTIVATION and oneDNN's fuse_norm_relu fuse the same pair.)
  // y = max(batch_norm(x), 0): batch_norm_forward_training's contract, shapes, dtypes and
  // layouts, with ReLU applied to y; bit for bit batch_norm_forward_training then relu_forward on
  // y (ReLU of the stored value equals the stored ReLU: both round monotonically and map -0 and
  // NaN to +0). The default runs those two ops, ReLU in place.
  [[nodiscard]] virtual Status batch_norm_relu_forward_training(const Tensor& x, const Tensor& gamma,
                                                                const Tensor& beta, double eps, double momentum,
                                                                Tensor& running_mean, Tensor& running_var, Tensor& y,
                                                                Tensor& save_mean, Tensor& save_invstd);
  // The pair's backward: batch_norm_backward (dx overwritten, dgamma and dbeta +=) for the gradient
  // dy masked by relu_backward's rule (dy where y > 0, else 0), y being the forward's output
  // (x's shape, dtype and layout); bit for bit relu_backward then batch_norm_backward. The default
  // runs those two ops, the masked gradient written into dx and batch norm's backward run in place
  // on it, so that it holds no more memory than the two layers did.
  [[nodiscard]] virtual Status batch_norm_relu_backward(const Tensor& x, const Tensor& y, const Tensor& dy,
                                                        const Tensor& gamma, const Tensor& save_mean,
                                                        const Tensor& save_invstd, Tensor& dx, Tensor& dgamma,
                                                        Tensor& dbeta);

  // --- Synchronised batch normalisation's pieces (--sync-bn) -----------------------------------------
  // The training forward and backward above, cut where the ranks' per-channel sums must be
  // all-reduced (dist/sync_batch_norm.h composes them with the all-reduces between; PyTorch's
  // SyncBatchNorm cuts at the same places: batch_norm_stats, batch_norm_elemt,
  // batch_norm_backward_reduce, batch_norm_backward_elemt). x, dy, y, dx: [N,C,H,W] plain, N may
  // be 0; gamma, beta, running_*, save_*, dgamma, dbeta: [C] in x's dtype; the sums are f64 on this
  // backend's device, read by the next piece where they are (no host round trip of their own).
  // Each sum is accumulated in double as batch_norm_forward_training / batch_norm_backward
  // accumulate it on this backend, so that with one rank (the sums all-reduced over one) the
  // pieces give those ops' results bit for bit. Errors: kInvalidArgument (shapes, dtypes, devices,
  // layouts), kUnimplemented (a backend without them).
  //
  // stats [C+1] (overwritten): stats[k] = sum of x over (n, h, w) of channel k; stats[C] = N*H*W.
  [[nodiscard]] virtual Status batch_norm_stats(const Tensor& x, Tensor& stats) {
    return unimplemented_op("batch_norm_stats", x, stats);
  }
  // devs [C] (overwritten): devs[k] = sum over (n, h, w) of (x - mean_k)^2, mean_k = stats[k] / stats[C]
  // (stats all-reduced over the ranks: the global mean; the two-pass variance, as one rank's).
  [[nodiscard]] virtual Status batch_norm_deviations(const Tensor& x, const Tensor& stats, Tensor& devs) {
    return unimplemented_op("batch_norm_deviations", x, stats, devs);
  }
  // The training forward from the all-reduced sums, M = stats[C]: mean = stats[k] / M, the biased
  // var = devs[k] / M; then y, save_mean, save_invstd and the running statistics (the unbiased var
  // devs[k] / (M - 1), or devs[k] / M when M is 1) as batch_norm_forward_training writes them.
  [[nodiscard]] virtual Status batch_norm_forward_from_stats(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                                             const Tensor& stats, const Tensor& devs, double eps,
                                                             double momentum, Tensor& running_mean,
                                                             Tensor& running_var, Tensor& y, Tensor& save_mean,
                                                             Tensor& save_invstd) {
    return unimplemented_op("batch_norm_forward_from_stats", x, gamma, beta, stats, devs, eps, momentum, running_mean,
                            running_var, y, save_mean, save_invstd);
  }
  // sums [2C] (overwritten) over this rank's values: sums[k] = sum dy, sums[C + k] = sum dy * xhat
  // (xhat = (x - save_mean) save_invstd); and dbeta += sums[k], dgamma += sums[C + k], as
  // batch_norm_backward adds them (the gradient all-reduce adds the other ranks' later).
  [[nodiscard]] virtual Status batch_norm_backward_reduce(const Tensor& x, const Tensor& dy, const Tensor& save_mean,
                                                          const Tensor& save_invstd, Tensor& sums, Tensor& dgamma,
                                                          Tensor& dbeta) {
    return unimplemented_op("batch_norm_backward_reduce", x, dy, save_mean, save_invstd, sums, dgamma, dbeta);
  }
  // dx (overwritten) = gamma invstd / M (M dy - sums[k] - xhat sums[C + k]) with the all-reduced
  // sums and the forward's stats (M = stats[C], the global count). dx may be dy (element-wise).
  [[nodiscard]] virtual Status batch_norm_backward_elemt(const Tensor& x, const Tensor& dy, const Tensor& gamma,
                                                         const Tensor& save_mean, const Tensor& save_invstd,
                                                         const Tensor& stats, const Tensor& sums, Tensor& dx) {
    return unimplemented_op("batch_norm_backward_elemt", x, dy, gamma, save_mean, save_invstd, stats, sums, dx);
  }

  // --- Element-wise ------------------------------------------------------------------------------
  // y = max(x, 0), 0 where x is NaN (formulas::relu; oneDNN's relu does the same); any shape. y may be x (in place).
  [[nodiscard]] virtual Status relu_forward(const Tensor& x, Tensor& y) = 0;
  // dx = dy where y > 0, else 0 (from the forward's output, so forward may run in place).
  [[nodiscard]] virtual Status relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) = 0;
  // y = a + b, same shapes (the residual add); y may be a or b.
  [[nodiscard]] virtual Status add(const Tensor& a, const Tensor& b, Tensor& y) = 0;
  // y = a * b element by element, same shapes; y may be a or b. Its backward is itself:
  // da = dy * b, db = dy * a (Dropout's mask, gated attention).
  [[nodiscard]] virtual Status mul(const Tensor& a, const Tensor& b, Tensor& y) = 0;

  // --- Pooling -----------------------------------------------------------------------------------
  // y[N,C,P,Q] = max over the window of x[N,C,H,W].
  [[nodiscard]] virtual Status max_pool2d_forward(const Tensor& x, Pool2dParams p, Tensor& y) = 0;
  // dx (overwritten): dy routed to the first maximum of each window (PyTorch's tie rule), summed
  // where windows overlap.
  [[nodiscard]] virtual Status max_pool2d_backward(const Tensor& x, const Tensor& dy, Pool2dParams p, Tensor& dx) = 0;
  // y[N,C] = mean over H, W of x[N,C,H,W] (AdaptiveAvgPool2d(1) then flatten).
  [[nodiscard]] virtual Status global_avg_pool_forward(const Tensor& x, Tensor& y) = 0;
  // dx[N,C,H,W] = dy[N,C] / (H * W), overwritten.
  [[nodiscard]] virtual Status global_avg_pool_backward(const Tensor& dy, Tensor& dx) = 0;

  // --- Fully connected ---------------------------------------------------------------------------
  // y[N,O] = x[N,I] w[O,I]^T + b[O] (PyTorch's Linear); b may be undefined.
  [[nodiscard]] virtual Status linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) = 0;
  // dx[N,I] = dy w (overwritten).
  [[nodiscard]] virtual Status linear_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx) = 0;
  // dw[O,I] += dy^T x; db[O] += sum_n dy (db may be undefined).
  [[nodiscard]] virtual Status linear_backward_weights(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db) = 0;

  // --- Loss --------------------------------------------------------------------------------------
  // Softmax cross-entropy of logits[N,C] against labels[N] (i32 in [0, C)), with optional class
  // weights[C] (undefined: all 1) and label smoothing s in [0, 1): the loss is PyTorch's
  // CrossEntropyLoss(weight, label_smoothing, reduction='mean'):
  // sum_n [(1 - s) w[y_n] (-log p_n,y_n) + (s / C) sum_c w[c] (-log p_nc)] / sum_n w[y_n]
  // (without weights: the target (1 - s) one_hot + s / C, averaged over N; kernels/formulas.h).
  // Writes probs[N,C] (softmax) and *loss. Errors also: kInvalidArgument for a label out of range.
  [[nodiscard]] virtual Status softmax_cross_entropy_forward(const Tensor& logits, const Tensor& labels,
                                                             const Tensor& class_weights, double label_smoothing,
                                                             Tensor& probs, double* loss) = 0;
  // dlogits[N,C] (overwritten) = w[y_n] * (probs - target) / sum_n w[y_n], the gradient of the mean
  // loss above.
  [[nodiscard]] virtual Status softmax_cross_entropy_backward(const Tensor& probs, const Tensor& labels,
                                                              const Tensor& class_weights, double label_smoothing,
                                                              Tensor& dlogits) = 0;

  // --- Optimizer updates (PyTorch's torch.optim semantics), in place on one parameter ------------
  // SGD: g = grad + weight_decay * param; with momentum m > 0: buf = g on the first step, else
  // buf = m * buf + (1 - dampening) * g; g = nesterov ? g + m * buf : buf. param -= lr * g.
  // param, grad and momentum_buf share a shape (momentum_buf unused when m == 0).
  [[nodiscard]] virtual Status sgd_update(Tensor& param, const Tensor& grad, Tensor& momentum_buf, double lr,
                                          double momentum, double dampening, double weight_decay, bool nesterov,
                                          bool first_step) = 0;
  // AdamW (Loshchilov & Hutter, 2019; torch.optim.AdamW): param *= 1 - lr * weight_decay;
  // m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; param -= lr * (m / (1 - b1^t)) /
  // (sqrt(v / (1 - b2^t)) + eps), t = step >= 1.
  [[nodiscard]] virtual Status adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr,
                                            double beta1, double beta2, double eps, double weight_decay,
                                            int64_t step) = 0;

  // --- Attention MIL (ABMIL: Ilse, Tomczak & Welling, ICML 2018) ---------------------------------
  // The gated attention's non-linearities, the softmax over a bag's instances and the pooling
  // product. Element-wise ops take any shape; y may be x (in place). A backend that lacks them
  // (one that predates them) answers kUnimplemented naming the op; reference and cpu have them.
  // y = tanh(x).
  [[nodiscard]] virtual Status tanh_forward(const Tensor& x, Tensor& y) {
    return unimplemented_op("tanh_forward", x, y);
  }
  // dx = dy * (1 - y^2), from the forward's output y (overwritten).
  [[nodiscard]] virtual Status tanh_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
    return unimplemented_op("tanh_backward", y, dy, dx);
  }
  // y = 1 / (1 + exp(-x)) (the logistic sigmoid).
  [[nodiscard]] virtual Status sigmoid_forward(const Tensor& x, Tensor& y) {
    return unimplemented_op("sigmoid_forward", x, y);
  }
  // dx = dy * y * (1 - y), from the forward's output y (overwritten).
  [[nodiscard]] virtual Status sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
    return unimplemented_op("sigmoid_backward", y, dy, dx);
  }
  // Softmax along each row of x[R,C]: y[r,c] = exp(x[r,c] - max_c x[r,:]) / sum_c' exp(x[r,c'] - max).
  // ABMIL's attention weights over a bag's N instances are one row [1,N]. y may be x.
  [[nodiscard]] virtual Status softmax_forward(const Tensor& x, Tensor& y) {
    return unimplemented_op("softmax_forward", x, y);
  }
  // dx[R,C] = y * (dy - sum_c dy * y) per row (the softmax's Jacobian-vector product), overwritten.
  [[nodiscard]] virtual Status softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
    return unimplemented_op("softmax_backward", y, dy, dx);
  }
  // y[M,N] = op(a) op(b), op(t) = t, or t^T when its transpose flag is set: a is [M,K] (or [K,M]),
  // b is [K,N] (or [N,K]); y overwritten, not aliasing a or b. Attention pooling is z[1,L] =
  // a[1,N] h[N,L]; its backward is da = dz h^T and dh = a^T dz.
  [[nodiscard]] virtual Status matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                                      Tensor& y) {
    return unimplemented_op("matmul", a, transpose_a, b, transpose_b, y);
  }

  // --- Vision Transformer (Dosovitskiy et al., 2021; as timm's VisionTransformer runs it) --------
  // Layer normalisation of each row of x[R,C] (Ba et al., 2016; torch.nn.LayerNorm over the last
  // dimension): y = gamma (x - mean_r) invstd_r + beta, invstd_r = 1 / sqrt(var_r + eps), var the
  // biased variance of the row; gamma, beta [C]. y may be x. (The inference form: nothing saved.)
  [[nodiscard]] virtual Status layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                                                  Tensor& y) {
    return unimplemented_op("layer_norm_forward", x, gamma, beta, eps, y);
  }
  // y = x Phi(x) = x / 2 (1 + erf(x / sqrt 2)), the exact GELU (PyTorch's default); any shape, y
  // may be x.
  [[nodiscard]] virtual Status gelu_forward(const Tensor& x, Tensor& y) { return unimplemented_op("gelu_forward", x, y); }
  // y[N,O] = GELU(x[N,I] w[O,I]^T + b[O]), GELU as gelu_forward: a ViT MLP's first layer with its
  // activation, the inference form (nothing kept for a backward). b may be undefined. Errors: those
  // of linear_forward. This default composes linear_forward and gelu_forward (y in place); cpu
  // applies the GELU to the product's f32 outputs inside the primitive (oneDNN's
  // eltwise_gelu_erf post-op), which saves a pass over y.
  [[nodiscard]] virtual Status linear_gelu_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y);
  // dx = dy (Phi(x) + x phi(x)), from the forward's input x (overwritten).
  [[nodiscard]] virtual Status gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
    return unimplemented_op("gelu_backward", x, dy, dx);
  }
  // y = x converted to y's dtype, element by element (same shape; f32, f16, bf16, and f64 on the
  // reference backend): to f16 / bf16 rounded to nearest, ties to even, overflow to inf, NaN kept
  // (PyTorch's .half() / .bfloat16()); to f32 exact from f16 / bf16. Formulas:
  // kernels/formulas.h (f32_to_f16, ...). x and y must not share storage unless the dtypes match.
  [[nodiscard]] virtual Status cast(const Tensor& x, Tensor& y) { return unimplemented_op("cast", x, y); }
  // *out = sum_i x_i^2 over every element of x (any shape, in the plain layout as gradients are:
  // kInvalidArgument for a channels-last or blocked tensor), accumulated in double: the
  // optimizer's check that a gradient is finite (NaN or inf in x makes *out non-finite). A host
  // number: a device backend waits for its result.
  [[nodiscard]] virtual Status sum_of_squares(const Tensor& x, double* out) {
    return unimplemented_op("sum_of_squares", x, out);
  }
  // out[i] = sum_of_squares(*xs[i]) for every i, bit for bit, in one wait for a device backend
  // (the optimizer checks every parameter's gradient each step: one host synchronisation per
  // parameter, 161 for ResNet-50, left the GPU idle between them). `out` holds xs.size() values.
  // The default calls sum_of_squares in turn; cuda queues every reduction, then copies the sums
  // back at once.
  [[nodiscard]] virtual Status sum_of_squares_each(const std::vector<const Tensor*>& xs, double* out);
  // A training batch from a dataset held on this backend's device (--cache device): images[B,3,S,S]
  // f32 (overwritten) = for each record b, tile records[b].index of tiles[N,S,S,3] u8, augmented
  // as the record says (augment.h: the crop resampled bilinearly, brightness, contrast against
  // the image's mean grey, saturation, hue, then flip and rotation) and normalised with ImageNet's
  // mean and std: the pixels TileDataset::load_batch makes on the host, from the per-pixel formulas
  // it shares (kernels/formulas.h). records: u8 [B, sizeof(AugmentRecord)] on the device, as
  // draw_augment made them. On a GPU the contrast mean is summed in double in another order, nvcc
  // contracts a * b + c into fused multiply-adds (the host build does not) and logf / expf (the
  // stain jitter) are CUDA's, so cuda's augmented pixels may differ from the host's by a few ulps
  // (un-augmented ones are equal). Errors: kInvalidArgument (shapes, dtypes,
  // layouts, devices; on host-readable devices also a record's index outside [0, N) or a crop box
  // outside the tile), kUnimplemented.
  [[nodiscard]] virtual Status gather_augment(const Tensor& tiles, const Tensor& records, Tensor& images) {
    return unimplemented_op("gather_augment", tiles, records, images);
  }
  // Multi-head self-attention's core (Vaswani et al., 2017, eq. 1; timm's Attention.forward):
  // qkv [B*T, 3*C] holds the rows of B sequences of T tokens as the qkv linear layer writes them:
  // per token q, then k, then v, each C = H*Dh wide and made of the H heads' Dh-wide parts in
  // order. out [B*T, C] (overwritten) = for each sequence b and head h,
  //   softmax_rows(scale * q_bh k_bh^T) v_bh     (q_bh, k_bh, v_bh: [T, Dh]),
  // written back per token with the heads concatenated in order (timm: x.transpose(1,
  // 2).reshape(B, T, C)). scale is 1 / sqrt(Dh) in a ViT. out must not share qkv's storage.
  // Errors: kInvalidArgument (shapes: batch not dividing the rows, heads not dividing C; a scale
  // that is not finite; out aliasing qkv; layouts, devices), kUnimplemented (dtypes), the
  // allocator's (scratch: the f32 scores of one sequence, [H, T, T]; cuda's holds those of as many
  // sequences as fit in 256 MiB, at least one, rows padded to a multiple of 8, with the
  // probabilities beside them under f16 / bf16: kernels::attention_sequences_per_chunk). This
  // default composes the ops above (permute, matmul, scale, softmax_forward) one sequence and head
  // at a time; the cpu backend overrides it with batched oneDNN matmuls over strided views (no
  // permutes).
  [[nodiscard]] virtual Status attention_forward(const Tensor& qkv, int64_t batch, int64_t heads, double scale,
                                                 Tensor& out);
  // y = alpha x, any shape; y may be x (attention's 1 / sqrt(head dim)).
  [[nodiscard]] virtual Status scale(const Tensor& x, double alpha, Tensor& y) {
    return unimplemented_op("scale", x, alpha, y);
  }
  // y = x with its dimensions reordered, y.shape[i] = x.shape[perm[i]] (torch.permute, then
  // contiguous); rank 1..6, perm a permutation of 0..rank-1; y must not share storage with x
  // (splitting attention heads: [B, T, 3, H, Dh] -> [3, B, H, T, Dh]).
  [[nodiscard]] virtual Status permute(const Tensor& x, const std::vector<int>& perm, Tensor& y) {
    return unimplemented_op("permute", x, perm, y);
  }

 protected:
  MathPrecision math_precision_ = MathPrecision::kFp32;

 private:
  template <typename... Unused>
  static Status unimplemented_op(const char* op, const Unused&...) {
    return slide::core::unimplemented(std::string(op) + ": not implemented by this backend");
  }
};

// --- Host <-> device helpers (on upload / download) ----------------------------------------------
// OK when `t` is a host tensor, or `device` is the backend of t's device (so that t can be
// downloaded or uploaded through it); else kInvalidArgument: "<what> is on <device> and no backend
// of that device was given to copy it".
[[nodiscard]] Status check_transfer_backend(const Tensor& t, const Backend* device, const std::string& what);
// A host copy of `t` (plain, on cpu_allocator()) downloaded from be's device; `t` itself when it
// is already a host tensor. For host code that reads elements (metrics, checkpoints).
// Errors: those of download and of the host allocation.
[[nodiscard]] Result<Tensor> to_host(Backend& be, const Tensor& t, const std::string& what = "host copy");
// `host` on be's device: a new tensor from be.allocator() with `host`'s elements uploaded, or
// `host` itself when be's tensors live in host memory (device cpu). An undefined tensor stays
// undefined. Errors: those of upload and of the allocation (kResourceExhausted past the budget).
[[nodiscard]] Result<Tensor> to_device(Backend& be, const Tensor& host, const std::string& what = "tensor");

// The backends this build has: "reference" and "reference-sim" (the reference backend on the
// simulated device, Device::kSim: for tests of the device paths) always; "cpu" (oneDNN) and
// "cuda" when built.
// "auto": cuda when built and a device is present, else cpu (Backend::name() says which).
// `device` (cuda only; -1: unset) is the GPU to open; unset, the launcher's node-local rank picks it
// (select_device, device_select.h), else GPU 0.
// Errors: kNotFound naming the backend and listing the built ones; for cuda, kUnavailable (no
// driver or device), those of select_device; kInvalidArgument for a device with another backend.
[[nodiscard]] Result<std::unique_ptr<Backend>> make_backend(const std::string& name, int device = -1);

}  // namespace slide::train
