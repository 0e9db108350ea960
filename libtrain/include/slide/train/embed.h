// Feature extraction for slide-level MIL: a trained or pretrained CNN cut at a named layer, run for
// inference over the tiles of slide-tile stores, one HDF5 feature bag per slide (slide/cache/bag.h).
//
// The CNN encoder (FeatureExtractor) runs the model's inference graph (inference_graph.h) through
// the op list on any backend: batch norm folded into the preceding convolution (w' = w * g /
// sqrt(v + eps), b' = beta - mean * g / sqrt(v + eps): Ioffe & Szegedy's inference transform),
// ReLU and the residual add fused into the convolution (Backend::fused_conv2d_inference: oneDNN's
// sum and eltwise_relu post-ops on cpu, with activations kept in blocked layouts and the weights
// reordered once; cuDNN's fused convolution-bias-activation on cuda). Global average pooling
// after a 4-D cut gives one D-vector per tile: cutting torchvision's ResNet-50 after `layer3`
// gives CLAM's 1024-d features (Lu et al., Nature BME 2021, extract_features_fp.py:
// resnet50_baseline = conv1..layer3 + AdaptiveAvgPool2d(1)).
//
// embed_stores() streams the stores' tiles in order, in batches that may span slides (so stores of
// small slides or patches still run full batches): tiles are read and JPEG-decoded on a thread
// pool one batch ahead of the forward pass, features appended to each slide's BagWriter as they
// come, so memory is independent of the number of tiles; a bag is renamed into place only when
// complete.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "slide/cache/bag.h"
#include "slide/core/status.h"
#include "slide/train/inference_graph.h"
#include "slide/train/layers.h"
#include "slide/train/stain.h"

namespace slide::train {

// A backbone with its weights, ready to be cut.
struct EmbedModel {
  std::unique_ptr<Sequential> net;
  std::string model;           // "resnet18" | "resnet34" | "resnet50" | "small"
  std::string layer;           // the cut (the `layer` asked for, or default_layer(model))
  std::string weights_path;    // the safetensors file read
  std::string weights_sha256;  // of that file, lower-case hex
  // The encoder backend's math precision (backend.h, slide-embed --precision): recorded in each bag
  // (attribute precision, only when not fp32); a complete bag made at another precision is not
  // reused.
  MathPrecision precision = MathPrecision::kFp32;
  // A ViT encoder's attention heads (its config's; slide-embed --heads can change them): recorded in
  // each bag (attribute attention_heads) and a complete bag made with others is not reused. 0: a CNN.
  int32_t attention_heads = 0;
};

// Loads a backbone. `weights` is either a slide-train checkpoint directory (state.json names the
// model, classes and width; model.safetensors holds the weights) or a safetensors file with
// torchvision's names (e.g. ImageNet weights converted by scripts/convert_torchvision_weights.py),
// in which case `model` names the architecture (resnet18/34/50); for a checkpoint `model` must be
// empty or agree. An empty `layer` means default_layer(model). Only the parameters and buffers of the children up to and including the cut
// `layer` are needed in the file (a file without `fc.*` loads for any cut before fc).
// Errors: kNotFound (no such file), kInvalidArgument (unknown model or layer, a model that
// disagrees with the checkpoint, a missing or mis-shaped tensor, naming it), kDataLoss (a corrupt
// state.json or safetensors file).
[[nodiscard]] Result<EmbedModel> load_embed_model(const std::string& weights, const std::string& model,
                                                  const std::string& layer);

// The cut points of a model: its top-level children's names ("conv1", "bn1", "relu", "maxpool",
// "layer1".."layer4", "avgpool", "fc" for ResNets), and "avgpool" for the small CNN's pooling.
std::vector<std::string> cut_points(Sequential& model);
// The default cut: "layer3" for resnet50 (CLAM), "avgpool" (the penultimate features) otherwise.
std::string default_layer(const std::string& model);
// The index of the child `layer` names. Errors: kInvalidArgument listing the cut points.
[[nodiscard]] Result<size_t> find_cut(Sequential& model, const std::string& layer);

// The engine's own forward pass (the training code path, `training` = false) through children
// 0..cut of `model`, then global average pooling if the output is 4-D: images [N,3,H,W] f32 ->
// [N,D]. The oracle for FeatureExtractor's tests. Errors: the backend's, kInvalidArgument for a
// bad cut.
[[nodiscard]] Result<Tensor> engine_features(Backend& be, Sequential& model, size_t cut, const Tensor& images);

// What embed_stores runs on each batch of tiles: a CNN cut at a layer (FeatureExtractor) or a
// Vision Transformer (VitEncoder, vit.h). Not thread-safe (one per thread).
class TileEncoder {
 public:
  virtual ~TileEncoder() = default;
  // D, the feature width.
  virtual int64_t feature_dim() const = 0;
  // What the bag's `layer` attribute records: the CNN's cut, or the ViT's pooling.
  virtual const std::string& layer() const = 0;
  // The tile side the encoder needs (0: any; a ViT's image size). Tiles of another size are
  // resized to it by embed_stores.
  virtual int64_t input_size() const { return 0; }
  // The per-channel normalisation of [0, 1] RGB the encoder was trained with: (v - mean) / std.
  virtual const float* mean() const;  // ImageNet's by default (0.485, 0.456, 0.406)
  virtual const float* std() const;   // (0.229, 0.224, 0.225)
  // images: n x 3 x h x w f32, plain NCHW, normalised; features: n x D f32, row-major,
  // overwritten. Errors: kInvalidArgument (n < 1, a size the encoder cannot take), the backend's.
  [[nodiscard]] virtual Status extract(const float* images, int64_t n, int64_t h, int64_t w, float* features) = 0;
  // Gives the cached free blocks of the encoder's backend allocator back to the system (or the
  // driver): after an out-of-memory error, before a retry with fewer images. Default: nothing.
  virtual void release_cached_memory() {}
};

// encoder.extract over n images (the layout of TileEncoder::extract) in micro-batches of at most
// *micro_batch images (<= 0 or > n: all n at once), rows written in order. A micro-batch that fails
// with kResourceExhausted (the device's memory, or --memory-budget) is run again in halves, after
// release_cached_memory(), and *micro_batch keeps the smaller size for later calls (a forward
// pass's rows do not depend on the other images of its batch: no batch statistics at inference).
// *reruns (if given) counts the halvings. Errors: the encoder's; kResourceExhausted naming the
// micro-batch when one image alone does not fit.
[[nodiscard]] Status extract_in_micro_batches(TileEncoder& encoder, const float* images, int64_t n, int64_t h,
                                              int64_t w, float* features, int64_t* micro_batch,
                                              int64_t* reruns = nullptr);

// The CNN encoder: the model's inference graph (inference_graph.h: batch norm folded, the
// residual add and ReLU fused into the convolutions) on a backend, any of them (cpu: oneDNN with
// blocked layouts; cuda: cuDNN's fused convolutions; reference). Each batch is uploaded, run and
// its features downloaded. Not thread-safe (one per thread); oneDNN parallelises each primitive
// over OMP_NUM_THREADS (or every core).
class FeatureExtractor final : public TileEncoder {
 public:
  // Folds children 0..cut of `model` (host copies of the weights: the model may be destroyed
  // afterwards) and prepares them on `be` (null: the cpu backend on cpu_allocator()). Supported:
  // Conv2d (+ BatchNorm2d, + ReLU), MaxPool2d, ResNet blocks (BasicBlock, Bottleneck),
  // GlobalAvgPool, Linear (only last). Errors: kInvalidArgument for a bad cut, kUnimplemented for
  // another layer kind (naming it), the backend's (preparing the weights on its device).
  [[nodiscard]] static Result<std::unique_ptr<FeatureExtractor>> create(Sequential& model, const std::string& layer,
                                                                        std::unique_ptr<Backend> be = nullptr);
  ~FeatureExtractor();

  // D (the output width of the cut).
  int64_t feature_dim() const override { return graph_.feature_dim(); }
  const std::string& layer() const override { return layer_; }
  // The backend the graph runs on.
  const Backend& backend() const { return *be_; }

  // images: n x 3 x h x w f32, plain NCHW, normalised (ImageNet mean/std); features: n x D f32,
  // row-major, overwritten. The first call for a shape creates its primitives (cpu: tens of ms);
  // later calls reuse them. Errors: kInvalidArgument (n < 1, an input too small for the cut,
  // naming the layer), the backend's (kInternal with oneDNN's message, kResourceExhausted).
  [[nodiscard]] Status extract(const float* images, int64_t n, int64_t h, int64_t w, float* features) override;
  void release_cached_memory() override;

 private:
  FeatureExtractor(InferenceGraph graph, std::unique_ptr<Backend> be, std::string layer);
  InferenceGraph graph_;
  std::unique_ptr<Backend> be_;
  std::string layer_;
};


struct EmbedOptions {
  std::vector<std::string> stores;     // slide-tile store directories
  std::vector<std::string> slide_ids;  // restrict to these ids (empty: every slide)
  std::string out_dir;                 // bags: <out_dir>/<bag_file_name(slide_id)>, and bags.csv
  // "flat" (the default: bags and bags.csv in out_dir, /coords in TRIDENT's convention) or "clam":
  // CLAM's layout, bags and bags.csv in <out_dir>/h5_files/, /coords in CLAM's convention
  // (slide/cache/bag.h), and <out_dir>/dataset.csv (case_id,slide_id,label: CLAM's dataset CSV;
  // case_id is the slide id, slide_id the bag's file stem, which CLAM appends ".h5" to).
  std::string layout = "flat";
  int64_t batch = 32;                  // tiles per forward pass (decoded together)
  // Tiles per forward pass on the backend, at most `batch` (<= 0: batch). An out-of-memory error
  // halves it for the rest of the run (extract_in_micro_batches; the log says so once per halving).
  int64_t micro_batch = 0;
  int decode_threads = 2;              // JPEG decode workers (run one batch ahead of compute)
  slide::cache::BagWriterOptions bag;  // dtype, compression, chunk rows
  std::string tool_version;            // "slide-embed 0.1.0"
  const std::atomic<bool>* cancel = nullptr;  // set by a signal handler: the current bag is discarded
  bool progress = true;                // progress lines with tiles/s on stderr
  // Stain normalisation of every tile (slide/train/stain.h), on the decode threads right after
  // decoding, before any resize and the encoder's mean/std; method kNone (the default): none.
  StainTarget stain;
};

// Where the bags and bags.csv go: out_dir ("flat"), or out_dir/h5_files (layout "clam", CLAM's
// DATA_DIR/h5_files).
std::string bag_directory(const EmbedOptions& options);

struct SlideOutcome {
  std::string store, slide_id, bag_path;
  int64_t tiles = 0;
  double seconds = 0;
  bool skipped = false;  // a complete bag was already there
  Status status;         // not OK: this slide failed (the others went on); kCancelled: interrupted
};

struct EmbedSummary {
  std::vector<SlideOutcome> slides;
  int64_t tiles_embedded = 0;
  double seconds = 0;
  bool interrupted = false;
  // Tiles per forward pass at the end (options.micro_batch, or batch, after any halving on out of
  // memory) and how many halvings there were.
  int64_t micro_batch = 0;
  int64_t oom_reruns = 0;
  int failed() const;  // slides whose status is an error other than kCancelled
  // Of the slides whose status is OK: bags written, bags already complete (skipped), slides
  // without tiles (no bag).
  struct Counts {
    int written = 0, skipped = 0, empty = 0;
  };
  Counts counts() const;
};

// Embeds every complete slide of `options.stores` (in store order, then slide index), skipping
// slides whose bag exists (complete by construction) after checking that it was made with the same
// model, layer, weights and dtype (else that slide fails with kFailedPrecondition: remove the bag
// or use another --out). Per-slide failures (an unreadable or corrupt tile, a bag that cannot be
// written) are recorded in the summary and the run goes on; zero-tile slides are reported and get
// no bag. At the end (also when cancelled) `<out_dir>/bags.csv` lists every bag in the directory.
// Errors (the run does not start or stops): kNotFound / kDataLoss opening a store, kInvalidArgument
// (no stores, a requested slide id in no store, two slides whose bag file names collide),
// kPermissionDenied / kResourceExhausted for the output directory or the manifest, and
// kResourceExhausted when a bag write runs out of space (disk full, quota, file size limit): the
// run stops there (that bag discarded, complete bags kept, bags.csv written when it fits).
// The tiles are normalised with the encoder's mean and std. An encoder with an input_size() E > 0
// gets the tiles of a store of another tile size S resized to E x E on the decode threads, before
// normalisation, as the encoders' own transforms do (PIL's Image.resize(BICUBIC), antialiased:
// BicubicResizer, resample.h; its weights precomputed once per (S, E)); the log says so once per
// store, and each bag of such a store records E in the root attribute `encoder_input_px` (int32;
// absent when the tiles went in as stored; tile_size_px stays S). A complete bag is reused only
// when that attribute matches too. input_size() 0 (the CNNs): tiles go in at their size.
// With options.stain (method other than kNone) each decoded 8-bit tile is stain-normalised in
// place (normalise_stain) before the resize, and each bag records the target's JSON in the root
// string attribute `stain_normalization` (absent without); a complete bag is reused only when that
// attribute equals this run's (else kFailedPrecondition for that slide, as for another model).
// Errors also: kInvalidArgument for an invalid stain target.
[[nodiscard]] Result<EmbedSummary> embed_stores(TileEncoder& encoder, const EmbedModel& model,
                                                const EmbedOptions& options);

}  // namespace slide::train
