// The memory planner (DESIGN.md, "Memory: never die of OOM"): the bytes a training step needs for
// a micro-batch size, per layer and in total, before any real memory is touched.
//
// How: the model's own forward and backward run on a planning backend whose tensors are reserved
// address space (mmap'd, never touched, so no page is ever backed) and whose ops do no arithmetic
// but take, for the length of each op, the scratch the `cpu` (oneDNN) backend takes: the reordered
// copies of a convolution's tensors in oneDNN's blocked layouts (channels padded to a multiple
// of 16), the weight-gradient scratch that is then added (+=) into the gradient, pooling's
// recomputed output. So every layer, wrapper (activation checkpointing) and step structure the
// trainer uses is planned by the same code that runs it, and a layer added later needs no planner
// code. The plan is per top-level layer of a Sequential (ResNet: conv1, bn1, relu, maxpool,
// layer1..layer4, avgpool, fc).
//
// What the peak counts, as the trainer's step holds it (trainer.cpp): parameters, batch norm
// buffers, gradients, optimizer state (sgd with momentum: one tensor per parameter; adamw: two),
// the micro-batch's images and labels and the prefetched next micro-batch's, the activations the
// layers save for backward, the logits' probabilities and gradient, and the largest transient
// (outputs and scratch of the op in flight), plus `other_bytes` (the dataset kept in RAM). The
// allocator's cache of freed blocks does not count (it does not count against the budget either).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "slide/train/layers.h"

namespace slide::train {

struct PlanOptions {
  int64_t micro_batch = 1;
  Shape sample_shape;           // one sample, e.g. {3, 224, 224} (images) or {N, D} (a bag)
  DType dtype = DType::kF32;
  int64_t classes = 2;
  std::string optimizer = "sgd";  // "sgd" or "adamw"
  double momentum = 0.9;          // sgd: 0 keeps no momentum buffers
  bool prefetch = true;           // the trainer decodes the next micro-batch during this one
  size_t other_bytes = 0;         // live bytes beside the training state (the dataset in RAM)
  // "cpu": oneDNN's scratch as above; "reference" (or any other): no scratch.
  std::string backend = "cpu";
  // The backend the step will run on, whose per-convolution workspace the plan counts
  // (Backend::conv_workspace_bytes: cuDNN's on cuda) while each convolution pass runs; null: none.
  // slide-train and bench/memory_bench set it. Without it a cuda plan was short by the largest
  // workspace live at the peak (ResNet-50, batch 64, tf32 on an H200: 12 MiB plain, 196 MiB with
  // block checkpointing).
  Backend* workspace_backend = nullptr;
};

// One top-level layer. Bytes are for the plan's micro-batch.
struct LayerPlan {
  std::string name;
  Shape output_shape;
  size_t parameter_bytes = 0;  // weights and buffers (batch norm running statistics)
  size_t gradient_bytes = 0;
  size_t optimizer_bytes = 0;
  size_t saved_bytes = 0;      // activations this layer adds to what is kept for backward
  size_t forward_peak_bytes = 0;   // live bytes at the peak of its forward (the whole step's)
  size_t backward_peak_bytes = 0;  // live bytes at the peak of its backward
};

struct MemoryPlan {
  int64_t micro_batch = 0;
  std::vector<LayerPlan> layers;
  size_t parameter_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;
  size_t input_bytes = 0;      // images + labels of one micro-batch (twice that with prefetch)
  size_t saved_bytes = 0;      // all activations kept at the end of forward
  size_t other_bytes = 0;
  size_t peak_bytes = 0;       // the step's predicted peak of live bytes (everything above);
                               // SIZE_MAX when the backend cannot run this micro-batch at all
                               // (a convolution past cuDNN's tensor limit): it fits no budget
  std::string peak_at;         // where the peak falls: "forward <layer>", "backward <layer>", "loss"
                               // ("nowhere: <why>" for an unrunnable micro-batch)

  // The table: one row per layer (output shape, parameters, gradients, optimizer state, saved
  // activations, peaks in MiB), then the totals and the peak.
  std::string table() const;
};

// Plans one training step of `model` at options.micro_batch. The model's saved state is released
// afterwards; its parameters and buffers are not written; its input gradient is cleared, as
// train_epoch does (Layer::set_input_gradient). Not thread-safe with a concurrent step
// on the same model. Errors: kInvalidArgument (micro_batch < 1, an empty sample shape, an unknown
// optimizer), kFailedPrecondition when the plan's address space cannot be reserved, and the
// layers' own shape errors.
[[nodiscard]] Result<MemoryPlan> plan_memory(Sequential& model, const PlanOptions& options);

// What PlanOptions::other_bytes should say for `model` in `alloc` now: the live bytes beyond its
// training state (parameters, gradients and optimizer state as plan_memory counts them with
// `options`), i.e. a dataset on the device, class weights, ...; 0 when nothing else is live.
// Errors: plan_memory's.
[[nodiscard]] Result<size_t> live_bytes_beside_state(Sequential& model, const PlanOptions& options,
                                                     const Allocator& alloc);

// The largest micro-batch in [1, limit] whose planned peak fits `budget_bytes` (bisection over the
// plan; the peak grows with the micro-batch). 0 when not even 1 fits. Errors: plan_memory's.
[[nodiscard]] Result<int64_t> largest_planned_micro_batch(Sequential& model, PlanOptions options,
                                                          size_t budget_bytes, int64_t limit);

// One real training step at micro-batch `n` under the allocator's budget, as the trainer runs it
// (the images and labels of two micro-batches, forward, loss, backward), on zero images with
// label 0; parameter gradients are zeroed and batch norm's running statistics put back
// afterwards, the saved activations released. Ok when it fits; kResourceExhausted when it does
// not; other errors are the layers'. With `times`, the step is timed (wall clock, the backend
// synchronised at each mark): the forward alone, and forward + loss + backward.
struct ProbeTimes {
  double forward_seconds = 0;
  double step_seconds = 0;
};
[[nodiscard]] Status probe_step(Backend& be, Sequential& model, const PlanOptions& options, int64_t n,
                                ProbeTimes* times = nullptr);

// --batch-size auto: the largest micro-batch in [1, limit] whose real step fits the budget, found
// from the plan (largest_planned_micro_batch) and confirmed by real steps (probe_step): when the
// planned size fits, one size larger is tried, and so on up; when it does not, sizes down. So
// the result fits and one larger does not (or the result is `limit`). `log` (may be empty)
// hears each probe. Errors: kResourceExhausted when not even micro-batch 1 fits; the others of
// the functions above.
struct AutoBatch {
  int64_t micro_batch = 0;
  int64_t planned = 0;        // the plan's answer
  size_t planned_peak_bytes = 0;
  int probes = 0;             // real steps run
};
[[nodiscard]] Result<AutoBatch> auto_micro_batch(Backend& be, Sequential& model, const PlanOptions& options,
                                                 size_t budget_bytes, int64_t limit,
                                                 const std::function<void(int64_t, bool)>& log = {});

// "12.5 MiB"-style text of a byte count (binary units).
std::string format_bytes(size_t bytes);

}  // namespace slide::train
