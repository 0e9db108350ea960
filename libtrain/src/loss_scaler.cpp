#include "slide/train/loss_scaler.h"

#include <cmath>

namespace slide::train {

slide::core::Result<LossScaler> LossScaler::make(const LossScalerOptions& o) {
  if (o.enabled) {
    if (!std::isfinite(o.init_scale) || o.init_scale <= 0)
      return slide::core::invalid_argument("loss scaler: init_scale " + std::to_string(o.init_scale) +
                                           " must be finite and > 0");
    if (!(o.growth_factor > 1) || !std::isfinite(o.growth_factor))
      return slide::core::invalid_argument("loss scaler: growth_factor must be > 1");
    if (!(o.backoff_factor > 0 && o.backoff_factor < 1))
      return slide::core::invalid_argument("loss scaler: backoff_factor must be in (0, 1)");
    if (o.growth_interval < 1) return slide::core::invalid_argument("loss scaler: growth_interval must be >= 1");
  }
  LossScaler s;
  s.enabled_ = o.enabled;
  s.scale_ = o.init_scale;
  s.growth_ = o.growth_factor;
  s.backoff_ = o.backoff_factor;
  s.interval_ = o.growth_interval;
  return s;
}

bool LossScaler::update(bool found_inf) {
  if (!enabled_) return !found_inf;
  if (found_inf) {
    // GradScaler: scale *= backoff_factor, growth tracker reset, the step skipped.
    scale_ *= backoff_;
    growth_tracker_ = 0;
    ++skipped_;
    return false;
  }
  if (++growth_tracker_ == interval_) {
    // GradScaler (torch._amp_update_scale_): grow only while the grown scale stays finite.
    const double grown = scale_ * growth_;
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
  return true;
}

void LossScaler::restore(double scale, int64_t growth_tracker) {
  scale_ = scale;
  growth_tracker_ = growth_tracker;
}

}  // namespace slide::train
