// One epoch of mini-batch training, and evaluation, of a classifier over a TileDataset.
//
// A step takes `batch_size` tiles in `accumulate` micro-batches: each micro-batch's loss
// gradient is weighted by its share of the step's samples, parameter gradients accumulate (+=)
// across micro-batches, and the optimizer steps once, so K micro-batches give the update of one
// K-times larger batch (batch norm's statistics, computed per micro-batch, are the known
// exception). The last partial batch of an epoch is used, not dropped.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "slide/core/thread_pool.h"
#include "slide/train/communicator.h"
#include "slide/train/dataset.h"
#include "slide/train/loss_scaler.h"
#include "slide/train/oom_recovery.h"
#include "slide/train/optimizer.h"

namespace slide::train {

class Communicator;

struct EpochStats {
  double loss = 0;        // mean over samples
  double accuracy = 0;    // fraction correct
  double balanced_accuracy = 0;  // mean per-class recall over the classes present
  std::vector<double> recall;     // per class; -1 for a class with no samples
  double roc_auc = -1;            // evaluate only: macro one-vs-rest ROC AUC; -1 when undefined
  std::vector<int64_t> confusion;  // evaluate only: confusion_matrix() of the labelled samples
  int64_t samples = 0;
  int64_t steps = 0;       // steps run by this call
  bool completed = true;   // false: stopped by `cancel` after `steps` steps
  double seconds = 0;
  double all_reduce_seconds = 0;  // data-parallel: wall time in the gradient all-reduce
  int64_t accumulate = 0;   // micro-batches per step at the end (more than asked after OOM recovery)
  int64_t oom_retries = 0;  // steps rerun after running out of memory (evaluate: batches halved)
  int64_t skipped_steps = 0;  // steps skipped by the loss scaler (an inf/NaN gradient under fp16)
};

// One event of a data-parallel step's gradient all-reduce (GradientBuckets::record_timeline), in
// seconds since the step's last micro-batch began.
struct AllReduceEvent {
  enum class Kind { kLayerDone, kBucketStart, kBucketDone, kWaitStart, kStepEnd };
  double t_s = 0;
  Kind kind = Kind::kLayerDone;
  int64_t bucket = -1;  // 0-based, for the bucket events
  std::string name;     // kLayerDone: the layer's first parameter
};

struct TrainOptions {
  int64_t batch_size = 32;
  int64_t accumulate = 1;      // micro-batches per step
  double label_smoothing = 0;
  Augmentation augment = {.flips_rotations = true};  // augment.h; {} for none
  // [classes] f32 in host memory (copied to the backend's device once per epoch), or undefined
  // (all 1). The loss is then each step's weighted mean, sum_n w[y_n] l_n / sum_n w[y_n] over the
  // whole (global) step: a micro-batch's gradient counts by its share of the step's weight, so the
  // update does not depend on the split over ranks and micro-batches.
  Tensor class_weights;
  int64_t start_step = 0;  // resume inside an epoch: skip its first start_step steps (same order)
  const std::atomic<bool>* cancel = nullptr;  // checked after every step
  // Called after every step with the step's (global) sample count and this rank's mean training
  // loss so far in the epoch: progress reporting.
  std::function<void(int64_t samples, double mean_loss)> on_step;
  // Data-parallel ranks (data_parallel.h); nullptr: one rank. Each step's global batch is split
  // over the ranks by shard_range before the micro-batch split; micro-batches are weighted by
  // their share of the global step's samples; gradients are summed over the ranks before the
  // update; the epoch's statistics are reduced over the ranks; a cancel on any rank stops every
  // rank after the same step (at most one step later than on one rank).
  Communicator* comm = nullptr;
  // The model's batch norms are synchronised over `comm` (Layer::set_batch_norm_sync): every rank
  // then runs the same number of micro-batches per step (min(accumulate, step samples / ranks)),
  // and a step with fewer samples than ranks is kInvalidArgument.
  bool sync_batch_norm = false;
  // With comm: the gradient buckets' size (GradientBuckets::make; PyTorch DDP's bucket_cap_mb),
  // and whether each bucket's all-reduce starts as soon as backward has finished its gradients
  // (true: overlapped with the rest of backward) or every bucket after backward (false: for
  // measuring what the overlap hides). Neither changes a number: each element is summed over the
  // same ranks whatever its bucket.
  size_t bucket_bytes = kDefaultBucketBytes;
  bool overlap_all_reduce = true;
  // With comm: called after every step with its optimizer step number (from 1) and the step's
  // all-reduce timeline (GradientBuckets::record_timeline). Null: none recorded.
  std::function<void(int64_t step, const std::vector<AllReduceEvent>& events)> on_all_reduce_timeline;
  // Out of memory (kResourceExhausted) inside a step: the step's partial work is discarded
  // (gradients zeroed, saved activations released, batch norm's running statistics put back,
  // the allocator's cache trimmed), its micro-batches are halved (twice as many, up to one
  // sample each) and it is rerun, with a warning naming the new sizes; later steps keep the finer
  // split (EpochStats::accumulate). The update is the same up to float rounding (see above).
  // false, or with sync_batch_norm (ranks must run the same micro-batches): the error is returned.
  bool oom_recovery = true;
  // Tried on out of memory in a step before its micro-batches are split finer (oom_recovery.h
  // RefitFn; slide-train: the planner's offload fallback). Null: never.
  RefitFn refit_on_oom;
  // Dynamic loss scaling (loss_scaler.h; slide-train --precision fp16), or null / disabled: none.
  // Enabled, the loss gradient is multiplied by scale() before backward (with the micro-batch's
  // share: exact, the scale being a power of two); after the gradients are summed (and
  // all-reduced) they are multiplied by inv_scale() and checked: a step with an inf or NaN
  // gradient is skipped (no parameter or optimizer state changes, the optimizer's step count
  // stays, so the learning-rate schedule follows the applied steps) and the scaler backs off; it
  // still counts in EpochStats::steps (its samples were consumed) and in skipped_steps. Every rank
  // sees the same all-reduced gradients, so every rank skips the same steps. The caller keeps the
  // scaler across epochs and in checkpoints.
  LossScaler* loss_scaler = nullptr;
};

// Trains over `positions` (into data.tiles()) in an order shuffled with `epoch_seed`.
// `schedule` gives the learning rate at the optimizer's step count. Clears the model's input
// gradient (Layer::set_input_gradient): its backward no longer returns dx. Errors: kInvalidArgument
// (batch_size < 1, accumulate < 1 or > batch_size), and those of the data, layers and backend
// (kResourceExhausted when the memory budget is exceeded: the step is not applied), kOutOfRange
// when a micro-batch's loss is not finite (naming the step) or from Optimizer::step (a gradient
// or learning rate that is not finite): that step is not applied.
[[nodiscard]] Result<EpochStats> train_epoch(Backend& be, Layer& model, Optimizer& opt, const Schedule& schedule,
                                             const TileDataset& data, const std::vector<size_t>& positions,
                                             const TrainOptions& options, uint64_t epoch_seed,
                                             slide::core::ThreadPool* pool);

// Inference-mode loss, accuracy, per-class recall and ROC AUC over `positions`, in order, no
// augmentation. With `probs_out`, the softmax probabilities, positions.size() x classes, row-major.
[[nodiscard]] Result<EpochStats> evaluate(Backend& be, Layer& model, const TileDataset& data,
                                          const std::vector<size_t>& positions, int64_t batch_size,
                                          slide::core::ThreadPool* pool, std::vector<float>* probs_out = nullptr);

// Logits of a batch for evaluate(): images [N,3,H,W] f32 (normalised, as TileDataset::load_batch
// gives them) -> logits [N,classes] f32 on the backend's device.
using LogitsFn = std::function<Result<Tensor>(const Tensor& images)>;

// evaluate() with the logits from `logits` instead of the engine's forward (e.g. the fused
// inference path of embed.h, FeatureExtractor::logits): the same loading, loss, metrics,
// out-of-memory halving and `probs_out`. Errors: kInvalidArgument (batch_size < 1, logits that
// are not [N,classes], a tile without a label), and those of the data, `logits` and the backend.
[[nodiscard]] Result<EpochStats> evaluate(Backend& be, const LogitsFn& logits, const TileDataset& data,
                                          const std::vector<size_t>& positions, int64_t batch_size,
                                          slide::core::ThreadPool* pool, std::vector<float>* probs_out = nullptr);

// The softmax probabilities of `logits` over `positions`, in order, no augmentation: evaluate()'s
// loading, batching and out-of-memory halving, so the same batch size gives bit-identical
// probabilities, but no labels are needed (tiles without one, TileDataset kNoLabel, are allowed).
// `probs`: positions.size() x classes, row-major. The returned stats carry samples, steps and
// seconds only. Errors: those of evaluate() save labels.
[[nodiscard]] Result<EpochStats> predict(Backend& be, const LogitsFn& logits, const TileDataset& data,
                                         const std::vector<size_t>& positions, int64_t batch_size,
                                         slide::core::ThreadPool* pool, std::vector<float>* probs);

// sklearn's class_weight="balanced" (sklearn.utils.class_weight.compute_class_weight): for labels
// in [0, classes), n / (classes x n_c) for each class c present, 0 for a class with none; a
// [classes] f32 tensor from `alloc`. Errors: the allocator's.
[[nodiscard]] Result<Tensor> balanced_weights(const std::vector<int32_t>& labels, int64_t classes, Allocator& alloc);

// balanced_weights over the labels of the tiles at `positions`.
[[nodiscard]] Result<Tensor> balanced_class_weights(const TileDataset& data, const std::vector<size_t>& positions,
                                                    Allocator& alloc);

// Macro-averaged one-vs-rest ROC AUC (sklearn's roc_auc_score(multi_class="ovr", average="macro")):
// per class, the probability that a random positive scores above a random negative (ties count
// half: the Mann-Whitney U statistic), averaged over the classes that have both positives and
// negatives; -1 when none has. probs: n x classes row-major; labels: n.
double macro_roc_auc(const std::vector<float>& probs, const std::vector<int32_t>& labels, int64_t classes);

// The confusion matrix (sklearn.metrics.confusion_matrix): classes x classes counts, row-major,
// row = the true class, column = the predicted one (the argmax of a row of probs, the first on
// ties, as the accuracy counts it). probs: n x classes row-major; labels: n, each in
// [0, classes) (others are skipped).
std::vector<int64_t> confusion_matrix(const std::vector<float>& probs, const std::vector<int32_t>& labels,
                                      int64_t classes);

}  // namespace slide::train
