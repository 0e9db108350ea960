// Tissue detection on a slide thumbnail, in the manner of CLAM (Lu et al., 2021, "Data-efficient
// and weakly supervised computational pathology on whole-slide images", segmentTissue): HSV
// saturation, median filter, Otsu threshold (Otsu, 1979), morphological close, then removal of
// small tissue objects and small holes.
//
// Memory: the thumbnail is built by reading the slide in bands of rows from the finest level that
// is not finer than needed, each band box-downsampled into the thumbnail: memory is bounded by the
// thumbnail plus one band, whatever the slide size. A whole level is never materialised.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "slide/core/status.h"
#include "slide/core/thread_pool.h"
#include "slide/tile/image.h"
#include "slide/tile/slide.h"

namespace slide::tile {

// What the slide is imaged in: brightfield (H&E, IHC: stained tissue on white glass; the mask is
// thresholded on saturation) or fluorescence (bright tissue on a dark background: thresholded on
// brightness, max(R, G, B)); auto decides per slide from the thumbnail (looks_like_fluorescence).
enum class TissueStain { kAuto, kBrightfield, kFluorescence };

struct TissueOptions {
  TissueStain stain = TissueStain::kAuto;
  int threshold = -1;                // on saturation (brightfield) or brightness (fluorescence), 0..255; -1: Otsu
  double thumbnail_mpp_um = 8.0;     // thumbnail resolution when the slide's mpp is known
  int64_t max_thumbnail_px = 4096;   // cap on the thumbnail's longer side (coarser if needed)
  int64_t fallback_thumbnail_px = 2048;  // longer side when the slide's mpp is unknown
  int median_px = 7;                 // median filter size, odd, thumbnail px
  int close_px = 5;                  // square structuring element of the close, thumbnail px
  double min_object_um2 = 20000;     // tissue components smaller than this are dropped (needs mpp)
  double min_hole_um2 = 20000;       // holes smaller than this are filled (needs mpp)
  double min_object_fraction = 0.0005;  // the same bounds as fractions of the thumbnail area, used when mpp is unknown
};

struct TissueMask {
  RgbImage thumbnail;          // RGB thumbnail
  std::vector<uint8_t> mask;   // thumbnail.width * thumbnail.height, 1 = tissue, 0 = background
  double downsample_x = 1;     // level-0 px per thumbnail px
  double downsample_y = 1;
  int otsu_threshold = 0;      // the threshold used (Otsu's or the option's), 0..255
  bool fluorescence = false;   // thresholded on brightness (fluorescence), else on saturation
  // What the size filters removed (thumbnail px): tissue objects below the minimum area dropped,
  // holes below the minimum hole area filled.
  int64_t objects_removed = 0, objects_removed_px = 0, holes_filled = 0, holes_filled_px = 0;

  int64_t width() const { return thumbnail.width; }
  int64_t height() const { return thumbnail.height; }
  // Fraction of the whole thumbnail that is tissue, 0..1.
  double tissue_fraction() const;
  // Fraction of tissue in the level-0 rectangle [x_l0, x_l0 + w_l0) x [y_l0, y_l0 + h_l0),
  // weighting thumbnail pixels by their overlap with the rectangle; 0..1. Areas outside the
  // slide count as background.
  double fraction_in(double x_l0, double y_l0, double w_l0, double h_l0) const;
};

// Builds a thumbnail of `slide` whose level-0 downsample is at least `downsample` (box filter,
// bounded memory as above). With a pool, bands are read on its threads and this one (memory:
// one band per thread); the result does not depend on it. The pool must not be running tasks
// that wait on this call. Errors: those of SlideReader::read_level_region (which name the slide)
// with the band as context; kResourceExhausted naming the slide when the thumbnail or one band
// of level pixels (3 * level width * (ceil(level rows per thumbnail row) + 1) bytes at least)
// would exceed 1 GiB (a forged or corrupt header), or when an allocation fails.
[[nodiscard]] Result<RgbImage> make_thumbnail(const SlideReader& slide, double downsample, double* actual_downsample_x,
                                              double* actual_downsample_y, core::ThreadPool* pool = nullptr);

// Thumbnail + mask. mpp_um is the level-0 resolution (0 if unknown: the thumbnail size and the
// object-size bounds then follow the fallback fields). `pool` as in make_thumbnail (it also
// splits the median filter). Errors: those of make_thumbnail.
[[nodiscard]] Result<TissueMask> detect_tissue(const SlideReader& slide, double mpp_um, const TissueOptions& options,
                                               core::ThreadPool* pool = nullptr);

// The mask computation alone on a given thumbnail (for tests and patch images); `um2_per_px` is
// the area of one thumbnail pixel in µm² (0 if unknown).
TissueMask detect_tissue_in_thumbnail(RgbImage thumbnail, double downsample_x, double downsample_y, double um2_per_px,
                                      const TissueOptions& options, core::ThreadPool* pool = nullptr);

// --stain auto's rule: true when the thumbnail's median grey level ((R + G + B) / 3, 0..255) is
// below 60 (a dark background: fluorescence; brightfield glass is near white).
bool looks_like_fluorescence(const RgbImage& thumbnail);

// The options that decide the mask, as one line for the store's record (StoreMeta::tissue_options):
// "stain=auto threshold=otsu median_px=7 close_px=5 min_object_um2=20000 min_hole_um2=20000".
std::string tissue_options_text(const TissueOptions& options);

// Otsu's threshold of a 256-bin histogram: the t maximising the between-class variance of
// {v <= t} and {v > t}. Returns 0 for an empty or constant histogram.
int otsu_threshold(const std::vector<int64_t>& histogram);

// Fluorescence's brightness on a log scale, 0..255: round(255 ln(1 + v) / ln(256)); Otsu's
// threshold is found on this scale. brightness_linear_threshold(t): the largest v whose log level
// is t or less, so that v > brightness_linear_threshold(t) exactly when brightness_log_level(v) > t
// (the split found on the log scale, applied to linear values); -1 when none is.
uint8_t brightness_log_level(uint8_t v);
int brightness_linear_threshold(int t);

}  // namespace slide::tile
