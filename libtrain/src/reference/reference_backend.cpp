#include "reference_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cross_entropy.h"
#include "cuda/conv_plan.h"
#include "kernels/formulas.h"
#include "kernels/launch.h"
#include "op_checks.h"
#include "slide/train/copy_engine.h"

namespace slide::train {

namespace {

using slide::core::ok_status;


// Runs f.template operator()<T>() for the call's dtype.
template <typename F>
Status dispatch(DType dtype, F&& f) {
  if (dtype == DType::kF64) return f.template operator()<double>();
  return f.template operator()<float>();
}

// A product operand as the reference multiplies it under a MathPrecision (backend.h): exactly,
// or rounded to TF32 / bfloat16 / binary16 through f32 (kernels/formulas.h).
struct Exact {
  template <typename T>
  double operator()(T v) const {
    return double(v);
  }
};
template <float (*Round)(float)>
struct RoundedTo {
  template <typename T>
  double operator()(T v) const {
    return double(Round(static_cast<float>(v)));
  }
};

// Runs f.template operator()<T>(q) for the call's dtype, with q the operand rounding of
// `precision` (a type per precision, so that fp32's loops are the plain ones).
template <typename F>
Status dispatch_product(DType dtype, MathPrecision precision, F&& f) {
  return dispatch(dtype, [&]<typename T>() {
    switch (precision) {
      case MathPrecision::kTf32:
        return f.template operator()<T>(RoundedTo<formulas::round_to_tf32>{});
      case MathPrecision::kBf16:
        return f.template operator()<T>(RoundedTo<formulas::round_to_bf16>{});
      case MathPrecision::kFp16:
        return f.template operator()<T>(RoundedTo<formulas::round_to_f16>{});
      case MathPrecision::kFp32:
        break;
    }
    return f.template operator()<T>(Exact{});
  });
}

// The outputs o in [0, O) of a convolution's axis whose input index o * stride - pad + t (t a
// kernel offset) lies in [0, I): [first, second), empty when first >= second. The convolution
// loops below run over these ranges instead of testing every (output, offset) pair, and visit the
// terms of each output's sum in the order the textbook loop does (their comments say which), so
// the results are the same bit for bit, only sooner.
std::pair<int64_t, int64_t> conv_valid_outputs(int64_t O, int64_t I, int64_t stride, int64_t pad, int64_t t) {
  const int64_t low = pad - t;  // o * stride >= pad - t
  const int64_t first = low <= 0 ? 0 : (low + stride - 1) / stride;
  const int64_t top = I - 1 + pad - t;  // o * stride <= I - 1 + pad - t
  const int64_t last = top < 0 ? -1 : top / stride;
  return {std::min(first, O), std::min(last + 1, O)};
}
// conv_valid_outputs for every kernel offset t in [0, T), once per call of an op. The loops read
// it and their accumulators through raw pointers: the sanitizer builds' -O1 calls operator[] and
// copies each pair, which doubled the ASan suite's ResNet-18 cases.
std::vector<std::pair<int64_t, int64_t>> conv_valid_ranges(int64_t O, int64_t I, int64_t T, int64_t stride, int64_t pad) {
  std::vector<std::pair<int64_t, int64_t>> ranges(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ranges[static_cast<size_t>(t)] = conv_valid_outputs(O, I, stride, pad, t);
  return ranges;
}

// Channel c of a plain x [N, C, HW], visited in (n, hw) order. The one-rank batch norm ops and
// the synchronised pieces are made of the helpers below, so that they sum in the same order and
// agree bit for bit.
struct BnChannel {
  int64_t N, C, HW, c;
  template <typename F>
  void each(F f) const {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) f((n * C + c) * HW + i);
  }
};

template <typename T>
double bn_channel_sum(const T* x, BnChannel ch) {
  double sum = 0;
  ch.each([&](int64_t j) { sum += x[j]; });
  return sum;
}

template <typename T>
double bn_channel_deviations(const T* x, BnChannel ch, double mean) {
  double sq = 0;
  ch.each([&](int64_t j) {
    const double d = x[j] - mean;
    sq += d * d;
  });
  return sq;
}

// y over the channel, the saved and running statistics; sq: the sum of squared deviations over
// `count` values.
template <typename T>
void bn_channel_normalise(const T* x, const T* gamma, const T* beta, double mean, double sq, double count, double eps,
                          double momentum, T* running_mean, T* running_var, T* y, T* save_mean, T* save_invstd,
                          BnChannel ch) {
  const int64_t c = ch.c;
  const double invstd = formulas::bn_invstd(sq / count, eps);
  ch.each([&](int64_t j) { y[j] = formulas::bn_apply(x[j], double(gamma[c]), double(beta[c]), mean, invstd); });
  save_mean[c] = static_cast<T>(mean);
  save_invstd[c] = static_cast<T>(invstd);
  running_mean[c] = formulas::bn_running(running_mean[c], momentum, mean);
  running_var[c] = formulas::bn_running(running_var[c], momentum, formulas::bn_unbiased_var(sq, count));
}

// {sum dy, sum dy * xhat} over the channel, also added to dbeta and dgamma.
template <typename T>
std::pair<double, double> bn_channel_grad_sums(const T* x, const T* dy, const T* save_mean, const T* save_invstd,
                                               T* dgamma, T* dbeta, BnChannel ch) {
  const int64_t c = ch.c;
  double sum_dy = 0, sum_dy_xhat = 0;
  ch.each([&](int64_t j) {
    sum_dy += dy[j];
    sum_dy_xhat += double(dy[j]) * formulas::bn_xhat(x[j], double(save_mean[c]), double(save_invstd[c]));
  });
  dgamma[c] += static_cast<T>(sum_dy_xhat);
  dbeta[c] += static_cast<T>(sum_dy);
  return {sum_dy, sum_dy_xhat};
}

// dx over the channel from the two sums over `count` values.
template <typename T>
void bn_channel_input_grad(const T* x, const T* dy, const T* gamma, const T* save_mean, const T* save_invstd,
                           double count, double sum_dy, double sum_dy_xhat, T* dx, BnChannel ch) {
  const int64_t c = ch.c;
  // dx = gamma * invstd / M * (M dy - sum dy - xhat sum(dy xhat))
  const double k = double(gamma[c]) * double(save_invstd[c]) / count;
  ch.each([&](int64_t j) {
    const double xhat = formulas::bn_xhat(x[j], double(save_mean[c]), double(save_invstd[c]));
    dx[j] = formulas::bn_input_grad(dy[j], xhat, k, count, sum_dy, sum_dy_xhat);
  });
}

class ReferenceBackend final : public Backend {
 public:
  // On `alloc`'s device: the host (cpu), or the simulated device (Device::kSim), whose tensors
  // are host memory that only the backend reads.
  ReferenceBackend(Allocator& alloc, bool simulated_workspace)
      : alloc_(alloc), dtypes_{true, true, false, alloc.device()}, simulated_workspace_(simulated_workspace) {}
  std::string name() const override { return alloc_.device() == Device::kSim ? "reference-sim" : "reference"; }
  Device device() const override { return alloc_.device(); }
  Allocator& allocator() override { return alloc_; }
  // The simulated device gives fences (its ops are complete when they return, so there is nothing
  // to wait for), so that the code ordering a communicator after them runs in the CPU tests.
  Result<std::unique_ptr<DeviceFence>> fence() override {
    if (alloc_.device() != Device::kSim) return std::unique_ptr<DeviceFence>();
    return std::unique_ptr<DeviceFence>(std::make_unique<DeviceFence>());
  }
  // The simulated device offloads on a copy thread, as a GPU does on its copy stream.
  CopyEngine* copy_engine() override {
    if (alloc_.device() != Device::kSim) return nullptr;
    if (!engine_) engine_ = make_thread_copy_engine();
    return engine_.get();
  }
  // ... and uploads the trainer's input batches on a copy thread of their own.
  std::unique_ptr<CopyEngine> new_copy_engine() override {
    if (alloc_.device() != Device::kSim) return nullptr;
    return make_thread_copy_engine();
  }

  Result<size_t> conv_workspace_bytes(ConvPass pass, const Tensor& x, const Tensor& w, Conv2dParams p,
                                      const Tensor& y) override {
    if (!simulated_workspace_) return size_t{0};
    // Shapes and dtypes only: the planner's placeholders live on no device, and are labelled
    // channels last where the model keeps its activations so (the ops read them).
    // Half-precision x with backward weights' f32 dw (in w's place): the half training pass.
    detail::DTypes any = detail::shapes_only(detail::with_half(dtypes_));
    any.blocked = true;
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d,
                           pass == ConvPass::kBackwardWeights
                               ? detail::validate_conv2d_backward_weights(x, y, p, w, Tensor(), any)
                               : detail::validate_conv2d_forward(x, w, Tensor(), p, y, any));
    return workspace_bytes(pass, d, p, x.dtype());
  }

  Status conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Conv2dParams p, Tensor& y) override {
    if (x.layout() == Layout::kNhwc)
      return via_plain("conv2d_forward", {&x}, &y, [&](std::vector<Tensor>& f, Tensor& out) {
        return conv2d_forward(f[0], w, b, p, out);
      });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_conv2d_forward(x, w, b, p, y, detail::with_half(dtypes_)).status());
      return via_f32({&x, &w, &b}, y,
                     [&](std::vector<Tensor>& f, Tensor& out) { return conv2d_forward(f[0], f[1], f[2], p, out); });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d, detail::validate_conv2d_forward(x, w, b, p, y, dtypes_));
    SLIDE_ASSIGN_OR_RETURN(const Tensor ws, workspace(ConvPass::kForward, d, p, x.dtype()));
    // Plain locals, not a structured binding: the lambda below uses them, and clang before 16
    // rejects a structured binding named in a lambda (P1091, C++20), which the sanitizer builds meet.
    const int64_t N = d.N, C = d.C, H = d.H, W = d.W, K = d.K, R = d.R, S = d.S, P = d.P, Q = d.Q;
    return dispatch_product(x.dtype(), math_precision_, [&]<typename T>(auto q) {
      const T *xp = x.ptr<T>(), *wp = w.ptr<T>(), *bp = b.defined() ? b.ptr<T>() : nullptr;
      T* yp = y.ptr<T>();
      // y[n, k, oh, ow] = b[k] + sum over (c, r, s) in that order of x[n, c, ih, iw] w[k, c, r, s],
      // ih = oh * stride - pad + r, iw = ow * stride - pad + s, the terms outside x left out.
      // Each output plane is summed in f64 with (c, r, s) outermost: every output still receives its
      // terms in (c, r, s) order, and the innermost loop runs along a row of outputs.
      std::vector<double> acc(static_cast<size_t>(P * Q));
      const auto row_ranges = conv_valid_ranges(P, H, R, p.stride, p.pad);
      const auto col_ranges = conv_valid_ranges(Q, W, S, p.stride, p.pad);
      const std::pair<int64_t, int64_t>*rows = row_ranges.data(), *cols = col_ranges.data();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          std::fill(acc.begin(), acc.end(), bp ? double(bp[k]) : 0.0);
          for (int64_t c = 0; c < C; ++c) {
            const T* xc = xp + (n * C + c) * H * W;
            for (int64_t r = 0; r < R; ++r) {
              const int64_t oh0 = rows[r].first, oh1 = rows[r].second;
              if (oh0 >= oh1) continue;
              for (int64_t s = 0; s < S; ++s) {
                const int64_t ow0 = cols[s].first, ow1 = cols[s].second;
                if (ow0 >= ow1) continue;
                const double wv = q(wp[((k * C + c) * R + r) * S + s]);
                const int64_t iw0 = s - p.pad;  // iw = ow * stride + iw0
                for (int64_t oh = oh0; oh < oh1; ++oh) {
                  const T* xrow = xc + (oh * p.stride - p.pad + r) * W;
                  double* arow = acc.data() + oh * Q;
                  for (int64_t ow = ow0; ow < ow1; ++ow) arow[ow] += q(xrow[ow * p.stride + iw0]) * wv;
                }
              }
            }
          }
          T* yk = yp + (n * K + k) * P * Q;
          for (int64_t i = 0; i < P * Q; ++i) yk[i] = static_cast<T>(acc.data()[i]);
        }
      return ok_status();
    });
  }

  Status conv2d_backward_data(const Tensor& dy, const Tensor& w, Conv2dParams p, Tensor& dx) override {
    if (dy.layout() == Layout::kNhwc)
      return via_plain("conv2d_backward_data", {&dy}, &dx, [&](std::vector<Tensor>& f, Tensor& out) {
        return conv2d_backward_data(f[0], w, p, out);
      });
    if (detail::is_half(dy.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_conv2d_backward_data(dy, w, p, dx, detail::with_half(dtypes_)).status());
      return via_f32({&dy, &w}, dx,
                     [&](std::vector<Tensor>& f, Tensor& out) { return conv2d_backward_data(f[0], f[1], p, out); });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d, detail::validate_conv2d_backward_data(dy, w, p, dx, dtypes_));
    SLIDE_ASSIGN_OR_RETURN(const Tensor ws, workspace(ConvPass::kBackwardData, d, p, dy.dtype()));
    const int64_t N = d.N, C = d.C, H = d.H, W = d.W, K = d.K, R = d.R, S = d.S, P = d.P, Q = d.Q;
    return dispatch_product(dy.dtype(), math_precision_, [&]<typename T>(auto q) {
      const T *dyp = dy.ptr<T>(), *wp = w.ptr<T>();
      // dx[n, c, ih, iw] = sum over k, then oh, then ow (ascending) of dy[n, k, oh, ow] w[k, c, r, s]
      // for the (oh, ow) that reach (ih, iw) through r = ih + pad - oh * stride and s likewise. For a
      // fixed input position oh rises as r falls, so running r and s downwards with (oh, ow) inside
      // gives every input its terms in that same order.
      std::vector<double> acc(static_cast<size_t>(dx.numel()), 0.0);
      const auto row_ranges = conv_valid_ranges(P, H, R, p.stride, p.pad);
      const auto col_ranges = conv_valid_ranges(Q, W, S, p.stride, p.pad);
      const std::pair<int64_t, int64_t>*rows = row_ranges.data(), *cols = col_ranges.data();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          const T* dyk = dyp + (n * K + k) * P * Q;
          for (int64_t c = 0; c < C; ++c) {
            double* ac = acc.data() + (n * C + c) * H * W;
            for (int64_t r = R - 1; r >= 0; --r) {
              const int64_t oh0 = rows[r].first, oh1 = rows[r].second;
              if (oh0 >= oh1) continue;
              for (int64_t s = S - 1; s >= 0; --s) {
                const int64_t ow0 = cols[s].first, ow1 = cols[s].second;
                if (ow0 >= ow1) continue;
                const double wv = q(wp[((k * C + c) * R + r) * S + s]);
                const int64_t iw0 = s - p.pad;
                for (int64_t oh = oh0; oh < oh1; ++oh) {
                  double* arow = ac + (oh * p.stride - p.pad + r) * W;
                  const T* grow = dyk + oh * Q;
                  for (int64_t ow = ow0; ow < ow1; ++ow) arow[ow * p.stride + iw0] += q(grow[ow]) * wv;
                }
              }
            }
          }
        }
      T* dxp = dx.ptr<T>();
      for (int64_t i = 0; i < dx.numel(); ++i) dxp[i] = static_cast<T>(acc.data()[i]);
      return ok_status();
    });
  }

  Status conv2d_backward_weights(const Tensor& x, const Tensor& dy, Conv2dParams p, Tensor& dw, Tensor& db) override {
    if (any_nhwc({&x, &dy}))
      return via_plain("conv2d_backward_weights", {&x, &dy}, nullptr, [&](std::vector<Tensor>& f, Tensor&) {
        return conv2d_backward_weights(f[0], f[1], p, dw, db);
      });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_conv2d_backward_weights(x, dy, p, dw, db, detail::with_half(dtypes_)).status());
      return half_weight_gradient(x, dy, dw, db, [&](const Tensor& xf, const Tensor& dyf, Tensor& dwf, Tensor& dbf) {
        return conv2d_backward_weights(xf, dyf, p, dwf, dbf);
      });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d,
                           detail::validate_conv2d_backward_weights(x, dy, p, dw, db, dtypes_));
    SLIDE_ASSIGN_OR_RETURN(const Tensor ws, workspace(ConvPass::kBackwardWeights, d, p, x.dtype()));
    const int64_t N = d.N, C = d.C, H = d.H, W = d.W, K = d.K, R = d.R, S = d.S, P = d.P, Q = d.Q;
    return dispatch_product(x.dtype(), math_precision_, [&]<typename T>(auto q) {
      const T *xp = x.ptr<T>(), *dyp = dy.ptr<T>();
      T* dwp = dw.ptr<T>();
      // dw[k, c, r, s] += sum over (n, oh, ow) in that order of x[n, c, ih, iw] dy[n, k, oh, ow]. The
      // R x S sums of one (k, c) are carried together through one sweep of (n, oh), each still
      // taking its terms in (n, oh, ow) order.
      std::vector<double> acc(static_cast<size_t>(R * S));
      double* accp = acc.data();
      const auto col_ranges = conv_valid_ranges(Q, W, S, p.stride, p.pad);
      const std::pair<int64_t, int64_t>* cols = col_ranges.data();
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < C; ++c) {
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t n = 0; n < N; ++n) {
            const T* xc = xp + (n * C + c) * H * W;
            const T* dyk = dyp + (n * K + k) * P * Q;
            for (int64_t oh = 0; oh < P; ++oh)
              for (int64_t r = 0; r < R; ++r) {
                const int64_t ih = oh * p.stride - p.pad + r;
                if (ih < 0 || ih >= H) continue;
                const T* grow = dyk + oh * Q;
                for (int64_t s = 0; s < S; ++s) {
                  const int64_t ow0 = cols[s].first, ow1 = cols[s].second;
                  const T* xrow = xc + ih * W;
                  const int64_t iw0 = s - p.pad;
                  double a = accp[r * S + s];
                  for (int64_t ow = ow0; ow < ow1; ++ow) a += q(xrow[ow * p.stride + iw0]) * q(grow[ow]);
                  accp[r * S + s] = a;
                }
              }
          }
          for (int64_t i = 0; i < R * S; ++i) dwp[(k * C + c) * R * S + i] += static_cast<T>(accp[i]);
        }
      if (db.defined()) {
        T* dbp = db.ptr<T>();
        for (int64_t k = 0; k < K; ++k) {
          double acc = 0;
          for (int64_t n = 0; n < N; ++n)
            for (int64_t i = 0; i < P * Q; ++i) acc += dyp[(n * K + k) * P * Q + i];
          dbp[k] += static_cast<T>(acc);
        }
      }
      return ok_status();
    });
  }

  Status batch_norm_forward_training(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                                     double momentum, Tensor& running_mean, Tensor& running_var, Tensor& y,
                                     Tensor& save_mean, Tensor& save_invstd) override {
    if (x.layout() == Layout::kNhwc)
      return via_plain("batch_norm_forward_training", {&x}, &y, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_forward_training(f[0], gamma, beta, eps, momentum, running_mean, running_var, out, save_mean,
                                           save_invstd);
      });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_batch_norm_training(x, gamma, beta, running_mean, running_var, y, save_mean,
                                                                 save_invstd, detail::with_half(dtypes_))
                                .status());
      return via_f32({&x}, y, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_forward_training(f[0], gamma, beta, eps, momentum, running_mean, running_var, out, save_mean,
                                           save_invstd);
      });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_training(x, gamma, beta, running_mean, running_var, y, save_mean,
                                                                save_invstd, dtypes_));
    SLIDE_ASSIGN_OR_RETURN(const Tensor scratch, bn_scratch(false, x));
    const int64_t N = d.N, C = d.C, HW = d.HW;
    const double count = double(N * HW);
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.ptr<T>();
      for (int64_t c = 0; c < C; ++c) {
        const BnChannel ch{N, C, HW, c};
        const double mean = bn_channel_sum(xp, ch) / count;
        const double sq = bn_channel_deviations(xp, ch, mean);
        bn_channel_normalise(xp, gamma.ptr<T>(), beta.ptr<T>(), mean, sq, count, eps, momentum, running_mean.ptr<T>(),
                             running_var.ptr<T>(), y.ptr<T>(), save_mean.ptr<T>(), save_invstd.ptr<T>(), ch);
      }
      return ok_status();
    });
  }

  Status batch_norm_forward_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      const Tensor& running_mean, const Tensor& running_var, double eps,
                                      Tensor& y) override {
    if (x.layout() == Layout::kNhwc)
      return via_plain("batch_norm_forward_inference", {&x}, &y, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_forward_inference(f[0], gamma, beta, running_mean, running_var, eps, out);
      });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_batch_norm_inference(x, gamma, beta, running_mean, running_var, y,
                                                                  detail::with_half(dtypes_))
                                .status());
      return via_f32({&x}, y, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_forward_inference(f[0], gamma, beta, running_mean, running_var, eps, out);
      });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d, detail::validate_batch_norm_inference(x, gamma, beta, running_mean,
                                                                                         running_var, y, dtypes_));
    const int64_t N = d.N, C = d.C, HW = d.HW;
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.ptr<T>(), *gp = gamma.ptr<T>(), *bp = beta.ptr<T>();
      const T *rm = running_mean.ptr<T>(), *rv = running_var.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t c = 0; c < C; ++c) {
        const double invstd = formulas::bn_invstd(double(rv[c]), eps);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < HW; ++i) {
            const int64_t j = (n * C + c) * HW + i;
            yp[j] = formulas::bn_apply(xp[j], double(gp[c]), double(bp[c]), double(rm[c]), invstd);
          }
      }
      return ok_status();
    });
  }

  Status batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                             const Tensor& save_invstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) override {
    if (any_nhwc({&x, &dy}))
      return via_plain("batch_norm_backward", {&x, &dy}, &dx, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_backward(f[0], f[1], gamma, save_mean, save_invstd, out, dgamma, dbeta);
      });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_batch_norm_backward(x, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta,
                                                                 detail::with_half(dtypes_))
                                .status());
      return via_f32({&x, &dy}, dx, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_backward(f[0], f[1], gamma, save_mean, save_invstd, out, dgamma, dbeta);
      });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_backward(x, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta,
                                                                dtypes_));
    SLIDE_ASSIGN_OR_RETURN(const Tensor scratch, bn_scratch(true, x));
    const int64_t N = d.N, C = d.C, HW = d.HW;
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.ptr<T>(), *dyp = dy.ptr<T>(), *sm = save_mean.ptr<T>(), *si = save_invstd.ptr<T>();
      for (int64_t c = 0; c < C; ++c) {
        const BnChannel ch{N, C, HW, c};
        const auto [sum_dy, sum_dy_xhat] =
            bn_channel_grad_sums(xp, dyp, sm, si, dgamma.ptr<T>(), dbeta.ptr<T>(), ch);
        bn_channel_input_grad(xp, dyp, gamma.ptr<T>(), sm, si, double(N * HW), sum_dy, sum_dy_xhat, dx.ptr<T>(), ch);
      }
      return ok_status();
    });
  }

  // Synchronised batch norm's pieces: the helpers of the two ops above, cut where the sums are
  // all-reduced.
  // Half-precision x (and y, dy, dx) through f32 copies, as the one-rank ops.
  Status batch_norm_stats(const Tensor& x, Tensor& stats) override {
    if (x.layout() == Layout::kNhwc)
      return via_plain("batch_norm_stats", {&x}, nullptr,
                       [&](std::vector<Tensor>& f, Tensor&) { return batch_norm_stats(f[0], stats); });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_batch_norm_stats(x, stats, detail::with_half(dtypes_)).status());
      return via_f32({&x}, stats, [&](std::vector<Tensor>& f, Tensor& out) { return batch_norm_stats(f[0], out); });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d, detail::validate_batch_norm_stats(x, stats, dtypes_));
    const int64_t N = d.N, C = d.C, HW = d.HW;
    return dispatch(x.dtype(), [&]<typename T>() {
      double* st = stats.ptr<double>();
      for (int64_t c = 0; c < C; ++c) st[c] = bn_channel_sum(x.ptr<T>(), {N, C, HW, c});
      st[C] = double(N * HW);
      return ok_status();
    });
  }

  Status batch_norm_deviations(const Tensor& x, const Tensor& stats, Tensor& devs) override {
    if (x.layout() == Layout::kNhwc)
      return via_plain("batch_norm_deviations", {&x}, nullptr,
                       [&](std::vector<Tensor>& f, Tensor&) { return batch_norm_deviations(f[0], stats, devs); });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(
          detail::validate_batch_norm_deviations(x, stats, devs, detail::with_half(dtypes_)).status());
      return via_f32({&x}, devs,
                     [&](std::vector<Tensor>& f, Tensor& out) { return batch_norm_deviations(f[0], stats, out); });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d, detail::validate_batch_norm_deviations(x, stats, devs, dtypes_));
    const int64_t N = d.N, C = d.C, HW = d.HW;
    return dispatch(x.dtype(), [&]<typename T>() {
      const double* st = stats.ptr<double>();
      for (int64_t c = 0; c < C; ++c)
        devs.ptr<double>()[c] = bn_channel_deviations(x.ptr<T>(), {N, C, HW, c}, st[c] / st[C]);
      return ok_status();
    });
  }

  Status batch_norm_forward_from_stats(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& stats,
                                       const Tensor& devs, double eps, double momentum, Tensor& running_mean,
                                       Tensor& running_var, Tensor& y, Tensor& save_mean,
                                       Tensor& save_invstd) override {
    if (x.layout() == Layout::kNhwc)
      return via_plain("batch_norm_forward_from_stats", {&x}, &y, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_forward_from_stats(f[0], gamma, beta, stats, devs, eps, momentum, running_mean, running_var,
                                             out, save_mean, save_invstd);
      });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_batch_norm_forward_from_stats(x, gamma, beta, stats, devs, running_mean,
                                                                           running_var, y, save_mean, save_invstd,
                                                                           detail::with_half(dtypes_))
                                .status());
      return via_f32({&x}, y, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_forward_from_stats(f[0], gamma, beta, stats, devs, eps, momentum, running_mean, running_var,
                                             out, save_mean, save_invstd);
      });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_forward_from_stats(x, gamma, beta, stats, devs, running_mean,
                                                                          running_var, y, save_mean, save_invstd,
                                                                          dtypes_));
    const int64_t N = d.N, C = d.C, HW = d.HW;
    return dispatch(x.dtype(), [&]<typename T>() {
      const double *st = stats.ptr<double>(), *dv = devs.ptr<double>();
      for (int64_t c = 0; c < C; ++c)
        bn_channel_normalise(x.ptr<T>(), gamma.ptr<T>(), beta.ptr<T>(), st[c] / st[C], dv[c], st[C], eps, momentum,
                             running_mean.ptr<T>(), running_var.ptr<T>(), y.ptr<T>(), save_mean.ptr<T>(),
                             save_invstd.ptr<T>(), {N, C, HW, c});
      return ok_status();
    });
  }

  Status batch_norm_backward_reduce(const Tensor& x, const Tensor& dy, const Tensor& save_mean,
                                    const Tensor& save_invstd, Tensor& sums, Tensor& dgamma, Tensor& dbeta) override {
    if (any_nhwc({&x, &dy}))
      return via_plain("batch_norm_backward_reduce", {&x, &dy}, nullptr, [&](std::vector<Tensor>& f, Tensor&) {
        return batch_norm_backward_reduce(f[0], f[1], save_mean, save_invstd, sums, dgamma, dbeta);
      });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_batch_norm_backward_reduce(x, dy, save_mean, save_invstd, sums, dgamma,
                                                                        dbeta, detail::with_half(dtypes_))
                                .status());
      return via_f32({&x, &dy}, sums, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_backward_reduce(f[0], f[1], save_mean, save_invstd, out, dgamma, dbeta);
      });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d, detail::validate_batch_norm_backward_reduce(
                                                       x, dy, save_mean, save_invstd, sums, dgamma, dbeta, dtypes_));
    const int64_t N = d.N, C = d.C, HW = d.HW;
    return dispatch(x.dtype(), [&]<typename T>() {
      double* su = sums.ptr<double>();
      for (int64_t c = 0; c < C; ++c)
        std::tie(su[c], su[C + c]) = bn_channel_grad_sums(x.ptr<T>(), dy.ptr<T>(), save_mean.ptr<T>(),
                                                          save_invstd.ptr<T>(), dgamma.ptr<T>(), dbeta.ptr<T>(),
                                                          {N, C, HW, c});
      return ok_status();
    });
  }

  Status batch_norm_backward_elemt(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                                   const Tensor& save_invstd, const Tensor& stats, const Tensor& sums,
                                   Tensor& dx) override {
    if (any_nhwc({&x, &dy}))
      return via_plain("batch_norm_backward_elemt", {&x, &dy}, &dx, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_backward_elemt(f[0], f[1], gamma, save_mean, save_invstd, stats, sums, out);
      });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_batch_norm_backward_elemt(x, dy, gamma, save_mean, save_invstd, stats,
                                                                       sums, dx, detail::with_half(dtypes_))
                                .status());
      return via_f32({&x, &dy}, dx, [&](std::vector<Tensor>& f, Tensor& out) {
        return batch_norm_backward_elemt(f[0], f[1], gamma, save_mean, save_invstd, stats, sums, out);
      });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_backward_elemt(x, dy, gamma, save_mean, save_invstd, stats, sums,
                                                                      dx, dtypes_));
    const int64_t N = d.N, C = d.C, HW = d.HW;
    return dispatch(x.dtype(), [&]<typename T>() {
      const double *st = stats.ptr<double>(), *su = sums.ptr<double>();
      for (int64_t c = 0; c < C; ++c)
        bn_channel_input_grad(x.ptr<T>(), dy.ptr<T>(), gamma.ptr<T>(), save_mean.ptr<T>(), save_invstd.ptr<T>(), st[C],
                              su[c], su[C + c], dx.ptr<T>(), {N, C, HW, c});
      return ok_status();
    });
  }

  Status relu_forward(const Tensor& x, Tensor& y) override {
    if (x.layout() == Layout::kNhwc)
      return via_plain("relu_forward", {&x}, &y,
                       [&](std::vector<Tensor>& f, Tensor& out) { return relu_forward(f[0], out); });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("relu_forward", x, y, nullptr, detail::with_half(dtypes_)));
      return via_f32({&x}, y, [&](std::vector<Tensor>& f, Tensor& out) { return relu_forward(f[0], out); });
    }
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("relu_forward", x, y, nullptr, dtypes_));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t i = 0; i < x.numel(); ++i) yp[i] = formulas::relu(xp[i]);
      return ok_status();
    });
  }

  Status relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    if (any_nhwc({&y, &dy}))
      return via_plain("relu_backward", {&y, &dy}, &dx,
                       [&](std::vector<Tensor>& f, Tensor& out) { return relu_backward(f[0], f[1], out); });
    if (detail::is_half(y.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("relu_backward", y, dy, &dx, detail::with_half(dtypes_)));
      return via_f32({&y, &dy}, dx, [&](std::vector<Tensor>& f, Tensor& out) { return relu_backward(f[0], f[1], out); });
    }
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("relu_backward", y, dy, &dx, dtypes_));
    return dispatch(y.dtype(), [&]<typename T>() {
      const T *yp = y.ptr<T>(), *dyp = dy.ptr<T>();
      T* dxp = dx.ptr<T>();
      for (int64_t i = 0; i < y.numel(); ++i) dxp[i] = formulas::relu_grad(yp[i], dyp[i]);
      return ok_status();
    });
  }

  Status add(const Tensor& a, const Tensor& b, Tensor& y) override {
    if (any_nhwc({&a, &b}))
      return via_plain("add", {&a, &b}, &y, [&](std::vector<Tensor>& f, Tensor& out) { return add(f[0], f[1], out); });
    if (detail::is_half(b.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_add(a, b, y, detail::with_half(dtypes_)));
      return via_f32({&a, &b}, y, [&](std::vector<Tensor>& f, Tensor& out) { return add(f[0], f[1], out); });
    }
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("add", a, b, &y, dtypes_));
    return dispatch(a.dtype(), [&]<typename T>() {
      const T *ap = a.ptr<T>(), *bp = b.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t i = 0; i < a.numel(); ++i) yp[i] = ap[i] + bp[i];
      return ok_status();
    });
  }

  Status mul(const Tensor& a, const Tensor& b, Tensor& y) override {
    if (detail::is_half(a.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("mul", a, b, &y, detail::with_half(dtypes_)));
      return via_f32({&a, &b}, y, [&](std::vector<Tensor>& f, Tensor& out) { return mul(f[0], f[1], out); });
    }
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("mul", a, b, &y, dtypes_));
    return dispatch(a.dtype(), [&]<typename T>() {
      const T *ap = a.ptr<T>(), *bp = b.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t i = 0; i < a.numel(); ++i) yp[i] = ap[i] * bp[i];
      return ok_status();
    });
  }

  Status max_pool2d_forward(const Tensor& x, Pool2dParams p, Tensor& y) override {
    if (x.layout() == Layout::kNhwc)
      return via_plain("max_pool2d_forward", {&x}, &y,
                       [&](std::vector<Tensor>& f, Tensor& out) { return max_pool2d_forward(f[0], p, out); });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(
          detail::validate_max_pool("max_pool2d_forward", x, p, &y, nullptr, nullptr, detail::with_half(dtypes_))
              .status());
      return via_f32({&x}, y, [&](std::vector<Tensor>& f, Tensor& out) { return max_pool(f[0], nullptr, p, &out, nullptr); });
    }
    return max_pool(x, nullptr, p, &y, nullptr);
  }
  // The op list's composition (fused_conv.cpp); half-precision x, residual and y through f32.
  Status fused_conv2d_inference(const Tensor& x, const FusedConvWeights& w, Conv2dParams p, bool relu,
                                const Tensor* residual, Tensor& y) override {
    if (!detail::is_half(y.dtype())) return Backend::fused_conv2d_inference(x, w, p, relu, residual, y);
    SLIDE_RETURN_IF_ERROR(
        detail::validate_fused_conv2d_inference(this, x, w, p, residual, y, detail::with_half(dtypes_)).status());
    const Tensor none;
    // The residual is copied to f32 before y (which it may be) is written.
    return via_f32({&x, residual ? residual : &none}, y, [&](std::vector<Tensor>& f, Tensor& out) {
      return Backend::fused_conv2d_inference(f[0], w, p, relu, residual ? &f[1] : nullptr, out);
    });
  }
  Status max_pool2d_backward(const Tensor& x, const Tensor& dy, Pool2dParams p, Tensor& dx) override {
    if (any_nhwc({&x, &dy}))
      return via_plain("max_pool2d_backward", {&x, &dy}, &dx,
                       [&](std::vector<Tensor>& f, Tensor& out) { return max_pool2d_backward(f[0], f[1], p, out); });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(
          detail::validate_max_pool("max_pool2d_backward", x, p, nullptr, &dy, &dx, detail::with_half(dtypes_))
              .status());
      return via_f32({&x, &dy}, dx,
                     [&](std::vector<Tensor>& f, Tensor& out) { return max_pool(f[0], &f[1], p, nullptr, &out); });
    }
    return max_pool(x, &dy, p, nullptr, &dx);
  }

  Status global_avg_pool_forward(const Tensor& x, Tensor& y) override {
    if (x.layout() == Layout::kNhwc)  // y [N, C] stays plain
      return via_plain("global_avg_pool_forward", {&x}, nullptr,
                       [&](std::vector<Tensor>& f, Tensor&) { return global_avg_pool_forward(f[0], y); });
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(
          detail::validate_global_avg_pool("global_avg_pool_forward", x, y, detail::with_half(dtypes_)).status());
      return via_f32({&x}, y, [&](std::vector<Tensor>& f, Tensor& out) { return global_avg_pool_forward(f[0], out); });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d, detail::validate_global_avg_pool("global_avg_pool_forward", x, y, dtypes_));
    const int64_t N = d.N, C = d.C, HW = d.HW;
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t j = 0; j < N * C; ++j) {
        double s = 0;
        for (int64_t i = 0; i < HW; ++i) s += xp[j * HW + i];
        yp[j] = static_cast<T>(s / double(HW));
      }
      return ok_status();
    });
  }

  Status global_avg_pool_backward(const Tensor& dy, Tensor& dx) override {
    if (dx.layout() == Layout::kNhwc)  // dy [N, C] is plain; dx's label asks for channels last
      return via_plain("global_avg_pool_backward", {}, &dx,
                       [&](std::vector<Tensor>&, Tensor& out) { return global_avg_pool_backward(dy, out); });
    if (detail::is_half(dy.dtype())) {
      SLIDE_RETURN_IF_ERROR(
          detail::validate_global_avg_pool("global_avg_pool_backward", dx, dy, detail::with_half(dtypes_)).status());
      return via_f32({&dy}, dx, [&](std::vector<Tensor>& f, Tensor& out) { return global_avg_pool_backward(f[0], out); });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_global_avg_pool("global_avg_pool_backward", dx, dy, dtypes_));
    const int64_t N = d.N, C = d.C, HW = d.HW;
    return dispatch(dy.dtype(), [&]<typename T>() {
      const T* dyp = dy.ptr<T>();
      T* dxp = dx.ptr<T>();
      for (int64_t j = 0; j < N * C; ++j)
        for (int64_t i = 0; i < HW; ++i) dxp[j * HW + i] = static_cast<T>(double(dyp[j]) / double(HW));
      return ok_status();
    });
  }

  Status linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) override {
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_linear("linear_forward", x, w, &b, y, detail::with_half(dtypes_)).status());
      return via_f32({&x, &w, &b}, y,
                     [&](std::vector<Tensor>& f, Tensor& out) { return linear_forward(f[0], f[1], f[2], out); });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_linear("linear_forward", x, w, &b, y, dtypes_));
    const int64_t N = d.N, I = d.I, O = d.O;
    return dispatch_product(x.dtype(), math_precision_, [&]<typename T>(auto q) {
      const T *xp = x.ptr<T>(), *wp = w.ptr<T>(), *bp = b.defined() ? b.ptr<T>() : nullptr;
      T* yp = y.ptr<T>();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t o = 0; o < O; ++o) {
          double acc = bp ? double(bp[o]) : 0.0;
          for (int64_t i = 0; i < I; ++i) acc += q(xp[n * I + i]) * q(wp[o * I + i]);
          yp[n * O + o] = static_cast<T>(acc);
        }
      return ok_status();
    });
  }

  Status linear_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx) override {
    if (detail::is_half(dy.dtype())) {
      SLIDE_RETURN_IF_ERROR(
          detail::validate_linear("linear_backward_data", dx, w, nullptr, dy, detail::with_half(dtypes_)).status());
      return via_f32({&dy, &w}, dx,
                     [&](std::vector<Tensor>& f, Tensor& out) { return linear_backward_data(f[0], f[1], out); });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d,
                           detail::validate_linear("linear_backward_data", dx, w, nullptr, dy, dtypes_));
    const int64_t N = d.N, I = d.I, O = d.O;
    return dispatch_product(dy.dtype(), math_precision_, [&]<typename T>(auto q) {
      const T *dyp = dy.ptr<T>(), *wp = w.ptr<T>();
      T* dxp = dx.ptr<T>();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < I; ++i) {
          double acc = 0;
          for (int64_t o = 0; o < O; ++o) acc += q(dyp[n * O + o]) * q(wp[o * I + i]);
          dxp[n * I + i] = static_cast<T>(acc);
        }
      return ok_status();
    });
  }

  Status linear_backward_weights(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db) override {
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_linear_backward_weights(x, dy, dw, db, detail::with_half(dtypes_)).status());
      return half_weight_gradient(x, dy, dw, db, [&](const Tensor& xf, const Tensor& dyf, Tensor& dwf, Tensor& dbf) {
        return linear_backward_weights(xf, dyf, dwf, dbf);
      });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_linear_backward_weights(x, dy, dw, db, dtypes_));
    const int64_t N = d.N, I = d.I, O = d.O;
    return dispatch_product(x.dtype(), math_precision_, [&]<typename T>(auto q) {
      const T *xp = x.ptr<T>(), *dyp = dy.ptr<T>();
      T* dwp = dw.ptr<T>();
      for (int64_t o = 0; o < O; ++o)
        for (int64_t i = 0; i < I; ++i) {
          double acc = 0;
          for (int64_t n = 0; n < N; ++n) acc += q(dyp[n * O + o]) * q(xp[n * I + i]);
          dwp[o * I + i] += static_cast<T>(acc);
        }
      if (db.defined()) {
        T* dbp = db.ptr<T>();
        for (int64_t o = 0; o < O; ++o) {
          double acc = 0;
          for (int64_t n = 0; n < N; ++n) acc += dyp[n * O + o];
          dbp[o] += static_cast<T>(acc);
        }
      }
      return ok_status();
    });
  }

  Status softmax_cross_entropy_forward(const Tensor& logits, const Tensor& labels, const Tensor& class_weights,
                                       double label_smoothing, Tensor& probs, double* loss) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d,
                           detail::validate_cross_entropy("softmax_cross_entropy_forward", logits, labels, class_weights,
                                                          label_smoothing, probs, dtypes_));
    const int64_t N = d.N, C = d.I;
    return dispatch(logits.dtype(), [&]<typename T>() {
      const T *zp = logits.ptr<T>(), *wp = class_weights.defined() ? class_weights.ptr<T>() : nullptr;
      const int32_t* yp = labels.ptr<int32_t>();
      T* pp = probs.ptr<T>();
      for (int64_t n = 0; n < N; ++n) {
        // log-sum-exp with the max subtracted (no overflow for large logits).
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t c = 0; c < C; ++c) m = std::max(m, double(zp[n * C + c]));
        double se = 0;
        for (int64_t c = 0; c < C; ++c) se += std::exp(double(zp[n * C + c]) - m);
        const double lse = m + std::log(se);
        for (int64_t c = 0; c < C; ++c) pp[n * C + c] = static_cast<T>(double(zp[n * C + c]) - lse);
      }
      *loss = detail::nll_to_probs(pp, yp, wp, N, C, label_smoothing);
      return ok_status();
    });
  }

  Status softmax_cross_entropy_backward(const Tensor& probs, const Tensor& labels, const Tensor& class_weights,
                                        double label_smoothing, Tensor& dlogits) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d,
                           detail::validate_cross_entropy("softmax_cross_entropy_backward", probs, labels, class_weights,
                                                          label_smoothing, dlogits, dtypes_));
    const int64_t N = d.N, C = d.I;
    return dispatch(probs.dtype(), [&]<typename T>() {
      const T *pp = probs.ptr<T>(), *wp = class_weights.defined() ? class_weights.ptr<T>() : nullptr;
      const int32_t* yp = labels.ptr<int32_t>();
      T* dp = dlogits.ptr<T>();
      double weight_sum = 0, classes_sum = 0;
      for (int64_t n = 0; n < N; ++n) weight_sum += wp ? double(wp[yp[n]]) : 1.0;
      for (int64_t c = 0; c < C; ++c) classes_sum += wp ? double(wp[c]) : 1.0;
      const double inv_weight_sum = weight_sum > 0 ? 1.0 / weight_sum : 0.0;
      for (int64_t n = 0; n < N; ++n) {
        const double wn = wp ? double(wp[yp[n]]) : 1.0;
        const double target_sum = formulas::cross_entropy_target_sum(wn, label_smoothing, C, classes_sum);
        for (int64_t c = 0; c < C; ++c) {
          const double target =
              formulas::cross_entropy_target(c, yp[n], label_smoothing, C, wn, wp ? double(wp[c]) : 1.0);
          dp[n * C + c] = formulas::cross_entropy_grad(pp[n * C + c], target, target_sum, inv_weight_sum);
        }
      }
      return ok_status();
    });
  }

  Status sgd_update(Tensor& param, const Tensor& grad, Tensor& momentum_buf, double lr, double momentum,
                    double dampening, double weight_decay, bool nesterov, bool first_step) override {
    SLIDE_RETURN_IF_ERROR(
        detail::validate_same_shape("sgd_update", param, grad, momentum > 0 ? &momentum_buf : nullptr, dtypes_));
    return dispatch(param.dtype(), [&]<typename T>() {
      T* p = param.ptr<T>();
      const T* g = grad.ptr<T>();
      T* buf = momentum > 0 ? momentum_buf.ptr<T>() : nullptr;
      for (int64_t i = 0; i < param.numel(); ++i)
        formulas::sgd_step(p[i], g[i], buf != nullptr ? buf + i : nullptr, lr, momentum, dampening, weight_decay,
                           nesterov, first_step);
      return ok_status();
    });
  }

  Status adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr, double beta1, double beta2,
                      double eps, double weight_decay, int64_t step) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("adamw_update", param, grad, &m, dtypes_));
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("adamw_update", param, v, nullptr, dtypes_));
    if (step < 1) return slide::core::invalid_argument("adamw_update: step " + std::to_string(step) + " < 1");
    const formulas::AdamCorrections c = formulas::adam_corrections(beta1, beta2, step);
    return dispatch(param.dtype(), [&]<typename T>() {
      T *p = param.ptr<T>(), *mp = m.ptr<T>(), *vp = v.ptr<T>();
      const T* g = grad.ptr<T>();
      for (int64_t i = 0; i < param.numel(); ++i)
        formulas::adamw_step(p[i], g[i], mp[i], vp[i], lr, beta1, beta2, eps, weight_decay, c);
      return ok_status();
    });
  }

  // --- Attention MIL ops ---
  Status tanh_forward(const Tensor& x, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("tanh_forward", x, y, nullptr, dtypes_));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t i = 0; i < x.numel(); ++i) yp[i] = formulas::tanh_act(xp[i]);
      return ok_status();
    });
  }

  Status tanh_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("tanh_backward", y, dy, &dx, dtypes_));
    return dispatch(y.dtype(), [&]<typename T>() {
      const T *yp = y.ptr<T>(), *dyp = dy.ptr<T>();
      T* dxp = dx.ptr<T>();
      for (int64_t i = 0; i < y.numel(); ++i) dxp[i] = formulas::tanh_grad(yp[i], dyp[i]);
      return ok_status();
    });
  }

  Status sigmoid_forward(const Tensor& x, Tensor& y) override {
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("sigmoid_forward", x, y, nullptr, detail::with_half(dtypes_)));
      return via_f32({&x}, y, [&](std::vector<Tensor>& f, Tensor& out) { return sigmoid_forward(f[0], out); });
    }
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("sigmoid_forward", x, y, nullptr, dtypes_));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t i = 0; i < x.numel(); ++i) yp[i] = formulas::sigmoid(xp[i]);
      return ok_status();
    });
  }

  Status sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("sigmoid_backward", y, dy, &dx, dtypes_));
    return dispatch(y.dtype(), [&]<typename T>() {
      const T *yp = y.ptr<T>(), *dyp = dy.ptr<T>();
      T* dxp = dx.ptr<T>();
      for (int64_t i = 0; i < y.numel(); ++i) dxp[i] = formulas::sigmoid_grad(yp[i], dyp[i]);
      return ok_status();
    });
  }

  Status softmax_forward(const Tensor& x, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_rows("softmax_forward", x, y, nullptr, dtypes_));
    const int64_t R = d.N, C = d.I;
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t r = 0; r < R; ++r) {
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t c = 0; c < C; ++c) m = std::max(m, double(xp[r * C + c]));
        double se = 0;
        for (int64_t c = 0; c < C; ++c) se += formulas::softmax_term(double(xp[r * C + c]), m);
        for (int64_t c = 0; c < C; ++c)
          yp[r * C + c] = static_cast<T>(formulas::softmax_term(double(xp[r * C + c]), m) / se);
      }
      return ok_status();
    });
  }

  Status softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_rows("softmax_backward", y, dy, &dx, dtypes_));
    const int64_t R = d.N, C = d.I;
    return dispatch(y.dtype(), [&]<typename T>() {
      const T *yp = y.ptr<T>(), *dyp = dy.ptr<T>();
      T* dxp = dx.ptr<T>();
      for (int64_t r = 0; r < R; ++r) {
        double dot = 0;
        for (int64_t c = 0; c < C; ++c) dot += double(dyp[r * C + c]) * double(yp[r * C + c]);
        for (int64_t c = 0; c < C; ++c)
          dxp[r * C + c] = static_cast<T>(formulas::softmax_grad(double(yp[r * C + c]), double(dyp[r * C + c]), dot));
      }
      return ok_status();
    });
  }

  // --- Vision Transformer ops ---
  Status layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y) override {
    if (detail::is_half(x.dtype()) || detail::is_half(y.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_layer_norm(x, gamma, beta, eps, y, detail::with_half(dtypes_)).status());
      return via_f32({&x}, y, [&](std::vector<Tensor>& f, Tensor& out) {
        return layer_norm_forward(f[0], gamma, beta, eps, out);
      });
    }
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_layer_norm(x, gamma, beta, eps, y, dtypes_));
    const int64_t R = d.N, C = d.I;
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.ptr<T>(), *gp = gamma.ptr<T>(), *bp = beta.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t r = 0; r < R; ++r) {
        const T* row = xp + r * C;
        double sum = 0;
        for (int64_t c = 0; c < C; ++c) sum += row[c];
        const double mean = sum / double(C);
        double sq = 0;
        for (int64_t c = 0; c < C; ++c) sq += (double(row[c]) - mean) * (double(row[c]) - mean);
        const double invstd = formulas::bn_invstd(sq / double(C), eps);
        for (int64_t c = 0; c < C; ++c)
          yp[r * C + c] = formulas::bn_apply(row[c], double(gp[c]), double(bp[c]), mean, invstd);
      }
      return ok_status();
    });
  }

  Status gelu_forward(const Tensor& x, Tensor& y) override {
    if (detail::is_half(x.dtype())) {
      SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("gelu_forward", x, y, nullptr, detail::with_half(dtypes_)));
      // In f32 arithmetic (formulas::gelu_f32), as cuda's half-precision kernel.
      return via_f32({&x}, y, [&](std::vector<Tensor>& f, Tensor& out) {
        const float* xp = f[0].ptr<float>();
        float* yp = out.ptr<float>();
        for (int64_t i = 0; i < out.numel(); ++i) yp[i] = formulas::gelu_f32(xp[i]);
        return ok_status();
      });
    }
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("gelu_forward", x, y, nullptr, dtypes_));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t i = 0; i < x.numel(); ++i) yp[i] = formulas::gelu(xp[i]);
      return ok_status();
    });
  }

  Status gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("gelu_backward", x, dy, &dx, dtypes_));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.ptr<T>(), *dyp = dy.ptr<T>();
      T* dxp = dx.ptr<T>();
      for (int64_t i = 0; i < x.numel(); ++i) dxp[i] = formulas::gelu_grad(xp[i], dyp[i]);
      return ok_status();
    });
  }

  // Channels last (backend.h): the reference stores kNhwc tensors as cuda does ([N][H][W][C]) and
  // runs the listed ops on plain copies (via_plain), so that the model code of channels-last
  // training runs on the CPU and the values are the plain run's bit for bit.
  Result<Tensor> to_plain(const Tensor& x) override {
    if (x.layout() == Layout::kPlain) return x;
    if (x.layout() != Layout::kNhwc) return Backend::to_plain(x);
    SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty(x.shape(), x.dtype(), alloc_, "plain copy"));
    relayout(x, y, false);
    return y;
  }
  Result<Tensor> to_channels_last(const Tensor& x) override {
    if (x.layout() == Layout::kNhwc) return x;
    if (x.rank() != 4 || x.layout() != Layout::kPlain)
      return slide::core::invalid_argument("to_channels_last: a " + shape_string(x.shape()) + " " +
                                           layout_name(x.layout()) + " tensor; needs a plain [N, C, H, W]");
    SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty(x.shape(), x.dtype(), alloc_, "channels-last copy"));
    relayout(x, y, true);
    SLIDE_RETURN_IF_ERROR(y.set_layout(Layout::kNhwc));
    return y;
  }

  Status gather_augment(const Tensor& tiles, const Tensor& records, Tensor& images) override {
    SLIDE_ASSIGN_OR_RETURN(const int64_t B, detail::validate_gather_augment(tiles, records, images, dtypes_));
    const int64_t N = tiles.dim(0), S = tiles.dim(1);
    // The very function TileDataset::load_batch calls per image (augment.cpp).
    std::vector<float> scratch(static_cast<size_t>(3 * S * S));
    for (int64_t b = 0; b < B; ++b) {
      AugmentRecord r;
      std::memcpy(&r, records.ptr<uint8_t>() + b * static_cast<int64_t>(sizeof r), sizeof r);
      SLIDE_RETURN_IF_ERROR(detail::validate_augment_record(r, N, S));
      augment_image(tiles.ptr<uint8_t>() + r.index * 3 * S * S, S, r, images.ptr<float>() + b * 3 * S * S,
                    scratch.data());
    }
    return ok_status();
  }

  Status cast(const Tensor& x, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_cast(x, y, dtypes_));
    // Through double: exact for every source (f64 to f32 rounds once, as a static_cast does).
    auto load = [&](int64_t i) -> double {
      switch (x.dtype()) {
        case DType::kF64: return x.ptr<double>()[i];
        case DType::kF16: return formulas::f16_to_f32(x.ptr<uint16_t>()[i]);
        case DType::kBF16: return formulas::bf16_to_f32(x.ptr<uint16_t>()[i]);
        default: return x.ptr<float>()[i];
      }
    };
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) {
      const double v = load(i);
      switch (y.dtype()) {
        case DType::kF64: y.ptr<double>()[i] = v; break;
        // From f64, round to f32 first: the half formulas take f32 (a double rounding that
        // cannot change a value that came from f32, f16 or bf16).
        case DType::kF16: y.ptr<uint16_t>()[i] = formulas::f32_to_f16(static_cast<float>(v)); break;
        case DType::kBF16: y.ptr<uint16_t>()[i] = formulas::f32_to_bf16(static_cast<float>(v)); break;
        default: y.ptr<float>()[i] = static_cast<float>(v); break;
      }
    }
    return ok_status();
  }

  Status sum_of_squares(const Tensor& x, double* out) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("sum_of_squares", x, x, nullptr, dtypes_));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.ptr<T>();
      double sq = 0;
      for (int64_t i = 0; i < x.numel(); ++i) sq += formulas::squared(xp[i]);
      *out = sq;
      return ok_status();
    });
  }

  Status scale(const Tensor& x, double alpha, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("scale", x, y, nullptr, dtypes_));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t i = 0; i < x.numel(); ++i) yp[i] = static_cast<T>(alpha * double(xp[i]));
      return ok_status();
    });
  }

  Status permute(const Tensor& x, const std::vector<int>& perm, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_permute(x, perm, y, detail::with_half(dtypes_)));
    const size_t rank = perm.size();
    // Strides of x (row-major), taken in y's order: y's index i walks x with in_stride[i].
    int64_t x_stride[6] = {0}, in_stride[6] = {0}, extent[6] = {0};
    int64_t s = 1;
    for (size_t i = rank; i-- > 0;) x_stride[i] = s, s *= x.dim(i);
    for (size_t i = 0; i < rank; ++i) in_stride[i] = x_stride[perm[i]], extent[i] = y.dim(i);
    auto run = [&]<typename T>() {
      const T* xp = x.ptr<T>();
      T* yp = y.ptr<T>();
      int64_t idx[6] = {0};
      for (int64_t o = 0; o < y.numel(); ++o) {
        int64_t src = 0;
        for (size_t i = 0; i < rank; ++i) src += idx[i] * in_stride[i];
        yp[o] = xp[src];
        for (size_t i = rank; i-- > 0;) {  // odometer over y's index
          if (++idx[i] < extent[i]) break;
          idx[i] = 0;
        }
      }
      return ok_status();
    };
    // Elements are moved, not computed: half-precision storage as its 16-bit patterns.
    if (detail::is_half(x.dtype())) return run.template operator()<uint16_t>();
    return dispatch(x.dtype(), run);
  }

  // Attention: the op list's default composition (attention.cpp); half-precision qkv through f32.
  Status attention_forward(const Tensor& qkv, int64_t batch, int64_t heads, double scale, Tensor& out) override {
    if (detail::is_half(qkv.dtype())) {
      SLIDE_RETURN_IF_ERROR(
          detail::validate_attention(qkv, batch, heads, scale, out, detail::with_half(dtypes_)).status());
      return via_f32({&qkv}, out, [&](std::vector<Tensor>& f, Tensor& o) {
        return Backend::attention_forward(f[0], batch, heads, scale, o);
      });
    }
    return Backend::attention_forward(qkv, batch, heads, scale, out);
  }

  Status matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::MatmulDims d, detail::validate_matmul(a, transpose_a, b, transpose_b, y, dtypes_));
    const int64_t M = d.M, K = d.K, N = d.N;
    return dispatch_product(a.dtype(), math_precision_, [&]<typename T>(auto q) {
      const T *ap = a.ptr<T>(), *bp = b.ptr<T>();
      T* yp = y.ptr<T>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = 0;
          for (int64_t k = 0; k < K; ++k)
            acc += q(ap[transpose_a ? k * M + m : m * K + k]) * q(bp[transpose_b ? n * K + k : k * N + n]);
          yp[m * N + n] = static_cast<T>(acc);
        }
      return ok_status();
    });
  }

 private:
  // Forward (y != nullptr) or backward (dx != nullptr) of max pooling.
  // Half-precision storage (backend.h): `op` run in f32 on f32 copies of the half inputs (exact
  // conversions), its f32 result rounded once into `out` (cast: round to nearest even). Inputs
  // already f32, and undefined ones, pass as they are; so does `out` when it is f32 (an input may
  // then be out itself: the ops called are element-wise in place).
  // y = x's elements moved between plain NCHW and channels last (to_nhwc: x plain, y stored
  // [N][H][W][C]; else the reverse) by kernels::nhwc_position, cuda's map; any element size.
  static void relayout(const Tensor& x, Tensor& y, bool to_nhwc) {
    const int64_t C = x.dim(1), HW = x.dim(2) * x.dim(3), n = x.numel();
    const size_t e = dtype_size(x.dtype());
    const auto* src = static_cast<const unsigned char*>(x.raw());
    auto* dst = static_cast<unsigned char*>(y.raw());
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = kernels::nhwc_position(j, C, HW);
      std::memcpy(dst + static_cast<size_t>(to_nhwc ? k : j) * e, src + static_cast<size_t>(to_nhwc ? j : k) * e, e);
    }
  }
  static bool any_nhwc(std::initializer_list<const Tensor*> ts) {
    for (const Tensor* t : ts)
      if (t->defined() && t->layout() == Layout::kNhwc) return true;
    return false;
  }
  // Channels last (backend.h): `op` on plain copies of the call's image tensors `in` (each defined
  // one kNhwc: a mix of layouts is kInvalidArgument naming `name`), its image result (out non-null)
  // written plain into scratch, then moved into *out channels last and *out labelled kNhwc. The op
  // validates shapes and dtypes on the plain copies; in-place calls (out one of `in`) are safe.
  template <typename Op>
  Status via_plain(const char* name, std::initializer_list<const Tensor*> in, Tensor* out, Op op) {
    std::vector<Tensor> plain;
    for (const Tensor* t : in) {
      if (!t->defined()) {
        plain.push_back(*t);
        continue;
      }
      if (t->layout() != Layout::kNhwc)
        return slide::core::invalid_argument(std::string(name) + ": image tensors in two layouts (" +
                                             layout_name(t->layout()) + " and nhwc); one layout per call");
      SLIDE_ASSIGN_OR_RETURN(Tensor p, to_plain(*t));
      plain.push_back(std::move(p));
    }
    Tensor result;
    if (out != nullptr) {
      if (out->rank() != 4)
        return slide::core::invalid_argument(std::string(name) + ": a channels-last output of shape " +
                                             shape_string(out->shape()));
      SLIDE_ASSIGN_OR_RETURN(result, Tensor::empty(out->shape(), out->dtype(), alloc_, "plain result"));
    }
    SLIDE_RETURN_IF_ERROR(op(plain, result));
    if (out == nullptr) return ok_status();
    relayout(result, *out, true);
    return out->set_layout(Layout::kNhwc);
  }

  template <typename Op>
  Status via_f32(std::initializer_list<const Tensor*> in, Tensor& out, Op op) {
    std::vector<Tensor> f;
    for (const Tensor* t : in) {
      if (!t->defined() || !detail::is_half(t->dtype())) {
        f.push_back(*t);
        continue;
      }
      SLIDE_ASSIGN_OR_RETURN(Tensor up, Tensor::empty(t->shape(), DType::kF32, alloc_, "f32 copy of a half operand"));
      SLIDE_RETURN_IF_ERROR(cast(*t, up));
      f.push_back(std::move(up));
    }
    if (!detail::is_half(out.dtype())) return op(f, out);
    SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty(out.shape(), DType::kF32, alloc_, "f32 result before rounding"));
    SLIDE_RETURN_IF_ERROR(op(f, y));
    return cast(y, out);
  }

  // A weight gradient from half-precision x and dy (backend.h, "Half-precision storage"): `op`
  // (the f32 op) on f32 copies of x and dy into a zeroed f32 product, which via_f32 rounds once to
  // the half type (as cuDNN writes a half-precision filter gradient: the coarsest result allowed);
  // that is then added to dw in f32. db takes its f32 sum unrounded.
  template <typename Op>
  Status half_weight_gradient(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db, Op op) {
    SLIDE_ASSIGN_OR_RETURN(Tensor rounded, Tensor::empty(dw.shape(), x.dtype(), alloc_, "half weight gradient"));
    SLIDE_RETURN_IF_ERROR(via_f32({&x, &dy}, rounded, [&](std::vector<Tensor>& f, Tensor& product) {
      SLIDE_RETURN_IF_ERROR(alloc_.zero_bytes(product.raw(), product.bytes()));
      return op(f[0], f[1], product, db);
    }));
    return add(dw, rounded, dw);
  }

  Status max_pool(const Tensor& x, const Tensor* dy, Pool2dParams p, Tensor* y, Tensor* dx) {
    SLIDE_ASSIGN_OR_RETURN(const detail::PoolDims d,
                           detail::validate_max_pool(y ? "max_pool2d_forward" : "max_pool2d_backward", x, p, y, dy, dx,
                                                     dtypes_));
    const int64_t N = d.N, C = d.C, H = d.H, W = d.W, P = d.P, Q = d.Q;
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.ptr<T>();
      if (dx && dx->bytes() > 0) std::memset(dx->raw(), 0, dx->bytes());
      for (int64_t nc = 0; nc < N * C; ++nc)
        for (int64_t oh = 0; oh < P; ++oh)
          for (int64_t ow = 0; ow < Q; ++ow) {
            const int64_t best = formulas::max_pool_argmax(xp, nc, oh, ow, H, W, p.kernel, p.stride, p.pad);
            const int64_t o = (nc * P + oh) * Q + ow;
            if (y) y->ptr<T>()[o] = best >= 0 ? xp[best] : T(0);
            if (dx && best >= 0) dx->ptr<T>()[best] += dy->ptr<T>()[o];
          }
      return ok_status();
    });
  }

  // The simulated workspace, or kResourceExhausted for a tensor past cuDNN's descriptor limit
  // (cuda::fits_cudnn_descriptor), as the cuda backend refuses it.
  static Result<size_t> workspace_bytes(ConvPass pass, const detail::ConvDims& d, Conv2dParams p, DType dtype) {
    if (!cuda::fits_cudnn_descriptor(d.N, d.C, d.H, d.W) || !cuda::fits_cudnn_descriptor(d.N, d.K, d.P, d.Q))
      return slide::core::resource_exhausted("simulated device: a convolution of " + std::to_string(d.N) + "x" +
                                             std::to_string(d.C) + "x" + std::to_string(d.H) + "x" +
                                             std::to_string(d.W) + " is past cuDNN's 2^31-1 elements per tensor");
    return simulated_conv_workspace_bytes(pass, d.N, d.C, d.H, d.W, d.K, d.R, d.S, d.P, d.Q, p, dtype);
  }
  // Batch norm's scratch on the simulated device with simulated workspaces: cuda's f64 partial sums
  // (Backend::batch_norm_scratch_bytes), held by the caller for the op's length.
  size_t batch_norm_scratch_bytes(bool backward, const Tensor& x) override {
    if (!simulated_workspace_ || x.rank() != 4) return 0;
    return static_cast<size_t>(kernels::bn_scratch_bytes(backward, x.dim(0), x.dim(1), x.dim(2) * x.dim(3)));
  }
  Result<Tensor> bn_scratch(bool backward, const Tensor& x) {
    const size_t bytes = batch_norm_scratch_bytes(backward, x);
    if (bytes == 0) return Tensor();
    return Tensor::empty({static_cast<int64_t>(bytes)}, DType::kU8, alloc_, "simulated batch norm scratch");
  }
  // The simulated workspace of one pass, held by the caller for the pass's length (an undefined
  // tensor when there is none).
  Result<Tensor> workspace(ConvPass pass, const detail::ConvDims& d, Conv2dParams p, DType dtype) {
    if (!simulated_workspace_) return Tensor();
    SLIDE_ASSIGN_OR_RETURN(const size_t bytes, workspace_bytes(pass, d, p, dtype));
    if (bytes == 0) return Tensor();
    return Tensor::empty({static_cast<int64_t>(bytes)}, DType::kU8, alloc_, "simulated convolution workspace");
  }

  Allocator& alloc_;
  const detail::DTypes dtypes_;  // f32 and f64, plain layouts, on alloc_'s device
  const bool simulated_workspace_;
  std::unique_ptr<CopyEngine> engine_;
};

}  // namespace

size_t simulated_conv_workspace_bytes(ConvPass pass, int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, int64_t R,
                                      int64_t S, int64_t P, int64_t Q, Conv2dParams p, DType dtype) {
  if (N * C * H * W == 0 || N * K * P * Q == 0) return 0;
  if (R == 1 && S == 1 && p.stride == 1 && p.pad == 0) return 0;
  int64_t elements = C * R * S * P * Q;
  if (pass == ConvPass::kBackwardData) elements += C * H * W;
  if (pass == ConvPass::kBackwardWeights) elements += K * C * R * S;
  return static_cast<size_t>(elements) * dtype_size(dtype);
}

std::unique_ptr<Backend> make_reference_backend(Allocator& alloc, bool simulated_conv_workspace) {
  return std::make_unique<ReferenceBackend>(alloc, simulated_conv_workspace);
}

}  // namespace slide::train
