// GeoJSON parsing and tile coverage (libtile/src/annotations.cpp), on hand-written GeoJSON whose
// areas are known exactly (axis-aligned rectangles, a rectangle with a hole, a right triangle).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "slide/tile/annotations.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtile_test_annotations {

using slide::core::StatusCode;
using slide::tile::AnnotationIndex;
using slide::tile::parse_geojson;

namespace {
// "tumor": [0,200]^2 with a hole [50,150]^2; "stroma": the triangle (200,0)-(400,0)-(200,200).
const char* kTwoClasses = R"({"type":"FeatureCollection","features":[
 {"type":"Feature","properties":{"classification":{"name":"tumor"}},
  "geometry":{"type":"Polygon","coordinates":[[[0,0],[200,0],[200,200],[0,200],[0,0]],
                                              [[50,50],[150,50],[150,150],[50,150],[50,50]]]}},
 {"type":"Feature","properties":{"classification":"stroma"},
  "geometry":{"type":"MultiPolygon","coordinates":[[[[200,0],[400,0],[200,200],[200,0]]]]}}]})";
}  // namespace

TEST_CASE("parse_geojson: FeatureCollection, holes, both classification spellings") {
  auto a = parse_geojson(kTwoClasses, "two.geojson");
  REQUIRE(a.ok());
  CHECK(a->classes == std::vector<std::string>{"tumor", "stroma"});
  REQUIRE(a->polygons.size() == 2);
  CHECK(a->polygons[0].rings.size() == 2);
  CHECK(a->polygons[1].class_name == "stroma");
}

TEST_CASE("parse_geojson: bad inputs name the file and the fault") {
  struct Case { const char* text; const char* message; };
  const Case cases[] = {
      {"{not json", "not valid JSON"},
      {R"({"type":"Feature","geometry":{"type":"Point","coordinates":[1,2]}})", "'Point' is not supported"},
      {R"({"type":"Feature","geometry":{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,1]]]}})",
       "not closed"},
      {R"({"type":"FeatureCollection","features":[]})", "no Polygon"},
      {R"({"type":"Topology"})", "top level"},
      // A "type" that is not a string (json::value threw type_error here; found by fuzz_geojson).
      {R"({"type":5})", "top level"},
      {R"([{"type":5}])", "not a GeoJSON Feature"},
      {R"({"type":"Feature","geometry":{"type":7}})", "geometry 'type' is a JSON number, not a string"},
  };
  for (const Case& c : cases) {
    auto a = parse_geojson(c.text, "bad.geojson");
    REQUIRE_FALSE(a.ok());
    CHECK(a.status().code() == StatusCode::kInvalidArgument);
    CHECK(a.status().message().find("bad.geojson") != std::string::npos);
    CHECK_MESSAGE(a.status().message().find(c.message) != std::string::npos, a.status().message());
  }
}

TEST_CASE("AnnotationIndex: at overlap 0 a label needs a class that covers some of the tile") {
  // A class-less ROI polygon (no classification) over [500,1000]^2 and a "tumor" square at the
  // origin: a tile under the ROI alone has no label, even with min_label_overlap 0.
  const char* text = R"({"type":"FeatureCollection","features":[
   {"type":"Feature","properties":{"classification":{"name":"tumor"}},
    "geometry":{"type":"Polygon","coordinates":[[[0,0],[100,0],[100,100],[0,100],[0,0]]]}},
   {"type":"Feature","properties":{},
    "geometry":{"type":"Polygon","coordinates":[[[500,500],[1000,500],[1000,1000],[500,1000],[500,500]]]}}]})";
  auto a = parse_geojson(text, "roi.geojson");
  REQUIRE(a.ok());
  auto idx = AnnotationIndex::build(*a, 1000, 1000);
  REQUIRE(idx.ok());
  auto c = (*idx)->cover(600, 600, 100, 0.0);
  CHECK(c.roi_fraction == doctest::Approx(1.0));
  CHECK(c.label == -1);
  c = (*idx)->cover(50, 50, 100, 0.0);  // a quarter of it tumour
  CHECK(c.label == 0);
  CHECK(c.label_fraction == doctest::Approx(0.25));
}

TEST_CASE("AnnotationIndex: coverage, labels, ties and validation") {
  auto a = parse_geojson(kTwoClasses, "two.geojson");
  REQUIRE(a.ok());
  auto idx = AnnotationIndex::build(*a, 1000, 1000);
  REQUIRE(idx.ok());
  const AnnotationIndex& ix = **idx;
  // Fully inside tumour's shell, outside the hole.
  auto c = ix.cover(0, 0, 50, 0.5);
  CHECK(c.roi_fraction == doctest::Approx(1.0));
  CHECK(c.label == 0);
  // Inside the hole: nothing.
  c = ix.cover(60, 60, 50, 0.5);
  CHECK(c.roi_fraction == 0);
  CHECK(c.label == -1);
  // [0,100]^2 minus the hole's [50,100]^2 quarter: 3/4 tumour.
  c = ix.cover(0, 0, 100, 0.5);
  CHECK(c.roi_fraction == doctest::Approx(0.75));
  CHECK(c.label == 0);
  // [200,300]^2 under the triangle x + y <= 400: a triangle of area 100*100/2 = half the tile.
  c = ix.cover(200, 200 - 100, 100, 0.5);
  CHECK(c.roi_fraction == doctest::Approx(0.5));
  CHECK(c.label == 1);
  CHECK(ix.cover(200, 100, 100, 0.51).label == -1);
  // [150,250]x[0,100]: tumour covers [150,200]x[0,100] = 0.5; stroma covers the part of
  // [200,250]x[0,100] under x + y <= 400: all of it, 0.5. Equal areas: tumour (listed first).
  c = ix.cover(150, 0, 100, 0.4);
  CHECK(c.roi_fraction == doctest::Approx(1.0));
  CHECK(c.label == 0);
  // Far away: the prepared geometry answers without an intersection.
  CHECK(ix.cover(900, 900, 50, 0.5).roi_fraction == 0);
}

TEST_CASE("AnnotationIndex: self-intersection and coordinates outside the slide") {
  auto bow = parse_geojson(
      R"({"type":"Feature","properties":{"classification":{"name":"x"}},
          "geometry":{"type":"Polygon","coordinates":[[[0,0],[100,100],[100,0],[0,100],[0,0]]]}})",
      "bow.geojson");
  REQUIRE(bow.ok());
  auto r = AnnotationIndex::build(*bow, 1000, 1000);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK(r.status().message().find("bow.geojson") != std::string::npos);
  CHECK(r.status().message().find("Self-intersection") != std::string::npos);

  auto a = parse_geojson(kTwoClasses, "two.geojson");
  REQUIRE(a.ok());
  auto out = AnnotationIndex::build(*a, 300, 300);  // the triangle reaches x = 400
  REQUIRE_FALSE(out.ok());
  CHECK(out.status().message().find("outside the slide") != std::string::npos);
}

TEST_CASE("AnnotationIndex: a long outline is cut into pieces; every tile's coverage is the exact area") {
  // A staircase "tumor" region y in [0, h_i] over the 7-px columns x in [7i, 7i + 7), 2000 columns
  // of random integer heights: 4003 vertices, each tile's covered area a sum of rectangles, known
  // exactly. A "stroma" rectangle overlaps it. Tiles of 97 px: not aligned with the columns.
  std::mt19937 rng(11);
  std::vector<int64_t> h(2000);
  for (auto& v : h) v = 1000 + static_cast<int64_t>(rng() % 2000);
  slide::tile::Annotations a;
  a.source = "staircase";
  a.classes = {"tumor", "stroma"};
  slide::tile::AnnotationPolygon stairs{"tumor", {{}}};
  auto& ring = stairs.rings[0];
  ring.push_back({0, 0});
  for (size_t i = 0; i < h.size(); ++i) {
    ring.push_back({7.0 * static_cast<double>(i), static_cast<double>(h[i])});
    ring.push_back({7.0 * static_cast<double>(i + 1), static_cast<double>(h[i])});
  }
  ring.push_back({14000, 0});
  ring.push_back({0, 0});
  a.polygons.push_back(stairs);
  a.polygons.push_back({"stroma", {{{5000, 2500}, {9000, 2500}, {9000, 3900}, {5000, 3900}, {5000, 2500}}}});
  auto index = AnnotationIndex::build(a, 15000, 4000);
  REQUIRE_MESSAGE(index.ok(), index.status().to_string());
  // Both unions of the staircase (all polygons, and "tumor") cut into pieces of 256 vertices or fewer.
  CHECK((*index)->pieces() >= 2 * (4003 / 256));
  const int64_t s = 97;
  auto tumor_area = [&](int64_t x0, int64_t y0) {
    int64_t area = 0;
    for (int64_t i = std::max<int64_t>(0, x0 / 7); i < static_cast<int64_t>(h.size()) && 7 * i < x0 + s; ++i) {
      const int64_t w = std::min(7 * i + 7, x0 + s) - std::max(7 * i, x0);
      const int64_t d = std::min(h[static_cast<size_t>(i)], y0 + s) - y0;
      if (w > 0 && d > 0) area += w * d;
    }
    return area;
  };
  auto overlap = [&](int64_t x0, int64_t y0, int64_t rx0, int64_t ry0, int64_t rx1, int64_t ry1) {
    const int64_t w = std::min(x0 + s, rx1) - std::max(x0, rx0), d = std::min(y0 + s, ry1) - std::max(y0, ry0);
    return w > 0 && d > 0 ? w * d : int64_t{0};
  };
  int64_t inside = 0, boundary = 0, wrong_roi = 0, wrong_label = 0;
  for (int64_t y = 0; y + s <= 4000; y += s)
    for (int64_t x = 0; x + s <= 15000; x += s) {
      const int64_t t = tumor_area(x, y), r = overlap(x, y, 5000, 2500, 9000, 3900);
      const int64_t both = std::min<int64_t>(t, r) > 0 ? [&] {  // the rectangle's part under the stairs
        int64_t area = 0;
        for (int64_t i = std::max<int64_t>(0, x / 7); i < static_cast<int64_t>(h.size()) && 7 * i < x + s; ++i) {
          const int64_t w = std::min({7 * i + 7, x + s, int64_t{9000}}) - std::max({7 * i, x, int64_t{5000}});
          const int64_t d = std::min({h[static_cast<size_t>(i)], y + s, int64_t{3900}}) - std::max(y, int64_t{2500});
          if (w > 0 && d > 0) area += w * d;
        }
        return area;
      }() : 0;
      const double want_roi = static_cast<double>(t + r - both) / static_cast<double>(s * s);
      const slide::tile::TileCoverage c = (*index)->cover(x, y, s, 0.25);
      wrong_roi += std::abs(c.roi_fraction - want_roi) > 1e-12;
      if (want_roi == 1) ++inside, wrong_roi += c.roi_fraction != 1.0;  // exactly, across the cuts
      if (want_roi > 0 && want_roi < 1) ++boundary;
      // The label: the larger of the two classes' areas among those covering 25 % (tumor first on a tie).
      int want_label = -1;
      if (t > 0 && 4 * t >= s * s) want_label = 0;
      if (r > 0 && 4 * r >= s * s && (want_label < 0 || r > t)) want_label = 1;
      wrong_label += c.label != want_label;
    }
  CHECK(inside > 500);
  CHECK(boundary > 100);
  CHECK(wrong_roi == 0);
  CHECK(wrong_label == 0);
}

}  // namespace libtile_test_annotations
