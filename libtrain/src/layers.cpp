#include "slide/train/layers.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "dist/sync_batch_norm.h"
#include "op_checks.h"
#include "slide/train/random.h"

namespace slide::train {

namespace {

using slide::core::failed_precondition;
using slide::core::invalid_argument;

Result<Tensor> new_tensor(Backend& be, const Shape& s, DType dt, const char* what) {
  return Tensor::empty(s, dt, be.allocator(), what);
}

// Fills t (f32 or f64) from gen(), in order.
template <typename Gen>
void fill(Tensor& t, Gen gen) {
  const int64_t n = t.numel();
  if (t.dtype() == DType::kF64) {
    double* p = t.data<double>();
    for (int64_t i = 0; i < n; ++i) p[i] = gen();
  } else {
    float* p = t.data<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(gen());
  }
}

void fill_value(Tensor& t, double v) {
  fill(t, [v] { return v; });
}

Result<Parameter> make_parameter(Allocator& alloc, const Shape& s, DType dt, const char* name) {
  Parameter p;
  p.name = name;
  SLIDE_ASSIGN_OR_RETURN(p.value, Tensor::zeros(s, dt, alloc, std::string("parameter ") + name));
  SLIDE_ASSIGN_OR_RETURN(p.grad, Tensor::zeros(s, dt, alloc, std::string("gradient of ") + name));
  return p;
}

// `t` in `dtype` for a half-precision forward: a copy made by the backend's cast when t (an f32
// parameter) differs, else t itself; undefined stays undefined.
Result<Tensor> half_copy(Backend& be, const Tensor& t, DType dtype, const char* what) {
  if (!t.defined() || t.dtype() == dtype) return t;
  SLIDE_ASSIGN_OR_RETURN(Tensor h, Tensor::empty(t.shape(), dtype, be.allocator(), what));
  SLIDE_RETURN_IF_ERROR(be.cast(t, h));
  return h;
}

// The weight and bias a Conv2d or Linear multiplies x by: the f32 parameters themselves, or, for
// half-precision x, their copies in x's type (torch.autocast's weight cast), made each forward.
// *saved (for backward data) is the half weight copy in training, else undefined.
// (An allocation error names the copy; Sequential adds the layer's name.)
Status operand_weights(Backend& be, const Tensor& x, const Parameter& weight, const Parameter& bias, bool training,
                       Tensor* w, Tensor* b, Tensor* saved) {
  *w = weight.value;
  *b = bias.value;
  *saved = Tensor();
  if (!detail::is_half(x.dtype())) return slide::core::ok_status();
  SLIDE_ASSIGN_OR_RETURN(*w, half_copy(be, weight.value, x.dtype(), "half-precision weight copy"));
  SLIDE_ASSIGN_OR_RETURN(*b, half_copy(be, bias.value, x.dtype(), "half-precision bias copy"));
  if (training) *saved = *w;
  return slide::core::ok_status();
}

void push(const std::string& prefix, Parameter& p, std::vector<Parameter*>* params) {
  if (params == nullptr || !p.value.defined()) return;
  params->push_back(&p);
  (void)prefix;
}

}  // namespace

std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : name.empty() ? prefix : prefix + "." + name;
}

// ---------------------------------------------------------------------------------------------
Result<std::unique_ptr<Conv2d>> Conv2d::make(Allocator& alloc, DType dtype, int64_t in, int64_t out, int kernel,
                                             Conv2dParams p, bool bias, InitRng& rng) {
  if (in < 1 || out < 1 || kernel < 1) return invalid_argument("Conv2d: sizes must be positive");
  auto c = std::make_unique<Conv2d>();
  c->p_ = p;
  SLIDE_ASSIGN_OR_RETURN(c->weight, make_parameter(alloc, {out, in, kernel, kernel}, dtype, "weight"));
  // torchvision ResNet: kaiming_normal_(mode="fan_out", nonlinearity="relu"): std = sqrt(2 / fan_out).
  const double stddev = std::sqrt(2.0 / static_cast<double>(out * kernel * kernel));
  NormalSampler normal(0.0, stddev);
  if (rng.draws()) fill(c->weight.value, [&] { return normal(rng); });
  if (bias) {
    SLIDE_ASSIGN_OR_RETURN(c->bias, make_parameter(alloc, {out}, dtype, "bias"));
  }
  c->bias.name = "bias";
  return c;
}

Result<Tensor> Conv2d::forward(Backend& be, const Tensor& x, bool training) {
  if (x.rank() != 4) return invalid_argument("Conv2d: input must be NCHW, is " + shape_string(x.shape()));
  const Shape& ws = weight.value.shape();
  SLIDE_ASSIGN_OR_RETURN(Tensor y, new_tensor(be,
                                               {x.dim(0), ws[0], conv_out_extent(x.dim(2), ws[2], p_.stride, p_.pad),
                                                conv_out_extent(x.dim(3), ws[3], p_.stride, p_.pad)},
                                               x.dtype(), "conv output"));
  Tensor w, b;
  SLIDE_RETURN_IF_ERROR(operand_weights(be, x, weight, bias, training, &w, &b, &w_half_));
  SLIDE_RETURN_IF_ERROR(be.conv2d_forward(x, w, b, p_, y));
  x_ = training ? x : Tensor();
  return y;
}

Result<Tensor> Conv2d::backward(Backend& be, const Tensor& dy) {
  if (!x_.defined()) return failed_precondition("Conv2d: backward without a training forward");
  SLIDE_RETURN_IF_ERROR(be.conv2d_backward_weights(x_, dy, p_, weight.grad, bias.grad));
  if (!input_gradient_) return Tensor();
  SLIDE_ASSIGN_OR_RETURN(Tensor dx, new_tensor(be, x_.shape(), x_.dtype(), "conv input gradient"));
  SLIDE_RETURN_IF_ERROR(be.conv2d_backward_data(dy, w_half_.defined() ? w_half_ : weight.value, p_, dx));
  return dx;
}

void Conv2d::collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>*) {
  weight.name = join_name(prefix, "weight");
  push(prefix, weight, params);
  if (bias.value.defined()) {
    bias.name = join_name(prefix, "bias");
    push(prefix, bias, params);
  }
}

// ---------------------------------------------------------------------------------------------
Result<std::unique_ptr<BatchNorm2d>> BatchNorm2d::make(Allocator& alloc, DType dtype, int64_t channels, double eps,
                                                       double momentum) {
  if (channels < 1) return invalid_argument("BatchNorm2d: channels must be positive");
  auto b = std::make_unique<BatchNorm2d>();
  b->eps_ = eps;
  b->momentum_ = momentum;
  SLIDE_ASSIGN_OR_RETURN(b->weight, make_parameter(alloc, {channels}, dtype, "weight"));
  SLIDE_ASSIGN_OR_RETURN(b->bias, make_parameter(alloc, {channels}, dtype, "bias"));
  fill_value(b->weight.value, 1.0);
  SLIDE_ASSIGN_OR_RETURN(b->running_mean.value, Tensor::zeros({channels}, dtype, alloc, "running_mean"));
  SLIDE_ASSIGN_OR_RETURN(b->running_var.value, Tensor::zeros({channels}, dtype, alloc, "running_var"));
  fill_value(b->running_var.value, 1.0);
  return b;
}

void BatchNorm2d::fuse_relu(ReLU& next) {
  relu_ = true;
  next.fused_ = true;
}

Result<Tensor> BatchNorm2d::forward(Backend& be, const Tensor& x, bool training) {
  SLIDE_ASSIGN_OR_RETURN(Tensor y, new_tensor(be, x.shape(), x.dtype(), "batch norm output"));
  if (!training) {
    SLIDE_RETURN_IF_ERROR(be.batch_norm_forward_inference(x, weight.value, bias.value, running_mean.value,
                                                          running_var.value, eps_, y));
    if (relu_) SLIDE_RETURN_IF_ERROR(be.relu_forward(y, y));
    x_ = y_ = Tensor();
    return y;
  }
  const Shape c{weight.value.dim(0)};
  // The statistics in the parameters' dtype: f32 beside half-precision activations.
  SLIDE_ASSIGN_OR_RETURN(mean_, new_tensor(be, c, weight.value.dtype(), "batch mean"));
  SLIDE_ASSIGN_OR_RETURN(invstd_, new_tensor(be, c, weight.value.dtype(), "batch 1/std"));
  if (sync_ != nullptr) {  // the pieces read plain or channels last: a blocked x through a plain copy
    SLIDE_ASSIGN_OR_RETURN(const Tensor xp, x.layout() == Layout::kNhwc ? Result<Tensor>(x) : be.to_plain(x));
    SLIDE_RETURN_IF_ERROR(dist::sync_batch_norm_forward(*sync_, be, xp, weight.value, bias.value, eps_, momentum_,
                                                        running_mean.value, running_var.value, y, mean_, invstd_,
                                                        &sync_stats_));
    if (relu_) SLIDE_RETURN_IF_ERROR(be.relu_forward(y, y));
    x_ = xp;
    y_ = relu_ ? y : Tensor();
    return y;
  }
  if (relu_) {
    SLIDE_RETURN_IF_ERROR(be.batch_norm_relu_forward_training(x, weight.value, bias.value, eps_, momentum_,
                                                              running_mean.value, running_var.value, y, mean_,
                                                              invstd_));
  } else {
    SLIDE_RETURN_IF_ERROR(be.batch_norm_forward_training(x, weight.value, bias.value, eps_, momentum_,
                                                         running_mean.value, running_var.value, y, mean_, invstd_));
  }
  x_ = x;
  y_ = relu_ ? y : Tensor();
  return y;
}

Result<Tensor> BatchNorm2d::backward(Backend& be, const Tensor& dy) {
  if (!x_.defined()) return failed_precondition("BatchNorm2d: backward without a training forward");
  SLIDE_ASSIGN_OR_RETURN(Tensor dx, new_tensor(be, x_.shape(), x_.dtype(), "batch norm input gradient"));
  if (sync_ != nullptr) {
    SLIDE_ASSIGN_OR_RETURN(Tensor dyp, dy.layout() == Layout::kNhwc ? Result<Tensor>(dy) : be.to_plain(dy));
    if (relu_) {  // the ReLU's mask first, as its own layer would, into dx (the pieces allow dx == dy)
      SLIDE_RETURN_IF_ERROR(be.relu_backward(y_, dyp, dx));
      dyp = dx;
    }
    SLIDE_RETURN_IF_ERROR(dist::sync_batch_norm_backward(*sync_, be, x_, dyp, weight.value, mean_, invstd_, sync_stats_,
                                                         dx, weight.grad, bias.grad));
    return dx;
  }
  if (relu_) {
    SLIDE_RETURN_IF_ERROR(
        be.batch_norm_relu_backward(x_, y_, dy, weight.value, mean_, invstd_, dx, weight.grad, bias.grad));
  } else {
    SLIDE_RETURN_IF_ERROR(be.batch_norm_backward(x_, dy, weight.value, mean_, invstd_, dx, weight.grad, bias.grad));
  }
  return dx;
}

void BatchNorm2d::collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) {
  weight.name = join_name(prefix, "weight");
  bias.name = join_name(prefix, "bias");
  push(prefix, weight, params);
  push(prefix, bias, params);
  running_mean.name = join_name(prefix, "running_mean");
  running_var.name = join_name(prefix, "running_var");
  if (buffers != nullptr) {
    buffers->push_back(&running_mean);
    buffers->push_back(&running_var);
  }
}

// ---------------------------------------------------------------------------------------------
Result<Tensor> ReLU::forward(Backend& be, const Tensor& x, bool training) {
  if (fused_) return x;  // the batch norm before it applied it
  SLIDE_ASSIGN_OR_RETURN(Tensor y, new_tensor(be, x.shape(), x.dtype(), "relu output"));
  SLIDE_RETURN_IF_ERROR(be.relu_forward(x, y));
  y_ = training ? y : Tensor();
  return y;
}

Result<Tensor> ReLU::backward(Backend& be, const Tensor& dy) {
  if (fused_) return dy;
  if (!y_.defined()) return failed_precondition("ReLU: backward without a training forward");
  SLIDE_ASSIGN_OR_RETURN(Tensor dx, new_tensor(be, y_.shape(), y_.dtype(), "relu input gradient"));
  SLIDE_RETURN_IF_ERROR(be.relu_backward(y_, dy, dx));
  return dx;
}

// ---------------------------------------------------------------------------------------------
Result<Tensor> MaxPool2d::forward(Backend& be, const Tensor& x, bool training) {
  if (x.rank() != 4) return invalid_argument("MaxPool2d: input must be NCHW, is " + shape_string(x.shape()));
  SLIDE_ASSIGN_OR_RETURN(Tensor y, new_tensor(be,
                                               {x.dim(0), x.dim(1), conv_out_extent(x.dim(2), p_.kernel, p_.stride, p_.pad),
                                                conv_out_extent(x.dim(3), p_.kernel, p_.stride, p_.pad)},
                                               x.dtype(), "max pool output"));
  SLIDE_RETURN_IF_ERROR(be.max_pool2d_forward(x, p_, y));
  x_ = training ? x : Tensor();
  return y;
}

Result<Tensor> MaxPool2d::backward(Backend& be, const Tensor& dy) {
  if (!x_.defined()) return failed_precondition("MaxPool2d: backward without a training forward");
  SLIDE_ASSIGN_OR_RETURN(Tensor dx, new_tensor(be, x_.shape(), x_.dtype(), "max pool input gradient"));
  SLIDE_RETURN_IF_ERROR(be.max_pool2d_backward(x_, dy, p_, dx));
  return dx;
}

// ---------------------------------------------------------------------------------------------
Result<Tensor> GlobalAvgPool::forward(Backend& be, const Tensor& x, bool training) {
  (void)training;
  if (x.rank() != 4) return invalid_argument("GlobalAvgPool: input must be NCHW, is " + shape_string(x.shape()));
  SLIDE_ASSIGN_OR_RETURN(Tensor y, new_tensor(be, {x.dim(0), x.dim(1)}, x.dtype(), "pooled features"));
  SLIDE_RETURN_IF_ERROR(be.global_avg_pool_forward(x, y));
  in_shape_ = x.shape();
  in_layout_ = x.layout() == Layout::kNhwc ? Layout::kNhwc : Layout::kPlain;
  return y;
}

Result<Tensor> GlobalAvgPool::backward(Backend& be, const Tensor& dy) {
  if (in_shape_.empty()) return failed_precondition("GlobalAvgPool: backward without a forward");
  SLIDE_ASSIGN_OR_RETURN(Tensor dx, new_tensor(be, in_shape_, dy.dtype(), "pool input gradient"));
  SLIDE_RETURN_IF_ERROR(dx.set_layout(in_layout_));  // channels last: global_avg_pool_backward writes it so
  SLIDE_RETURN_IF_ERROR(be.global_avg_pool_backward(dy, dx));
  return dx;
}

// ---------------------------------------------------------------------------------------------
Result<std::unique_ptr<Linear>> Linear::make(Allocator& alloc, DType dtype, int64_t in, int64_t out, InitRng& rng) {
  if (in < 1 || out < 1) return invalid_argument("Linear: sizes must be positive");
  auto l = std::make_unique<Linear>();
  SLIDE_ASSIGN_OR_RETURN(l->weight, make_parameter(alloc, {out, in}, dtype, "weight"));
  SLIDE_ASSIGN_OR_RETURN(l->bias, make_parameter(alloc, {out}, dtype, "bias"));
  // PyTorch's Linear.reset_parameters: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
  // and the bias from the same bound.
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  if (rng.draws()) {
    fill(l->weight.value, [&] { return uniform_real(rng, -bound, bound); });
    fill(l->bias.value, [&] { return uniform_real(rng, -bound, bound); });
  }
  return l;
}

Result<Tensor> Linear::forward(Backend& be, const Tensor& x, bool training) {
  if (x.rank() != 2) return invalid_argument("Linear: input must be [N, features], is " + shape_string(x.shape()));
  SLIDE_ASSIGN_OR_RETURN(Tensor y, new_tensor(be, {x.dim(0), weight.value.dim(0)}, x.dtype(), "linear output"));
  Tensor w, b;
  SLIDE_RETURN_IF_ERROR(operand_weights(be, x, weight, bias, training, &w, &b, &w_half_));
  SLIDE_RETURN_IF_ERROR(be.linear_forward(x, w, b, y));
  x_ = training ? x : Tensor();
  return y;
}

Result<Tensor> Linear::backward(Backend& be, const Tensor& dy) {
  if (!x_.defined()) return failed_precondition("Linear: backward without a training forward");
  SLIDE_RETURN_IF_ERROR(be.linear_backward_weights(x_, dy, weight.grad, bias.grad));
  SLIDE_ASSIGN_OR_RETURN(Tensor dx, new_tensor(be, x_.shape(), x_.dtype(), "linear input gradient"));
  SLIDE_RETURN_IF_ERROR(be.linear_backward_data(dy, w_half_.defined() ? w_half_ : weight.value, dx));
  return dx;
}

void Linear::collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>*) {
  weight.name = join_name(prefix, "weight");
  bias.name = join_name(prefix, "bias");
  push(prefix, weight, params);
  push(prefix, bias, params);
}

// ---------------------------------------------------------------------------------------------
Result<Tensor> Cast::forward(Backend& be, const Tensor& x, bool training) {
  (void)training;
  from_ = x.dtype();
  Tensor y = x;
  if (x.dtype() != dtype_) {
    SLIDE_ASSIGN_OR_RETURN(y, new_tensor(be, x.shape(), dtype_, "cast output"));
    SLIDE_RETURN_IF_ERROR(be.cast(x, y));
  }
  if (layout_ == Layout::kNhwc && y.rank() == 4) return be.to_channels_last(y);
  return y;
}

Result<Tensor> Cast::backward(Backend& be, const Tensor& dy) {
  if (!input_gradient_ || !dy.defined()) return Tensor();  // set_input_gradient(false)
  Tensor g = dy;
  if (g.layout() != Layout::kPlain) {  // channels last: the input's gradient is plain, as the input was
    SLIDE_ASSIGN_OR_RETURN(g, be.to_plain(dy));
  }
  if (g.dtype() == from_) return g;
  SLIDE_ASSIGN_OR_RETURN(Tensor dx, new_tensor(be, g.shape(), from_, "cast input gradient"));
  SLIDE_RETURN_IF_ERROR(be.cast(g, dx));
  return dx;
}

void set_input_gradient_of(const std::vector<std::unique_ptr<Layer>>& layers, bool needed) {
  for (const auto& l : layers) {
    l->set_input_gradient(needed);
    if (dynamic_cast<const Cast*>(l.get()) == nullptr) break;
  }
}

namespace {
// Cast(dtype, layout) first ("cast_in") and Cast(f32) last ("cast_out"), unless the model has a
// Cast first already (`what` names the caller in that error).
Status insert_casts(Sequential& model, DType dtype, Layout layout, const char* what) {
  if (model.size() > 0 && dynamic_cast<const Cast*>(&model.at(0)) != nullptr)
    return invalid_argument(std::string(what) + ": the model has casts at its ends already");
  model.insert(0, std::make_unique<Cast>(dtype, layout), "cast_in");
  model.insert(model.size(), std::make_unique<Cast>(DType::kF32), "cast_out");
  return slide::core::ok_status();
}
}  // namespace

Status enable_half_activations(Sequential& model, DType dtype, Layout layout) {
  if (!detail::is_half(dtype))
    return invalid_argument(std::string("half-precision activations: ") + dtype_name(dtype) + " is not f16 or bf16");
  if (layout != Layout::kPlain && layout != Layout::kNhwc)
    return invalid_argument(std::string("half-precision activations: the ") + layout_name(layout) +
                            " layout; plain or nhwc (channels last)");
  return insert_casts(model, dtype, layout, "half-precision activations");
}

Status enable_channels_last(Sequential& model) { return insert_casts(model, DType::kF32, Layout::kNhwc, "channels last"); }

Layout activation_layout(Sequential& model) {
  if (model.size() == 0) return Layout::kPlain;
  const auto* c = dynamic_cast<const Cast*>(&model.at(0));
  return c != nullptr ? c->layout() : Layout::kPlain;
}

DType half_activation_dtype(Sequential& model) {
  if (model.size() == 0) return DType::kF32;
  const auto* c = dynamic_cast<const Cast*>(&model.at(0));
  return c != nullptr && detail::is_half(c->dtype()) ? c->dtype() : DType::kF32;
}

// ---------------------------------------------------------------------------------------------
void Sequential::insert(size_t i, std::unique_ptr<Layer> layer, std::string name) {
  i = std::min(i, layers_.size());
  names_.insert(names_.begin() + static_cast<long>(i), std::move(name));
  layers_.insert(layers_.begin() + static_cast<long>(i), std::move(layer));
  if (backward_hook_ != nullptr) layers_[i]->set_backward_hook(backward_hook_);
}

void Sequential::add(std::unique_ptr<Layer> layer, std::string name) {
  if (auto* relu = dynamic_cast<ReLU*>(layer.get()); relu != nullptr && !layers_.empty()) {
    if (auto* bn = dynamic_cast<BatchNorm2d*>(layers_.back().get()); bn != nullptr && !bn->relu_fused()) {
      bn->fuse_relu(*relu);
    }
  }
  names_.push_back(name.empty() ? std::to_string(layers_.size()) : std::move(name));
  layers_.push_back(std::move(layer));
}

Result<Tensor> Sequential::forward(Backend& be, const Tensor& x, bool training) {
  Tensor h = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto r = layers_[i]->forward(be, h, training);
    if (!r.ok()) return r.status().with_context("layer " + names_[i]);
    h = std::move(*r);
  }
  return h;
}

Result<Tensor> Sequential::backward(Backend& be, const Tensor& dy) {
  Tensor g = dy;
  for (size_t i = layers_.size(); i-- > 0;) {
    auto r = layers_[i]->backward(be, g);
    if (!r.ok()) return r.status().with_context("layer " + names_[i] + " backward");
    g = std::move(*r);
    layers_[i]->release();  // its saved activations are no longer needed
    if (backward_hook_ != nullptr) {
      if (Status s = (*backward_hook_)(*layers_[i]); !s.ok()) return s.with_context("after layer " + names_[i] + " backward");
    }
  }
  return g;
}

void Sequential::set_backward_hook(const BackwardHook* hook) {
  backward_hook_ = hook;
  for (auto& l : layers_) l->set_backward_hook(hook);
}

void Sequential::collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) {
  for (size_t i = 0; i < layers_.size(); ++i) layers_[i]->collect(join_name(prefix, names_[i]), params, buffers);
}

std::unique_ptr<Layer> Sequential::replace(size_t i, std::unique_ptr<Layer> layer) {
  std::swap(layers_.at(i), layer);
  return layer;
}

void Sequential::release() {
  for (auto& l : layers_) l->release();
}

void Sequential::set_rng_seed(uint64_t seed) {
  for (auto& l : layers_) l->set_rng_seed(seed);
}

Status move_to_device(Backend& be, Layer& model) {
  if (be.device() == Device::kCpu) return slide::core::ok_status();
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  model.collect("", &params, &buffers);
  for (Parameter* p : params) {
    SLIDE_ASSIGN_OR_RETURN(p->value, to_device(be, p->value, "parameter " + p->name));
    SLIDE_ASSIGN_OR_RETURN(p->grad, to_device(be, p->grad, "gradient of " + p->name));
  }
  for (Buffer* b : buffers) {
    SLIDE_ASSIGN_OR_RETURN(b->value, to_device(be, b->value, "buffer " + b->name));
  }
  return slide::core::ok_status();
}

void Sequential::set_batch_norm_sync(Communicator* comm) {
  for (auto& l : layers_) l->set_batch_norm_sync(comm);
}

// ---------------------------------------------------------------------------------------------
Result<Tensor> Dropout::forward(Backend& be, const Tensor& x, bool training) {
  if (!(p_ >= 0 && p_ < 1)) return invalid_argument("dropout probability " + std::to_string(p_) + " is not in [0, 1)");
  identity_ = !training || p_ == 0;
  if (identity_) return x;
  // The mask is drawn on the host, one generator per sample (row of dim 0) seeded by seed + row:
  // the trainer's seed is the micro-batch's first position in the epoch's order, so a sample's
  // mask depends on its position only, not on how the step is split into micro-batches or ranks.
  // On a device backend it is uploaded (one copy of x's size per Dropout and step; the classifier
  // head's dropout is [N, features], small beside the activations).
  Allocator& host_alloc = be.device() == Device::kCpu ? be.allocator() : cpu_allocator();
  // Half-precision x takes the f32 mask rounded to its type on the backend (0 and 1 / (1 - p)).
  const DType mask_dtype = detail::is_half(x.dtype()) ? DType::kF32 : x.dtype();
  SLIDE_ASSIGN_OR_RETURN(Tensor host_mask, Tensor::empty(x.shape(), mask_dtype, host_alloc, "dropout mask"));
  const double keep = 1.0 - p_, scale = 1.0 / keep;
  const int64_t rows = x.rank() > 0 ? x.dim(0) : 1, per_row = rows > 0 ? x.numel() / rows : 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::mt19937_64 rng((seed_ + static_cast<uint64_t>(r)) * 0x9E3779B97F4A7C15ull ^ (salt_ + 0x632BE59BD9B4E019ull));
    for (int64_t i = r * per_row; i < (r + 1) * per_row; ++i) {
      const double m = bernoulli(rng, keep) ? scale : 0.0;
      if (x.dtype() == DType::kF64) host_mask.data<double>()[i] = m;
      else host_mask.data<float>()[i] = static_cast<float>(m);
    }
  }
  SLIDE_ASSIGN_OR_RETURN(mask_, to_device(be, host_mask, "dropout mask"));
  if (mask_dtype != x.dtype()) {
    SLIDE_ASSIGN_OR_RETURN(mask_, half_copy(be, mask_, x.dtype(), "half-precision dropout mask"));
  }
  SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty(x.shape(), x.dtype(), be.allocator(), "dropout output"));
  SLIDE_RETURN_IF_ERROR(be.mul(x, mask_, y));
  return y;
}

Result<Tensor> Dropout::backward(Backend& be, const Tensor& dy) {
  if (identity_) return dy;
  if (!mask_.defined()) return failed_precondition("Dropout backward without a training forward");
  SLIDE_ASSIGN_OR_RETURN(Tensor dx, Tensor::empty(dy.shape(), dy.dtype(), be.allocator(), "dropout input gradient"));
  SLIDE_RETURN_IF_ERROR(be.mul(dy, mask_, dx));
  return dx;
}

// ---------------------------------------------------------------------------------------------
namespace {

// torchvision's downsample: 1x1 conv with the block's stride, then batch norm.
Result<std::unique_ptr<Sequential>> make_downsample(Allocator& alloc, DType dtype, int64_t in, int64_t out, int stride,
                                                    InitRng& rng) {
  auto d = std::make_unique<Sequential>();
  SLIDE_ASSIGN_OR_RETURN(auto dc, Conv2d::make(alloc, dtype, in, out, 1, {stride, 0}, false, rng));
  SLIDE_ASSIGN_OR_RETURN(auto dn, BatchNorm2d::make(alloc, dtype, out));
  d->add(std::move(dc));
  d->add(std::move(dn));
  return d;
}

// Appends conv (k x k, stride, pad k / 2, no bias) + bn (+ relu) named conv<i>, bn<i>.
Status add_conv_bn(Sequential& seq, Allocator& alloc, DType dtype, int64_t in, int64_t out, int k, int stride, int i,
                   bool relu, InitRng& rng) {
  SLIDE_ASSIGN_OR_RETURN(auto c, Conv2d::make(alloc, dtype, in, out, k, {stride, k / 2}, false, rng));
  SLIDE_ASSIGN_OR_RETURN(auto n, BatchNorm2d::make(alloc, dtype, out));
  seq.add(std::move(c), "conv" + std::to_string(i));
  seq.add(std::move(n), "bn" + std::to_string(i));
  if (relu) seq.add(std::make_unique<ReLU>(), "relu" + std::to_string(i));
  return slide::core::ok_status();
}

}  // namespace

Result<Tensor> ResidualBlock::forward(Backend& be, const Tensor& x, bool training) {
  SLIDE_ASSIGN_OR_RETURN(Tensor h, main_.forward(be, x, training));
  Tensor shortcut = x;
  if (down_) {
    SLIDE_ASSIGN_OR_RETURN(shortcut, down_->forward(be, x, training));
  }
  SLIDE_RETURN_IF_ERROR(be.add(h, shortcut, h));  // in place: h is the block's own tensor
  return out_relu_.forward(be, h, training);
}

Result<Tensor> ResidualBlock::backward(Backend& be, const Tensor& dy) {
  SLIDE_ASSIGN_OR_RETURN(Tensor g, out_relu_.backward(be, dy));
  // The sum's gradient flows unchanged into both branches; their input gradients add up.
  SLIDE_ASSIGN_OR_RETURN(Tensor dx, main_.backward(be, g));
  Tensor dshort = g;
  if (down_) {
    SLIDE_ASSIGN_OR_RETURN(dshort, down_->backward(be, g));
  }
  SLIDE_RETURN_IF_ERROR(be.add(dx, dshort, dx));
  return dx;
}

void ResidualBlock::collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) {
  main_.collect(prefix, params, buffers);
  if (down_) down_->collect(join_name(prefix, "downsample"), params, buffers);
}

void ResidualBlock::set_batch_norm_sync(Communicator* comm) {
  main_.set_batch_norm_sync(comm);
  if (down_) down_->set_batch_norm_sync(comm);
}

void ResidualBlock::set_rng_seed(uint64_t seed) {
  main_.set_rng_seed(seed);
  if (down_) down_->set_rng_seed(seed);
}

void ResidualBlock::release() {
  main_.release();
  if (down_) down_->release();
  out_relu_.release();
}

Result<std::unique_ptr<BasicBlock>> BasicBlock::make(Allocator& alloc, DType dtype, int64_t in, int64_t out,
                                                     int stride, InitRng& rng) {
  auto b = std::make_unique<BasicBlock>();
  SLIDE_RETURN_IF_ERROR(add_conv_bn(b->main_, alloc, dtype, in, out, 3, stride, 1, true, rng));
  SLIDE_RETURN_IF_ERROR(add_conv_bn(b->main_, alloc, dtype, out, out, 3, 1, 2, false, rng));
  if (stride != 1 || in != out) {
    SLIDE_ASSIGN_OR_RETURN(b->down_, make_downsample(alloc, dtype, in, out, stride, rng));
  }
  return b;
}


Result<std::unique_ptr<Bottleneck>> Bottleneck::make(Allocator& alloc, DType dtype, int64_t in, int64_t width,
                                                     int stride, InitRng& rng) {
  auto b = std::make_unique<Bottleneck>();
  const int64_t out = width * 4;
  SLIDE_RETURN_IF_ERROR(add_conv_bn(b->main_, alloc, dtype, in, width, 1, 1, 1, true, rng));
  SLIDE_RETURN_IF_ERROR(add_conv_bn(b->main_, alloc, dtype, width, width, 3, stride, 2, true, rng));
  SLIDE_RETURN_IF_ERROR(add_conv_bn(b->main_, alloc, dtype, width, out, 1, 1, 3, false, rng));
  if (stride != 1 || in != out) {
    SLIDE_ASSIGN_OR_RETURN(b->down_, make_downsample(alloc, dtype, in, out, stride, rng));
  }
  return b;
}


Result<std::unique_ptr<Sequential>> make_resnet(Allocator& alloc, DType dtype, int depth, int64_t classes,
                                                std::optional<uint64_t> seed, double dropout) {
  if (!(dropout >= 0 && dropout < 1)) return invalid_argument("dropout " + std::to_string(dropout) + " is not in [0, 1)");
  std::vector<int> blocks;
  if (depth == 18) blocks = {2, 2, 2, 2};
  else if (depth == 34 || depth == 50) blocks = {3, 4, 6, 3};
  else return invalid_argument("ResNet depth " + std::to_string(depth) + " is not one of 18, 34, 50");
  const bool bottleneck = depth == 50;
  InitRng rng = InitRng::from(seed);
  auto net = std::make_unique<Sequential>();
  SLIDE_ASSIGN_OR_RETURN(auto conv1, Conv2d::make(alloc, dtype, 3, 64, 7, {2, 3}, false, rng));
  SLIDE_ASSIGN_OR_RETURN(auto bn1, BatchNorm2d::make(alloc, dtype, 64));
  net->add(std::move(conv1), "conv1");
  net->add(std::move(bn1), "bn1");
  net->add(std::make_unique<ReLU>(), "relu");
  net->add(std::make_unique<MaxPool2d>(Pool2dParams{3, 2, 1}), "maxpool");
  int64_t in = 64;
  for (int stage = 0; stage < 4; ++stage) {
    auto layer = std::make_unique<Sequential>();
    const int64_t width = int64_t{64} << stage;
    for (int i = 0; i < blocks[static_cast<size_t>(stage)]; ++i) {
      const int stride = (i == 0 && stage > 0) ? 2 : 1;
      if (bottleneck) {
        SLIDE_ASSIGN_OR_RETURN(auto b, Bottleneck::make(alloc, dtype, in, width, stride, rng));
        layer->add(std::move(b));
        in = width * 4;
      } else {
        SLIDE_ASSIGN_OR_RETURN(auto b, BasicBlock::make(alloc, dtype, in, width, stride, rng));
        layer->add(std::move(b));
        in = width;
      }
    }
    net->add(std::move(layer), "layer" + std::to_string(stage + 1));
  }
  net->add(std::make_unique<GlobalAvgPool>(), "avgpool");
  if (dropout > 0) net->add(std::make_unique<Dropout>(dropout), "dropout");
  SLIDE_ASSIGN_OR_RETURN(auto fc, Linear::make(alloc, dtype, in, classes, rng));
  net->add(std::move(fc), "fc");
  return net;
}

// ---------------------------------------------------------------------------------------------
Result<std::unique_ptr<Sequential>> make_small_cnn(Allocator& alloc, DType dtype, int64_t in_channels, int64_t classes,
                                                   int64_t width, std::optional<uint64_t> seed, double dropout) {
  if (!(dropout >= 0 && dropout < 1)) return invalid_argument("dropout " + std::to_string(dropout) + " is not in [0, 1)");
  InitRng rng = InitRng::from(seed);
  auto net = std::make_unique<Sequential>();
  int64_t c = in_channels;
  for (int stage = 0; stage < 3; ++stage) {
    const int64_t out = width << stage;
    SLIDE_ASSIGN_OR_RETURN(auto conv, Conv2d::make(alloc, dtype, c, out, 3, {1, 1}, false, rng));
    SLIDE_ASSIGN_OR_RETURN(auto bn, BatchNorm2d::make(alloc, dtype, out));
    net->add(std::move(conv));
    net->add(std::move(bn));
    net->add(std::make_unique<ReLU>());
    net->add(std::make_unique<MaxPool2d>(Pool2dParams{2, 2, 0}));
    c = out;
  }
  net->add(std::make_unique<GlobalAvgPool>());
  if (dropout > 0) net->add(std::make_unique<Dropout>(dropout), "dropout");
  SLIDE_ASSIGN_OR_RETURN(auto fc, Linear::make(alloc, dtype, c, classes, rng));
  net->add(std::move(fc), "fc");
  return net;
}

}  // namespace slide::train
