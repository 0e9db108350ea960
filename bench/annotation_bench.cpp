// Annotation coverage (libtile/src/annotations.cpp): AnnotationIndex::cover on every tile of a
// 100,000 x 100,000 px level 0, under one wavy outline (a circle of radius 40,000 px whose radius
// varies by 5 % over 37 waves: a QuPath-like tumour boundary) of V vertices. Prints the index's
// build time, the coverage time of all tiles, and how many tiles the boundary crosses (those that
// need an intersection; the others are answered by prepared containment tests).
//
//   annotation_bench [vertices=100000] [tile_px=256]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "slide/tile/annotations.h"

int main(int argc, char** argv) {
  using clock = std::chrono::steady_clock;
  const int vertices = argc > 1 ? std::atoi(argv[1]) : 100000;
  const int64_t side = argc > 2 ? std::atoll(argv[2]) : 256;
  const int64_t extent = 100000;
  if (vertices < 3 || side < 1) {
    std::fprintf(stderr, "usage: annotation_bench [vertices >= 3] [tile_px >= 1]\n");
    return 2;
  }
  slide::tile::Annotations a;
  a.source = "annotation_bench";
  a.classes = {"tumor"};
  slide::tile::AnnotationPolygon p;
  p.class_name = "tumor";
  std::vector<std::array<double, 2>> ring;
  for (int i = 0; i < vertices; ++i) {
    const double t = 2 * M_PI * i / vertices, r = 40000 * (1 + 0.05 * std::sin(37 * t));
    ring.push_back({50000 + r * std::cos(t), 50000 + r * std::sin(t)});
  }
  ring.push_back(ring.front());
  p.rings.push_back(ring);
  a.polygons.push_back(p);
  const auto t0 = clock::now();
  auto index = slide::tile::AnnotationIndex::build(a, extent, extent);
  if (!index.ok()) {
    std::fprintf(stderr, "%s\n", index.status().to_string().c_str());
    return 1;
  }
  const auto t1 = clock::now();
  int64_t tiles = 0, boundary = 0, labelled = 0;
  double covered = 0;
  for (int64_t y = 0; y + side <= extent; y += side)
    for (int64_t x = 0; x + side <= extent; x += side) {
      const slide::tile::TileCoverage c = (*index)->cover(x, y, side, 0.5);
      ++tiles;
      boundary += c.roi_fraction > 0 && c.roi_fraction < 1;
      labelled += c.label >= 0;
      covered += c.roi_fraction;
    }
  const auto t2 = clock::now();
  std::printf("vertices=%d tile_px=%lld tiles=%lld boundary_tiles=%lld labelled=%lld covered_tiles=%.3f "
              "build_s=%.3f cover_s=%.3f\n",
              vertices, static_cast<long long>(side), static_cast<long long>(tiles), static_cast<long long>(boundary),
              static_cast<long long>(labelled), covered, std::chrono::duration<double>(t1 - t0).count(),
              std::chrono::duration<double>(t2 - t1).count());
  return 0;
}
