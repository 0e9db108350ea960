// slide-train's memory options (issue 6): --dry-run (the memory plan), --batch-size auto with
// --global-batch, --checkpoint-activations, and the --cache auto rule. The logic is in libtrain
// (planner.h, activation_checkpoint.h); this file wires it to the command line.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "slide/core/status.h"
#include "slide/train/communicator.h"
#include "slide/train/layers.h"
#include "slide/train/oom_recovery.h"

namespace slide::apps {

struct MemoryOptions {
  std::string memory_strategy = "auto";
  std::string checkpoint_activations = "none";
  std::string offload_activations = "none";
  bool dry_run = false;
  int64_t global_batch = 0;  // with --batch-size auto: samples per step; 0 = one micro-batch
};

// Adds --memory-strategy, --checkpoint-activations, --offload-activations, --dry-run and
// --global-batch to `app`.
void add_memory_options(CLI::App& app, MemoryOptions* options);

// What prepare_memory decided.
struct MemoryDecision {
  size_t step_bytes = 0;  // the plan's peak beyond weights, gradients and optimizer state
  size_t peak_bytes = 0;  // the plan's whole peak
  // How the step fits (memory_strategy.h): "micro-batch", "checkpoint", "offload" or
  // "checkpoint+offload", the segments ("none" with micro-batch; "block+stage" with both) and the
  // micro-batches per step. Recorded in the run's
  // state, so that --resume makes the same choice instead of timing again.
  std::string strategy = "micro-batch", segments = "none";
  int64_t accumulate = 1;
  int64_t ranks = 1;  // the world size it was made for: a resume on another applies none of it
  // With --memory-strategy auto on a device backend, when the step runs without offload: the
  // out-of-memory fallback (TrainOptions::refit_on_oom, issue 13 item 4). Once per run, a step
  // out of memory plans again at the micro-batch that failed (plan_memory_strategy: the plain
  // step and offload, its time measured) and wraps the model for offload when the plan predicts
  // that cheaper than halving the micro-batch (offload_refit_candidate); else, or later, the
  // micro-batch halves as before. Null otherwise. Not recorded for --resume: a resumed run that
  // runs out of memory again makes the same choice.
  slide::train::RefitFn refit;
};

// After the model and optimizer exist (their bytes live in the allocator), before the schedule:
// - decides how the step fits the budget (the allocator's, else the backend's free memory):
//   --memory-strategy auto, when the requested micro-batch's plan does not fit, weighs
//   micro-batching, checkpointing and offload (plan_memory_strategy) and takes the cheapest;
//   micro-batch | checkpoint | offload force one (with micro-batches as needed);
//   --checkpoint-activations / --offload-activations name the mechanism and its segments; off
//   keeps the step as asked (an out-of-memory step then halves its micro-batches). Sets
//   *accumulate when micro-batches are needed; on several ranks, rank 0's choice is every rank's
//   (`comm`, may be null for one rank);
// - resolves --batch-size auto (*batch == 0) into the largest micro-batch that fits, confirmed
//   by real steps, setting *batch and *accumulate (with --global-batch G: *batch = G,
//   *accumulate = ceil(G / micro-batch));
// - plans the step at the micro-batch and logs the predicted peak. With --dry-run the plan's
//   table (and the strategy table when one was weighed) goes to stdout.
// `recorded`: the decision of the run being resumed (or null): applied as it was, not weighed
// again. `limit`: the largest micro-batch worth trying (the training tiles). Errors:
// kInvalidArgument (a bad mode, --global-batch without auto, offload on a host backend, two
// mechanisms at once), kResourceExhausted (with --batch-size auto, not even a micro-batch of 1
// fits), those of the planner, the probe steps and the broadcast.
[[nodiscard]] slide::core::Result<MemoryDecision> prepare_memory(
    const MemoryOptions& options, slide::train::Backend& be, slide::train::Sequential& model, int64_t tile_px,
    int64_t classes, const std::string& optimizer, double momentum, const std::string& backend_name, int64_t limit,
    int64_t* batch, int64_t* accumulate, slide::train::Communicator* comm = nullptr,
    const MemoryDecision* recorded = nullptr);

// --cache auto: keep the decoded dataset `where` ("on the device", "in RAM") when it fits beside
// the training step within what is left of that memory's budget, with a tenth of it spare
// (oneDNN's and cuDNN's own buffers, rounding): logs the choice and the figures either way.
bool dataset_fits(size_t decoded_bytes, size_t budget_left_bytes, const MemoryDecision& decision, const std::string& where);

}  // namespace slide::apps
