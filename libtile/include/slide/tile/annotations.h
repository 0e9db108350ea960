// Region annotations: GeoJSON as QuPath exports it, and the coverage of a tile's level-0 square
// by those regions (libtile/src/annotations.cpp, geometry through GEOS's reentrant C API).
//
// Accepted GeoJSON (RFC 7946 shapes, QuPath's conventions): a FeatureCollection, a single
// Feature, or a top-level array of Features (QuPath's "Export objects" writes either). Each
// feature's geometry is a Polygon or a MultiPolygon (first ring the exterior, the rest holes);
// coordinates are level-0 pixels (x right, y down), as QuPath writes them. A feature's class is
// properties.classification.name, or properties.classification when it is a string (older
// QuPath); a feature without one has the class "" (it counts for the ROI, never as a label).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "slide/core/status.h"

namespace slide::tile {

using slide::core::Result;

struct AnnotationPolygon {
  std::string class_name;
  // rings[0]: exterior; rings[1..]: holes. Each ring is closed (first point == last point).
  std::vector<std::vector<std::array<double, 2>>> rings;  // level-0 px
};

struct Annotations {
  std::string source;                  // file name, for error messages
  std::vector<std::string> classes;    // non-empty class names, in order of first appearance
  std::vector<AnnotationPolygon> polygons;
};

// Parses GeoJSON text. `source` names the file in every error message.
// Errors (kInvalidArgument, "<source>: ..."): not JSON (with nlohmann's position), a top level
// that is not a Feature/FeatureCollection/array, a geometry type other than Polygon/MultiPolygon
// (named), a ring with fewer than 4 points or not closed, a non-numeric or non-finite
// coordinate, no polygon at all.
[[nodiscard]] Result<Annotations> parse_geojson(std::string_view text, const std::string& source);
// Reads and parses a file. Errors: those of parse_geojson; errno's status when it cannot be read.
[[nodiscard]] Result<Annotations> load_geojson(const std::string& path);

// Coverage of one tile square by the annotations.
struct TileCoverage {
  double roi_fraction = 0;  // fraction of the square covered by the union of all polygons
  int label = -1;           // index into Annotations::classes, -1 = none
  double label_fraction = 0;
};

// The annotations of one slide, validated and prepared for many tile queries. Owns a GEOS
// context; not thread-safe (one index per thread, or external locking).
class AnnotationIndex {
 public:
  // Validates every polygon (GEOSisValid_r: self-intersections, holes outside their shell, ...)
  // and that every coordinate lies inside [0, width_l0] x [0, height_l0].
  // Errors (kInvalidArgument, naming annotations.source and the feature index): an invalid
  // polygon with GEOS's reason; a coordinate outside the slide; kInternal if GEOS fails.
  [[nodiscard]] static Result<std::unique_ptr<AnnotationIndex>> build(const Annotations& annotations,
                                                                      int64_t width_l0, int64_t height_l0);
  ~AnnotationIndex();
  AnnotationIndex(const AnnotationIndex&) = delete;
  AnnotationIndex& operator=(const AnnotationIndex&) = delete;

  // Coverage of the square [x_l0, x_l0 + side_l0) x [y_l0, y_l0 + side_l0).
  // label: the class whose (unioned) polygons cover the largest area of the square among those
  // covering at least min_label_overlap of it, and more than none of it (at 0 too: a square touched
  // only by class-less polygons has no label); equal areas: the class listed first in the file.
  // Squares whose bounding box misses every polygon, or that one piece (pieces()) contains, are
  // answered from prepared geometries without computing an intersection.
  TileCoverage cover(int64_t x_l0, int64_t y_l0, int64_t side_l0, double min_label_overlap) const;

  const std::vector<std::string>& classes() const;

  // The prepared pieces the index queries, over the union of all polygons and the per-class
  // unions: each union's disjoint parts, those of more than 256 vertices cut into pieces of at
  // most 256 (annotations.cpp, subdivide; a sliver under 2 px across stays whole), so that a tile
  // on a long outline intersects a few hundred vertices, not the outline's.
  size_t pieces() const;

 private:
  struct Impl;
  explicit AnnotationIndex(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace slide::tile
