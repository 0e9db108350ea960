// Plain loops with double accumulators over NCHW host tensors; the all-reduces carry per-channel
// sums (a few KB per layer), so their latency, not their size, is the cost.
#include "dist/sync_batch_norm.h"

#include <cmath>
#include <vector>

namespace slide::train::dist {

namespace {

Status check(const Tensor& x, const char* op) {
  if (x.device() != Device::kCpu || (x.dtype() != DType::kF32 && x.dtype() != DType::kF64) || x.rank() != 4)
    return slide::core::invalid_argument(std::string(op) + ": --sync-bn takes host f32/f64 NCHW tensors, got " +
                                         dtype_name(x.dtype()) + " " + shape_string(x.shape()));
  return slide::core::ok_status();
}

template <typename T>
Status forward(Communicator& comm, const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
               double momentum, Tensor& running_mean, Tensor& running_var, Tensor& y, Tensor& save_mean,
               Tensor& save_invstd, double* global_count) {
  const int64_t n = x.dim(0), c = x.dim(1), hw = x.dim(2) * x.dim(3);
  const T* px = x.data<T>();
  std::vector<double> sums(static_cast<size_t>(c) + 1, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < c; ++k) {
      const T* p = px + (i * c + k) * hw;
      double s = 0;
      for (int64_t j = 0; j < hw; ++j) s += p[j];
      sums[static_cast<size_t>(k)] += s;
    }
  sums[static_cast<size_t>(c)] = static_cast<double>(n * hw);
  SLIDE_RETURN_IF_ERROR(comm.all_reduce(sums.data(), c + 1, DType::kF64, ReduceOp::kSum, "sync batch norm sums"));
  const double m = sums[static_cast<size_t>(c)];
  std::vector<double> mean(static_cast<size_t>(c)), dev(static_cast<size_t>(c), 0.0);
  for (int64_t k = 0; k < c; ++k) mean[static_cast<size_t>(k)] = sums[static_cast<size_t>(k)] / m;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < c; ++k) {
      const T* p = px + (i * c + k) * hw;
      const double mu = mean[static_cast<size_t>(k)];
      double s = 0;
      for (int64_t j = 0; j < hw; ++j) s += (p[j] - mu) * (p[j] - mu);
      dev[static_cast<size_t>(k)] += s;
    }
  SLIDE_RETURN_IF_ERROR(comm.all_reduce(dev.data(), c, DType::kF64, ReduceOp::kSum, "sync batch norm variances"));
  T* py = y.data<T>();
  for (int64_t k = 0; k < c; ++k) {
    const auto kk = static_cast<size_t>(k);
    const double var = dev[kk] / m, invstd = 1.0 / std::sqrt(var + eps);
    save_mean.data<T>()[k] = static_cast<T>(mean[kk]);
    save_invstd.data<T>()[k] = static_cast<T>(invstd);
    running_mean.data<T>()[k] = static_cast<T>((1 - momentum) * running_mean.data<T>()[k] + momentum * mean[kk]);
    const double unbiased = m > 1 ? dev[kk] / (m - 1) : var;
    running_var.data<T>()[k] = static_cast<T>((1 - momentum) * running_var.data<T>()[k] + momentum * unbiased);
    const double g = gamma.data<T>()[k], b = beta.data<T>()[k];
    for (int64_t i = 0; i < n; ++i) {
      const T* p = px + (i * c + k) * hw;
      T* q = py + (i * c + k) * hw;
      for (int64_t j = 0; j < hw; ++j) q[j] = static_cast<T>(g * (p[j] - mean[kk]) * invstd + b);
    }
  }
  *global_count = m;
  return slide::core::ok_status();
}

template <typename T>
Status backward(Communicator& comm, const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                const Tensor& save_invstd, double m, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  const int64_t n = x.dim(0), c = x.dim(1), hw = x.dim(2) * x.dim(3);
  const T *px = x.data<T>(), *pdy = dy.data<T>();
  // sums[k] = sum dy, sums[c + k] = sum dy * xhat, over this rank's values of channel k.
  std::vector<double> sums(2 * static_cast<size_t>(c), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < c; ++k) {
      const double mu = save_mean.data<T>()[k], is = save_invstd.data<T>()[k];
      const T *p = px + (i * c + k) * hw, *d = pdy + (i * c + k) * hw;
      double s1 = 0, s2 = 0;
      for (int64_t j = 0; j < hw; ++j) s1 += d[j], s2 += d[j] * (p[j] - mu) * is;
      sums[static_cast<size_t>(k)] += s1;
      sums[static_cast<size_t>(c + k)] += s2;
    }
  for (int64_t k = 0; k < c; ++k) {
    dbeta.data<T>()[k] += static_cast<T>(sums[static_cast<size_t>(k)]);
    dgamma.data<T>()[k] += static_cast<T>(sums[static_cast<size_t>(c + k)]);
  }
  SLIDE_RETURN_IF_ERROR(comm.all_reduce(sums.data(), 2 * c, DType::kF64, ReduceOp::kSum, "sync batch norm gradient sums"));
  T* pdx = dx.data<T>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < c; ++k) {
      const double mu = save_mean.data<T>()[k], is = save_invstd.data<T>()[k], g = gamma.data<T>()[k];
      const double mean_dy = sums[static_cast<size_t>(k)] / m, mean_dy_xhat = sums[static_cast<size_t>(c + k)] / m;
      const T *p = px + (i * c + k) * hw, *d = pdy + (i * c + k) * hw;
      T* q = pdx + (i * c + k) * hw;
      for (int64_t j = 0; j < hw; ++j)
        q[j] = static_cast<T>(g * is * (d[j] - mean_dy - (p[j] - mu) * is * mean_dy_xhat));
    }
  return slide::core::ok_status();
}

}  // namespace

Status sync_batch_norm_forward(Communicator& comm, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                               double eps, double momentum, Tensor& running_mean, Tensor& running_var, Tensor& y,
                               Tensor& save_mean, Tensor& save_invstd, double* global_count) {
  SLIDE_RETURN_IF_ERROR(check(x, "sync batch norm forward"));
  if (x.dtype() == DType::kF32)
    return forward<float>(comm, x, gamma, beta, eps, momentum, running_mean, running_var, y, save_mean, save_invstd,
                          global_count);
  return forward<double>(comm, x, gamma, beta, eps, momentum, running_mean, running_var, y, save_mean, save_invstd,
                         global_count);
}

Status sync_batch_norm_backward(Communicator& comm, const Tensor& x, const Tensor& dy, const Tensor& gamma,
                                const Tensor& save_mean, const Tensor& save_invstd, double global_count, Tensor& dx,
                                Tensor& dgamma, Tensor& dbeta) {
  SLIDE_RETURN_IF_ERROR(check(x, "sync batch norm backward"));
  if (x.dtype() == DType::kF32)
    return backward<float>(comm, x, dy, gamma, save_mean, save_invstd, global_count, dx, dgamma, dbeta);
  return backward<double>(comm, x, dy, gamma, save_mean, save_invstd, global_count, dx, dgamma, dbeta);
}

}  // namespace slide::train::dist
