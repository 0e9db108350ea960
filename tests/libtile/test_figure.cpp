// Figures drawn with cairo (libtile/src/figure.cpp): the colour bar beside an image.
#include <doctest/doctest.h>

#include <cmath>
#include <set>
#include <string>
#include <tuple>

#include "slide/tile/figure.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtile_test_figure {

namespace {

using slide::core::StatusCode;
using slide::tile::ColourBar;
using slide::tile::RgbImage;

std::tuple<int, int, int> pixel(const RgbImage& img, int64_t x, int64_t y) {
  const uint8_t* p = img.row(y) + 3 * x;
  return {p[0], p[1], p[2]};
}

}  // namespace

TEST_CASE("jet colour: dark blue at 0, green-yellow mid-way, dark red at 1, clamped outside") {
  uint8_t c[3];
  slide::tile::jet_colour(0, c);
  CHECK((c[0] == 0 && c[1] == 0 && c[2] == 128));
  slide::tile::jet_colour(1, c);
  CHECK((c[0] == 128 && c[1] == 0 && c[2] == 0));
  slide::tile::jet_colour(0.5, c);
  CHECK((c[1] == 255 && c[2] == 128 && c[0] == 128));
  uint8_t d[3];
  slide::tile::jet_colour(7, d);
  slide::tile::jet_colour(1, c);
  CHECK((d[0] == c[0] && d[1] == c[1] && d[2] == c[2]));
  slide::tile::jet_colour(NAN, d);
  slide::tile::jet_colour(0, c);
  CHECK((d[0] == c[0] && d[1] == c[1] && d[2] == c[2]));
}

TEST_CASE("a colour bar beside an image: the image's pixels unchanged, the bar's ends in jet's colours, text drawn") {
  RgbImage img(300, 240);
  for (int64_t y = 0; y < img.height; ++y)
    for (int64_t x = 0; x < img.width; ++x) {
      uint8_t* p = img.row(y) + 3 * x;
      p[0] = static_cast<uint8_t>(x), p[1] = static_cast<uint8_t>(y), p[2] = 77;
    }
  ColourBar bar;
  bar.title = "p(tumour): slide-1";
  bar.scale = "probability, absolute scale";
  auto fig = slide::tile::add_colour_bar(img, bar);
  REQUIRE(fig.ok());
  CHECK(fig->width == 300 + 110);
  CHECK(fig->height == 28 + 240);
  bool same = true;
  for (int64_t y = 0; y < img.height; ++y)
    for (int64_t x = 0; x < img.width; ++x) same = same && pixel(*fig, x, y + 28) == pixel(img, x, y);
  CHECK(same);
  // The bar is 18 px wide at x = 314..332, from y = 36 down to height - 48; its top is jet(1), its
  // bottom jet(0) (within the gradient's interpolation).
  const auto [tr, tg, tb] = pixel(*fig, 323, 38);
  CHECK(tr > 110);
  CHECK(tg < 30);
  CHECK(tb < 30);
  const auto [br, bg, bb] = pixel(*fig, 323, fig->height - 51);
  CHECK(br < 30);
  CHECK(bg < 30);
  CHECK(bb > 110);
  // Text: dark pixels in the title band and right of the bar (tick labels), none there before.
  int title_dark = 0, label_dark = 0;
  for (int64_t y = 0; y < 28; ++y)
    for (int64_t x = 0; x < fig->width; ++x) title_dark += std::get<0>(pixel(*fig, x, y)) < 100;
  for (int64_t y = 28; y < fig->height; ++y)
    for (int64_t x = 340; x < fig->width; ++x) label_dark += std::get<0>(pixel(*fig, x, y)) < 100;
  CHECK(title_dark > 50);
  CHECK(label_dark > 50);
}

TEST_CASE("a colour bar beside a small image: padded to the bar's height, the title shrunk to the width") {
  RgbImage img(10, 12, 200);
  ColourBar bar;
  bar.title = "a title much wider than the image and its colour bar panel together";
  auto fig = slide::tile::add_colour_bar(img, bar);
  REQUIRE(fig.ok());
  CHECK(fig->height == 28 + 200);
  CHECK(fig->width == 10 + 110);
  int64_t dark = 0;
  for (int64_t y = 0; y < 28; ++y)
    for (int64_t x = 0; x < fig->width; ++x) dark += std::get<0>(pixel(*fig, x, y)) < 128;
  CHECK(dark > 10);  // the title, smaller
  CHECK(pixel(*fig, 5, 28 + 5) == std::make_tuple(200, 200, 200));
  CHECK(pixel(*fig, 5, 28 + 100) == std::make_tuple(255, 255, 255));  // below the image: white
}

TEST_CASE("a colour bar refuses an empty image, fewer than two ticks and a non-finite range") {
  ColourBar bar;
  CHECK(slide::tile::add_colour_bar(RgbImage(), bar).status().code() == StatusCode::kInvalidArgument);
  bar.ticks = 1;
  CHECK(slide::tile::add_colour_bar(RgbImage(4, 4), bar).status().code() == StatusCode::kInvalidArgument);
  bar.ticks = 5;
  bar.high = INFINITY;
  CHECK(slide::tile::add_colour_bar(RgbImage(4, 4), bar).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("line charts: panels side by side, each series' colour in its panel only, text drawn; errors") {
  slide::tile::Series a, b, c;
  a.name = "train", b.name = "validation", c.name = "accuracy";
  a.rgb[0] = 31, a.rgb[1] = 119, a.rgb[2] = 180;
  b.rgb[0] = 255, b.rgb[1] = 127, b.rgb[2] = 14;
  c.rgb[0] = 44, c.rgb[1] = 160, c.rgb[2] = 44;
  a.x = b.x = c.x = {1, 2, 3, 4};
  a.y = {1.2, 0.8, 0.5, 0.4};
  b.y = {1.5, NAN, 0.9, 0.7};  // a gap
  c.y = {0.5, 0.6, 0.8, 0.9};
  slide::tile::Panel left{"Loss", "epoch", "cross-entropy", {a, b}};
  slide::tile::Panel right{"Accuracy", "epoch", "fraction", {c}};
  right.y_min = 0, right.y_max = 1;
  auto fig = slide::tile::draw_line_charts("Curves", {left, right}, 300, 200);
  REQUIRE(fig.ok());
  CHECK(fig->width == 600);
  CHECK(fig->height == 232);
  auto count = [&](int r, int g, int bl, int64_t x0, int64_t x1) {
    int64_t n = 0;
    for (int64_t y = 0; y < fig->height; ++y)
      for (int64_t x = x0; x < x1; ++x) n += pixel(*fig, x, y) == std::make_tuple(r, g, bl);
    return n;
  };
  CHECK(count(31, 119, 180, 0, 300) > 20);  // dots (filled, exact colour) and the legend swatch
  CHECK(count(255, 127, 14, 0, 300) > 20);
  CHECK(count(44, 160, 44, 300, 600) > 20);
  CHECK(count(44, 160, 44, 0, 300) == 0);
  CHECK(count(31, 119, 180, 300, 600) == 0);
  int64_t dark = 0;
  for (int64_t y = 0; y < 32; ++y)
    for (int64_t x = 0; x < fig->width; ++x) dark += std::get<0>(pixel(*fig, x, y)) < 80;
  CHECK(dark > 30);  // the title
  CHECK(slide::tile::draw_line_charts("x", {}, 300, 200).status().code() == StatusCode::kInvalidArgument);
  CHECK(slide::tile::draw_line_charts("x", {left}, 100, 200).status().code() == StatusCode::kInvalidArgument);
  slide::tile::Panel bad{"bad", "x", "y", {a}};
  bad.series[0].y.pop_back();
  CHECK(slide::tile::draw_line_charts("x", {bad}).status().code() == StatusCode::kInvalidArgument);
}

}  // namespace libtile_test_figure
