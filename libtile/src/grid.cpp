// Tile grid planning, tile reading and the QC picture; the geometry is documented in grid.h.
#include "slide/tile/grid.h"

#include "slide/tile/figure.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>

namespace slide::tile {

namespace {

// Resolutions within 2% are treated as equal: scanners report 0.2527 or 0.499 µm/px for nominal
// 0.25 / 0.5, and pyramids have downsamples such as 4.0005; resampling by 1.002 would only blur.
constexpr double kSnapTolerance = 0.02;
// The most grid positions one slide may have: each kept one costs a TileSpec (48 bytes), and a
// forged header (10^7 x 10^7 px) or --stride 1 would otherwise ask for tens of gigabytes. 2^26 is
// ~100x a whole 40x section tiled at 224 px.
constexpr int64_t kMaxCandidateTiles = int64_t{1} << 26;

std::string format_um(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// floor() that forgives the last-bit error of quotients such as 1000 / (0.75 / 0.25).
int64_t floor_tolerant(double v) { return static_cast<int64_t>(std::floor(v + 1e-9)); }

}  // namespace

Result<TilePlan> plan_tiles(const SlideProperties& slide, double mpp_um, const TissueMask* tissue,
                            const GridOptions& options) {
  const int tile = options.tile_size_px;
  const int stride = options.stride_px == 0 ? tile : options.stride_px;
  if (tile < 8 || tile > 8192)
    return core::invalid_argument("tile size " + std::to_string(tile) + " px is outside 8..8192");
  if (stride < 1) return core::invalid_argument("stride " + std::to_string(options.stride_px) + " px is < 1");
  if (!(mpp_um > 0) || !std::isfinite(mpp_um))
    return core::invalid_argument("slide resolution " + format_um(mpp_um) + " µm/px is not > 0");
  if (!(options.target_mpp_um > 0) || !std::isfinite(options.target_mpp_um))
    return core::invalid_argument("target " + format_um(options.target_mpp_um) + " µm/px is not > 0");
  if (!(options.min_tissue >= 0 && options.min_tissue <= 1))
    return core::invalid_argument("min_tissue " + format_um(options.min_tissue) + " is outside [0, 1]");
  if (options.max_tiles < 0) return core::invalid_argument("max_tiles " + std::to_string(options.max_tiles) + " is < 0");
  if (slide.levels.empty() || slide.levels[0].width < 1 || slide.levels[0].height < 1)
    return core::invalid_argument("slide has no readable level 0");

  TilePlan plan;
  double s = options.target_mpp_um / mpp_um;
  if (std::abs(s - 1) <= kSnapTolerance) s = 1;
  if (s < 1)
    return core::invalid_argument("target " + format_um(options.target_mpp_um) +
                                  " µm/px is finer than level 0 (" + format_um(mpp_um) + " µm/px)");
  // OpenSlide's get_best_level_for_downsample: the coarsest level whose downsample does not
  // exceed the one asked for (with the tolerance), so a level is never upsampled.
  int level = 0;
  for (size_t i = 0; i < slide.levels.size(); ++i)
    if (slide.levels[i].downsample <= s * (1 + kSnapTolerance) && slide.levels[i].width >= 1) level = static_cast<int>(i);
  const SlideLevel& lv = slide.levels[static_cast<size_t>(level)];
  const double d = lv.downsample;
  double r = s / d;
  if (std::abs(r - 1) <= kSnapTolerance) r = 1;
  plan.level = level;
  plan.level_downsample = d;
  plan.scale_l0 = s;
  plan.scale_level = r;
  plan.tile_mpp_um = mpp_um * s;
  plan.tile_size_px = tile;
  plan.stride_px = stride;

  // Output-space size; also bounded by the level itself, so that a tile never reaches past the
  // level's last pixel when the level is a rounded W0 / d.
  const int64_t out_w = std::min(floor_tolerant(static_cast<double>(slide.levels[0].width) / s),
                                 floor_tolerant(static_cast<double>(lv.width) / r));
  const int64_t out_h = std::min(floor_tolerant(static_cast<double>(slide.levels[0].height) / s),
                                 floor_tolerant(static_cast<double>(lv.height) / r));
  plan.cols = out_w >= tile ? (out_w - tile) / stride + 1 : 0;
  plan.rows = out_h >= tile ? (out_h - tile) / stride + 1 : 0;
  if (__builtin_mul_overflow(plan.cols, plan.rows, &plan.candidates) || plan.candidates > kMaxCandidateTiles)
    return core::resource_exhausted("the tile grid is " + std::to_string(plan.cols) + " x " +
                                    std::to_string(plan.rows) + " positions, more than the " + std::to_string(kMaxCandidateTiles) +
                                    " one slide may have (a larger --stride or a coarser --mpp has fewer)");

  const double footprint_l0 = tile * r * d;
  for (int64_t row = 0; row < plan.rows; ++row) {
    for (int64_t col = 0; col < plan.cols; ++col) {
      const double x = static_cast<double>(col * stride) * r * d;
      const double y = static_cast<double>(row * stride) * r * d;
      TileSpec t;
      t.col = col;
      t.row = row;
      t.x_l0 = std::llround(x);
      t.y_l0 = std::llround(y);
      t.tissue_fraction = tissue != nullptr ? tissue->fraction_in(x, y, footprint_l0, footprint_l0) : 1.0;
      if (t.tissue_fraction >= options.min_tissue) plan.tiles.push_back(t);
    }
  }

  if (options.max_tiles > 0 && static_cast<int64_t>(plan.tiles.size()) > options.max_tiles) {
    std::vector<TileSpec> kept;
    for (size_t i : sample_tile_positions(plan.tiles.size(), options.max_tiles, options.seed))
      kept.push_back(plan.tiles[i]);
    plan.tiles = std::move(kept);
  }
  return plan;
}

std::vector<size_t> sample_tile_positions(size_t n, int64_t max_tiles, uint64_t seed) {
  std::vector<size_t> idx(n);
  std::iota(idx.begin(), idx.end(), size_t{0});
  if (max_tiles <= 0 || static_cast<uint64_t>(max_tiles) >= n) return idx;
  // A uniform sample without replacement by a partial Fisher-Yates shuffle of the indices, then
  // back to grid order. The draw is rng() % n rather than std::uniform_int_distribution, whose
  // algorithm differs between standard libraries: the same seed gives the same tiles everywhere
  // (the modulo bias is below n / 2^64).
  const auto k = static_cast<size_t>(max_tiles);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < k; ++i) std::swap(idx[i], idx[i + static_cast<size_t>(rng() % (n - i))]);
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

Status read_tile(const SlideReader& slide, const TilePlan& plan, const TileSpec& tile, uint8_t* rgb) {
  const int64_t T = plan.tile_size_px;
  const double r = plan.scale_level;
  const double d = plan.level_downsample;
  const std::string where = "tile (col=" + std::to_string(tile.col) + ", row=" + std::to_string(tile.row) + ")";
  if (!plan.resampled()) {
    // Level pixels [col * stride, + T) exactly; x_l0 = round(col * stride * d) maps back to them.
    SLIDE_RETURN_IF_ERROR_CTX(slide.read_region(tile.x_l0, tile.y_l0, plan.level, T, T, rgb), where);
    return core::ok_status();
  }
  // The level region the tile's area covers: [fx, fx + T * r) rounded out to whole pixels.
  const double fx = static_cast<double>(tile.col * plan.stride_px) * r;
  const double fy = static_cast<double>(tile.row * plan.stride_px) * r;
  const int64_t ix = static_cast<int64_t>(std::floor(fx));
  const int64_t iy = static_cast<int64_t>(std::floor(fy));
  const double ox = fx - static_cast<double>(ix), oy = fy - static_cast<double>(iy);
  RgbImage region(static_cast<int64_t>(std::ceil(ox + static_cast<double>(T) * r)),
                  static_cast<int64_t>(std::ceil(oy + static_cast<double>(T) * r)));
  Status s = slide.read_region(std::llround(static_cast<double>(ix) * d), std::llround(static_cast<double>(iy) * d),
                               plan.level, region.width, region.height, region.pixels.data());
  if (!s.ok()) {
    std::fill(rgb, rgb + 3 * T * T, uint8_t{0});
    return s.with_context(where);
  }
  RgbImage out(T, T);
  resample_area(region, ox, oy, r, &out);
  std::copy(out.pixels.begin(), out.pixels.end(), rgb);
  return core::ok_status();
}

bool can_pass_through(const SlideReader& slide, const TilePlan& plan) {
  const SlideProperties& props = slide.properties();
  if (plan.resampled() || plan.stride_px != plan.tile_size_px) return false;
  if (plan.level < 0 || static_cast<size_t>(plan.level) >= props.levels.size()) return false;
  const SlideLevel& lv = props.levels[static_cast<size_t>(plan.level)];
  return lv.tile_width == plan.tile_size_px && lv.tile_height == plan.tile_size_px && slide.has_raw_jpeg_tiles(plan.level);
}

RgbImage draw_qc(const TissueMask& tissue, const TilePlan& plan, const RgbImage* thumbnail, double downsample_x,
                 double downsample_y) {
  if (thumbnail == nullptr) thumbnail = &tissue.thumbnail, downsample_x = tissue.downsample_x, downsample_y = tissue.downsample_y;
  RgbImage img = *thumbnail;
  const int64_t w = img.width, h = img.height;
  if (w < 1 || h < 1 || !(downsample_x > 0) || !(downsample_y > 0)) return img;
  const int64_t mw = tissue.width(), mh = tissue.height();
  if (mw > 0 && mh > 0 && tissue.mask.size() == static_cast<size_t>(mw * mh)) {
    // Tissue: 40% toward green, so the stain stays visible under the tint. The mask is sampled at
    // each pixel's centre (nearest mask pixel): the picture may be finer than the mask.
    const double sx = downsample_x / tissue.downsample_x, sy = downsample_y / tissue.downsample_y;
    for (int64_t y = 0; y < h; ++y) {
      const int64_t my = std::min<int64_t>(mh - 1, static_cast<int64_t>((static_cast<double>(y) + 0.5) * sy));
      for (int64_t x = 0; x < w; ++x) {
        const int64_t mx = std::min<int64_t>(mw - 1, static_cast<int64_t>((static_cast<double>(x) + 0.5) * sx));
        if (tissue.mask[static_cast<size_t>(my * mw + mx)] == 0) continue;
        uint8_t* p = img.row(y) + 3 * x;
        p[0] = static_cast<uint8_t>((p[0] * 3) / 5);
        p[1] = static_cast<uint8_t>((p[1] * 3 + 255 * 2) / 5);
        p[2] = static_cast<uint8_t>((p[2] * 3) / 5);
      }
    }
  }
  auto put = [&](int64_t x, int64_t y) {
    if (x < 0 || y < 0 || x >= w || y >= h) return;
    uint8_t* p = img.row(y) + 3 * x;
    p[0] = 0, p[1] = 0, p[2] = 255;
  };
  const double size_l0 = plan.tile_size_px * plan.scale_level * plan.level_downsample;
  for (const TileSpec& t : plan.tiles) {
    // Outline in picture px: the level-0 footprint divided by the picture's downsample.
    const int64_t x0 = static_cast<int64_t>(std::floor(static_cast<double>(t.x_l0) / downsample_x));
    const int64_t y0 = static_cast<int64_t>(std::floor(static_cast<double>(t.y_l0) / downsample_y));
    const int64_t x1 = std::max(x0, static_cast<int64_t>(std::ceil((static_cast<double>(t.x_l0) + size_l0) / downsample_x)) - 1);
    const int64_t y1 = std::max(y0, static_cast<int64_t>(std::ceil((static_cast<double>(t.y_l0) + size_l0) / downsample_y)) - 1);
    for (int64_t x = x0; x <= x1; ++x) put(x, y0), put(x, y1);
    for (int64_t y = y0; y <= y1; ++y) put(x0, y), put(x1, y);
  }
  return img;
}

Result<std::vector<uint8_t>> render_qc_png(const TissueMask& tissue, const TilePlan& plan, const std::string& title,
                                           double um_per_px, const RgbImage* thumbnail, double downsample_x,
                                           double downsample_y) {
  const RgbImage img = draw_qc(tissue, plan, thumbnail, downsample_x, downsample_y);
  if (img.width < 1 || img.height < 1) return core::internal_error("QC picture: empty thumbnail");
  std::vector<LegendEntry> legend(2);
  legend[0].label = "tissue mask (" + std::string(tissue.fluorescence ? "fluorescence" : "brightfield") + ", " +
                    std::to_string(static_cast<int>(std::lround(100 * tissue.tissue_fraction()))) + "%)";
  legend[0].rgb[1] = 200;
  legend[1].label = "kept tiles (" + std::to_string(plan.tiles.size()) + ")";
  legend[1].rgb[2] = 255, legend[1].outline = true;
  SLIDE_ASSIGN_OR_RETURN(RgbImage fig, add_legend(img, title, legend, um_per_px));
  auto png = encode_png(fig);
  if (!png.ok()) return png.status().with_context("QC picture");
  return png;
}

}  // namespace slide::tile
