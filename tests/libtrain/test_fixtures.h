// Fixtures shared by the libtrain and cache test suites: real tiles from sample_data and models
// whose batch norms are away from their initial values.
#pragma once

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "slide/train/dataset.h"
#include "slide/train/layers.h"
#include "slide/train/random.h"
#include "test_util.h"

namespace slide::train::testing {

// The LC25000 lung subset in sample_data (360 patches, 3 classes) tiled by libtile at
// `tile_px` into a store under a new temporary directory (a ScratchDir removed when the process
// exits, after the datasets that function-local statics hold), opened as a TileDataset. Needs
// SLIDE_SAMPLE_DIR and libtile's pipeline (include "slide/tile/pipeline.h" first).
#ifdef SLIDE_SAMPLE_DIR
inline std::unique_ptr<TileDataset> tile_lc25000(int64_t tile_px, const std::string& tag) {
  // Constructed on the first call, before any static that keeps this call's dataset: destroyed
  // after it.
  static std::vector<std::unique_ptr<ScratchDir>> stores;
  stores.push_back(std::make_unique<ScratchDir>(tag));
  const std::string dir = stores.back()->path();
  auto inputs = slide::tile::collect_inputs({}, {}, {std::string(SLIDE_SAMPLE_DIR) + "/patches/lc25000-lung-subset"});
  REQUIRE_MESSAGE(inputs.ok(), inputs.status().to_string());
  slide::tile::TileJobOptions topt;
  topt.grid.tile_size_px = tile_px;
  topt.progress = false;
  auto summary = slide::tile::run_tiling(*inputs, dir + "/lc", topt);
  REQUIRE_MESSAGE(summary.ok(), summary.status().to_string());
  auto d = TileDataset::open({dir + "/lc"});
  REQUIRE_MESSAGE(d.ok(), d.status().to_string());
  return std::move(*d);
}
#endif

// Batch norms' running statistics (mean in [-0.2, 0.2], var in [0.5, 2]) and affine parameters
// (gamma in [0.5, 1.5], beta in [-0.2, 0.2]) drawn from `seed`, so that a wrong batch-norm fold
// shows. BN parameters are those named "bn*" or "downsample.1", or any other 1-D parameter but
// fc's (the small CNN's numbered batch norms).
inline void randomise_bn(Sequential& model, uint64_t seed) {
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  model.collect("", &params, &buffers);
  std::mt19937_64 g(seed);
  auto fill = [&](Tensor& t, float lo, float hi) {
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = slide::train::uniform_real(g, lo, hi);
  };
  int running = 0;
  for (Buffer* b : buffers) {
    if (b->name.find("running_mean") != std::string::npos) fill(b->value, -0.2f, 0.2f), ++running;
    if (b->name.find("running_var") != std::string::npos) fill(b->value, 0.5f, 2.0f);
  }
  REQUIRE(running > 0);
  for (Parameter* p : params) {
    const bool bn = p->name.find("bn") != std::string::npos || p->name.find("downsample.1") != std::string::npos ||
                    (p->value.rank() == 1 && p->name.find("fc") == std::string::npos);
    if (!bn) continue;
    if (p->name.find("weight") != std::string::npos) fill(p->value, 0.5f, 1.5f);
    else fill(p->value, -0.2f, 0.2f);
  }
}

}  // namespace slide::train::testing
