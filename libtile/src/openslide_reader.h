// Private to libtile: the OpenSlide-backed SlideReader.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "slide/core/status.h"
#include "slide/tile/slide.h"

namespace slide::tile::detail {

// Opens `path`, which openslide_detect_vendor() recognised as `vendor`. For TIFF-based vendors
// ("aperio", "generic-tiff") the file is also opened with libtiff to find JPEG levels whose
// source tiles can be passed through. Errors: kDataLoss "<path>: <OpenSlide's error>",
// kResourceExhausted.
[[nodiscard]] Result<std::unique_ptr<SlideReader>> open_openslide_reader(const std::string& path,
                                                                         const std::string& vendor);

// Makes an abbreviated TIFF JPEG stream standalone: `tables` (the JPEGTables tag: SOI, DQT/DHT
// segments, EOI; may be empty) merged into `tile` (SOI, SOF, SOS, entropy-coded data, EOI) as
// SOI + tables' segments + tile's segments. `rgb` adds an Adobe APP14 marker with transform 0
// after SOI (Adobe Technical Note #5116), which tells decoders the components are RGB rather than
// YCbCr. Errors: kDataLoss (either stream does not start with SOI).
[[nodiscard]] Result<std::vector<uint8_t>> merge_jpeg_tables(std::span<const uint8_t> tables,
                                                             std::span<const uint8_t> tile, bool rgb);

}  // namespace slide::tile::detail
