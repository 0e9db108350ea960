// Slide readers (libtile/src/slide.cpp, openslide_reader.cpp, tiff_reader.cpp).
//
// Expectations are fixed numbers from sample_data/README.md and OpenSlide 3.4.1's own view of the
// files; pixels are compared with OpenSlide (called directly here) or libtiff's whole-image RGBA
// read, never with the code under test.
#include <doctest/doctest.h>
#include <openslide.h>
#include <sys/stat.h>
#include <tiffio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "slide/tile/image.h"
#include "slide/tile/slide.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtile_test_slide {

namespace {

using slide::core::StatusCode;
using slide::tile::open_slide;
using slide::tile::SlideReader;

const std::string kSlides = std::string(SLIDE_SAMPLE_DIR) + "/slides/";
const std::string kBad = std::string(SLIDE_SAMPLE_DIR) + "/bad/";
const std::string kCmu = kSlides + "CMU-1-Small-Region.svs";
const std::string kTcga = kSlides + "TCGA-CR-7395-01A-01-TS1.svs";
const std::string kBoxes = kSlides + "boxes.tiff";
const std::string kKidney = kSlides + "kidney-48-5.tif";
const std::string kNdpi = kSlides + "test3-DAPI-2-387.ndpi";
// 150x150, PackBits, 18 rows per strip: the last strip is short (150 = 8 * 18 + 6).
const std::string kKather = std::string(SLIDE_SAMPLE_DIR) +
                            "/patches/kather2016-samples/01_TUMOR/1A11_CRC-Prim-HE-07_022.tif_Row_601_Col_151.tif";

std::unique_ptr<SlideReader> must_open(const std::string& path) {
  auto r = open_slide(path);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(r).value();
}

std::vector<uint8_t> must_read(const SlideReader& s, int64_t x, int64_t y, int level, int64_t w, int64_t h) {
  std::vector<uint8_t> rgb(static_cast<size_t>(3 * w * h));
  slide::core::Status st = s.read_region(x, y, level, w, h, rgb.data());
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  return rgb;
}

// The reference: OpenSlide's own read of the region, premultiplied ARGB composited onto white.
std::vector<uint8_t> openslide_rgb(const std::string& path, int64_t x, int64_t y, int level, int64_t w, int64_t h) {
  openslide_t* osr = openslide_open(path.c_str());
  REQUIRE(osr != nullptr);
  std::vector<uint32_t> argb(static_cast<size_t>(w * h));
  openslide_read_region(osr, argb.data(), x, y, level, w, h);
  const char* err = openslide_get_error(osr);
  CHECK_MESSAGE(err == nullptr, (err != nullptr ? err : ""));
  openslide_close(osr);
  std::vector<uint8_t> rgb(3 * argb.size());
  for (size_t i = 0; i < argb.size(); ++i) {
    const uint32_t p = argb[i];
    const uint32_t a = p >> 24;
    rgb[3 * i + 0] = static_cast<uint8_t>(((p >> 16) & 0xff) + 255 - a);
    rgb[3 * i + 1] = static_cast<uint8_t>(((p >> 8) & 0xff) + 255 - a);
    rgb[3 * i + 2] = static_cast<uint8_t>((p & 0xff) + 255 - a);
  }
  return rgb;
}

// libtiff's whole-image RGBA read of directory 0, top-down, composited onto white.
std::vector<uint8_t> libtiff_rgb(const std::string& path, int64_t* width, int64_t* height) {
  TIFF* tif = TIFFOpen(path.c_str(), "r");
  REQUIRE(tif != nullptr);
  uint32_t w = 0, h = 0;
  TIFFGetField(tif, TIFFTAG_IMAGEWIDTH, &w);
  TIFFGetField(tif, TIFFTAG_IMAGELENGTH, &h);
  std::vector<uint32_t> abgr(size_t{w} * h);
  REQUIRE(TIFFReadRGBAImageOriented(tif, w, h, abgr.data(), ORIENTATION_TOPLEFT, 1) == 1);
  TIFFClose(tif);
  std::vector<uint8_t> rgb(3 * abgr.size());
  for (size_t i = 0; i < abgr.size(); ++i) {
    const uint32_t a = TIFFGetA(abgr[i]);
    rgb[3 * i + 0] = static_cast<uint8_t>(TIFFGetR(abgr[i]) + 255 - a);
    rgb[3 * i + 1] = static_cast<uint8_t>(TIFFGetG(abgr[i]) + 255 - a);
    rgb[3 * i + 2] = static_cast<uint8_t>(TIFFGetB(abgr[i]) + 255 - a);
  }
  *width = w;
  *height = h;
  return rgb;
}

struct Diff {
  double mean = 0;
  int max = 0;
};

Diff diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  REQUIRE(a.size() == b.size());
  Diff d;
  int64_t sum = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const int v = std::abs(int{a[i]} - int{b[i]});
    sum += v;
    d.max = std::max(d.max, v);
  }
  d.mean = static_cast<double>(sum) / static_cast<double>(a.size());
  return d;
}

size_t count_not(const std::vector<uint8_t>& v, uint8_t value) {
  return static_cast<size_t>(std::count_if(v.begin(), v.end(), [value](uint8_t b) { return b != value; }));
}

void check_level(const SlideReader& s, size_t i, int64_t w, int64_t h, int64_t tw, int64_t th) {
  CAPTURE(i);
  REQUIRE(s.properties().levels.size() > i);
  const auto& lv = s.properties().levels[i];
  CHECK(lv.width == w);
  CHECK(lv.height == h);
  CHECK(lv.tile_width == tw);
  CHECK(lv.tile_height == th);
}

}  // namespace

TEST_CASE("open_slide: CMU-1-Small-Region.svs properties") {
  auto s = must_open(kCmu);
  const auto& p = s->properties();
  CHECK(p.path == kCmu);
  CHECK(p.vendor == "aperio");
  CHECK(p.backend == "openslide");
  REQUIRE(p.levels.size() == 1);
  check_level(*s, 0, 2220, 2967, 240, 240);
  CHECK(p.levels[0].downsample == 1.0);
  CHECK(p.mpp_x_um == doctest::Approx(0.499).epsilon(1e-9));
  CHECK(p.mpp_y_um == doctest::Approx(0.499).epsilon(1e-9));
  CHECK(p.mpp_source == "vendor");
  CHECK(p.objective_power == 20.0);
}

TEST_CASE("open_slide: TCGA-CR-7395 (JPEG 2000) properties and level 1 pixels") {
  auto s = must_open(kTcga);
  const auto& p = s->properties();
  CHECK(p.vendor == "aperio");
  REQUIRE(p.levels.size() == 2);
  check_level(*s, 0, 4443, 3567, 256, 256);
  check_level(*s, 1, 2221, 1783, 256, 256);
  CHECK(p.levels[1].downsample == doctest::Approx(2.0005055500659967));
  CHECK(p.mpp_x_um == 0.0);
  CHECK(p.mpp_y_um == 0.0);
  CHECK(p.mpp_source == "");
  CHECK(p.objective_power == 0.0);
  // JPEG 2000 tiles cannot be passed through as JPEG.
  CHECK_FALSE(s->has_raw_jpeg_tiles(0));
  CHECK_FALSE(s->has_raw_jpeg_tiles(1));
  auto ours = must_read(*s, 2000, 1500, 1, 200, 150);
  CHECK(ours == openslide_rgb(kTcga, 2000, 1500, 1, 200, 150));
  CHECK(count_not(ours, 255) > 1000);  // tissue, not background
}

TEST_CASE("open_slide: boxes.tiff properties, pixels and no pass-through") {
  auto s = must_open(kBoxes);
  const auto& p = s->properties();
  CHECK(p.vendor == "generic-tiff");
  CHECK(p.backend == "openslide");
  REQUIRE(p.levels.size() == 4);
  check_level(*s, 0, 300, 250, 64, 64);
  check_level(*s, 1, 150, 125, 64, 64);
  check_level(*s, 2, 75, 62, 64, 64);
  check_level(*s, 3, 37, 31, 64, 64);
  // 28.35 px/cm = 352.8 µm/px: the 72 dpi default, not a microscope's resolution.
  CHECK(p.mpp_x_um == 0.0);
  CHECK(p.mpp_source == "");
  // Deflate-compressed tiles.
  for (int i = 0; i < 4; ++i) CHECK_FALSE(s->has_raw_jpeg_tiles(i));
  auto raw = s->read_raw_jpeg_tile(0, 0, 0);
  CHECK(raw.status().code() == StatusCode::kUnimplemented);
  CHECK(must_read(*s, 0, 0, 0, 300, 250) == openslide_rgb(kBoxes, 0, 0, 0, 300, 250));
  CHECK(must_read(*s, 40, 20, 2, 50, 30) == openslide_rgb(kBoxes, 40, 20, 2, 50, 30));
}

TEST_CASE("open_slide: test3-DAPI-2-387.ndpi properties and pixels") {
  auto s = must_open(kNdpi);
  const auto& p = s->properties();
  CHECK(p.vendor == "hamamatsu");
  REQUIRE(p.levels.size() == 7);
  CHECK(p.levels[0].width == 3968);
  CHECK(p.levels[0].height == 4864);
  CHECK(p.levels[6].width == 62);
  CHECK(p.levels[6].height == 76);
  CHECK(p.levels[6].downsample == 64.0);
  CHECK(p.mpp_x_um == doctest::Approx(0.2281750559).epsilon(1e-9));
  CHECK(p.mpp_y_um == doctest::Approx(0.2281750559).epsilon(1e-9));
  CHECK(p.mpp_source == "vendor");
  CHECK(p.objective_power == 40.0);
  CHECK_FALSE(s->has_raw_jpeg_tiles(0));  // not a TIFF-tiled vendor
  CHECK(must_read(*s, 1900, 2400, 0, 128, 96) == openslide_rgb(kNdpi, 1900, 2400, 0, 128, 96));
  CHECK(must_read(*s, 800, 1600, 3, 100, 80) == openslide_rgb(kNdpi, 800, 1600, 3, 100, 80));
}

TEST_CASE("read_region (OpenSlide): CMU pixels equal OpenSlide's; outside the slide is white") {
  auto s = must_open(kCmu);
  auto inside = must_read(*s, 1000, 1200, 0, 300, 200);
  CHECK(inside == openslide_rgb(kCmu, 1000, 1200, 0, 300, 200));
  CHECK(count_not(inside, 255) > 10000);

  // Partly outside at the bottom-right corner: 120x67 px inside, the rest white.
  auto corner = must_read(*s, 2100, 2900, 0, 200, 100);
  CHECK(corner == openslide_rgb(kCmu, 2100, 2900, 0, 200, 100));
  size_t not_white_outside = 0, not_white_inside = 0;
  for (int64_t y = 0; y < 100; ++y)
    for (int64_t x = 0; x < 200; ++x)
      for (int c = 0; c < 3; ++c) {
        const bool in = 2100 + x < 2220 && 2900 + y < 2967;
        if (corner[static_cast<size_t>(3 * (y * 200 + x) + c)] != 255) ++(in ? not_white_inside : not_white_outside);
      }
  CHECK(not_white_outside == 0);
  CHECK(not_white_inside > 1000);

  // Negative coordinates: the top-left 50x40 is outside.
  auto neg = must_read(*s, -50, -40, 0, 100, 80);
  for (int64_t y = 0; y < 40; ++y)
    for (int64_t x = 0; x < 50; ++x) CHECK(neg[static_cast<size_t>(3 * (y * 100 + x))] == 255);
  CHECK(neg == openslide_rgb(kCmu, -50, -40, 0, 100, 80));

  auto away = must_read(*s, 5000, 5000, 0, 64, 64);
  CHECK(count_not(away, 255) == 0);
}

TEST_CASE("read_region: bad arguments are kInvalidArgument and zero the output") {
  auto s = must_open(kCmu);
  std::vector<uint8_t> rgb(3 * 16 * 16, 0x7f);
  auto st = s->read_region(0, 0, 1, 16, 16, rgb.data());
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(count_not(rgb, 0) == 0);
  CHECK(s->read_region(0, 0, -1, 16, 16, rgb.data()).code() == StatusCode::kInvalidArgument);
  CHECK(s->read_region(0, 0, 0, 0, 16, rgb.data()).code() == StatusCode::kInvalidArgument);
  CHECK(s->read_region(0, 0, 0, 16, -1, rgb.data()).code() == StatusCode::kInvalidArgument);

  auto k = must_open(kKidney);
  std::fill(rgb.begin(), rgb.end(), 0x7f);
  CHECK(k->read_region(0, 0, 1, 16, 16, rgb.data()).code() == StatusCode::kInvalidArgument);
  CHECK(count_not(rgb, 0) == 0);
  CHECK(k->read_region(0, 0, 0, 16, 0, rgb.data()).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("read_region is thread-safe: concurrent reads equal serial ones") {
  for (const std::string& path : {kCmu, kKidney}) {
    CAPTURE(path);
    auto s = must_open(path);
    constexpr int kThreads = 4, kReads = 8;
    std::vector<std::vector<uint8_t>> serial;
    for (int i = 0; i < kThreads * kReads; ++i)
      serial.push_back(must_read(*s, (i * 131) % 1300, (i * 71) % 800, 0, 96, 64));
    std::vector<std::vector<uint8_t>> parallel(serial.size(), std::vector<uint8_t>(3 * 96 * 64));
    std::vector<int> failures(kThreads, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int j = 0; j < kReads; ++j) {
          const int i = j * kThreads + t;
          if (!s->read_region((i * 131) % 1300, (i * 71) % 800, 0, 96, 64, parallel[static_cast<size_t>(i)].data()).ok())
            ++failures[static_cast<size_t>(t)];
        }
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < kThreads; ++t) CHECK(failures[static_cast<size_t>(t)] == 0);
    CHECK(parallel == serial);
  }
}

TEST_CASE("open_slide: kidney-48-5.tif falls back to libtiff") {
  auto s = must_open(kKidney);
  const auto& p = s->properties();
  CHECK(p.vendor == "tiff");
  CHECK(p.backend == "libtiff");
  REQUIRE(p.levels.size() == 1);
  check_level(*s, 0, 1493, 901, 0, 0);  // stripped, so no tile size
  CHECK(p.mpp_x_um == 0.0);  // ResolutionUnit none
  CHECK(p.mpp_source == "");
  CHECK_FALSE(s->has_raw_jpeg_tiles(0));
  CHECK(s->read_raw_jpeg_tile(0, 0, 0).status().code() == StatusCode::kUnimplemented);

  int64_t w = 0, h = 0;
  const auto ref = libtiff_rgb(kKidney, &w, &h);
  REQUIRE(w == 1493);
  REQUIRE(h == 901);
  CHECK(must_read(*s, 0, 0, 0, w, h) == ref);

  // Partly outside (right and bottom edges, and a negative origin): white outside, libtiff inside.
  // (Named copies, not structured bindings: clang 14, which builds the sanitizer suite, cannot
  // capture a binding in CAPTURE's lambda.)
  for (auto origin : {std::pair<int64_t, int64_t>{1400, 850}, {-30, -20}}) {
    const int64_t x0 = origin.first, y0 = origin.second;
    CAPTURE(x0);
    const int64_t rw = 150, rh = 100;
    auto got = must_read(*s, x0, y0, 0, rw, rh);
    size_t wrong = 0;
    for (int64_t y = 0; y < rh; ++y)
      for (int64_t x = 0; x < rw; ++x) {
        const int64_t sx = x0 + x, sy = y0 + y;
        const bool in = sx >= 0 && sy >= 0 && sx < w && sy < h;
        for (int c = 0; c < 3; ++c) {
          const uint8_t want = in ? ref[static_cast<size_t>(3 * (sy * w + sx) + c)] : 255;
          if (got[static_cast<size_t>(3 * (y * rw + x) + c)] != want) ++wrong;
        }
      }
    CHECK(wrong == 0);
  }
}

TEST_CASE("libtiff reader: multi-strip PackBits TIFF with a short last strip") {
  auto s = must_open(kKather);
  CHECK(s->properties().backend == "libtiff");
  check_level(*s, 0, 150, 150, 0, 0);
  int64_t w = 0, h = 0;
  const auto ref = libtiff_rgb(kKather, &w, &h);
  CHECK(must_read(*s, 0, 0, 0, 150, 150) == ref);
  // A region crossing the boundary into the short last strip (rows 144..149).
  auto part = must_read(*s, 10, 130, 0, 100, 20);
  size_t wrong = 0;
  for (int64_t y = 0; y < 20; ++y)
    for (int64_t x = 0; x < 100; ++x)
      for (int c = 0; c < 3; ++c)
        if (part[static_cast<size_t>(3 * (y * 100 + x) + c)] != ref[static_cast<size_t>(3 * ((130 + y) * w + 10 + x) + c)])
          ++wrong;
  CHECK(wrong == 0);
}

TEST_CASE("libtiff reader: a truncated TIFF opens, then missing strips are kDataLoss with a zeroed output") {
  // kidney-48-5.tif keeps its directory at offset 8 and its 901 one-row strips after it, so the
  // first 2,000,000 bytes hold the directory and rows 0..445 (4479 bytes per row).
  const std::string path =
      (std::filesystem::temp_directory_path() / ("slide_test_slide_trunc_" + std::to_string(::getpid()) + ".tif")).string();
  {
    std::ifstream in(kKidney, std::ios::binary);
    std::vector<char> head(2000000);
    REQUIRE(in.read(head.data(), static_cast<std::streamsize>(head.size())));
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    REQUIRE(out.write(head.data(), static_cast<std::streamsize>(head.size())));
  }
  auto s = must_open(path);
  CHECK(s->properties().backend == "libtiff");
  int64_t w = 0, h = 0;
  const auto ref = libtiff_rgb(kKidney, &w, &h);
  auto top = must_read(*s, 0, 0, 0, w, 100);
  CHECK(std::equal(top.begin(), top.end(), ref.begin()));
  std::vector<uint8_t> rgb(3 * 100 * 100, 0x7f);
  auto st = s->read_region(0, 800, 0, 100, 100, rgb.data());
  std::filesystem::remove(path);
  CHECK(st.code() == StatusCode::kDataLoss);
  CHECK(st.message().find(path) == 0);
  CHECK(st.message().find("strip") != std::string::npos);
  CHECK(count_not(rgb, 0) == 0);
}

TEST_CASE("pass-through: CMU-1-Small-Region.svs raw JPEG tiles decode to read_region's pixels") {
  auto s = must_open(kCmu);
  REQUIRE(s->has_raw_jpeg_tiles(0));
  CHECK_FALSE(s->has_raw_jpeg_tiles(1));
  CHECK_FALSE(s->has_raw_jpeg_tiles(-1));
  CHECK(s->read_raw_jpeg_tile(1, 0, 0).status().code() == StatusCode::kUnimplemented);

  // 2220x2967 in 240x240 tiles: 10 x 13 tiles, of which columns 0..8 and rows 0..11 are whole.
  for (auto tile : {std::pair<int64_t, int64_t>{0, 0}, {3, 5}, {8, 11}, {6, 2}}) {
    const int64_t col = tile.first, row = tile.second;
    CAPTURE(col);
    CAPTURE(row);
    auto raw = s->read_raw_jpeg_tile(0, col, row);
    REQUIRE_MESSAGE(raw.ok(), raw.status().to_string());
    const auto& jpeg = *raw;
    REQUIRE(jpeg.size() > 100);
    CHECK(jpeg[0] == 0xFF);
    CHECK(jpeg[1] == 0xD8);
    // Aperio stores RGB JPEG (PHOTOMETRIC_RGB): an Adobe APP14 marker must follow SOI.
    CHECK(jpeg[2] == 0xFF);
    CHECK(jpeg[3] == 0xEE);
    CHECK(std::string(jpeg.begin() + 6, jpeg.begin() + 11) == "Adobe");
    CHECK(jpeg[jpeg.size() - 2] == 0xFF);
    CHECK(jpeg[jpeg.size() - 1] == 0xD9);
    auto img = slide::tile::decode_jpeg(jpeg);
    REQUIRE_MESSAGE(img.ok(), img.status().to_string());
    REQUIRE(img->width == 240);
    REQUIRE(img->height == 240);
    const Diff d = diff(img->pixels, must_read(*s, col * 240, row * 240, 0, 240, 240));
    CHECK(d.mean < 1.0);
    CHECK(d.max < 16);
  }
  // The comparison can fail: a neighbouring tile's pixels are far off.
  auto raw = s->read_raw_jpeg_tile(0, 3, 5);
  REQUIRE(raw.ok());
  auto img = slide::tile::decode_jpeg(*raw);
  REQUIRE(img.ok());
  CHECK(diff(img->pixels, must_read(*s, 4 * 240, 5 * 240, 0, 240, 240)).mean > 5.0);

  CHECK(s->read_raw_jpeg_tile(0, 10, 0).status().code() == StatusCode::kOutOfRange);
  CHECK(s->read_raw_jpeg_tile(0, 0, 13).status().code() == StatusCode::kOutOfRange);
  CHECK(s->read_raw_jpeg_tile(0, -1, 0).status().code() == StatusCode::kOutOfRange);
}

// A large generated pyramid (generic-tiff, 256x256 YCbCr-or-RGB JPEG tiles, 2004 px/mm), built by
// /work/shared/tools/make-big-slide.sh outside the repository; skipped unless
// SLIDE_TEST_BIG_SLIDE names it.
TEST_CASE("pass-through: generated pyramidal JPEG TIFF (SLIDE_TEST_BIG_SLIDE)") {
  const char* big = std::getenv("SLIDE_TEST_BIG_SLIDE");
  if (big == nullptr || big[0] == '\0') {
    MESSAGE("SLIDE_TEST_BIG_SLIDE not set: skipped");
    return;
  }
  auto s = must_open(big);
  const auto& p = s->properties();
  CHECK(p.vendor == "generic-tiff");
  CHECK(p.mpp_source == "tiff-resolution");
  CHECK(p.mpp_x_um == doctest::Approx(0.499).epsilon(1e-3));
  CHECK(p.mpp_y_um == doctest::Approx(0.499).epsilon(1e-3));
  for (size_t level = 0; level < p.levels.size(); ++level) {
    CAPTURE(level);
    const auto& lv = p.levels[level];
    REQUIRE(lv.tile_width == 256);
    const int64_t cols = lv.width / 256, rows = lv.height / 256;
    if (cols == 0 || rows == 0) continue;
    REQUIRE(s->has_raw_jpeg_tiles(static_cast<int>(level)));
    const int64_t col = cols / 2, row = rows / 2;
    auto raw = s->read_raw_jpeg_tile(static_cast<int>(level), col, row);
    REQUIRE_MESSAGE(raw.ok(), raw.status().to_string());
    auto img = slide::tile::decode_jpeg(*raw);
    REQUIRE_MESSAGE(img.ok(), img.status().to_string());
    // The reference is libtiff's decode of the same TIFF tile (vips writes level k as directory
    // k), not read_region: this pyramid's downsamples are not integers (5934 / 1483 = 4.0013), so
    // no level-0 origin maps exactly onto a level's pixel grid except 0, and OpenSlide then
    // interpolates a sub-pixel shift. The self-check inside the reader uses tile (0,0) for that
    // reason.
    TIFF* tif = TIFFOpen(big, "r");
    REQUIRE(tif != nullptr);
    REQUIRE(TIFFSetDirectory(tif, static_cast<tdir_t>(level)) == 1);
    std::vector<uint32_t> abgr(256 * 256);
    REQUIRE(TIFFReadRGBATile(tif, static_cast<uint32_t>(col * 256), static_cast<uint32_t>(row * 256), abgr.data()) == 1);
    TIFFClose(tif);
    std::vector<uint8_t> ref(3 * 256 * 256);
    for (size_t y = 0; y < 256; ++y)
      for (size_t x = 0; x < 256; ++x) {
        const uint32_t p = abgr[(255 - y) * 256 + x];  // bottom-up
        ref[3 * (y * 256 + x) + 0] = static_cast<uint8_t>(TIFFGetR(p));
        ref[3 * (y * 256 + x) + 1] = static_cast<uint8_t>(TIFFGetG(p));
        ref[3 * (y * 256 + x) + 2] = static_cast<uint8_t>(TIFFGetB(p));
      }
    const Diff d = diff(img->pixels, ref);
    CAPTURE(d.mean);
    CAPTURE(d.max);
    CHECK(d.mean < 1.0);
    CHECK(d.max < 16);
  }
}

TEST_CASE("open_slide: bad/broken.svs (random text) is kInvalidArgument") {
  auto r = open_slide(kBad + "broken.svs");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK(r.status().message().find(kBad + "broken.svs: not a slide OpenSlide or libtiff can read") == 0);
}

TEST_CASE("open_slide: bad/unopenable.tiff is kDataLoss with OpenSlide's words") {
  auto r = open_slide(kBad + "unopenable.tiff");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kDataLoss);
  CHECK(r.status().message() == kBad + "unopenable.tiff: Unsupported TIFF compression: 52479");
}

TEST_CASE("read_region: bad/unreadable.svs opens, then fails with kDataLoss and a zeroed output") {
  auto s = must_open(kBad + "unreadable.svs");
  CHECK(s->properties().vendor == "aperio");
  REQUIRE(s->properties().levels.size() == 1);
  check_level(*s, 0, 16, 16, 64, 64);
  std::vector<uint8_t> rgb(3 * 16 * 16, 0x7f);
  auto st = s->read_region(0, 0, 0, 16, 16, rgb.data());
  CHECK(st.code() == StatusCode::kDataLoss);
  CHECK(st.message().find("Bogus marker length") != std::string::npos);
  CHECK(st.message().find("unreadable.svs") != std::string::npos);
  CHECK(count_not(rgb, 0) == 0);
  // The error sticks to the handle: later reads fail too, and no tile is offered for pass-through.
  std::fill(rgb.begin(), rgb.end(), 0x7f);
  CHECK(s->read_region(0, 0, 0, 8, 8, rgb.data()).code() == StatusCode::kDataLoss);
  CHECK(count_not(std::vector<uint8_t>(rgb.begin(), rgb.begin() + 3 * 8 * 8), 0) == 0);
  CHECK_FALSE(s->has_raw_jpeg_tiles(0));
  CHECK(s->read_raw_jpeg_tile(0, 0, 0).status().code() == StatusCode::kUnimplemented);
}

TEST_CASE("open_slide: a missing file is kNotFound naming the path") {
  const std::string missing = kSlides + "no-such-slide.svs";
  auto r = open_slide(missing);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kNotFound);
  CHECK(r.status().message().find(missing) != std::string::npos);
}

TEST_CASE("open_slide: an unreadable file is kPermissionDenied (skipped as root)") {
  if (::geteuid() == 0) {
    MESSAGE("running as root: permissions are not enforced, skipped");
    return;
  }
  const std::string path =
      (std::filesystem::temp_directory_path() / ("slide_test_slide_" + std::to_string(::getpid()) + ".tif")).string();
  std::filesystem::copy_file(kKidney, path, std::filesystem::copy_options::overwrite_existing);
  REQUIRE(::chmod(path.c_str(), 0) == 0);
  auto r = open_slide(path);
  std::filesystem::remove(path);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kPermissionDenied);
  CHECK(r.status().message().find(path) != std::string::npos);
}

TEST_CASE("open_slide: a directory is kInvalidArgument") {
  auto r = open_slide(kSlides);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
}

}  // namespace libtile_test_slide
