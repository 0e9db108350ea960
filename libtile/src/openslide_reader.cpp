// OpenSlide-backed SlideReader, with pass-through of source JPEG tiles for TIFF-based formats.
//
// Pixels: openslide_read_region (premultiplied ARGB, thread-safe on one handle) composited onto
// white. OpenSlide's first error sticks to the handle (openslide.h: openslide_get_error), so a
// slide that failed once fails every later read; that is its documented behaviour.
//
// Pass-through: for "aperio" and "generic-tiff" each OpenSlide level is a tiled TIFF directory.
// Its tile offsets, byte counts and JPEGTables are read once with libtiff at open; tiles are then
// read with pread(2), which needs no lock (a libtiff handle would need one). A level is declared
// pass-through only after a tile near its centre, merged into a standalone JPEG and decoded with
// TurboJPEG, matches OpenSlide's read_region of the same area.
//
// Direct decode: when that check finds TurboJPEG's pixels *identical* to OpenSlide's, regions of
// the level at whole level-pixel positions are assembled from TurboJPEG-decoded source tiles
// instead of openslide_read_region (which decodes through libjpeg into ARGB and composites with
// cairo/pixman: about 4x the CPU per tile). Same pixels, so the choice is invisible in the store.
// Regions at fractional level positions (OpenSlide interpolates those) and any read the direct
// path cannot do (a missing or corrupt source tile) go through OpenSlide.
#include "openslide_reader.h"

#include <fcntl.h>
#include <openslide.h>
#include <tiffio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <utility>

#include "reader_limits.h"
#include "slide/core/log.h"
#include "slide/tile/image.h"
#include "tiff_reader.h"

namespace slide::tile::detail {

namespace {

// A compressed source tile larger than this is a corrupt byte count, not a tile.
constexpr uint64_t kMaxRawTileBytes = uint64_t{64} << 20;
// Self-check tolerance between TurboJPEG's decode of a merged tile and OpenSlide's pixels: both
// run libjpeg-turbo's integer DCT, but OpenSlide may decode through libtiff with different
// upsampling or colour conversion, so allow rounding-level differences and reject anything that
// looks like a wrong colour space or wrong tile (which differ by tens of levels on average).
constexpr double kMaxMeanAbsDiff = 1.0;
constexpr int kMaxAbsDiff = 16;

struct OpenslideCloser {
  void operator()(openslide_t* osr) const { openslide_close(osr); }
};
using OpenslideHandle = std::unique_ptr<openslide_t, OpenslideCloser>;

class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  ~UniqueFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

std::optional<double> property_double(openslide_t* osr, const std::string& name) {
  const char* v = openslide_get_property_value(osr, name.c_str());
  if (v == nullptr) return std::nullopt;
  // OpenSlide formats numbers with g_ascii_dtostr: locale-independent, which from_chars is too.
  double d = 0;
  const char* end = v + std::strlen(v);
  auto [ptr, ec] = std::from_chars(v, end, d);
  if (ec != std::errc() || ptr != end || !std::isfinite(d)) return std::nullopt;
  return d;
}

// Where a level's source tiles lie in the file, for pass-through.
struct RawLevel {
  bool candidate = false;  // tiled JPEG directory matching the level; still needs the self-check
  bool rgb = false;        // PHOTOMETRIC_RGB: the JPEG holds RGB, not YCbCr
  int64_t tiles_across = 0;
  int64_t tiles_down = 0;
  std::vector<uint64_t> offsets;      // per tile, row-major (TIFF 6.0 section 15)
  std::vector<uint64_t> byte_counts;  // per tile
  std::vector<uint8_t> tables;        // JPEGTables tag, empty if absent
  std::vector<uint8_t> head;          // merge_jpeg_tables(tables, SOI): what precedes each tile's body
};

class OpenSlideReader final : public SlideReader {
 public:
  OpenSlideReader(OpenslideHandle osr, SlideProperties props, std::vector<RawLevel> raw, UniqueFd fd)
      : osr_(std::move(osr)),
        props_(std::move(props)),
        raw_(std::move(raw)),
        fd_(std::move(fd)),
        checked_(new std::atomic<int8_t>[props_.levels.size()]) {
    for (size_t i = 0; i < props_.levels.size(); ++i) checked_[i].store(-1);
  }

  // Pixels of [x_l0, +w) x [y_l0, +h) at `level`, as read_region, through OpenSlide.
  Status openslide_region(int64_t x_l0, int64_t y_l0, int level, int64_t w, int64_t h, uint8_t* rgb) const;
  // The same from TurboJPEG-decoded source tiles; level pixel origin (lx, ly). Only for levels
  // whose check found identical pixels. Errors: those of reading or decoding a source tile.
  Status direct_region(int64_t lx, int64_t ly, int level, int64_t w, int64_t h, uint8_t* rgb) const;

  const SlideProperties& properties() const override { return props_; }
  Status read_region(int64_t x_l0, int64_t y_l0, int level, int64_t w, int64_t h, uint8_t* rgb) const override;
  Status read_level_region(int level, int64_t lx, int64_t ly, int64_t w, int64_t h, uint8_t* rgb) const override;
  bool has_raw_jpeg_tiles(int level) const override;
  Result<std::vector<uint8_t>> read_raw_jpeg_tile(int level, int64_t col, int64_t row) const override;

 private:
  // The merged JPEG of a candidate level's tile, without the self-check.
  Result<std::vector<uint8_t>> read_merged_tile(int level, int64_t col, int64_t row) const;
  // Decodes a tile near the centre of `level` and compares it with OpenSlide's read_region; OK
  // when they agree within rounding, and *identical set when they agree exactly.
  Status self_check(int level, bool* identical) const;
  // 1 or 2 as in checked_ (running the check on first use), else 0.
  int8_t raw_state(int level) const;

  const OpenslideHandle osr_;
  const SlideProperties props_;
  const std::vector<RawLevel> raw_;
  const UniqueFd fd_;  // the slide file, for pread of source tiles

  // Per level: -1 not yet checked, 0 failed, 1 passed (pass-through), 2 passed with identical
  // pixels (pass-through and direct decode). Atomic so that the per-tile calls take no lock once a
  // level is checked; check_mutex_ runs each check once.
  mutable std::mutex check_mutex_;
  const std::unique_ptr<std::atomic<int8_t>[]> checked_;
};

Status OpenSlideReader::read_region(int64_t x_l0, int64_t y_l0, int level, int64_t w, int64_t h,
                                    uint8_t* rgb) const {
  if (w > 0 && h > 0 && level >= 0 && level < static_cast<int>(props_.levels.size()) &&
      raw_[static_cast<size_t>(level)].candidate && raw_state(level) == 2) {
    // OpenSlide maps level-0 coordinates to level pixels as x_l0 / downsample (openslide.h);
    // only whole level pixels are read directly.
    const double d = props_.levels[static_cast<size_t>(level)].downsample;
    const double lx = static_cast<double>(x_l0) / d, ly = static_cast<double>(y_l0) / d;
    if (lx == std::floor(lx) && ly == std::floor(ly) && std::abs(lx) < 1e15 && std::abs(ly) < 1e15 &&
        direct_region(static_cast<int64_t>(lx), static_cast<int64_t>(ly), level, w, h, rgb).ok())
      return core::ok_status();
    // Anything the direct path cannot do (a missing source tile, say) OpenSlide handles or reports.
  }
  return openslide_region(x_l0, y_l0, level, w, h, rgb);
}

Status OpenSlideReader::read_level_region(int level, int64_t lx, int64_t ly, int64_t w, int64_t h,
                                          uint8_t* rgb) const {
  if (w > 0 && h > 0 && level >= 0 && level < static_cast<int>(props_.levels.size()) &&
      raw_[static_cast<size_t>(level)].candidate && raw_state(level) == 2 &&
      direct_region(lx, ly, level, w, h, rgb).ok())
    return core::ok_status();
  return SlideReader::read_level_region(level, lx, ly, w, h, rgb);
}

Status OpenSlideReader::direct_region(int64_t lx, int64_t ly, int level, int64_t w, int64_t h, uint8_t* rgb) const {
  const SlideLevel& lv = props_.levels[static_cast<size_t>(level)];
  const RawLevel& rl = raw_[static_cast<size_t>(level)];
  const int64_t tw = lv.tile_width, th = lv.tile_height;
  if (tw < 1 || th < 1 || w > kMaxCoordinate / 4 || h > kMaxCoordinate / 4)
    return core::invalid_argument("direct read: bad size");
  // Outside the level is white, as OpenSlide's transparent pixels composited onto white.
  std::memset(rgb, 255, static_cast<size_t>(3 * w * h));
  const int64_t x0 = std::max<int64_t>(lx, 0), y0 = std::max<int64_t>(ly, 0);
  const int64_t x1 = std::min(lx + w, lv.width), y1 = std::min(ly + h, lv.height);
  if (x0 >= x1 || y0 >= y1) return core::ok_status();
  for (int64_t row = y0 / th; row <= (y1 - 1) / th; ++row) {
    for (int64_t col = x0 / tw; col <= (x1 - 1) / tw; ++col) {
      if (col >= rl.tiles_across || row >= rl.tiles_down) return core::out_of_range("direct read: tile outside the grid");
      SLIDE_ASSIGN_OR_RETURN(std::vector<uint8_t> jpeg, read_merged_tile(level, col, row));
      SLIDE_ASSIGN_OR_RETURN(RgbImage tile, decode_jpeg(jpeg));
      if (tile.width != tw || tile.height != th) return core::data_loss("direct read: source tile size");
      // The part of this tile inside both the level and the region, in level pixels.
      const int64_t cx0 = std::max(x0, col * tw), cx1 = std::min(x1, (col + 1) * tw);
      const int64_t cy0 = std::max(y0, row * th), cy1 = std::min(y1, (row + 1) * th);
      for (int64_t y = cy0; y < cy1; ++y)
        std::memcpy(rgb + 3 * ((y - ly) * w + (cx0 - lx)), tile.pixels.data() + 3 * ((y - row * th) * tw + (cx0 - col * tw)),
                    static_cast<size_t>(3 * (cx1 - cx0)));
    }
  }
  return core::ok_status();
}

Status OpenSlideReader::openslide_region(int64_t x_l0, int64_t y_l0, int level, int64_t w, int64_t h,
                                         uint8_t* rgb) const {
  if (w <= 0 || h <= 0 || w > kMaxCoordinate / 4 || h > kMaxCoordinate / 4)
    return core::invalid_argument("read_region: bad size " + std::to_string(w) + "x" + std::to_string(h));
  const size_t pixels = static_cast<size_t>(w * h);
  if (level < 0 || level >= static_cast<int>(props_.levels.size())) {
    std::memset(rgb, 0, 3 * pixels);
    return core::invalid_argument("read_region: level " + std::to_string(level) + " out of range (" +
                                  std::to_string(props_.levels.size()) + " levels)");
  }
  if (x_l0 < -kMaxCoordinate || x_l0 > kMaxCoordinate || y_l0 < -kMaxCoordinate || y_l0 > kMaxCoordinate) {
    std::memset(rgb, 0, 3 * pixels);
    return core::invalid_argument("read_region: coordinates out of range");
  }
  // Only the region is allocated (nothrow: an allocation failure is a Status, not an exception).
  std::unique_ptr<uint32_t[]> argb(new (std::nothrow) uint32_t[pixels]);
  if (argb == nullptr) {
    std::memset(rgb, 0, 3 * pixels);
    return core::resource_exhausted(props_.path + ": no memory for a " + std::to_string(w) + "x" +
                                    std::to_string(h) + " region");
  }
  openslide_read_region(osr_.get(), argb.get(), x_l0, y_l0, level, w, h);
  if (const char* err = openslide_get_error(osr_.get()); err != nullptr) {
    std::memset(rgb, 0, 3 * pixels);
    return core::data_loss(props_.path + ": " + err);
  }
  for (size_t i = 0; i < pixels; ++i) {
    const uint32_t p = argb[i];
    // Premultiplied ARGB over white: c + (255 - a) never exceeds 255 for valid premultiplied data;
    // the min guards against a decoder that breaks that.
    const uint32_t inv_a = 255 - (p >> 24);
    rgb[3 * i + 0] = static_cast<uint8_t>(std::min<uint32_t>(255, ((p >> 16) & 0xff) + inv_a));
    rgb[3 * i + 1] = static_cast<uint8_t>(std::min<uint32_t>(255, ((p >> 8) & 0xff) + inv_a));
    rgb[3 * i + 2] = static_cast<uint8_t>(std::min<uint32_t>(255, (p & 0xff) + inv_a));
  }
  return core::ok_status();
}

Result<std::vector<uint8_t>> OpenSlideReader::read_merged_tile(int level, int64_t col, int64_t row) const {
  const RawLevel& rl = raw_[static_cast<size_t>(level)];
  const size_t index = static_cast<size_t>(row * rl.tiles_across + col);
  const uint64_t offset = rl.offsets[index];
  const uint64_t count = rl.byte_counts[index];
  auto where = [&] {
    return props_.path + ": source tile (level=" + std::to_string(level) + ", col=" + std::to_string(col) +
           ", row=" + std::to_string(row) + ")";
  };
  if (count < 2 || count > kMaxRawTileBytes)
    return core::data_loss(where() + ": implausible byte count " + std::to_string(count));
  // The level's stream head (SOI, APP14, tables) then the tile without its own SOI: the tile is
  // read straight into place, over the head's last two bytes, which are put back after checking
  // that what landed there is the tile's SOI.
  const size_t head = rl.head.size();
  std::vector<uint8_t> out(head - 2 + count);
  size_t done = 0;
  while (done < count) {
    const ssize_t n = ::pread(fd_.get(), out.data() + head - 2 + done, count - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return core::data_loss(where() + ": read: " + std::strerror(errno));
    }
    if (n == 0) return core::data_loss(where() + ": file ends inside the tile");
    done += static_cast<size_t>(n);
  }
  if (out[head - 2] != 0xFF || out[head - 1] != 0xD8) return core::data_loss(where() + ": JPEG tile does not start with SOI");
  std::memcpy(out.data(), rl.head.data(), head);
  return out;
}

Status OpenSlideReader::self_check(int level, bool* identical) const {
  *identical = false;
  const RawLevel& rl = raw_[static_cast<size_t>(level)];
  const SlideLevel& lv = props_.levels[static_cast<size_t>(level)];
  if (rl.tiles_across < 1 || rl.tiles_down < 1) return core::failed_precondition("level has no tiles");
  // A tile near the centre: more likely tissue than a corner, whose flat background would agree
  // under almost any decoder. But OpenSlide reads at level-0 coordinates and interpolates when
  // x_l0 / downsample is not a whole level pixel, which at a non-integral downsample (4.0013, say)
  // is true of nearly every tile but the first; then tile (0, 0) it is.
  auto whole = [&](int64_t level_px) {
    const double l0 = static_cast<double>(std::llround(static_cast<double>(level_px) * lv.downsample));
    return l0 / lv.downsample == static_cast<double>(level_px);
  };
  int64_t col = rl.tiles_across / 2, row = rl.tiles_down / 2;
  if (!whole(col * lv.tile_width) || !whole(row * lv.tile_height)) col = row = 0;
  SLIDE_ASSIGN_OR_RETURN(std::vector<uint8_t> jpeg, read_merged_tile(level, col, row));

  SLIDE_ASSIGN_OR_RETURN_CTX(RgbImage tile, decode_jpeg(jpeg), "merged tile");
  const int64_t jw = tile.width, jh = tile.height;
  if (jw != lv.tile_width || jh != lv.tile_height)
    return core::data_loss("merged tile is " + std::to_string(jw) + "x" + std::to_string(jh) + ", TIFF says " +
                           std::to_string(lv.tile_width) + "x" + std::to_string(lv.tile_height));
  const std::vector<uint8_t>& decoded = tile.pixels;

  // Edge padding is not part of the level: compare only what lies inside it. The level-0
  // position is a whole multiple of the downsample only at integral downsamples; elsewhere
  // OpenSlide interpolates a sub-pixel shift and the comparison (rightly) fails or is inexact.
  const int64_t lx = col * jw, ly = row * jh;
  const int64_t cw = std::min<int64_t>(jw, lv.width - lx);
  const int64_t ch = std::min<int64_t>(jh, lv.height - ly);
  std::vector<uint8_t> region(static_cast<size_t>(3 * cw * ch));
  SLIDE_RETURN_IF_ERROR(openslide_region(std::llround(static_cast<double>(lx) * lv.downsample),
                                         std::llround(static_cast<double>(ly) * lv.downsample), level, cw, ch,
                                         region.data()));
  int64_t sum = 0;
  int max_diff = 0;
  for (int64_t y = 0; y < ch; ++y) {
    for (int64_t i = 0; i < 3 * cw; ++i) {
      const int d = std::abs(int{decoded[static_cast<size_t>(y * 3 * jw + i)]} -
                             int{region[static_cast<size_t>(y * 3 * cw + i)]});
      sum += d;
      max_diff = std::max(max_diff, d);
    }
  }
  const double mean = static_cast<double>(sum) / static_cast<double>(3 * cw * ch);
  if (mean >= kMaxMeanAbsDiff || max_diff >= kMaxAbsDiff)
    return core::data_loss("merged tile differs from read_region: mean |diff| " + std::to_string(mean) +
                           ", max " + std::to_string(max_diff));
  *identical = max_diff == 0;
  return core::ok_status();
}

int8_t OpenSlideReader::raw_state(int level) const {
  std::atomic<int8_t>& state = checked_[static_cast<size_t>(level)];
  const int8_t known = state.load(std::memory_order_acquire);
  if (known >= 0) return known;
  std::lock_guard<std::mutex> lock(check_mutex_);
  if (state.load(std::memory_order_acquire) < 0) {
    bool identical = false;
    Status s = self_check(level, &identical);
    if (!s.ok())
      core::log_debug("JPEG pass-through off for a level",
                      {{"slide", props_.path}, {"level", level}, {"why", s.to_string()}});
    else
      core::log_debug(identical ? "JPEG pass-through and direct decode on for a level" : "JPEG pass-through on for a level",
                      {{"slide", props_.path}, {"level", level}});
    state.store(!s.ok() ? 0 : identical ? 2 : 1, std::memory_order_release);
  }
  return state.load(std::memory_order_acquire);
}

bool OpenSlideReader::has_raw_jpeg_tiles(int level) const {
  if (level < 0 || level >= static_cast<int>(raw_.size()) || !raw_[static_cast<size_t>(level)].candidate)
    return false;
  return raw_state(level) >= 1;
}

Result<std::vector<uint8_t>> OpenSlideReader::read_raw_jpeg_tile(int level, int64_t col, int64_t row) const {
  if (!has_raw_jpeg_tiles(level))
    return core::unimplemented(props_.path + ": level " + std::to_string(level) +
                               " has no pass-through JPEG tiles");
  const RawLevel& rl = raw_[static_cast<size_t>(level)];
  if (col < 0 || row < 0 || col >= rl.tiles_across || row >= rl.tiles_down)
    return core::out_of_range(props_.path + ": no tile (col=" + std::to_string(col) + ", row=" +
                              std::to_string(row) + ") in level " + std::to_string(level) + " (" +
                              std::to_string(rl.tiles_across) + "x" + std::to_string(rl.tiles_down) + " tiles)");
  return read_merged_tile(level, col, row);
}

// Finds each level's TIFF directory and records where its JPEG tiles are. Any surprise leaves the
// level without pass-through (read_region still works), so nothing here is an error.
std::vector<RawLevel> find_raw_levels(const std::string& path, const std::vector<SlideLevel>& levels) {
  std::vector<RawLevel> raw(levels.size());
  auto file = TiffFile::open(path);
  if (!file.ok()) {
    core::log_debug("no JPEG pass-through: libtiff cannot open the slide",
                    {{"slide", path}, {"why", file.status().to_string()}});
    return raw;
  }
  TIFF* tif = (*file)->get();
  std::vector<bool> used_level(levels.size(), false);
  // Aperio's thumbnail, label and macro images are stripped, and a tiled directory must match a
  // level's size and tile size, so only true pyramid levels are taken.
  for (tdir_t dir = 0;; ++dir) {
    if (dir > 0 && TIFFReadDirectory(tif) != 1) break;
    if (TIFFIsTiled(tif) == 0) continue;
    uint32_t w = 0, h = 0, tw = 0, th = 0;
    uint16_t compression = 0, photometric = 0, spp = 0, bps = 0, planar = PLANARCONFIG_CONTIG;
    TIFFGetField(tif, TIFFTAG_IMAGEWIDTH, &w);
    TIFFGetField(tif, TIFFTAG_IMAGELENGTH, &h);
    TIFFGetField(tif, TIFFTAG_TILEWIDTH, &tw);
    TIFFGetField(tif, TIFFTAG_TILELENGTH, &th);
    TIFFGetFieldDefaulted(tif, TIFFTAG_COMPRESSION, &compression);
    TIFFGetField(tif, TIFFTAG_PHOTOMETRIC, &photometric);
    TIFFGetFieldDefaulted(tif, TIFFTAG_SAMPLESPERPIXEL, &spp);
    TIFFGetFieldDefaulted(tif, TIFFTAG_BITSPERSAMPLE, &bps);
    TIFFGetFieldDefaulted(tif, TIFFTAG_PLANARCONFIG, &planar);
    size_t level = levels.size();
    for (size_t i = 0; i < levels.size(); ++i) {
      if (!used_level[i] && levels[i].width == w && levels[i].height == h && levels[i].tile_width == tw &&
          levels[i].tile_height == th) {
        level = i;
        break;
      }
    }
    if (level == levels.size()) continue;
    used_level[level] = true;
    if (compression != COMPRESSION_JPEG || spp != 3 || bps != 8 || planar != PLANARCONFIG_CONTIG ||
        (photometric != PHOTOMETRIC_RGB && photometric != PHOTOMETRIC_YCBCR) || tw == 0 || th == 0)
      continue;
    RawLevel rl;
    rl.rgb = photometric == PHOTOMETRIC_RGB;
    rl.tiles_across = (int64_t{w} + tw - 1) / tw;
    rl.tiles_down = (int64_t{h} + th - 1) / th;
    const auto tiles = static_cast<size_t>(rl.tiles_across * rl.tiles_down);
    uint64_t* offsets = nullptr;
    uint64_t* counts = nullptr;
    if (TIFFGetField(tif, TIFFTAG_TILEOFFSETS, &offsets) != 1 ||
        TIFFGetField(tif, TIFFTAG_TILEBYTECOUNTS, &counts) != 1 || offsets == nullptr || counts == nullptr ||
        TIFFNumberOfTiles(tif) < tiles)
      continue;
    rl.offsets.assign(offsets, offsets + tiles);
    rl.byte_counts.assign(counts, counts + tiles);
    uint32_t table_bytes = 0;
    void* tables = nullptr;
    if (TIFFGetField(tif, TIFFTAG_JPEGTABLES, &table_bytes, &tables) == 1 && tables != nullptr) {
      const auto* p = static_cast<const uint8_t*>(tables);
      rl.tables.assign(p, p + table_bytes);
    }
    static constexpr uint8_t kSoi[] = {0xFF, 0xD8};
    auto head = merge_jpeg_tables(rl.tables, kSoi, rl.rgb);
    if (!head.ok()) continue;  // malformed JPEGTables: no pass-through for this level
    rl.head = std::move(*head);
    rl.candidate = true;
    raw[level] = std::move(rl);
  }
  return raw;
}

}  // namespace

Result<std::vector<uint8_t>> merge_jpeg_tables(std::span<const uint8_t> tables, std::span<const uint8_t> tile,
                                               bool rgb) {
  auto starts_with_soi = [](std::span<const uint8_t> s) { return s.size() >= 2 && s[0] == 0xFF && s[1] == 0xD8; };
  if (!starts_with_soi(tile)) return core::data_loss("JPEG tile does not start with SOI");
  if (!tables.empty() && !starts_with_soi(tables)) return core::data_loss("JPEGTables does not start with SOI");
  // Adobe APP14: length 14, "Adobe", version 100, flags0 0, flags1 0, transform 0 (no colour
  // transform: the components are RGB). libjpeg honours it over its YCbCr default.
  static constexpr uint8_t kAdobeRgb[] = {0xFF, 0xEE, 0x00, 0x0E, 'A', 'd', 'o', 'b', 'e',
                                          0x00, 0x64, 0x00, 0x00, 0x00, 0x00, 0x00};
  std::span<const uint8_t> table_segments = tables.empty() ? tables : tables.subspan(2);
  if (table_segments.size() >= 2 && table_segments[table_segments.size() - 2] == 0xFF &&
      table_segments.back() == 0xD9)
    table_segments = table_segments.first(table_segments.size() - 2);
  std::vector<uint8_t> out;
  out.reserve(2 + (rgb ? sizeof kAdobeRgb : 0) + table_segments.size() + tile.size() - 2);
  out.push_back(0xFF);
  out.push_back(0xD8);
  if (rgb) out.insert(out.end(), std::begin(kAdobeRgb), std::end(kAdobeRgb));
  out.insert(out.end(), table_segments.begin(), table_segments.end());
  out.insert(out.end(), tile.begin() + 2, tile.end());
  return out;
}

Result<std::unique_ptr<SlideReader>> open_openslide_reader(const std::string& path, const std::string& vendor) {
  OpenslideHandle osr(openslide_open(path.c_str()));
  if (osr == nullptr) return core::data_loss(path + ": OpenSlide detected " + vendor + " but cannot open it");
  if (const char* err = openslide_get_error(osr.get()); err != nullptr) return core::data_loss(path + ": " + err);

  SlideProperties props;
  props.path = path;
  props.vendor = vendor;
  props.backend = "openslide";
  const int32_t level_count = openslide_get_level_count(osr.get());
  if (level_count < 1) {
    const char* err = openslide_get_error(osr.get());
    return core::data_loss(path + ": " + (err != nullptr ? err : "OpenSlide reports no levels"));
  }
  for (int32_t i = 0; i < level_count; ++i) {
    SlideLevel lv;
    openslide_get_level_dimensions(osr.get(), i, &lv.width, &lv.height);
    lv.downsample = openslide_get_level_downsample(osr.get(), i);
    const std::string prefix = "openslide.level[" + std::to_string(i) + "].";
    lv.tile_width = static_cast<int64_t>(property_double(osr.get(), prefix + "tile-width").value_or(0));
    lv.tile_height = static_cast<int64_t>(property_double(osr.get(), prefix + "tile-height").value_or(0));
    if (lv.width < 1 || lv.height < 1 || !(lv.downsample > 0))
      return core::data_loss(path + ": level " + std::to_string(i) + " has no size");
    props.levels.push_back(lv);
  }

  const auto mpp_x = property_double(osr.get(), OPENSLIDE_PROPERTY_NAME_MPP_X);
  const auto mpp_y = property_double(osr.get(), OPENSLIDE_PROPERTY_NAME_MPP_Y);
  if (mpp_x && mpp_y && *mpp_x > 0 && *mpp_y > 0) {
    props.mpp_x_um = *mpp_x;
    props.mpp_y_um = *mpp_y;
    props.mpp_source = "vendor";
  } else if (const auto xres = property_double(osr.get(), "tiff.XResolution")) {
    const auto yres = property_double(osr.get(), "tiff.YResolution");
    const char* unit = openslide_get_property_value(osr.get(), "tiff.ResolutionUnit");
    // No ResolutionUnit tag means inch (TIFF 6.0 default).
    const std::string unit_name = unit != nullptr ? unit : "inch";
    const double mx = mpp_from_tiff_resolution(*xres, unit_name);
    const double my = mpp_from_tiff_resolution(yres.value_or(*xres), unit_name);
    if (mx > 0 && my > 0) {
      props.mpp_x_um = mx;
      props.mpp_y_um = my;
      props.mpp_source = "tiff-resolution";
    }
  }
  if (const auto power = property_double(osr.get(), OPENSLIDE_PROPERTY_NAME_OBJECTIVE_POWER); power && *power > 0)
    props.objective_power = *power;

  std::vector<RawLevel> raw(props.levels.size());
  UniqueFd fd;
  if (vendor == "aperio" || vendor == "generic-tiff") {
    raw = find_raw_levels(path, props.levels);
    if (std::any_of(raw.begin(), raw.end(), [](const RawLevel& r) { return r.candidate; })) {
      fd = UniqueFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
      if (fd.get() < 0) raw.assign(props.levels.size(), RawLevel{});
    }
  }
  std::unique_ptr<SlideReader> reader(
      new (std::nothrow) OpenSlideReader(std::move(osr), std::move(props), std::move(raw), std::move(fd)));
  if (reader == nullptr) return core::resource_exhausted(path + ": out of memory");
  return reader;
}

}  // namespace slide::tile::detail
