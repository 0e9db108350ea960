// Internal: batch norm's running statistics swapped for copies for the lifetime of a guard, and
// the originals put back when it goes away (also on an error return), so that a forward pass run
// for another purpose (activation checkpointing's recompute, the planner's probe step) does not
// advance them.
#pragma once

#include <string>
#include <vector>

#include "slide/train/layers.h"

namespace slide::train::detail {

class RunningStatsGuard {
 public:
  explicit RunningStatsGuard(std::vector<Buffer*> buffers) : buffers_(std::move(buffers)) {}
  ~RunningStatsGuard() {
    for (size_t i = 0; i < kept_.size(); ++i) buffers_[i]->value = kept_[i];
  }
  RunningStatsGuard(const RunningStatsGuard&) = delete;
  RunningStatsGuard& operator=(const RunningStatsGuard&) = delete;

  // Each buffer's value becomes a copy; `what` names the copies in a budget error. Errors: the
  // allocator's (the buffers swapped so far are still restored by the destructor).
  [[nodiscard]] Status swap_in_copies(const std::string& what) {
    for (Buffer* b : buffers_) {
      kept_.push_back(b->value);
      SLIDE_ASSIGN_OR_RETURN(b->value, b->value.clone(what));
    }
    return slide::core::ok_status();
  }

 private:
  std::vector<Buffer*> buffers_;
  std::vector<Tensor> kept_;
};

}  // namespace slide::train::detail
