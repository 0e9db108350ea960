#include "slide_train_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cli_checks.h"
#include "slide/core/log.h"
#include "slide/train/memory_strategy.h"
#include "slide/train/planner.h"

namespace slide::apps {

using namespace slide::train;

void add_memory_options(CLI::App& app, MemoryOptions* o) {
  app.add_option("--memory-strategy", o->memory_strategy,
                 "How a step that does not fit the memory budget is made to fit: auto (the planner weighs "
                 "micro-batching, activation checkpointing, offload and both by their measured cost and takes the "
                 "cheapest; nothing changes when the step fits) | micro-batch | checkpoint | offload | "
                 "checkpoint+offload (blocks checkpointed, their inputs offloaded by stage) (that one, with "
                 "micro-batches as needed) | off (the step as asked; a step out of memory halves its micro-batches)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "micro-batch", "checkpoint", "offload", "checkpoint+offload", "off"}));
  app.add_option("--checkpoint-activations", o->checkpoint_activations,
                 "Keep only segment inputs in forward and recompute in backward: none | stage (each ResNet "
                 "stage) | block (each residual block) | K (every K top-level layers)")
      ->capture_default_str();
  app.add_option("--offload-activations", o->offload_activations,
                 "Move the activations saved for backward to host memory after each segment's forward and back "
                 "before its backward (on a device: --backend cuda; the device peak falls, the gradients are the "
                 "same): none | stage | block | K, segments as --checkpoint-activations; with both options the "
                 "offload segments group the checkpointed ones (e.g. --checkpoint-activations block "
                 "--offload-activations stage: each block keeps only its input, and a stage's block inputs go to "
                 "the host)")
      ->capture_default_str();
  app.add_flag("--dry-run", o->dry_run,
               "Print the memory plan (bytes per layer and the peak for the micro-batch) and exit");
  app.add_option("--global-batch", o->global_batch,
                 "With --batch-size auto: samples per optimizer step; the accumulation steps follow")
      ->check(slide::apps::positive_number());
}

namespace {

using slide::core::invalid_argument;

// What may be weighed: the mechanisms in order of preference and their segment modes.
Result<StrategyRequest> request_for(const MemoryOptions& o, const Backend& be, const std::string& backend_name) {
  const bool ck = o.checkpoint_activations != "none", off = o.offload_activations != "none";
  const std::string& s = o.memory_strategy;
  const bool offload_asked = off || s == "offload" || s == "checkpoint+offload";
  if (offload_asked && be.device() == Device::kCpu)
    return invalid_argument(std::string(off ? "--offload-activations" : "--memory-strategy " + s) +
                            " moves activations from a device to host memory; on --backend " + backend_name +
                            " they are in host memory already (--checkpoint-activations saves memory there)");
  // The options name a mechanism; --memory-strategy, when not auto/off, must name the same one.
  const std::string named = ck && off ? "checkpoint+offload" : ck ? "checkpoint" : off ? "offload" : "";
  if (!named.empty() && s != "auto" && s != "off" && s != named)
    return invalid_argument("--memory-strategy " + s + " with " +
                            (ck && off ? std::string("--checkpoint-activations and --offload-activations")
                             : ck      ? std::string("--checkpoint-activations")
                                       : std::string("--offload-activations")) +
                            (ck && off ? ": the options name" : ": the option names") + " another mechanism (" +
                            named + ")");
  StrategyRequest r;
  if (ck && off) {
    r.mechanisms = {Mechanism::kCheckpointOffload};
    r.combined_segment_modes = {o.checkpoint_activations + "+" + o.offload_activations};
  } else if (ck || off) {
    r.mechanisms = {ck ? Mechanism::kCheckpoint : Mechanism::kOffload};
    r.segment_modes = {ck ? o.checkpoint_activations : o.offload_activations};
  } else if (s == "micro-batch" || s == "off") {
    r.mechanisms = {Mechanism::kNone};
  } else if (s == "checkpoint" || s == "offload" || s == "checkpoint+offload") {
    r.mechanisms = {mechanism_named(s)};
  }
  return r;
}

}  // namespace

Result<MemoryDecision> prepare_memory(const MemoryOptions& o, Backend& be, Sequential& model, int64_t tile_px,
                                      int64_t classes, const std::string& optimizer, double momentum,
                                      const std::string& backend_name, int64_t limit, int64_t* batch,
                                      int64_t* accumulate, Communicator* comm, const MemoryDecision* recorded) {
  SLIDE_ASSIGN_OR_RETURN(StrategyRequest req, request_for(o, be, backend_name));
  if (o.global_batch > 0 && *batch != 0) return invalid_argument("--global-batch goes with --batch-size auto");
  PlanOptions po;
  po.sample_shape = {3, tile_px, tile_px};
  po.classes = classes;
  po.optimizer = optimizer;
  po.momentum = momentum;
  po.backend = backend_name;
  po.workspace_backend = &be;  // cuDNN's convolution workspaces on cuda
  Allocator& alloc = be.allocator();
  // The training state already lives in the allocator; the plan adds its own figure for it, so
  // what else is live (class weights, ...) is the rest.
  SLIDE_ASSIGN_OR_RETURN(po.other_bytes, live_bytes_beside_state(model, po, alloc));
  size_t budget = alloc.budget_bytes();
  if (budget == Allocator::kUnlimited) {
    SLIDE_ASSIGN_OR_RETURN(size_t free_bytes, be.available_memory_bytes());
    budget = alloc.current_bytes() + free_bytes;
  }

  // The candidate to apply: the resumed run's, the one forced, or the planner's choice.
  StrategyCandidate chosen;
  chosen.mechanism = req.mechanisms.front();
  chosen.segments = chosen.mechanism == Mechanism::kNone                ? "none"
                    : chosen.mechanism == Mechanism::kCheckpointOffload ? req.combined_segment_modes.front()
                                                                        : req.segment_modes.front();
  std::string strategy_table;
  const int64_t asked_micro = *batch == 0 ? 0 : (*batch + *accumulate - 1) / *accumulate;
  const int64_t request_batch = *batch != 0 ? *batch : o.global_batch;  // 0: auto without a global batch
  const bool weigh = o.memory_strategy != "off" && recorded == nullptr && request_batch > 0;
  if (recorded != nullptr) {
    chosen.mechanism = mechanism_named(recorded->strategy);
    chosen.segments = recorded->segments;
    if (*batch != 0) *accumulate = std::max(*accumulate, recorded->accumulate);
    slide::core::log_info("memory strategy (as recorded by the run resumed)",
                          {{"strategy", recorded->strategy}, {"segments", recorded->segments},
                           {"accumulate", recorded->accumulate}});
  } else if (weigh) {
    req.batch = request_batch;
    req.micro_batch = *batch != 0 ? asked_micro : std::min(limit, o.global_batch);
    req.budget_bytes = budget;
    bool fits_as_asked = false;
    if (req.mechanisms.size() > 1) {  // auto: nothing to weigh when the plain step fits
      po.micro_batch = req.micro_batch;
      SLIDE_ASSIGN_OR_RETURN(MemoryPlan p, plan_memory(model, po));
      fits_as_asked = p.peak_bytes <= budget;
    }
    if (!fits_as_asked) {
      SLIDE_ASSIGN_OR_RETURN(StrategyPlan sp, plan_memory_strategy(be, model, po, req, cpu_allocator()));
      strategy_table = sp.table();
      if (sp.chosen >= 0) {
        chosen = sp.candidates[static_cast<size_t>(sp.chosen)];
        if (*batch != 0 && chosen.micro_batch < asked_micro)
          *accumulate = (*batch + chosen.micro_batch - 1) / chosen.micro_batch;
        slide::core::log_info("memory strategy", {{"chosen", chosen.name()},
                                                  {"micro_batch", chosen.micro_batch},
                                                  {"accumulate", *batch != 0 ? *accumulate : int64_t{0}},
                                                  {"why", sp.why}});
        if (!o.dry_run)
          for (size_t at = 0, nl; at < strategy_table.size(); at = nl + 1) {
            nl = strategy_table.find('\n', at);
            slide::core::log_debug(strategy_table.substr(at, nl - at));
          }
      } else {
        slide::core::log_warn("memory strategy: the plan says nothing fits the budget; trying the step as asked "
                              "(a step out of memory halves its micro-batches)",
                              {{"budget", format_bytes(budget)}});
      }
    }
  }
  // Rank 0's decision is every rank's: timings, free memory and a resumed record (read by rank 0
  // only) may differ between ranks, and every rank must split its micro-batches alike.
  if (comm != nullptr && comm->world_size() > 1) {
    struct Pick {
      int64_t mechanism, accumulate;
      char segments[48];
    } pick{static_cast<int64_t>(chosen.mechanism), *accumulate, {}};
    if (chosen.segments.size() >= sizeof pick.segments)
      return invalid_argument("segments mode '" + chosen.segments + "' is too long");
    chosen.segments.copy(pick.segments, chosen.segments.size());
    SLIDE_RETURN_IF_ERROR(comm->broadcast(&pick, sizeof pick, 0, "memory strategy"));
    chosen.mechanism = static_cast<Mechanism>(
        std::clamp<int64_t>(pick.mechanism, 0, static_cast<int64_t>(Mechanism::kCheckpointOffload)));
    chosen.segments.assign(pick.segments, strnlen(pick.segments, sizeof pick.segments));
    *accumulate = pick.accumulate;
  }
  if (chosen.mechanism != Mechanism::kNone) {
    SLIDE_ASSIGN_OR_RETURN(size_t segments, apply_strategy(model, chosen, cpu_allocator()));
    slide::core::log_info(chosen.mechanism == Mechanism::kCheckpoint ? "activation checkpointing"
                          : chosen.mechanism == Mechanism::kOffload  ? "activation offload"
                                                                     : "activation checkpointing and offload",
                          {{"mode", chosen.segments}, {"segments", static_cast<int64_t>(segments)}});
  }
  if (*batch == 0 && recorded != nullptr && o.global_batch > 0) {
    // --batch-size auto --global-batch G resumed: the run's split of G, not a new timing (another
    // free memory would give another micro-batch, and other batch statistics).
    *batch = o.global_batch;
    *accumulate = std::max<int64_t>(1, recorded->accumulate);
    slide::core::log_info("--batch-size auto: the resumed run's", {{"batch_size", *batch}, {"accumulate", *accumulate}});
  }
  if (*batch == 0) {
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
  if (o.dry_run) {
    std::fputs(strategy_table.c_str(), stdout);
    std::fputs(plan.table().c_str(), stdout);
  }
  slide::core::log_info("memory plan", {{"micro_batch", po.micro_batch}, {"peak", format_bytes(plan.peak_bytes)},
                                        {"peak_bytes", static_cast<int64_t>(plan.peak_bytes)},
                                        {"saved_activations", format_bytes(plan.saved_bytes)}, {"at", plan.peak_at}});
  MemoryDecision d;
  if (o.memory_strategy == "auto" && chosen.mechanism == Mechanism::kNone && be.device() != Device::kCpu &&
      std::find(req.mechanisms.begin(), req.mechanisms.end(), Mechanism::kOffload) != req.mechanisms.end())
    d.refit = offload_refit(be, model, po, budget, req.segment_modes);
  d.peak_bytes = plan.peak_bytes;
  d.step_bytes = plan.peak_bytes - plan.parameter_bytes - plan.gradient_bytes - plan.optimizer_bytes - plan.other_bytes;
  d.strategy = mechanism_name(chosen.mechanism);
  d.segments = chosen.segments;
  d.accumulate = *accumulate;
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
