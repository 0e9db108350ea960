#include "slide/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <numeric>
#include <random>

namespace slide::train {

namespace {

// Adds a batch's predictions to correct / per-class counts.
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

// A batch through the model and the loss: its labels, the softmax probabilities and the mean loss.
struct Scored {
  Tensor labels, probs;
  double loss = 0;
};

struct Batch {
  Tensor images, labels;
};

Result<Batch> load(Backend& be, const TileDataset& data, const std::vector<size_t>& idx, bool augment, uint64_t seed,
                   slide::core::ThreadPool* pool) {
  Batch b;
  SLIDE_RETURN_IF_ERROR(data.load_batch(idx, augment, seed, pool, be.allocator(), &b.images, &b.labels));
  return b;
}

Result<Scored> score(Backend& be, Layer& model, const Batch& batch, bool training, double label_smoothing,
                     const Tensor& class_weights = Tensor()) {
  Scored out;
  out.labels = batch.labels;
  SLIDE_ASSIGN_OR_RETURN(Tensor logits, model.forward(be, batch.images, training));
  SLIDE_ASSIGN_OR_RETURN(out.probs, Tensor::empty(logits.shape(), logits.dtype(), be.allocator(), "probabilities"));
  SLIDE_RETURN_IF_ERROR(
      be.softmax_cross_entropy_forward(logits, out.labels, class_weights, label_smoothing, out.probs, &out.loss));
  return out;
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
  std::vector<size_t> order = positions;
  std::mt19937_64 rng(epoch_seed);
  std::shuffle(order.begin(), order.end(), rng);
  const size_t classes = data.class_names().size();
  std::vector<int64_t> seen(classes, 0), right(classes, 0);
  EpochStats st;
  int64_t correct = 0;
  double loss_sum = 0;
  // The epoch's micro-batches, from start_step on; sizes within a step differ by at most one.
  struct Micro {
    size_t start, a, b;
    int64_t step_n;
    bool first, last;
  };
  std::vector<Micro> plan;
  int64_t step_index = 0;
  for (size_t start = 0; start < order.size(); start += static_cast<size_t>(options.batch_size), ++step_index) {
    if (step_index < options.start_step) continue;
    const size_t end = std::min(order.size(), start + static_cast<size_t>(options.batch_size));
    const auto step_n = static_cast<int64_t>(end - start);
    const int64_t micro = std::min<int64_t>(options.accumulate, step_n);
    for (int64_t m = 0; m < micro; ++m)
      plan.push_back({start, start + static_cast<size_t>(step_n * m / micro),
                      start + static_cast<size_t>(step_n * (m + 1) / micro), step_n, m == 0, m == micro - 1});
  }
  // A bounded prefetch queue of one micro-batch: the next one is decoded (on the pool) while this
  // one computes. Decoding depends only on (seed, positions), so the order of work changes
  // nothing in the result.
  auto fetch = [&](const Micro& mb) {
    std::vector<size_t> idx(order.begin() + static_cast<long>(mb.a), order.begin() + static_cast<long>(mb.b));
    return load(be, data, idx, options.augment, epoch_seed * 1000003 + mb.start + mb.a, pool);
  };
  std::future<Result<Batch>> next;
  if (!plan.empty()) next = std::async(std::launch::async, fetch, plan[0]);
  for (size_t i = 0; i < plan.size(); ++i) {
    const Micro& mb = plan[i];
    if (mb.first) {
      if (options.cancel != nullptr && options.cancel->load()) {
        st.completed = false;
        break;  // the future in flight is joined when it goes out of scope
      }
      opt.zero_grad();
    }
    SLIDE_ASSIGN_OR_RETURN(Batch batch, next.get());
    if (i + 1 < plan.size()) next = std::async(std::launch::async, fetch, plan[i + 1]);
    SLIDE_ASSIGN_OR_RETURN(Scored sc, score(be, model, batch, true, options.label_smoothing, options.class_weights));
    SLIDE_ASSIGN_OR_RETURN(Tensor dlogits, Tensor::empty(sc.probs.shape(), sc.probs.dtype(), be.allocator(), "logit gradient"));
    SLIDE_RETURN_IF_ERROR(be.softmax_cross_entropy_backward(sc.probs, sc.labels, options.class_weights,
                                                            options.label_smoothing, dlogits));
    // The micro-batch's mean-loss gradient, weighted by its share of the step's samples.
    const float share = static_cast<float>(mb.b - mb.a) / static_cast<float>(mb.step_n);
    for (int64_t j = 0; j < dlogits.numel(); ++j) dlogits.data<float>()[j] *= share;
    SLIDE_RETURN_IF_ERROR(model.backward(be, dlogits).status());
    loss_sum += sc.loss * static_cast<double>(mb.b - mb.a);
    tally(sc.probs, sc.labels, &seen, &right, &correct);
    if (mb.last) {
      SLIDE_RETURN_IF_ERROR(opt.step(be, schedule.at(opt.steps())));
      st.samples += mb.step_n;
      ++st.steps;
    }
  }
  finish(&st, loss_sum, correct, seen, right, t0);
  return st;
}

Result<Tensor> balanced_class_weights(const TileDataset& data, const std::vector<size_t>& positions, Allocator& alloc) {
  const auto k = static_cast<int64_t>(data.class_names().size());
  std::vector<int64_t> count(static_cast<size_t>(k), 0);
  for (size_t p : positions) ++count[static_cast<size_t>(data.tiles().at(p).label)];
  SLIDE_ASSIGN_OR_RETURN(Tensor w, Tensor::zeros({k}, DType::kF32, alloc, "class weights"));
  for (int64_t c = 0; c < k; ++c)
    if (count[static_cast<size_t>(c)] > 0)
      w.data<float>()[c] = static_cast<float>(static_cast<double>(positions.size()) /
                                              (static_cast<double>(k) * static_cast<double>(count[static_cast<size_t>(c)])));
  return w;
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
  if (batch_size < 1) return slide::core::invalid_argument("batch size " + std::to_string(batch_size));
  const auto t0 = std::chrono::steady_clock::now();
  const size_t classes = data.class_names().size();
  std::vector<int64_t> seen(classes, 0), right(classes, 0);
  std::vector<float> all_probs;
  std::vector<int32_t> all_labels;
  EpochStats st;
  int64_t correct = 0;
  double loss_sum = 0;
  for (size_t start = 0; start < positions.size(); start += static_cast<size_t>(batch_size)) {
    const size_t end = std::min(positions.size(), start + static_cast<size_t>(batch_size));
    std::vector<size_t> idx(positions.begin() + static_cast<long>(start), positions.begin() + static_cast<long>(end));
    SLIDE_ASSIGN_OR_RETURN(Batch batch, load(be, data, idx, false, 0, pool));
    SLIDE_ASSIGN_OR_RETURN(Scored sc, score(be, model, batch, false, 0.0));
    loss_sum += sc.loss * static_cast<double>(end - start);
    tally(sc.probs, sc.labels, &seen, &right, &correct);
    all_probs.insert(all_probs.end(), sc.probs.data<float>(), sc.probs.data<float>() + sc.probs.numel());
    all_labels.insert(all_labels.end(), sc.labels.data<int32_t>(), sc.labels.data<int32_t>() + sc.labels.numel());
    st.samples += static_cast<int64_t>(end - start);
    ++st.steps;
  }
  finish(&st, loss_sum, correct, seen, right, t0);
  st.roc_auc = macro_roc_auc(all_probs, all_labels, static_cast<int64_t>(classes));
  if (probs_out != nullptr) *probs_out = std::move(all_probs);
  return st;
}

}  // namespace slide::train
