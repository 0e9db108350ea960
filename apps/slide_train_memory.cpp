#include "slide_train_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "slide/core/log.h"
#include "slide/train/activation_checkpoint.h"
#include "slide/train/offload.h"
#include "slide/train/planner.h"

namespace slide::apps {

using namespace slide::train;

void add_memory_options(CLI::App& app, MemoryOptions* o) {
  app.add_option("--checkpoint-activations", o->checkpoint_activations,
                 "Keep only segment inputs in forward and recompute in backward: none | stage (each ResNet "
                 "stage) | block (each residual block) | K (every K top-level layers)")
      ->capture_default_str();
  app.add_option("--offload-activations", o->offload_activations,
                 "Move the activations saved for backward to host memory after each segment's forward and back "
                 "before its backward (on a device: --backend cuda; the device peak falls, the gradients are the "
                 "same): none | stage | block | K, segments as --checkpoint-activations")
      ->capture_default_str();
  app.add_flag("--dry-run", o->dry_run,
               "Print the memory plan (bytes per layer and the peak for the micro-batch) and exit");
  app.add_option("--global-batch", o->global_batch,
                 "With --batch-size auto: samples per optimizer step; the accumulation steps follow")
      ->check(CLI::PositiveNumber);
}

namespace {

size_t available_bytes() {
  return static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace

Result<MemoryDecision> prepare_memory(const MemoryOptions& o, Backend& be, Sequential& model, int64_t tile_px,
                                      int64_t classes, const std::string& optimizer, double momentum,
                                      const std::string& backend_name, int64_t limit, int64_t* batch,
                                      int64_t* accumulate) {
  if (o.checkpoint_activations != "none") {
    SLIDE_ASSIGN_OR_RETURN(size_t segments, checkpoint_activations(model, o.checkpoint_activations));
    slide::core::log_info("activation checkpointing",
                          {{"mode", o.checkpoint_activations}, {"segments", static_cast<int64_t>(segments)}});
  }
  if (o.offload_activations != "none") {
    if (o.checkpoint_activations != "none")
      return slide::core::invalid_argument(
          "--offload-activations with --checkpoint-activations: one or the other for now (offloading recomputed "
          "segments is not built yet)");
    if (be.device() == Device::kCpu)
      return slide::core::invalid_argument(
          "--offload-activations moves activations from a device to host memory; on --backend " + backend_name +
          " they are in host memory already (--checkpoint-activations saves memory there)");
    SLIDE_ASSIGN_OR_RETURN(size_t segments, offload_activations(model, o.offload_activations, cpu_allocator()));
    slide::core::log_info("activation offload",
                          {{"mode", o.offload_activations}, {"segments", static_cast<int64_t>(segments)}});
  }
  PlanOptions po;
  po.sample_shape = {3, tile_px, tile_px};
  po.classes = classes;
  po.optimizer = optimizer;
  po.momentum = momentum;
  po.backend = backend_name;
  Allocator& alloc = be.allocator();
  // The training state already lives in the allocator; the plan adds its own figure for it, so
  // what else is live (class weights, ...) is the rest.
  SLIDE_ASSIGN_OR_RETURN(MemoryPlan one, plan_memory(model, po));
  const size_t state = one.parameter_bytes + one.gradient_bytes + one.optimizer_bytes;
  po.other_bytes = alloc.current_bytes() > state ? alloc.current_bytes() - state : 0;
  if (o.global_batch > 0 && *batch != 0)
    return slide::core::invalid_argument("--global-batch goes with --batch-size auto");
  if (*batch == 0) {
    const size_t budget = alloc.budget_bytes() == Allocator::kUnlimited ? alloc.current_bytes() + available_bytes()
                                                                         : alloc.budget_bytes();
    const int64_t upto = std::max<int64_t>(1, o.global_batch > 0 ? std::min(limit, o.global_batch) : limit);
    auto found = auto_micro_batch(be, model, po, budget, upto, [](int64_t n, bool fits) {
      slide::core::log_info("--batch-size auto: real step", {{"micro_batch", n}, {"fits", fits ? "yes" : "no"}});
    });
    if (!found.ok()) return found.status();
    const int64_t micro = found->micro_batch;
    *batch = o.global_batch > 0 ? o.global_batch : micro;
    *accumulate = (*batch + micro - 1) / micro;
    slide::core::log_info("--batch-size auto",
                          {{"micro_batch", micro}, {"planned", found->planned}, {"real_steps", found->probes},
                           {"batch_size", *batch}, {"accumulate", *accumulate},
                           {"budget", format_bytes(budget)}});
  }
  po.micro_batch = (*batch + *accumulate - 1) / *accumulate;
  SLIDE_ASSIGN_OR_RETURN(MemoryPlan plan, plan_memory(model, po));
  if (o.dry_run) std::fputs(plan.table().c_str(), stdout);
  slide::core::log_info("memory plan", {{"micro_batch", po.micro_batch}, {"peak", format_bytes(plan.peak_bytes)},
                                        {"peak_bytes", static_cast<int64_t>(plan.peak_bytes)},
                                        {"saved_activations", format_bytes(plan.saved_bytes)}, {"at", plan.peak_at}});
  MemoryDecision d;
  d.peak_bytes = plan.peak_bytes;
  d.step_bytes = plan.peak_bytes - plan.parameter_bytes - plan.gradient_bytes - plan.optimizer_bytes - plan.other_bytes;
  return d;
}

bool dataset_fits(size_t decoded_bytes, size_t budget_left_bytes, const MemoryDecision& d, const std::string& where) {
  const size_t usable = budget_left_bytes - budget_left_bytes / 10;
  const bool fits = decoded_bytes + d.step_bytes <= usable;
  slide::core::log_info(fits ? "--cache auto: the decoded dataset fits beside the training step: kept " + where
                             : "--cache auto: the decoded dataset does not fit beside the training step " + where +
                                   (where == "in RAM" ? ": streamed with a one-micro-batch prefetch" : ""),
                        {{"dataset", format_bytes(decoded_bytes)}, {"step", format_bytes(d.step_bytes)},
                         {"budget_left", format_bytes(budget_left_bytes)}});
  return fits;
}

}  // namespace slide::apps
