#include "slide/train/augment.h"

#include <algorithm>
#include <cmath>

namespace slide::train {

namespace {

float clamp01(float v) { return std::min(1.0f, std::max(0.0f, v)); }

// torchvision's rgb_to_grayscale for float images (its coefficients: 0.2989, 0.587, 0.114).
float gray(const float* p) { return 0.2989f * p[0] + 0.587f * p[1] + 0.114f * p[2]; }

float uniform(std::mt19937_64& rng, float lo, float hi) {
  return std::uniform_real_distribution<float>(lo, hi)(rng);
}

// torchvision's _rgb2hsv, _hsv2rgb (transforms/_functional_tensor.py), per pixel.
void rgb_to_hsv(const float* rgb, float* hsv) {
  const float r = rgb[0], g = rgb[1], b = rgb[2];
  const float maxc = std::max({r, g, b}), minc = std::min({r, g, b});
  const bool eqc = maxc == minc;
  const float cr = maxc - minc;
  const float s = cr / (eqc ? 1.0f : maxc);
  const float div = eqc ? 1.0f : cr;
  const float rc = (maxc - r) / div, gc = (maxc - g) / div, bc = (maxc - b) / div;
  float h;
  if (maxc == r) h = bc - gc;
  else if (maxc == g) h = 2.0f + rc - bc;
  else h = 4.0f + gc - rc;
  hsv[0] = std::fmod(h / 6.0f + 1.0f, 1.0f);
  hsv[1] = s;
  hsv[2] = maxc;
}

void hsv_to_rgb(const float* hsv, float* rgb) {
  const float h = hsv[0], s = hsv[1], v = hsv[2];
  const float i_f = std::floor(h * 6.0f);
  const float f = h * 6.0f - i_f;
  const int i = ((static_cast<int>(i_f) % 6) + 6) % 6;
  const float p = clamp01(v * (1.0f - s)), q = clamp01(v * (1.0f - s * f)), t = clamp01(v * (1.0f - s * (1.0f - f)));
  const float r[6] = {v, q, p, p, t, v}, g[6] = {t, v, v, q, p, p}, b[6] = {p, p, t, v, v, q};
  rgb[0] = r[i], rgb[1] = g[i], rgb[2] = b[i];
}

}  // namespace

JitterFactors draw_jitter(const Augmentation& aug, std::mt19937_64& rng) {
  JitterFactors f;
  if (aug.brightness > 0) f.brightness = uniform(rng, std::max(0.0f, 1 - aug.brightness), 1 + aug.brightness);
  if (aug.contrast > 0) f.contrast = uniform(rng, std::max(0.0f, 1 - aug.contrast), 1 + aug.contrast);
  if (aug.saturation > 0) f.saturation = uniform(rng, std::max(0.0f, 1 - aug.saturation), 1 + aug.saturation);
  if (aug.hue > 0) f.hue = uniform(rng, -std::min(0.5f, aug.hue), std::min(0.5f, aug.hue));
  return f;
}

void apply_jitter(const JitterFactors& f, float* hwc, int64_t n) {
  if (f.brightness != 1)
    for (int64_t i = 0; i < 3 * n; ++i) hwc[i] = clamp01(f.brightness * hwc[i]);
  if (f.contrast != 1) {
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += gray(hwc + 3 * i);
    const auto mean = static_cast<float>(sum / static_cast<double>(std::max<int64_t>(1, n)));
    for (int64_t i = 0; i < 3 * n; ++i) hwc[i] = clamp01(f.contrast * hwc[i] + (1 - f.contrast) * mean);
  }
  if (f.saturation != 1)
    for (int64_t i = 0; i < n; ++i) {
      float* p = hwc + 3 * i;
      const float g = gray(p);
      for (int c = 0; c < 3; ++c) p[c] = clamp01(f.saturation * p[c] + (1 - f.saturation) * g);
    }
  if (f.hue != 0)
    for (int64_t i = 0; i < n; ++i) {
      float hsv[3];
      rgb_to_hsv(hwc + 3 * i, hsv);
      hsv[0] = std::fmod(hsv[0] + f.hue, 1.0f);
      if (hsv[0] < 0) hsv[0] += 1.0f;  // Python's % is non-negative for a positive divisor
      hsv_to_rgb(hsv, hwc + 3 * i);
    }
}

CropBox draw_crop(int64_t size, float min_scale, std::mt19937_64& rng) {
  const double area = static_cast<double>(size) * static_cast<double>(size);
  const double log_lo = std::log(3.0 / 4.0), log_hi = std::log(4.0 / 3.0);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * uniform(rng, std::clamp(min_scale, 1e-3f, 1.0f), 1.0f);
    const double aspect = std::exp(std::uniform_real_distribution<double>(log_lo, log_hi)(rng));
    const auto w = static_cast<int64_t>(std::llround(std::sqrt(target * aspect)));
    const auto h = static_cast<int64_t>(std::llround(std::sqrt(target / aspect)));
    if (w > 0 && w <= size && h > 0 && h <= size) {
      const int64_t y = std::uniform_int_distribution<int64_t>(0, size - h)(rng);
      const int64_t x = std::uniform_int_distribution<int64_t>(0, size - w)(rng);
      return {x, y, w, h};
    }
  }
  return {0, 0, size, size};  // a square image is within the ratio range: the whole of it
}

void resize_crop(const float* src, int64_t size, const CropBox& box, float* dst) {
  // PyTorch's area_pixel_compute_source_index for linear modes: (d + 0.5) * scale - 0.5, >= 0.
  auto source = [size](int64_t d, int64_t extent, int64_t* i0, int64_t* i1, float* frac) {
    const double s = static_cast<double>(extent) / static_cast<double>(size);
    const double v = std::max(0.0, (static_cast<double>(d) + 0.5) * s - 0.5);
    *i0 = std::min(static_cast<int64_t>(v), extent - 1);
    *i1 = std::min(*i0 + 1, extent - 1);
    *frac = static_cast<float>(v - static_cast<double>(*i0));
  };
  for (int64_t y = 0; y < size; ++y) {
    int64_t y0, y1;
    float fy;
    source(y, box.h, &y0, &y1, &fy);
    for (int64_t x = 0; x < size; ++x) {
      int64_t x0, x1;
      float fx;
      source(x, box.w, &x0, &x1, &fx);
      const float* p00 = src + 3 * ((box.y + y0) * size + box.x + x0);
      const float* p01 = src + 3 * ((box.y + y0) * size + box.x + x1);
      const float* p10 = src + 3 * ((box.y + y1) * size + box.x + x0);
      const float* p11 = src + 3 * ((box.y + y1) * size + box.x + x1);
      float* o = dst + 3 * (y * size + x);
      for (int c = 0; c < 3; ++c)
        o[c] = (1 - fy) * ((1 - fx) * p00[c] + fx * p01[c]) + fy * ((1 - fx) * p10[c] + fx * p11[c]);
    }
  }
}

}  // namespace slide::train
