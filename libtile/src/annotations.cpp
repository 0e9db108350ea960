// GeoJSON parsing (nlohmann::json) and tile coverage (GEOS reentrant C API, geos_c.h).
#include "slide/tile/annotations.h"

#include <geos_c.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace slide::tile {

using slide::core::Status;
using json = nlohmann::json;

namespace {

Status bad(const std::string& source, const std::string& what) {
  return slide::core::invalid_argument(source + ": " + what);
}

// An object's "type" when it is a string, else "" (json::value would throw on {"type": 5}).
std::string type_of(const json& j) {
  auto t = j.find("type");
  return t != j.end() && t->is_string() ? t->get<std::string>() : std::string();
}

Status parse_ring(const json& ring, std::vector<std::array<double, 2>>& out, const std::string& where) {
  if (!ring.is_array()) return slide::core::invalid_argument(where + ": a ring is not an array");
  for (const json& p : ring) {
    if (!p.is_array() || p.size() < 2 || !p[0].is_number() || !p[1].is_number())
      return slide::core::invalid_argument(where + ": a coordinate is not a [x, y] pair of numbers");
    double x = p[0].get<double>(), y = p[1].get<double>();
    if (!std::isfinite(x) || !std::isfinite(y)) return slide::core::invalid_argument(where + ": non-finite coordinate");
    out.push_back({x, y});
  }
  if (out.size() < 4) return slide::core::invalid_argument(where + ": a ring has fewer than 4 points");
  if (out.front() != out.back()) return slide::core::invalid_argument(where + ": a ring is not closed");
  return {};
}

Status parse_polygon(const json& rings, const std::string& cls, Annotations& out, const std::string& where) {
  if (!rings.is_array() || rings.empty()) return slide::core::invalid_argument(where + ": a polygon has no rings");
  AnnotationPolygon poly;
  poly.class_name = cls;
  for (const json& r : rings) {
    poly.rings.emplace_back();
    SLIDE_RETURN_IF_ERROR(parse_ring(r, poly.rings.back(), where));
  }
  out.polygons.push_back(std::move(poly));
  return {};
}

Status parse_feature(const json& f, size_t index, Annotations& out) {
  const std::string where = out.source + ": feature " + std::to_string(index);
  if (!f.is_object() || type_of(f) != "Feature")
    return slide::core::invalid_argument(where + ": not a GeoJSON Feature");
  std::string cls;
  if (auto p = f.find("properties"); p != f.end() && p->is_object()) {
    if (auto c = p->find("classification"); c != p->end()) {
      if (c->is_string()) cls = c->get<std::string>();
      else if (c->is_object() && c->contains("name") && (*c)["name"].is_string()) cls = (*c)["name"].get<std::string>();
    }
  }
  auto g = f.find("geometry");
  if (g == f.end() || !g->is_object()) return slide::core::invalid_argument(where + ": no geometry");
  if (auto t = g->find("type"); t != g->end() && !t->is_string())
    return slide::core::invalid_argument(where + ": geometry 'type' is a JSON " + t->type_name() + ", not a string");
  const std::string type = type_of(*g);
  auto coords = g->find("coordinates");
  if (type != "Polygon" && type != "MultiPolygon")
    return slide::core::invalid_argument(where + ": geometry type '" + type +
                                         "' is not supported (only Polygon and MultiPolygon)");
  if (coords == g->end() || !coords->is_array()) return slide::core::invalid_argument(where + ": no coordinates");
  if (type == "Polygon") {
    SLIDE_RETURN_IF_ERROR(parse_polygon(*coords, cls, out, where));
  } else {
    for (const json& poly : *coords) SLIDE_RETURN_IF_ERROR(parse_polygon(poly, cls, out, where));
  }
  if (!cls.empty()) {
    bool known = false;
    for (const auto& c : out.classes) known = known || c == cls;
    if (!known) out.classes.push_back(cls);
  }
  return {};
}

void geos_message(const char* fmt, ...) {
  // GEOS reports through these handlers; errors also surface as null returns, which we check.
  (void)fmt;
}

}  // namespace

Result<Annotations> parse_geojson(std::string_view text, const std::string& source) {
  Annotations out;
  out.source = source;
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return bad(source, "not valid JSON");
  std::vector<const json*> features;
  if (doc.is_array()) {
    for (const json& f : doc) features.push_back(&f);
  } else if (doc.is_object() && type_of(doc) == "FeatureCollection") {
    auto fs = doc.find("features");
    if (fs == doc.end() || !fs->is_array()) return bad(source, "a FeatureCollection without a 'features' array");
    for (const json& f : *fs) features.push_back(&f);
  } else if (doc.is_object() && type_of(doc) == "Feature") {
    features.push_back(&doc);
  } else {
    return bad(source, "the top level is not a Feature, a FeatureCollection or an array of Features");
  }
  for (size_t i = 0; i < features.size(); ++i) SLIDE_RETURN_IF_ERROR(parse_feature(*features[i], i, out));
  if (out.polygons.empty()) return bad(source, "no Polygon or MultiPolygon");
  return out;
}

Result<Annotations> load_geojson(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return slide::core::errno_status(errno, "cannot read annotations " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return slide::core::errno_status(errno, "cannot read annotations " + path);
  return parse_geojson(ss.str(), path);
}

// A union's disjoint parts, each prepared, behind an STR tree on their bounding boxes: a tile
// query touches only the parts whose boxes it meets, never the whole union (a union of 1000
// polygons intersected with every boundary tile took a minute for 100k tiles). A part of more
// than kMaxPieceVertices vertices is cut into pieces (Impl::subdivide): a boundary tile's
// intersection then costs its pieces' vertices, not the whole outline's (one 100,000-vertex
// outline over 2,012 boundary tiles of 256 px: 20.9 s of coverage uncut, 1.7 s cut, index build
// included; bench/annotation_bench.cpp).
constexpr int kMaxPieceVertices = 256;

struct Layer {
  std::vector<GEOSGeometry*> parts;  // owned: the union's components, or pieces of them
  std::vector<const GEOSPreparedGeometry*> prepared;
  GEOSSTRtree* tree = nullptr;
};

struct AnnotationIndex::Impl {
  GEOSContextHandle_t ctx = nullptr;
  std::vector<std::string> classes;
  Layer all;                  // the union of every polygon
  std::vector<Layer> by_class;  // the union per class, in classes' order

  void free_layer(Layer& l) {
    if (l.tree) GEOSSTRtree_destroy_r(ctx, l.tree);
    for (auto* p : l.prepared) if (p) GEOSPreparedGeom_destroy_r(ctx, p);
    for (auto* g : l.parts) GEOSGeom_destroy_r(ctx, g);
  }
  ~Impl() {
    if (!ctx) return;
    free_layer(all);
    for (auto& l : by_class) free_layer(l);
    GEOS_finish_r(ctx);
  }

  // Appends the polygons of `g` (a Polygon, or the polygons of a MultiPolygon or collection; lines
  // and points, which an intersection can leave along a cut, have no area and are dropped) to
  // *out as owned clones. False when GEOS fails.
  bool polygons_of(const GEOSGeometry* g, std::vector<GEOSGeometry*>* out) const {
    const int type = GEOSGeomTypeId_r(ctx, g);
    if (type == GEOS_POLYGON) {
      if (GEOSisEmpty_r(ctx, g) == 1) return true;
      GEOSGeometry* c = GEOSGeom_clone_r(ctx, g);
      if (!c) return false;
      out->push_back(c);
      return true;
    }
    if (type != GEOS_MULTIPOLYGON && type != GEOS_GEOMETRYCOLLECTION) return type >= 0;
    const int n = GEOSGetNumGeometries_r(ctx, g);
    if (n < 0) return false;
    for (int i = 0; i < n; ++i)
      if (!polygons_of(GEOSGetGeometryN_r(ctx, g, i), out)) return false;
    return true;
  }

  // Cuts `part` (a polygon, owned) into pieces of at most kMaxPieceVertices vertices, appended to
  // *out (owned): its bounding box halved across its longer side at an integer coordinate, each
  // half intersected with it (GEOSIntersection_r, robust; GEOSClipByRect_r may return invalid
  // polygons), recursively: PostGIS's ST_Subdivide. The pieces are disjoint but for the cuts and
  // their union is the part, so their areas inside a tile add to the part's; level-0 tiles have
  // integer corners, and a cut at an integer coordinate through a tile inside the part splits it
  // into rectangles whose areas add exactly. O(V log V) for V vertices. A part GEOS cannot cut is
  // kept whole. False when GEOS cannot count its vertices or bound it.
  bool subdivide(GEOSGeometry* part, int depth, std::vector<GEOSGeometry*>* out) const {
    const int vertices = GEOSGetNumCoordinates_r(ctx, part);
    double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
    const bool box_ok = GEOSGeom_getXMin_r(ctx, part, &x0) == 1 && GEOSGeom_getYMin_r(ctx, part, &y0) == 1 &&
                        GEOSGeom_getXMax_r(ctx, part, &x1) == 1 && GEOSGeom_getYMax_r(ctx, part, &y1) == 1;
    const bool across_x = x1 - x0 >= y1 - y0;
    const double lo = across_x ? x0 : y0, hi = across_x ? x1 : y1;
    const double cut = std::floor((lo + hi) / 2);
    // Small enough, too deep, or too narrow to cut at an integer inside it: kept whole.
    if (vertices < 0 || !box_ok || vertices <= kMaxPieceVertices || depth >= 40 || cut <= lo || cut >= hi) {
      out->push_back(part);
      return vertices >= 0 && box_ok;
    }
    std::vector<GEOSGeometry*> pieces;  // both halves' polygons
    bool cut_ok = true;
    for (int side = 0; cut_ok && side < 2; ++side) {
      // The half-boxes reach 1 px past the part's box, so no vertex lies on their outer edges.
      GEOSGeometry* half = across_x ? (side == 0 ? box(x0 - 1, y0 - 1, cut, y1 + 1) : box(cut, y0 - 1, x1 + 1, y1 + 1))
                                    : (side == 0 ? box(x0 - 1, y0 - 1, x1 + 1, cut) : box(x0 - 1, cut, x1 + 1, y1 + 1));
      GEOSGeometry* inter = half ? GEOSIntersection_r(ctx, part, half) : nullptr;
      if (half) GEOSGeom_destroy_r(ctx, half);
      cut_ok = inter != nullptr && polygons_of(inter, &pieces);
      if (inter) GEOSGeom_destroy_r(ctx, inter);
    }
    if (!cut_ok) {  // GEOS could not cut it: the part is kept whole, as before the cuts
      for (GEOSGeometry* piece : pieces) GEOSGeom_destroy_r(ctx, piece);
      out->push_back(part);
      return true;
    }
    GEOSGeom_destroy_r(ctx, part);
    bool ok = true;
    for (GEOSGeometry* piece : pieces) {
      if (ok) ok = subdivide(piece, depth + 1, out);
      else GEOSGeom_destroy_r(ctx, piece);
    }
    return ok;
  }

  // Takes ownership of `u` (a union). False when GEOS fails.
  bool make_layer(GEOSGeometry* u, Layer* l) {
    const int n = GEOSGetNumGeometries_r(ctx, u);
    if (n < 0) { GEOSGeom_destroy_r(ctx, u); return false; }
    l->tree = GEOSSTRtree_create_r(ctx, 10);
    bool ok = l->tree != nullptr;
    for (int i = 0; ok && i < n; ++i) {
      std::vector<GEOSGeometry*> polygons;
      ok = polygons_of(GEOSGetGeometryN_r(ctx, u, i), &polygons);
      for (GEOSGeometry* polygon : polygons) {
        if (ok) ok = subdivide(polygon, 0, &l->parts);
        else GEOSGeom_destroy_r(ctx, polygon);
      }
    }
    for (size_t i = 0; ok && i < l->parts.size(); ++i) {
      const GEOSPreparedGeometry* prep = GEOSPrepare_r(ctx, l->parts[i]);
      if (!prep) { ok = false; break; }
      l->prepared.push_back(prep);
    }
    // Insert after parts stops growing: the tree keeps pointers to the index slots.
    for (size_t i = 0; ok && i < l->parts.size(); ++i)
      GEOSSTRtree_insert_r(ctx, l->tree, l->parts[i], reinterpret_cast<void*>(i));
    GEOSGeom_destroy_r(ctx, u);
    return ok;
  }

  GEOSGeometry* ring(const std::vector<std::array<double, 2>>& pts) const {
    GEOSCoordSequence* seq = GEOSCoordSeq_create_r(ctx, static_cast<unsigned>(pts.size()), 2);
    if (!seq) return nullptr;
    for (unsigned i = 0; i < pts.size(); ++i) GEOSCoordSeq_setXY_r(ctx, seq, i, pts[i][0], pts[i][1]);
    return GEOSGeom_createLinearRing_r(ctx, seq);  // takes seq
  }

  GEOSGeometry* box(double x0, double y0, double x1, double y1) const {
    return ring_polygon({{{x0, y0}, {x1, y0}, {x1, y1}, {x0, y1}, {x0, y0}}});
  }

  GEOSGeometry* ring_polygon(const std::vector<std::vector<std::array<double, 2>>>& rings) const {
    GEOSGeometry* shell = ring(rings[0]);
    if (!shell) return nullptr;
    std::vector<GEOSGeometry*> holes;
    for (size_t i = 1; i < rings.size(); ++i) {
      GEOSGeometry* h = ring(rings[i]);
      if (!h) {
        GEOSGeom_destroy_r(ctx, shell);
        for (auto* x : holes) GEOSGeom_destroy_r(ctx, x);
        return nullptr;
      }
      holes.push_back(h);
    }
    return GEOSGeom_createPolygon_r(ctx, shell, holes.data(), static_cast<unsigned>(holes.size()));
  }

  // Area of the layer inside the tile square: the parts are disjoint, so their areas add.
  double covered_area(const Layer& l, const GEOSGeometry* tile, double tile_area) const {
    struct Query { const Impl* self; const Layer* layer; const GEOSGeometry* tile; double tile_area; double area; };
    Query q{this, &l, tile, tile_area, 0};
    GEOSSTRtree_query_r(
        ctx, l.tree, tile,
        [](void* item, void* data) {
          auto* q = static_cast<Query*>(data);
          const size_t i = reinterpret_cast<size_t>(item);
          GEOSContextHandle_t c = q->self->ctx;
          if (GEOSPreparedIntersects_r(c, q->layer->prepared[i], q->tile) != 1) return;
          if (GEOSPreparedContains_r(c, q->layer->prepared[i], q->tile) == 1) {
            q->area += q->tile_area;
            return;
          }
          GEOSGeometry* inter = GEOSIntersection_r(c, q->layer->parts[i], q->tile);
          if (!inter) return;
          double a = 0;
          if (GEOSArea_r(c, inter, &a) == 1) q->area += a;
          GEOSGeom_destroy_r(c, inter);
        },
        &q);
    return std::min(q.area, tile_area);
  }
};

AnnotationIndex::AnnotationIndex(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AnnotationIndex::~AnnotationIndex() = default;
const std::vector<std::string>& AnnotationIndex::classes() const { return impl_->classes; }
size_t AnnotationIndex::pieces() const {
  size_t n = impl_->all.parts.size();
  for (const Layer& l : impl_->by_class) n += l.parts.size();
  return n;
}

Result<std::unique_ptr<AnnotationIndex>> AnnotationIndex::build(const Annotations& a, int64_t width_l0,
                                                                int64_t height_l0) {
  auto impl = std::make_unique<Impl>();
  impl->ctx = GEOS_init_r();
  if (!impl->ctx) return slide::core::internal_error("GEOS_init_r failed");
  GEOSContext_setNoticeHandler_r(impl->ctx, geos_message);
  GEOSContext_setErrorHandler_r(impl->ctx, geos_message);
  GEOSContextHandle_t ctx = impl->ctx;
  impl->classes = a.classes;

  std::vector<GEOSGeometry*> all_parts;
  std::vector<std::vector<GEOSGeometry*>> class_parts(a.classes.size());
  auto cleanup = [&] {
    for (auto* g : all_parts) GEOSGeom_destroy_r(ctx, g);
    for (auto& v : class_parts) for (auto* g : v) GEOSGeom_destroy_r(ctx, g);
  };
  for (size_t i = 0; i < a.polygons.size(); ++i) {
    const AnnotationPolygon& p = a.polygons[i];
    for (const auto& r : p.rings)
      for (const auto& pt : r)
        if (pt[0] < 0 || pt[1] < 0 || pt[0] > static_cast<double>(width_l0) || pt[1] > static_cast<double>(height_l0)) {
          cleanup();
          char buf[160];
          std::snprintf(buf, sizeof buf, "polygon %zu: coordinate (%g, %g) is outside the slide (%lld x %lld level-0 px)",
                        i, pt[0], pt[1], static_cast<long long>(width_l0), static_cast<long long>(height_l0));
          return bad(a.source, buf);
        }
    GEOSGeometry* g = impl->ring_polygon(p.rings);
    if (!g) {
      cleanup();
      return bad(a.source, "polygon " + std::to_string(i) + ": GEOS could not build it");
    }
    if (GEOSisValid_r(ctx, g) != 1) {
      char* reason = GEOSisValidReason_r(ctx, g);
      std::string why = reason ? reason : "invalid";
      if (reason) GEOSFree_r(ctx, reason);
      GEOSGeom_destroy_r(ctx, g);
      cleanup();
      return bad(a.source, "polygon " + std::to_string(i) + " (class '" + p.class_name + "') is not valid: " + why);
    }
    for (size_t c = 0; c < a.classes.size(); ++c)
      if (a.classes[c] == p.class_name) class_parts[c].push_back(GEOSGeom_clone_r(ctx, g));
    all_parts.push_back(g);
  }
  // Unions: overlapping polygons of one class count once; GEOSGeom_createCollection_r takes the parts.
  auto unite = [&](std::vector<GEOSGeometry*>& parts) -> GEOSGeometry* {
    GEOSGeometry* coll = GEOSGeom_createCollection_r(ctx, GEOS_GEOMETRYCOLLECTION, parts.data(),
                                                     static_cast<unsigned>(parts.size()));
    parts.clear();
    if (!coll) return nullptr;
    GEOSGeometry* u = GEOSUnaryUnion_r(ctx, coll);
    GEOSGeom_destroy_r(ctx, coll);
    return u;
  };
  GEOSGeometry* u = unite(all_parts);
  if (!u || !impl->make_layer(u, &impl->all)) {
    cleanup();
    return slide::core::internal_error(a.source + ": GEOS union failed");
  }
  impl->by_class.resize(class_parts.size());
  for (size_t c = 0; c < class_parts.size(); ++c) {
    GEOSGeometry* cu = unite(class_parts[c]);
    if (!cu || !impl->make_layer(cu, &impl->by_class[c])) {
      cleanup();
      return slide::core::internal_error(a.source + ": GEOS union failed");
    }
  }
  return std::unique_ptr<AnnotationIndex>(new AnnotationIndex(std::move(impl)));
}

TileCoverage AnnotationIndex::cover(int64_t x_l0, int64_t y_l0, int64_t side_l0, double min_label_overlap) const {
  TileCoverage out;
  const Impl& m = *impl_;
  const double x0 = static_cast<double>(x_l0), y0 = static_cast<double>(y_l0);
  const double s = static_cast<double>(side_l0);
  const double tile_area = s * s;
  if (tile_area <= 0) return out;
  GEOSGeometry* tile = m.box(x0, y0, x0 + s, y0 + s);
  if (!tile) return out;
  out.roi_fraction = m.covered_area(m.all, tile, tile_area) / tile_area;
  if (out.roi_fraction > 0) {
    double best = -1;
    for (size_t c = 0; c < m.by_class.size(); ++c) {
      double f = m.covered_area(m.by_class[c], tile, tile_area) / tile_area;
      // A class must cover some of the tile, even at min_label_overlap 0 (a tile touched only by a
      // class-less ROI polygon is unlabelled); strict: equal areas keep the class listed first.
      if (f > 0 && f >= min_label_overlap && f > best) {
        best = f;
        out.label = static_cast<int>(c);
        out.label_fraction = f;
      }
    }
  }
  GEOSGeom_destroy_r(m.ctx, tile);
  return out;
}

}  // namespace slide::tile
