// Heatmaps of per-tile values (a class's probability, MIL attention) over a slide: each tile's
// level-0 rectangle tinted by the jet colormap (slide/tile/figure.h) over the slide's thumbnail,
// or, when the slide cannot be opened (moved, or patch images), drawn as cells of a tile grid.
// Shared by slide-train predict and the MIL attention files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "slide/core/status.h"
#include "slide/tile/image.h"

namespace slide::train {

using slide::core::Result;

// Each value's percentile rank among `values`, 0..1 (ties ranked in input order; one value: 1).
// CLAM's heatmaps normalise attention this way.
std::vector<double> percentile_ranks(const std::vector<float>& values);

// The smallest positive step between the tiles' coordinates (n x 2 level-0 x, y): the grid's
// stride in level-0 px (1 when there is none, e.g. one tile).
int64_t coords_grid_step(const std::vector<int32_t>& coords);

// A slide's thumbnail for heatmaps: about 8 thumbnail px per tile of side `tile_l0_px` level-0
// px, or finer when that leaves the longer side under `min_long_side_px` px (predict's heatmaps
// ask for 1024 so that small slides are readable; 0: 8 px a tile), the longer side at most 4096
// px; one thumbnail pixel is downsample_x x downsample_y level-0 px.
struct HeatmapCanvas {
  slide::tile::RgbImage thumbnail;
  double downsample_x = 1, downsample_y = 1;
};
// `expect_width_l0` x `expect_height_l0`: the level-0 size the tiles were cut from (a store's or
// a bag's record; 0 x 0: not checked). Errors: those of opening the slide (slide/tile/slide.h) and
// of make_thumbnail; kFailedPrecondition when the file's level-0 size is another (the file at that
// path was replaced: its thumbnail would not be the tiles' slide), naming both sizes.
[[nodiscard]] Result<HeatmapCanvas> heatmap_canvas(const std::string& slide_path, int64_t tile_l0_px,
                                                   int64_t min_long_side_px = 0, int64_t expect_width_l0 = 0,
                                                   int64_t expect_height_l0 = 0);

// The tiles drawn as cells of `cell_px` px on a white tile grid spanning their bounding box (tile
// side `tile_l0_px` level-0 px; 0: coords_grid_step; a tile's cell is its offset in tile sides
// rounded to the nearest, as tile positions are rounded from a fractional step; overlapping tiles,
// whose grid step is under nine tenths of the side, in strides instead), coloured by value (0..1,
// jet). Cells are `cell_px` px, fewer (down to 1) where the grid's longer side in cells times
// cell_px would pass kMaxHeatmapSidePx: the image is at most 4096 px on its longer side unless the
// grid has more cells than that on it (then 1 px per cell; 48 MiB at 2^24 cells).
// Errors: kInvalidArgument (sizes disagree, no tiles, a grid over 2^24 cells), naming `what`.
inline constexpr int64_t kMaxHeatmapSidePx = 4096;
[[nodiscard]] Result<slide::tile::RgbImage> draw_tile_grid(const std::vector<double>& values,
                                                           const std::vector<int32_t>& coords, int64_t tile_l0_px,
                                                           const std::string& what, int cell_px = 8);

// The tiles over `canvas`: each tile's level-0 rectangle blended half and half with its value's
// colour (0..1, jet); where tiles overlap, with the colour of the mean of their values (CLAM's
// overlapping heatmaps average the same way); the rest of the slide as it is. Extra memory: 8 bytes
// per thumbnail pixel of the tiles' bounding box. Errors: kInvalidArgument (sizes disagree, no
// tiles, an empty thumbnail), naming `what`.
[[nodiscard]] Result<slide::tile::RgbImage> draw_tile_overlay(const std::vector<double>& values,
                                                              const std::vector<int32_t>& coords, int64_t tile_l0_px,
                                                              const HeatmapCanvas& canvas, const std::string& what);

}  // namespace slide::train
