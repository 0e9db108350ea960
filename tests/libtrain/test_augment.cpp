// Augmentation (augment.h) and Dropout: hand-computed values of torchvision's formulas, the crop
// geometry, determinism, and Dropout's gradient in double. The pixel-for-pixel comparison with
// torchvision itself is the e2e TestAugment.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <vector>

#include "slide/train/augment.h"
#include "slide/train/layers.h"
#include "test_util.h"
#include "../../libtrain/src/kernels/formulas.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_augment {

using namespace slide::train;
using slide::train::testing::dot_f64;
using slide::train::testing::random_f64;
using slide::train::testing::reference;

TEST_CASE("colour jitter: torchvision's brightness, contrast, saturation and hue formulas") {
  // Two pixels: orange-ish and dark blue.
  const std::vector<float> src = {0.8f, 0.5f, 0.2f, 0.1f, 0.2f, 0.6f};
  auto run = [&](JitterFactors f) {
    std::vector<float> v = src;
    apply_jitter(f, v.data(), 2);
    return v;
  };
  auto b = run({1.5f, 1, 1, 0});  // x * 1.5, clamped to 1
  CHECK(b[0] == doctest::Approx(1.0f));
  CHECK(b[1] == doctest::Approx(0.75f));
  CHECK(b[5] == doctest::Approx(0.9f));
  // contrast 0.5: 0.5 x + 0.5 mean(gray), gray = 0.2989 R + 0.587 G + 0.114 B over both pixels.
  const float g0 = 0.2989f * 0.8f + 0.587f * 0.5f + 0.114f * 0.2f, g1 = 0.2989f * 0.1f + 0.587f * 0.2f + 0.114f * 0.6f;
  auto c = run({1, 0.5f, 1, 0});
  CHECK(c[0] == doctest::Approx(0.5f * 0.8f + 0.5f * (g0 + g1) / 2));
  CHECK(c[4] == doctest::Approx(0.5f * 0.2f + 0.5f * (g0 + g1) / 2));
  // saturation 0: every channel becomes the pixel's gray.
  auto s = run({1, 1, 0, 0});
  CHECK(s[0] == doctest::Approx(g0));
  CHECK(s[2] == doctest::Approx(g0));
  CHECK(s[3] == doctest::Approx(g1));
  // hue: a third of the circle turns red into green, a half turns it into cyan.
  std::vector<float> red = {1, 0, 0};
  apply_jitter({1, 1, 1, 1.0f / 3}, red.data(), 1);
  CHECK(red[0] == doctest::Approx(0.0f));
  CHECK(red[1] == doctest::Approx(1.0f));
  CHECK(red[2] == doctest::Approx(0.0f));
  red = {1, 0, 0};
  apply_jitter({1, 1, 1, -0.5f}, red.data(), 1);
  CHECK(red == std::vector<float>{0, 1, 1});
  // A shift and its inverse give the colours back (HSV round trip).
  auto h = run({1, 1, 1, 0.2f});
  CHECK(h != src);
  apply_jitter({1, 1, 1, -0.2f}, h.data(), 2);
  for (size_t i = 0; i < src.size(); ++i) CHECK(h[i] == doctest::Approx(src[i]).epsilon(1e-5));
  // The identity changes nothing.
  CHECK(run({}) == src);
}

namespace {

// scikit-image's rgb2hed / hed2rgb (skimage.color.colorconv: combine_stains / separate_stains) in
// double, written from its documented algorithm, with hed_from_rgb inverted here (Cramer's rule)
// from the published rgb_from_hed: the reference for formulas::hed_jitter.
void hed_jitter_f64(const double* rgb, const double* alpha, const double* beta, double* out) {
  const double m[3][3] = {{0.65, 0.70, 0.29}, {0.07, 0.99, 0.11}, {0.27, 0.57, 0.78}};
  const double det = m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) -
                     m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0]) +
                     m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]);
  double inv[3][3];
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 3; ++j) {
      const int a = (j + 1) % 3, b = (j + 2) % 3, c = (i + 1) % 3, d = (i + 2) % 3;
      inv[i][j] = (m[a][c] * m[b][d] - m[a][d] * m[b][c]) / det;  // cofactor, transposed
    }
  const double log_adjust = std::log(1e-6);
  double hed[3];
  for (int k = 0; k < 3; ++k) {
    double s = 0;
    for (int c = 0; c < 3; ++c) s += std::log(std::max(rgb[c], 1e-6)) / log_adjust * inv[c][k];
    hed[k] = std::max(s, 0.0) * alpha[k] + beta[k];
  }
  for (int c = 0; c < 3; ++c) {
    double l = 0;
    for (int k = 0; k < 3; ++k) l += hed[k] * log_adjust * m[k][c];
    out[c] = std::min(1.0, std::max(0.0, std::exp(l)));
  }
}

}  // namespace

TEST_CASE("stain augmentation: HED jitter as scikit-image's colour deconvolution; draws in range, appended") {
  // H&E-like pixels (pink, purple, near white, dark), factors at and around the identity.
  const std::vector<std::array<float, 3>> pixels = {
      {0.91f, 0.55f, 0.75f}, {0.45f, 0.30f, 0.62f}, {0.97f, 0.96f, 0.98f}, {0.12f, 0.08f, 0.20f}, {0, 0.5f, 1}};
  const std::vector<std::array<float, 6>> factors = {
      {1, 1, 1, 0, 0, 0}, {1.05f, 0.95f, 1.02f, 0.03f, -0.04f, 0.01f}, {0.8f, 1.2f, 1.0f, -0.1f, 0.1f, 0}};
  double worst = 0;
  for (const auto& px : pixels)
    for (const auto& f : factors) {
      float p[3] = {px[0], px[1], px[2]};
      slide::train::formulas::hed_jitter(p, f.data(), f.data() + 3);
      const double rgb[3] = {px[0], px[1], px[2]}, a[3] = {f[0], f[1], f[2]}, b[3] = {f[3], f[4], f[5]};
      double want[3];
      hed_jitter_f64(rgb, a, b, want);
      for (int c = 0; c < 3; ++c) worst = std::max(worst, std::abs(double(p[c]) - want[c]));
    }
  MESSAGE("HED jitter: largest difference from the double reference ", worst);
  CHECK(worst < 2e-5);

  Augmentation aug;
  aug.flips_rotations = true;
  aug.brightness = 0.2f;
  aug.crop_min_scale = 0.5f;
  Augmentation stained = aug;
  stained.stain_sigma = 0.05f;
  CHECK(stained.any());
  for (uint64_t pos = 0; pos < 200; ++pos) {
    const AugmentRecord r = draw_augment(aug, 7, pos, 32), s = draw_augment(stained, 7, pos, 32);
    // The stain factors are drawn after everything else: the other draws are unchanged.
    CHECK(std::memcmp(&r, &s, offsetof(AugmentRecord, stain)) == 0);
    CHECK(r.stain == 0);
    REQUIRE(s.stain == 1);
    for (int k = 0; k < 3; ++k) {
      CHECK(s.stain_alpha[k] >= 0.95f);
      CHECK(s.stain_alpha[k] <= 1.05f);
      CHECK(std::abs(s.stain_beta[k]) <= 0.05f);
    }
    const AugmentRecord again = draw_augment(stained, 7, pos, 32);
    CHECK(std::memcmp(&again, &s, sizeof s) == 0);
  }
  // A stained record is not the identity, and changes the image.
  AugmentRecord id;
  CHECK(is_identity(id));
  AugmentRecord st = id;
  st.stain = 1, st.stain_alpha[0] = 1.05f, st.stain_beta[1] = 0.03f;
  CHECK_FALSE(is_identity(st));
  std::vector<uint8_t> tile(4 * 4 * 3);
  for (size_t i = 0; i < tile.size(); ++i) tile[i] = static_cast<uint8_t>(60 + 11 * i % 180);
  std::vector<float> plain(3 * 16), stain(3 * 16), scratch(3 * 16);
  augment_image(tile.data(), 4, id, plain.data(), scratch.data());
  augment_image(tile.data(), 4, st, stain.data(), scratch.data());
  CHECK(plain != stain);
}

TEST_CASE("colour jitter factors stay within ColorJitter's ranges") {
  Augmentation aug;
  aug.brightness = 0.25f, aug.contrast = 1.5f, aug.saturation = 0.1f, aug.hue = 0.05f;
  std::mt19937_64 rng(7);
  for (int i = 0; i < 1000; ++i) {
    const JitterFactors f = draw_jitter(aug, rng);
    CHECK((f.brightness >= 0.75f && f.brightness <= 1.25f));
    CHECK((f.contrast >= 0.0f && f.contrast <= 2.5f));
    CHECK((f.saturation >= 0.9f && f.saturation <= 1.1f));
    CHECK((f.hue >= -0.05f && f.hue <= 0.05f));
  }
}

TEST_CASE("random resized crop: boxes inside the tile, area and aspect within range; whole box is the identity") {
  std::mt19937_64 rng(3);
  const int64_t S = 64;
  for (int i = 0; i < 500; ++i) {
    const CropBox b = draw_crop(S, 0.3f, rng);
    REQUIRE((b.w > 0 && b.h > 0 && b.x >= 0 && b.y >= 0 && b.x + b.w <= S && b.y + b.h <= S));
    const double area = static_cast<double>(b.w * b.h) / (S * S);
    CHECK(area >= 0.3 * 0.85);  // rounding of w and h to whole pixels
    const double ratio = static_cast<double>(b.w) / static_cast<double>(b.h);
    CHECK((ratio >= 0.75 * 0.9 && ratio <= 4.0 / 3 * 1.1));
  }
  std::vector<float> img(static_cast<size_t>(3 * S * S)), out(img.size());
  for (size_t i = 0; i < img.size(); ++i) img[i] = static_cast<float>(i % 97) / 97.0f;
  resize_crop(img.data(), S, {0, 0, S, S}, out.data());
  CHECK(out == img);
  // Upsampling a 2 x 2 box of a 4 x 4 image: half-pixel centres give 0.25 / 0.75 weights.
  std::vector<float> small(3 * 16, 0.0f), up(3 * 16);
  for (int64_t y = 0; y < 4; ++y)
    for (int64_t x = 0; x < 4; ++x) small[static_cast<size_t>(3 * (y * 4 + x))] = static_cast<float>(x);  // red = column
  resize_crop(small.data(), 4, {1, 1, 2, 2}, up.data());
  // Output column 1: source 0.25 within the box -> 1 + 0.25 = 1.25; column 0 clamps to the box's first column.
  CHECK(up[3 * (0 * 4 + 0)] == doctest::Approx(1.0f));
  CHECK(up[3 * (0 * 4 + 1)] == doctest::Approx(1.25f));
  CHECK(up[3 * (0 * 4 + 2)] == doctest::Approx(1.75f));
  CHECK(up[3 * (0 * 4 + 3)] == doctest::Approx(2.0f));
}

TEST_CASE("Dropout: identity in inference, mask from the seed, gradient in double") {
  Backend& be = reference();
  Dropout d(0.4);
  Tensor x = random_f64({4, 50}, 11);
  auto y_eval = d.forward(be, x, false);
  REQUIRE(y_eval.ok());
  CHECK(y_eval->raw() == x.raw());
  d.set_rng_seed(5);
  auto y = d.forward(be, x, true);
  REQUIRE(y.ok());
  int64_t zeros = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double v = y->data<double>()[i], want = x.data<double>()[i] / 0.6;
    if (v == 0) ++zeros;
    else CHECK(v == doctest::Approx(want));
  }
  CHECK((zeros > 50 && zeros < 110));  // p = 0.4 of 200: 80 expected
  // The same seed draws the same mask; another seed another.
  Tensor first = *y->clone();
  d.set_rng_seed(5);
  auto again = d.forward(be, x, true);
  REQUIRE(again.ok());
  CHECK(std::memcmp(again->raw(), first.raw(), first.bytes()) == 0);
  d.set_rng_seed(6);
  auto other = d.forward(be, x, true);
  REQUIRE(other.ok());
  CHECK(std::memcmp(other->raw(), first.raw(), first.bytes()) != 0);
  // Gradient of sum(y * r) with the mask fixed by the seed: central differences.
  Tensor r = random_f64(x.shape(), 12);
  d.set_rng_seed(9);
  auto y9 = d.forward(be, x, true);
  REQUIRE(y9.ok());
  auto dx = d.backward(be, r);
  REQUIRE(dx.ok());
  const double h = 1e-6;
  for (int64_t i : {0, 7, 33, 150, 199}) {
    const double keep = x.data<double>()[i];
    x.data<double>()[i] = keep + h;
    d.set_rng_seed(9);
    const double up = dot_f64(*d.forward(be, x, true), r);
    x.data<double>()[i] = keep - h;
    d.set_rng_seed(9);
    const double down = dot_f64(*d.forward(be, x, true), r);
    x.data<double>()[i] = keep;
    CHECK(dx->data<double>()[i] == doctest::Approx((up - down) / (2 * h)).epsilon(1e-6));
  }
  // A sample's mask depends on its position only: rows 2..3 of a batch seeded s equal rows 0..1 of
  // a micro-batch seeded s + 2 (the same samples split differently, as under OOM recovery or ranks).
  Tensor whole = random_f64({4, 30}, 13), half = *Tensor::empty({2, 30}, DType::kF64, cpu_allocator());
  std::memcpy(half.raw(), whole.data<double>() + 60, half.bytes());
  d.set_rng_seed(100);
  Tensor yw = *d.forward(be, whole, true)->clone();
  d.set_rng_seed(102);
  auto yh = d.forward(be, half, true);
  REQUIRE(yh.ok());
  CHECK(std::memcmp(yh->raw(), yw.data<double>() + 60, yh->bytes()) == 0);
  Dropout bad(1.0);
  CHECK(bad.forward(be, x, true).status().code() == slide::core::StatusCode::kInvalidArgument);
}

}  // namespace libtrain_test_augment
