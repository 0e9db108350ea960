#include "slide/train/trainer.h"

#include "batch_uploader.h"

#include "slide/core/log.h"
#include "slide/train/data_parallel.h"
#include "slide/train/oom_recovery.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <numeric>
#include <random>
#include <tuple>
#include <unordered_map>

namespace slide::train {

namespace {

// Adds a batch's predictions to correct / per-class counts (host tensors: probs[N,C] f32, labels[N]).
void tally(const Tensor& probs, const Tensor& labels, std::vector<int64_t>* seen, std::vector<int64_t>* right,
           int64_t* correct) {
  const int64_t n = probs.dim(0), c = probs.dim(1);
  for (int64_t i = 0; i < n; ++i) {
    const float* p = probs.data<float>() + i * c;
    const int32_t y = labels.data<int32_t>()[i];
    const auto pred = static_cast<int32_t>(std::max_element(p, p + c) - p);
    ++(*seen)[static_cast<size_t>(y)];
    if (pred == y) ++(*right)[static_cast<size_t>(y)], ++*correct;
  }
}

// A batch through the model and the loss: its labels, the softmax probabilities (on the backend's
// device; host_probs a host copy, made by with_host_probs) and the mean loss.
struct Scored {
  Tensor labels, host_labels, probs, host_probs;
  double loss = 0;
};

// Downloads sc's probabilities for the host's tallies (a no-op on a host backend).
Status with_host_probs(Backend& be, Scored* sc) {
  SLIDE_ASSIGN_OR_RETURN(sc->host_probs, to_host(be, sc->probs, "probabilities (host)"));
  return slide::core::ok_status();
}

// images and labels on the backend's device; host_labels the labels in host memory (the same
// tensor on a host backend), for the tallies. `uploaded`: when a BatchUploader copied them (their
// slot is held until the batch goes; ready() before the batch's first op).
struct Batch {
  Tensor images, labels, host_labels;
  BatchUploader::Uploaded uploaded;
  BatchUploader* uploader = nullptr;
  Status ready() const { return uploader != nullptr ? uploader->ready(uploaded) : slide::core::ok_status(); }
};

// Decodes a batch on the host (on `pool`) and, on a device backend, uploads it: one copy per
// micro-batch, made on the prefetch thread while the previous micro-batch computes. With
// `uploader` (training on a device) the batch is decoded into its (pinned) host memory and copied
// on its copy engine, beside the compute; else with Backend::upload. With the dataset cached on
// the device (--cache device), the batch is gathered and augmented there. `zero_labels`
// (predict): every label is written as 0, for tiles that may have none.
Result<Batch> load(Backend& be, const TileDataset& data, const std::vector<size_t>& idx, const Augmentation& augment,
                   uint64_t seed, slide::core::ThreadPool* pool, bool zero_labels = false,
                   BatchUploader* uploader = nullptr) {
  Batch b;
  Tensor host_images;
  if (data.device_cached() && be.device() != Device::kCpu) {
    // --cache device: the tiles are on the device; only the draws (records) and labels go up.
    SLIDE_RETURN_IF_ERROR(data.load_batch_on_device(be, idx, augment, seed, &b.images, &b.host_labels));
  } else {
    // A host backend's tensors are host memory: decoded straight into its allocator.
    Allocator& alloc = be.device() == Device::kCpu ? be.allocator()
                       : uploader != nullptr       ? uploader->host_allocator()
                                                   : cpu_allocator();
    SLIDE_RETURN_IF_ERROR(data.load_batch(idx, augment, seed, pool, alloc, &host_images, &b.host_labels));
  }
  if (zero_labels) std::fill_n(b.host_labels.data<int32_t>(), b.host_labels.numel(), 0);
  if (!b.images.defined() && uploader != nullptr) {
    SLIDE_ASSIGN_OR_RETURN(b.uploaded, uploader->upload(host_images, b.host_labels));
    b.images = b.uploaded.images;
    b.labels = b.uploaded.labels;
    b.uploader = uploader;
    return b;
  }
  // On a host backend to_device returns the tensor itself: images and labels are the host's.
  if (!b.images.defined()) {
    SLIDE_ASSIGN_OR_RETURN(b.images, to_device(be, host_images, "images"));
  }
  SLIDE_ASSIGN_OR_RETURN(b.labels, to_device(be, b.host_labels, "labels"));
  return b;
}

// A BatchUploader for the batches of `data` on be's device: null on a host backend, with the
// dataset cached on the device (--cache device: nothing to copy), or where the backend has no
// second copy engine (load() then uploads with Backend::upload).
std::unique_ptr<BatchUploader> make_batch_uploader(Backend& be, const TileDataset& data) {
  if (be.device() == Device::kCpu || data.device_cached()) return nullptr;
  auto engine = be.new_copy_engine();
  if (!engine) return nullptr;
  return std::make_unique<BatchUploader>(be, std::move(engine));
}

// The loss and probabilities of a batch's logits.
Result<Scored> score_logits(Backend& be, const Tensor& logits, const Batch& batch, double label_smoothing,
                            const Tensor& class_weights = Tensor()) {
  Scored out;
  out.labels = batch.labels;
  out.host_labels = batch.host_labels;
  SLIDE_ASSIGN_OR_RETURN(out.probs, Tensor::empty(logits.shape(), logits.dtype(), be.allocator(), "probabilities"));
  SLIDE_RETURN_IF_ERROR(
      be.softmax_cross_entropy_forward(logits, out.labels, class_weights, label_smoothing, out.probs, &out.loss));
  return out;
}

Result<Scored> score(Backend& be, Layer& model, const Batch& batch, bool training, double label_smoothing,
                     const Tensor& class_weights = Tensor()) {
  SLIDE_ASSIGN_OR_RETURN(Tensor logits, model.forward(be, batch.images, training));
  return score_logits(be, logits, batch, label_smoothing, class_weights);
}

// Fills the means, accuracy, balanced accuracy (mean recall over the classes present) and time.
void finish(EpochStats* st, double loss_sum, int64_t correct, const std::vector<int64_t>& seen,
            const std::vector<int64_t>& right, std::chrono::steady_clock::time_point t0) {
  const double n = static_cast<double>(st->samples);
  st->loss = st->samples ? loss_sum / n : 0;
  st->accuracy = st->samples ? static_cast<double>(correct) / n : 0;
  double sum = 0;
  int present = 0;
  st->recall.assign(seen.size(), -1.0);
  for (size_t k = 0; k < seen.size(); ++k) {
    if (seen[k] == 0) continue;
    st->recall[k] = static_cast<double>(right[k]) / static_cast<double>(seen[k]);
    sum += st->recall[k];
    ++present;
  }
  st->balanced_accuracy = present ? sum / present : 0.0;
  st->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Result<EpochStats> train_epoch(Backend& be, Layer& model, Optimizer& opt, const Schedule& schedule,
                               const TileDataset& data, const std::vector<size_t>& positions,
                               const TrainOptions& options, uint64_t epoch_seed, slide::core::ThreadPool* pool) {
  if (options.batch_size < 1 || options.accumulate < 1 || options.accumulate > options.batch_size)
    return slide::core::invalid_argument("batch size " + std::to_string(options.batch_size) + " with " +
                                         std::to_string(options.accumulate) + " micro-batches");
  const auto t0 = std::chrono::steady_clock::now();
  // The class weights (host, from the caller) on the backend's device, once per epoch.
  SLIDE_ASSIGN_OR_RETURN(const Tensor class_weights, to_device(be, options.class_weights, "class weights"));
  std::vector<size_t> order = positions;
  std::mt19937_64 rng(epoch_seed);
  std::shuffle(order.begin(), order.end(), rng);
  const size_t classes = data.class_names().size();
  std::vector<int64_t> seen(classes, 0), right(classes, 0);
  EpochStats st;
  int64_t correct = 0;
  double loss_sum = 0;
  // The epoch's micro-batches, from start_step on; sizes within a step differ by at most one.
  // step_w: the sum of the class weights of the whole (global) step's labels, sum_n w[y_n] (its
  // sample count without class weights), the same on every rank.
  struct Micro {
    size_t start, a, b;
    int64_t step_n;
    double step_w;
    bool first, last;
  };
  // The class weights on the host (options.class_weights is the caller's host tensor), and
  // sum_n w[y_n] over order[a, b) in index order (the count b - a without weights). A tile without
  // a label never reaches training (TileDataset::labelled).
  std::vector<double> host_weights;
  if (options.class_weights.defined()) {
    if (options.class_weights.device() != Device::kCpu || options.class_weights.dtype() != DType::kF32)
      return slide::core::invalid_argument("class weights: expected an f32 tensor in host memory");
    const float* w = options.class_weights.data<float>();
    host_weights.assign(w, w + options.class_weights.numel());
  }
  auto weight_of = [&](size_t a, size_t b) {
    if (host_weights.empty()) return static_cast<double>(b - a);
    double sum = 0;
    for (size_t i = a; i < b; ++i) {
      const int32_t y = data.tiles()[order[i]].label;
      if (y >= 0 && static_cast<size_t>(y) < host_weights.size()) sum += host_weights[static_cast<size_t>(y)];
    }
    return sum;
  };
  std::vector<Micro> plan;
  // Data-parallel (data_parallel.h): this rank's slice of each step, and the gradient buckets.
  const int rank = options.comm != nullptr ? options.comm->rank() : 0;
  const int world = options.comm != nullptr ? options.comm->world_size() : 1;
  std::unique_ptr<GradientBuckets> buckets;
  if (options.comm != nullptr) {
    std::vector<Parameter*> params;
    std::vector<Buffer*> buffers;
    model.collect("", &params, &buffers);
    SLIDE_ASSIGN_OR_RETURN(buckets, GradientBuckets::make(params, be.allocator(), options.bucket_bytes, &be));
    buckets->record_timeline(static_cast<bool>(options.on_all_reduce_timeline));
  }
  bool stop_all = false;  // data-parallel: some rank asked to stop (all-reduced with the gradients)
  const bool scaling = options.loss_scaler != nullptr && options.loss_scaler->enabled();
  double loss_scale = scaling ? options.loss_scaler->scale() : 1.0;  // the scale of this step
  int64_t step_index = 0;
  for (size_t start = 0; start < order.size(); start += static_cast<size_t>(options.batch_size), ++step_index) {
    if (step_index < options.start_step) continue;
    const size_t end = std::min(order.size(), start + static_cast<size_t>(options.batch_size));
    const auto step_n = static_cast<int64_t>(end - start);
    const ShardRange mine = shard_range(end - start, rank, world);  // all of it on one rank
    const size_t first = start + mine.begin;
    const auto rank_n = static_cast<int64_t>(mine.end - mine.begin);
    // --sync-bn: the same number of micro-batches on every rank, so that their batch norms meet.
    if (options.sync_batch_norm && step_n < world)
      return slide::core::invalid_argument("--sync-bn: step " + std::to_string(step_index) + " of the epoch has " +
                                           std::to_string(step_n) + " samples for " + std::to_string(world) +
                                           " ranks; choose a batch size whose last step has at least one per rank");
    const int64_t micro = std::min<int64_t>(options.accumulate, options.sync_batch_norm ? step_n / world : rank_n);
    const double step_w = weight_of(start, end);
    // A rank with no sample in this step (step_n < ranks) still all-reduces and steps.
    if (micro == 0) plan.push_back({start, first, first, step_n, step_w, true, true});
    for (int64_t m = 0; m < micro; ++m)
      plan.push_back({start, first + static_cast<size_t>(rank_n * m / micro),
                      first + static_cast<size_t>(rank_n * (m + 1) / micro), step_n, step_w, m == 0,
                      m == micro - 1});
  }
  // A bounded prefetch queue of one micro-batch: the next one is decoded (on the pool) while this
  // one computes. Decoding depends only on (seed, positions), so the order of work changes
  // nothing in the result.
  // On a device, the micro-batches are copied on a copy engine of their own, double buffered
  // (batch_uploader.h); declared before the prefetch future so that it outlives every batch.
  const std::unique_ptr<BatchUploader> uploader = make_batch_uploader(be, data);
  auto fetch = [&](const Micro& mb) {
    std::vector<size_t> idx(order.begin() + static_cast<long>(mb.a), order.begin() + static_cast<long>(mb.b));
    // Seeded per step: a sample's augmentation depends on its step and position, not on how the
    // step is split into ranks and micro-batches.
    if (idx.empty()) return Result<Batch>(Batch{});
    return load(be, data, idx, options.augment, epoch_seed * 1000003 + mb.start, pool, false, uploader.get());
  };
  std::future<Result<Batch>> next;
  if (!plan.empty()) next = std::async(std::launch::async, fetch, plan[0]);
  // Out-of-memory recovery (oom_recovery.h): the micro-batches of the step that starts at
  // plan[step_first], and what the step changed, so that it can be rerun split finer.
  // Not with --sync-bn: a rank that re-split its step would meet the others' synchronised batch
  // norms a different number of times; out of memory there is an error, as without recovery.
  StepRecovery recovery(model, options.oom_recovery && !options.sync_batch_norm);
  recovery.set_refit(options.refit_on_oom);
  model.set_input_gradient(false);  // the input is data: no gradient to compute for it
  int64_t micro_count = options.accumulate;
  size_t step_first = 0;
  StepTally tally_at_step;
  // Data-parallel: each gradient bucket's all-reduce starts as soon as backward has finished its
  // gradients, during the step's last micro-batch (GradientBuckets::gradients_ready).
  // A layer's parameters, found once per layer: Layer::collect names the parameters as it goes
  // (relative to the layer it is called on), so the model is collected again at once to put the
  // names it gives back.
  std::unordered_map<const Layer*, std::vector<Parameter*>> layer_params;
  const BackwardHook bucket_hook = [&](Layer& layer) -> Status {
    auto it = layer_params.find(&layer);
    if (it == layer_params.end()) {
      std::vector<Parameter*> own, all;
      std::vector<Buffer*> buffers;
      layer.collect("", &own, &buffers);
      buffers.clear();
      model.collect("", &all, &buffers);
      it = layer_params.emplace(&layer, std::move(own)).first;
    }
    return buckets->gradients_ready(it->second);
  };
  for (size_t i = 0; i < plan.size(); ++i) {
    const Micro& mb = plan[i];
    if (mb.first) {
      if (options.comm != nullptr ? stop_all : options.cancel != nullptr && options.cancel->load()) {
        st.completed = false;
        break;  // the future in flight is joined when it goes out of scope
      }
      SLIDE_RETURN_IF_ERROR(opt.zero_grad());
      step_first = i;
      tally_at_step = {loss_sum, correct, seen, right};
      SLIDE_RETURN_IF_ERROR(recovery.begin_step());
    }
    if (mb.last && buckets != nullptr) {
      options.comm->set_step(opt.steps());
      SLIDE_RETURN_IF_ERROR(buckets->start_step(*options.comm, options.cancel != nullptr && options.cancel->load()));
      if (options.overlap_all_reduce) model.set_backward_hook(&bucket_hook);
    }
    const Status micro_status = [&]() -> Status {
    SLIDE_ASSIGN_OR_RETURN(Batch batch, next.get());
    SLIDE_RETURN_IF_ERROR(batch.ready());  // the ops below run after its copy (on the device)
    if (i + 1 < plan.size()) next = std::async(std::launch::async, fetch, plan[i + 1]);
    if (mb.a != mb.b) {  // else: no sample of this step on this rank
      // Dropout's masks: sample j of this micro-batch gets seed + j, a function of its position in
      // the epoch's order only (the same masks however the step is split).
      model.set_rng_seed(epoch_seed * 1000003 + mb.a);
      SLIDE_ASSIGN_OR_RETURN(Scored sc, score(be, model, batch, true, options.label_smoothing, class_weights));
      if (!std::isfinite(sc.loss))  // diverged (or NaN weights): stop before it reaches the parameters
        return slide::core::out_of_range(
            "step " + std::to_string(mb.start / static_cast<size_t>(options.batch_size)) + " of the epoch (optimizer step " +
            std::to_string(opt.steps() + 1) + "): the loss is " + std::to_string(sc.loss) +
            "; nothing was updated (lower --lr, or check the data and weights)");
      SLIDE_ASSIGN_OR_RETURN(Tensor dlogits, Tensor::empty(sc.probs.shape(), sc.probs.dtype(), be.allocator(), "logit gradient"));
      SLIDE_RETURN_IF_ERROR(be.softmax_cross_entropy_backward(sc.probs, sc.labels, class_weights,
                                                              options.label_smoothing, dlogits));
      // The micro-batch's mean-loss gradient, weighted by its share of the (global) step's samples
      // (llm.c's dloss), on the device. With class weights the loss is a weighted mean
      // (sum_n w[y_n] l_n / sum_n w[y_n], PyTorch's CrossEntropyLoss(weight)), so the share is that
      // of the step's weight, sum over the micro-batch / sum over the step: the micro-batches'
      // gradients then add up to the weighted mean over the whole step, however it is split over
      // ranks and micro-batches (a step whose weights are all 0 has gradient 0, as the op's).
      // The share is rounded to f32 first: a product of two f32 values rounded once is the f32
      // product, so this equals the f32 loop it replaced bit for bit (without weights, both sums
      // are exact integers).
      const double mb_w = weight_of(mb.a, mb.b);
      const float share = mb.step_w > 0 ? static_cast<float>(mb_w) / static_cast<float>(mb.step_w) : 0.0f;
      // Under loss scaling, times the scale. With a power of two (GradScaler's 2^16 and every
      // halving or doubling of it) share * scale is exact and the gradients are exactly scale times
      // the unscaled ones until an operand over- or underflows.
      SLIDE_RETURN_IF_ERROR(be.scale(dlogits, static_cast<double>(share) * loss_scale, dlogits));
      SLIDE_RETURN_IF_ERROR(model.backward(be, dlogits).status());
      // The epoch's loss: the mean over steps of each step's (weighted) mean loss, weighted by the
      // step's samples; without class weights, the mean over samples. Either way independent of
      // the split.
      loss_sum += host_weights.empty() || mb.step_w <= 0
                      ? sc.loss * static_cast<double>(mb.b - mb.a)
                      : sc.loss * mb_w / mb.step_w * static_cast<double>(mb.step_n);
      SLIDE_RETURN_IF_ERROR(with_host_probs(be, &sc));
      tally(sc.host_probs, sc.host_labels, &seen, &right, &correct);
    }
    return slide::core::ok_status();
    }();
    model.set_backward_hook(nullptr);
    if (!micro_status.ok() && buckets != nullptr) {
      // A collective already started cannot be taken back: the step cannot be rerun.
      if (buckets->started_any())
        return micro_status.with_context("the step's gradient all-reduce had started on every rank; it cannot be "
                                         "rerun split finer");
      buckets->cancel_step();
    }
    if (!micro_status.ok()) {
      // Out of memory inside the step: discard its partial work and rerun it whole with the
      // micro-batches halved (twice as many), which gives the same update (trainer.h).
      int64_t step_rank_n = 0;
      for (size_t j = step_first; j < plan.size(); ++j) {
        step_rank_n += static_cast<int64_t>(plan[j].b - plan[j].a);
        if (plan[j].last) break;
      }
      if (next.valid()) (void)next.get();  // the prefetched micro-batch belongs to the old split
      if (uploader != nullptr) SLIDE_RETURN_IF_ERROR(uploader->trim());  // its buffers, for the recovery
      SLIDE_RETURN_IF_ERROR(recovery.recover(micro_status, &micro_count, step_rank_n, be.allocator()));
      SLIDE_RETURN_IF_ERROR(opt.zero_grad());
      std::tie(loss_sum, correct, seen, right) =
          std::tie(tally_at_step.loss_sum, tally_at_step.correct, tally_at_step.seen, tally_at_step.right);
      // Re-split this step and every later one into micro_count micro-batches.
      std::vector<Micro> redo(plan.begin(), plan.begin() + static_cast<long>(step_first));
      for (size_t j = step_first; j < plan.size();) {
        size_t last = j;
        while (!plan[last].last) ++last;
        const size_t first = plan[j].a;
        const auto rank_n = static_cast<int64_t>(plan[last].b - first);
        const int64_t micro = std::min<int64_t>(micro_count, rank_n);
        if (micro == 0) redo.push_back(plan[j]);
        for (int64_t m = 0; m < micro; ++m)
          redo.push_back({plan[j].start, first + static_cast<size_t>(rank_n * m / micro),
                          first + static_cast<size_t>(rank_n * (m + 1) / micro), plan[j].step_n, plan[j].step_w,
                          m == 0, m == micro - 1});
        j = last + 1;
      }
      plan = std::move(redo);
      st.oom_retries += 1;
      next = std::async(std::launch::async, fetch, plan[step_first]);
      i = step_first - 1;  // wraps to SIZE_MAX for the first step; ++i makes it step_first
      continue;
    }
    if (mb.last) {
      if (buckets != nullptr) {
        SLIDE_ASSIGN_OR_RETURN(stop_all, buckets->finish_step());
        if (options.on_all_reduce_timeline) options.on_all_reduce_timeline(opt.steps() + 1, buckets->timeline());
      }
      bool apply = true;
      if (scaling) {
        SLIDE_RETURN_IF_ERROR(opt.scale_gradients(be, options.loss_scaler->inv_scale()));
        SLIDE_ASSIGN_OR_RETURN(const bool finite, opt.gradients_finite(be));
        apply = options.loss_scaler->update(!finite);
        loss_scale = options.loss_scaler->scale();
        if (!apply) ++st.skipped_steps;
      }
      if (apply) SLIDE_RETURN_IF_ERROR(opt.step(be, schedule.at(opt.steps())));
      recovery.end_step(micro_count, static_cast<int64_t>(mb.b - plan[step_first].a));
      st.samples += mb.step_n;
      ++st.steps;
      if (options.on_step) {
        int64_t local = 0;
        for (int64_t n : seen) local += n;
        options.on_step(mb.step_n, local > 0 ? loss_sum / static_cast<double>(local) : 0.0);
      }
    }
  }
  if (options.comm != nullptr) {
    SLIDE_RETURN_IF_ERROR(all_reduce_tallies(*options.comm, &loss_sum, &correct, &seen, &right));
    st.all_reduce_seconds = buckets->seconds();
  }
  st.accumulate = micro_count;
  finish(&st, loss_sum, correct, seen, right, t0);
  return st;
}

Result<Tensor> balanced_weights(const std::vector<int32_t>& labels, int64_t classes, Allocator& alloc) {
  std::vector<int64_t> count(static_cast<size_t>(classes), 0);
  for (int32_t y : labels) ++count.at(static_cast<size_t>(y));
  SLIDE_ASSIGN_OR_RETURN(Tensor w, Tensor::zeros({classes}, DType::kF32, alloc, "class weights"));
  for (int64_t c = 0; c < classes; ++c)
    if (count[static_cast<size_t>(c)] > 0)
      w.data<float>()[c] = static_cast<float>(static_cast<double>(labels.size()) /
                                              (static_cast<double>(classes) * static_cast<double>(count[static_cast<size_t>(c)])));
  return w;
}

Result<Tensor> balanced_class_weights(const TileDataset& data, const std::vector<size_t>& positions, Allocator& alloc) {
  std::vector<int32_t> labels;
  for (size_t p : positions) labels.push_back(data.tiles().at(p).label);
  return balanced_weights(labels, static_cast<int64_t>(data.class_names().size()), alloc);
}

std::vector<int64_t> confusion_matrix(const std::vector<float>& probs, const std::vector<int32_t>& labels,
                                      int64_t classes) {
  const auto c = static_cast<size_t>(std::max<int64_t>(classes, 0));
  std::vector<int64_t> m(c * c, 0);
  for (size_t i = 0; i < labels.size() && (i + 1) * c <= probs.size(); ++i) {
    if (labels[i] < 0 || static_cast<size_t>(labels[i]) >= c) continue;
    const float* p = probs.data() + i * c;
    const auto pred = static_cast<size_t>(std::max_element(p, p + c) - p);
    ++m[static_cast<size_t>(labels[i]) * c + pred];
  }
  return m;
}

double macro_roc_auc(const std::vector<float>& probs, const std::vector<int32_t>& labels, int64_t classes) {
  const size_t n = labels.size();
  double sum = 0;
  int used = 0;
  std::vector<size_t> order(n);
  for (int64_t k = 0; k < classes; ++k) {
    // Ranks of the scores for class k (1-based, ties averaged), then U = R_pos - n_pos (n_pos + 1) / 2.
    std::iota(order.begin(), order.end(), size_t{0});
    auto score = [&](size_t i) { return probs[i * static_cast<size_t>(classes) + static_cast<size_t>(k)]; };
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return score(a) < score(b); });
    double rank_sum_pos = 0;
    int64_t n_pos = 0;
    for (size_t i = 0; i < n;) {
      size_t j = i;
      while (j + 1 < n && score(order[j + 1]) == score(order[i])) ++j;
      const double avg_rank = (static_cast<double>(i) + static_cast<double>(j)) / 2.0 + 1.0;
      for (size_t t = i; t <= j; ++t)
        if (labels[order[t]] == k) rank_sum_pos += avg_rank, ++n_pos;
      i = j + 1;
    }
    const int64_t n_neg = static_cast<int64_t>(n) - n_pos;
    if (n_pos == 0 || n_neg == 0) continue;
    const double u = rank_sum_pos - static_cast<double>(n_pos) * static_cast<double>(n_pos + 1) / 2.0;
    sum += u / (static_cast<double>(n_pos) * static_cast<double>(n_neg));
    ++used;
  }
  return used ? sum / used : -1.0;
}

Result<EpochStats> evaluate(Backend& be, Layer& model, const TileDataset& data, const std::vector<size_t>& positions,
                            int64_t batch_size, slide::core::ThreadPool* pool, std::vector<float>* probs_out) {
  const LogitsFn engine = [&](const Tensor& images) { return model.forward(be, images, false); };
  return evaluate(be, engine, data, positions, batch_size, pool, probs_out);
}

namespace {

// evaluate() and predict(): the batches of `positions` through `logits` and the softmax, in order,
// no augmentation, with out-of-memory halving. `labelled`: the loss and tallies over the tiles'
// labels (evaluate); else every label is taken as 0 for the loss op, whose probabilities do not
// depend on the labels, and the loss and tallies are not kept (predict). On a device the next
// batch is decoded on a prefetch thread while this one computes, and copied on the uploader's
// copy stream as in training; on a host backend the batches are decoded in turn, as before.
Result<EpochStats> score_positions(Backend& be, const LogitsFn& logits, const TileDataset& data,
                                   const std::vector<size_t>& positions, int64_t batch_size,
                                   slide::core::ThreadPool* pool, bool labelled, std::vector<float>* probs_out) {
  if (batch_size < 1) return slide::core::invalid_argument("batch size " + std::to_string(batch_size));
  const auto t0 = std::chrono::steady_clock::now();
  const size_t classes = data.class_names().size();
  std::vector<int64_t> seen(classes, 0), right(classes, 0);
  std::vector<float> all_probs;
  std::vector<int32_t> all_labels;
  EpochStats st;
  int64_t correct = 0;
  double loss_sum = 0;
  const bool on_device = be.device() != Device::kCpu;
  // Before the prefetch future: it outlives every batch.
  const std::unique_ptr<BatchUploader> uploader = make_batch_uploader(be, data);
  auto fetch = [&](size_t a, size_t b) {
    std::vector<size_t> idx(positions.begin() + static_cast<long>(a), positions.begin() + static_cast<long>(b));
    return load(be, data, idx, Augmentation{}, 0, pool, /*zero_labels=*/!labelled, uploader.get());
  };
  std::future<Result<Batch>> next;  // on a device: the batch [next_start, next_end), being loaded
  size_t next_start = 0, next_end = 0;
  for (size_t start = 0, end = 0; start < positions.size(); start = end) {
    end = std::min(positions.size(), start + static_cast<size_t>(batch_size));
    auto batch = [&]() -> Result<Batch> {
      if (next.valid() && next_start == start && next_end == end) return next.get();
      if (next.valid()) (void)next.get();  // loaded for the split before an out-of-memory halving
      return fetch(start, end);
    }();
    if (on_device && end < positions.size()) {
      next_start = end;
      next_end = std::min(positions.size(), end + static_cast<size_t>(batch_size));
      next = std::async(std::launch::async, fetch, next_start, next_end);
    }
    auto scored = [&]() -> Result<Scored> {
      if (!batch.ok()) return batch.status();
      SLIDE_RETURN_IF_ERROR(batch->ready());  // the ops below run after its copy (on the device)
      SLIDE_ASSIGN_OR_RETURN(Tensor z, logits(batch->images));
      if (z.rank() != 2 || z.dim(0) != batch->labels.dim(0) || z.dim(1) != static_cast<int64_t>(classes))
        return slide::core::invalid_argument((labelled ? "evaluate" : "predict") + std::string(": logits of shape ") +
                                             shape_string(z.shape()) + " for " +
                                             std::to_string(batch->labels.dim(0)) + " images and " +
                                             std::to_string(classes) + " classes");
      SLIDE_ASSIGN_OR_RETURN(Scored sc, score_logits(be, z, *batch, 0.0));
      SLIDE_RETURN_IF_ERROR(with_host_probs(be, &sc));
      return sc;
    }();
    if (!scored.ok() && scored.status().code() == slide::core::StatusCode::kResourceExhausted && batch_size > 1) {
      // Inference is per sample: a smaller batch gives the same figures. Retry this batch halved.
      batch_size = (batch_size + 1) / 2;
      ++st.oom_retries;
      slide::core::log_warn("out of memory in evaluation: batch halved",
                            {{"batch_size", batch_size}, {"error", scored.status().to_string()}});
      if (next.valid()) (void)next.get();  // the prefetched batch of the old size
      // The failed batch's slot too: released before the trim, else its buffer of the old size
      // stays (a slot's buffers grow, never shrink) and the halved batches run beside it.
      if (batch.ok()) *batch = Batch{};
      if (uploader != nullptr) SLIDE_RETURN_IF_ERROR(uploader->trim());  // the idle slots' buffers
      be.allocator().trim_cache();
      end = start;
      continue;
    }
    if (!scored.ok()) return scored.status();
    const Scored& sc = *scored;
    all_probs.insert(all_probs.end(), sc.host_probs.data<float>(), sc.host_probs.data<float>() + sc.host_probs.numel());
    if (labelled) {
      loss_sum += sc.loss * static_cast<double>(end - start);
      tally(sc.host_probs, sc.host_labels, &seen, &right, &correct);
      all_labels.insert(all_labels.end(), sc.host_labels.data<int32_t>(),
                        sc.host_labels.data<int32_t>() + sc.host_labels.numel());
    }
    st.samples += static_cast<int64_t>(end - start);
    ++st.steps;
  }
  finish(&st, loss_sum, correct, seen, right, t0);
  if (labelled) {
    st.roc_auc = macro_roc_auc(all_probs, all_labels, static_cast<int64_t>(classes));
    st.confusion = confusion_matrix(all_probs, all_labels, static_cast<int64_t>(classes));
  }
  if (probs_out != nullptr) *probs_out = std::move(all_probs);
  return st;
}

}  // namespace

Result<EpochStats> evaluate(Backend& be, const LogitsFn& logits, const TileDataset& data,
                            const std::vector<size_t>& positions, int64_t batch_size, slide::core::ThreadPool* pool,
                            std::vector<float>* probs_out) {
  for (size_t p : positions)
    if (data.tiles().at(p).label == kNoLabel)
      return slide::core::invalid_argument("evaluate: slide '" + data.slide_ids()[data.tiles()[p].slide] +
                                           "' has no label (predict needs none)");
  return score_positions(be, logits, data, positions, batch_size, pool, true, probs_out);
}

Result<EpochStats> predict(Backend& be, const LogitsFn& logits, const TileDataset& data,
                           const std::vector<size_t>& positions, int64_t batch_size, slide::core::ThreadPool* pool,
                           std::vector<float>* probs) {
  return score_positions(be, logits, data, positions, batch_size, pool, false, probs);
}

}  // namespace slide::train
