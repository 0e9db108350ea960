// Private to libtile: libtiff helpers shared by the OpenSlide reader (pass-through of source JPEG
// tiles) and the libtiff fallback reader.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "slide/core/status.h"
#include "slide/tile/slide.h"

struct tiff;  // libtiff's TIFF (tiffio.h: typedef struct tiff TIFF), kept out of this header

namespace slide::tile::detail {

// A TIFF opened read-only with its own error and warning handlers: libtiff never prints or aborts,
// and the first error message since the last take_error() is kept for the Status. Not
// thread-safe (libtiff handles are not): the owner serialises every use.
class TiffFile {
 public:
  ~TiffFile();
  TiffFile(const TiffFile&) = delete;
  TiffFile& operator=(const TiffFile&) = delete;

  // Errors: kNotFound / kPermissionDenied (errno of open(2)), kInvalidArgument (libtiff does not
  // read the file as a TIFF; the message carries libtiff's words). Messages name the path.
  [[nodiscard]] static Result<std::unique_ptr<TiffFile>> open(const std::string& path);

  ::tiff* get() const { return tif_; }
  const std::string& path() const { return path_; }
  // libtiff's first error since the last call ("" if none), cleared.
  std::string take_error();
  // "<prefix>: <libtiff's error>" or "<prefix>" when libtiff said nothing.
  std::string error_message(std::string_view prefix);

  // Called by the libtiff error handler; public only for it.
  void record_error(std::string message);

 private:
  TiffFile() = default;

  ::tiff* tif_ = nullptr;
  std::string path_;
  std::string first_error_;
};

// µm/px from a TIFF resolution (px per `unit`, OpenSlide's tiff.ResolutionUnit spelling "inch" or
// "centimeter"); 0 when the unit is anything else ("none"), the resolution is not positive, or the
// result is coarser than 50 µm/px (the 72 dpi default = 352 µm/px is not a microscope's).
double mpp_from_tiff_resolution(double px_per_unit, std::string_view unit);

// The libtiff fallback reader (vendor "tiff", backend "libtiff") for a TIFF whose first directory
// libtiff's RGBA interface reads at 8 bits per sample. Errors: kNotFound, kPermissionDenied,
// kInvalidArgument (not such a TIFF; the message says why), kResourceExhausted.
[[nodiscard]] Result<std::unique_ptr<SlideReader>> open_tiff_reader(const std::string& path);

}  // namespace slide::tile::detail
