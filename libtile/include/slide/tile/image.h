// In-memory RGB images, JPEG (libjpeg-turbo's TurboJPEG API), PNG (libpng) and TIFF (libtiff)
// codecs for single images, and area resampling.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "slide/core/status.h"

namespace slide::tile {

using slide::core::Result;
using slide::core::Status;

// Interleaved 8-bit RGB, row-major, no padding: pixels.size() == 3 * width * height.
struct RgbImage {
  int64_t width = 0;
  int64_t height = 0;
  std::vector<uint8_t> pixels;

  RgbImage() = default;
  RgbImage(int64_t w, int64_t h, uint8_t fill = 0) : width(w), height(h), pixels(static_cast<size_t>(3 * w * h), fill) {}
  uint8_t* row(int64_t y) { return pixels.data() + 3 * width * y; }
  const uint8_t* row(int64_t y) const { return pixels.data() + 3 * width * y; }
};

// Encodes RGB (3 * width * height bytes) as a baseline JPEG, 4:2:0 chroma subsampling, quality
// 1..100 (libjpeg's scale). Deterministic: same input, same bytes. Thread-safe (one TurboJPEG
// handle per thread). Errors: kInvalidArgument (quality or size out of range), kInternal.
[[nodiscard]] Result<std::vector<uint8_t>> encode_jpeg(const uint8_t* rgb, int64_t width, int64_t height, int quality);

// Decodes a JPEG stream to RGB. Errors: kDataLoss with libjpeg-turbo's message (corrupt data).
[[nodiscard]] Result<RgbImage> decode_jpeg(std::span<const uint8_t> jpeg);

// Checks that a JPEG stream decodes cleanly, without keeping the pixels: its header says
// expect_width x expect_height px, and its entropy-coded data decodes with no error and no
// warning (libjpeg's "Corrupt JPEG data: ..." and "Premature end of JPEG file" are warnings that
// would otherwise yield a grey-padded or garbled image with success). Decodes at 1/8 scale into a
// per-thread scratch buffer: every coefficient is still entropy-decoded, the IDCT is DC-only.
// Thread-safe. Errors: kDataLoss "JPEG check: <libjpeg-turbo's message>" or the size mismatch.
[[nodiscard]] Status validate_jpeg(std::span<const uint8_t> jpeg, int64_t expect_width, int64_t expect_height);

// Encodes RGB as an 8-bit PNG. Errors: kInternal.
[[nodiscard]] Result<std::vector<uint8_t>> encode_png(const RgbImage& image);

// Decodes a PNG stream (any bit depth or colour type; alpha composited onto white) to RGB.
// Errors: kDataLoss.
[[nodiscard]] Result<RgbImage> decode_png(std::span<const uint8_t> png);

// Reads a single image file by extension: .jpg/.jpeg, .png, .tif/.tiff (first directory, through
// TIFFReadRGBAImage; alpha composited onto white). Errors, naming the path: kNotFound,
// kInvalidArgument (unknown extension), kDataLoss (corrupt).
[[nodiscard]] Result<RgbImage> read_image_file(const std::string& path);

// The width and height of the image file `path` (read_image_file's formats) from its header only:
// TurboJPEG's header parse, PNG's IHDR chunk, libtiff's tags. Errors: as read_image_file's (the
// file, the extension, a header that is not its format's, naming the file).
struct ImageSize {
  int64_t width = 0, height = 0;
};
[[nodiscard]] Result<ImageSize> read_image_size(const std::string& path);

// Area (box) resampling, the same as OpenCV's INTER_AREA: each destination pixel is the mean of
// the source area it covers, with fractional weights at the edges. The destination pixel (i, j)
// covers source x in [x0 + i * scale, x0 + (i + 1) * scale) (and likewise y), where x0, y0 are
// relative to `src`'s top-left; scale >= 1 is source px per destination px. Source pixels past
// src's edges are clamped to the edge. When scale == 1 and x0, y0 are integers this is a copy.
void resample_area(const RgbImage& src, double x0, double y0, double scale, RgbImage* dst);

}  // namespace slide::tile
