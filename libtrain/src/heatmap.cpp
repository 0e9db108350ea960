#include "slide/train/heatmap.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "slide/tile/figure.h"
#include "slide/tile/slide.h"
#include "slide/tile/tissue.h"

namespace slide::train {

using slide::core::invalid_argument;
using slide::tile::RgbImage;

std::vector<double> percentile_ranks(const std::vector<float>& values) {
  const size_t n = values.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return values[a] < values[b]; });
  std::vector<double> pct(n, 1.0);
  for (size_t r = 0; r < n; ++r) pct[order[r]] = n > 1 ? static_cast<double>(r) / static_cast<double>(n - 1) : 1.0;
  return pct;
}

int64_t coords_grid_step(const std::vector<int32_t>& coords) {
  int64_t step = 0;
  const size_t n = coords.size() / 2;
  for (size_t axis = 0; axis < 2; ++axis) {
    std::vector<int32_t> v;
    for (size_t i = 0; i < n; ++i) v.push_back(coords[2 * i + axis]);
    std::sort(v.begin(), v.end());
    for (size_t i = 1; i < v.size(); ++i)
      if (v[i] > v[i - 1] && (step == 0 || v[i] - v[i - 1] < step)) step = v[i] - v[i - 1];
  }
  return step == 0 ? 1 : step;
}

Result<HeatmapCanvas> heatmap_canvas(const std::string& slide_path, int64_t tile_l0_px, int64_t min_long_side_px,
                                     int64_t expect_width_l0, int64_t expect_height_l0) {
  SLIDE_ASSIGN_OR_RETURN(auto slide, slide::tile::open_slide(slide_path));
  const auto& l0 = slide->properties().levels.at(0);
  if ((expect_width_l0 > 0 || expect_height_l0 > 0) && (l0.width != expect_width_l0 || l0.height != expect_height_l0))
    return slide::core::failed_precondition(
        slide_path + ": level 0 is " + std::to_string(l0.width) + " x " + std::to_string(l0.height) +
        " px, the tiles were cut from a slide of " + std::to_string(expect_width_l0) + " x " +
        std::to_string(expect_height_l0) + " px: another file under that name");
  const auto longest = static_cast<double>(std::max(l0.width, l0.height));
  double ds = static_cast<double>(tile_l0_px) / 8.0;
  if (min_long_side_px > 0) ds = std::min(ds, longest / static_cast<double>(min_long_side_px));
  ds = std::max({1.0, ds, longest / static_cast<double>(kMaxHeatmapSidePx)});
  HeatmapCanvas c;
  SLIDE_ASSIGN_OR_RETURN(c.thumbnail, slide::tile::make_thumbnail(*slide, ds, &c.downsample_x, &c.downsample_y));
  return c;
}

Result<RgbImage> draw_tile_grid(const std::vector<double>& values, const std::vector<int32_t>& coords,
                                int64_t tile_l0_px, const std::string& what, int cell_px) {
  const size_t n = values.size();
  if (n == 0 || coords.size() != 2 * n || cell_px < 1)
    return invalid_argument(what + ": " + std::to_string(n) + " values for " + std::to_string(coords.size() / 2) +
                            " tile coordinates");
  int64_t x0 = coords[0], y0 = coords[1], x1 = coords[0], y1 = coords[1];
  for (size_t i = 0; i < n; ++i) {
    x0 = std::min<int64_t>(x0, coords[2 * i]), x1 = std::max<int64_t>(x1, coords[2 * i]);
    y0 = std::min<int64_t>(y0, coords[2 * i + 1]), y1 = std::max<int64_t>(y1, coords[2 * i + 1]);
  }
  if (tile_l0_px <= 0) tile_l0_px = coords_grid_step(coords);
  // A tile's cell: its offset in tile sides, rounded to the nearest. The grid's level-0 step is
  // rarely a whole number (0.2525 um/px tiled at 0.5 um/px, 256 px: 506.93 px, tiles at
  // llround(col x step)) while tile_l0_px is rounded (507): flooring put column 8 (x = 4055,
  // 7.998 sides) into column 7's cell, and every later column one to the left.
  // Overlapping tiles (slide-tile --stride under the tile side): a tile's cell is its offset in
  // strides instead, else tiles half a side apart would share a cell and the later would hide the
  // earlier. The stride is the span over the number of steps it holds: the smallest gap between
  // coordinates is rounded (506 for a 506.93 px step) and would drift over many columns.
  double pitch = static_cast<double>(tile_l0_px);
  if (const int64_t gap = coords_grid_step(coords); n > 1 && gap * 10 < tile_l0_px * 9) {
    const int64_t span = std::max(x1 - x0, y1 - y0);
    pitch = static_cast<double>(span) /
            static_cast<double>(std::max<int64_t>(1, std::llround(static_cast<double>(span) / static_cast<double>(gap))));
  }
  auto cell = [&](int64_t offset) { return std::llround(static_cast<double>(offset) / pitch); };
  const int64_t cols = cell(x1 - x0) + 1, rows = cell(y1 - y0) + 1;
  if (cols * rows > int64_t{1} << 24)
    return invalid_argument(what + ": a tile grid of " + std::to_string(cols) + " x " + std::to_string(rows) +
                            " cells is too large for a heatmap");
  // Cells shrink (down to 1 px) so that the figure's longer side stays within 4096 px where the
  // grid allows it, as heatmap_canvas bounds a thumbnail: 8 px cells over a 2^12-cell side would
  // be a 32768 px, 3 GiB image.
  cell_px = static_cast<int>(std::clamp<int64_t>(kMaxHeatmapSidePx / std::max(cols, rows), 1, cell_px));
  RgbImage img(cols * cell_px, rows * cell_px, 255);
  for (size_t i = 0; i < n; ++i) {
    const int64_t cx = cell(coords[2 * i] - x0), cy = cell(coords[2 * i + 1] - y0);
    uint8_t rgb[3];
    slide::tile::jet_colour(values[i], rgb);
    for (int64_t y = cy * cell_px; y < (cy + 1) * cell_px; ++y)
      for (int64_t x = cx * cell_px; x < (cx + 1) * cell_px; ++x) {
        uint8_t* p = img.row(y) + 3 * x;
        p[0] = rgb[0], p[1] = rgb[1], p[2] = rgb[2];
      }
  }
  return img;
}

Result<RgbImage> draw_tile_overlay(const std::vector<double>& values, const std::vector<int32_t>& coords,
                                   int64_t tile_l0_px, const HeatmapCanvas& canvas, const std::string& what) {
  const size_t n = values.size();
  const RgbImage& thumb = canvas.thumbnail;
  const double dx = canvas.downsample_x, dy = canvas.downsample_y;
  if (n == 0 || coords.size() != 2 * n || thumb.width < 1 || thumb.height < 1 || !(dx > 0) || !(dy > 0))
    return invalid_argument(what + ": " + std::to_string(n) + " values for " + std::to_string(coords.size() / 2) +
                            " tile coordinates over a " + std::to_string(thumb.width) + " x " +
                            std::to_string(thumb.height) + " thumbnail");
  if (tile_l0_px <= 0) tile_l0_px = coords_grid_step(coords);
  // Each tile's rectangle in thumbnail pixels, clipped; the box around them all.
  struct Rect {
    int64_t x0, y0, x1, y1;
  };
  std::vector<Rect> rects(n);
  int64_t bx0 = thumb.width, by0 = thumb.height, bx1 = 0, by1 = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto px0 = static_cast<int64_t>(std::floor(coords[2 * i] / dx));
    const auto py0 = static_cast<int64_t>(std::floor(coords[2 * i + 1] / dy));
    const auto px1 = std::max(px0 + 1, static_cast<int64_t>(std::floor((coords[2 * i] + tile_l0_px) / dx)));
    const auto py1 = std::max(py0 + 1, static_cast<int64_t>(std::floor((coords[2 * i + 1] + tile_l0_px) / dy)));
    Rect& r = rects[i];
    r = {std::max<int64_t>(px0, 0), std::max<int64_t>(py0, 0), std::min(px1, thumb.width), std::min(py1, thumb.height)};
    if (r.x0 < r.x1 && r.y0 < r.y1)
      bx0 = std::min(bx0, r.x0), by0 = std::min(by0, r.y0), bx1 = std::max(bx1, r.x1), by1 = std::max(by1, r.y1);
  }
  RgbImage img = thumb;
  if (bx0 >= bx1 || by0 >= by1) return img;  // every tile outside the thumbnail
  // A pixel under several tiles (overlapping tiles: --stride under the tile side) takes the mean of
  // their values, as CLAM's overlapping heatmaps do, blended once: blending each tile in turn would
  // bury the slide under the colour and weigh the last tiles most.
  const int64_t bw = bx1 - bx0;
  std::vector<float> sum(static_cast<size_t>(bw * (by1 - by0)), 0.0f), count(sum.size(), 0.0f);
  for (size_t i = 0; i < n; ++i) {
    const Rect& r = rects[i];
    for (int64_t y = r.y0; y < r.y1; ++y)
      for (int64_t x = r.x0; x < r.x1; ++x) {
        const auto k = static_cast<size_t>((y - by0) * bw + (x - bx0));
        sum[k] += static_cast<float>(values[i]), count[k] += 1.0f;
      }
  }
  for (int64_t y = by0; y < by1; ++y)
    for (int64_t x = bx0; x < bx1; ++x) {
      const auto k = static_cast<size_t>((y - by0) * bw + (x - bx0));
      if (count[k] == 0.0f) continue;
      uint8_t rgb[3];
      slide::tile::jet_colour(static_cast<double>(sum[k] / count[k]), rgb);
      uint8_t* p = img.row(y) + 3 * x;
      for (int c = 0; c < 3; ++c) p[c] = static_cast<uint8_t>((p[c] + rgb[c] + 1) / 2);
    }
  return img;
}

}  // namespace slide::train
