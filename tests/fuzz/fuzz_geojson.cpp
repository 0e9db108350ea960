// slide::tile::parse_geojson (region annotations, QuPath's GeoJSON export or hand-written files)
// on arbitrary text, then AnnotationIndex::build and cover (GEOS) on what it accepts, with the
// slide as large as the coordinates need. Properties:
//   - parse_geojson never crashes or throws; its errors are kInvalidArgument naming the source;
//   - what it accepts: at least one polygon; every polygon has rings, every ring >= 4 finite
//     points and closed; classes are the distinct non-empty class names of the polygons, in order
//     of first appearance;
//   - round trip: the polygons written back as a FeatureCollection parse to the same annotations;
//   - build: errors are kInvalidArgument naming the source (never kInternal: GEOS's union of
//     valid polygons does not fail);
//   - cover on a 4 x 4 grid of tiles over the slide: roi_fraction and label_fraction in [0, 1],
//     label -1 or a class index, a label only where roi_fraction > 0, label_fraction >=
//     min_label_overlap and <= roi_fraction; the covered areas summed over the grid lie between
//     the largest polygon's area and the sum of all polygons' areas (shoelace, holes subtracted).
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "slide/tile/annotations.h"

namespace {

using slide::core::StatusCode;
using slide::tile::Annotations;

const std::string kSource = "fuzz.geojson";

bool names_source(const slide::core::Status& s) { return s.message().rfind(kSource + ": ", 0) == 0; }

double ring_area(const std::vector<std::array<double, 2>>& r) {
  double a = 0;
  for (size_t i = 0; i + 1 < r.size(); ++i) a += r[i][0] * r[i + 1][1] - r[i + 1][0] * r[i][1];
  return std::abs(a) / 2;
}

nlohmann::json to_geojson(const Annotations& a) {
  nlohmann::json features = nlohmann::json::array();
  for (const auto& p : a.polygons) {
    nlohmann::json f = {{"type", "Feature"},
                        {"geometry", {{"type", "Polygon"}, {"coordinates", p.rings}}}};
    if (!p.class_name.empty()) f["properties"] = {{"classification", {{"name", p.class_name}}}};
    features.push_back(std::move(f));
  }
  return {{"type", "FeatureCollection"}, {"features", features}};
}

void check_parsed(const Annotations& a) {
  SLIDE_FUZZ_CHECK(a.source == kSource);
  SLIDE_FUZZ_CHECK(!a.polygons.empty());
  std::vector<std::string> classes;
  for (const auto& p : a.polygons) {
    SLIDE_FUZZ_CHECK(!p.rings.empty());
    for (const auto& r : p.rings) {
      SLIDE_FUZZ_CHECK(r.size() >= 4);
      SLIDE_FUZZ_CHECK(r.front() == r.back());
      for (const auto& pt : r) SLIDE_FUZZ_CHECK(std::isfinite(pt[0]) && std::isfinite(pt[1]));
    }
    if (!p.class_name.empty() && std::find(classes.begin(), classes.end(), p.class_name) == classes.end())
      classes.push_back(p.class_name);
  }
  SLIDE_FUZZ_CHECK(classes == a.classes);
}

void check_round_trip(const Annotations& a) {
  auto again = slide::tile::parse_geojson(to_geojson(a).dump(), kSource);
  SLIDE_FUZZ_CHECK(again.ok());
  SLIDE_FUZZ_CHECK(again->classes == a.classes);
  SLIDE_FUZZ_CHECK(again->polygons.size() == a.polygons.size());
  for (size_t i = 0; i < a.polygons.size(); ++i) {
    SLIDE_FUZZ_CHECK(again->polygons[i].class_name == a.polygons[i].class_name);
    SLIDE_FUZZ_CHECK(again->polygons[i].rings == a.polygons[i].rings);
  }
}

void check_index(const Annotations& a) {
  double max_x = 0, max_y = 0;
  for (const auto& p : a.polygons)
    for (const auto& r : p.rings)
      for (const auto& pt : r) max_x = std::max(max_x, pt[0]), max_y = std::max(max_y, pt[1]);
  // Huge coordinates make the tolerances below meaningless; they are still parsed above.
  if (max_x > 1e6 || max_y > 1e6) return;
  const int64_t width = static_cast<int64_t>(std::ceil(max_x)), height = static_cast<int64_t>(std::ceil(max_y));
  auto index = slide::tile::AnnotationIndex::build(a, width, height);
  if (!index.ok()) {
    SLIDE_FUZZ_CHECK(index.status().code() == StatusCode::kInvalidArgument);
    SLIDE_FUZZ_CHECK(names_source(index.status()));
    return;
  }
  SLIDE_FUZZ_CHECK((*index)->classes() == a.classes);
  // Valid polygons: holes lie inside their shell and do not overlap.
  double sum_area = 0, max_area = 0;
  for (const auto& p : a.polygons) {
    double area = ring_area(p.rings[0]);
    for (size_t i = 1; i < p.rings.size(); ++i) area -= ring_area(p.rings[i]);
    sum_area += area;
    max_area = std::max(max_area, area);
  }
  const int64_t side = std::max<int64_t>(1, (std::max(width, height) + 3) / 4);
  const double min_overlap = 0.25;
  const double tile_area = static_cast<double>(side) * static_cast<double>(side);
  double covered = 0;
  for (int64_t ty = 0; ty < 4; ++ty)
    for (int64_t tx = 0; tx < 4; ++tx) {
      const auto c = (*index)->cover(tx * side, ty * side, side, min_overlap);
      SLIDE_FUZZ_CHECK(c.roi_fraction >= 0 && c.roi_fraction <= 1);
      SLIDE_FUZZ_CHECK(c.label >= -1 && c.label < static_cast<int>(a.classes.size()));
      SLIDE_FUZZ_CHECK(c.label_fraction >= 0 && c.label_fraction <= 1);
      if (c.label >= 0) {
        SLIDE_FUZZ_CHECK(c.roi_fraction > 0);
        SLIDE_FUZZ_CHECK(c.label_fraction >= min_overlap);
        SLIDE_FUZZ_CHECK(c.label_fraction <= c.roi_fraction * (1 + 1e-9) + 1e-9);
      } else {
        SLIDE_FUZZ_CHECK(c.label_fraction == 0);
      }
      covered += c.roi_fraction * tile_area;
    }
  const double eps = 1e-6 * std::max(1.0, static_cast<double>(width) * static_cast<double>(height));
  SLIDE_FUZZ_CHECK(covered <= sum_area + eps);
  SLIDE_FUZZ_CHECK(covered >= max_area - eps);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto parsed = slide::tile::parse_geojson(text, kSource);
  if (!parsed.ok()) {
    SLIDE_FUZZ_CHECK(parsed.status().code() == StatusCode::kInvalidArgument);
    SLIDE_FUZZ_CHECK(names_source(parsed.status()));
    return 0;
  }
  check_parsed(*parsed);
  check_round_trip(*parsed);
  check_index(*parsed);
  return 0;
}
