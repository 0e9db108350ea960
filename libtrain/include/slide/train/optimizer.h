// Optimizers and learning-rate schedules, on Backend& update ops (PyTorch's semantics, see
// backend.h): SGD with momentum / Nesterov and AdamW, each with decoupled or L2 weight decay as
// PyTorch defines it; cosine and step schedules with linear warm-up.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "slide/train/layers.h"

namespace slide::train {

struct OptimizerConfig {
  std::string name = "sgd";  // "sgd" or "adamw"
  double momentum = 0.9;     // sgd
  double dampening = 0.0;    // sgd
  bool nesterov = false;     // sgd
  double weight_decay = 1e-4;  // sgd: L2 added to the gradient; adamw: decoupled
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adamw
};

// One parameter's options (fine_tune.h): a frozen parameter is never updated and has no optimizer
// state (its gradient is still zeroed by zero_grad); lr_scale multiplies the step's learning rate
// for it (PyTorch's parameter groups with their own lr: lr_group = lr_scale x the schedule's lr).
struct ParameterOptions {
  bool frozen = false;
  double lr_scale = 1.0;
};

class Optimizer {
 public:
  // State tensors (momentum buffers, Adam moments) are allocated from `alloc` now, so an
  // optimizer that does not fit the budget fails here, before training starts.
  // Errors: kInvalidArgument (unknown name; a hyper-parameter out of PyTorch's range or not
  // finite: momentum and betas in [0, 1), weight decay >= 0, dampening in [0, 1], eps > 0),
  // the allocator's. `options`: one per parameter (empty: none frozen, every lr_scale 1); also
  // kInvalidArgument when its size differs from params' or an lr_scale is not finite and >= 0.
  [[nodiscard]] static Result<std::unique_ptr<Optimizer>> make(const OptimizerConfig& config,
                                                               std::vector<Parameter*> params, Allocator& alloc,
                                                               std::vector<ParameterOptions> options = {});
  // One update of every parameter that is not frozen from its gradient at learning rate `lr`
  // (times its lr_scale). Checks first that
  // `lr` is finite and >= 0 and that the gradient is finite (the sum of squared gradient
  // elements of each parameter, Backend::sum_of_squares, on the gradients' device: one pass over
  // the gradients and one number per parameter back to the host); otherwise nothing is updated.
  // Errors: kOutOfRange (naming the step, and the first parameter whose gradient is not
  // finite), the backend's update's.
  [[nodiscard]] Status step(Backend& be, double lr);
  // Whether every gradient of a parameter that is not frozen is finite (the check step() makes
  // first). *first_bad, when given, gets the first parameter whose gradient is not. Errors: the
  // backend's.
  [[nodiscard]] Result<bool> gradients_finite(Backend& be, std::string* first_bad = nullptr);
  // Multiplies the gradient of every parameter that is not frozen by `factor` (on the gradients'
  // device): the loss scaler's unscale (loss_scaler.h). Errors: the backend's.
  [[nodiscard]] Status scale_gradients(Backend& be, double factor);
  // Sets every gradient to zero (before the first micro-batch of a step), on the gradients' device.
  // Errors: the device's.
  [[nodiscard]] Status zero_grad();
  int64_t steps() const { return steps_; }
  void set_steps(int64_t s) { steps_ = s; }
  // State for checkpoints: "<param>.momentum_buffer" (sgd), "<param>.exp_avg" and
  // "<param>.exp_avg_sq" (adamw), as in PyTorch's optimizer state dict; none for a frozen parameter.
  std::vector<Buffer*> state();

 private:
  OptimizerConfig config_;
  std::vector<Parameter*> params_;
  std::vector<ParameterOptions> options_;  // one per parameter
  std::vector<Buffer> state_a_, state_b_;  // momentum buffers, or exp_avg / exp_avg_sq; trainable parameters in order
  int64_t steps_ = 0;
};

// Learning rate at `step` (0-based): linear warm-up from base_lr / warmup_steps to base_lr over
// warmup_steps, then "cosine" (min_lr + (base_lr - min_lr) (1 + cos(pi t / T)) / 2 over the
// remaining steps, SGDR without restarts: Loshchilov & Hutter, 2017), "step" (base_lr *
// gamma^(floor(step / step_size))), or "constant".
struct Schedule {
  std::string kind = "cosine";
  double base_lr = 0.1;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  int64_t step_size = 1;  // step
  double gamma = 0.1;     // step
  double at(int64_t step) const;
};

}  // namespace slide::train
