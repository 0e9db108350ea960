#include "slide/train/oom_recovery.h"

#include <algorithm>
#include <string>

#include "slide/core/log.h"

namespace slide::train {

StepRecovery::StepRecovery(Layer& model, bool enabled) : model_(model), enabled_(enabled) {
  if (enabled_) model_.collect("", nullptr, &buffers_);
}

Status StepRecovery::begin_step() {
  if (!enabled_) return slide::core::ok_status();
  // Copies on the buffers' own device (running statistics: a few KiB per batch norm), refreshed in
  // place after the first step.
  saved_.resize(buffers_.size());
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const Tensor& t = buffers_[i]->value;
    if (!saved_[i].defined() || saved_[i].shape() != t.shape() || saved_[i].device() != t.device()) {
      SLIDE_ASSIGN_OR_RETURN(saved_[i], t.clone(buffers_[i]->name + " (saved for out-of-memory recovery)"));
    } else {
      SLIDE_RETURN_IF_ERROR(saved_[i].copy_from(t));
    }
  }
  return slide::core::ok_status();
}

Status StepRecovery::recover(const Status& error, int64_t* micro_count, int64_t step_samples, Allocator& alloc) {
  if (!enabled_ || error.code() != slide::core::StatusCode::kResourceExhausted) return error;
  if (*micro_count >= step_samples && !refit_)
    return error.with_context("out of memory with one sample per micro-batch (" + std::to_string(step_samples) +
                              " micro-batches): no smaller split is left");
  model_.release();
  for (size_t i = 0; i < buffers_.size() && i < saved_.size(); ++i)
    SLIDE_RETURN_IF_ERROR(buffers_[i]->value.copy_from(saved_[i]));
  // Freed blocks cached by the allocator do not count against the budget, but they do against the
  // machine's memory: give them back before the finer split allocates its (smaller) blocks.
  alloc.trim_cache();
  int64_t refit_count = 0;
  if (refit_) {
    SLIDE_ASSIGN_OR_RETURN(refit_count, refit_(*micro_count, step_samples));
  }
  if (refit_count <= 0 && *micro_count >= step_samples)
    return error.with_context("out of memory with one sample per micro-batch (" + std::to_string(step_samples) +
                              " micro-batches): no smaller split is left");
  if (reruns_++ == 0) count_before_ = *micro_count, first_error_ = error.to_string();
  if (refit_count > 0) {
    refitted_ = true;
    *micro_count = std::min<int64_t>(refit_count, step_samples);
  } else {
    *micro_count = std::min<int64_t>(2 * *micro_count, step_samples);
  }
  return slide::core::ok_status();
}

void StepRecovery::end_step(int64_t micro_count, int64_t step_samples) {
  if (reruns_ == 0) return;
  slide::core::log_warn(refitted_ ? "out of memory in a step: it was rerun fitted another way (same update); "
                                    "later steps keep it"
                                  : "out of memory in a step: it was rerun with smaller micro-batches (same update); "
                                    "later steps keep them",
                        {{"error", first_error_}, {"reruns", reruns_}, {"refitted", refitted_ ? "yes" : "no"},
                         {"micro_batch_before", (step_samples + count_before_ - 1) / count_before_},
                         {"micro_batch_now", (step_samples + micro_count - 1) / micro_count},
                         {"accumulate_before", count_before_}, {"accumulate_now", micro_count}});
  reruns_ = 0;
  refitted_ = false;
}

}  // namespace slide::train
