#include "slide/tile/figure.h"

#include <cairo.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numbers>

namespace slide::tile {

namespace {

using core::Status;

constexpr int kTitleBand = 28;    // px above the image
constexpr int kPanel = 110;       // px at its right
constexpr int kMinHeight = 200;   // the bar's panel, at least
constexpr const char* kFont = "DejaVu Sans";

Status cairo_failed(const char* what, cairo_status_t st) {
  return core::internal_error(std::string("cairo: ") + what + ": " + cairo_status_to_string(st));
}

// An RGB24 image surface's pixels (one native-endian uint32 0x00RRGGBB a pixel) as an RgbImage.
RgbImage to_image(cairo_surface_t* surface) {
  cairo_surface_flush(surface);
  const unsigned char* data = cairo_image_surface_get_data(surface);
  const int stride = cairo_image_surface_get_stride(surface);
  RgbImage out(cairo_image_surface_get_width(surface), cairo_image_surface_get_height(surface));
  for (int64_t y = 0; y < out.height; ++y) {
    const auto* row = reinterpret_cast<const uint32_t*>(data + y * stride);
    uint8_t* dst = out.row(y);
    for (int64_t x = 0; x < out.width; ++x)
      dst[3 * x] = static_cast<uint8_t>(row[x] >> 16), dst[3 * x + 1] = static_cast<uint8_t>(row[x] >> 8),
      dst[3 * x + 2] = static_cast<uint8_t>(row[x]);
  }
  return out;
}

using Surface = std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)>;

// A white W x H RGB24 surface with `image`'s pixels copied in at (0, kTitleBand) (RGB24: one
// native-endian uint32 0x00RRGGBB a pixel). Errors: kInvalidArgument past cairo's 32767 px,
// kInternal from cairo.
Result<Surface> canvas_with_image(const RgbImage& image, int64_t W, int64_t H, const char* what) {
  if (W > 32767 || H > 32767) return core::invalid_argument(std::string(what) + ": the figure would exceed cairo's 32767 px");
  Surface surface(cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(W), static_cast<int>(H)),
                  cairo_surface_destroy);
  if (auto st = cairo_surface_status(surface.get()); st != CAIRO_STATUS_SUCCESS) return cairo_failed("image surface", st);
  cairo_surface_flush(surface.get());
  unsigned char* data = cairo_image_surface_get_data(surface.get());
  const int stride = cairo_image_surface_get_stride(surface.get());
  for (int64_t y = 0; y < H; ++y) {
    auto* row = reinterpret_cast<uint32_t*>(data + y * stride);
    std::fill(row, row + W, 0x00FFFFFFu);
    const int64_t iy = y - kTitleBand;
    if (iy < 0 || iy >= image.height) continue;
    const uint8_t* src = image.row(iy);
    for (int64_t x = 0; x < image.width; ++x)
      row[x] = (uint32_t{src[3 * x]} << 16) | (uint32_t{src[3 * x + 1]} << 8) | uint32_t{src[3 * x + 2]};
  }
  cairo_surface_mark_dirty(surface.get());
  return surface;
}

// The title in the band above the image: 14 px, smaller (down to 7 px) when it would not fit
// the figure's width W.
void draw_title(cairo_t* c, const std::string& title, int64_t W) {
  cairo_select_font_face(c, kFont, CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_source_rgb(c, 0, 0, 0);
  cairo_set_font_size(c, 14);
  cairo_text_extents_t ext;
  cairo_text_extents(c, title.c_str(), &ext);
  if (ext.x_advance > static_cast<double>(W) - 12)
    cairo_set_font_size(c, std::max(7.0, 14.0 * (static_cast<double>(W) - 12) / ext.x_advance));
  cairo_move_to(c, 6, 19);
  cairo_show_text(c, title.c_str());
}

}  // namespace

void jet_colour(double v, uint8_t rgb[3]) {
  v = std::clamp(std::isfinite(v) ? v : 0.0, 0.0, 1.0);
  auto ch = [&](double c) {
    return static_cast<uint8_t>(std::lround(255.0 * std::clamp(1.5 - std::abs(4.0 * v - c), 0.0, 1.0)));
  };
  rgb[0] = ch(3.0), rgb[1] = ch(2.0), rgb[2] = ch(1.0);
}

Result<RgbImage> add_colour_bar(const RgbImage& image, const ColourBar& bar) {
  if (image.width < 1 || image.height < 1 || bar.ticks < 2 || !std::isfinite(bar.low) || !std::isfinite(bar.high))
    return core::invalid_argument("colour bar: an image of " + std::to_string(image.width) + " x " +
                                  std::to_string(image.height) + " px, " + std::to_string(bar.ticks) + " ticks");
  const int64_t W = image.width + kPanel;
  const int64_t H = kTitleBand + std::max<int64_t>(image.height, kMinHeight);
  SLIDE_ASSIGN_OR_RETURN(Surface surface, canvas_with_image(image, W, H, "colour bar"));
  std::unique_ptr<cairo_t, decltype(&cairo_destroy)> cr(cairo_create(surface.get()), cairo_destroy);
  cairo_t* c = cr.get();
  draw_title(c, bar.title, W);
  // The bar: 18 px wide, from the image's top to its bottom (or kMinHeight), high at the top.
  const double bx = static_cast<double>(image.width) + 14, bw = 18, by = kTitleBand + 8;
  const double bh = static_cast<double>(H - kTitleBand) - 16 - 40;  // room for the scale's note
  cairo_pattern_t* grad = cairo_pattern_create_linear(0, by + bh, 0, by);
  for (int i = 0; i <= 16; ++i) {
    uint8_t rgb[3];
    jet_colour(i / 16.0, rgb);
    cairo_pattern_add_color_stop_rgb(grad, i / 16.0, rgb[0] / 255.0, rgb[1] / 255.0, rgb[2] / 255.0);
  }
  cairo_rectangle(c, bx, by, bw, bh);
  cairo_set_source(c, grad);
  cairo_fill_preserve(c);
  cairo_pattern_destroy(grad);
  cairo_set_source_rgb(c, 0, 0, 0);
  cairo_set_line_width(c, 1);
  cairo_stroke(c);
  // Ticks and their labels.
  cairo_set_font_size(c, 11);
  for (int t = 0; t < bar.ticks; ++t) {
    const double f = t / static_cast<double>(bar.ticks - 1);
    const double y = std::round(by + bh - f * bh) + 0.5;
    cairo_move_to(c, bx + bw, y);
    cairo_line_to(c, bx + bw + 5, y);
    cairo_stroke(c);
    char label[64];
    std::snprintf(label, sizeof label, "%g%s", bar.low + f * (bar.high - bar.low), bar.unit.c_str());
    cairo_move_to(c, bx + bw + 8, y + 4);
    cairo_show_text(c, label);
  }
  // The scale's note, under the bar, wrapped at spaces to the panel's width.
  cairo_set_font_size(c, 9);
  std::string line, rest = bar.scale;
  double ny = by + bh + 14;
  while (!rest.empty() && ny < static_cast<double>(H) - 2) {
    size_t cut = rest.size();
    cairo_text_extents_t ext;
    while (true) {
      cairo_text_extents(c, rest.substr(0, cut).c_str(), &ext);
      if (ext.x_advance <= kPanel - 8 || cut <= 1) break;
      const size_t space = rest.rfind(' ', cut - 1);
      cut = space == std::string::npos || space == 0 ? cut - 1 : space;
    }
    cairo_move_to(c, static_cast<double>(image.width) + 6, ny);
    cairo_show_text(c, rest.substr(0, cut).c_str());
    rest = rest.substr(std::min(rest.size(), cut + (cut < rest.size() && rest[cut] == ' ' ? 1 : 0)));
    ny += 11;
  }
  if (auto st = cairo_status(c); st != CAIRO_STATUS_SUCCESS) return cairo_failed("drawing", st);
  return to_image(surface.get());
}

double scale_bar_um(double max_um) {
  if (!(max_um >= 1) || !std::isfinite(max_um)) return 0;
  const double p = std::pow(10.0, std::floor(std::log10(max_um)));
  for (double m : {5.0, 2.0, 1.0})
    if (m * p <= max_um) return m * p;
  return p;
}

Result<RgbImage> add_legend(const RgbImage& image, const std::string& title, const std::vector<LegendEntry>& entries,
                            double um_per_px) {
  constexpr int kLegendBand = 30, kMinWidth = 420;
  if (image.width < 1 || image.height < 1 || !std::isfinite(um_per_px) || um_per_px < 0)
    return core::invalid_argument("legend: an image of " + std::to_string(image.width) + " x " +
                                  std::to_string(image.height) + " px at " + std::to_string(um_per_px) + " um/px");
  const int64_t W = std::max<int64_t>(image.width, kMinWidth), H = kTitleBand + image.height + kLegendBand;
  SLIDE_ASSIGN_OR_RETURN(Surface surface, canvas_with_image(image, W, H, "legend"));
  std::unique_ptr<cairo_t, decltype(&cairo_destroy)> cr(cairo_create(surface.get()), cairo_destroy);
  cairo_t* c = cr.get();
  draw_title(c, title, W);
  cairo_text_extents_t ext;
  // The legend band: swatches and labels from the left.
  const double band = static_cast<double>(kTitleBand + image.height);
  cairo_set_font_size(c, 11);
  double x = 6;
  for (const LegendEntry& e : entries) {
    cairo_set_source_rgb(c, e.rgb[0] / 255.0, e.rgb[1] / 255.0, e.rgb[2] / 255.0);
    if (e.outline) {
      cairo_set_line_width(c, 2);
      cairo_rectangle(c, x + 1, band + 9, 12, 12);
      cairo_stroke(c);
    } else {
      cairo_rectangle(c, x, band + 8, 14, 14);
      cairo_fill(c);
    }
    cairo_set_source_rgb(c, 0, 0, 0);
    cairo_move_to(c, x + 19, band + 19);
    cairo_show_text(c, e.label.c_str());
    cairo_text_extents(c, e.label.c_str(), &ext);
    x += 19 + ext.x_advance + 14;
  }
  // The scale bar at the right end.
  // The scale bar at the right end, in what the entries left (at most a quarter of the width),
  // its length written above it.
  if (um_per_px > 0) {
    const double room = std::min(static_cast<double>(W) / 4, static_cast<double>(W) - 8 - x - 6);
    const double um = scale_bar_um(um_per_px * room);
    if (um > 0) {
      const double len = um / um_per_px;
      char label[32];
      if (um >= 1000) std::snprintf(label, sizeof label, "%g mm", um / 1000);
      else std::snprintf(label, sizeof label, "%g um", um);
      cairo_set_font_size(c, 10);
      cairo_text_extents(c, label, &ext);
      const double x1 = static_cast<double>(W) - 8, x0 = x1 - len;
      cairo_set_source_rgb(c, 0, 0, 0);
      cairo_rectangle(c, x0, band + 19, len, 4);
      cairo_fill(c);
      cairo_move_to(c, x1 - ext.x_advance, band + 14);
      cairo_show_text(c, label);
    }
  }
  if (auto st = cairo_status(c); st != CAIRO_STATUS_SUCCESS) return cairo_failed("drawing", st);
  return to_image(surface.get());
}

namespace {

// Round tick positions over [lo, hi]: a step of 1, 2 or 5 x 10^k giving about `want` ticks.
std::vector<double> nice_ticks(double lo, double hi, int want, bool integer) {
  if (!(hi > lo)) hi = lo + 1;
  double raw = (hi - lo) / std::max(1, want);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  if (integer) step = std::max(1.0, std::round(step));
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step - 1e-9) * step; t <= hi + 1e-9 * step; t += step) ticks.push_back(t);
  return ticks;
}

std::string tick_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", std::abs(v) < 1e-12 ? 0.0 : v);
  return buf;
}

}  // namespace

Result<RgbImage> draw_line_charts(const std::string& title, const std::vector<Panel>& panels, int64_t panel_w,
                                  int64_t panel_h) {
  if (panels.empty() || panel_w < 200 || panel_h < 150)
    return core::invalid_argument("line charts: " + std::to_string(panels.size()) + " panels of " +
                                  std::to_string(panel_w) + " x " + std::to_string(panel_h) + " px");
  for (const Panel& p : panels)
    for (const Series& s : p.series)
      if (s.x.size() != s.y.size())
        return core::invalid_argument("line charts: series '" + s.name + "' has " + std::to_string(s.x.size()) +
                                      " x and " + std::to_string(s.y.size()) + " y values");
  constexpr int kTitle = 32;
  const int64_t W = panel_w * static_cast<int64_t>(panels.size()), H = kTitle + panel_h;
  if (W > 32767 || H > 32767) return core::invalid_argument("line charts: the figure would exceed cairo's 32767 px");
  std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> surface(
      cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(W), static_cast<int>(H)), cairo_surface_destroy);
  if (auto st = cairo_surface_status(surface.get()); st != CAIRO_STATUS_SUCCESS) return cairo_failed("image surface", st);
  std::unique_ptr<cairo_t, decltype(&cairo_destroy)> cr(cairo_create(surface.get()), cairo_destroy);
  cairo_t* c = cr.get();
  cairo_set_source_rgb(c, 1, 1, 1);
  cairo_paint(c);
  cairo_select_font_face(c, kFont, CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  auto text_at = [&](double x, double y, const std::string& t, double size, double align) {
    cairo_set_font_size(c, size);
    cairo_text_extents_t e;
    cairo_text_extents(c, t.c_str(), &e);
    cairo_move_to(c, x - align * e.x_advance, y);
    cairo_show_text(c, t.c_str());
  };
  cairo_set_source_rgb(c, 0, 0, 0);
  text_at(static_cast<double>(W) / 2, 22, title, 15, 0.5);
  for (size_t k = 0; k < panels.size(); ++k) {
    const Panel& p = panels[k];
    // The plot area inside the panel: room for tick labels and axis labels left and below.
    const double x0 = static_cast<double>(panel_w) * static_cast<double>(k) + 62, x1 = x0 + static_cast<double>(panel_w) - 82;
    const double y0 = kTitle + 28, y1 = static_cast<double>(H) - 48;
    double xmin = INFINITY, xmax = -INFINITY, ymin = 0, ymax = -INFINITY;
    for (const Series& s : p.series)
      for (size_t i = 0; i < s.x.size(); ++i) {
        xmin = std::min(xmin, s.x[i]), xmax = std::max(xmax, s.x[i]);
        if (std::isfinite(s.y[i])) ymin = std::min(ymin, s.y[i]), ymax = std::max(ymax, s.y[i]);
      }
    if (!std::isfinite(xmin)) xmin = 0, xmax = 1;
    if (xmax <= xmin) xmax = xmin + 1;
    if (!std::isfinite(ymax) || ymax <= ymin) ymax = ymin + 1;
    if (std::isfinite(p.y_min)) ymin = p.y_min;
    if (std::isfinite(p.y_max)) ymax = p.y_max;
    const std::vector<double> yt = nice_ticks(ymin, ymax, 5, false), xt = nice_ticks(xmin, xmax, 6, p.integer_x);
    ymax = std::max(ymax, yt.back());
    auto X = [&](double v) { return x0 + (v - xmin) / (xmax - xmin) * (x1 - x0); };
    auto Y = [&](double v) { return y1 - (v - ymin) / (ymax - ymin) * (y1 - y0); };
    // Grid, axes, ticks and their labels.
    cairo_set_line_width(c, 1);
    for (double t : yt) {
      cairo_set_source_rgb(c, 0.88, 0.88, 0.88);
      cairo_move_to(c, x0, std::round(Y(t)) + 0.5);
      cairo_line_to(c, x1, std::round(Y(t)) + 0.5);
      cairo_stroke(c);
      cairo_set_source_rgb(c, 0, 0, 0);
      text_at(x0 - 6, Y(t) + 4, tick_text(t), 11, 1.0);
    }
    for (double t : xt) {
      if (t < xmin - 1e-9 || t > xmax + 1e-9) continue;
      cairo_set_source_rgb(c, 0, 0, 0);
      cairo_move_to(c, std::round(X(t)) + 0.5, y1);
      cairo_line_to(c, std::round(X(t)) + 0.5, y1 + 5);
      cairo_stroke(c);
      text_at(X(t), y1 + 18, tick_text(t), 11, 0.5);
    }
    cairo_set_source_rgb(c, 0, 0, 0);
    cairo_rectangle(c, x0 + 0.5, y0 + 0.5, x1 - x0, y1 - y0);
    cairo_stroke(c);
    text_at((x0 + x1) / 2, y0 - 10, p.title, 13, 0.5);
    text_at((x0 + x1) / 2, static_cast<double>(H) - 12, p.x_label, 12, 0.5);
    cairo_save(c);
    cairo_translate(c, x0 - 44, (y0 + y1) / 2);
    cairo_rotate(c, -std::numbers::pi / 2);
    text_at(0, 0, p.y_label, 12, 0.5);
    cairo_restore(c);
    // The series: a line, then a filled dot per point.
    for (const Series& s : p.series) {
      cairo_set_source_rgb(c, s.rgb[0] / 255.0, s.rgb[1] / 255.0, s.rgb[2] / 255.0);
      cairo_set_line_width(c, 2);
      bool pen = false;
      for (size_t i = 0; i < s.x.size(); ++i) {
        if (!std::isfinite(s.y[i])) {
          pen = false;
          continue;
        }
        if (pen) cairo_line_to(c, X(s.x[i]), Y(s.y[i]));
        else cairo_move_to(c, X(s.x[i]), Y(s.y[i]));
        pen = true;
      }
      cairo_stroke(c);
      for (size_t i = 0; i < s.x.size(); ++i) {
        if (!std::isfinite(s.y[i])) continue;
        cairo_arc(c, X(s.x[i]), Y(s.y[i]), 4, 0, 2 * std::numbers::pi);
        cairo_fill(c);
      }
    }
    // The legend, top right inside the plot, on white so that the lines under it do not hide it.
    if (!p.series.empty()) {
      cairo_rectangle(c, x1 - 156, y0 + 4, 150, 16.0 * static_cast<double>(p.series.size()) + 4);
      cairo_set_source_rgb(c, 1, 1, 1);
      cairo_fill_preserve(c);
      cairo_set_source_rgb(c, 0.7, 0.7, 0.7);
      cairo_set_line_width(c, 1);
      cairo_stroke(c);
    }
    double ly = y0 + 16;
    for (const Series& s : p.series) {
      cairo_set_source_rgb(c, s.rgb[0] / 255.0, s.rgb[1] / 255.0, s.rgb[2] / 255.0);
      cairo_rectangle(c, x1 - 150, ly - 8, 16, 8);
      cairo_fill(c);
      cairo_set_source_rgb(c, 0, 0, 0);
      text_at(x1 - 128, ly, s.name, 11, 0);
      ly += 16;
    }
  }
  if (auto st = cairo_status(c); st != CAIRO_STATUS_SUCCESS) return cairo_failed("drawing", st);
  return to_image(surface.get());
}

}  // namespace slide::tile
