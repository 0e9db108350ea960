#include "slide/train/augment.h"

#include "kernels/formulas.h"
#include "slide/train/random.h"

#include <algorithm>
#include <cmath>

namespace slide::train {

namespace {

using formulas::clamp01;
using formulas::gray;

float uniform(std::mt19937_64& rng, float lo, float hi) {
  return uniform_real(rng, lo, hi);
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
  // Per pixel the order is brightness, contrast, saturation, hue; contrast needs the mean grey of
  // the whole image after brightness.
  if (f.brightness != 1)
    for (int64_t i = 0; i < n; ++i) formulas::jitter_brightness(hwc + 3 * i, f.brightness);
  float mean = 0;
  if (f.contrast != 1) {
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += gray(hwc + 3 * i);
    mean = static_cast<float>(sum / static_cast<double>(std::max<int64_t>(1, n)));
  }
  // One pass per op (each loop vectorises); per pixel the same sequence as formulas::jitter_rest.
  if (f.contrast != 1)
    for (int64_t i = 0; i < n; ++i) formulas::jitter_contrast(hwc + 3 * i, f.contrast, mean);
  if (f.saturation != 1)
    for (int64_t i = 0; i < n; ++i) formulas::jitter_saturation(hwc + 3 * i, f.saturation);
  if (f.hue != 0)
    for (int64_t i = 0; i < n; ++i) formulas::jitter_hue(hwc + 3 * i, f.hue);
}

CropBox draw_crop(int64_t size, float min_scale, std::mt19937_64& rng) {
  const double area = static_cast<double>(size) * static_cast<double>(size);
  const double log_lo = std::log(3.0 / 4.0), log_hi = std::log(4.0 / 3.0);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * uniform(rng, std::clamp(min_scale, 1e-3f, 1.0f), 1.0f);
    const double aspect = std::exp(uniform_real(rng, log_lo, log_hi));
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

namespace {

// The box (bx, by, bw, bh) of `pixel`'s S x S image resized to S x S into `dst` (HWC): the per-pixel
// formulas of resample_crop, the row's source computed once per row.
template <typename Pixel>
void resample_box(const Pixel& pixel, int64_t size, int64_t bx, int64_t by, int64_t bw, int64_t bh, float* dst) {
  for (int64_t y = 0; y < size; ++y) {
    int64_t y0, y1;
    float fy;
    formulas::crop_source(y, bh, size, &y0, &y1, &fy);
    for (int64_t x = 0; x < size; ++x) {
      int64_t x0, x1;
      float fx;
      formulas::crop_source(x, bw, size, &x0, &x1, &fx);
      formulas::resample_at(pixel, bx, by, y0, y1, fy, x0, x1, fx, dst + 3 * (y * size + x));
    }
  }
}

}  // namespace

void resize_crop(const float* src, int64_t size, const CropBox& box, float* dst) {
  resample_box(formulas::FloatPixel{src, size}, size, box.x, box.y, box.w, box.h, dst);
}

AugmentRecord draw_augment(const Augmentation& aug, uint64_t seed, uint64_t position, int64_t size) {
  AugmentRecord r;
  if (!aug.any()) return r;
  // Flip and rotation are drawn first, so a flips-only recipe draws what it always drew.
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + position);
  const uint64_t fr = rng();
  r.flip = aug.flips_rotations ? static_cast<int32_t>(fr & 1) : 0;
  r.rot = aug.flips_rotations ? static_cast<int32_t>((fr >> 1) & 3) : 0;
  if (aug.random_crop()) {
    const CropBox box = draw_crop(size, aug.crop_min_scale, rng);
    r.crop = 1;
    r.crop_x = static_cast<int32_t>(box.x), r.crop_y = static_cast<int32_t>(box.y);
    r.crop_w = static_cast<int32_t>(box.w), r.crop_h = static_cast<int32_t>(box.h);
  }
  if (aug.color_jitter()) {
    const JitterFactors f = draw_jitter(aug, rng);
    r.brightness = f.brightness, r.contrast = f.contrast, r.saturation = f.saturation, r.hue = f.hue;
  }
  if (aug.stain_jitter()) {
    r.stain = 1;
    for (int k = 0; k < 3; ++k) {
      r.stain_alpha[k] = uniform(rng, 1 - aug.stain_sigma, 1 + aug.stain_sigma);
      r.stain_beta[k] = uniform(rng, -aug.stain_sigma, aug.stain_sigma);
    }
  }
  return r;
}

bool is_identity(const AugmentRecord& r) {
  return !r.crop && r.flip == 0 && r.rot == 0 && r.brightness == 1 && r.contrast == 1 && r.saturation == 1 &&
         r.hue == 0 && !r.stain;
}

void augment_image(const uint8_t* rgb, int64_t size, const AugmentRecord& r, float* chw, float* scratch) {
  const int64_t n = size * size;
  if (is_identity(r)) {  // evaluation: straight from the bytes, no working copy
    for (int64_t k = 0; k < n; ++k) {  // channel by channel, unrolled: the plain loop stays vectorisable
      const uint8_t* p = rgb + 3 * k;
      chw[k] = formulas::imagenet_normalize(p[0] / 255.0f, 0);
      chw[n + k] = formulas::imagenet_normalize(p[1] / 255.0f, 1);
      chw[2 * n + k] = formulas::imagenet_normalize(p[2] / 255.0f, 2);
    }
    return;
  }
  float* hwc = scratch;
  if (r.crop) {
    resample_box(formulas::U8Pixel{rgb, size}, size, r.crop_x, r.crop_y, r.crop_w, r.crop_h, hwc);
  } else {
    for (int64_t k = 0; k < 3 * n; ++k) hwc[k] = rgb[k] / 255.0f;
  }
  apply_jitter(JitterFactors{r.brightness, r.contrast, r.saturation, r.hue}, hwc, n);
  if (r.stain)
    for (int64_t k = 0; k < n; ++k) formulas::hed_jitter(hwc + 3 * k, r.stain_alpha, r.stain_beta);
  for (int64_t y = 0; y < size; ++y)
    for (int64_t x = 0; x < size; ++x) {
      int64_t sy, sx;
      formulas::flip_rotate_source(y, x, size, r.flip, r.rot, &sy, &sx);
      const float* p = hwc + 3 * (sy * size + sx);
      for (int c = 0; c < 3; ++c) chw[(c * size + y) * size + x] = formulas::imagenet_normalize(p[c], c);
    }
}

}  // namespace slide::train
