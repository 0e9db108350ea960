#include "reference_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace slide::train {

int64_t conv_out_extent(int64_t in, int64_t kernel, int stride, int pad) {
  if (stride < 1) return 0;
  const int64_t span = in + 2 * int64_t{pad} - kernel;
  return span < 0 ? 0 : span / stride + 1;
}

namespace {

using slide::core::invalid_argument;
using slide::core::ok_status;
using slide::core::unimplemented;

Status want_shape(const char* op, const char* name, const Tensor& t, const Shape& shape) {
  if (!t.defined() || t.shape() != shape)
    return invalid_argument(std::string(op) + ": " + name + " is " + (t.defined() ? shape_string(t.shape()) : "undefined") +
                            ", expected " + shape_string(shape));
  return ok_status();
}

Status want_rank(const char* op, const char* name, const Tensor& t, size_t rank) {
  if (!t.defined() || t.rank() != rank)
    return invalid_argument(std::string(op) + ": " + name + " must have rank " + std::to_string(rank) + ", is " +
                            (t.defined() ? shape_string(t.shape()) : "undefined"));
  return ok_status();
}

// Every floating tensor of a call has `dtype`, and lives on the CPU.
Status want_dtype(const char* op, DType dtype, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (t->dtype() != dtype)
      return invalid_argument(std::string(op) + ": mixed dtypes (" + dtype_name(t->dtype()) + " and " +
                              dtype_name(dtype) + ")");
    if (t->device() != Device::kCpu) return invalid_argument(std::string(op) + ": a tensor is not on the CPU");
  }
  if (dtype != DType::kF32 && dtype != DType::kF64)
    return unimplemented(std::string(op) + ": dtype " + dtype_name(dtype) + " (reference has f32 and f64)");
  return ok_status();
}

using Named = std::initializer_list<std::pair<const char*, const Tensor*>>;

// Runs f.template operator()<T>() for the call's dtype.
template <typename F>
Status dispatch(DType dtype, F&& f) {
  if (dtype == DType::kF64) return f.template operator()<double>();
  return f.template operator()<float>();
}

class ReferenceBackend final : public Backend {
 public:
  explicit ReferenceBackend(Allocator& alloc) : alloc_(alloc) {}
  std::string name() const override { return "reference"; }
  Device device() const override { return Device::kCpu; }
  Allocator& allocator() override { return alloc_; }

  Status conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Conv2dParams p, Tensor& y) override {
    const char* op = "conv2d_forward";
    SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
    SLIDE_RETURN_IF_ERROR(want_rank(op, "w", w, 4));
    const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
    const int64_t K = w.dim(0), R = w.dim(2), S = w.dim(3);
    if (w.dim(1) != C) return invalid_argument(std::string(op) + ": w " + shape_string(w.shape()) + " vs x " + shape_string(x.shape()));
    const int64_t P = conv_out_extent(H, R, p.stride, p.pad), Q = conv_out_extent(W, S, p.stride, p.pad);
    SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, {N, K, P, Q}));
    if (b.defined()) SLIDE_RETURN_IF_ERROR(want_shape(op, "b", b, {K}));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, x.dtype(), {&x, &w, &b, &y}));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.data<T>(), *wp = w.data<T>(), *bp = b.defined() ? b.data<T>() : nullptr;
      T* yp = y.data<T>();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
          for (int64_t oh = 0; oh < P; ++oh)
            for (int64_t ow = 0; ow < Q; ++ow) {
              double acc = bp ? double(bp[k]) : 0.0;
              for (int64_t c = 0; c < C; ++c)
                for (int64_t r = 0; r < R; ++r) {
                  const int64_t ih = oh * p.stride - p.pad + r;
                  if (ih < 0 || ih >= H) continue;
                  for (int64_t s = 0; s < S; ++s) {
                    const int64_t iw = ow * p.stride - p.pad + s;
                    if (iw < 0 || iw >= W) continue;
                    acc += double(xp[((n * C + c) * H + ih) * W + iw]) * double(wp[((k * C + c) * R + r) * S + s]);
                  }
                }
              yp[((n * K + k) * P + oh) * Q + ow] = static_cast<T>(acc);
            }
      return ok_status();
    });
  }

  Status conv2d_backward_data(const Tensor& dy, const Tensor& w, Conv2dParams p, Tensor& dx) override {
    const char* op = "conv2d_backward_data";
    SLIDE_RETURN_IF_ERROR(want_rank(op, "dy", dy, 4));
    SLIDE_RETURN_IF_ERROR(want_rank(op, "w", w, 4));
    SLIDE_RETURN_IF_ERROR(want_rank(op, "dx", dx, 4));
    const int64_t N = dx.dim(0), C = dx.dim(1), H = dx.dim(2), W = dx.dim(3);
    const int64_t K = w.dim(0), R = w.dim(2), S = w.dim(3);
    const int64_t P = conv_out_extent(H, R, p.stride, p.pad), Q = conv_out_extent(W, S, p.stride, p.pad);
    SLIDE_RETURN_IF_ERROR(want_shape(op, "w", w, {K, C, R, S}));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", dy, {N, K, P, Q}));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, dy.dtype(), {&dy, &w, &dx}));
    return dispatch(dy.dtype(), [&]<typename T>() {
      const T *dyp = dy.data<T>(), *wp = w.data<T>();
      std::vector<double> acc(static_cast<size_t>(dx.numel()), 0.0);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
          for (int64_t oh = 0; oh < P; ++oh)
            for (int64_t ow = 0; ow < Q; ++ow) {
              const double g = dyp[((n * K + k) * P + oh) * Q + ow];
              for (int64_t c = 0; c < C; ++c)
                for (int64_t r = 0; r < R; ++r) {
                  const int64_t ih = oh * p.stride - p.pad + r;
                  if (ih < 0 || ih >= H) continue;
                  for (int64_t s = 0; s < S; ++s) {
                    const int64_t iw = ow * p.stride - p.pad + s;
                    if (iw < 0 || iw >= W) continue;
                    acc[static_cast<size_t>(((n * C + c) * H + ih) * W + iw)] += g * double(wp[((k * C + c) * R + r) * S + s]);
                  }
                }
            }
      T* dxp = dx.data<T>();
      for (size_t i = 0; i < acc.size(); ++i) dxp[i] = static_cast<T>(acc[i]);
      return ok_status();
    });
  }

  Status conv2d_backward_weights(const Tensor& x, const Tensor& dy, Conv2dParams p, Tensor& dw, Tensor& db) override {
    const char* op = "conv2d_backward_weights";
    SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
    SLIDE_RETURN_IF_ERROR(want_rank(op, "dw", dw, 4));
    const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
    const int64_t K = dw.dim(0), R = dw.dim(2), S = dw.dim(3);
    const int64_t P = conv_out_extent(H, R, p.stride, p.pad), Q = conv_out_extent(W, S, p.stride, p.pad);
    SLIDE_RETURN_IF_ERROR(want_shape(op, "dw", dw, {K, C, R, S}));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", dy, {N, K, P, Q}));
    if (db.defined()) SLIDE_RETURN_IF_ERROR(want_shape(op, "db", db, {K}));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, x.dtype(), {&x, &dy, &dw, &db}));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.data<T>(), *dyp = dy.data<T>();
      T* dwp = dw.data<T>();
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < C; ++c)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t s = 0; s < S; ++s) {
              double acc = 0;
              for (int64_t n = 0; n < N; ++n)
                for (int64_t oh = 0; oh < P; ++oh) {
                  const int64_t ih = oh * p.stride - p.pad + r;
                  if (ih < 0 || ih >= H) continue;
                  for (int64_t ow = 0; ow < Q; ++ow) {
                    const int64_t iw = ow * p.stride - p.pad + s;
                    if (iw < 0 || iw >= W) continue;
                    acc += double(xp[((n * C + c) * H + ih) * W + iw]) * double(dyp[((n * K + k) * P + oh) * Q + ow]);
                  }
                }
              dwp[((k * C + c) * R + r) * S + s] += static_cast<T>(acc);
            }
      if (db.defined()) {
        T* dbp = db.data<T>();
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
    const char* op = "batch_norm_forward_training";
    SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
    const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3), M = N * HW;
    for (auto [name, t] : Named{{"gamma", &gamma}, {"beta", &beta},
                           {"running_mean", &running_mean}, {"running_var", &running_var}, {"save_mean", &save_mean},
                           {"save_invstd", &save_invstd}})
      SLIDE_RETURN_IF_ERROR(want_shape(op, name, *t, {C}));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, x.shape()));
    if (M < 2) return invalid_argument(std::string(op) + ": needs more than one value per channel, got x " + shape_string(x.shape()));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, x.dtype(), {&x, &gamma, &beta, &running_mean, &running_var, &y, &save_mean, &save_invstd}));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.data<T>(), *gp = gamma.data<T>(), *bp = beta.data<T>();
      T *yp = y.data<T>(), *rm = running_mean.data<T>(), *rv = running_var.data<T>();
      T *sm = save_mean.data<T>(), *si = save_invstd.data<T>();
      for (int64_t c = 0; c < C; ++c) {
        double sum = 0;
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < HW; ++i) sum += xp[(n * C + c) * HW + i];
        const double mean = sum / double(M);
        double sq = 0;
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < HW; ++i) {
            const double d = xp[(n * C + c) * HW + i] - mean;
            sq += d * d;
          }
        const double var = sq / double(M);
        const double invstd = 1.0 / std::sqrt(var + eps);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < HW; ++i) {
            const int64_t j = (n * C + c) * HW + i;
            yp[j] = static_cast<T>(double(gp[c]) * (double(xp[j]) - mean) * invstd + double(bp[c]));
          }
        sm[c] = static_cast<T>(mean);
        si[c] = static_cast<T>(invstd);
        rm[c] = static_cast<T>((1 - momentum) * double(rm[c]) + momentum * mean);
        rv[c] = static_cast<T>((1 - momentum) * double(rv[c]) + momentum * sq / double(M - 1));
      }
      return ok_status();
    });
  }

  Status batch_norm_forward_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      const Tensor& running_mean, const Tensor& running_var, double eps,
                                      Tensor& y) override {
    const char* op = "batch_norm_forward_inference";
    SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
    const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
    for (auto [name, t] : Named{{"gamma", &gamma}, {"beta", &beta},
                           {"running_mean", &running_mean}, {"running_var", &running_var}})
      SLIDE_RETURN_IF_ERROR(want_shape(op, name, *t, {C}));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, x.shape()));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, x.dtype(), {&x, &gamma, &beta, &running_mean, &running_var, &y}));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.data<T>(), *gp = gamma.data<T>(), *bp = beta.data<T>();
      const T *rm = running_mean.data<T>(), *rv = running_var.data<T>();
      T* yp = y.data<T>();
      for (int64_t c = 0; c < C; ++c) {
        const double invstd = 1.0 / std::sqrt(double(rv[c]) + eps);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < HW; ++i) {
            const int64_t j = (n * C + c) * HW + i;
            yp[j] = static_cast<T>(double(gp[c]) * (double(xp[j]) - double(rm[c])) * invstd + double(bp[c]));
          }
      }
      return ok_status();
    });
  }

  Status batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                             const Tensor& save_invstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) override {
    const char* op = "batch_norm_backward";
    SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
    const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3), M = N * HW;
    for (auto [name, t] : Named{{"gamma", &gamma}, {"save_mean", &save_mean},
                           {"save_invstd", &save_invstd}, {"dgamma", &dgamma}, {"dbeta", &dbeta}})
      SLIDE_RETURN_IF_ERROR(want_shape(op, name, *t, {C}));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", dy, x.shape()));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "dx", dx, x.shape()));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, x.dtype(), {&x, &dy, &gamma, &save_mean, &save_invstd, &dx, &dgamma, &dbeta}));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.data<T>(), *dyp = dy.data<T>(), *gp = gamma.data<T>();
      const T *sm = save_mean.data<T>(), *si = save_invstd.data<T>();
      T *dxp = dx.data<T>(), *dgp = dgamma.data<T>(), *dbp = dbeta.data<T>();
      for (int64_t c = 0; c < C; ++c) {
        // dx = gamma * invstd / M * (M dy - sum dy - xhat sum(dy xhat))
        double sum_dy = 0, sum_dy_xhat = 0;
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < HW; ++i) {
            const int64_t j = (n * C + c) * HW + i;
            const double xhat = (double(xp[j]) - double(sm[c])) * double(si[c]);
            sum_dy += dyp[j];
            sum_dy_xhat += double(dyp[j]) * xhat;
          }
        const double k = double(gp[c]) * double(si[c]) / double(M);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < HW; ++i) {
            const int64_t j = (n * C + c) * HW + i;
            const double xhat = (double(xp[j]) - double(sm[c])) * double(si[c]);
            dxp[j] = static_cast<T>(k * (double(M) * double(dyp[j]) - sum_dy - xhat * sum_dy_xhat));
          }
        dgp[c] += static_cast<T>(sum_dy_xhat);
        dbp[c] += static_cast<T>(sum_dy);
      }
      return ok_status();
    });
  }

  Status relu_forward(const Tensor& x, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(want_shape("relu_forward", "y", y, x.shape()));
    SLIDE_RETURN_IF_ERROR(want_dtype("relu_forward", x.dtype(), {&x, &y}));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.data<T>();
      T* yp = y.data<T>();
      for (int64_t i = 0; i < x.numel(); ++i) yp[i] = xp[i] > T(0) ? xp[i] : T(0);
      return ok_status();
    });
  }

  Status relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    SLIDE_RETURN_IF_ERROR(want_shape("relu_backward", "dy", dy, y.shape()));
    SLIDE_RETURN_IF_ERROR(want_shape("relu_backward", "dx", dx, y.shape()));
    SLIDE_RETURN_IF_ERROR(want_dtype("relu_backward", y.dtype(), {&y, &dy, &dx}));
    return dispatch(y.dtype(), [&]<typename T>() {
      const T *yp = y.data<T>(), *dyp = dy.data<T>();
      T* dxp = dx.data<T>();
      for (int64_t i = 0; i < y.numel(); ++i) dxp[i] = yp[i] > T(0) ? dyp[i] : T(0);
      return ok_status();
    });
  }

  Status add(const Tensor& a, const Tensor& b, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(want_shape("add", "b", b, a.shape()));
    SLIDE_RETURN_IF_ERROR(want_shape("add", "y", y, a.shape()));
    SLIDE_RETURN_IF_ERROR(want_dtype("add", a.dtype(), {&a, &b, &y}));
    return dispatch(a.dtype(), [&]<typename T>() {
      const T *ap = a.data<T>(), *bp = b.data<T>();
      T* yp = y.data<T>();
      for (int64_t i = 0; i < a.numel(); ++i) yp[i] = ap[i] + bp[i];
      return ok_status();
    });
  }

  Status max_pool2d_forward(const Tensor& x, Pool2dParams p, Tensor& y) override {
    return max_pool(x, nullptr, p, &y, nullptr);
  }
  Status max_pool2d_backward(const Tensor& x, const Tensor& dy, Pool2dParams p, Tensor& dx) override {
    return max_pool(x, &dy, p, nullptr, &dx);
  }

  Status global_avg_pool_forward(const Tensor& x, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(want_rank("global_avg_pool_forward", "x", x, 4));
    const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
    SLIDE_RETURN_IF_ERROR(want_shape("global_avg_pool_forward", "y", y, {N, C}));
    SLIDE_RETURN_IF_ERROR(want_dtype("global_avg_pool_forward", x.dtype(), {&x, &y}));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.data<T>();
      T* yp = y.data<T>();
      for (int64_t j = 0; j < N * C; ++j) {
        double s = 0;
        for (int64_t i = 0; i < HW; ++i) s += xp[j * HW + i];
        yp[j] = static_cast<T>(s / double(HW));
      }
      return ok_status();
    });
  }

  Status global_avg_pool_backward(const Tensor& dy, Tensor& dx) override {
    SLIDE_RETURN_IF_ERROR(want_rank("global_avg_pool_backward", "dx", dx, 4));
    const int64_t N = dx.dim(0), C = dx.dim(1), HW = dx.dim(2) * dx.dim(3);
    SLIDE_RETURN_IF_ERROR(want_shape("global_avg_pool_backward", "dy", dy, {N, C}));
    SLIDE_RETURN_IF_ERROR(want_dtype("global_avg_pool_backward", dy.dtype(), {&dy, &dx}));
    return dispatch(dy.dtype(), [&]<typename T>() {
      const T* dyp = dy.data<T>();
      T* dxp = dx.data<T>();
      for (int64_t j = 0; j < N * C; ++j)
        for (int64_t i = 0; i < HW; ++i) dxp[j * HW + i] = static_cast<T>(double(dyp[j]) / double(HW));
      return ok_status();
    });
  }

  Status linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) override {
    const char* op = "linear_forward";
    SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 2));
    SLIDE_RETURN_IF_ERROR(want_rank(op, "w", w, 2));
    const int64_t N = x.dim(0), I = x.dim(1), O = w.dim(0);
    SLIDE_RETURN_IF_ERROR(want_shape(op, "w", w, {O, I}));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, {N, O}));
    if (b.defined()) SLIDE_RETURN_IF_ERROR(want_shape(op, "b", b, {O}));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, x.dtype(), {&x, &w, &b, &y}));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.data<T>(), *wp = w.data<T>(), *bp = b.defined() ? b.data<T>() : nullptr;
      T* yp = y.data<T>();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t o = 0; o < O; ++o) {
          double acc = bp ? double(bp[o]) : 0.0;
          for (int64_t i = 0; i < I; ++i) acc += double(xp[n * I + i]) * double(wp[o * I + i]);
          yp[n * O + o] = static_cast<T>(acc);
        }
      return ok_status();
    });
  }

  Status linear_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx) override {
    const char* op = "linear_backward_data";
    SLIDE_RETURN_IF_ERROR(want_rank(op, "dx", dx, 2));
    SLIDE_RETURN_IF_ERROR(want_rank(op, "w", w, 2));
    const int64_t N = dx.dim(0), I = dx.dim(1), O = w.dim(0);
    SLIDE_RETURN_IF_ERROR(want_shape(op, "w", w, {O, I}));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", dy, {N, O}));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, dy.dtype(), {&dy, &w, &dx}));
    return dispatch(dy.dtype(), [&]<typename T>() {
      const T *dyp = dy.data<T>(), *wp = w.data<T>();
      T* dxp = dx.data<T>();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < I; ++i) {
          double acc = 0;
          for (int64_t o = 0; o < O; ++o) acc += double(dyp[n * O + o]) * double(wp[o * I + i]);
          dxp[n * I + i] = static_cast<T>(acc);
        }
      return ok_status();
    });
  }

  Status linear_backward_weights(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db) override {
    const char* op = "linear_backward_weights";
    SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 2));
    SLIDE_RETURN_IF_ERROR(want_rank(op, "dw", dw, 2));
    const int64_t N = x.dim(0), I = x.dim(1), O = dw.dim(0);
    SLIDE_RETURN_IF_ERROR(want_shape(op, "dw", dw, {O, I}));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", dy, {N, O}));
    if (db.defined()) SLIDE_RETURN_IF_ERROR(want_shape(op, "db", db, {O}));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, x.dtype(), {&x, &dy, &dw, &db}));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T *xp = x.data<T>(), *dyp = dy.data<T>();
      T* dwp = dw.data<T>();
      for (int64_t o = 0; o < O; ++o)
        for (int64_t i = 0; i < I; ++i) {
          double acc = 0;
          for (int64_t n = 0; n < N; ++n) acc += double(dyp[n * O + o]) * double(xp[n * I + i]);
          dwp[o * I + i] += static_cast<T>(acc);
        }
      if (db.defined()) {
        T* dbp = db.data<T>();
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
    const char* op = "softmax_cross_entropy_forward";
    SLIDE_RETURN_IF_ERROR(check_xent(op, logits, labels, class_weights, label_smoothing));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "probs", probs, logits.shape()));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, logits.dtype(), {&logits, &class_weights, &probs}));
    const int64_t N = logits.dim(0), C = logits.dim(1);
    return dispatch(logits.dtype(), [&]<typename T>() {
      const T *zp = logits.data<T>(), *wp = class_weights.defined() ? class_weights.data<T>() : nullptr;
      const int32_t* yp = labels.data<int32_t>();
      T* pp = probs.data<T>();
      double total = 0, weight_sum = 0;
      for (int64_t n = 0; n < N; ++n) {
        // log-sum-exp with the max subtracted (no overflow for large logits).
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t c = 0; c < C; ++c) m = std::max(m, double(zp[n * C + c]));
        double se = 0;
        for (int64_t c = 0; c < C; ++c) se += std::exp(double(zp[n * C + c]) - m);
        const double lse = m + std::log(se);
        double nll = 0;
        for (int64_t c = 0; c < C; ++c) {
          const double logp = double(zp[n * C + c]) - lse;
          pp[n * C + c] = static_cast<T>(std::exp(logp));
          const double target = (c == yp[n] ? 1.0 - label_smoothing : 0.0) + label_smoothing / double(C);
          nll -= target * logp;
        }
        const double wn = wp ? double(wp[yp[n]]) : 1.0;
        total += wn * nll;
        weight_sum += wn;
      }
      *loss = weight_sum > 0 ? total / weight_sum : 0.0;
      return ok_status();
    });
  }

  Status softmax_cross_entropy_backward(const Tensor& probs, const Tensor& labels, const Tensor& class_weights,
                                        double label_smoothing, Tensor& dlogits) override {
    const char* op = "softmax_cross_entropy_backward";
    SLIDE_RETURN_IF_ERROR(check_xent(op, probs, labels, class_weights, label_smoothing));
    SLIDE_RETURN_IF_ERROR(want_shape(op, "dlogits", dlogits, probs.shape()));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, probs.dtype(), {&probs, &class_weights, &dlogits}));
    const int64_t N = probs.dim(0), C = probs.dim(1);
    return dispatch(probs.dtype(), [&]<typename T>() {
      const T *pp = probs.data<T>(), *wp = class_weights.defined() ? class_weights.data<T>() : nullptr;
      const int32_t* yp = labels.data<int32_t>();
      T* dp = dlogits.data<T>();
      double weight_sum = 0;
      for (int64_t n = 0; n < N; ++n) weight_sum += wp ? double(wp[yp[n]]) : 1.0;
      for (int64_t n = 0; n < N; ++n) {
        const double scale = weight_sum > 0 ? (wp ? double(wp[yp[n]]) : 1.0) / weight_sum : 0.0;
        for (int64_t c = 0; c < C; ++c) {
          const double target = (c == yp[n] ? 1.0 - label_smoothing : 0.0) + label_smoothing / double(C);
          dp[n * C + c] = static_cast<T>(scale * (double(pp[n * C + c]) - target));
        }
      }
      return ok_status();
    });
  }

 private:
  // Forward (y != nullptr) or backward (dx != nullptr) of max pooling.
  Status max_pool(const Tensor& x, const Tensor* dy, Pool2dParams p, Tensor* y, Tensor* dx) {
    const char* op = y ? "max_pool2d_forward" : "max_pool2d_backward";
    SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
    if (p.kernel < 1 || p.stride < 1 || p.pad < 0 || 2 * p.pad > p.kernel)
      return invalid_argument(std::string(op) + ": kernel " + std::to_string(p.kernel) + ", stride " +
                              std::to_string(p.stride) + ", pad " + std::to_string(p.pad) +
                              " (pad must be at most half the kernel, as in PyTorch)");
    const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
    const int64_t P = conv_out_extent(H, p.kernel, p.stride, p.pad), Q = conv_out_extent(W, p.kernel, p.stride, p.pad);
    if (y) SLIDE_RETURN_IF_ERROR(want_shape(op, "y", *y, {N, C, P, Q}));
    if (dy) SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", *dy, {N, C, P, Q}));
    if (dx) SLIDE_RETURN_IF_ERROR(want_shape(op, "dx", *dx, x.shape()));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, x.dtype(), {&x, y ? y : &x, dy ? dy : &x, dx ? dx : &x}));
    return dispatch(x.dtype(), [&]<typename T>() {
      const T* xp = x.data<T>();
      if (dx) dx->fill_zero();
      for (int64_t nc = 0; nc < N * C; ++nc)
        for (int64_t oh = 0; oh < P; ++oh)
          for (int64_t ow = 0; ow < Q; ++ow) {
            int64_t best = -1;
            for (int64_t r = 0; r < p.kernel; ++r) {
              const int64_t ih = oh * p.stride - p.pad + r;
              if (ih < 0 || ih >= H) continue;
              for (int64_t s = 0; s < p.kernel; ++s) {
                const int64_t iw = ow * p.stride - p.pad + s;
                if (iw < 0 || iw >= W) continue;
                const int64_t j = (nc * H + ih) * W + iw;
                if (best < 0 || xp[j] > xp[best]) best = j;  // first maximum wins ties
              }
            }
            const int64_t o = (nc * P + oh) * Q + ow;
            if (y) y->data<T>()[o] = best >= 0 ? xp[best] : T(0);
            if (dx && best >= 0) dx->data<T>()[best] += dy->data<T>()[o];
          }
      return ok_status();
    });
  }

  Status check_xent(const char* op, const Tensor& logits, const Tensor& labels, const Tensor& class_weights,
                    double label_smoothing) {
    SLIDE_RETURN_IF_ERROR(want_rank(op, "logits", logits, 2));
    const int64_t N = logits.dim(0), C = logits.dim(1);
    SLIDE_RETURN_IF_ERROR(want_shape(op, "labels", labels, {N}));
    if (labels.dtype() != DType::kI32) return invalid_argument(std::string(op) + ": labels must be i32");
    if (class_weights.defined()) SLIDE_RETURN_IF_ERROR(want_shape(op, "class_weights", class_weights, {C}));
    if (!(label_smoothing >= 0 && label_smoothing < 1))
      return invalid_argument(std::string(op) + ": label smoothing " + std::to_string(label_smoothing) + " is outside [0, 1)");
    const int32_t* yp = labels.data<int32_t>();
    for (int64_t n = 0; n < N; ++n)
      if (yp[n] < 0 || yp[n] >= C)
        return invalid_argument(std::string(op) + ": label " + std::to_string(yp[n]) + " of sample " + std::to_string(n) +
                                " is outside [0, " + std::to_string(C) + ")");
    return ok_status();
  }

  Allocator& alloc_;
};

}  // namespace

std::unique_ptr<Backend> make_reference_backend(Allocator& alloc) { return std::make_unique<ReferenceBackend>(alloc); }

}  // namespace slide::train
