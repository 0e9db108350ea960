// Antialiased bicubic resampling (resample.h): PIL's Image.resize(BICUBIC) for 8-bit RGB tiles and
// PyTorch's F.interpolate(mode='bicubic', antialias=True) for float planes. Re-implemented from
// the documented behaviour of Pillow's src/libImaging/Resample.c and PyTorch's
// aten/src/ATen/native/cpu/UpSampleKernel.cpp (see resample.h for the formulas).
#include "slide/train/resample.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace slide::train {

namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;  // Pillow's PRECISION_BITS
constexpr int64_t kMaxSide = 65536;

Status check_sizes(int64_t in, int64_t out) {
  if (in < 1 || out < 1 || in > kMaxSide || out > kMaxSide)
    return slide::core::invalid_argument("resample: sizes " + std::to_string(in) + " -> " + std::to_string(out) +
                                         " outside 1.." + std::to_string(kMaxSide));
  return slide::core::ok_status();
}

inline uint8_t clip8(int64_t acc) {
  // Pillow's clip8: the accumulator (with its 2^21 rounding offset) shifted down, clamped to 0..255.
  const int64_t v = acc >> kPrecisionBits;  // arithmetic shift: floor, as Pillow's int >> on negatives
  return static_cast<uint8_t>(v < 0 ? 0 : v > 255 ? 255 : v);
}

}  // namespace

double cubic_kernel(double x, double a) {
  if (x < 0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

Result<ResampleAxis> antialiased_cubic_axis(int64_t in, int64_t out, double a) {
  SLIDE_RETURN_IF_ERROR(check_sizes(in, out));
  ResampleAxis ax;
  ax.in = in, ax.out = out;
  const double scale = static_cast<double>(in) / static_cast<double>(out);
  const double fscale = std::max(scale, 1.0);
  const double support = 2.0 * fscale;  // bicubic support 2, widened when downsampling
  const double inv = 1.0 / fscale;
  ax.taps = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  ax.first.assign(static_cast<size_t>(out), 0);
  ax.count.assign(static_cast<size_t>(out), 0);
  ax.weights.assign(static_cast<size_t>(out * ax.taps), 0.0);
  ax.fixed.assign(static_cast<size_t>(out * ax.taps), 0);
  for (int64_t i = 0; i < out; ++i) {
    const double centre = (static_cast<double>(i) + 0.5) * scale;
    // C's (int) truncation, as Pillow and PyTorch write it; the clamps make it a rounding.
    int64_t lo = static_cast<int64_t>(centre - support + 0.5);
    int64_t hi = static_cast<int64_t>(centre + support + 0.5);
    lo = std::max<int64_t>(lo, 0);
    hi = std::min<int64_t>(hi, in);
    const int64_t n = std::max<int64_t>(hi - lo, 0);
    double* w = ax.weights.data() + i * ax.taps;
    double total = 0;
    for (int64_t j = 0; j < n; ++j) {
      w[j] = cubic_kernel((static_cast<double>(j + lo) - centre + 0.5) * inv, a);
      total += w[j];
    }
    if (total != 0.0)
      for (int64_t j = 0; j < n; ++j) w[j] /= total;
    int32_t* f = ax.fixed.data() + i * ax.taps;
    for (int64_t j = 0; j < n; ++j) {
      // normalize_coeffs_8bpc: (int)(w * 2^22 -/+ 0.5), truncation toward zero.
      const double s = w[j] * static_cast<double>(1 << kPrecisionBits);
      f[j] = static_cast<int32_t>(w[j] < 0 ? s - 0.5 : s + 0.5);
    }
    ax.first[static_cast<size_t>(i)] = static_cast<int32_t>(lo);
    ax.count[static_cast<size_t>(i)] = static_cast<int32_t>(n);
  }
  return ax;
}

Result<BicubicResizer> BicubicResizer::create(int64_t in_w, int64_t in_h, int64_t out_w, int64_t out_h) {
  BicubicResizer r;
  SLIDE_ASSIGN_OR_RETURN(r.h_, antialiased_cubic_axis(in_w, out_w));
  SLIDE_ASSIGN_OR_RETURN(r.v_, antialiased_cubic_axis(in_h, out_h));
  return r;
}

void BicubicResizer::resize(const uint8_t* in, uint8_t* out, std::vector<uint8_t>& scratch) const {
  const int64_t iw = h_.in, ih = v_.in, ow = h_.out, oh = v_.out;
  const bool need_h = iw != ow, need_v = ih != oh;
  if (!need_h && !need_v) {
    std::memcpy(out, in, static_cast<size_t>(iw * ih * 3));
    return;
  }
  const int64_t half = int64_t{1} << (kPrecisionBits - 1);
  // Rows the vertical pass reads (Pillow's ybox_first .. ybox_last): only these are resampled
  // horizontally; the values are the same either way.
  int64_t row0 = 0, row1 = ih;
  if (need_v) {
    row0 = v_.first.front();
    row1 = static_cast<int64_t>(v_.first.back()) + v_.count.back();
  }
  const uint8_t* src = in + row0 * iw * 3;
  if (need_h) {
    uint8_t* dst = need_v ? (scratch.resize(static_cast<size_t>((row1 - row0) * ow * 3)), scratch.data()) : out;
    for (int64_t y = 0; y < row1 - row0; ++y) {
      const uint8_t* row = src + y * iw * 3;
      uint8_t* o = dst + y * ow * 3;
      for (int64_t x = 0; x < ow; ++x) {
        const int32_t* k = h_.fixed.data() + x * h_.taps;
        const uint8_t* p = row + static_cast<int64_t>(h_.first[static_cast<size_t>(x)]) * 3;
        int64_t s0 = half, s1 = half, s2 = half;
        for (int32_t j = 0; j < h_.count[static_cast<size_t>(x)]; ++j) {
          s0 += int64_t{p[3 * j]} * k[j];
          s1 += int64_t{p[3 * j + 1]} * k[j];
          s2 += int64_t{p[3 * j + 2]} * k[j];
        }
        o[3 * x] = clip8(s0), o[3 * x + 1] = clip8(s1), o[3 * x + 2] = clip8(s2);
      }
    }
    if (!need_v) return;
    src = dst;
  }
  // Vertical pass over rows row0..row1 of the (horizontally resampled) image of width ow.
  for (int64_t y = 0; y < oh; ++y) {
    const int32_t* k = v_.fixed.data() + y * v_.taps;
    const int64_t first = v_.first[static_cast<size_t>(y)] - row0;
    const int32_t n = v_.count[static_cast<size_t>(y)];
    uint8_t* o = out + y * ow * 3;
    for (int64_t x = 0; x < ow * 3; ++x) {
      int64_t s = half;
      for (int32_t j = 0; j < n; ++j) s += int64_t{src[(first + j) * ow * 3 + x]} * k[j];
      o[x] = clip8(s);
    }
  }
}

Status resize_planes_bicubic_aa(const float* in, int64_t channels, int64_t in_h, int64_t in_w, int64_t out_h,
                                int64_t out_w, float* out) {
  if (channels < 1) return slide::core::invalid_argument("resample: channels < 1");
  SLIDE_ASSIGN_OR_RETURN(const ResampleAxis h, antialiased_cubic_axis(in_w, out_w));
  SLIDE_ASSIGN_OR_RETURN(const ResampleAxis v, antialiased_cubic_axis(in_h, out_h));
  std::vector<double> mid(static_cast<size_t>(in_h * out_w));
  for (int64_t c = 0; c < channels; ++c) {
    const float* plane = in + c * in_h * in_w;
    for (int64_t y = 0; y < in_h; ++y)
      for (int64_t x = 0; x < out_w; ++x) {
        if (in_w == out_w) {
          mid[static_cast<size_t>(y * out_w + x)] = plane[y * in_w + x];
          continue;
        }
        const double* k = h.weights.data() + x * h.taps;
        const float* p = plane + y * in_w + h.first[static_cast<size_t>(x)];
        double s = 0;
        for (int32_t j = 0; j < h.count[static_cast<size_t>(x)]; ++j) s += k[j] * p[j];
        mid[static_cast<size_t>(y * out_w + x)] = s;
      }
    float* o = out + c * out_h * out_w;
    for (int64_t y = 0; y < out_h; ++y)
      for (int64_t x = 0; x < out_w; ++x) {
        if (in_h == out_h) {
          o[y * out_w + x] = static_cast<float>(mid[static_cast<size_t>(y * out_w + x)]);
          continue;
        }
        const double* k = v.weights.data() + y * v.taps;
        const int64_t first = v.first[static_cast<size_t>(y)];
        double s = 0;
        for (int32_t j = 0; j < v.count[static_cast<size_t>(y)]; ++j) s += k[j] * mid[static_cast<size_t>((first + j) * out_w + x)];
        o[y * out_w + x] = static_cast<float>(s);
      }
  }
  return slide::core::ok_status();
}

}  // namespace slide::train
