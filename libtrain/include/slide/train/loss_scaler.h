// Dynamic loss scaling for FP16 training (Micikevicius et al., "Mixed Precision Training", 2018),
// with PyTorch's torch.cuda.amp.GradScaler rules, so that runs behave as their users expect:
//   - the loss is multiplied by scale() before backward (initially 2^16), so that small FP16
//     gradients do not flush to zero;
//   - before the optimizer step the gradients are divided by scale() (inv_scale()) and checked;
//     if any is inf or NaN the step is skipped and the scale multiplied by backoff_factor (0.5);
//   - after growth_interval (2000) consecutive steps without inf/NaN the scale is multiplied by
//     growth_factor (2).
// BF16 and FP32 need no scaling: a disabled scaler has scale 1 and never skips a step, so the
// trainer calls it the same way in every precision.
//
// This class is the host-side state machine only (plain C++, tested on the CPU); the device work
// (multiplying the loss gradient, unscaling, the finiteness check) is the backend's.
#pragma once

#include <cstdint>
#include <string>

#include "slide/core/status.h"

namespace slide::train {

struct LossScalerOptions {
  bool enabled = true;
  double init_scale = 65536.0;  // 2^16, GradScaler's default
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class LossScaler {
 public:
  // Errors: kInvalidArgument for a non-finite or non-positive init_scale, growth_factor <= 1,
  // backoff_factor outside (0, 1), growth_interval < 1 (GradScaler's own checks).
  [[nodiscard]] static slide::core::Result<LossScaler> make(const LossScalerOptions& options);

  double scale() const { return enabled_ ? scale_ : 1.0; }
  // 1 / scale(), what the gradients are multiplied by before the optimizer step.
  double inv_scale() const { return 1.0 / scale(); }

  // Records the outcome of one optimizer step's finiteness check and updates the scale (GradScaler.
  // update()). Returns true when the optimizer step must be applied, false when it must be skipped
  // (found_inf). A disabled scaler returns !found_inf and keeps scale 1: the trainer then stops
  // with an error, since in FP32/BF16 a non-finite gradient is a bug or bad data, not underflow.
  bool update(bool found_inf);

  int64_t growth_tracker() const { return growth_tracker_; }  // good steps since the last change
  int64_t skipped_steps() const { return skipped_; }
  bool enabled() const { return enabled_; }

  // State for checkpoints ("scale" and "growth_tracker"; a resumed run continues exactly).
  void restore(double scale, int64_t growth_tracker);

 private:
  LossScaler() = default;
  bool enabled_ = true;
  double scale_ = 65536.0, growth_ = 2.0, backoff_ = 0.5;
  int64_t interval_ = 2000, growth_tracker_ = 0, skipped_ = 0;
};

}  // namespace slide::train
