// The ceiling for slide-tile's re-encoding path: decode source JPEG tiles of a slide's level and
// encode them again with libjpeg-turbo, on N threads, with nothing else (no tissue mask, no
// store). Which tiles matters (blank glass decodes and encodes several times faster than
// tissue): with --store, exactly the tiles a slide-tile store kept (their level-0 x, y over the
// source tile size; the store must come from this slide at its level-0 resolution and the source
// tile size); else every tile of the level in row-major order, up to --max-tiles.
// Prints: tiles=N seconds=S tiles_per_s=R
//
// usage: jpeg_limit SLIDE [--threads N] [--quality Q] [--level L] [--max-tiles M] [--store STORE]
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "slide/tile/image.h"
#include "slide/tile/slide.h"
#include "slide/tile/store.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: jpeg_limit SLIDE [--threads N] [--quality Q] [--level L] [--max-tiles M] [--store STORE]\n");
    return 2;
  }
  std::string path = argv[1];
  int threads = 2, quality = 90, level = 0;
  long long max_tiles = 0;
  std::string store;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--quality")) quality = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--level")) level = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--max-tiles")) max_tiles = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--store")) store = argv[i + 1];
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
  std::vector<std::pair<long long, long long>> tiles;  // (col, row)
  if (!store.empty()) {
    auto reader = slide::tile::StoreReader::open(store);
    if (!reader.ok()) {
      std::fprintf(stderr, "%s\n", reader.status().to_string().c_str());
      return 1;
    }
    slide::tile::TileHeader h;
    std::vector<uint8_t> payload;
    for (uint64_t i = 0; i < (*reader)->tile_count(); ++i) {
      if (auto st = (*reader)->read_tile(i, &h, &payload); !st.ok()) {
        std::fprintf(stderr, "%s\n", st.to_string().c_str());
        return 1;
      }
      const double d = lv.downsample;
      tiles.emplace_back(static_cast<long long>(h.x_l0 / d) / lv.tile_width, static_cast<long long>(h.y_l0 / d) / lv.tile_height);
    }
  } else {
    for (long long i = 0; i < cols * rows; ++i) tiles.emplace_back(i % cols, i / cols);
  }
  long long total = static_cast<long long>(tiles.size());
  if (max_tiles > 0 && max_tiles < total) total = max_tiles;
  std::atomic<long long> next{0}, done{0};
  std::atomic<bool> failed{false};
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (long long i; (i = next.fetch_add(1)) < total;) {
        auto raw = (*slide)->read_raw_jpeg_tile(level, tiles[static_cast<size_t>(i)].first, tiles[static_cast<size_t>(i)].second);
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
