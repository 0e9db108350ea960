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
#include <functional>
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

// A chance to fit a step another way before its micro-batches are split finer (issue 13 item 4:
// fall back to activation offload when the memory plan says that is cheaper than halving).
// Called by recover() once the failed step's effects are undone, with the micro-batch count that
// ran out of memory and the step's samples on this rank. Returns the micro-batch count to rerun
// the step with after changing the model (say, wrapping it for offload; the update stays the
// same), or 0 when it changed nothing: then the count doubles as before. Its errors end the run.
using RefitFn = std::function<Result<int64_t>(int64_t micro_count, int64_t step_samples)>;

class StepRecovery {
 public:
  // `enabled` false: recover() returns the error unchanged.
  StepRecovery(Layer& model, bool enabled);
  // Tried by recover() before the micro-batches are split finer (null: never).
  void set_refit(RefitFn refit) { refit_ = std::move(refit); }
  // Snapshots the buffers (host tensors; tiny: two floats per batch-norm channel). Errors:
  // kUnimplemented for a buffer that is not in host memory.
  [[nodiscard]] Status begin_step();
  // After `error` inside a step whose samples on this rank are `step_samples`: when the error is
  // kResourceExhausted and recovery is enabled, undoes the step's effects on the model as above;
  // then, when the refit function (set_refit) changed the model, sets *micro_count to the count it
  // gave, else, when the micro-batches can still be split finer (*micro_count < step_samples),
  // sets *micro_count = min(2 x *micro_count, step_samples); and returns ok: the caller reruns
  // the step. Otherwise returns `error` (with context saying that even one sample per micro-batch
  // did not fit, when that is why), or the refit function's error.
  [[nodiscard]] Status recover(const Status& error, int64_t* micro_count, int64_t step_samples, Allocator& alloc);
  // After the step's update: when it was rerun, one warning with the first error, the micro-batch
  // size and count before and after (`micro_count` now), the number of reruns, and whether the
  // refit function changed the model.
  void end_step(int64_t micro_count, int64_t step_samples);

 private:
  Layer& model_;
  bool enabled_;
  std::vector<Buffer*> buffers_;
  std::vector<Tensor> saved_;  // copies of the buffers, on their device
  int64_t reruns_ = 0, count_before_ = 0;  // this step's
  bool refitted_ = false;                  // this step's
  std::string first_error_;
  RefitFn refit_;
};

}  // namespace slide::train
