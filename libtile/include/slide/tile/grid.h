// The tile grid: which level to read, where each output tile lies in level-0 pixels, which tiles
// are kept, and reading one output tile with exact resampling.
//
// Geometry. Let m0 be the slide's level-0 mpp (µm/px) and m the target mpp. One output pixel
// covers s = m / m0 level-0 pixels. When |s - 1| <= 2% the slide is read at its native resolution
// (s := 1; the stored tiles then have the slide's mpp, recorded as tile_mpp_um). The level read is
// the finest level whose downsample d satisfies d <= s * 1.02 (OpenSlide's
// get_best_level_for_downsample, with a tolerance for pyramids whose downsamples are 2.0005...);
// an output pixel covers r = s / d pixels of that level (r := 1 when |r - 1| <= 2%, i.e. no
// resampling). The output-space slide is floor(W0 / s) x floor(H0 / s) px; grid position
// (col, row) is the output tile whose top-left output pixel is (col * stride, row * stride); only
// tiles lying wholly inside the slide are planned (no padding). With r == 1 the tile is level
// pixels [col * stride, col * stride + T) (likewise rows) exactly; otherwise it is the area
// resampling (resample_area) of the level region starting at (col * stride * r, row * stride * r).
// The level-0 top-left recorded for a tile is round(col * stride * r * d), round(row * stride * r * d).
#pragma once

#include <cstdint>
#include <vector>

#include "slide/core/status.h"
#include "slide/tile/slide.h"
#include "slide/tile/tissue.h"

namespace slide::tile {

struct GridOptions {
  int tile_size_px = 256;    // output tile side, px
  int stride_px = 0;         // distance between tile origins in output px; 0 = tile_size_px (no overlap)
  double target_mpp_um = 0.5;
  double min_tissue = 0.5;   // keep a tile when its tissue fraction is >= this (0 keeps every tile)
  int64_t max_tiles = 0;     // keep at most this many (0 = all): a seeded uniform sample, in grid order
  uint64_t seed = 0;         // for max_tiles sampling
};

struct TileSpec {
  int64_t col = 0, row = 0;  // grid position
  int64_t x_l0 = 0, y_l0 = 0;  // top-left in level-0 px
  double tissue_fraction = 0;
};

struct TilePlan {
  int level = 0;                 // level read
  double level_downsample = 1;   // d
  double scale_l0 = 1;           // s: level-0 px per output px (after the 2% snap)
  double scale_level = 1;        // r: level px per output px (after the 2% snap); 1 = no resampling
  double tile_mpp_um = 0;        // resolution of the stored tiles: m0 * s
  int tile_size_px = 0;
  int stride_px = 0;
  int64_t cols = 0, rows = 0;    // grid size
  int64_t candidates = 0;        // cols * rows
  std::vector<TileSpec> tiles;   // kept tiles, row-major order

  bool resampled() const { return scale_level != 1.0; }
  // Level-0 footprint of one output tile, as read_tile reads it: T * r * d (T * s but for the 2%
  // snap of r to 1, which leaves s as asked: 0.2527 um/px tiled at 0.5 from a level of
  // downsample 2 reads 448 level-0 px a tile, not T * s = 443).
  double tile_size_l0() const { return tile_size_px * scale_level * level_downsample; }
};

// Plans the grid for a slide whose level-0 mpp is `mpp_um` (> 0). `tissue` may be null (every
// tile has tissue fraction 1). Errors: kInvalidArgument when the options are out of range (tile
// size < 8 or > 8192, stride < 1, mpp <= 0, min_tissue outside [0, 1]) or when the target is
// finer than level 0 by more than 2% (upsampling is refused: "target 0.25 µm/px is finer than
// level 0 (0.499 µm/px)"); kResourceExhausted when the grid has more than 2^26 positions
// (cols x rows; a forged slide size or a tiny stride), before anything is allocated for them.
[[nodiscard]] Result<TilePlan> plan_tiles(const SlideProperties& slide, double mpp_um, const TissueMask* tissue,
                                          const GridOptions& options);

// The positions (0..n-1, ascending) that max_tiles sampling keeps of n tiles: all when max_tiles
// is 0 or at least n, else a uniform sample of max_tiles without replacement drawn from `seed` (a
// partial Fisher-Yates shuffle with rng() % (n - i) on std::mt19937_64: the same tiles with every
// standard library). plan_tiles samples its tiles so; slide-tile's pipeline samples after the
// annotations have filtered them (--roi-only), so that the sample is of the tiles kept.
std::vector<size_t> sample_tile_positions(size_t n, int64_t max_tiles, uint64_t seed);

// Reads output tile `tile` of `plan` into `rgb` (3 * T * T bytes). Bounded memory: one level
// region of about (T * r + 2)^2 px. Errors: those of SlideReader::read_region.
[[nodiscard]] Status read_tile(const SlideReader& slide, const TilePlan& plan, const TileSpec& tile, uint8_t* rgb);

// True when tile `tile` of `plan` can be copied from the source's compressed JPEG tile: no
// resampling, stride == T, the level has raw JPEG tiles of exactly T x T px. The source tile is
// then (col, row) of plan.level.
bool can_pass_through(const SlideReader& slide, const TilePlan& plan);

// The QC picture's pixels: `thumbnail` (downsample_x x downsample_y level-0 px per pixel; when
// null, the tissue mask's own thumbnail and downsamples) with the tissue mask, sampled at each
// pixel's centre, tinted 40% toward green, and each kept tile of `plan` outlined in blue (0, 0, 255).
RgbImage draw_qc(const TissueMask& tissue, const TilePlan& plan, const RgbImage* thumbnail = nullptr,
                 double downsample_x = 0, double downsample_y = 0);

// PNG bytes of draw_qc's picture under `title`, with a legend (the tissue mask: brightfield or
// fluorescence, its fraction; the kept tiles: their count) and, when um_per_px > 0 (the picture's
// µm per pixel), a scale bar (figure.h add_legend). Errors: kInternal (an empty thumbnail, cairo,
// the PNG encoder).
[[nodiscard]] Result<std::vector<uint8_t>> render_qc_png(const TissueMask& tissue, const TilePlan& plan,
                                                         const std::string& title, double um_per_px = 0,
                                                         const RgbImage* thumbnail = nullptr, double downsample_x = 0,
                                                         double downsample_y = 0);

}  // namespace slide::tile
