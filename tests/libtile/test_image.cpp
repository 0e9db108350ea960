// Codecs and area resampling (libtile/src/image.cpp).
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "slide/core/file.h"
#include "slide/tile/image.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtile_test_image {

namespace {

using slide::core::StatusCode;
using slide::tile::RgbImage;

const std::string kKather = std::string(SLIDE_SAMPLE_DIR) +
                            "/patches/kather2016-samples/01_TUMOR/1A11_CRC-Prim-HE-07_022.tif_Row_601_Col_151.tif";

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("slide_test_image_" + std::to_string(::getpid()) + "_" + name)).string();
}

double psnr(const RgbImage& a, const RgbImage& b) {
  double se = 0;
  for (size_t i = 0; i < a.pixels.size(); ++i) {
    const double d = static_cast<double>(a.pixels[i]) - static_cast<double>(b.pixels[i]);
    se += d * d;
  }
  const double mse = se / static_cast<double>(a.pixels.size());
  return 10 * std::log10(255.0 * 255.0 / mse);
}

// A grey image (R = G = B) from a row-major list of values.
RgbImage grey(int64_t w, int64_t h, const std::vector<int>& v) {
  RgbImage img(w, h);
  for (size_t i = 0; i < v.size(); ++i)
    for (int c = 0; c < 3; ++c) img.pixels[3 * i + static_cast<size_t>(c)] = static_cast<uint8_t>(v[i]);
  return img;
}

std::vector<int> channel(const RgbImage& img, int c) {
  std::vector<int> out;
  for (size_t i = 0; i < img.pixels.size() / 3; ++i) out.push_back(img.pixels[3 * i + static_cast<size_t>(c)]);
  return out;
}

}  // namespace

TEST_CASE("test_image: read_image_file decodes a Kather TIFF patch like OpenCV does") {
  auto img = slide::tile::read_image_file(kKather);
  REQUIRE_MESSAGE(img.ok(), img.status().to_string());
  CHECK(img->width == 150);
  CHECK(img->height == 150);
  // Reference pixels from cv2.imread (BGR reversed) of the same file.
  auto px = [&](int x, int y) {
    const uint8_t* p = img->row(y) + 3 * x;
    return std::vector<int>{p[0], p[1], p[2]};
  };
  CHECK(px(0, 0) == std::vector<int>{102, 39, 82});
  CHECK(px(75, 40) == std::vector<int>{161, 63, 114});
  CHECK(px(149, 149) == std::vector<int>{228, 200, 215});
}

TEST_CASE("test_image: JPEG round trip of a real patch, deterministic bytes") {
  auto img = slide::tile::read_image_file(kKather);
  REQUIRE(img.ok());
  auto a = slide::tile::encode_jpeg(img->pixels.data(), img->width, img->height, 90);
  auto b = slide::tile::encode_jpeg(img->pixels.data(), img->width, img->height, 90);
  REQUIRE_MESSAGE(a.ok(), a.status().to_string());
  REQUIRE(b.ok());
  CHECK(*a == *b);
  CHECK((*a)[0] == 0xFF);
  CHECK((*a)[1] == 0xD8);
  auto dec = slide::tile::decode_jpeg(*a);
  REQUIRE_MESSAGE(dec.ok(), dec.status().to_string());
  CHECK(dec->width == 150);
  CHECK(dec->height == 150);
  const double p = psnr(*img, *dec);
  CHECK(p > 30.0);
  CHECK(p < 60.0);  // lossy: an exact copy would mean the encoder did not run at quality 90

  // A lower quality gives a smaller file.
  auto low = slide::tile::encode_jpeg(img->pixels.data(), img->width, img->height, 20);
  REQUIRE(low.ok());
  CHECK(low->size() < a->size());
}

TEST_CASE("test_image: JPEG errors") {
  std::vector<uint8_t> garbage(500);
  for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<uint8_t>(i * 37 + 11);
  auto g = slide::tile::decode_jpeg(garbage);
  REQUIRE_FALSE(g.ok());
  CHECK(g.status().code() == StatusCode::kDataLoss);
  CHECK(g.status().message().find("JPEG decode") != std::string::npos);

  // A truncated stream is data loss too, not a grey-padded image.
  RgbImage img(64, 64);
  for (size_t i = 0; i < img.pixels.size(); ++i) img.pixels[i] = static_cast<uint8_t>((i * 7) % 251);
  auto enc = slide::tile::encode_jpeg(img.pixels.data(), 64, 64, 90);
  REQUIRE(enc.ok());
  std::vector<uint8_t> cut(enc->begin(), enc->begin() + static_cast<long>(enc->size() / 2));
  auto t = slide::tile::decode_jpeg(cut);
  REQUIRE_FALSE(t.ok());
  CHECK(t.status().code() == StatusCode::kDataLoss);

  CHECK(slide::tile::decode_jpeg(std::span<const uint8_t>()).status().code() == StatusCode::kDataLoss);

  // A stream cut inside its header tables fails; the next good stream on the same thread must
  // still decode (TurboJPEG leaves the failed handle mid-marker; it has to be replaced).
  for (size_t cut_at : {size_t{25}, size_t{60}, size_t{100}, size_t{170}}) {
    std::vector<uint8_t> head(enc->begin(), enc->begin() + static_cast<long>(cut_at));
    CHECK_FALSE(slide::tile::decode_jpeg(head).ok());
    auto again = slide::tile::decode_jpeg(*enc);
    CHECK_MESSAGE(again.ok(), "after a stream cut at byte ", cut_at, ": ", again.status().to_string());
  }
  CHECK(slide::tile::encode_jpeg(img.pixels.data(), 64, 64, 0).status().code() == StatusCode::kInvalidArgument);
  CHECK(slide::tile::encode_jpeg(img.pixels.data(), 64, 64, 101).status().code() == StatusCode::kInvalidArgument);
  CHECK(slide::tile::encode_jpeg(img.pixels.data(), 0, 64, 90).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("test_image: validate_jpeg finds corrupt entropy-coded data and size mismatches") {
  RgbImage img(64, 64);
  for (size_t i = 0; i < img.pixels.size(); ++i) img.pixels[i] = static_cast<uint8_t>((i * 7) % 251);
  auto enc = slide::tile::encode_jpeg(img.pixels.data(), 64, 64, 90);
  REQUIRE(enc.ok());
  CHECK(slide::tile::validate_jpeg(*enc, 64, 64).ok());
  auto wrong_size = slide::tile::validate_jpeg(*enc, 64, 32);
  CHECK(wrong_size.code() == StatusCode::kDataLoss);
  CHECK_MESSAGE(wrong_size.message().find("64x64 px, expected 64x32") != std::string::npos, wrong_size.message());
  // Zeroed bytes in the middle of the scan: libjpeg only warns ("Corrupt JPEG data: ...").
  size_t sos = 0;
  for (size_t i = 0; i + 1 < enc->size(); ++i)
    if ((*enc)[i] == 0xFF && (*enc)[i + 1] == 0xDA) sos = i;
  REQUIRE(sos > 0);
  std::vector<uint8_t> corrupt = *enc;
  const size_t mid = sos + (corrupt.size() - sos) / 2;
  std::fill(corrupt.begin() + static_cast<long>(mid), corrupt.begin() + static_cast<long>(mid + 64), 0);
  auto c = slide::tile::validate_jpeg(corrupt, 64, 64);
  CHECK(c.code() == StatusCode::kDataLoss);
  CHECK_MESSAGE(c.message().find("JPEG check: Corrupt JPEG data") != std::string::npos, c.message());
  std::vector<uint8_t> cut(enc->begin(), enc->begin() + static_cast<long>(enc->size() / 2));
  CHECK(slide::tile::validate_jpeg(cut, 64, 64).code() == StatusCode::kDataLoss);
  CHECK(slide::tile::validate_jpeg(std::span<const uint8_t>(), 64, 64).code() == StatusCode::kDataLoss);
  CHECK(slide::tile::validate_jpeg(*enc, 64, 64).ok());  // the handle survives the failures
}

TEST_CASE("test_image: PNG round trip is exact; corrupt PNG is data loss") {
  RgbImage img(37, 23);
  for (size_t i = 0; i < img.pixels.size(); ++i) img.pixels[i] = static_cast<uint8_t>((i * 131 + i / 7) % 256);
  auto png = slide::tile::encode_png(img);
  REQUIRE_MESSAGE(png.ok(), png.status().to_string());
  CHECK((*png)[1] == 'P');
  auto dec = slide::tile::decode_png(*png);
  REQUIRE_MESSAGE(dec.ok(), dec.status().to_string());
  CHECK(dec->width == 37);
  CHECK(dec->height == 23);
  CHECK(dec->pixels == img.pixels);

  std::vector<uint8_t> cut(png->begin(), png->begin() + static_cast<long>(png->size() - 30));
  auto c = slide::tile::decode_png(cut);
  REQUIRE_FALSE(c.ok());
  CHECK(c.status().code() == StatusCode::kDataLoss);

  std::vector<uint8_t> flipped = *png;
  flipped[flipped.size() / 2] ^= 0xFF;  // inside IDAT: CRC mismatch
  CHECK(slide::tile::decode_png(flipped).status().code() == StatusCode::kDataLoss);

  std::vector<uint8_t> not_png{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  CHECK(slide::tile::decode_png(not_png).status().code() == StatusCode::kDataLoss);
}

TEST_CASE("test_image: read_image_file on PNG/JPEG files and its errors") {
  RgbImage img(16, 8);
  for (size_t i = 0; i < img.pixels.size(); ++i) img.pixels[i] = static_cast<uint8_t>(i % 256);
  auto png = slide::tile::encode_png(img);
  REQUIRE(png.ok());
  const std::string png_path = temp_path("a.PNG");  // upper case: extensions are case-insensitive
  REQUIRE(slide::core::write_file_atomic(png_path, std::span<const uint8_t>(*png)).ok());
  auto back = slide::tile::read_image_file(png_path);
  REQUIRE_MESSAGE(back.ok(), back.status().to_string());
  CHECK(back->pixels == img.pixels);

  // A corrupt file names its path.
  const std::string bad_jpg = temp_path("bad.jpg");
  REQUIRE(slide::core::write_file_atomic(bad_jpg, std::string_view("not a jpeg at all")).ok());
  auto bad = slide::tile::read_image_file(bad_jpg);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kDataLoss);
  CHECK(bad.status().message().find(bad_jpg) != std::string::npos);

  const std::string bad_tif = temp_path("bad.tif");
  REQUIRE(slide::core::write_file_atomic(bad_tif, std::string_view("II*\0garbage-garbage-garbage", 27)).ok());
  auto bt = slide::tile::read_image_file(bad_tif);
  REQUIRE_FALSE(bt.ok());
  CHECK(bt.status().code() == StatusCode::kDataLoss);
  CHECK(bt.status().message().find(bad_tif) != std::string::npos);

  auto missing = slide::tile::read_image_file(temp_path("missing.png"));
  CHECK(missing.status().code() == StatusCode::kNotFound);
  auto missing_tif = slide::tile::read_image_file(temp_path("missing.tiff"));
  CHECK(missing_tif.status().code() == StatusCode::kNotFound);
  CHECK(missing_tif.status().message().find("missing.tiff") != std::string::npos);
  auto unknown = slide::tile::read_image_file(temp_path("a.bmp"));
  CHECK(unknown.status().code() == StatusCode::kInvalidArgument);
  CHECK(unknown.status().message().find("a.bmp") != std::string::npos);

  std::remove(png_path.c_str());
  std::remove(bad_jpg.c_str());
  std::remove(bad_tif.c_str());
}

TEST_CASE("test_image: resample_area scale 1 with an integer offset is a copy") {
  RgbImage src(5, 4);
  for (size_t i = 0; i < src.pixels.size(); ++i) src.pixels[i] = static_cast<uint8_t>(i * 3 + 1);
  RgbImage dst(3, 2);
  slide::tile::resample_area(src, 1, 2, 1.0, &dst);
  for (int64_t y = 0; y < 2; ++y)
    for (int64_t x = 0; x < 3; ++x)
      for (int c = 0; c < 3; ++c) CHECK(dst.row(y)[3 * x + c] == src.row(y + 2)[3 * (x + 1) + c]);
}

TEST_CASE("test_image: resample_area scale 2 is the mean of 2x2 blocks") {
  // Hand-computed: (3+13+43+53)/4 = 28, (23+33+63+73)/4 = 48, (83+93+123+133)/4 = 108,
  // (103+113+143+153)/4 = 128; and a block averaging 0.75 rounds to 1.
  RgbImage src = grey(4, 4, {3, 13, 23, 33, 43, 53, 63, 73, 83, 93, 103, 113, 123, 133, 143, 153});
  src.pixels[0 * 3 + 2] = 0;  // blue channel of the top-left block: 0, 13, 43, 53 -> 27.25 -> 27
  RgbImage dst(2, 2);
  slide::tile::resample_area(src, 0, 0, 2.0, &dst);
  CHECK(channel(dst, 0) == std::vector<int>{28, 48, 108, 128});
  CHECK(channel(dst, 2) == std::vector<int>{27, 48, 108, 128});

  RgbImage q = grey(2, 2, {0, 1, 1, 1});
  RgbImage one(1, 1);
  slide::tile::resample_area(q, 0, 0, 2.0, &one);
  CHECK(one.pixels[0] == 1);
}

TEST_CASE("test_image: resample_area scale 1.5 with fractional weights") {
  // Destination pixel 0 covers source [0, 1.5): weights 2/3, 1/3; pixel 1 covers [1.5, 3):
  // 1/3, 2/3. The centre 255 contributes 255/9 = 28.3 to every output pixel; the corner 90 adds
  // 90 * 4/9 = 40 to the bottom-right one (68.3). cv2.resize(INTER_AREA) gives the same.
  RgbImage src = grey(3, 3, {0, 0, 0, 0, 255, 0, 0, 0, 90});
  RgbImage dst(2, 2);
  slide::tile::resample_area(src, 0, 0, 1.5, &dst);
  CHECK(channel(dst, 1) == std::vector<int>{28, 28, 28, 68});

  // Offset 0.5: [0.5, 2) x [0.5, 2) weights the centre by (2/3)^2: 255 * 4/9 = 113.3.
  RgbImage one(1, 1);
  slide::tile::resample_area(src, 0.5, 0.5, 1.5, &one);
  CHECK(channel(one, 0) == std::vector<int>{113});

  // Past the right/bottom edge the edge pixel repeats: [2, 4) x [2, 4) reads only (2, 2).
  slide::tile::resample_area(src, 2, 2, 2.0, &one);
  CHECK(channel(one, 2) == std::vector<int>{90});
}

TEST_CASE("read_image_size: the header's size for TIFF, JPEG and PNG, as read_image_file decodes them") {
  auto tiff = slide::tile::read_image_size(kKather);
  REQUIRE(tiff.ok());
  CHECK((tiff->width == 150 && tiff->height == 150));
  RgbImage img(37, 21, 90);
  auto jpeg = slide::tile::encode_jpeg(img.pixels.data(), 37, 21, 90);
  auto png = slide::tile::encode_png(img);
  REQUIRE(jpeg.ok());
  REQUIRE(png.ok());
  const std::string j = temp_path("size.jpg"), p = temp_path("size.png"), bad = temp_path("bad.png");
  REQUIRE(slide::core::write_file_atomic(j, *jpeg).ok());
  REQUIRE(slide::core::write_file_atomic(p, *png).ok());
  REQUIRE(slide::core::write_file_atomic(bad, std::string("not a png at all, but long enough")).ok());
  for (const std::string& path : {j, p}) {
    CAPTURE(path);
    auto size = slide::tile::read_image_size(path);
    auto full = slide::tile::read_image_file(path);
    REQUIRE(size.ok());
    REQUIRE(full.ok());
    CHECK((size->width == full->width && size->height == full->height));
    CHECK((size->width == 37 && size->height == 21));
  }
  CHECK(slide::tile::read_image_size(bad).status().code() == StatusCode::kDataLoss);
  CHECK(slide::tile::read_image_size(temp_path("missing.jpg")).status().code() == StatusCode::kNotFound);
  CHECK(slide::tile::read_image_size(temp_path("x.bmp")).status().code() == StatusCode::kInvalidArgument);
  std::remove(j.c_str());
  std::remove(p.c_str());
  std::remove(bad.c_str());
}

}  // namespace libtile_test_image
