// Limits the slide readers (openslide_reader.cpp, tiff_reader.cpp) put on what a file declares.
#pragma once

#include <cstdint>

namespace slide::tile::detail {

// Level-0 coordinates beyond this are certainly not a slide's and would risk int64 overflow in
// the readers' region arithmetic (x + w, x * downsample).
inline constexpr int64_t kMaxCoordinate = int64_t{1} << 48;

}  // namespace slide::tile::detail
