#include <cmath>
#include "op_checks.h"

#include <string>

namespace slide::train {

// backend.h's output extent, defined beside the shape checks that use it (and that every backend,
// and the fuzz targets' small libtrain, links).
int64_t conv_out_extent(int64_t in, int64_t kernel, int stride, int pad) {
  if (stride < 1) return 0;
  const int64_t span = in + 2 * int64_t{pad} - kernel;
  return span < 0 ? 0 : span / stride + 1;
}

}  // namespace slide::train

namespace slide::train::detail {

namespace {

using slide::core::invalid_argument;
using slide::core::ok_status;
using Named = std::initializer_list<std::pair<const char*, const Tensor*>>;

Status want_shape(const char* op, const char* name, const Tensor& t, const Shape& shape) {
  if (!t.defined() || t.shape() != shape)
    return invalid_argument(std::string(op) + ": " + name + " is " +
                            (t.defined() ? shape_string(t.shape()) : "undefined") + ", expected " + shape_string(shape));
  return ok_status();
}

Status want_rank(const char* op, const char* name, const Tensor& t, size_t rank) {
  if (!t.defined() || t.rank() != rank)
    return invalid_argument(std::string(op) + ": " + name + " must have rank " + std::to_string(rank) + ", is " +
                            (t.defined() ? shape_string(t.shape()) : "undefined"));
  return ok_status();
}

// Every defined tensor has the first one's dtype, which the backend implements, on its device.
template <typename Range>
Status want_dtype_of(const char* op, const Range& ts, DTypes dtypes) {
  const DType dt = ts.begin()->second->dtype();
  for (auto [name, t] : ts) {
    if (!t->defined()) continue;
    if (t->dtype() != dt)
      return invalid_argument(std::string(op) + ": " + name + " is " + dtype_name(t->dtype()) + ", expected " +
                              dtype_name(dt));
    if (t->device() != dtypes.device && !dtypes.any_device)
      return invalid_argument(std::string(op) + ": " + name + " is on " + device_name(t->device()) + ", this backend's " +
                              "tensors are on " + device_name(dtypes.device));
    if (t->layout() != Layout::kPlain && !dtypes.blocked)
      return invalid_argument(std::string(op) + ": " + name + " is in the " + layout_name(t->layout()) +
                              " layout, which this backend does not read (Backend::to_plain)");
  }
  if ((dt == DType::kF32 && dtypes.f32) || (dt == DType::kF64 && dtypes.f64) || (is_half(dt) && dtypes.half))
    return ok_status();
  return slide::core::unimplemented(std::string(op) + ": dtype " + dtype_name(dt) + " is not implemented here");
}

Status want_dtype(const char* op, Named ts, DTypes dtypes) { return want_dtype_of(op, ts, dtypes); }

// Half-precision training storage (backend.h): with dtypes.half and the first of `acts` f16 or
// bf16, `acts` (the activations and their gradients) of that one type and `f32s` (parameters,
// per-channel statistics, parameter gradients; the first defined) f32; otherwise every tensor of
// one dtype, as everywhere.
template <typename Acts, typename F32s>
Status want_dtype_split_of(const char* op, const Acts& acts, const F32s& f32s, DTypes dtypes) {
  const Tensor* first = acts.begin()->second;
  if (!dtypes.half || !first->defined() || !is_half(first->dtype())) {
    std::vector<std::pair<const char*, const Tensor*>> all(acts.begin(), acts.end());
    all.insert(all.end(), f32s.begin(), f32s.end());
    return want_dtype_of(op, all, dtypes);
  }
  SLIDE_RETURN_IF_ERROR(want_dtype_of(op, acts, dtypes));
  for (auto [name, t] : f32s) {
    if (!t->defined()) continue;
    if (t->dtype() != DType::kF32)
      return invalid_argument(std::string(op) + ": " + name + " is " + dtype_name(t->dtype()) + ", expected f32 (with " +
                              dtype_name(first->dtype()) + " activations, parameters, statistics and parameter " +
                              "gradients stay f32)");
    SLIDE_RETURN_IF_ERROR(want_dtype(op, {{name, t}}, dtypes));
  }
  return ok_status();
}
Status want_dtype_split(const char* op, Named acts, Named f32s, DTypes dtypes) {
  return want_dtype_split_of(op, acts, f32s, dtypes);
}

Status want_channels(const char* op, Named ts, int64_t c) {
  for (auto [name, t] : ts) SLIDE_RETURN_IF_ERROR(want_shape(op, name, *t, {c}));
  return ok_status();
}

// An f64 sum tensor of a synchronised batch norm piece: `per_c` * C + `extra` elements.
struct BnSum {
  const char* name;
  const Tensor* t;
  int64_t per_c, extra;
};

// The synchronised batch norm pieces' checks (op_checks.h).
Result<BnDims> batch_norm_sync_dims(const char* op, const Tensor& x, Named like_x, Named per_channel,
                                    std::initializer_list<BnSum> sums, DTypes dtypes) {
  SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
  const BnDims d{x.dim(0), x.dim(1), x.dim(2) * x.dim(3)};
  for (auto [name, t] : like_x) SLIDE_RETURN_IF_ERROR(want_shape(op, name, *t, x.shape()));
  SLIDE_RETURN_IF_ERROR(want_channels(op, per_channel, d.C));
  std::vector<std::pair<const char*, const Tensor*>> acts{{"x", &x}};
  acts.insert(acts.end(), like_x.begin(), like_x.end());
  SLIDE_RETURN_IF_ERROR(want_dtype_split_of(op, acts, per_channel, dtypes));
  DTypes f64 = dtypes;
  f64.f64 = true;
  f64.blocked = false;
  for (const BnSum& s : sums) {
    SLIDE_RETURN_IF_ERROR(want_shape(op, s.name, *s.t, {s.per_c * d.C + s.extra}));
    if (s.t->dtype() != DType::kF64)
      return invalid_argument(std::string(op) + ": " + s.name + " is " + dtype_name(s.t->dtype()) + ", expected f64");
    SLIDE_RETURN_IF_ERROR(want_dtype(op, {{s.name, s.t}}, f64));
  }
  return d;
}

// x or dx [N,C,H,W] with w [K,C,R,S]: the convolution's extents.
Result<ConvDims> conv_dims(const char* op, const char* xname, const Tensor& x, const Tensor& w, Conv2dParams p) {
  SLIDE_RETURN_IF_ERROR(want_rank(op, xname, x, 4));
  SLIDE_RETURN_IF_ERROR(want_rank(op, "w", w, 4));
  if (p.stride < 1 || p.pad < 0)
    return invalid_argument(std::string(op) + ": stride " + std::to_string(p.stride) + ", pad " + std::to_string(p.pad));
  ConvDims d{x.dim(0), x.dim(1), x.dim(2), x.dim(3), w.dim(0), w.dim(2), w.dim(3), 0, 0};
  if (w.dim(1) != d.C)
    return invalid_argument(std::string(op) + ": w " + shape_string(w.shape()) + " does not match " + xname + " " +
                            shape_string(x.shape()));
  d.P = conv_out_extent(d.H, d.R, p.stride, p.pad);
  d.Q = conv_out_extent(d.W, d.S, p.stride, p.pad);
  if (d.P < 1 || d.Q < 1)
    return invalid_argument(std::string(op) + ": kernel " + shape_string(w.shape()) + " is larger than the padded " +
                            xname + " " + shape_string(x.shape()));
  return d;
}

}  // namespace

Result<ConvDims> validate_conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Conv2dParams p,
                                         const Tensor& y, DTypes dtypes) {
  const char* op = "conv2d_forward";
  SLIDE_ASSIGN_OR_RETURN(ConvDims d, conv_dims(op, "x", x, w, p));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, {d.N, d.K, d.P, d.Q}));
  if (b.defined()) SLIDE_RETURN_IF_ERROR(want_shape(op, "b", b, {d.K}));
  SLIDE_RETURN_IF_ERROR(want_dtype(op, {{"x", &x}, {"w", &w}, {"b", &b}, {"y", &y}}, dtypes));
  return d;
}

Result<ConvDims> validate_fused_conv2d_inference(const Backend* self, const Tensor& x, const FusedConvWeights& w,
                                                 Conv2dParams p, const Tensor* residual, const Tensor& y,
                                                 DTypes dtypes) {
  const char* op = "fused_conv2d_inference";
  if (w.owner() != self) return invalid_argument(std::string(op) + ": the weights were prepared by another backend");
  SLIDE_ASSIGN_OR_RETURN(ConvDims d, conv_dims(op, "x", x, w.weight(), p));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, {d.N, d.K, d.P, d.Q}));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "b", w.bias(), {d.K}));
  if (residual != nullptr) SLIDE_RETURN_IF_ERROR(want_shape(op, "residual", *residual, {d.N, d.K, d.P, d.Q}));
  const Tensor none;
  if (dtypes.half && is_half(y.dtype())) {
    // Half-precision storage: x, residual and y of one half type; the prepared weights f32.
    SLIDE_RETURN_IF_ERROR(
        want_dtype(op, {{"y", &y}, {"x", &x}, {"residual", residual ? residual : &none}}, dtypes));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, {{"w", &w.weight()}, {"b", &w.bias()}}, dtypes));
    if (w.weight().dtype() != DType::kF32)
      return invalid_argument(std::string(op) + ": the prepared weights are " + dtype_name(w.weight().dtype()) +
                              ", expected f32 (the backend converts them for half-precision activations)");
  } else {
    SLIDE_RETURN_IF_ERROR(want_dtype(
        op, {{"x", &x}, {"w", &w.weight()}, {"b", &w.bias()}, {"residual", residual ? residual : &none}, {"y", &y}},
        dtypes));
  }
  if (x.defined() && y.defined() && x.raw() == y.raw() && x.bytes() > 0)
    return invalid_argument(std::string(op) + ": y must not share x's storage");
  return d;
}

Result<ConvDims> validate_conv2d_backward_data(const Tensor& dy, const Tensor& w, Conv2dParams p, const Tensor& dx,
                                               DTypes dtypes) {
  const char* op = "conv2d_backward_data";
  SLIDE_ASSIGN_OR_RETURN(ConvDims d, conv_dims(op, "dx", dx, w, p));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", dy, {d.N, d.K, d.P, d.Q}));
  SLIDE_RETURN_IF_ERROR(want_dtype(op, {{"dy", &dy}, {"w", &w}, {"dx", &dx}}, dtypes));
  return d;
}

Result<ConvDims> validate_conv2d_backward_weights(const Tensor& x, const Tensor& dy, Conv2dParams p, const Tensor& dw,
                                                  const Tensor& db, DTypes dtypes) {
  const char* op = "conv2d_backward_weights";
  SLIDE_ASSIGN_OR_RETURN(ConvDims d, conv_dims(op, "x", x, dw, p));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", dy, {d.N, d.K, d.P, d.Q}));
  if (db.defined()) SLIDE_RETURN_IF_ERROR(want_shape(op, "db", db, {d.K}));
  SLIDE_RETURN_IF_ERROR(want_dtype_split(op, {{"x", &x}, {"dy", &dy}}, {{"dw", &dw}, {"db", &db}}, dtypes));
  return d;
}

Result<BnDims> validate_batch_norm_training(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                            const Tensor& running_mean, const Tensor& running_var, const Tensor& y,
                                            const Tensor& save_mean, const Tensor& save_invstd, DTypes dtypes) {
  const char* op = "batch_norm_forward_training";
  SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
  const BnDims d{x.dim(0), x.dim(1), x.dim(2) * x.dim(3)};
  SLIDE_RETURN_IF_ERROR(want_channels(op,
                                      {{"gamma", &gamma}, {"beta", &beta}, {"running_mean", &running_mean},
                                       {"running_var", &running_var}, {"save_mean", &save_mean},
                                       {"save_invstd", &save_invstd}},
                                      d.C));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, x.shape()));
  if (d.N * d.HW < 2)
    return invalid_argument(std::string(op) + ": needs more than one value per channel, got x " + shape_string(x.shape()));
  SLIDE_RETURN_IF_ERROR(want_dtype_split(op, {{"x", &x}, {"y", &y}},
                                         {{"gamma", &gamma}, {"beta", &beta}, {"running_mean", &running_mean},
                                          {"running_var", &running_var}, {"save_mean", &save_mean},
                                          {"save_invstd", &save_invstd}},
                                         dtypes));
  return d;
}

Result<BnDims> validate_batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                             const Tensor& running_mean, const Tensor& running_var, const Tensor& y,
                                             DTypes dtypes) {
  const char* op = "batch_norm_forward_inference";
  SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
  const BnDims d{x.dim(0), x.dim(1), x.dim(2) * x.dim(3)};
  SLIDE_RETURN_IF_ERROR(want_channels(
      op, {{"gamma", &gamma}, {"beta", &beta}, {"running_mean", &running_mean}, {"running_var", &running_var}}, d.C));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, x.shape()));
  SLIDE_RETURN_IF_ERROR(want_dtype_split(
      op, {{"x", &x}, {"y", &y}},
      {{"gamma", &gamma}, {"beta", &beta}, {"running_mean", &running_mean}, {"running_var", &running_var}}, dtypes));
  return d;
}

Result<BnDims> validate_batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma,
                                            const Tensor& save_mean, const Tensor& save_invstd, const Tensor& dx,
                                            const Tensor& dgamma, const Tensor& dbeta, DTypes dtypes) {
  const char* op = "batch_norm_backward";
  SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
  const BnDims d{x.dim(0), x.dim(1), x.dim(2) * x.dim(3)};
  SLIDE_RETURN_IF_ERROR(want_channels(op,
                                      {{"gamma", &gamma}, {"save_mean", &save_mean}, {"save_invstd", &save_invstd},
                                       {"dgamma", &dgamma}, {"dbeta", &dbeta}},
                                      d.C));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", dy, x.shape()));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "dx", dx, x.shape()));
  SLIDE_RETURN_IF_ERROR(want_dtype_split(op, {{"x", &x}, {"dy", &dy}, {"dx", &dx}},
                                         {{"gamma", &gamma}, {"save_mean", &save_mean}, {"save_invstd", &save_invstd},
                                          {"dgamma", &dgamma}, {"dbeta", &dbeta}},
                                         dtypes));
  return d;
}

Result<BnDims> validate_batch_norm_stats(const Tensor& x, const Tensor& stats, DTypes dtypes) {
  return batch_norm_sync_dims("batch_norm_stats", x, {}, {}, {{"stats", &stats, 1, 1}}, dtypes);
}

Result<BnDims> validate_batch_norm_deviations(const Tensor& x, const Tensor& stats, const Tensor& devs,
                                              DTypes dtypes) {
  return batch_norm_sync_dims("batch_norm_deviations", x, {}, {}, {{"stats", &stats, 1, 1}, {"devs", &devs, 1, 0}},
                              dtypes);
}

Result<BnDims> validate_batch_norm_forward_from_stats(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                                      const Tensor& stats, const Tensor& devs,
                                                      const Tensor& running_mean, const Tensor& running_var,
                                                      const Tensor& y, const Tensor& save_mean,
                                                      const Tensor& save_invstd, DTypes dtypes) {
  return batch_norm_sync_dims("batch_norm_forward_from_stats", x, {{"y", &y}},
                              {{"gamma", &gamma}, {"beta", &beta}, {"running_mean", &running_mean},
                               {"running_var", &running_var}, {"save_mean", &save_mean}, {"save_invstd", &save_invstd}},
                              {{"stats", &stats, 1, 1}, {"devs", &devs, 1, 0}}, dtypes);
}

Result<BnDims> validate_batch_norm_backward_reduce(const Tensor& x, const Tensor& dy, const Tensor& save_mean,
                                                   const Tensor& save_invstd, const Tensor& sums, const Tensor& dgamma,
                                                   const Tensor& dbeta, DTypes dtypes) {
  return batch_norm_sync_dims(
      "batch_norm_backward_reduce", x, {{"dy", &dy}},
      {{"save_mean", &save_mean}, {"save_invstd", &save_invstd}, {"dgamma", &dgamma}, {"dbeta", &dbeta}},
      {{"sums", &sums, 2, 0}}, dtypes);
}

Result<BnDims> validate_batch_norm_backward_elemt(const Tensor& x, const Tensor& dy, const Tensor& gamma,
                                                  const Tensor& save_mean, const Tensor& save_invstd,
                                                  const Tensor& stats, const Tensor& sums, const Tensor& dx,
                                                  DTypes dtypes) {
  return batch_norm_sync_dims("batch_norm_backward_elemt", x, {{"dy", &dy}, {"dx", &dx}},
                              {{"gamma", &gamma}, {"save_mean", &save_mean}, {"save_invstd", &save_invstd}},
                              {{"stats", &stats, 1, 1}, {"sums", &sums, 2, 0}}, dtypes);
}

Status validate_same_shape(const char* op, const Tensor& x, const Tensor& y, const Tensor* z, DTypes dtypes) {
  if (!x.defined()) return invalid_argument(std::string(op) + ": first operand is undefined");
  SLIDE_RETURN_IF_ERROR(want_shape(op, "second operand", y, x.shape()));
  if (z != nullptr) SLIDE_RETURN_IF_ERROR(want_shape(op, "output", *z, x.shape()));
  return want_dtype(op, {{"first operand", &x}, {"second operand", &y}, {"output", z != nullptr ? z : &x}}, dtypes);
}

Status validate_add(const Tensor& a, const Tensor& b, const Tensor& y, DTypes dtypes) {
  const char* op = "add";
  if (!a.defined() || !b.defined() || a.dtype() == b.dtype() || !dtypes.half || !is_half(b.dtype()))
    return validate_same_shape(op, a, b, &y, dtypes);
  // A half-precision b added into f32 a and y.
  SLIDE_RETURN_IF_ERROR(validate_same_shape(op, a, a, &y, dtypes));
  if (a.dtype() != DType::kF32)
    return invalid_argument(std::string(op) + ": first operand is " + dtype_name(a.dtype()) + " and second " +
                            dtype_name(b.dtype()) + " (a half-precision second operand goes into f32 only)");
  SLIDE_RETURN_IF_ERROR(want_shape(op, "second operand", b, a.shape()));
  return want_dtype(op, {{"second operand", &b}}, dtypes);
}

Result<PoolDims> validate_max_pool(const char* op, const Tensor& x, Pool2dParams p, const Tensor* y, const Tensor* dy,
                                   const Tensor* dx, DTypes dtypes) {
  SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
  if (p.kernel < 1 || p.stride < 1 || p.pad < 0 || 2 * p.pad > p.kernel)
    return invalid_argument(std::string(op) + ": kernel " + std::to_string(p.kernel) + ", stride " +
                            std::to_string(p.stride) + ", pad " + std::to_string(p.pad) +
                            " (pad must be at most half the kernel, as in PyTorch)");
  PoolDims d{x.dim(0), x.dim(1), x.dim(2), x.dim(3), 0, 0};
  d.P = conv_out_extent(d.H, p.kernel, p.stride, p.pad);
  d.Q = conv_out_extent(d.W, p.kernel, p.stride, p.pad);
  if (d.P < 1 || d.Q < 1) return invalid_argument(std::string(op) + ": window larger than x " + shape_string(x.shape()));
  if (y != nullptr) SLIDE_RETURN_IF_ERROR(want_shape(op, "y", *y, {d.N, d.C, d.P, d.Q}));
  if (dy != nullptr) SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", *dy, {d.N, d.C, d.P, d.Q}));
  if (dx != nullptr) SLIDE_RETURN_IF_ERROR(want_shape(op, "dx", *dx, x.shape()));
  SLIDE_RETURN_IF_ERROR(want_dtype(
      op, {{"x", &x}, {"y", y ? y : &x}, {"dy", dy ? dy : &x}, {"dx", dx ? dx : &x}}, dtypes));
  return d;
}

Result<BnDims> validate_global_avg_pool(const char* op, const Tensor& x, const Tensor& pooled, DTypes dtypes) {
  SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 4));
  const BnDims d{x.dim(0), x.dim(1), x.dim(2) * x.dim(3)};
  if (d.HW < 1) return invalid_argument(std::string(op) + ": empty image " + shape_string(x.shape()));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "pooled", pooled, {d.N, d.C}));
  SLIDE_RETURN_IF_ERROR(want_dtype(op, {{"x", &x}, {"pooled", &pooled}}, dtypes));
  return d;
}

Result<LinearDims> validate_linear(const char* op, const Tensor& x, const Tensor& w, const Tensor* b, const Tensor& y,
                                   DTypes dtypes) {
  SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 2));
  SLIDE_RETURN_IF_ERROR(want_rank(op, "w", w, 2));
  const LinearDims d{x.dim(0), x.dim(1), w.dim(0)};
  SLIDE_RETURN_IF_ERROR(want_shape(op, "w", w, {d.O, d.I}));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, {d.N, d.O}));
  const bool has_b = b != nullptr && b->defined();
  if (has_b) SLIDE_RETURN_IF_ERROR(want_shape(op, "b", *b, {d.O}));
  SLIDE_RETURN_IF_ERROR(want_dtype(op, {{"x", &x}, {"w", &w}, {"b", has_b ? b : &x}, {"y", &y}}, dtypes));
  return d;
}

Result<LinearDims> validate_linear_backward_weights(const Tensor& x, const Tensor& dy, const Tensor& dw,
                                                    const Tensor& db, DTypes dtypes) {
  const char* op = "linear_backward_weights";
  SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 2));
  SLIDE_RETURN_IF_ERROR(want_rank(op, "dw", dw, 2));
  const LinearDims d{x.dim(0), x.dim(1), dw.dim(0)};
  SLIDE_RETURN_IF_ERROR(want_shape(op, "dw", dw, {d.O, d.I}));
  SLIDE_RETURN_IF_ERROR(want_shape(op, "dy", dy, {d.N, d.O}));
  if (db.defined()) SLIDE_RETURN_IF_ERROR(want_shape(op, "db", db, {d.O}));
  SLIDE_RETURN_IF_ERROR(want_dtype_split(op, {{"x", &x}, {"dy", &dy}}, {{"dw", &dw}, {"db", &db}}, dtypes));
  return d;
}

Result<LinearDims> validate_cross_entropy(const char* op, const Tensor& logits, const Tensor& labels,
                                          const Tensor& class_weights, double label_smoothing, const Tensor& out,
                                          DTypes dtypes) {
  SLIDE_RETURN_IF_ERROR(want_rank(op, "logits", logits, 2));
  const LinearDims d{logits.dim(0), logits.dim(1), logits.dim(1)};
  SLIDE_RETURN_IF_ERROR(want_shape(op, "labels", labels, {d.N}));
  if (labels.dtype() != DType::kI32) return invalid_argument(std::string(op) + ": labels must be i32");
  if (class_weights.defined()) SLIDE_RETURN_IF_ERROR(want_shape(op, "class_weights", class_weights, {d.I}));
  if (!(label_smoothing >= 0 && label_smoothing < 1))
    return invalid_argument(std::string(op) + ": label smoothing " + std::to_string(label_smoothing) +
                            " is outside [0, 1)");
  SLIDE_RETURN_IF_ERROR(want_shape(op, "output", out, logits.shape()));
  SLIDE_RETURN_IF_ERROR(
      want_dtype(op, {{"logits", &logits}, {"class_weights", &class_weights}, {"output", &out}}, dtypes));
  if (labels.device() != dtypes.device)
    return invalid_argument(std::string(op) + ": labels are on " + device_name(labels.device()) + ", expected " +
                            device_name(dtypes.device));
  // Labels in host memory (cpu, and the simulated device's) are range-checked here; a GPU backend
  // checks them in its kernel (one flag read back per call) and returns the same error.
  if (labels.device() == Device::kCuda) return d;
  const int32_t* yp = labels.ptr<int32_t>();
  for (int64_t n = 0; n < d.N; ++n)
    if (yp[n] < 0 || yp[n] >= d.I)
      return invalid_argument(std::string(op) + ": label " + std::to_string(yp[n]) + " of sample " + std::to_string(n) +
                              " is outside [0, " + std::to_string(d.I) + ")");
  return d;
}

// --- Attention MIL ops ---
Result<LinearDims> validate_rows(const char* op, const Tensor& x, const Tensor& y, const Tensor* z, DTypes dtypes) {
  SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 2));
  if (x.dim(1) < 1) return invalid_argument(std::string(op) + ": rows of x " + shape_string(x.shape()) + " are empty");
  SLIDE_RETURN_IF_ERROR(validate_same_shape(op, x, y, z, dtypes));
  return LinearDims{x.dim(0), x.dim(1), x.dim(1)};
}

Result<MatmulDims> validate_matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, const Tensor& y,
                                   DTypes dtypes) {
  const char* op = "matmul";
  SLIDE_RETURN_IF_ERROR(want_rank(op, "a", a, 2));
  SLIDE_RETURN_IF_ERROR(want_rank(op, "b", b, 2));
  const MatmulDims d{transpose_a ? a.dim(1) : a.dim(0), transpose_a ? a.dim(0) : a.dim(1),
                     transpose_b ? b.dim(0) : b.dim(1)};
  const int64_t kb = transpose_b ? b.dim(1) : b.dim(0);
  if (kb != d.K)
    return invalid_argument(std::string(op) + ": a " + shape_string(a.shape()) + (transpose_a ? " (transposed)" : "") +
                            " and b " + shape_string(b.shape()) + (transpose_b ? " (transposed)" : "") +
                            " do not chain");
  SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, {d.M, d.N}));
  if (y.raw() == a.raw() || y.raw() == b.raw())
    return invalid_argument(std::string(op) + ": y shares storage with an operand");
  SLIDE_RETURN_IF_ERROR(want_dtype(op, {{"a", &a}, {"b", &b}, {"y", &y}}, dtypes));
  return d;
}

Status validate_cast(const Tensor& x, const Tensor& y, DTypes dtypes) {
  if (!x.defined() || !y.defined() || x.shape() != y.shape())
    return invalid_argument("cast: x " + (x.defined() ? shape_string(x.shape()) : std::string("undefined")) +
                            " and y " + (y.defined() ? shape_string(y.shape()) : std::string("undefined")) + " differ");
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"x", &x}, {"y", &y}}) {
    if (t->device() != dtypes.device)
      return invalid_argument(std::string("cast: ") + name + " is on " + device_name(t->device()) +
                              ", this backend's tensors are on " + device_name(dtypes.device));
    if (t->layout() != Layout::kPlain)
      return invalid_argument(std::string("cast: ") + name + " is in the " + layout_name(t->layout()) + " layout");
    const DType d = t->dtype();
    if (!(d == DType::kF32 || d == DType::kF16 || d == DType::kBF16 || (d == DType::kF64 && dtypes.f64)))
      return slide::core::unimplemented(std::string("cast: ") + name + " is " + dtype_name(d) +
                                        "; casts are between f32, f16 and bf16" + (dtypes.f64 ? " (and f64)" : ""));
  }
  return ok_status();
}

Result<int64_t> validate_gather_augment(const Tensor& tiles, const Tensor& records, const Tensor& images,
                                        DTypes dtypes) {
  const auto shapes = [&] {
    return "gather_augment: tiles " + (tiles.defined() ? shape_string(tiles.shape()) : std::string("undefined")) +
           ", records " + (records.defined() ? shape_string(records.shape()) : std::string("undefined")) +
           ", images " + (images.defined() ? shape_string(images.shape()) : std::string("undefined"));
  };
  if (!tiles.defined() || !records.defined() || !images.defined() || tiles.rank() != 4 || tiles.dim(3) != 3 ||
      tiles.dim(1) != tiles.dim(2) || records.rank() != 2 ||
      records.dim(1) != static_cast<int64_t>(sizeof(AugmentRecord)) || images.rank() != 4 ||
      images.dim(0) != records.dim(0) || images.dim(1) != 3 || images.dim(2) != tiles.dim(1) ||
      images.dim(3) != tiles.dim(2))
    return invalid_argument(shapes() + ": expected [N,S,S,3], [B," + std::to_string(sizeof(AugmentRecord)) +
                            "] and [B,3,S,S]");
  if (tiles.dtype() != DType::kU8 || records.dtype() != DType::kU8 || images.dtype() != DType::kF32)
    return invalid_argument(shapes() + ": tiles and records are u8, images f32");
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"tiles", &tiles}, {"records", &records},
                         {"images", &images}}) {
    if (t->device() != dtypes.device)
      return invalid_argument(std::string("gather_augment: ") + name + " is on " + device_name(t->device()) +
                              ", this backend's tensors are on " + device_name(dtypes.device));
    if (t->layout() != Layout::kPlain)
      return invalid_argument(std::string("gather_augment: ") + name + " is in the " + layout_name(t->layout()) +
                              " layout");
  }
  return images.dim(0);
}

Status validate_augment_record(const AugmentRecord& r, int64_t n, int64_t size) {
  if (r.index < 0 || r.index >= n)
    return invalid_argument("gather_augment: tile index " + std::to_string(r.index) + " outside [0, " +
                            std::to_string(n) + ")");
  if (r.crop && (r.crop_w < 1 || r.crop_h < 1 || r.crop_x < 0 || r.crop_y < 0 || r.crop_x + r.crop_w > size ||
                 r.crop_y + r.crop_h > size))
    return invalid_argument("gather_augment: crop box (" + std::to_string(r.crop_x) + ", " + std::to_string(r.crop_y) +
                            ", " + std::to_string(r.crop_w) + " x " + std::to_string(r.crop_h) + ") outside a " +
                            std::to_string(size) + "-px tile");
  if (r.flip < 0 || r.flip > 1 || r.rot < 0 || r.rot > 3)
    return invalid_argument("gather_augment: flip " + std::to_string(r.flip) + ", rotation " + std::to_string(r.rot));
  if (r.stain != 0 && r.stain != 1) return invalid_argument("gather_augment: stain flag " + std::to_string(r.stain));
  for (int k = 0; k < 3; ++k)
    if (!std::isfinite(r.stain_alpha[k]) || !std::isfinite(r.stain_beta[k]))
      return invalid_argument("gather_augment: a stain factor is not finite");
  return ok_status();
}

// --- Vision Transformer ops ---
Result<LinearDims> validate_layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                                       const Tensor& y, DTypes dtypes) {
  const char* op = "layer_norm_forward";
  SLIDE_RETURN_IF_ERROR(want_rank(op, "x", x, 2));
  if (x.dim(1) < 1) return invalid_argument(std::string(op) + ": rows of x " + shape_string(x.shape()) + " are empty");
  SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, x.shape()));
  SLIDE_RETURN_IF_ERROR(want_channels(op, {{"gamma", &gamma}, {"beta", &beta}}, x.dim(1)));
  if (!(eps > 0)) return invalid_argument(std::string(op) + ": eps " + std::to_string(eps) + " must be > 0");
  if (is_half(x.dtype()) || is_half(y.dtype())) {
    // Half-precision storage: x and y each f32 or one half type, gamma and beta f32.
    if (is_half(x.dtype()) && is_half(y.dtype()) && x.dtype() != y.dtype())
      return invalid_argument(std::string(op) + ": x is " + dtype_name(x.dtype()) + " and y " + dtype_name(y.dtype()) +
                              " (one half-precision type per call)");
    for (const Tensor* t : {&x, &y})
      if (!is_half(t->dtype()) && t->dtype() != DType::kF32)
        return invalid_argument(std::string(op) + ": " + (t == &x ? "x" : "y") + " is " + dtype_name(t->dtype()) +
                                "; beside a half-precision tensor it must be f32");
    if (gamma.dtype() != DType::kF32 || beta.dtype() != DType::kF32)
      return invalid_argument(std::string(op) + ": gamma and beta must be f32 with half-precision x or y");
    SLIDE_RETURN_IF_ERROR(want_dtype(op, {{"x", &x}}, dtypes));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, {{"y", &y}}, dtypes));
    SLIDE_RETURN_IF_ERROR(want_dtype(op, {{"gamma", &gamma}, {"beta", &beta}}, dtypes));
    return LinearDims{x.dim(0), x.dim(1), x.dim(1)};
  }
  SLIDE_RETURN_IF_ERROR(want_dtype(op, {{"x", &x}, {"gamma", &gamma}, {"beta", &beta}, {"y", &y}}, dtypes));
  return LinearDims{x.dim(0), x.dim(1), x.dim(1)};
}

Status validate_permute(const Tensor& x, const std::vector<int>& perm, const Tensor& y, DTypes dtypes) {
  const char* op = "permute";
  if (!x.defined() || x.rank() < 1 || x.rank() > 6 || perm.size() != x.rank())
    return invalid_argument(std::string(op) + ": x " + shape_string(x.shape()) + " with a permutation of " +
                            std::to_string(perm.size()) + " dimensions (rank 1..6, one entry per dimension)");
  std::vector<bool> seen(perm.size(), false);
  Shape want(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) {
    if (perm[i] < 0 || static_cast<size_t>(perm[i]) >= perm.size() || seen[static_cast<size_t>(perm[i])])
      return invalid_argument(std::string(op) + ": not a permutation of 0.." + std::to_string(perm.size() - 1));
    seen[static_cast<size_t>(perm[i])] = true;
    want[i] = x.dim(static_cast<size_t>(perm[i]));
  }
  SLIDE_RETURN_IF_ERROR(want_shape(op, "y", y, want));
  if (y.shares_storage(x)) return invalid_argument(std::string(op) + ": y shares storage with x");
  return want_dtype(op, {{"x", &x}, {"y", &y}}, dtypes);
}

}  // namespace slide::train::detail
