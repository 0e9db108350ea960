// slide-train evaluate and predict for tile classifiers (the MIL versions: slide_train_mil.h).
//
//   slide-train evaluate --checkpoint CK --data STORE... --out DIR     labelled stores: metrics
//   slide-train predict  --checkpoint CK --data STORE... --out DIR     any stores: no labels needed
//
// CK is a checkpoint directory (checkpoints/epoch-E-step-S) or a weights file: a run's
// best.safetensors (its model is described by the run's newest checkpoint's state.json) or a
// checkpoint's model.safetensors.
//
// Both write, atomically, predictions.csv (per tile: slide_id, level-0 x and y, label (empty when
// none), p_<class>..., predicted) and slides.csv (per slide: label, tiles, mean_p_<class>...,
// predicted_by_mean, predicted_by_majority), and metrics.json when every tile has a label
// (evaluate requires labels: a slide without one is exit 2). predict also writes, per slide,
// predictions/<stem>.h5 (slide/train/predict.h: /probs, /coords) and, unless --no-heatmaps,
// heatmaps/<stem>.<class>.png, one per class, over the slide's thumbnail (over the tile grid when
// the slide file cannot be opened); slides.csv then names them. <stem> is slide_file_stem of the
// slide id (libcore/file_name.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace slide::apps {

struct TileInferenceOptions {
  std::string checkpoint;         // a checkpoint directory or a .safetensors file (above)
  std::vector<std::string> data;  // tile stores
  std::string labels;             // a slide_id,label CSV (optional)
  std::string out;
  int64_t batch = 32;
  int threads = 1;                // decode threads
  std::string backend = "cpu";
  int device = -1;
  std::string precision = "fp32";  // --precision: the products' math precision (backend.h)
  bool fused = true;              // the inference graph on cpu and cuda (inference_graph.h)
  bool overwrite = false;
  bool heatmaps = true;           // predict: per-class heatmaps
  // > 0: only the tiles slide-train --test-fraction held out of these stores (TileDataset::hold_out
  // with the same fraction and seed, stratified when the run was: config.stratify), not every
  // tile. The seed is the checkpoint's (state.json config.seed) unless seed_given; another
  // fraction or seed than the run's is warned about.
  double test_fraction = 0;
  uint64_t seed = 0;
  bool seed_given = false;
};

// Runs evaluate (`predict` false) or predict; returns the process exit code (0 ok, 1 failed, 2 usage
// or bad input), having logged the error.
int run_tile_inference(const TileInferenceOptions& options, bool predict);

}  // namespace slide::apps
