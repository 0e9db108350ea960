// Figures: what a reader needs beside the pixels (titles, colour bars with labelled ticks), drawn
// with cairo (Debian's libcairo2-dev, its image surfaces and toy text API; font "DejaVu Sans",
// Debian's fonts-dejavu-core, which fontconfig finds) on RgbImage.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "slide/core/status.h"
#include "slide/tile/image.h"

namespace slide::tile {

using core::Result;

// The jet colormap (matplotlib's "jet", piecewise linear): 0 dark blue, 0.5 green-yellow, 1 dark
// red; v is clamped to [0, 1].
void jet_colour(double v, uint8_t rgb[3]);

// A vertical colour bar: the jet colormap from `low` (bottom) to `high` (top), `ticks` (>= 2)
// evenly spaced labelled ticks (printf "%g" of the value, then `unit`), and `scale` written under
// the bar in small type (e.g. "absolute" or "percentile within the slide"), so the scale is stated
// on the image.
struct ColourBar {
  std::string title;   // one line above the image, e.g. "p(tumor): slide-1"
  double low = 0, high = 1;
  std::string unit;    // appended to each tick label, e.g. "%"
  std::string scale;   // e.g. "probability, absolute scale"
  int ticks = 5;
};

// `image` with a 28-px title band above it and a 110-px panel at its right holding the colour bar
// (at least 200 px tall: a smaller image is padded with white below): (image.width + 110) x
// (28 + max(image.height, 200)) px. The title's type shrinks (to 7 px) to fit the width. The
// image's pixels are copied unchanged, at (0, 28). Errors: kInvalidArgument (an empty image, ticks < 2, low/high not finite),
// kInternal naming the cairo call and cairo's status string.
[[nodiscard]] Result<RgbImage> add_colour_bar(const RgbImage& image, const ColourBar& bar);

// A legend entry: a 14-px swatch of `rgb`, filled, or drawn as a 2-px outline (a tile's frame),
// and its label.
struct LegendEntry {
  std::string label;
  uint8_t rgb[3] = {0, 0, 0};
  bool outline = false;
};
// `image` under a 28-px title band and above a 30-px legend band: the entries left to right, and,
// when um_per_px > 0 (the image's resolution, µm per pixel), a scale bar at the right end of a
// round length (1, 2 or 5 x 10^k µm, at most a quarter of the figure's width, labelled in µm or
// mm). The figure is max(image.width, 420) x (image.height + 58) px; the image's pixels are copied
// unchanged at (0, 28), white padding right of a narrow image. Errors: kInvalidArgument (an empty
// image, um_per_px not finite or < 0), kInternal from cairo.
[[nodiscard]] Result<RgbImage> add_legend(const RgbImage& image, const std::string& title,
                                          const std::vector<LegendEntry>& entries, double um_per_px = 0);

// The scale bar's length for add_legend: the largest 1, 2 or 5 x 10^k µm at most max_um (0 when
// max_um < 1).
double scale_bar_um(double max_um);

// Line charts (training curves): panels side by side under one title, each with axes, ticks at
// round numbers (1, 2 or 5 x 10^k) labelled, axis labels, grid lines and a legend; each series a
// line with a filled dot per point. A point whose y is not finite is left out (a gap).
struct Series {
  std::string name;
  uint8_t rgb[3] = {0, 0, 0};
  std::vector<double> x, y;
};
struct Panel {
  std::string title, x_label, y_label;
  std::vector<Series> series;
  double y_min = NAN, y_max = NAN;  // NaN: from the data (with 0 included)
  bool integer_x = true;            // x ticks at whole numbers (epochs)
};
// A figure `panel_w` x `panel_h` px per panel plus a 32-px title band. Errors: kInvalidArgument
// (no panels, panels under 200 x 150 px, a series whose x and y sizes differ), kInternal from cairo.
[[nodiscard]] Result<RgbImage> draw_line_charts(const std::string& title, const std::vector<Panel>& panels,
                                                int64_t panel_w = 480, int64_t panel_h = 360);

}  // namespace slide::tile
