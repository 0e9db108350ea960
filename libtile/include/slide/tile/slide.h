// Whole-slide image readers: OpenSlide for every format it reads, libtiff for plain TIFFs that
// OpenSlide refuses (stripped or untiled RGB such as kidney-48-5.tif).
//
// Coordinate frames: `x_l0`/`y_l0` are level-0 pixels; sizes passed with a level are pixels of
// that level (OpenSlide's convention, openslide.h: openslide_read_region).
// Pixels: RGB, 8 bits per channel, row-major, interleaved, composited onto white. OpenSlide returns
// premultiplied ARGB; a pixel (a, r', g', b') becomes r = r' + (255 - a) etc. (compositing a
// premultiplied colour over white), so transparent areas outside the scanned region read white.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "slide/core/status.h"

namespace slide::tile {

using slide::core::Result;
using slide::core::Status;

struct SlideLevel {
  int64_t width = 0;      // px of this level
  int64_t height = 0;     // px of this level
  double downsample = 1;  // level-0 px per px of this level (OpenSlide's level downsample)
  int64_t tile_width = 0;   // source tile size in px of this level, 0 if unknown or untiled
  int64_t tile_height = 0;
};

struct SlideProperties {
  std::string path;
  std::string vendor;   // OpenSlide's vendor ("aperio", "hamamatsu", "generic-tiff", ...) or "tiff" (libtiff fallback)
  std::string backend;  // "openslide" or "libtiff"
  std::vector<SlideLevel> levels;  // level 0 first, downsample increasing
  // Level-0 resolution in µm/px; 0 when unknown. Taken from OpenSlide's openslide.mpp-x/-y, else
  // from the TIFF resolution tags (XResolution/YResolution with ResolutionUnit inch or cm; unit
  // "none" and values coarser than 50 µm/px, such as the 72 dpi default, count as unknown).
  double mpp_x_um = 0;
  double mpp_y_um = 0;
  std::string mpp_source;      // "vendor", "tiff-resolution" or "" (unknown)
  double objective_power = 0;  // openslide.objective-power, 0 when unknown
};

// A slide open for reading. All methods are thread-safe (OpenSlide handles are; the libtiff
// reader serialises decoding internally).
class SlideReader {
 public:
  virtual ~SlideReader() = default;

  virtual const SlideProperties& properties() const = 0;

  // Reads a w x h region of `level` whose top-left corner is (x_l0, y_l0) in level-0 pixels into
  // `rgb` (3 * w * h bytes, caller-owned). Pixels outside the slide read as white (255,255,255).
  // Errors: kInvalidArgument (level out of range, w or h <= 0), kDataLoss (the source's pixels
  // cannot be decoded; the message carries OpenSlide's or libtiff's words, e.g. "Bogus marker
  // length"). On error `rgb` is filled with zeros, never half-filled.
  [[nodiscard]] virtual Status read_region(int64_t x_l0, int64_t y_l0, int level, int64_t w, int64_t h,
                                           uint8_t* rgb) const = 0;

  // Reads a w x h region of `level` whose top-left corner is (lx, ly) in that level's own pixels.
  // read_region at (llround(lx * downsample), ...) names nearly the same pixels, but at a
  // non-integral downsample (4.0013) OpenSlide maps that back to a fractional level position and
  // interpolates; this reads the level's pixels as they are, which is what a thumbnail wants.
  // Errors as read_region. The default goes through read_region.
  [[nodiscard]] virtual Status read_level_region(int level, int64_t lx, int64_t ly, int64_t w, int64_t h,
                                                 uint8_t* rgb) const;

  // Pass-through support: true when `level` is a tiled TIFF directory with JPEG compression whose
  // source tiles (tile_width x tile_height px of that level, from TIFFTAG_TILEWIDTH/LENGTH) can be
  // copied as complete JPEG files (read_raw_jpeg_tile) that decode to the pixels read_region
  // returns for the same area.
  virtual bool has_raw_jpeg_tiles(int level) const { (void)level; return false; }

  // The compressed bytes of source tile (col, row) of `level` as a complete, standalone JPEG
  // stream (the abbreviated TIFF stream with the JPEGTables tag's quantisation and Huffman tables
  // merged in, and an Adobe APP14 marker when the TIFF says the JPEG holds RGB rather than YCbCr).
  // Errors: kUnimplemented (has_raw_jpeg_tiles(level) is false), kOutOfRange (no such tile),
  // kDataLoss (libtiff cannot read the tile).
  [[nodiscard]] virtual Result<std::vector<uint8_t>> read_raw_jpeg_tile(int level, int64_t col, int64_t row) const;
};

// OK when `path` (symlinks followed) is a regular file. Reading a FIFO would wait for a writer
// forever, and a device or socket is never a slide, so every reader checks this before it opens
// anything. Errors, naming the path: kInvalidArgument ("is a FIFO, not a slide ..."; likewise a
// directory, socket or device; and a symlink loop), else stat(2)'s errno (kNotFound,
// kPermissionDenied, ...).
[[nodiscard]] Status check_regular_file(const std::string& path);

// Opens a slide: OpenSlide first (every format it detects), then libtiff for TIFFs that OpenSlide
// does not recognise. Errors, each naming the path: kNotFound (no such file), kPermissionDenied,
// kInvalidArgument (neither OpenSlide nor libtiff recognises the file: "not a slide OpenSlide or
// libtiff can read"), kDataLoss (recognised but corrupt, e.g. OpenSlide's "Unsupported TIFF
// compression: 52479"). A path that is not a regular file (check_regular_file) is
// kInvalidArgument before anything opens it.
[[nodiscard]] Result<std::unique_ptr<SlideReader>> open_slide(const std::string& path);

}  // namespace slide::tile
