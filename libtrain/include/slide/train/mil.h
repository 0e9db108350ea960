// Slide-level multiple-instance learning (MIL) on feature bags (DESIGN.md, "Feature bags"):
// attention-based MIL with gated attention (ABMIL: Ilse, Tomczak & Welling, "Attention-based Deep
// Multiple Instance Learning", ICML 2018, eq. 9; CLAM_SB's layout and parameter names: Lu et al.,
// Nature Biomedical Engineering 2021), a dataset of HDF5 bags (slide/cache/bag.h) labelled per
// slide, split by slide or patient, kept in RAM or streamed with a bounded prefetch, and the
// training and evaluation loops.
//
// A bag is one slide: N tiles x D features, N varying from bag to bag. The model takes one bag at
// a time ([N, D] -> [1, classes]); a mini-batch of B bags accumulates the gradients of its bags
// (the micro-batch idea with one bag per micro-batch), each weighted by its share of the step's
// loss, and the optimizer steps once.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "slide/tile/image.h"
#include "slide/train/layers.h"
#include "slide/train/optimizer.h"
#include "slide/train/trainer.h"

namespace slide::train {

struct AbmilConfig {
  int64_t in_features = 0;   // D, the bags' feature dimension
  int64_t hidden = 512;      // L, the first fc's width (CLAM's "small" size: 1024 -> 512 -> 256)
  int64_t attention = 256;   // the gated attention's width
  int64_t classes = 2;
  double dropout = 0;        // after the first fc's ReLU in training (CLAM's fc block; CLAM uses 0.25)
  bool input_gradient = false;  // backward also returns dL/dx (tests); off in training: it costs a GEMM
};

// Gated attention MIL (Ilse et al. 2018, eq. 9), forward for one bag x[N, D]:
//   h   = Dropout(ReLU(x W1^T + b1))              [N, L]   attention_net.0 (dropout: training only)
//   t   = tanh(h Wa^T + ba)                       [N, A]   attention_net.3.attention_a.0
//   s   = sigmoid(h Wb^T + bb)                    [N, A]   attention_net.3.attention_b.0
//   e   = (t * s) wc^T + bc                       [N, 1]   attention_net.3.attention_c
//   a   = softmax over the N instances of e       [1, N]   (the attention weights; sum 1)
//   z   = a h                                     [1, L]
//   y   = z Wc^T + bc                             [1, C]   classifiers
// Parameter names are CLAM_SB's (its instance classifiers aside), so a checkpoint maps onto
// CLAM's model.state_dict(); initialisation is PyTorch's Linear default from a seeded generator.
// Saves for backward: x, ReLU(fc x), h, t, s, a (and what its Linear layers save: their inputs). Backward
// accumulates (+=) into every parameter gradient. Dropout's mask comes from set_rng_seed() (the
// training loop seeds it per bag from the epoch's order, so --resume stays exact). Not thread-safe.
class Abmil final : public Layer {
 public:
  // Errors: kInvalidArgument (a non-positive size), the allocator's (kResourceExhausted).
  [[nodiscard]] static Result<std::unique_ptr<Abmil>> make(Allocator& alloc, DType dtype, const AbmilConfig& config,
                                                           uint64_t seed);
  // x[N, D] (N >= 1) -> logits [1, classes]. Errors: kInvalidArgument (x not [N, D]), the
  // backend's and the allocator's.
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  // dlogits[1, classes] -> dx[N, D] when config.input_gradient, else an undefined tensor.
  // Errors: kFailedPrecondition without a preceding forward, the backend's.
  Result<Tensor> backward(Backend& be, const Tensor& dlogits) override;
  void collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) override;
  void release() override;
  void set_rng_seed(uint64_t seed) override { dropout_.set_rng_seed(seed); }
  // The attention weights a[1, N] of the last forward (undefined before one).
  const Tensor& attention() const { return a_; }
  const AbmilConfig& config() const { return config_; }

 private:
  AbmilConfig config_;
  std::unique_ptr<Linear> fc_, attention_a_, attention_b_, attention_c_, classifier_;
  Dropout dropout_{0};
  Tensor x_, r_, h_, t_, s_, a_;  // r_: the ReLU's output (h_ is r_ after dropout)
};

// One bag of a BagDataset.
struct BagRef {
  std::string path;      // the .h5 file
  std::string slide_id;
  int32_t label = 0;     // index into class_names(), or kNoLabel (opened with allow_unlabelled)
  uint32_t group = 0;    // its patient's index (labels CSV `patient` column), or its own
  int64_t tiles = 0;     // N
};

// The encoder a bag's features came from: the bag's root attributes model, layer and
// weights_sha256 (slide/cache/bag.h). All empty when the bag does not say (bags written by other
// tools, e.g. CLAM's own .h5 files).
struct BagEncoder {
  std::string model, layer, weights_sha256;
  bool known() const { return !model.empty() || !layer.empty() || !weights_sha256.empty(); }
  bool operator==(const BagEncoder&) const = default;
  // For messages: "resnet50 layer3, weights sha256 1a2b3c4d5e6f..." (the hash's first 12 digits).
  std::string describe() const;
};

// Labelled bags from directories written by slide-embed: `<dir>/bags.csv` (the bag manifest) when
// present, else every `*.h5` of the directory (slide/cache/bag.h, list_bags). Labels are the bags'
// own `label` attribute, or, with a labels CSV (a header naming `slide_id` and `label`,
// optionally `patient`; the manifest dialect, slide/core/csv.h), its rows joined on slide id.
// Classes are the distinct labels in sorted order, or `class_names` when given (a checkpoint's:
// labels are matched by name, and the bags may hold only some of the classes).
class BagDataset {
 public:
  // Every bag that records its encoder must record the same one (features of two encoders, even of
  // one width, e.g. ResNet-50's layer3 and UNI's 1024, mean different things to one model); in a
  // directory with a manifest (one slide-embed run, which never mixes encoders in its output) its
  // first bag speaks for the others.
  // Errors: kNotFound (a directory or the CSV missing), kDataLoss (a bag that does not open, named
  // by path), kInvalidArgument (no bags; bags of different feature dimensions or encoders, naming
  // one of each; a bag with no label and no CSV row, naming it; a CSV without slide_id/label columns or
  // with a duplicate slide id, naming file and line; without `class_names`, fewer than two
  // classes; with them, a label that is not one of them, naming the bag).
  // With `allow_unlabelled` (slide-train predict: a checkpoint on new slides; needs
  // `class_names`), a bag with no label (no attribute and no CSV row) is listed with label
  // kNoLabel instead of being an error; labelled() then tells whether every bag has one.
  [[nodiscard]] static Result<std::unique_ptr<BagDataset>> open(const std::vector<std::string>& dirs,
                                                                const std::string& labels_csv = "",
                                                                const std::vector<std::string>& class_names = {},
                                                                bool allow_unlabelled = false);
  // Whether every bag has a label (always true unless opened with allow_unlabelled).
  bool labelled() const;

  const std::vector<std::string>& class_names() const { return class_names_; }
  const std::vector<BagRef>& bags() const { return bags_; }
  int64_t feature_dim() const { return feature_dim_; }
  // The encoder of the bags that record one (not known() when none does).
  const BagEncoder& encoder() const { return encoder_; }
  // Bytes of every bag's features as f32 (sum of N x D x 4): what cache_in_ram would take.
  size_t feature_bytes() const;
  // Tiles of the largest bag.
  int64_t max_tiles() const;

  // Positions (into bags()) split by slide, or by patient when the labels CSV has a `patient`
  // column, the rule of TileDataset::split_by_slide: groups shuffled with `seed`,
  // round(val_fraction x groups) (at least one when val_fraction > 0 and there are two groups or
  // more) go to validation. With `stratify`, within each class (split_groups_stratified; a
  // patient's class is its bags' most frequent label).
  void split(double val_fraction, uint64_t seed, std::vector<size_t>* train, std::vector<size_t>* val,
             bool stratify = false) const;

  // Reads every bag once into tensors from `alloc` (the dataset-pinning idea: train from RAM).
  // Errors: kResourceExhausted when they do not fit the budget (what was read is dropped, the
  // caller may go on streaming), the bag reader's.
  [[nodiscard]] Status cache_in_ram(Allocator& alloc);
  bool cached() const { return !cache_.empty(); }

  // Bag `position` as features [N, D] f32 from `alloc` (from RAM when cached, else read from its
  // file; float16 bags are widened exactly). Safe to call from several threads at once (HDF5
  // serialises reads). Errors: the bag reader's (kDataLoss naming the file), the allocator's.
  [[nodiscard]] Result<Tensor> load(size_t position, Allocator& alloc) const;
  // Level-0 (x, y) of each tile of bag `position`, N x 2. Errors: the bag reader's.
  [[nodiscard]] Result<std::vector<int32_t>> coords(size_t position) const;

 private:
  std::vector<BagRef> bags_;
  std::vector<std::string> class_names_;
  int64_t feature_dim_ = 0;
  BagEncoder encoder_;
  std::vector<Tensor> cache_;
};

struct MilTrainOptions {
  int64_t batch_size = 1;   // bags per optimizer step (their gradients accumulate)
  int prefetch = 2;         // bags read ahead of the one in compute (bounded: memory stays flat)
  double label_smoothing = 0;
  Tensor class_weights;     // [classes] f32 in host memory, or undefined (all 1)
  int64_t start_step = 0;   // resume inside an epoch: skip its first start_step steps (same order)
  const std::atomic<bool>* cancel = nullptr;  // checked after every step
};

// On any backend: the model's parameters and the optimizer's state on be's device (move_to_device);
// bags are read into host memory and uploaded one at a time, and each bag's probabilities (and,
// evaluating, its attention) come back to the host for the metrics. On a device each bag costs
// two small copies besides its features' upload.
// Trains over `positions` (into data.bags()) in an order shuffled with `epoch_seed`. Each step's
// gradient is that of PyTorch's CrossEntropyLoss(weight, label_smoothing) over the step's bags
// as one batch (with smoothing, each class's term weighted by its own weight, as PyTorch's): bag
// b's gradient is that of the loss op with the class weights, scaled by w[y_b] / sum over the
// step's bags of w[y]. The last
// partial step is used. EpochStats: loss (mean over bags), accuracy, balanced accuracy, recall.
// Errors: kInvalidArgument (batch_size < 1, prefetch < 0), the data's, model's and backend's
// (kResourceExhausted over the budget: that step is not applied), kOutOfRange when a bag's loss
// is not finite (naming the step and bag) or from Optimizer::step (a gradient or learning rate
// that is not finite): that step is not applied.
[[nodiscard]] Result<EpochStats> train_mil_epoch(Backend& be, Abmil& model, Optimizer& opt, const Schedule& schedule,
                                                 const BagDataset& data, const std::vector<size_t>& positions,
                                                 const MilTrainOptions& options, uint64_t epoch_seed);

// Inference over `positions` in order: loss, accuracy, balanced accuracy, recall, macro ROC AUC
// (over the bags that have a label; with none of them, samples = 0 and ROC AUC NaN: bags without a
// label, kNoLabel, get probabilities and attention only).
// With `probs_out`, the softmax probabilities (positions.size() x classes, row-major). With
// `on_bag`, each bag's outputs as it is scored, in order, so that a caller writes them bag by bag
// and holds one bag's attention at a time whatever the cohort: its index i into `positions`, its
// probabilities (`classes` values) and its attention weights (`attention`: N values, N the bag's
// tiles, summing to 1; valid during the call). An error from `on_bag` ends the evaluation and is
// returned.
using BagOutputs = std::function<Status(size_t i, const float* probs, const std::vector<float>& attention)>;
[[nodiscard]] Result<EpochStats> evaluate_mil(Backend& be, Abmil& model, const BagDataset& data,
                                              const std::vector<size_t>& positions, int prefetch = 2,
                                              std::vector<float>* probs_out = nullptr,
                                              const BagOutputs& on_bag = nullptr);

// sklearn's class_weight="balanced" over the bags at `positions`: n / (classes x n_c), 0 for a
// class with no bags. Errors: the allocator's.
[[nodiscard]] Result<Tensor> balanced_bag_weights(const BagDataset& data, const std::vector<size_t>& positions,
                                                  Allocator& alloc);

// Writes a bag's attention to `path` (HDF5, written as `<path>.partial` and renamed): /attention
// (N float32, the softmax weights, summing to 1), /coords (N x 2 int32, level-0 x, y, as the bag's),
// root attributes slide_id, label, predicted (strings) and probabilities (float64 array).
// Errors: kInvalidArgument (attention and coords sizes disagree), kInternal / kResourceExhausted
// from HDF5 or the rename, naming the path.
[[nodiscard]] Status write_attention_h5(const std::string& path, const std::string& slide_id, const std::string& label,
                                        const std::string& predicted, const std::vector<double>& probabilities,
                                        const std::vector<float>& attention, const std::vector<int32_t>& coords);

// An attention heatmap PNG over the tile grid: each tile at its /coords position (tile side
// `tile_l0_px` level-0 px; 0: the smallest non-zero coordinate step) drawn as a cell of `cell_px`
// pixels, coloured by its attention rank within the bag (low blue -> high red, the jet colormap
// of CLAM's heatmaps, percentile-normalised as CLAM does); background white; `title` above it and
// a colour bar stating the scale (0-100 %, the percentile within the slide) at its right
// (slide/tile/figure.h add_colour_bar: the map at (0, 28)). Written atomically.
// Errors: kInvalidArgument (sizes disagree, an empty bag), the PNG encoder's and the file's.
[[nodiscard]] Status write_attention_heatmap(const std::string& path, const std::vector<float>& attention,
                                             const std::vector<int32_t>& coords, int64_t tile_l0_px, int cell_px = 8,
                                             const std::string& title = "attention");

// The same heatmap over a slide's thumbnail (`thumbnail`, whose pixel is downsample_x x
// downsample_y level-0 px): each tile's level-0 rectangle (side `tile_l0_px`; 0: the grid step
// as above) blended half and half with its colour; the rest of the slide as it is; the title and
// colour bar as above. Written atomically. Errors: kInvalidArgument (sizes disagree, an empty bag
// or thumbnail), the PNG encoder's and the file's.
[[nodiscard]] Status write_attention_overlay(const std::string& path, const std::vector<float>& attention,
                                             const std::vector<int32_t>& coords, int64_t tile_l0_px,
                                             const slide::tile::RgbImage& thumbnail, double downsample_x,
                                             double downsample_y, const std::string& title = "attention");

}  // namespace slide::train
