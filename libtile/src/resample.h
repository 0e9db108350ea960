// Private to libtile: the area-resampling kernel behind resample_area (image.cpp), shared with the
// banded thumbnail builder (tissue.cpp), which needs separate x and y scales and works on a band
// of source rows at a time.
#pragma once

#include <cstdint>
#include <vector>

#include "slide/tile/image.h"

namespace slide::tile::detail {

struct AreaTap {
  int64_t index = 0;  // source pixel, clamped to [0, src_size)
  double weight = 0;  // overlap / scale; a destination pixel's weights sum to 1
};

// Taps of destination pixels begin .. begin + count - 1 along one axis: pixel i covers source
// [origin + i * scale, origin + (i + 1) * scale). (*tap_begin)[i - begin] .. [i - begin + 1] index
// the returned taps of pixel i. Source indices are non-decreasing.
std::vector<AreaTap> area_taps(double origin, double scale, int64_t begin, int64_t count, int64_t src_size,
                               std::vector<int64_t>* tap_begin);

// Fills destination rows [dst_row_begin, dst_row_end) of `dst` (already sized). `src` holds source
// rows [src_y0, src_y0 + src.height) of a source src_full_height rows tall, and must contain every
// row those destination rows' taps need. Destination pixel (i, j) covers source
// [x0 + i * scale_x, ...) x [y0 + j * scale_y, ...) in full-source coordinates.
void resample_area_xy(const RgbImage& src, int64_t src_y0, double x0, double y0, double scale_x, double scale_y,
                      int64_t src_full_height, RgbImage* dst, int64_t dst_row_begin, int64_t dst_row_end);

}  // namespace slide::tile::detail
