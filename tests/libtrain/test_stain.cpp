// Stain normalisation (slide/train/stain.h): CIE L*a*b* against published values, round trips,
// Reinhard's, Macenko's and Vahadane's known answers on constructed images, the reference normalised to its own
// target on a real H&E tile, JSON round trips, errors. The NumPy transcription of the same
// formulas is in tests/e2e/test_stain.py, which drives this file's `stain_io` suite (excluded from
// the plain run) with SLIDE_STAIN_JOB naming a job file.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "slide/core/file.h"
#include "slide/tile/image.h"
#include "slide/train/stain.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_stain {

using namespace slide::train;

namespace {

#define OK_STAIN(expr)                                             \
  do {                                                             \
    const slide::core::Status s_ = slide::core::detail::to_status(expr); \
    REQUIRE_MESSAGE(s_.ok(), s_.to_string());                      \
  } while (0)

// A real H&E tile: the first (sorted) LC25000 patch of a class in sample_data (224 x 224 JPEG).
slide::tile::RgbImage lc_tile(const std::string& cls) {
  const std::string dir = std::string(SLIDE_SAMPLE_DIR) + "/patches/lc25000-lung-subset/" + cls;
  std::vector<std::string> paths;
  for (const auto& e : std::filesystem::directory_iterator(dir)) paths.push_back(e.path().string());
  REQUIRE(!paths.empty());
  std::sort(paths.begin(), paths.end());
  auto img = slide::tile::read_image_file(paths.front());
  REQUIRE(img.ok());
  return std::move(*img);
}

double mean_abs_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  REQUIRE(a.size() == b.size());
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += std::abs(static_cast<int>(a[i]) - static_cast<int>(b[i]));
  return s / static_cast<double>(a.size());
}

// Ruifrok & Johnston's H&E optical density vectors (Anal. Quant. Cytol. Histol. 23(4), 2001,
// table 1, normalised), in natural-log OD units up to scale.
void unit(double v[3]) {
  const double n = std::sqrt(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
  for (int k = 0; k < 3; ++k) v[k] /= n;
}

}  // namespace

TEST_CASE("stain: method names") {
  CHECK(*parse_stain_method("none") == StainMethod::kNone);
  CHECK(*parse_stain_method("reinhard") == StainMethod::kReinhard);
  CHECK(*parse_stain_method("macenko") == StainMethod::kMacenko);
  CHECK(*parse_stain_method("vahadane") == StainMethod::kVahadane);
  auto bad = parse_stain_method("ruifrok");
  REQUIRE(!bad.ok());
  CHECK(bad.status().code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(bad.status().message().find("ruifrok") != std::string::npos);
  for (auto m : {StainMethod::kNone, StainMethod::kReinhard, StainMethod::kMacenko, StainMethod::kVahadane})
    CHECK(*parse_stain_method(stain_method_name(m)) == m);
}

TEST_CASE("stain: sRGB -> L*a*b* against published values, and the 8-bit round trip") {
  // Published CIELAB (D65) of the sRGB primaries and white: e.g. Bruce Lindbloom's calculator and
  // scikit-image's rgb2lab: white (100, 0, 0), red (53.24, 80.09, 67.20), green (87.73, -86.18,
  // 83.18), blue (32.30, 79.19, -107.86).
  struct Case {
    uint8_t rgb[3];
    double lab[3];
  };
  const Case cases[] = {{{255, 255, 255}, {100.0, 0.0, 0.0}},
                        {{0, 0, 0}, {0.0, 0.0, 0.0}},
                        {{255, 0, 0}, {53.24, 80.09, 67.20}},
                        {{0, 255, 0}, {87.73, -86.18, 83.18}},
                        {{0, 0, 255}, {32.30, 79.19, -107.86}}};
  for (const auto& c : cases) {
    double lab[3];
    rgb_to_lab(c.rgb, lab);
    for (int k = 0; k < 3; ++k) CHECK(std::abs(lab[k] - c.lab[k]) < 0.02);
  }
  // Every 8-bit colour on a grid comes back exactly.
  int worst = 0;
  for (int r = 0; r < 256; r += 3)
    for (int g = 0; g < 256; g += 5)
      for (int b = 0; b < 256; b += 3) {
        const uint8_t in[3] = {static_cast<uint8_t>(r), static_cast<uint8_t>(g), static_cast<uint8_t>(b)};
        double lab[3];
        uint8_t out[3];
        rgb_to_lab(in, lab);
        lab_to_rgb(lab, out);
        for (int k = 0; k < 3; ++k) worst = std::max(worst, std::abs(in[k] - out[k]));
      }
  CHECK(worst == 0);
}

TEST_CASE("stain: Reinhard on constant images maps to the reference colour") {
  const int64_t w = 7, h = 5;
  const uint8_t ref_rgb[3] = {200, 120, 180}, src_rgb[3] = {150, 90, 200};
  std::vector<uint8_t> ref(3 * w * h), src(3 * w * h);
  for (int64_t i = 0; i < w * h; ++i)
    for (int k = 0; k < 3; ++k) ref[3 * i + k] = ref_rgb[k], src[3 * i + k] = src_rgb[k];
  auto t = fit_stain_target(StainMethod::kReinhard, ref.data(), w, h);
  OK_STAIN(t);
  double lab[3];
  rgb_to_lab(ref_rgb, lab);
  for (int k = 0; k < 3; ++k) CHECK(t->reinhard_mean[k] == doctest::Approx(lab[k]).epsilon(1e-12));
  OK_STAIN(normalise_stain(*t, src.data(), w, h));
  for (int64_t i = 0; i < w * h; ++i)
    for (int k = 0; k < 3; ++k) REQUIRE(src[3 * i + k] == ref_rgb[k]);
}

TEST_CASE("stain: Reinhard matches the reference's Lab statistics on a real tile") {
  auto ref = lc_tile("lung_n");
  auto src = lc_tile("lung_scc");
  auto t = fit_stain_target(StainMethod::kReinhard, ref.pixels.data(), ref.width, ref.height);
  OK_STAIN(t);
  // The reference against its own target: scale 1, shift 0, up to rounding.
  std::vector<uint8_t> self = ref.pixels;
  OK_STAIN(normalise_stain(*t, self.data(), ref.width, ref.height));
  int worst = 0;
  for (size_t i = 0; i < self.size(); ++i) worst = std::max(worst, std::abs(self[i] - ref.pixels[i]));
  CHECK(worst <= 1);
  // Another class's tile: its Lab means move to the reference's (up to clipping and rounding).
  std::vector<uint8_t> out = src.pixels;
  OK_STAIN(normalise_stain(*t, out.data(), src.width, src.height));
  auto before = fit_stain_target(StainMethod::kReinhard, src.pixels.data(), src.width, src.height);
  auto after = fit_stain_target(StainMethod::kReinhard, out.data(), src.width, src.height);
  OK_STAIN(before);
  OK_STAIN(after);
  for (int k = 0; k < 3; ++k) {
    CHECK(std::abs(after->reinhard_mean[k] - t->reinhard_mean[k]) < 0.5);
    CHECK(std::abs(after->reinhard_mean[k] - t->reinhard_mean[k]) <
          std::abs(before->reinhard_mean[k] - t->reinhard_mean[k]) + 1e-9);
  }
}

TEST_CASE("stain: Macenko recovers the stain vectors of a constructed H&E image") {
  // Ruifrok & Johnston's H and E vectors; pixels I = 256 exp(-(cH H + cE E)) - 1 (the inverse of
  // stain.h's optical density), 10% pure H, 10% pure E, the rest mixtures. The 1st/99th angle
  // percentiles then fall on the pure stains.
  double H[3] = {0.650, 0.704, 0.286}, E[3] = {0.072, 0.990, 0.105};
  unit(H);
  unit(E);
  const int64_t w = 100, h = 100;
  std::vector<uint8_t> img(3 * w * h);
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.2, 1.5), pure_h(0.6, 1.5), pure_e(2.2, 3.0);
  for (int64_t i = 0; i < w * h; ++i) {
    double ch = u(rng), ce = u(rng);
    // Pure pixels dense enough to pass beta = 0.15 in every channel (E's red and blue ODs are
    // small: 0.07 and 0.1 per unit of concentration).
    if (i % 10 == 0) ch = pure_h(rng), ce = 0;
    if (i % 10 == 1) ch = 0, ce = pure_e(rng);
    for (int k = 0; k < 3; ++k)
      img[3 * i + k] = static_cast<uint8_t>(std::clamp(std::floor(256 * std::exp(-(ch * H[k] + ce * E[k])) - 1 + 0.5), 0.0, 255.0));
  }
  auto t = fit_stain_target(StainMethod::kMacenko, img.data(), w, h);
  OK_STAIN(t);
  double dot_h = 0, dot_e = 0;
  for (int k = 0; k < 3; ++k) dot_h += t->stain_matrix[k][0] * H[k], dot_e += t->stain_matrix[k][1] * E[k];
  MESSAGE("fitted . true: H " << dot_h << ", E " << dot_e);
  CHECK(dot_h > 0.995);  // within ~6 degrees: 8-bit quantisation and pixels below beta are dropped
  CHECK(dot_e > 0.995);
  CHECK(t->max_concentration[0] > 1.0);
  CHECK(t->max_concentration[1] > 1.0);
  // The image lies in a stain plane (up to 8-bit quantisation): against its own target it comes
  // back to within a grey level.
  std::vector<uint8_t> self = img;
  OK_STAIN(normalise_stain(*t, self.data(), w, h));
  const double d_self = mean_abs_diff(self, img);
  MESSAGE("Macenko, constructed image against its own target: mean |diff| = " << d_self);
  CHECK(d_self <= 1.0);
}

TEST_CASE("stain: Macenko on real tiles; the reference reproduces itself") {
  auto ref = lc_tile("lung_aca");
  auto src = lc_tile("lung_n");
  auto t = fit_stain_target(StainMethod::kMacenko, ref.pixels.data(), ref.width, ref.height);
  OK_STAIN(t);
  // H has the larger red OD component; columns are unit vectors.
  CHECK(t->stain_matrix[0][0] > t->stain_matrix[0][1]);
  for (int c = 0; c < 2; ++c) {
    double n = 0;
    for (int k = 0; k < 3; ++k) n += t->stain_matrix[k][c] * t->stain_matrix[k][c];
    CHECK(n == doctest::Approx(1.0).epsilon(1e-12));
  }
  std::vector<uint8_t> self = ref.pixels;
  OK_STAIN(normalise_stain(*t, self.data(), ref.width, ref.height));
  const double d_self = mean_abs_diff(self, ref.pixels);
  MESSAGE("Macenko, reference against its own target: mean |diff| = " << d_self << " grey levels");
  // Macenko recomposes each pixel from its two stain concentrations, i.e. projects its OD onto the
  // H-E plane: even the reference loses its out-of-plane residual (measured: 2.7 grey levels on
  // this tile; an image that lies in a stain plane reproduces itself: the constructed case above).
  CHECK(d_self <= 3.0);
  std::vector<uint8_t> out = src.pixels;
  OK_STAIN(normalise_stain(*t, out.data(), src.width, src.height));
  CHECK(mean_abs_diff(out, src.pixels) > 2.0);  // another tile does change
  // Normalised again to the same target: the tile's fitted target is now near the reference's.
  auto after = fit_stain_target(StainMethod::kMacenko, out.data(), src.width, src.height);
  OK_STAIN(after);
  for (int c = 0; c < 2; ++c) {
    double dot = 0;
    for (int k = 0; k < 3; ++k) dot += after->stain_matrix[k][c] * t->stain_matrix[k][c];
    CHECK(dot > 0.99);
  }
}

TEST_CASE("stain: Vahadane recovers the stain vectors of a constructed sparse H&E image") {
  // Stains 10-15 degrees away from Ruifrok and Johnston's (the solver's starting point), and
  // sparse concentrations as the method assumes: 40% of the pixels pure H, 40% pure E, 20%
  // mixtures. Pixels I = 256 exp(-(cH H + cE E)) - 1, 8-bit.
  double H[3] = {0.50, 0.78, 0.38}, E[3] = {0.20, 0.97, 0.14};
  unit(H);
  unit(E);
  const int64_t w = 100, h = 100;
  std::vector<uint8_t> img(3 * w * h);
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.3, 1.5);
  for (int64_t i = 0; i < w * h; ++i) {
    double ch = u(rng), ce = u(rng);
    if (i % 5 < 2) ce = 0;
    else if (i % 5 < 4) ch = 0;
    for (int k = 0; k < 3; ++k)
      img[3 * i + k] = static_cast<uint8_t>(std::clamp(std::floor(256 * std::exp(-(ch * H[k] + ce * E[k])) - 1 + 0.5), 0.0, 255.0));
  }
  auto t = fit_stain_target(StainMethod::kVahadane, img.data(), w, h);
  OK_STAIN(t);
  double dot_h = 0, dot_e = 0, n_h = 0, n_e = 0;
  for (int k = 0; k < 3; ++k) {
    dot_h += t->stain_matrix[k][0] * H[k], dot_e += t->stain_matrix[k][1] * E[k];
    n_h += t->stain_matrix[k][0] * t->stain_matrix[k][0], n_e += t->stain_matrix[k][1] * t->stain_matrix[k][1];
  }
  MESSAGE("Vahadane fitted . true: H " << dot_h << ", E " << dot_e);
  CHECK(n_h == doctest::Approx(1.0).epsilon(1e-12));
  CHECK(n_e == doctest::Approx(1.0).epsilon(1e-12));
  CHECK(dot_h > 0.9995);  // within ~2 degrees
  CHECK(dot_e > 0.9995);
  // Macenko's estimate of the same image, for comparison (printed only).
  auto m = fit_stain_target(StainMethod::kMacenko, img.data(), w, h);
  OK_STAIN(m);
  double mdot_h = 0, mdot_e = 0;
  for (int k = 0; k < 3; ++k) mdot_h += m->stain_matrix[k][0] * H[k], mdot_e += m->stain_matrix[k][1] * E[k];
  MESSAGE("Macenko fitted . true: H " << mdot_h << ", E " << mdot_e);
  CHECK(t->max_concentration[0] > 1.0);
  CHECK(t->max_concentration[1] > 1.0);
  // Against its own target the image comes back to within a grey level or so (its ODs lie in the
  // stain plane; the lasso's shrinkage is undone by the max-concentration scaling only at the top).
  std::vector<uint8_t> self = img;
  OK_STAIN(normalise_stain(*t, self.data(), w, h));
  const double d_self = mean_abs_diff(self, img);
  MESSAGE("Vahadane, constructed image against its own target: mean |diff| = " << d_self);
  CHECK(d_self <= 1.5);
}

TEST_CASE("stain: Vahadane on real tiles: H first, unit stains, the reference reproduces itself") {
  auto ref = lc_tile("lung_aca");
  auto src = lc_tile("lung_n");
  auto t = fit_stain_target(StainMethod::kVahadane, ref.pixels.data(), ref.width, ref.height);
  OK_STAIN(t);
  CHECK(t->stain_matrix[0][0] > t->stain_matrix[0][1]);
  for (int c = 0; c < 2; ++c) {
    double n = 0;
    for (int k = 0; k < 3; ++k) {
      n += t->stain_matrix[k][c] * t->stain_matrix[k][c];
      CHECK(t->stain_matrix[k][c] >= 0);  // a non-negative dictionary
    }
    CHECK(n == doctest::Approx(1.0).epsilon(1e-12));
  }
  // Macenko's and Vahadane's H and E on the same tile are near each other (both estimate the same
  // stains), not equal.
  auto m = fit_stain_target(StainMethod::kMacenko, ref.pixels.data(), ref.width, ref.height);
  OK_STAIN(m);
  for (int c = 0; c < 2; ++c) {
    double dot = 0;
    for (int k = 0; k < 3; ++k) dot += t->stain_matrix[k][c] * m->stain_matrix[k][c];
    MESSAGE("Vahadane . Macenko, stain " << c << ": " << dot);
    CHECK(dot > 0.95);
  }
  std::vector<uint8_t> self = ref.pixels;
  OK_STAIN(normalise_stain(*t, self.data(), ref.width, ref.height));
  const double d_self = mean_abs_diff(self, ref.pixels);
  MESSAGE("Vahadane, reference against its own target: mean |diff| = " << d_self << " grey levels");
  CHECK(d_self <= 4.0);
  std::vector<uint8_t> out = src.pixels;
  OK_STAIN(normalise_stain(*t, out.data(), src.width, src.height));
  CHECK(mean_abs_diff(out, src.pixels) > 2.0);
  // Normalised to the target, the tile's own Vahadane stains are the reference's.
  auto after = fit_stain_target(StainMethod::kVahadane, out.data(), src.width, src.height);
  OK_STAIN(after);
  for (int c = 0; c < 2; ++c) {
    double dot = 0;
    for (int k = 0; k < 3; ++k) dot += after->stain_matrix[k][c] * t->stain_matrix[k][c];
    CHECK(dot > 0.99);
  }
}

TEST_CASE("stain: tiles without tissue are returned unchanged; none changes nothing") {
  auto ref = lc_tile("lung_aca");
  auto t = fit_stain_target(StainMethod::kMacenko, ref.pixels.data(), ref.width, ref.height);
  OK_STAIN(t);
  std::vector<uint8_t> white(3 * 32 * 32, 250), flat(3 * 32 * 32);
  for (size_t i = 0; i < flat.size(); i += 3) flat[i] = 150, flat[i + 1] = 80, flat[i + 2] = 160;
  auto v = fit_stain_target(StainMethod::kVahadane, ref.pixels.data(), ref.width, ref.height);
  OK_STAIN(v);
  for (auto* img : {&white, &flat}) {
    const std::vector<uint8_t> before = *img;
    OK_STAIN(normalise_stain(*t, img->data(), 32, 32));
    CHECK(*img == before);
    OK_STAIN(normalise_stain(*v, img->data(), 32, 32));
    CHECK(*img == before);
  }
  // kNone: a no-op.
  std::vector<uint8_t> tile = ref.pixels;
  auto none = fit_stain_target(StainMethod::kNone, tile.data(), ref.width, ref.height);
  OK_STAIN(none);
  CHECK(none->method == StainMethod::kNone);
  OK_STAIN(normalise_stain(*none, tile.data(), ref.width, ref.height));
  CHECK(tile == ref.pixels);
}

TEST_CASE("stain: thread-safe: tiles normalised on 4 threads at once equal the serial result") {
  auto ref = lc_tile("lung_aca");
  auto src = lc_tile("lung_scc");
  for (auto m : {StainMethod::kReinhard, StainMethod::kMacenko, StainMethod::kVahadane}) {
    auto t = fit_stain_target(m, ref.pixels.data(), ref.width, ref.height);
    OK_STAIN(t);
    std::vector<uint8_t> serial = src.pixels;
    OK_STAIN(normalise_stain(*t, serial.data(), src.width, src.height));
    std::vector<std::vector<uint8_t>> outs(4, src.pixels);
    std::vector<int> ok(4, 0);
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i)
      threads.emplace_back([&, i] { ok[i] = normalise_stain(*t, outs[i].data(), src.width, src.height).ok() ? 1 : 0; });
    for (auto& th : threads) th.join();
    for (int i = 0; i < 4; ++i) {
      CHECK(ok[i] == 1);
      CHECK(outs[i] == serial);
    }
  }
}

TEST_CASE("stain: JSON round trips bit for bit; bad JSON is refused") {
  auto ref = lc_tile("lung_aca");
  for (auto m : {StainMethod::kNone, StainMethod::kReinhard, StainMethod::kMacenko, StainMethod::kVahadane}) {
    auto t = fit_stain_target(m, ref.pixels.data(), ref.width, ref.height);
    OK_STAIN(t);
    const std::string j = stain_target_to_json(*t);
    auto back = stain_target_from_json(j);
    OK_STAIN(back);
    CHECK(back->method == m);
    for (int k = 0; k < 3; ++k) {
      CHECK(back->reinhard_mean[k] == t->reinhard_mean[k]);
      CHECK(back->reinhard_std[k] == t->reinhard_std[k]);
      for (int c = 0; c < 2; ++c) CHECK(back->stain_matrix[k][c] == t->stain_matrix[k][c]);
    }
    CHECK(back->max_concentration[0] == t->max_concentration[0]);
    CHECK(back->max_concentration[1] == t->max_concentration[1]);
    CHECK(stain_target_to_json(*back) == j);
  }
  for (const char* bad : {"", "[1,2]", "{\"method\":\"vahadane\"}", "{\"method\":\"reinhard\"}",
                          "{\"method\":\"reinhard\",\"reinhard_mean\":[1,2],\"reinhard_std\":[1,1,1]}",
                          "{\"method\":\"reinhard\",\"reinhard_mean\":[1,2,3],\"reinhard_std\":[1,0,1]}",
                          "{\"method\":\"macenko\",\"macenko_he\":[[1,0],[0,1]],\"macenko_max_c\":[1,1]}",
                          "{\"method\":\"macenko\",\"macenko_he\":[[1,0],[0,1],[0,0]],\"macenko_max_c\":[1,-1]}",
                          "{\"method\":\"macenko\",\"macenko_he\":[[1,0],[0,\"x\"],[0,0]],\"macenko_max_c\":[1,1]}",
                          // a Vahadane target under Macenko's keys, and the reverse
                          "{\"method\":\"vahadane\",\"macenko_he\":[[1,0],[0,1],[0,0]],\"macenko_max_c\":[1,1]}",
                          "{\"method\":\"macenko\",\"vahadane_he\":[[1,0],[0,1],[0,0]],\"vahadane_max_c\":[1,1]}",
                          "{\"method\":\"vahadane\",\"vahadane_he\":[[1,0],[0,1],[0,0]],\"vahadane_max_c\":[0,1]}"}) {
    auto r = stain_target_from_json(bad);
    CHECK_MESSAGE(!r.ok(), bad);
    if (!r.ok()) CHECK(r.status().code() == slide::core::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("stain: errors on bad input") {
  std::vector<uint8_t> white(3 * 16 * 16, 255);
  auto t = fit_stain_target(StainMethod::kMacenko, white.data(), 16, 16);
  REQUIRE(!t.ok());
  CHECK(t.status().code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(t.status().message().find("too few tissue") != std::string::npos);
  CHECK(!fit_stain_target(StainMethod::kReinhard, nullptr, 16, 16).ok());
  CHECK(!fit_stain_target(StainMethod::kReinhard, white.data(), 0, 16).ok());
  CHECK(!fit_stain_target(StainMethod::kMacenko, white.data(), 16, -1).ok());
  StainTarget nan_target;
  nan_target.method = StainMethod::kReinhard;
  nan_target.reinhard_std[0] = nan_target.reinhard_std[1] = nan_target.reinhard_std[2] = 1;
  nan_target.reinhard_mean[1] = std::nan("");
  CHECK(!normalise_stain(nan_target, white.data(), 16, 16).ok());
  StainTarget zero_macenko;
  zero_macenko.method = StainMethod::kMacenko;
  CHECK(!normalise_stain(zero_macenko, white.data(), 16, 16).ok());
  zero_macenko.method = StainMethod::kVahadane;
  CHECK(!normalise_stain(zero_macenko, white.data(), 16, 16).ok());
  auto v = fit_stain_target(StainMethod::kVahadane, white.data(), 16, 16);
  REQUIRE(!v.ok());
  CHECK(v.status().message().find("Vahadane reference: too few tissue") != std::string::npos);
  StainTarget fine;
  CHECK(!normalise_stain(fine, nullptr, 16, 16).ok());
  CHECK(!normalise_stain(fine, white.data(), 16, 0).ok());
}

// The e2e test's side (tests/e2e/test_stain.py): SLIDE_STAIN_JOB names a file of lines
//   fit METHOD IN.rgb W H OUT.json       (fit_stain_target on raw RGB; the target's JSON)
//   norm TARGET.json IN.rgb W H OUT.rgb  (normalise_stain; the raw RGB result)
TEST_CASE("stain: jobs from the e2e test" * doctest::test_suite("stain_io")) {
  const char* job = std::getenv("SLIDE_STAIN_JOB");
  if (job == nullptr) return;
  std::ifstream lines(job);
  REQUIRE(lines.good());
  auto read_bytes = [](const std::string& path) {
    auto b = slide::core::read_file(path);
    REQUIRE_MESSAGE(b.ok(), b.status().to_string());
    return *b;
  };
  auto write_bytes = [](const std::string& path, const void* data, size_t n) {
    std::ofstream out(path, std::ios::binary);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    REQUIRE(out.good());
  };
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream f(line);
    std::string kind, a, in, out;
    int64_t w = 0, h = 0;
    f >> kind >> a >> in >> w >> h >> out;
    if (kind.empty()) continue;
    std::string bytes = read_bytes(in);
    REQUIRE(static_cast<int64_t>(bytes.size()) == w * h * 3);
    auto* px = reinterpret_cast<uint8_t*>(bytes.data());
    if (kind == "fit") {
      auto m = parse_stain_method(a);
      OK_STAIN(m);
      auto t = fit_stain_target(*m, px, w, h);
      OK_STAIN(t);
      const std::string j = stain_target_to_json(*t);
      write_bytes(out, j.data(), j.size());
    } else if (kind == "norm") {
      auto t = stain_target_from_json(read_bytes(a));
      OK_STAIN(t);
      OK_STAIN(normalise_stain(*t, px, w, h));
      write_bytes(out, px, bytes.size());
    } else {
      FAIL("unknown job " << kind);
    }
  }
}

}  // namespace libtrain_test_stain
#undef OK_STAIN
