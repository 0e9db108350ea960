// Tissue detection after CLAM's segmentTissue (Lu et al., 2021; github.com/mahmoodlab/CLAM,
// wsi_core/WholeSlideImage.py): saturation, median blur, Otsu, close, small-object and
// small-hole filtering, all on a thumbnail built in bands of rows.
#include "slide/tile/tissue.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <functional>
#include <future>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>

#include "resample.h"
#include "slide/core/log.h"

namespace slide::tile {

namespace {

// Otsu on the saturation of a near-empty thumbnail (a blank slide, a white patch) splits sensor
// noise into "tissue". Thresholds below this floor are raised to it, as histolab and CLAM-style
// pipelines do with a minimum saturation; stained tissue is far above it (H&E saturation is
// typically 40-150 of 255), glass and background are below (typically 0-10).
constexpr int kMinSaturationThreshold = 15;
// The same floor for a fluorescence image's mean brightness (max of R, G, B): its dark background
// is camera noise a few levels above 0 (0-5 on the shared DAPI slide), its tissue above that.
constexpr int kMinBrightnessThreshold = 5;
// --stain auto: a thumbnail whose median grey level ((R + G + B) / 3) is below this is taken for
// fluorescence. Brightfield glass is near white (the shared H&E slides' medians are 172-243);
// a fluorescence slide's background is near black (the shared DAPI slide's median is 5).
constexpr double kFluorescenceMedianGrey = 60;

// Budget for one band of level pixels read while building a thumbnail. At least one thumbnail
// row is always read, so a level-0-only slide of extreme width can exceed it by that row.
constexpr int64_t kBandBudgetBytes = int64_t{16} << 20;
// At most this many thumbnail rows per band: keeps bands short even for small levels.
constexpr int64_t kMaxBandRows = 64;
// The largest buffer make_thumbnail allocates from sizes a slide's header declares (the thumbnail,
// one band of level pixels): a forged or corrupt header (10^7 x 10^7 px with one level) must fail
// its slide, not ask for tens of gigabytes. Real slides need a few to a few hundred MB here.
constexpr uint64_t kMaxThumbnailBufferBytes = uint64_t{1} << 30;

// 3 * w * h bytes, or nullopt when it overflows or exceeds kMaxThumbnailBufferBytes.
std::optional<uint64_t> checked_rgb_bytes(int64_t w, int64_t h) {
  uint64_t px = 0, bytes = 0;
  if (w < 0 || h < 0 || __builtin_mul_overflow(static_cast<uint64_t>(w), static_cast<uint64_t>(h), &px) ||
      __builtin_mul_overflow(px, uint64_t{3}, &bytes) || bytes > kMaxThumbnailBufferBytes)
    return std::nullopt;
  return bytes;
}

// Runs f() (returning Status), turning an allocation failure into kResourceExhausted: a task on
// the pool must never end in an exception, which would leave its siblings' futures behind.
template <typename F>
Status no_throw_alloc(F&& f) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return core::resource_exhausted("out of memory");
  } catch (const std::length_error&) {
    return core::resource_exhausted("out of memory (a buffer larger than the address space)");
  }
}

// OpenCV's 8-bit RGB2HSV saturation (imgproc/src/color_hsv.simd.hpp, RGB2HSV_b): a fixed-point
// 255 * (max - min) / max with a 12-bit reciprocal table, reproduced here bit for bit.
struct SaturationTable {
  int sdiv[256];
  SaturationTable() {
    sdiv[0] = 0;
    for (int v = 1; v < 256; ++v) sdiv[v] = static_cast<int>(std::lround((255 << 12) / static_cast<double>(v)));
  }
};

std::vector<uint8_t> saturation(const RgbImage& img) {
  static const SaturationTable table;
  const size_t n = static_cast<size_t>(img.width * img.height);
  std::vector<uint8_t> s(n);
  for (size_t i = 0; i < n; ++i) {
    const int r = img.pixels[3 * i], g = img.pixels[3 * i + 1], b = img.pixels[3 * i + 2];
    const int v = std::max({r, g, b});
    const int diff = v - std::min({r, g, b});
    s[i] = static_cast<uint8_t>((diff * table.sdiv[v] + (1 << 11)) >> 12);
  }
  return s;
}

// Rows [y0, y1) of the k x k median of `in` (w x h) into `out` (w x h), replicating the edges
// (OpenCV medianBlur's border), by Huang's sliding histogram (Huang, Yang & Tang, 1979): per step
// one column leaves and one enters the window, and the median moves by the few bins the update
// shifted it; O(k) per pixel.
void median_rows(const std::vector<uint8_t>& in, int64_t w, int64_t h, int k, int64_t y0, int64_t y1,
                 std::vector<uint8_t>* out_rows) {
  std::vector<uint8_t>& out = *out_rows;
  const int64_t r = k / 2;
  const int64_t half = (int64_t{k} * k) / 2;  // 0-based rank of the median
  auto at = [&](int64_t x, int64_t y) {
    return in[static_cast<size_t>(std::clamp<int64_t>(y, 0, h - 1) * w + std::clamp<int64_t>(x, 0, w - 1))];
  };
  int64_t hist[256];
  for (int64_t y = y0; y < y1; ++y) {
    std::fill(std::begin(hist), std::end(hist), 0);
    for (int64_t dy = -r; dy <= r; ++dy)
      for (int64_t dx = -r; dx <= r; ++dx) ++hist[at(dx, y + dy)];
    int m = 0;
    int64_t below = 0;  // number of window values < m
    for (int64_t x = 0; x < w; ++x) {
      if (x > 0) {
        for (int64_t dy = -r; dy <= r; ++dy) {
          const uint8_t out_v = at(x - r - 1, y + dy);
          const uint8_t in_v = at(x + r, y + dy);
          --hist[out_v];
          if (out_v < m) --below;
          ++hist[in_v];
          if (in_v < m) ++below;
        }
      }
      while (below > half) below -= hist[--m];
      while (below + hist[m] <= half) below += hist[m++];
      out[static_cast<size_t>(y * w + x)] = static_cast<uint8_t>(m);
    }
  }
}

// Runs body(i) for i in [0, n): on the pool's threads and this one when a pool is given, else
// here; returns the first error in index order.
Status run_parallel(core::ThreadPool* pool, int64_t n, const std::function<Status(int64_t)>& body) {
  if (pool == nullptr || pool->size() < 2 || n < 2) {
    for (int64_t i = 0; i < n; ++i) SLIDE_RETURN_IF_ERROR(body(i));
    return core::ok_status();
  }
  std::vector<std::future<Status>> done;
  for (int64_t i = 1; i < n; ++i)
    done.push_back(pool->submit([&body, i] { return no_throw_alloc([&] { return body(i); }); }));
  Status first = no_throw_alloc([&] { return body(0); });
  for (auto& f : done) {
    Status s = f.get();
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

// The k x k median filter of `in` (w x h; k made odd), rows split over the pool.
std::vector<uint8_t> median_filter(const std::vector<uint8_t>& in, int64_t w, int64_t h, int k,
                                   core::ThreadPool* pool) {
  if (k <= 1 || w < 1 || h < 1) return in;
  if (k % 2 == 0) ++k;
  std::vector<uint8_t> out(in.size());
  const int64_t parts = pool != nullptr ? std::min<int64_t>(h, static_cast<int64_t>(pool->size()) + 1) : 1;
  (void)run_parallel(pool, parts, [&](int64_t i) {
    median_rows(in, w, h, k, h * i / parts, h * (i + 1) / parts, &out);
    return core::ok_status();
  });
  return out;
}

// Running max (dilate) or min (erode) over a k-wide window along one axis. Pixels outside the
// image do not take part, as in OpenCV's morphology default border (morphologyDefaultBorderValue).
void morph_1d(const std::vector<uint8_t>& in, std::vector<uint8_t>* out, int64_t w, int64_t h, int k, bool dilate,
              bool horizontal) {
  const int64_t before = k / 2;  // OpenCV's anchor for a k-wide element is k / 2
  const int64_t after = k - 1 - before;
  auto combine = [dilate](uint8_t a, uint8_t b) { return dilate ? std::max(a, b) : std::min(a, b); };
  if (horizontal) {
    for (int64_t y = 0; y < h; ++y) {
      const uint8_t* src = in.data() + y * w;
      uint8_t* dst = out->data() + y * w;
      for (int64_t x = 0; x < w; ++x) {
        uint8_t v = dilate ? 0 : 1;
        const int64_t q0 = std::max<int64_t>(0, x - before), q1 = std::min<int64_t>(w - 1, x + after);
        for (int64_t q = q0; q <= q1; ++q) v = combine(v, src[q]);
        dst[x] = v;
      }
    }
    return;
  }
  // Vertical: whole rows at a time (contiguous, vectorisable) rather than down columns.
  for (int64_t y = 0; y < h; ++y) {
    uint8_t* dst = out->data() + y * w;
    const int64_t q0 = std::max<int64_t>(0, y - before), q1 = std::min<int64_t>(h - 1, y + after);
    std::copy(in.data() + q0 * w, in.data() + (q0 + 1) * w, dst);
    for (int64_t q = q0 + 1; q <= q1; ++q) {
      const uint8_t* src = in.data() + q * w;
      for (int64_t x = 0; x < w; ++x) dst[x] = combine(dst[x], src[x]);
    }
  }
}

// Morphological close (dilate then erode) of a 0/1 mask with a k x k square.
void close_mask(std::vector<uint8_t>* mask, int64_t w, int64_t h, int k) {
  if (k <= 1) return;
  std::vector<uint8_t> tmp(mask->size());
  morph_1d(*mask, &tmp, w, h, k, true, true);
  morph_1d(tmp, mask, w, h, k, true, false);
  morph_1d(*mask, &tmp, w, h, k, false, true);
  morph_1d(tmp, mask, w, h, k, false, false);
}

// Sets to `fill` every connected component of pixels equal to `value` whose area is < min_area
// px, skipping components that touch the border when `skip_border` (holes are background regions
// enclosed by tissue; the background around the tissue touches the border). 8-connected for
// tissue, 4-connected for background: the pair that makes holes and objects dual (a diagonal gap
// in tissue does not connect a hole to the outside).
// Components of `value` smaller than min_area px are flipped to 1 - value; returns how many
// were, and adds their pixels to *flipped_px.
int64_t filter_components(std::vector<uint8_t>* mask, int64_t w, int64_t h, uint8_t value, bool eight,
                          bool skip_border, double min_area, int64_t* flipped_px) {
  int64_t flipped = 0;
  if (min_area <= 1) return flipped;
  std::vector<uint8_t> seen(mask->size(), 0);
  std::vector<int64_t> stack, component;
  for (int64_t start = 0; start < w * h; ++start) {
    if (seen[static_cast<size_t>(start)] || (*mask)[static_cast<size_t>(start)] != value) continue;
    stack.assign(1, start);
    component.clear();
    seen[static_cast<size_t>(start)] = 1;
    bool touches_border = false;
    // Only a component below min_area is ever refilled, so pixels are listed only until it
    // reaches that size; the big ones (the background) are just counted.
    int64_t area = 0;
    while (!stack.empty()) {
      const int64_t p = stack.back();
      stack.pop_back();
      if (static_cast<double>(++area) < min_area) component.push_back(p);
      const int64_t x = p % w, y = p / w;
      const bool border = x == 0 || y == 0 || x == w - 1 || y == h - 1;
      touches_border = touches_border || border;
      auto visit = [&](int64_t q) {
        if (seen[static_cast<size_t>(q)] || (*mask)[static_cast<size_t>(q)] != value) return;
        seen[static_cast<size_t>(q)] = 1;
        stack.push_back(q);
      };
      if (!border) {  // the common case: every neighbour exists, no bounds checks
        visit(p - 1), visit(p + 1), visit(p - w), visit(p + w);
        if (eight) visit(p - w - 1), visit(p - w + 1), visit(p + w - 1), visit(p + w + 1);
        continue;
      }
      for (int64_t dy = -1; dy <= 1; ++dy) {
        for (int64_t dx = -1; dx <= 1; ++dx) {
          if ((dx == 0 && dy == 0) || (!eight && dx != 0 && dy != 0)) continue;
          const int64_t nx = x + dx, ny = y + dy;
          if (nx < 0 || ny < 0 || nx >= w || ny >= h) continue;
          visit(ny * w + nx);
        }
      }
    }
    if (skip_border && touches_border) continue;
    if (static_cast<double>(area) < min_area) {
      for (int64_t p : component) (*mask)[static_cast<size_t>(p)] = static_cast<uint8_t>(1 - value);
      ++flipped;
      *flipped_px += area;
    }
  }
  return flipped;
}

// A fluorescence image's tissue signal: brightness = max(R, G, B) per pixel (whatever the
// channel's colour: DAPI blue, FITC green, TRITC red), averaged over a k x k window (edges
// clamped) and rounded. The mean, not the median: in a nuclear stain the tissue between nuclei is
// as dark as the glass, so the tissue is where nuclei are dense, which a local mean measures and a
// median (most pixels dark) erases.
std::vector<uint8_t> mean_brightness(const RgbImage& img, int k) {
  const int64_t w = img.width, h = img.height, r = std::max(0, k / 2);
  std::vector<double> b(static_cast<size_t>(w * h)), rows(b.size());
  const uint8_t* p = img.pixels.data();
  for (size_t i = 0; i < b.size(); ++i, p += 3) b[i] = std::max({p[0], p[1], p[2]});
  auto clampi = [](int64_t v, int64_t hi) { return std::clamp<int64_t>(v, 0, hi - 1); };
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x) {
      double sum = 0;
      for (int64_t d = -r; d <= r; ++d) sum += b[static_cast<size_t>(y * w + clampi(x + d, w))];
      rows[static_cast<size_t>(y * w + x)] = sum;
    }
  std::vector<uint8_t> out(b.size());
  const double n = static_cast<double>((2 * r + 1) * (2 * r + 1));
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x) {
      double sum = 0;
      for (int64_t d = -r; d <= r; ++d) sum += rows[static_cast<size_t>(clampi(y + d, h) * w + x)];
      out[static_cast<size_t>(y * w + x)] = static_cast<uint8_t>(std::lround(std::clamp(sum / n, 0.0, 255.0)));
    }
  return out;
}

}  // namespace

// A fluorescence signal spans orders of magnitude (sparse tissue a few levels above the glass,
// dense nuclei a hundred): on a log scale Otsu splits tissue from glass, not nuclei from the rest.
uint8_t brightness_log_level(uint8_t v) {
  return static_cast<uint8_t>(std::lround(255.0 * std::log1p(static_cast<double>(v)) / std::log(256.0)));
}
int brightness_linear_threshold(int t) {
  // The levels round (not floor), so the inverse is found, not computed: expm1's inverse of t
  // stopped one level short for 94 of the 256 thresholds, counting background pixels as tissue.
  int last = -1;
  for (int v = 0; v < 256; ++v)
    if (brightness_log_level(static_cast<uint8_t>(v)) <= t) last = v;
  return last;
}

bool looks_like_fluorescence(const RgbImage& thumbnail) {
  if (thumbnail.width < 1 || thumbnail.height < 1 ||
      thumbnail.pixels.size() != static_cast<size_t>(3 * thumbnail.width * thumbnail.height))
    return false;
  std::vector<int64_t> hist(256, 0);
  const uint8_t* p = thumbnail.pixels.data();
  const int64_t n = thumbnail.width * thumbnail.height;
  for (int64_t i = 0; i < n; ++i, p += 3) ++hist[static_cast<size_t>((int{p[0]} + p[1] + p[2]) / 3)];
  int64_t below = 0;
  int median = 0;
  while (median < 255 && 2 * (below + hist[static_cast<size_t>(median)]) <= n) below += hist[static_cast<size_t>(median++)];
  return median < kFluorescenceMedianGrey;
}

std::string tissue_options_text(const TissueOptions& o) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "stain=%s threshold=%s median_px=%d close_px=%d min_object_um2=%g min_hole_um2=%g",
                o.stain == TissueStain::kAuto ? "auto" : o.stain == TissueStain::kFluorescence ? "fluorescence" : "brightfield",
                o.threshold < 0 ? "otsu" : std::to_string(o.threshold).c_str(), o.median_px, o.close_px,
                o.min_object_um2, o.min_hole_um2);
  return buf;
}

int otsu_threshold(const std::vector<int64_t>& histogram) {
  // Otsu (1979), "A threshold selection method from gray-level histograms": maximise
  // w0 * w1 * (mu0 - mu1)^2 over t, classes {v <= t} and {v > t}. The first maximum wins (as in
  // OpenCV's getThreshVal_Otsu_8u), so a gap between two modes gives its lower edge.
  const int bins = static_cast<int>(std::min<size_t>(histogram.size(), 256));
  double total = 0, total_sum = 0;
  for (int v = 0; v < bins; ++v) {
    total += static_cast<double>(histogram[static_cast<size_t>(v)]);
    total_sum += static_cast<double>(v) * static_cast<double>(histogram[static_cast<size_t>(v)]);
  }
  if (total <= 0) return 0;
  double w0 = 0, sum0 = 0, best = 0;
  int best_t = 0;
  for (int t = 0; t < bins - 1; ++t) {
    const double n = static_cast<double>(histogram[static_cast<size_t>(t)]);
    w0 += n;
    sum0 += t * n;
    const double w1 = total - w0;
    if (w0 <= 0 || w1 <= 0) continue;
    const double mu0 = sum0 / w0, mu1 = (total_sum - sum0) / w1;
    const double between = w0 * w1 * (mu0 - mu1) * (mu0 - mu1);
    if (between > best * (1 + 1e-12)) best = between, best_t = t;
  }
  return best_t;
}

double TissueMask::tissue_fraction() const {
  if (mask.empty()) return 0;
  int64_t n = 0;
  for (uint8_t m : mask) n += m;
  return static_cast<double>(n) / static_cast<double>(mask.size());
}

double TissueMask::fraction_in(double x_l0, double y_l0, double w_l0, double h_l0) const {
  const int64_t w = width(), h = height();
  if (!(w_l0 > 0) || !(h_l0 > 0) || w < 1 || h < 1 || mask.size() != static_cast<size_t>(w * h)) return 0;
  const double tx0 = x_l0 / downsample_x, tx1 = (x_l0 + w_l0) / downsample_x;
  const double ty0 = y_l0 / downsample_y, ty1 = (y_l0 + h_l0) / downsample_y;
  const double area = (tx1 - tx0) * (ty1 - ty0);
  const int64_t x_first = std::max<int64_t>(0, static_cast<int64_t>(std::floor(tx0)));
  const int64_t x_last = std::min<int64_t>(w - 1, static_cast<int64_t>(std::ceil(tx1)) - 1);
  const int64_t y_first = std::max<int64_t>(0, static_cast<int64_t>(std::floor(ty0)));
  const int64_t y_last = std::min<int64_t>(h - 1, static_cast<int64_t>(std::ceil(ty1)) - 1);
  double tissue = 0;
  for (int64_t y = y_first; y <= y_last; ++y) {
    const double wy = std::min(ty1, static_cast<double>(y + 1)) - std::max(ty0, static_cast<double>(y));
    if (wy <= 0) continue;
    double row = 0;
    const uint8_t* m = mask.data() + y * w;
    for (int64_t x = x_first; x <= x_last; ++x) {
      if (m[x] == 0) continue;
      row += std::min(tx1, static_cast<double>(x + 1)) - std::max(tx0, static_cast<double>(x));
    }
    tissue += wy * row;
  }
  return std::clamp(tissue / area, 0.0, 1.0);
}

Result<RgbImage> make_thumbnail(const SlideReader& slide, double downsample, double* actual_downsample_x,
                                double* actual_downsample_y, core::ThreadPool* pool) {
  const SlideProperties& props = slide.properties();
  if (props.levels.empty() || props.levels[0].width < 1 || props.levels[0].height < 1)
    return core::invalid_argument(props.path + ": slide has no readable level 0");
  if (!(downsample >= 1) || !std::isfinite(downsample)) downsample = std::max(1.0, std::isfinite(downsample) ? downsample : 1.0);
  const int64_t w0 = props.levels[0].width, h0 = props.levels[0].height;
  const int64_t tw = std::max<int64_t>(1, static_cast<int64_t>(std::floor(static_cast<double>(w0) / downsample)));
  const int64_t th = std::max<int64_t>(1, static_cast<int64_t>(std::floor(static_cast<double>(h0) / downsample)));
  // The coarsest level not coarser than asked for (OpenSlide's get_best_level_for_downsample):
  // reading fewer pixels, and never averaging fewer than one level pixel per thumbnail pixel.
  int level = 0;
  for (size_t i = 0; i < props.levels.size(); ++i)
    if (props.levels[i].downsample <= downsample && props.levels[i].width >= 1 && props.levels[i].height >= 1)
      level = static_cast<int>(i);
  const SlideLevel& lv = props.levels[static_cast<size_t>(level)];
  // Per-axis scales from the level's own size, so that the thumbnail spans the level exactly even
  // where the level's size is rounded (W_k = ceil(W0 / d) on most scanners).
  const double sx = static_cast<double>(lv.width) / static_cast<double>(tw);
  const double sy = static_cast<double>(lv.height) / static_cast<double>(th);
  const auto too_large = [&](const std::string& what, int64_t w, int64_t h) {
    return core::resource_exhausted(props.path + ": " + what + " of " + std::to_string(w) + "x" + std::to_string(h) +
                                    " px is larger than the " + std::to_string(kMaxThumbnailBufferBytes >> 20) +
                                    " MiB limit (is the slide's header sane?)");
  };
  if (!checked_rgb_bytes(tw, th)) return too_large("a thumbnail", tw, th);
  // One band holds at least the level rows under one thumbnail row: ceil(sy) + 1 of them.
  if (!checked_rgb_bytes(lv.width, static_cast<int64_t>(std::min(std::ceil(sy) + 1, 1e15))))
    return too_large("a thumbnail band (level " + std::to_string(level) + ")", lv.width,
                     static_cast<int64_t>(std::min(std::ceil(sy) + 1, 1e15)));
  RgbImage thumb(tw, th, 255);
  const int64_t band_rows = std::clamp<int64_t>(
      kBandBudgetBytes / std::max<int64_t>(1, static_cast<int64_t>(3.0 * static_cast<double>(lv.width) * std::ceil(sy + 1))),
      1, kMaxBandRows);
  // Bands write disjoint thumbnail rows, so they can be read in parallel; one band buffer per
  // thread keeps memory at (threads x the band budget).
  const int64_t bands = (th + band_rows - 1) / band_rows;
  const int64_t workers = pool != nullptr ? std::min<int64_t>(bands, static_cast<int64_t>(pool->size()) + 1) : 1;
  SLIDE_RETURN_IF_ERROR(run_parallel(pool, workers, [&](int64_t worker) -> Status {
    RgbImage band;
    for (int64_t b = worker; b < bands; b += workers) {
      const int64_t j0 = b * band_rows, j1 = std::min(th, j0 + band_rows);
      std::vector<int64_t> tap_begin;
      const std::vector<detail::AreaTap> taps = detail::area_taps(0, sy, j0, j1 - j0, lv.height, &tap_begin);
      const int64_t ly0 = taps.front().index, ly1 = taps.back().index + 1;
      band.width = lv.width;
      band.height = ly1 - ly0;
      const std::string where = "thumbnail band (level " + std::to_string(level) + ", rows " + std::to_string(ly0) +
                                ".." + std::to_string(ly1) + ")";
      const auto bytes = checked_rgb_bytes(band.width, band.height);
      if (!bytes) return too_large(where, band.width, band.height);
      band.pixels.resize(static_cast<size_t>(*bytes));
      // The reader's errors name the slide already: add only which band it was.
      SLIDE_RETURN_IF_ERROR_CTX(slide.read_level_region(level, 0, ly0, band.width, band.height, band.pixels.data()),
                                where);
      detail::resample_area_xy(band, ly0, 0, 0, sx, sy, lv.height, &thumb, j0, j1);
    }
    return core::ok_status();
  }));
  if (actual_downsample_x != nullptr) *actual_downsample_x = static_cast<double>(w0) / static_cast<double>(tw);
  if (actual_downsample_y != nullptr) *actual_downsample_y = static_cast<double>(h0) / static_cast<double>(th);
  return thumb;
}

Result<TissueMask> detect_tissue(const SlideReader& slide, double mpp_um, const TissueOptions& options,
                                 core::ThreadPool* pool) {
  const SlideProperties& props = slide.properties();
  if (props.levels.empty()) return core::invalid_argument(props.path + ": slide has no levels");
  const double longer = static_cast<double>(std::max(props.levels[0].width, props.levels[0].height));
  double downsample = 0;
  if (mpp_um > 0) {
    downsample = std::max(options.thumbnail_mpp_um / mpp_um,
                          longer / static_cast<double>(std::max<int64_t>(1, options.max_thumbnail_px)));
  } else {
    downsample = longer / static_cast<double>(std::max<int64_t>(1, options.fallback_thumbnail_px));
  }
  downsample = std::max(1.0, downsample);
  double dx = 1, dy = 1;
  const auto t0 = std::chrono::steady_clock::now();
  SLIDE_ASSIGN_OR_RETURN(RgbImage thumb, make_thumbnail(slide, downsample, &dx, &dy, pool));
  const auto t1 = std::chrono::steady_clock::now();
  const double um2_per_px = mpp_um > 0 ? (dx * mpp_um) * (dy * mpp_um) : 0;
  const int64_t tw = thumb.width, th = thumb.height;
  TissueMask mask = detect_tissue_in_thumbnail(std::move(thumb), dx, dy, um2_per_px, options, pool);
  const auto t2 = std::chrono::steady_clock::now();
  core::log_debug("tissue mask", {{"slide", slide.properties().path},
                                  {"thumbnail", std::to_string(tw) + "x" + std::to_string(th)},
                                  {"read_s", std::chrono::duration<double>(t1 - t0).count()},
                                  {"mask_s", std::chrono::duration<double>(t2 - t1).count()}});
  return mask;
}

TissueMask detect_tissue_in_thumbnail(RgbImage thumbnail, double downsample_x, double downsample_y, double um2_per_px,
                                      const TissueOptions& options, core::ThreadPool* pool) {
  TissueMask out;
  out.downsample_x = downsample_x;
  out.downsample_y = downsample_y;
  const int64_t w = thumbnail.width, h = thumbnail.height;
  out.thumbnail = std::move(thumbnail);
  if (w < 1 || h < 1 || out.thumbnail.pixels.size() != static_cast<size_t>(3 * w * h)) {
    out.mask.assign(static_cast<size_t>(std::max<int64_t>(0, w) * std::max<int64_t>(0, h)), 0);
    return out;
  }
  out.fluorescence = options.stain == TissueStain::kFluorescence ||
                     (options.stain == TissueStain::kAuto && looks_like_fluorescence(out.thumbnail));
  // Brightfield (CLAM): tissue is saturated (stained) over white glass: the median-filtered
  // saturation, Otsu's threshold. Fluorescence: bright over dark: the local mean brightness, Otsu's
  // threshold found on its log scale (mean_brightness, brightness_log_level), applied as the linear
  // level it stands for.
  const std::vector<uint8_t> signal = out.fluorescence
                                          ? mean_brightness(out.thumbnail, options.median_px)
                                          : median_filter(saturation(out.thumbnail), w, h, options.median_px, pool);
  if (options.threshold >= 0) {
    out.otsu_threshold = options.threshold;
  } else {
    std::vector<int64_t> hist(256, 0);
    for (uint8_t v : signal) ++hist[out.fluorescence ? brightness_log_level(v) : v];
    out.otsu_threshold = out.fluorescence
                             ? std::max(brightness_linear_threshold(otsu_threshold(hist)), kMinBrightnessThreshold)
                             : std::max(otsu_threshold(hist), kMinSaturationThreshold);
  }
  out.mask.resize(signal.size());
  for (size_t i = 0; i < signal.size(); ++i) out.mask[i] = signal[i] > out.otsu_threshold ? 1 : 0;
  close_mask(&out.mask, w, h, options.close_px);
  const double area = static_cast<double>(w * h);
  const double min_object_px =
      um2_per_px > 0 ? options.min_object_um2 / um2_per_px : options.min_object_fraction * area;
  const double min_hole_px = um2_per_px > 0 ? options.min_hole_um2 / um2_per_px : options.min_object_fraction * area;
  // Objects first: a speck inside a hole is dropped before the hole is measured, as CLAM keeps
  // holes only inside the contours it kept.
  out.objects_removed = filter_components(&out.mask, w, h, 1, /*eight=*/true, /*skip_border=*/false, min_object_px,
                                          &out.objects_removed_px);
  out.holes_filled = filter_components(&out.mask, w, h, 0, /*eight=*/false, /*skip_border=*/true, min_hole_px,
                                       &out.holes_filled_px);
  return out;
}

}  // namespace slide::tile
