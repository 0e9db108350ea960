// ABMIL, the bag dataset and the MIL loops (mil.h). The attention file is written with HDF5's C
// API here (the bag format's own writer, slide/cache/bag.h, holds features, not attention).
#include "slide/train/mil.h"

#include <hdf5.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <future>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "slide/cache/bag.h"
#include "slide/core/file.h"
#include "slide/tile/figure.h"
#include "slide/tile/image.h"
#include "slide/train/dataset.h"
#include "slide/train/heatmap.h"
#include "h5_util.h"

namespace slide::train {

namespace {

namespace fs = std::filesystem;
using slide::core::failed_precondition;
using slide::core::invalid_argument;
using slide::core::ok_status;

// splitmix64's output function (Steele, Lea and Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014): nearby inputs to far-apart outputs.
uint64_t mix_seed(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

Result<Tensor> new_tensor(Backend& be, const Shape& s, DType dt, const char* what) {
  return Tensor::empty(s, dt, be.allocator(), what);
}

// Where host code writes what `be` then reads: be's own memory on a host backend, else the host's
// (uploaded by on_backend).
Allocator& host_allocator(Backend& be) { return be.device() == Device::kCpu ? be.allocator() : cpu_allocator(); }
// A host tensor as `be` takes it: itself on a host backend, else a copy on the device.
Result<Tensor> on_backend(Backend& be, Tensor host, const std::string& what) {
  if (be.device() == Device::kCpu) return host;
  return to_device(be, host, what);
}
// A tensor of `be` as host code reads it: itself on a host backend, else a host copy.
Result<Tensor> on_host(Backend& be, const Tensor& t, const std::string& what) {
  if (t.device() == Device::kCpu) return t;
  return to_host(be, t, what);
}

}  // namespace

// --- Abmil -----------------------------------------------------------------------------------------

Result<std::unique_ptr<Abmil>> Abmil::make(Allocator& alloc, DType dtype, const AbmilConfig& config, uint64_t seed) {
  if (config.in_features < 1 || config.hidden < 1 || config.attention < 1 || config.classes < 2)
    return invalid_argument("ABMIL: feature, hidden and attention sizes must be positive and classes at least 2");
  auto m = std::unique_ptr<Abmil>(new Abmil());
  if (!(config.dropout >= 0 && config.dropout < 1))
    return invalid_argument("ABMIL: dropout " + std::to_string(config.dropout) + " is not in [0, 1)");
  m->config_ = config;
  m->dropout_ = Dropout(config.dropout);
  InitRng rng(seed);
  SLIDE_ASSIGN_OR_RETURN(m->fc_, Linear::make(alloc, dtype, config.in_features, config.hidden, rng));
  SLIDE_ASSIGN_OR_RETURN(m->attention_a_, Linear::make(alloc, dtype, config.hidden, config.attention, rng));
  SLIDE_ASSIGN_OR_RETURN(m->attention_b_, Linear::make(alloc, dtype, config.hidden, config.attention, rng));
  SLIDE_ASSIGN_OR_RETURN(m->attention_c_, Linear::make(alloc, dtype, config.attention, 1, rng));
  SLIDE_ASSIGN_OR_RETURN(m->classifier_, Linear::make(alloc, dtype, config.hidden, config.classes, rng));
  return m;
}

Result<Tensor> Abmil::forward(Backend& be, const Tensor& x, bool training) {
  if (x.rank() != 2 || x.dim(0) < 1 || x.dim(1) != config_.in_features)
    return invalid_argument("ABMIL: a bag must be [N >= 1, " + std::to_string(config_.in_features) + "], is " +
                            shape_string(x.shape()));
  const int64_t N = x.dim(0), L = config_.hidden, A = config_.attention;
  const DType dt = x.dtype();
  SLIDE_ASSIGN_OR_RETURN(Tensor r, new_tensor(be, {N, L}, dt, "ABMIL hidden"));
  SLIDE_RETURN_IF_ERROR(be.linear_forward(x, fc_->weight.value, fc_->bias.value, r));
  SLIDE_RETURN_IF_ERROR(be.relu_forward(r, r));
  SLIDE_ASSIGN_OR_RETURN(Tensor h, dropout_.forward(be, r, training));
  SLIDE_ASSIGN_OR_RETURN(Tensor t, attention_a_->forward(be, h, training));
  SLIDE_RETURN_IF_ERROR(be.tanh_forward(t, t));
  SLIDE_ASSIGN_OR_RETURN(Tensor s, attention_b_->forward(be, h, training));
  SLIDE_RETURN_IF_ERROR(be.sigmoid_forward(s, s));
  SLIDE_ASSIGN_OR_RETURN(Tensor g, new_tensor(be, {N, A}, dt, "ABMIL gated attention"));
  SLIDE_RETURN_IF_ERROR(be.mul(t, s, g));
  SLIDE_ASSIGN_OR_RETURN(Tensor e, attention_c_->forward(be, g, training));  // [N, 1]
  SLIDE_ASSIGN_OR_RETURN(Tensor scores, e.reshape({1, N}));
  SLIDE_ASSIGN_OR_RETURN(Tensor a, new_tensor(be, {1, N}, dt, "ABMIL attention"));
  SLIDE_RETURN_IF_ERROR(be.softmax_forward(scores, a));
  SLIDE_ASSIGN_OR_RETURN(Tensor z, new_tensor(be, {1, L}, dt, "ABMIL slide embedding"));
  SLIDE_RETURN_IF_ERROR(be.matmul(a, false, h, false, z));
  SLIDE_ASSIGN_OR_RETURN(Tensor logits, classifier_->forward(be, z, training));
  a_ = a;
  if (training) {
    x_ = x, r_ = r, h_ = h, t_ = t, s_ = s;
  } else {
    x_ = r_ = h_ = t_ = s_ = Tensor();
  }
  return logits;
}

Result<Tensor> Abmil::backward(Backend& be, const Tensor& dlogits) {
  if (!h_.defined()) return failed_precondition("ABMIL: backward without a training forward");
  const int64_t N = h_.dim(0), L = config_.hidden;
  const DType dt = h_.dtype();
  SLIDE_ASSIGN_OR_RETURN(Tensor dz, classifier_->backward(be, dlogits));  // [1, L]
  // z = a h: da = dz h^T, dh = a^T dz (the pooling's share of dh).
  SLIDE_ASSIGN_OR_RETURN(Tensor da, new_tensor(be, {1, N}, dt, "ABMIL attention gradient"));
  SLIDE_RETURN_IF_ERROR(be.matmul(dz, false, h_, true, da));
  SLIDE_ASSIGN_OR_RETURN(Tensor dh, new_tensor(be, {N, L}, dt, "ABMIL hidden gradient"));
  SLIDE_RETURN_IF_ERROR(be.matmul(a_, true, dz, false, dh));
  SLIDE_ASSIGN_OR_RETURN(Tensor de, new_tensor(be, {1, N}, dt, "ABMIL score gradient"));
  SLIDE_RETURN_IF_ERROR(be.softmax_backward(a_, da, de));
  SLIDE_ASSIGN_OR_RETURN(Tensor de_col, de.reshape({N, 1}));
  SLIDE_ASSIGN_OR_RETURN(Tensor dg, attention_c_->backward(be, de_col));  // [N, A]
  // g = t * s: dt = dg * s, ds = dg * t; then through tanh and sigmoid (from their outputs).
  SLIDE_ASSIGN_OR_RETURN(Tensor dt_, new_tensor(be, dg.shape(), dt, "ABMIL tanh gradient"));
  SLIDE_ASSIGN_OR_RETURN(Tensor ds, new_tensor(be, dg.shape(), dt, "ABMIL sigmoid gradient"));
  SLIDE_RETURN_IF_ERROR(be.mul(dg, s_, dt_));
  SLIDE_RETURN_IF_ERROR(be.mul(dg, t_, ds));
  SLIDE_RETURN_IF_ERROR(be.tanh_backward(t_, dt_, dg));   // dg now holds d(pre-tanh)
  SLIDE_RETURN_IF_ERROR(be.sigmoid_backward(s_, ds, dt_));  // dt_ now holds d(pre-sigmoid)
  SLIDE_ASSIGN_OR_RETURN(Tensor dh_a, attention_a_->backward(be, dg));
  SLIDE_ASSIGN_OR_RETURN(Tensor dh_b, attention_b_->backward(be, dt_));
  SLIDE_RETURN_IF_ERROR(be.add(dh, dh_a, dh));
  SLIDE_RETURN_IF_ERROR(be.add(dh, dh_b, dh));
  SLIDE_ASSIGN_OR_RETURN(Tensor dr, dropout_.backward(be, dh));
  SLIDE_ASSIGN_OR_RETURN(Tensor dpre, new_tensor(be, {N, L}, dt, "ABMIL fc gradient"));
  SLIDE_RETURN_IF_ERROR(be.relu_backward(r_, dr, dpre));
  SLIDE_RETURN_IF_ERROR(be.linear_backward_weights(x_, dpre, fc_->weight.grad, fc_->bias.grad));
  if (!config_.input_gradient) return Tensor();
  SLIDE_ASSIGN_OR_RETURN(Tensor dx, new_tensor(be, x_.shape(), dt, "ABMIL input gradient"));
  SLIDE_RETURN_IF_ERROR(be.linear_backward_data(dpre, fc_->weight.value, dx));
  return dx;
}

void Abmil::collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) {
  auto p = [&](const char* name) { return prefix.empty() ? std::string(name) : prefix + "." + name; };
  fc_->collect(p("attention_net.0"), params, buffers);
  attention_a_->collect(p("attention_net.3.attention_a.0"), params, buffers);
  attention_b_->collect(p("attention_net.3.attention_b.0"), params, buffers);
  attention_c_->collect(p("attention_net.3.attention_c"), params, buffers);
  classifier_->collect(p("classifiers"), params, buffers);
}

void Abmil::release() {
  x_ = r_ = h_ = t_ = s_ = Tensor();
  dropout_.release();
  for (Linear* l : {fc_.get(), attention_a_.get(), attention_b_.get(), attention_c_.get(), classifier_.get()})
    l->release();
}

// --- BagDataset -----------------------------------------------------------------------------------

std::string BagEncoder::describe() const {
  std::string s = (model.empty() ? "an unnamed model" : model) + (layer.empty() ? "" : " " + layer);
  if (!weights_sha256.empty()) s += ", weights sha256 " + weights_sha256.substr(0, 12) + "...";
  return s;
}

Result<std::unique_ptr<BagDataset>> BagDataset::open(const std::vector<std::string>& dirs,
                                                     const std::string& labels_csv,
                                                     const std::vector<std::string>& class_names,
                                                     bool allow_unlabelled) {
  if (dirs.empty()) return invalid_argument("no bag directories given");
  std::map<std::string, SlideLabelRow> csv;
  if (!labels_csv.empty()) {
    SLIDE_ASSIGN_OR_RETURN(csv, read_slide_labels_csv(labels_csv));
  }
  struct Found {
    std::string path, slide_id, label;
    int64_t tiles, dim;
    BagEncoder encoder;  // left unknown for a manifest's bags but its first
  };
  auto encoder_of = [](const slide::cache::BagAttributes& a) {
    return BagEncoder{a.model, a.layer, a.weights_sha256};
  };
  std::vector<Found> found;
  for (const std::string& dir : dirs) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) return slide::core::not_found("bag directory " + dir + " does not exist");
    const std::string manifest = dir + "/" + slide::cache::kManifestName;
    if (fs::exists(manifest, ec)) {
      SLIDE_ASSIGN_OR_RETURN(auto entries, slide::cache::read_manifest(manifest));
      for (auto& e : entries) found.push_back({e.path, e.slide_id, e.label, e.num_tiles, e.feature_dim, {}});
      if (!entries.empty()) {
        SLIDE_ASSIGN_OR_RETURN(auto first, slide::cache::BagReader::open(entries.front().path));
        found[found.size() - entries.size()].encoder = encoder_of(first->info().attributes);
      }
    } else {
      SLIDE_ASSIGN_OR_RETURN(auto infos, slide::cache::list_bags(dir));
      for (auto& i : infos)
        found.push_back({i.path, i.attributes.slide_id.empty() ? fs::path(i.path).stem().string() : i.attributes.slide_id,
                         i.attributes.label, i.num_tiles, i.feature_dim, encoder_of(i.attributes)});
    }
  }
  if (found.empty()) return invalid_argument("no bags (*.h5) in the bag directories given");
  auto ds = std::unique_ptr<BagDataset>(new BagDataset());
  std::set<std::string> names, seen_ids;
  std::string encoder_bag;  // the bag whose encoder ds->encoder_ is
  for (Found& f : found) {
    if (!csv.empty()) {
      auto it = csv.find(f.slide_id);
      if (it != csv.end()) f.label = it->second.label;
      else if (allow_unlabelled) f.label.clear();
      else return invalid_argument(labels_csv + ": no row for slide '" + f.slide_id + "' (" + f.path + ")");
    }
    if (f.label.empty() && !allow_unlabelled)
      return invalid_argument("bag " + f.path + " (slide '" + f.slide_id +
                              "') has no label: give --labels CSV with slide_id,label columns");
    if (!seen_ids.insert(f.slide_id).second)
      return invalid_argument("slide '" + f.slide_id + "' has two bags (" + f.path + ")");
    if (f.tiles < 1) return invalid_argument("bag " + f.path + " has no tiles");
    if (ds->feature_dim_ == 0) ds->feature_dim_ = f.dim;
    if (f.dim != ds->feature_dim_)
      return invalid_argument("bag " + f.path + " has " + std::to_string(f.dim) + " features per tile, " +
                              found.front().path + " has " + std::to_string(ds->feature_dim_));
    if (f.encoder.known()) {
      if (!ds->encoder_.known()) {
        ds->encoder_ = f.encoder;
        encoder_bag = f.path;
      } else if (!(f.encoder == ds->encoder_)) {
        return invalid_argument("bag " + f.path + " holds features of " + f.encoder.describe() + ", bag " +
                                encoder_bag + " of " + ds->encoder_.describe() +
                                ": one model needs one encoder's features (embed every slide with the same "
                                "--model, --layer and --weights)");
      }
    }
    if (!f.label.empty()) names.insert(f.label);
  }
  if (allow_unlabelled && class_names.empty())
    return invalid_argument("bags without labels need the model's classes");
  if (class_names.empty()) {
    ds->class_names_.assign(names.begin(), names.end());
    if (ds->class_names_.size() < 2)
      return invalid_argument("the bags hold fewer than two classes (" + std::to_string(ds->class_names_.size()) + ")");
  } else {
    ds->class_names_ = class_names;
    for (const Found& f : found)
      if (!f.label.empty() && std::find(class_names.begin(), class_names.end(), f.label) == class_names.end())
        return invalid_argument("bag " + f.path + ": label '" + f.label + "' is not one of the model's " +
                                std::to_string(class_names.size()) + " classes");
  }
  std::map<std::string, uint32_t> patient_index;
  for (Found& f : found) {
    BagRef b;
    b.path = f.path;
    b.slide_id = f.slide_id;
    b.label = f.label.empty() ? kNoLabel
                              : static_cast<int32_t>(std::find(ds->class_names_.begin(), ds->class_names_.end(), f.label) -
                                                     ds->class_names_.begin());
    b.tiles = f.tiles;
    auto it = csv.find(f.slide_id);
    const std::string group = it != csv.end() && !it->second.patient.empty() ? "patient:" + it->second.patient
                                                                              : "slide:" + f.slide_id;
    b.group = patient_index.emplace(group, static_cast<uint32_t>(patient_index.size())).first->second;
    ds->bags_.push_back(std::move(b));
  }
  return ds;
}

bool BagDataset::labelled() const {
  return std::none_of(bags_.begin(), bags_.end(), [](const BagRef& b) { return b.label == kNoLabel; });
}

size_t BagDataset::feature_bytes() const {
  size_t n = 0;
  for (const BagRef& b : bags_) n += static_cast<size_t>(b.tiles) * static_cast<size_t>(feature_dim_) * sizeof(float);
  return n;
}

int64_t BagDataset::max_tiles() const {
  int64_t m = 0;
  for (const BagRef& b : bags_) m = std::max(m, b.tiles);
  return m;
}

void BagDataset::split(double val_fraction, uint64_t seed, std::vector<size_t>* train, std::vector<size_t>* val,
                       bool stratify) const {
  uint32_t groups = 0;
  std::vector<uint32_t> bag_group;
  std::vector<int32_t> labels;
  for (const BagRef& b : bags_) {
    groups = std::max(groups, b.group + 1);
    bag_group.push_back(b.group), labels.push_back(b.label);
  }
  const std::vector<bool> is_val = stratify
                                       ? split_groups_stratified(group_classes(bag_group, labels, groups), val_fraction, seed)
                                       : split_groups(groups, val_fraction, seed);
  train->clear();
  val->clear();
  for (size_t i = 0; i < bags_.size(); ++i) (is_val[bags_[i].group] ? val : train)->push_back(i);
}

Status BagDataset::cache_in_ram(Allocator& alloc) {
  std::vector<Tensor> cache;
  for (size_t i = 0; i < bags_.size(); ++i) {
    SLIDE_ASSIGN_OR_RETURN(Tensor t, load(i, alloc));
    cache.push_back(std::move(t));
  }
  cache_ = std::move(cache);
  return ok_status();
}

Result<Tensor> BagDataset::load(size_t position, Allocator& alloc) const {
  if (!cache_.empty()) return cache_.at(position);
  const BagRef& b = bags_.at(position);
  SLIDE_ASSIGN_OR_RETURN(auto reader, slide::cache::BagReader::open(b.path));
  if (reader->num_tiles() != b.tiles || reader->feature_dim() != feature_dim_)
    return slide::core::data_loss("bag " + b.path + " holds " + std::to_string(reader->num_tiles()) + " x " +
                                  std::to_string(reader->feature_dim()) + " features but was listed with " +
                                  std::to_string(b.tiles) + " x " + std::to_string(feature_dim_) +
                                  " (its directory's bags.csv, or its first read): it changed since, or bags.csv is "
                                  "stale; rerun slide-embed on its store");
  SLIDE_ASSIGN_OR_RETURN(Tensor t, Tensor::empty({b.tiles, feature_dim_}, DType::kF32, alloc, "bag " + b.slide_id));
  SLIDE_RETURN_IF_ERROR(reader->read_features(0, b.tiles, std::span<float>(t.data<float>(), static_cast<size_t>(t.numel()))));
  return t;
}

Result<std::vector<int32_t>> BagDataset::coords(size_t position) const {
  const BagRef& b = bags_.at(position);
  SLIDE_ASSIGN_OR_RETURN(auto reader, slide::cache::BagReader::open(b.path));
  std::vector<int32_t> out(static_cast<size_t>(reader->num_tiles()) * 2);
  SLIDE_RETURN_IF_ERROR(reader->read_coords(0, reader->num_tiles(), out));
  return out;
}

// --- Training and evaluation -------------------------------------------------------------------

namespace {

// Bags read ahead of the one in compute, at most `depth` in flight: memory holds depth + 1 bags
// whatever the dataset's size. Reading depends only on the position, so prefetching changes no
// result. Bags are read into host memory; on a device backend get() uploads the one asked for.
class BagPrefetcher {
 public:
  BagPrefetcher(const BagDataset& data, const std::vector<size_t>& order, int depth, Backend& be)
      : data_(data), order_(order), depth_(static_cast<size_t>(std::max(depth, 0))), be_(be) {}
  // The bag at order[i], on the backend; calls must come with i = 0, 1, 2, ... (skipping ahead is
  // allowed).
  Result<Tensor> get(size_t i) {
    SLIDE_ASSIGN_OR_RETURN(Tensor host, get_host(i));
    return on_backend(be_, std::move(host), "bag");
  }

 private:
  Result<Tensor> get_host(size_t i) {
    while (!queue_.empty() && queue_.front().first < i) queue_.pop_front();
    if (queue_.empty() || queue_.front().first != i) {
      queue_.clear();
      next_ = i;
      if (depth_ == 0) {
        next_ = i + 1;
        return data_.load(order_[i], host_allocator(be_));
      }
    }
    while (queue_.size() <= depth_ && next_ < order_.size()) {
      const size_t pos = order_[next_];
      queue_.emplace_back(next_++, std::async(std::launch::async,
                                              [this, pos] { return data_.load(pos, host_allocator(be_)); }));
    }
    Result<Tensor> r = queue_.front().second.get();
    queue_.pop_front();
    return r;
  }

  const BagDataset& data_;
  const std::vector<size_t>& order_;
  size_t depth_;
  Backend& be_;
  size_t next_ = 0;
  std::deque<std::pair<size_t, std::future<Result<Tensor>>>> queue_;
};

struct Tally {
  double loss_sum = 0;
  int64_t n = 0, correct = 0;
  std::vector<int64_t> seen, right;
  void add(const Tensor& probs, int32_t y, double loss) {
    const int64_t c = probs.dim(1);
    const float* p = probs.data<float>();
    const auto pred = static_cast<int32_t>(std::max_element(p, p + c) - p);
    if (seen.empty()) seen.assign(static_cast<size_t>(c), 0), right.assign(static_cast<size_t>(c), 0);
    ++seen[static_cast<size_t>(y)];
    if (pred == y) ++right[static_cast<size_t>(y)], ++correct;
    loss_sum += loss;
    ++n;
  }
  void finish(EpochStats* st, std::chrono::steady_clock::time_point t0) const {
    st->samples = n;
    st->loss = n ? loss_sum / static_cast<double>(n) : 0;
    st->accuracy = n ? static_cast<double>(correct) / static_cast<double>(n) : 0;
    st->recall.assign(seen.size(), -1.0);
    double sum = 0;
    int present = 0;
    for (size_t c = 0; c < seen.size(); ++c)
      if (seen[c] > 0) {
        st->recall[c] = static_cast<double>(right[c]) / static_cast<double>(seen[c]);
        sum += st->recall[c];
        ++present;
      }
    st->balanced_accuracy = present ? sum / present : 0;
    st->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

// One bag's logits, probabilities [1, C] and loss (unweighted: a batch of one).
struct BagScore {
  Tensor probs, label;
  double loss = 0;
};

Result<BagScore> score_bag(Backend& be, Abmil& model, const Tensor& x, int32_t label, bool training,
                           double label_smoothing) {
  BagScore out;
  SLIDE_ASSIGN_OR_RETURN(Tensor logits, model.forward(be, x, training));
  SLIDE_ASSIGN_OR_RETURN(Tensor host_label, Tensor::empty({1}, DType::kI32, host_allocator(be), "bag label"));
  host_label.data<int32_t>()[0] = label;
  SLIDE_ASSIGN_OR_RETURN(out.label, on_backend(be, std::move(host_label), "bag label"));
  SLIDE_ASSIGN_OR_RETURN(out.probs, Tensor::empty(logits.shape(), logits.dtype(), be.allocator(), "bag probabilities"));
  SLIDE_RETURN_IF_ERROR(be.softmax_cross_entropy_forward(logits, out.label, Tensor(), label_smoothing, out.probs, &out.loss));
  return out;
}

}  // namespace

Result<EpochStats> train_mil_epoch(Backend& be, Abmil& model, Optimizer& opt, const Schedule& schedule,
                                   const BagDataset& data, const std::vector<size_t>& positions,
                                   const MilTrainOptions& options, uint64_t epoch_seed) {
  if (options.batch_size < 1) return invalid_argument("batch size must be at least 1 bag");
  if (options.prefetch < 0) return invalid_argument("prefetch must be >= 0");
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<size_t> order = positions;
  std::mt19937_64 rng(epoch_seed);
  std::shuffle(order.begin(), order.end(), rng);
  const float* cw = options.class_weights.defined() ? options.class_weights.data<float>() : nullptr;
  auto weight_of = [&](size_t pos) { return cw ? double(cw[data.bags()[pos].label]) : 1.0; };
  EpochStats st;
  Tally tally;
  const auto B = static_cast<size_t>(options.batch_size);
  const size_t first = std::min(order.size(), static_cast<size_t>(options.start_step) * B);
  BagPrefetcher prefetch(data, order, options.prefetch, be);
  Tensor weights;  // the class weights where the backend reads them
  if (options.class_weights.defined()) {
    SLIDE_ASSIGN_OR_RETURN(Tensor host, Tensor::empty(options.class_weights.shape(), DType::kF32,
                                                      host_allocator(be), "class weights"));
    std::copy_n(options.class_weights.data<float>(), options.class_weights.numel(), host.data<float>());
    SLIDE_ASSIGN_OR_RETURN(weights, on_backend(be, std::move(host), "class weights"));
  }
  for (size_t start = first; start < order.size(); start += B) {
    if (options.cancel != nullptr && options.cancel->load()) {
      st.completed = false;
      break;
    }
    const size_t end = std::min(order.size(), start + B);
    double weight_sum = 0;
    for (size_t i = start; i < end; ++i) weight_sum += weight_of(order[i]);
    SLIDE_RETURN_IF_ERROR(opt.zero_grad());
    for (size_t i = start; i < end; ++i) {
      const BagRef& bag = data.bags()[order[i]];
      SLIDE_ASSIGN_OR_RETURN_CTX(Tensor x, prefetch.get(i), "bag " + bag.path);
      // Dropout: a function of the bag's place in the order. Dropout draws row r's mask from
      // seed + r (layers.h), and a bag's rows are its tiles: consecutive seeds would give bag i + 1
      // bag i's masks shifted by one tile, so each bag's seed is hashed apart (splitmix64's finaliser).
      model.set_rng_seed(mix_seed(epoch_seed * 1000003 + i));
      SLIDE_ASSIGN_OR_RETURN(BagScore sc, score_bag(be, model, x, bag.label, true, options.label_smoothing));
      if (!std::isfinite(sc.loss))  // diverged: stop before it reaches the parameters
        return slide::core::out_of_range("step " + std::to_string(start / B) + " of the epoch (optimizer step " +
                                         std::to_string(opt.steps() + 1) + "), bag " + bag.path + ": the loss is " +
                                         std::to_string(sc.loss) + "; nothing was updated (lower --lr)");
      SLIDE_ASSIGN_OR_RETURN(Tensor dlogits, Tensor::empty(sc.probs.shape(), sc.probs.dtype(), be.allocator(), "logit gradient"));
      // With class weights, the op's gradient of this one bag is ((sum_c t_c) p - t) / w[y], t the
      // weighted smoothed target (formulas.h), and the share below makes it ... / W: PyTorch's. (A
      // bag of a class weighted 0 contributes nothing, where PyTorch's smoothing term would.)
      SLIDE_RETURN_IF_ERROR(
          be.softmax_cross_entropy_backward(sc.probs, sc.label, weights, options.label_smoothing, dlogits));
      // This bag's share of the step's weighted mean loss (PyTorch's weighted CrossEntropyLoss).
      const double share = weight_sum > 0 ? weight_of(order[i]) / weight_sum : 0.0;
      // On the backend (llm.c's dloss); the share rounded to f32 first, as the f32 loop it replaced.
      SLIDE_RETURN_IF_ERROR(be.scale(dlogits, static_cast<double>(static_cast<float>(share)), dlogits));
      SLIDE_RETURN_IF_ERROR(model.backward(be, dlogits).status());
      model.release();
      SLIDE_ASSIGN_OR_RETURN(const Tensor probs, on_host(be, sc.probs, "bag probabilities"));
      tally.add(probs, bag.label, sc.loss);
    }
    SLIDE_RETURN_IF_ERROR(opt.step(be, schedule.at(opt.steps())));
    ++st.steps;
  }
  tally.finish(&st, t0);
  return st;
}

Result<EpochStats> evaluate_mil(Backend& be, Abmil& model, const BagDataset& data, const std::vector<size_t>& positions,
                                int prefetch_depth, std::vector<float>* probs_out, const BagOutputs& on_bag) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto C = static_cast<size_t>(data.class_names().size());
  std::vector<float> probs, scored;  // every bag's; the labelled bags'
  std::vector<int32_t> labels;
  Tally tally;
  BagPrefetcher prefetch(data, positions, prefetch_depth, be);
  std::vector<float> attention;  // the bag's, for on_bag
  for (size_t i = 0; i < positions.size(); ++i) {
    const BagRef& bag = data.bags()[positions[i]];
    SLIDE_ASSIGN_OR_RETURN_CTX(Tensor x, prefetch.get(i), "bag " + bag.path);
    // A bag without a label is scored against class 0: its probabilities and attention do not
    // depend on the label; it is left out of the metrics.
    const int32_t y = bag.label == kNoLabel ? 0 : bag.label;
    SLIDE_ASSIGN_OR_RETURN(BagScore sc, score_bag(be, model, x, y, false, 0.0));
    SLIDE_ASSIGN_OR_RETURN(const Tensor p, on_host(be, sc.probs, "bag probabilities"));
    // Finite features can still overflow the layers (values near 1e38): a NaN probability would be
    // "class 0" by max_element and disorder the ROC AUC. Training refuses such a step; so does this.
    for (size_t c = 0; c < C; ++c)
      if (!std::isfinite(p.data<float>()[c]))
        return slide::core::data_loss("bag " + bag.path + " (slide '" + bag.slide_id +
                                      "'): the model's probabilities are not finite (features too large for it?)");
    if (bag.label != kNoLabel) {
      tally.add(p, y, sc.loss);
      scored.insert(scored.end(), p.data<float>(), p.data<float>() + C);
      labels.push_back(y);
    }
    if (probs_out) probs.insert(probs.end(), p.data<float>(), p.data<float>() + C);
    if (on_bag) {
      SLIDE_ASSIGN_OR_RETURN(const Tensor a, on_host(be, model.attention(), "bag attention"));
      attention.assign(a.data<float>(), a.data<float>() + a.numel());
      SLIDE_RETURN_IF_ERROR(on_bag(i, p.data<float>(), attention));
    }
  }
  EpochStats st;
  tally.finish(&st, t0);
  st.roc_auc = labels.empty() ? std::nan("") : macro_roc_auc(scored, labels, static_cast<int64_t>(C));
  st.confusion = confusion_matrix(scored, labels, static_cast<int64_t>(C));
  if (probs_out) *probs_out = std::move(probs);
  return st;
}

Result<Tensor> balanced_bag_weights(const BagDataset& data, const std::vector<size_t>& positions, Allocator& alloc) {
  std::vector<int32_t> labels;
  for (size_t p : positions) labels.push_back(data.bags().at(p).label);
  return balanced_weights(labels, static_cast<int64_t>(data.class_names().size()), alloc);
}

// --- Attention outputs ----------------------------------------------------------------------------

Status write_attention_h5(const std::string& path, const std::string& slide_id, const std::string& label,
                          const std::string& predicted, const std::vector<double>& probabilities,
                          const std::vector<float>& attention, const std::vector<int32_t>& coords) {
  if (coords.size() != 2 * attention.size() || attention.empty())
    return invalid_argument(path + ": " + std::to_string(attention.size()) + " attention weights for " +
                            std::to_string(coords.size() / 2) + " tile coordinates");
  return h5::write_committed(path, [&](const std::string& partial) -> Status {
    h5::Id file(H5Fcreate(partial.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    if (!file.ok()) return h5::error(partial, "cannot create the file");
    const auto n = static_cast<hsize_t>(attention.size());
    {
      h5::Id space(H5Screate_simple(1, &n, nullptr), H5Sclose);
      h5::Id ds(H5Dcreate2(file.id, "attention", H5T_IEEE_F32LE, space.id, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
              H5Dclose);
      if (!ds.ok() || H5Dwrite(ds.id, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, attention.data()) < 0)
        return h5::error(partial, "writing /attention");
    }
    {
      const hsize_t dims[2] = {n, 2};
      h5::Id space(H5Screate_simple(2, dims, nullptr), H5Sclose);
      h5::Id ds(H5Dcreate2(file.id, "coords", H5T_STD_I32LE, space.id, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
      if (!ds.ok() || H5Dwrite(ds.id, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, coords.data()) < 0)
        return h5::error(partial, "writing /coords");
    }
    {
      h5::Id root(H5Gopen2(file.id, "/", H5P_DEFAULT), H5Gclose);
      if (!root.ok()) return h5::error(partial, "opening /");
      SLIDE_RETURN_IF_ERROR(h5::write_string_attr(root.id, "slide_id", slide_id, partial));
      SLIDE_RETURN_IF_ERROR(h5::write_string_attr(root.id, "label", label, partial));
      SLIDE_RETURN_IF_ERROR(h5::write_string_attr(root.id, "predicted", predicted, partial));
      const auto k = static_cast<hsize_t>(probabilities.size());
      h5::Id space(H5Screate_simple(1, &k, nullptr), H5Sclose);
      h5::Id attr(H5Acreate2(root.id, "probabilities", H5T_IEEE_F64LE, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
      if (!attr.ok() || H5Awrite(attr.id, H5T_NATIVE_DOUBLE, probabilities.data()) < 0)
        return h5::error(partial, "attribute probabilities");
    }
    if (H5Fflush(file.id, H5F_SCOPE_GLOBAL) < 0) return h5::error(partial, "flush");
    return h5::close_file(file, partial);
  });
}

namespace {

// The attention map with its title and a colour bar stating the percentile scale, as a PNG file.
Status write_attention_figure(const std::string& path, const slide::tile::RgbImage& map, const std::string& title) {
  slide::tile::ColourBar bar;
  bar.title = title;
  bar.low = 0, bar.high = 100, bar.unit = "%";
  bar.scale = "attention percentile within the slide (CLAM's scale)";
  auto figure = slide::tile::add_colour_bar(map, bar);
  if (!figure.ok()) return figure.status().with_context(path);
  SLIDE_ASSIGN_OR_RETURN(std::vector<uint8_t> png, slide::tile::encode_png(*figure));
  return slide::core::write_file_atomic(path, png);
}

}  // namespace

Status write_attention_heatmap(const std::string& path, const std::vector<float>& attention,
                               const std::vector<int32_t>& coords, int64_t tile_l0_px, int cell_px,
                               const std::string& title) {
  SLIDE_ASSIGN_OR_RETURN(slide::tile::RgbImage img,
                         draw_tile_grid(percentile_ranks(attention), coords, tile_l0_px, path, cell_px));
  return write_attention_figure(path, img, title);
}

Status write_attention_overlay(const std::string& path, const std::vector<float>& attention,
                               const std::vector<int32_t>& coords, int64_t tile_l0_px,
                               const slide::tile::RgbImage& thumbnail, double downsample_x, double downsample_y,
                               const std::string& title) {
  const HeatmapCanvas canvas{thumbnail, downsample_x, downsample_y};
  SLIDE_ASSIGN_OR_RETURN(slide::tile::RgbImage img,
                         draw_tile_overlay(percentile_ranks(attention), coords, tile_l0_px, canvas, path));
  return write_attention_figure(path, img, title);
}

}  // namespace slide::train
