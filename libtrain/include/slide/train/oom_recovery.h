// Out-of-memory recovery around a training step (DESIGN.md, "Memory: never die of OOM"), for
// any Layer: train_epoch (tiles) uses it, and a MIL trainer can wrap its bag steps the same way.
//
// The step's caller zeroes the gradients and snapshots its own running figures; StepRecovery
// snapshots the model's buffers (batch norm's running statistics, which a discarded forward
// would have advanced) at begin_step(), and on a kResourceExhausted error recover() puts them
// back, releases the saved activations, trims the allocator's cache of freed blocks, and doubles
// the micro-batch count; end_step() logs the step's recovery once, with the old and new sizes.
// Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "slide/train/layers.h"

namespace slide::train {

// A step's running sums, restored when the step is rerun.
struct StepTally {
  double loss_sum = 0;
  int64_t correct = 0;
  std::vector<int64_t> seen, right;
};

class StepRecovery {
 public:
  // `enabled` false: recover() returns the error unchanged.
  StepRecovery(Layer& model, bool enabled);
  // Snapshots the buffers (host tensors; tiny: two floats per batch-norm channel). Errors:
  // kUnimplemented for a buffer that is not in host memory.
  [[nodiscard]] Status begin_step();
  // After `error` inside a step whose samples on this rank are `step_samples`: when the error is
  // kResourceExhausted, recovery is enabled and the micro-batches can still be split finer
  // (*micro_count < step_samples), undoes the step's effects on the model as above, sets
  // *micro_count = min(2 x *micro_count, step_samples) and returns ok: the caller reruns the
  // step. Otherwise returns `error`
  // (with context saying that even one sample per micro-batch did not fit, when that is why).
  [[nodiscard]] Status recover(const Status& error, int64_t* micro_count, int64_t step_samples, Allocator& alloc);
  // After the step's update: when it was rerun, one warning with the first error, the micro-batch
  // size and count before and after (`micro_count` now), and the number of reruns.
  void end_step(int64_t micro_count, int64_t step_samples);

 private:
  Layer& model_;
  bool enabled_;
  std::vector<Buffer*> buffers_;
  std::vector<Tensor> saved_;  // copies of the buffers, on their device
  int64_t reruns_ = 0, count_before_ = 0;  // this step's
  std::string first_error_;
};

}  // namespace slide::train
