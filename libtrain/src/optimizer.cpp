#include "slide/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace slide::train {

Result<std::unique_ptr<Optimizer>> Optimizer::make(const OptimizerConfig& config, std::vector<Parameter*> params,
                                                   Allocator& alloc, std::vector<ParameterOptions> options) {
  if (options.empty()) options.resize(params.size());
  if (options.size() != params.size())
    return slide::core::invalid_argument("optimizer: " + std::to_string(options.size()) + " parameter options for " +
                                         std::to_string(params.size()) + " parameters");
  for (size_t i = 0; i < options.size(); ++i)
    if (!(options[i].lr_scale >= 0) || !std::isfinite(options[i].lr_scale))
      return slide::core::invalid_argument("optimizer: learning-rate scale of " + params[i]->name +
                                           " is not a finite number >= 0");
  if (config.name != "sgd" && config.name != "adamw")
    return slide::core::invalid_argument("optimizer '" + config.name + "' is not one of sgd, adamw");
  // Written so that NaN fails every test.
  if (!(config.momentum >= 0 && config.momentum < 1) || !(config.weight_decay >= 0) ||
      !std::isfinite(config.weight_decay) || !(config.dampening >= 0 && config.dampening <= 1) ||
      !(config.eps > 0) || !std::isfinite(config.eps) || !(config.beta1 >= 0 && config.beta1 < 1) ||
      !(config.beta2 >= 0 && config.beta2 < 1))
    return slide::core::invalid_argument("optimizer " + config.name + ": a hyper-parameter is out of range");
  if (config.nesterov && (config.momentum <= 0 || config.dampening != 0))
    return slide::core::invalid_argument("sgd: Nesterov momentum needs momentum > 0 and dampening 0 (as PyTorch)");
  auto opt = std::unique_ptr<Optimizer>(new Optimizer());
  opt->config_ = config;
  opt->params_ = std::move(params);
  opt->options_ = std::move(options);
  const bool sgd = config.name == "sgd";
  for (size_t i = 0; i < opt->params_.size(); ++i) {
    Parameter* p = opt->params_[i];
    if (opt->options_[i].frozen) continue;
    if (sgd && config.momentum > 0) {
      Buffer b{p->name + ".momentum_buffer", Tensor()};
      SLIDE_ASSIGN_OR_RETURN(b.value, Tensor::zeros(p->value.shape(), p->value.dtype(), alloc, b.name));
      opt->state_a_.push_back(std::move(b));
    } else if (!sgd) {
      Buffer m{p->name + ".exp_avg", Tensor()}, v{p->name + ".exp_avg_sq", Tensor()};
      SLIDE_ASSIGN_OR_RETURN(m.value, Tensor::zeros(p->value.shape(), p->value.dtype(), alloc, m.name));
      SLIDE_ASSIGN_OR_RETURN(v.value, Tensor::zeros(p->value.shape(), p->value.dtype(), alloc, v.name));
      opt->state_a_.push_back(std::move(m));
      opt->state_b_.push_back(std::move(v));
    }
  }
  return opt;
}

Status Optimizer::step(Backend& be, double lr) {
  // Nothing non-finite is applied: a NaN or inf learning rate or gradient (after the all-reduce,
  // so every rank sees the same) stops training before any parameter changes.
  if (!std::isfinite(lr) || lr < 0)
    return slide::core::out_of_range("optimizer step " + std::to_string(steps_ + 1) + ": learning rate " +
                                     std::to_string(lr) + " is not a finite number >= 0; nothing was updated");
  std::string where;
  SLIDE_ASSIGN_OR_RETURN(const bool finite, gradients_finite(be, &where));
  if (!finite) {
    return slide::core::out_of_range("optimizer step " + std::to_string(steps_ + 1) +
                                     ": the gradient is not finite (NaN or inf" +
                                     (where.empty() ? std::string() : ", first in " + where + "'s gradient") +
                                     "); nothing was updated");
  }
  const bool first = steps_ == 0;
  ++steps_;
  size_t k = 0;  // the state of the k-th trainable parameter
  for (size_t i = 0; i < params_.size(); ++i) {
    if (options_[i].frozen) continue;
    Parameter& p = *params_[i];
    // The scale 1 case multiplies by 1.0: the same bits as before per-parameter scales existed.
    const double lr_i = lr * options_[i].lr_scale;
    Status s;
    if (config_.name == "sgd") {
      Tensor none;
      Tensor& buf = state_a_.empty() ? none : state_a_[k].value;
      s = be.sgd_update(p.value, p.grad, buf, lr_i, config_.momentum, config_.dampening, config_.weight_decay,
                        config_.nesterov, first);
    } else {
      s = be.adamw_update(p.value, p.grad, state_a_[k].value, state_b_[k].value, lr_i, config_.beta1, config_.beta2,
                          config_.eps, config_.weight_decay, steps_);
    }
    ++k;
    if (!s.ok()) return s.with_context("update of " + p.name);
  }
  return slide::core::ok_status();
}

Result<bool> Optimizer::gradients_finite(Backend& be, std::string* first_bad) {
  // The sum of squared gradient elements (Backend::sum_of_squares_each: on the gradients' device,
  // one number per parameter back to the host in one wait), the first non-finite one named.
  std::vector<const Tensor*> grads;
  std::vector<const Parameter*> checked;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter* p = params_[i];
    if (!p->grad.defined() || options_[i].frozen) continue;
    grads.push_back(&p->grad);
    checked.push_back(p);
  }
  std::vector<double> sums(grads.size(), 0.0);
  SLIDE_RETURN_IF_ERROR(be.sum_of_squares_each(grads, sums.data()).with_context("gradient check"));
  std::string where;
  double sq = 0;
  for (size_t i = 0; i < sums.size(); ++i) {
    if (!std::isfinite(sums[i]) && where.empty()) where = checked[i]->name;
    sq += sums[i];
  }
  if (first_bad != nullptr) *first_bad = where;
  return std::isfinite(sq);
}

Status Optimizer::scale_gradients(Backend& be, double factor) {
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter* p = params_[i];
    if (!p->grad.defined() || options_[i].frozen) continue;
    SLIDE_RETURN_IF_ERROR(be.scale(p->grad, factor, p->grad).with_context("gradient unscale of " + p->name));
  }
  return slide::core::ok_status();
}

Status Optimizer::zero_grad() {
  for (Parameter* p : params_) SLIDE_RETURN_IF_ERROR(p->grad.set_zero());
  return slide::core::ok_status();
}

std::vector<Buffer*> Optimizer::state() {
  std::vector<Buffer*> out;
  for (auto& b : state_a_) out.push_back(&b);
  for (auto& b : state_b_) out.push_back(&b);
  return out;
}

double Schedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  const int64_t t = step - warmup_steps;
  if (kind == "constant") return base_lr;
  if (kind == "step") return base_lr * std::pow(gamma, static_cast<double>(t / std::max<int64_t>(1, step_size)));
  const int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
  const double frac = std::min(1.0, static_cast<double>(t) / static_cast<double>(span));
  return min_lr + (base_lr - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi * frac));
}

}  // namespace slide::train
