// The memory planner's choice of how to fit a training step into a memory budget (issue 13; the
// seeds: TFLMS's swap-out/swap-in, vDNN, Chen et al.'s recomputation, and gradient accumulation).
//
// Three mechanisms trade time for memory, and every strategy is micro-batching plus checkpointing,
// offload, or both:
// - micro-batching: the step's samples run as ceil(batch / m) micro-batches whose gradients
//   accumulate (the same update). Cost: a fixed time per micro-batch (launches, smaller GEMMs).
// - checkpointing (activation_checkpoint.h): each segment keeps only its input and recomputes
//   its forward in backward. Cost: the forward once more.
// - offload (offload.h): each segment's saved activations go to host memory after its forward
//   and come back before its backward. Cost: those bytes both ways over the host-device copy
//   bandwidth, hidden behind the compute where the backend copies beside it (a copy stream).
// - both (checkpoint+offload, TFLMS with recomputation): blocks are checkpointed, so each keeps
//   only its input, and those inputs go to host memory by offload segments over them (stages by
//   default: "block+stage"); backward brings a stage's block inputs back and each block recomputes
//   its forward. Cost: the forward once more, and the block inputs' bytes both ways. The device
//   then holds the stage boundaries and about two stages' block inputs, plus one block's
//   recomputed activations.
//
// How a choice is made (plan_memory_strategy): every candidate (mechanism x segment mode) is
// planned on the model (planner.h: wrap, plan, unwrap) for the largest micro-batch up to the
// requested one whose planned peak fits the budget; when more than one candidate fits, the step's
// time is measured with real steps on the backend (StepCost) and each candidate's step time is
// predicted from it (predict_step_seconds); the cheapest wins, ties going to the simpler one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "slide/train/oom_recovery.h"
#include "slide/train/planner.h"

namespace slide::train {

enum class Mechanism { kNone, kCheckpoint, kOffload, kCheckpointOffload };

// "micro-batch", "checkpoint", "offload", "checkpoint+offload"; mechanism_named is its inverse
// (kNone for any other name).
const char* mechanism_name(Mechanism m);
Mechanism mechanism_named(const std::string& name);
// Whether the mechanism recomputes (checkpoint, both) / offloads (offload, both).
bool recomputes(Mechanism m);
bool offloads(Mechanism m);
// The combination's segments "CHECKPOINT_MODE+OFFLOAD_MODE" (e.g. "block+stage") split in two.
// Errors: kInvalidArgument for another shape.
[[nodiscard]] Result<std::pair<std::string, std::string>> split_combined_segments(const std::string& segments);

// The time model of one training step, measured on the backend (measure_step_cost). Seconds.
struct StepCost {
  double micro_batch_seconds = 0;    // fixed time of one micro-batch's forward + backward
  double sample_seconds = 0;         // time per sample of forward + backward
  double forward_fraction = 1.0 / 3; // forward's share of forward + backward (what a recompute repeats)
  double copy_bytes_per_second = 0;  // host <-> device copies (0: not measured; offload not weighed)
  bool copies_overlap = false;       // the backend's copy engine runs beside its ops (copy_engine.h)
  int measured_steps = 0;            // real steps run to measure this
};

// Predicted seconds of one optimizer step of `batch` samples run in micro-batches of at most
// `micro_batch` (k = ceil(batch / micro_batch) of them):
//   base = k * micro_batch_seconds + batch * sample_seconds
//   + base * forward_fraction                          when `recompute`
//   + 2 * k * offloaded_bytes / copy_bytes_per_second  when offloaded_bytes > 0 (per micro-batch,
//                                                      each way; infinite without a bandwidth);
//   with copies_overlap the copies run beside the compute instead: max(that compute, the copies)
double predict_step_seconds(const StepCost& cost, int64_t batch, int64_t micro_batch, bool recompute,
                            size_t offloaded_bytes);

struct StrategyCandidate {
  Mechanism mechanism = Mechanism::kNone;
  std::string segments = "none";  // wrap_segments' mode ("stage", "block", "K"); "none" with kNone
  int64_t micro_batch = 0;        // the micro-batch run: the step split evenly into the fewest
                                  // micro-batches that fit, <= the requested one; 0: none fits
  int64_t micro_batches = 0;      // per step: ceil(batch / micro_batch)
  size_t peak_bytes = 0;          // planned peak at micro_batch (at 1 when nothing fits)
  size_t offloaded_bytes = 0;     // per micro-batch, each way (offload)
  double seconds = -1;            // predicted step time; < 0: not predicted
  double overhead = 0;            // seconds over the plain step at the requested micro-batch, - 1
  bool fits() const { return micro_batch > 0; }
  // "micro-batch", "checkpoint stage", "offload block".
  std::string name() const;
};

// What to weigh. `mechanisms` in order of preference (ties go to the earlier); `segment_modes`
// are tried for checkpointing and offload (modes the model has nothing for are skipped).
struct StrategyRequest {
  int64_t batch = 1;            // samples per optimizer step on this rank
  int64_t micro_batch = 1;      // the micro-batch asked for (<= batch)
  size_t budget_bytes = 0;      // the device's budget for everything the plan counts
  std::vector<Mechanism> mechanisms{Mechanism::kNone, Mechanism::kCheckpoint, Mechanism::kOffload,
                                    Mechanism::kCheckpointOffload};
  std::vector<std::string> segment_modes{"stage", "block"};
  // kCheckpointOffload's segments, "CHECKPOINT_MODE+OFFLOAD_MODE".
  std::vector<std::string> combined_segment_modes{"block+stage"};
};

struct StrategyPlan {
  int64_t batch = 0, requested_micro_batch = 0;
  size_t budget_bytes = 0;
  std::vector<StrategyCandidate> candidates;
  int chosen = -1;          // index into candidates; -1: nothing fits
  StepCost cost;            // measured when more than one candidate fits
  std::string why;          // one line: why the chosen one
  // The table printed by --dry-run and logged: one row per candidate (micro-batch, micro-batches,
  // planned peak, predicted step time, overhead), then the choice and the measured time model.
  std::string table() const;
};

// The index of the fitting candidate with the least predicted time (candidates without a
// prediction count as equal to each other and lose to predicted ones only when those are
// cheaper); ties go to the earlier candidate. -1 when none fits.
int cheapest_candidate(const std::vector<StrategyCandidate>& candidates);

// Out of memory in a step run in `micro_count` micro-batches of a `batch`-sample step, without
// offload (issue 13 item 4): the index of the fitting offload candidate of `plan` whose predicted
// step (predict_step_seconds with plan.cost, at the failed micro-batch or the candidate's smaller
// one, its offloaded bytes scaled per sample) is cheaper than the step rerun with the micro-batch
// halved and nothing offloaded; -1 when none is (or the plan measured no step time or copy
// bandwidth). With one sample per micro-batch there is no halving left: the first fitting
// offload candidate, whatever the time model says.
int offload_refit_candidate(const StrategyPlan& plan, int64_t batch, int64_t micro_count);

// The out-of-memory fallback to offload (issue 13 item 4), for TrainOptions::refit_on_oom: once
// (later calls return 0), at a step of `step_samples` that ran out of memory in `micro_count`
// micro-batches without offload, plans again at that micro-batch (plan_memory_strategy with the
// plain step and offload in `segment_modes`, `budget`, `options` with what else lives in be's
// allocator now as other_bytes) and, when offload_refit_candidate picks an offload candidate,
// wraps `model` for it (apply_strategy, host memory from cpu_allocator()) and returns the
// micro-batch count to rerun with; else 0 (the caller halves). `model` must be unwrapped, and it
// and `be` must outlive the function. A plan that cannot be made (a shape the planner refuses)
// returns 0 with a log line. Errors: apply_strategy's.
[[nodiscard]] RefitFn offload_refit(Backend& be, Sequential& model, const PlanOptions& options, size_t budget,
                                    const std::vector<std::string>& segment_modes);

// Times real steps (probe_step) at `micro_batch` and about half of it, each after one untimed
// warm-up step (kernel selection, primitive caches), and fits StepCost's line through the two
// (one point: all of it per sample). `model` may be wrapped: `recompute` (checkpointed) takes
// the recomputed forward off the step's time; `offloaded_bytes_per_sample` (offloaded) takes
// the copies off, at `copy_bytes_per_second`, unless `copies_overlap`. Errors: probe_step's
// (kResourceExhausted when a step does not fit).
[[nodiscard]] Result<StepCost> measure_step_cost(Backend& be, Sequential& model, const PlanOptions& options,
                                                 int64_t micro_batch, bool recompute,
                                                 double offloaded_bytes_per_sample, double copy_bytes_per_second,
                                                 bool copies_overlap = false);

// Bytes per second of an upload plus a download of `bytes`, the second of two rounds, on the path
// activation offload copies on: be's copy engine with its host memory where it has one (pinned on
// cuda), else Backend::upload / download with host memory from `host`; device memory from be's
// allocator. Errors: the allocators' and the copies'.
[[nodiscard]] Result<double> measure_copy_bandwidth(Backend& be, Allocator& host, size_t bytes);

// Plans every candidate of `request` on `model`, which must not be wrapped already (it is left
// unwrapped afterwards: apply the choice
// with apply_strategy), measures the step's time when more than one fits, and chooses. Offload
// candidates are planned only on a device backend. `host`: offload's host memory. Errors: the
// planner's; a failed measurement is not an error (the first fitting candidate is chosen, and
// `why` says so).
[[nodiscard]] Result<StrategyPlan> plan_memory_strategy(Backend& be, Sequential& model, const PlanOptions& options,
                                                        const StrategyRequest& request, Allocator& host);

// Wraps `model` for `candidate` (checkpoint_activations or offload_activations with its
// segments; for kCheckpointOffload checkpoint_activations with the first mode, then
// offload_activations with the second over the result; nothing for kNone). Returns the number of
// segments (both kinds). Errors: as wrap_segments (the combination leaves the model unwrapped
// when its offload finds nothing to wrap: "block+stage" on a model without stages), and
// split_combined_segments'.
[[nodiscard]] Result<size_t> apply_strategy(Sequential& model, const StrategyCandidate& candidate, Allocator& host);

}  // namespace slide::train
