// slide-train predict's outputs for a tile classifier on new slides: one HDF5 file of per-tile
// probabilities per slide, and one heatmap per class over the slide.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "slide/core/status.h"
#include "slide/train/heatmap.h"

namespace slide::train {

using slide::core::Status;

// One slide's tile predictions.
struct SlidePredictions {
  std::string slide_id;
  std::string label;                 // "" when the slide has none
  std::vector<std::string> classes;  // the model's, K
  std::vector<float> probs;          // N x K softmax probabilities, row-major, in tile order
  std::vector<int32_t> coords;       // N x 2: each tile's level-0 x, y (top-left)
  int32_t tile_size_px = 0;          // the tile's side as stored (px at mpp_um)
  int32_t tile_size_l0_px = 0;       // the tile's side in level-0 px
  double mpp_um = 0;                 // the tiles' resolution (0: unknown)
  std::string checkpoint;            // the model's weights file
};

// Writes `p` to `path` (HDF5, as `<path>.partial` then renamed, so a file of that name is always
// complete): /probs (N x K float32), /coords (N x 2 int32, with the bags' attributes
// patch_size_level0 and patch_size), root attributes slide_id, label, checkpoint (strings),
// classes (a JSON array of the class names, a string), mean_probabilities (K float64) and
// predicted_by_mean (string). Errors: kInvalidArgument (no tiles, sizes that disagree),
// kInternal from HDF5 naming the path, the rename's errno.
[[nodiscard]] Status write_predictions_h5(const std::string& path, const SlidePredictions& p);

// One PNG per class at `<path_prefix>.<class stem>.png` (the class name through slide_file_stem):
// the class's probability over `canvas` (nullptr: over the tile grid, 8 px a tile), on an absolute
// scale (0..1, never normalised per slide), with a title naming the class and slide and a colour
// bar stating the scale (slide/tile/figure.h). Each written atomically. Returns the file names
// written (without the directory). Errors: those of drawing, encoding and writing, naming the file.
[[nodiscard]] Result<std::vector<std::string>> write_class_heatmaps(const std::string& path_prefix,
                                                                   const SlidePredictions& p,
                                                                   const HeatmapCanvas* canvas);

}  // namespace slide::train
