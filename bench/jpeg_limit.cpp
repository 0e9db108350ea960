// The ceiling for slide-tile's re-encoding path: decode every source JPEG tile of a slide's level
// and encode it again with libjpeg-turbo, on N threads, with nothing else (no tissue mask, no
// store). Prints: tiles=N seconds=S tiles_per_s=R
//
// usage: jpeg_limit SLIDE [--threads N] [--quality Q] [--level L] [--max-tiles M]
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "slide/tile/image.h"
#include "slide/tile/slide.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: jpeg_limit SLIDE [--threads N] [--quality Q] [--level L] [--max-tiles M]\n");
    return 2;
  }
  std::string path = argv[1];
  int threads = 2, quality = 90, level = 0;
  long long max_tiles = 0;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--quality")) quality = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--level")) level = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--max-tiles")) max_tiles = std::atoll(argv[i + 1]);
  }
  auto slide = slide::tile::open_slide(path);
  if (!slide.ok()) {
    std::fprintf(stderr, "%s\n", slide.status().to_string().c_str());
    return 1;
  }
  const auto& lv = (*slide)->properties().levels.at(static_cast<size_t>(level));
  if (!(*slide)->has_raw_jpeg_tiles(level) || lv.tile_width <= 0) {
    std::fprintf(stderr, "%s level %d has no raw JPEG tiles\n", path.c_str(), level);
    return 1;
  }
  const long long cols = lv.width / lv.tile_width, rows = lv.height / lv.tile_height;
  long long total = cols * rows;
  if (max_tiles > 0 && max_tiles < total) total = max_tiles;
  std::atomic<long long> next{0}, done{0};
  std::atomic<bool> failed{false};
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (long long i; (i = next.fetch_add(1)) < total;) {
        auto raw = (*slide)->read_raw_jpeg_tile(level, i % cols, i / cols);
        if (!raw.ok()) { failed = true; return; }
        auto img = slide::tile::decode_jpeg(*raw);
        if (!img.ok()) { failed = true; return; }
        auto enc = slide::tile::encode_jpeg(img->pixels.data(), img->width, img->height, quality);
        if (!enc.ok()) { failed = true; return; }
        done.fetch_add(1);
      }
    });
  }
  for (auto& t : pool) t.join();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (failed) {
    std::fprintf(stderr, "a tile failed to decode or encode\n");
    return 1;
  }
  std::printf("tiles=%lld seconds=%.2f tiles_per_s=%.1f\n", done.load(), secs, done.load() / secs);
  return 0;
}
