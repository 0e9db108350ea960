// Tissue detection and the tile grid (libtile/src/tissue.cpp, grid.cpp), against an in-memory
// fake slide and, where the real readers are built, the CMU-1-Small-Region sample.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "slide/tile/figure.h"
#include "slide/tile/grid.h"
#include "slide/tile/image.h"
#include "slide/tile/pipeline.h"
#include "slide/tile/slide.h"
#include "slide/tile/tissue.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtile_test_tissue_grid {

namespace {

using slide::core::Status;
using slide::core::StatusCode;
using slide::tile::GridOptions;
using slide::tile::RgbImage;
using slide::tile::SlideProperties;
using slide::tile::TilePlan;
using slide::tile::TissueMask;
using slide::tile::TissueOptions;

constexpr uint8_t kPink[3] = {230, 150, 200};  // saturation 255 * 80 / 230 = 88

void paint_disk(RgbImage* img, double cx, double cy, double radius, const uint8_t* rgb) {
  for (int64_t y = 0; y < img->height; ++y)
    for (int64_t x = 0; x < img->width; ++x) {
      const double dx = static_cast<double>(x) + 0.5 - cx, dy = static_cast<double>(y) + 0.5 - cy;
      if (dx * dx + dy * dy < radius * radius) std::copy(rgb, rgb + 3, img->row(y) + 3 * x);
    }
}

// An in-memory slide: level 0 is given, levels 1 and 2 are 2x and 4x box downsamples of it.
class FakeSlide : public slide::tile::SlideReader {
 public:
  explicit FakeSlide(RgbImage level0, int64_t tile_px = 0, bool raw_jpeg = false) : raw_jpeg_(raw_jpeg) {
    levels_.push_back(std::move(level0));
    for (int i = 1; i < 3; ++i) {
      const RgbImage& prev = levels_.back();
      RgbImage next(prev.width / 2, prev.height / 2);
      slide::tile::resample_area(prev, 0, 0, 2.0, &next);
      levels_.push_back(std::move(next));
    }
    props_.path = "fake.svs";
    props_.vendor = "fake";
    for (size_t i = 0; i < levels_.size(); ++i)
      props_.levels.push_back({levels_[i].width, levels_[i].height, static_cast<double>(1 << i), tile_px, tile_px});
  }

  const SlideProperties& properties() const override { return props_; }
  const RgbImage& level(int i) const { return levels_[static_cast<size_t>(i)]; }

  Status read_region(int64_t x_l0, int64_t y_l0, int level, int64_t w, int64_t h, uint8_t* rgb) const override {
    if (level < 0 || level >= 3 || w <= 0 || h <= 0) return slide::core::invalid_argument("bad read_region");
    ++calls_;
    max_pixels_ = std::max(max_pixels_, w * h);
    const RgbImage& img = levels_[static_cast<size_t>(level)];
    const int64_t d = int64_t{1} << level;
    // The fake's callers must land on whole level pixels (they do: downsamples are 1, 2, 4).
    if (x_l0 % d != 0 || y_l0 % d != 0) return slide::core::invalid_argument("unaligned read_region");
    const int64_t lx = x_l0 / d, ly = y_l0 / d;
    for (int64_t y = 0; y < h; ++y)
      for (int64_t x = 0; x < w; ++x) {
        uint8_t* out = rgb + 3 * (y * w + x);
        const int64_t sx = lx + x, sy = ly + y;
        if (sx < 0 || sy < 0 || sx >= img.width || sy >= img.height) {
          out[0] = out[1] = out[2] = 255;
        } else {
          std::copy(img.row(sy) + 3 * sx, img.row(sy) + 3 * sx + 3, out);
        }
      }
    return slide::core::ok_status();
  }

  bool has_raw_jpeg_tiles(int) const override { return raw_jpeg_; }

  mutable int64_t calls_ = 0;
  mutable int64_t max_pixels_ = 0;

 private:
  std::vector<RgbImage> levels_;
  SlideProperties props_;
  bool raw_jpeg_;
};

// 1000 x 800 px: white with light noise, a pink disk of radius 250 px centred at (500, 400).
RgbImage fake_level0() {
  RgbImage img(1000, 800, 255);
  std::mt19937 rng(7);
  for (auto& p : img.pixels) p = static_cast<uint8_t>(240 + rng() % 16);
  paint_disk(&img, 500, 400, 250, kPink);
  return img;
}

SlideProperties fake_props(double downsample1 = 2, double downsample2 = 4) {
  SlideProperties p;
  p.path = "geometry.svs";
  p.levels = {{1000, 800, 1, 0, 0}, {500, 400, downsample1, 0, 0}, {250, 200, downsample2, 0, 0}};
  return p;
}

GridOptions grid(double target, int tile, int stride = 0, double min_tissue = 0) {
  GridOptions g;
  g.target_mpp_um = target;
  g.tile_size_px = tile;
  g.stride_px = stride;
  g.min_tissue = min_tissue;
  return g;
}

}  // namespace

TEST_CASE("test_tissue_grid: otsu_threshold") {
  // Values {0, 0, 1, 3}: t = 0 gives w0 w1 (mu0 - mu1)^2 = 2 * 2 * 2^2 = 16; t = 1 gives
  // 3 * 1 * (1/3 - 3)^2 = 21.3 (t = 2 ties with it; the first maximum wins).
  std::vector<int64_t> h(256, 0);
  h[0] = 2, h[1] = 1, h[3] = 1;
  CHECK(slide::tile::otsu_threshold(h) == 1);
  // Two modes {10, 11} and {100, 101}: every t in 11..99 separates them; the first is 11.
  std::vector<int64_t> b(256, 0);
  b[10] = b[11] = 50;
  b[100] = b[101] = 50;
  CHECK(slide::tile::otsu_threshold(b) == 11);
  // Unequal modes move nothing: still the gap's lower edge.
  b[100] = 500;
  CHECK(slide::tile::otsu_threshold(b) == 11);
  std::vector<int64_t> constant(256, 0);
  constant[77] = 1000;
  CHECK(slide::tile::otsu_threshold(constant) == 0);
  CHECK(slide::tile::otsu_threshold(std::vector<int64_t>(256, 0)) == 0);
}

TEST_CASE("test_tissue_grid: detect_tissue_in_thumbnail keeps the disk, drops the speck, fills small holes") {
  RgbImage t(200, 200, 255);
  std::mt19937 rng(3);
  for (auto& p : t.pixels) p = static_cast<uint8_t>(235 + rng() % 21);  // glass noise
  const uint8_t white[3] = {255, 255, 255};
  paint_disk(&t, 100, 100, 50, kPink);
  paint_disk(&t, 85, 100, 5, white);    // ~79 px hole: below min_hole (312 px) -> filled
  paint_disk(&t, 120, 100, 15, white);  // ~707 px hole: kept
  for (int y = 16; y < 24; ++y)         // 8x8 speck: 64 px < min_object (312 px) -> removed
    for (int x = 16; x < 24; ++x) std::copy(kPink, kPink + 3, t.row(y) + 3 * x);
  TissueOptions opt;
  // 8 µm thumbnail px: 64 µm² each; 20000 µm² = 312.5 px.
  TissueMask m = slide::tile::detect_tissue_in_thumbnail(t, 32, 32, 64, opt);
  REQUIRE(m.mask.size() == 200u * 200u);
  auto at = [&](int x, int y) { return static_cast<int>(m.mask[static_cast<size_t>(y * 200 + x)]); };
  CHECK(at(100, 70) == 1);   // disk
  CHECK(at(85, 100) == 1);   // small hole, filled
  CHECK(at(120, 100) == 0);  // big hole
  CHECK(at(20, 20) == 0);    // speck
  CHECK(at(5, 5) == 0);
  CHECK(at(190, 190) == 0);
  CHECK(m.otsu_threshold >= 15);
  CHECK(m.otsu_threshold < 88);
  // Disk minus the big hole: pi (50^2 - 15^2) / 200^2 = 0.1787.
  CHECK(m.tissue_fraction() == doctest::Approx(0.1787).epsilon(0.04));

  // Without mpp the bounds are fractions of the area: 0.0005 * 40000 = 20 px, so the speck stays.
  TissueMask f = slide::tile::detect_tissue_in_thumbnail(t, 32, 32, 0, opt);
  CHECK(f.mask[static_cast<size_t>(20 * 200 + 20)] == 1);
  CHECK(f.mask[static_cast<size_t>(100 * 200 + 85)] == 0);  // hole (~79 px) is above 20 px now
}

TEST_CASE("test_tissue_grid: the knobs: fixed threshold, filters' counts, options text") {
  RgbImage t(200, 200, 255);
  std::mt19937 rng(3);
  for (auto& p : t.pixels) p = static_cast<uint8_t>(235 + rng() % 21);
  paint_disk(&t, 100, 100, 50, kPink);
  for (int y = 16; y < 24; ++y)  // 8x8 speck: removed, and counted
    for (int x = 16; x < 24; ++x) std::copy(kPink, kPink + 3, t.row(y) + 3 * x);
  TissueOptions opt;
  TissueMask m = slide::tile::detect_tissue_in_thumbnail(t, 32, 32, 64, opt);
  CHECK(!m.fluorescence);  // auto: white glass is brightfield
  CHECK(m.objects_removed == 1);
  CHECK(m.objects_removed_px > 30);  // the 8x8 speck, its corners rounded by the 7-px median
  CHECK(m.objects_removed_px <= 64);
  CHECK(m.holes_filled == 0);
  // A threshold above the pink's saturation (88) finds nothing; below it, the same disk as Otsu.
  opt.threshold = 100;
  CHECK(slide::tile::detect_tissue_in_thumbnail(t, 32, 32, 64, opt).tissue_fraction() == 0.0);
  opt.threshold = 40;
  TissueMask fixed = slide::tile::detect_tissue_in_thumbnail(t, 32, 32, 64, opt);
  CHECK(fixed.otsu_threshold == 40);
  CHECK(fixed.mask == m.mask);
  // No size filter: the speck stays.
  opt.threshold = -1, opt.min_object_um2 = 0;
  TissueMask keep = slide::tile::detect_tissue_in_thumbnail(t, 32, 32, 64, opt);
  CHECK(keep.objects_removed == 0);
  CHECK(keep.mask[static_cast<size_t>(20 * 200 + 20)] == 1);
  CHECK(slide::tile::tissue_options_text(TissueOptions{}) ==
        "stain=auto threshold=otsu median_px=7 close_px=5 min_object_um2=20000 min_hole_um2=20000");
  opt.stain = slide::tile::TissueStain::kFluorescence, opt.threshold = 12;
  CHECK(slide::tile::tissue_options_text(opt) ==
        "stain=fluorescence threshold=12 median_px=7 close_px=5 min_object_um2=0 min_hole_um2=20000");
}

TEST_CASE("test_tissue_grid: fluorescence's log-scale threshold applies to linear values exactly") {
  // Otsu splits {log level <= t} from {log level > t}; the linear threshold must split the same
  // pixels, for every t and every value (an expm1 inverse of the rounded levels did not for 94 t).
  for (int t = 0; t < 256; ++t) {
    const int lin = slide::tile::brightness_linear_threshold(t);
    for (int v = 0; v < 256; ++v) {
      CAPTURE(t);
      CAPTURE(v);
      CHECK((v > lin) == (slide::tile::brightness_log_level(static_cast<uint8_t>(v)) > t));
    }
  }
  CHECK(slide::tile::brightness_log_level(0) == 0);
  CHECK(slide::tile::brightness_log_level(255) == 255);
}

TEST_CASE("test_tissue_grid: fluorescence: sparse bright nuclei over a dark background are tissue where dense") {
  // Camera noise 0..3 everywhere; in the rectangle x 40..160, y 50..150, one blue "nucleus" pixel
  // in four (as in a DAPI image: the tissue between nuclei is as dark as the glass).
  RgbImage t(200, 200, 0);
  std::mt19937 rng(7);
  for (auto& p : t.pixels) p = static_cast<uint8_t>(rng() % 4);
  for (int y = 50; y < 150; ++y)
    for (int x = 40; x < 160; ++x)
      if ((x % 2 == 0) && (y % 2 == 0)) t.row(y)[3 * x + 2] = 160;
  CHECK(slide::tile::looks_like_fluorescence(t));
  TissueOptions opt;  // auto
  TissueMask m = slide::tile::detect_tissue_in_thumbnail(t, 32, 32, 64, opt);
  CHECK(m.fluorescence);
  // The rectangle is 120 x 100 of 200 x 200 = 0.30 (the 7-px mean blurs its edge by a few px).
  CHECK(m.tissue_fraction() == doctest::Approx(0.30).epsilon(0.08));
  CHECK(m.mask[static_cast<size_t>(101 * 200 + 101)] == 1);  // between nuclei: tissue
  CHECK(m.mask[static_cast<size_t>(10 * 200 + 10)] == 0);    // glass
  // Thresholded on saturation instead (--stain brightfield), the dark noise is "saturated": all
  // tissue, the failure this mode exists for.
  opt.stain = slide::tile::TissueStain::kBrightfield;
  CHECK(slide::tile::detect_tissue_in_thumbnail(t, 32, 32, 64, opt).tissue_fraction() > 0.9);
  // A brightfield thumbnail is not taken for fluorescence.
  RgbImage glass(50, 50, 240);
  paint_disk(&glass, 25, 25, 10, kPink);
  CHECK(!slide::tile::looks_like_fluorescence(glass));
}

TEST_CASE("test_tissue_grid: a blank thumbnail gives an empty mask") {
  TissueOptions opt;
  TissueMask pure = slide::tile::detect_tissue_in_thumbnail(RgbImage(120, 90, 255), 1, 1, 0, opt);
  CHECK(pure.tissue_fraction() == 0.0);
  // Glass noise alone: Otsu would split it (its threshold is a few units); the floor refuses.
  RgbImage noisy(120, 90);
  std::mt19937 rng(5);
  for (auto& p : noisy.pixels) p = static_cast<uint8_t>(240 + rng() % 16);
  TissueMask n = slide::tile::detect_tissue_in_thumbnail(noisy, 1, 1, 0, opt);
  CHECK(n.tissue_fraction() == 0.0);
  CHECK(n.otsu_threshold == 15);
}

TEST_CASE("test_tissue_grid: TissueMask::fraction_in weights partial pixels") {
  TissueMask m;
  m.thumbnail = RgbImage(4, 4, 255);
  m.mask = {1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0};  // left half
  m.downsample_x = m.downsample_y = 10;
  CHECK(m.tissue_fraction() == doctest::Approx(0.5));
  CHECK(m.fraction_in(0, 0, 40, 40) == doctest::Approx(0.5));
  CHECK(m.fraction_in(0, 0, 20, 40) == doctest::Approx(1.0));
  CHECK(m.fraction_in(15, 0, 10, 10) == doctest::Approx(0.5));   // straddles x = 20
  CHECK(m.fraction_in(30, 0, 20, 10) == doctest::Approx(0.0));   // half outside the slide
  CHECK(m.fraction_in(-20, 0, 40, 40) == doctest::Approx(0.5));  // outside counts as background
  CHECK(m.fraction_in(5, 5, 0, 10) == 0.0);
}

TEST_CASE("test_tissue_grid: make_thumbnail equals area resampling of the chosen level, in bands") {
  FakeSlide s(fake_level0());
  double dx = 0, dy = 0;
  // Downsample 5: level 2 (d = 4) is the coarsest not coarser; 200 x 160 px from 250 x 200.
  auto t = slide::tile::make_thumbnail(s, 5.0, &dx, &dy);
  REQUIRE_MESSAGE(t.ok(), t.status().to_string());
  CHECK(t->width == 200);
  CHECK(t->height == 160);
  CHECK(dx == 5.0);
  CHECK(dy == 5.0);
  RgbImage ref(200, 160);
  slide::tile::resample_area(s.level(2), 0, 0, 1.25, &ref);
  CHECK(t->pixels == ref.pixels);
  CHECK(s.calls_ >= 3);                     // 160 rows in bands of at most 64
  CHECK(s.max_pixels_ < 250 * 200);         // never the whole level at once

  // Downsample 2.5: level 1, 400 x 320.
  auto t1 = slide::tile::make_thumbnail(s, 2.5, &dx, &dy);
  REQUIRE(t1.ok());
  RgbImage ref1(400, 320);
  slide::tile::resample_area(s.level(1), 0, 0, 1.25, &ref1);
  CHECK(t1->pixels == ref1.pixels);

  // Downsample 1: level 0 itself.
  auto t0 = slide::tile::make_thumbnail(s, 1.0, &dx, &dy);
  REQUIRE(t0.ok());
  CHECK(t0->pixels == s.level(0).pixels);

  // Larger than the slide: one pixel.
  auto tiny = slide::tile::make_thumbnail(s, 5000.0, &dx, &dy);
  REQUIRE(tiny.ok());
  CHECK(tiny->width == 1);
  CHECK(tiny->height == 1);
  CHECK(dx == 1000.0);
  CHECK(dy == 800.0);
}

TEST_CASE("test_tissue_grid: detect_tissue on the fake slide finds the disk") {
  FakeSlide s(fake_level0());
  TissueOptions opt;
  opt.min_object_um2 = 1000;  // the disk is pi * (62.5 µm)^2 = 12272 µm², below the default bound
  auto m = slide::tile::detect_tissue(s, 0.25, opt);
  REQUIRE_MESSAGE(m.ok(), m.status().to_string());
  // Thumbnail downsample max(8 / 0.25, 1000 / 4096) = 32: 31 x 25 px.
  CHECK(m->width() == 31);
  CHECK(m->height() == 25);
  CHECK(m->downsample_x == doctest::Approx(1000.0 / 31));
  // The disk covers pi 250^2 / (1000 * 800) = 0.245 of the slide.
  CHECK(m->tissue_fraction() == doctest::Approx(0.245).epsilon(0.1));

  // Without mpp: the longer side is fallback_thumbnail_px (clamped to downsample 1 here).
  auto f = slide::tile::detect_tissue(s, 0, opt);
  REQUIRE(f.ok());
  CHECK(f->width() == 1000);
  CHECK(f->tissue_fraction() == doctest::Approx(0.245).epsilon(0.02));
}

TEST_CASE("test_tissue_grid: plan_tiles refuses a grid too large to hold") {
  SlideProperties p = fake_props();
  p.levels.resize(1);
  p.levels[0].width = p.levels[0].height = 10000000;  // a forged header: 10^7 x 10^7 px
  auto plan = slide::tile::plan_tiles(p, 0.25, nullptr, grid(0.25, 256));
  REQUIRE_FALSE(plan.ok());
  CHECK(plan.status().code() == slide::core::StatusCode::kResourceExhausted);
  CHECK_MESSAGE(plan.status().message().find("the tile grid is 39062 x 39062 positions") != std::string::npos,
                plan.status().message());
}

TEST_CASE("test_tissue_grid: plan_tiles geometry") {
  const SlideProperties p = fake_props();
  {  // 0.25 -> 0.5: s = 2, level 1 read as is, output 500 x 400, 5 x 4 tiles
    auto plan = slide::tile::plan_tiles(p, 0.25, nullptr, grid(0.5, 100));
    REQUIRE_MESSAGE(plan.ok(), plan.status().to_string());
    CHECK(plan->level == 1);
    CHECK(plan->scale_l0 == 2.0);
    CHECK(plan->scale_level == 1.0);
    CHECK_FALSE(plan->resampled());
    CHECK(plan->tile_mpp_um == doctest::Approx(0.5));
    CHECK(plan->cols == 5);
    CHECK(plan->rows == 4);
    CHECK(plan->candidates == 20);
    REQUIRE(plan->tiles.size() == 20u);
    CHECK(plan->tiles[6].col == 1);
    CHECK(plan->tiles[6].row == 1);
    CHECK(plan->tiles[6].x_l0 == 200);
    CHECK(plan->tiles[6].y_l0 == 200);
    CHECK(plan->tiles[6].tissue_fraction == 1.0);
    CHECK(plan->tile_size_l0() == 200.0);
  }
  {  // stride 50: (500 - 100) / 50 + 1 = 9, (400 - 100) / 50 + 1 = 7
    auto plan = slide::tile::plan_tiles(p, 0.25, nullptr, grid(0.5, 100, 50));
    REQUIRE(plan.ok());
    CHECK(plan->cols == 9);
    CHECK(plan->rows == 7);
    CHECK(plan->tiles.size() == 63u);
    CHECK(plan->tiles[1].x_l0 == 100);
  }
  {  // native resolution: level 0, 10 x 8
    auto plan = slide::tile::plan_tiles(p, 0.25, nullptr, grid(0.25, 100));
    REQUIRE(plan.ok());
    CHECK(plan->level == 0);
    CHECK(plan->cols == 10);
    CHECK(plan->rows == 8);
  }
  {  // 1.0 µm/px: s = 4, level 2, 250 x 200 -> 2 x 2
    auto plan = slide::tile::plan_tiles(p, 0.25, nullptr, grid(1.0, 100));
    REQUIRE(plan.ok());
    CHECK(plan->level == 2);
    CHECK(plan->scale_level == 1.0);
    CHECK(plan->cols == 2);
    CHECK(plan->rows == 2);
  }
  {  // 0.75 µm/px: s = 3, level 1 resampled by r = 1.5; output 333 x 266 -> 3 x 2
    auto plan = slide::tile::plan_tiles(p, 0.25, nullptr, grid(0.75, 100));
    REQUIRE(plan.ok());
    CHECK(plan->level == 1);
    CHECK(plan->scale_level == doctest::Approx(1.5));
    CHECK(plan->resampled());
    CHECK(plan->cols == 3);
    CHECK(plan->rows == 2);
    CHECK(plan->tiles[4].x_l0 == 300);  // (1, 1): 1 * 100 * 1.5 * 2
    CHECK(plan->tiles[4].y_l0 == 300);
  }
  {  // 2% snap: 0.499 -> 0.5 reads level 0 unresampled, the tiles keep the slide's 0.499
    auto plan = slide::tile::plan_tiles(p, 0.499, nullptr, grid(0.5, 100));
    REQUIRE(plan.ok());
    CHECK(plan->level == 0);
    CHECK(plan->scale_l0 == 1.0);
    CHECK_FALSE(plan->resampled());
    CHECK(plan->tile_mpp_um == doctest::Approx(0.499));
    CHECK(plan->cols == 10);
  }
  {  // a pyramid whose downsample is 2.0005 is still read without resampling at s = 2
    auto plan = slide::tile::plan_tiles(fake_props(2.0005, 4.001), 0.25, nullptr, grid(0.5, 100));
    REQUIRE(plan.ok());
    CHECK(plan->level == 1);
    CHECK_FALSE(plan->resampled());
    CHECK(plan->tiles[1].x_l0 == 200);  // round(100 * 2.0005)
  }
  // Upsampling and bad options are refused.
  auto up = slide::tile::plan_tiles(p, 0.499, nullptr, grid(0.25, 100));
  REQUIRE_FALSE(up.ok());
  CHECK(up.status().code() == StatusCode::kInvalidArgument);
  CHECK(up.status().message().find("target 0.25 µm/px is finer than level 0 (0.499 µm/px)") != std::string::npos);
  CHECK(slide::tile::plan_tiles(p, 0.25, nullptr, grid(0.5, 4)).status().code() == StatusCode::kInvalidArgument);
  CHECK(slide::tile::plan_tiles(p, 0.25, nullptr, grid(0.5, 100, -1)).status().code() == StatusCode::kInvalidArgument);
  CHECK(slide::tile::plan_tiles(p, 0.25, nullptr, grid(0.5, 100, 0, 1.5)).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(slide::tile::plan_tiles(p, 0, nullptr, grid(0.5, 100)).status().code() == StatusCode::kInvalidArgument);
  // A tile larger than the slide: no candidates, not an error.
  auto big = slide::tile::plan_tiles(p, 0.25, nullptr, grid(0.25, 1024));
  REQUIRE(big.ok());
  CHECK(big->candidates == 0);
}

TEST_CASE("test_tissue_grid: plan_tiles with a tissue mask and max_tiles sampling") {
  FakeSlide s(fake_level0());
  TissueOptions topt;
  topt.min_object_um2 = 1000;
  auto m = slide::tile::detect_tissue(s, 0.25, topt);
  REQUIRE(m.ok());
  // 0.25 µm/px, tile 50 at 0.5 -> 10 x 8 tiles of 100 x 100 level-0 px.
  GridOptions g = grid(0.5, 50, 0, 0.5);
  auto plan = slide::tile::plan_tiles(s.properties(), 0.25, &*m, g);
  REQUIRE(plan.ok());
  CHECK(plan->candidates == 80);
  // Tiles wholly inside the disk (radius 250 around (500, 400)) number 12; those mostly inside it,
  // about pi 250^2 / 100^2 = 19.6. Allow for the coarse (32 px) thumbnail.
  CHECK(plan->tiles.size() >= 12u);
  CHECK(plan->tiles.size() <= 28u);
  for (const auto& t : plan->tiles) {
    CHECK(t.tissue_fraction >= 0.5);
    const double cx = static_cast<double>(t.x_l0) + 50 - 500, cy = static_cast<double>(t.y_l0) + 50 - 400;
    CHECK(std::sqrt(cx * cx + cy * cy) < 250 + 71);  // the tile's centre is within a half-diagonal of the disk
  }

  // max_tiles: a subset of the kept tiles, in grid order, the same for the same seed.
  GridOptions g6 = g;
  g6.max_tiles = 6;
  g6.seed = 42;
  auto a = slide::tile::plan_tiles(s.properties(), 0.25, &*m, g6);
  auto b = slide::tile::plan_tiles(s.properties(), 0.25, &*m, g6);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(a->tiles.size() == 6u);
  bool same = true;
  for (size_t i = 0; i < 6; ++i) {
    same = same && a->tiles[i].col == b->tiles[i].col && a->tiles[i].row == b->tiles[i].row;
    if (i > 0) CHECK(a->tiles[i - 1].row * 100 + a->tiles[i - 1].col < a->tiles[i].row * 100 + a->tiles[i].col);
    bool found = false;
    for (const auto& t : plan->tiles) found = found || (t.col == a->tiles[i].col && t.row == a->tiles[i].row);
    CHECK(found);
  }
  CHECK(same);
  // Some other seed gives another subset.
  bool differs = false;
  for (uint64_t seed = 1; seed < 6 && !differs; ++seed) {
    g6.seed = seed;
    auto c = slide::tile::plan_tiles(s.properties(), 0.25, &*m, g6);
    REQUIRE(c.ok());
    for (size_t i = 0; i < 6; ++i) differs = differs || c->tiles[i].col != a->tiles[i].col || c->tiles[i].row != a->tiles[i].row;
  }
  CHECK(differs);
  // max_tiles above the kept count keeps them all.
  g6.max_tiles = 1000;
  auto all = slide::tile::plan_tiles(s.properties(), 0.25, &*m, g6);
  REQUIRE(all.ok());
  CHECK(all->tiles.size() == plan->tiles.size());
  // sample_tile_positions is plan_tiles' draw (the pipeline samples after the annotations with it).
  g6.max_tiles = 6;
  g6.seed = 42;
  const std::vector<size_t> pos = slide::tile::sample_tile_positions(plan->tiles.size(), 6, 42);
  REQUIRE(pos.size() == 6u);
  for (size_t i = 0; i < 6; ++i) {
    CHECK(plan->tiles[pos[i]].col == a->tiles[i].col);
    CHECK(plan->tiles[pos[i]].row == a->tiles[i].row);
  }
  CHECK(slide::tile::sample_tile_positions(5, 0, 1) == std::vector<size_t>{0, 1, 2, 3, 4});
  CHECK(slide::tile::sample_tile_positions(5, 5, 1) == std::vector<size_t>{0, 1, 2, 3, 4});
}

TEST_CASE("test_tissue_grid: tile_size_l0 is the footprint read, after the 2% snap of r") {
  // 0.25 um/px tiled at 0.5075: s = 2.03, level 1 (d = 2), r = 1.015 snapped to 1: tiles of 100
  // px read 200 level-0 px and sit 200 apart; T * s would say 203.
  auto plan = slide::tile::plan_tiles(fake_props(), 0.25, nullptr, grid(0.5075, 100));
  REQUIRE(plan.ok());
  CHECK(plan->level == 1);
  CHECK(plan->scale_level == 1.0);
  CHECK(plan->scale_l0 == doctest::Approx(2.03));
  REQUIRE(plan->tiles.size() >= 2u);
  CHECK(plan->tiles[1].x_l0 - plan->tiles[0].x_l0 == 200);
  CHECK(plan->tile_size_l0() == 200.0);
}

TEST_CASE("test_tissue_grid: read_tile matches area resampling of the level") {
  FakeSlide s(fake_level0());
  {  // r = 1.5 on level 1: tile (col, row) is resample_area(level 1, col * 150, row * 150, 1.5)
    auto plan = slide::tile::plan_tiles(s.properties(), 0.25, nullptr, grid(0.75, 100));
    REQUIRE(plan.ok());
    REQUIRE(plan->resampled());
    for (const auto& t : plan->tiles) {
      std::vector<uint8_t> rgb(3 * 100 * 100);
      s.max_pixels_ = 0;
      REQUIRE(slide::tile::read_tile(s, *plan, t, rgb.data()).ok());
      CHECK(s.max_pixels_ <= 152 * 152);  // one level region of about (T r + 2)^2 px
      RgbImage ref(100, 100);
      slide::tile::resample_area(s.level(1), static_cast<double>(t.col) * 150, static_cast<double>(t.row) * 150, 1.5, &ref);
      CHECK(rgb == ref.pixels);
    }
  }
  {  // r = 1 on level 2: a copy of level pixels [col * 50, + 100) with stride 50
    auto plan = slide::tile::plan_tiles(s.properties(), 0.25, nullptr, grid(1.0, 100, 50));
    REQUIRE(plan.ok());
    REQUIRE(plan->tiles.size() == 12u);  // 250 x 200: 4 x 3
    const auto& t = plan->tiles[5];      // (1, 1)
    std::vector<uint8_t> rgb(3 * 100 * 100);
    REQUIRE(slide::tile::read_tile(s, *plan, t, rgb.data()).ok());
    bool equal = true;
    for (int y = 0; y < 100; ++y)
      equal = equal && std::equal(rgb.begin() + 300 * y, rgb.begin() + 300 * (y + 1), s.level(2).row(50 + y) + 3 * 50);
    CHECK(equal);
  }
}

TEST_CASE("test_tissue_grid: can_pass_through") {
  FakeSlide jpeg(fake_level0(), 100, true);
  FakeSlide plain(fake_level0(), 100, false);
  FakeSlide other_tile(fake_level0(), 240, true);
  auto plan = slide::tile::plan_tiles(jpeg.properties(), 0.25, nullptr, grid(0.5, 100));
  REQUIRE(plan.ok());
  CHECK(slide::tile::can_pass_through(jpeg, *plan));
  CHECK_FALSE(slide::tile::can_pass_through(plain, *plan));
  CHECK_FALSE(slide::tile::can_pass_through(other_tile, *plan));
  auto overlap = slide::tile::plan_tiles(jpeg.properties(), 0.25, nullptr, grid(0.5, 100, 50));
  REQUIRE(overlap.ok());
  CHECK_FALSE(slide::tile::can_pass_through(jpeg, *overlap));
  auto resampled = slide::tile::plan_tiles(jpeg.properties(), 0.25, nullptr, grid(0.75, 100));
  REQUIRE(resampled.ok());
  CHECK_FALSE(slide::tile::can_pass_through(jpeg, *resampled));
}

TEST_CASE("test_tissue_grid: render_qc_png tints tissue and outlines kept tiles") {
  FakeSlide s(fake_level0());
  TissueOptions topt;
  topt.min_object_um2 = 1000;
  topt.thumbnail_mpp_um = 1.0;  // downsample 4: a 250 x 200 thumbnail, tiles 100 / 4 = 25 px
  auto m = slide::tile::detect_tissue(s, 0.25, topt);
  REQUIRE(m.ok());
  auto plan = slide::tile::plan_tiles(s.properties(), 0.25, &*m, grid(0.5, 50, 0, 0.9));
  REQUIRE(plan.ok());
  REQUIRE_FALSE(plan->tiles.empty());
  auto img = std::make_optional(slide::tile::draw_qc(*m, *plan));
  REQUIRE(img->width == 250);
  REQUIRE(img->height == 200);
  auto px = [&](int64_t x, int64_t y) {
    const uint8_t* p = img->row(y) + 3 * x;
    return std::vector<int>{p[0], p[1], p[2]};
  };
  const auto& t = plan->tiles.front();
  CHECK(px(t.x_l0 / 4, t.y_l0 / 4) == std::vector<int>{0, 0, 255});            // outline corner
  CHECK(px(t.x_l0 / 4 + 24, t.y_l0 / 4 + 10) == std::vector<int>{0, 0, 255});  // right edge
  const auto inside = px(t.x_l0 / 4 + 12, t.y_l0 / 4 + 12);                     // tinted pink
  CHECK(inside[1] > inside[0]);
  CHECK(px(2, 2) == std::vector<int>{m->thumbnail.pixels[3 * (2 * 250 + 2)], m->thumbnail.pixels[3 * (2 * 250 + 2) + 1],
                                     m->thumbnail.pixels[3 * (2 * 250 + 2) + 2]});  // background untouched
  // A finer picture (downsample 2: 500 x 400) samples the mask at each pixel's centre: the same
  // tint and outlines, at twice the scale.
  RgbImage fine(500, 400, 255);
  const auto f = slide::tile::draw_qc(*m, *plan, &fine, 2, 2);
  auto fpx = [&](int64_t x, int64_t y) {
    const uint8_t* p = f.row(y) + 3 * x;
    return std::vector<int>{p[0], p[1], p[2]};
  };
  CHECK(fpx(t.x_l0 / 2, t.y_l0 / 2) == std::vector<int>{0, 0, 255});
  CHECK(fpx(t.x_l0 / 2 + 24, t.y_l0 / 2 + 24) == std::vector<int>{153, 255, 153});  // white, tinted
  CHECK(fpx(4, 4) == std::vector<int>{255, 255, 255});                               // glass: no tint
  // The PNG: the picture under a title, over a legend band, at least 420 px wide.
  auto png = slide::tile::render_qc_png(*m, *plan, "fake slide", 0.5);
  REQUIRE_MESSAGE(png.ok(), png.status().to_string());
  auto fig = slide::tile::decode_png(*png);
  REQUIRE(fig.ok());
  CHECK(fig->width == 420);
  CHECK(fig->height == 28 + 200 + 30);
  CHECK(std::equal(fig->row(28), fig->row(28) + 3 * 250, img->row(0)));  // the picture, unchanged
  int dark_title = 0, blue_legend = 0;
  for (int64_t y = 0; y < 28; ++y)
    for (int64_t x = 0; x < 420; ++x) dark_title += fig->row(y)[3 * x] < 100;
  for (int64_t y = 228; y < 258; ++y)
    for (int64_t x = 0; x < 420; ++x) {
      const uint8_t* p = fig->row(y) + 3 * x;
      blue_legend += p[0] == 0 && p[1] == 0 && p[2] == 255;
    }
  CHECK(dark_title > 20);   // the title is drawn
  CHECK(blue_legend > 20);  // the kept tiles' swatch
}

TEST_CASE("test_tissue_grid: the scale bar's length is 1, 2 or 5 x 10^k um") {
  CHECK(slide::tile::scale_bar_um(0.5) == 0);
  CHECK(slide::tile::scale_bar_um(1) == 1);
  CHECK(slide::tile::scale_bar_um(730) == 500);
  CHECK(slide::tile::scale_bar_um(1999) == 1000);
  CHECK(slide::tile::scale_bar_um(2000) == 2000);
}

// The real sample (Aperio, 2220 x 2967 px, 0.499 µm/px, 240 px JPEG tiles, one level). The
// expected values were read off the QC picture after checking it by eye: the mask covers the
// main tissue strip and leaves out the glass, the thin detached streak on the left and the pale
// loose fragments on the right.
TEST_CASE("test_tissue_grid: CMU-1-Small-Region tissue mask and tile counts") {
  auto slide = slide::tile::open_slide(std::string(SLIDE_SAMPLE_DIR) + "/slides/CMU-1-Small-Region.svs");
  REQUIRE_MESSAGE(slide.ok(), slide.status().to_string());
  const SlideProperties& p = (*slide)->properties();
  REQUIRE(p.mpp_x_um == doctest::Approx(0.499));
  auto m = slide::tile::detect_tissue(**slide, p.mpp_x_um, TissueOptions{});
  REQUIRE_MESSAGE(m.ok(), m.status().to_string());
  // Thumbnail at 8 µm/px: downsample 8 / 0.499 = 16.03 -> 138 x 185 px.
  CHECK(m->width() == 138);
  CHECK(m->height() == 185);
  CHECK(m->tissue_fraction() > 0.23);  // seen: 0.328
  CHECK(m->tissue_fraction() < 0.43);

  GridOptions g = grid(0.5, 256, 0, 0.5);
  auto half = slide::tile::plan_tiles(p, p.mpp_x_um, &*m, g);
  REQUIRE(half.ok());
  CHECK(half->level == 0);
  CHECK_FALSE(half->resampled());  // 0.499 -> 0.5 is within the 2% snap
  CHECK(half->cols == 8);          // floor(2220 / 256)
  CHECK(half->rows == 11);         // floor(2967 / 256)
  CHECK(half->tiles.size() == 29u);

  g.target_mpp_um = 1.0;
  auto one = slide::tile::plan_tiles(p, p.mpp_x_um, &*m, g);
  REQUIRE(one.ok());
  CHECK(one->resampled());  // r = 1.0 / 0.499 = 2.004
  CHECK(one->cols == 4);    // floor(2220 / 2.004) = 1107 -> 4
  CHECK(one->rows == 5);    // 1480 -> 5
  CHECK(one->tiles.size() == 6u);
  std::vector<uint8_t> rgb(3 * 256 * 256);
  REQUIRE(slide::tile::read_tile(**slide, *one, one->tiles.front(), rgb.data()).ok());

  auto png = slide::tile::render_qc_png(*m, *half, "CMU-1-Small-Region", m->downsample_x * p.mpp_x_um);
  REQUIRE(png.ok());
}

TEST_CASE("test_tissue_grid: the automatic thumbnail resolution gives 8 mask px per tile side, within 2..16 um/px") {
  auto at = [](int tile, double mpp) { return slide::tile::auto_thumbnail_mpp(grid(mpp, tile)); };
  CHECK(at(256, 0.5) == doctest::Approx(16.0));
  CHECK(at(224, 0.5) == doctest::Approx(14.0));
  CHECK(at(64, 0.5) == doctest::Approx(4.0));
  CHECK(at(16, 0.5) == doctest::Approx(2.0));   // 1 um/px: clamped to 2
  CHECK(at(512, 1.0) == doctest::Approx(16.0)); // 64 um/px: clamped to 16
  CHECK(at(224, 0.0) == doctest::Approx(8.0));  // patches: no target resolution
}

TEST_CASE("test_tissue_grid: a thread pool changes nothing in the thumbnail and the mask") {
  // Bands read on the pool's threads and the median split by rows must give the same pixels.
  auto slide = slide::tile::open_slide(std::string(SLIDE_SAMPLE_DIR) + "/slides/CMU-1-Small-Region.svs");
  REQUIRE_MESSAGE(slide.ok(), slide.status().to_string());
  slide::core::ThreadPool pool(3);
  TissueOptions opt;
  opt.thumbnail_mpp_um = 2.0;  // downsample 4.008: 553 x 740 px, many bands
  auto serial = slide::tile::detect_tissue(**slide, 0.499, opt);
  auto parallel = slide::tile::detect_tissue(**slide, 0.499, opt, &pool);
  REQUIRE(serial.ok());
  REQUIRE(parallel.ok());
  CHECK(serial->width() == 553);  // floor(2220 / 4.008)
  CHECK(parallel->thumbnail.pixels == serial->thumbnail.pixels);
  CHECK(parallel->mask == serial->mask);
  CHECK(parallel->otsu_threshold == serial->otsu_threshold);
  CHECK(serial->tissue_fraction() > 0.2);
}

TEST_CASE("test_tissue_grid: CMU-1-Small-Region pass-through tiles decode to read_tile's pixels") {
  auto slide = slide::tile::open_slide(std::string(SLIDE_SAMPLE_DIR) + "/slides/CMU-1-Small-Region.svs");
  REQUIRE_MESSAGE(slide.ok(), slide.status().to_string());
  const SlideProperties& p = (*slide)->properties();
  auto plan = slide::tile::plan_tiles(p, p.mpp_x_um, nullptr, grid(0.5, 240));
  REQUIRE(plan.ok());
  CHECK(plan->cols == 9);  // floor(2220 / 240)
  CHECK(plan->rows == 12);
  REQUIRE(slide::tile::can_pass_through(**slide, *plan));
  CHECK_FALSE(slide::tile::can_pass_through(**slide, *slide::tile::plan_tiles(p, p.mpp_x_um, nullptr, grid(0.5, 256))));
  for (size_t i = 0; i < plan->tiles.size(); i += 11) {
    const auto& t = plan->tiles[i];
    auto raw = (*slide)->read_raw_jpeg_tile(plan->level, t.col, t.row);
    REQUIRE_MESSAGE(raw.ok(), raw.status().to_string());
    auto dec = slide::tile::decode_jpeg(*raw);
    REQUIRE_MESSAGE(dec.ok(), dec.status().to_string());
    std::vector<uint8_t> rgb(3 * 240 * 240);
    REQUIRE(slide::tile::read_tile(**slide, *plan, t, rgb.data()).ok());
    CHECK(dec->pixels == rgb);
  }
}

}  // namespace libtile_test_tissue_grid
