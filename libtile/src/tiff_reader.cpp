// libtiff fallback reader for plain TIFFs that OpenSlide does not recognise (stripped or untiled
// RGB such as kidney-48-5.tif), and the libtiff handle shared with the OpenSlide reader.
//
// Pixels come from libtiff's RGBA interface (TIFFReadRGBAStripExt / TIFFReadRGBATileExt), which
// handles every photometric and compression libtiff knows. One strip or tile is decoded at a time
// and the last one is cached, so memory is bounded by one decode unit (a single-strip image is
// decoded whole: that strip is the image).
#include "tiff_reader.h"
#include "reader_limits.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <tiffio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace slide::tile::detail {

namespace {

// A decode unit (strip or tile) larger than this is refused rather than allocated: a corrupt or
// hostile header must not become a multi-gigabyte allocation (2^28 px = 1 GiB of RGBA).
constexpr int64_t kMaxUnitPixels = int64_t{1} << 28;


int tiff_error_handler(TIFF*, void* user, const char* module, const char* fmt, va_list ap) {
  char text[512];
  std::vsnprintf(text, sizeof text, fmt, ap);
  auto* file = static_cast<TiffFile*>(user);
  if (file != nullptr) {
    // libtiff passes the file name as the module of open errors; the Status names the path already.
    const bool useful_module = module != nullptr && module[0] != '\0' && file->path() != module;
    file->record_error(useful_module ? std::string(module) + ": " + text : std::string(text));
  }
  // 1: stop here, so libtiff does not also call the process-wide handler (which prints).
  return 1;
}

int tiff_warning_handler(TIFF*, void*, const char*, const char*, va_list) { return 1; }

struct TiffOptionsDeleter {
  void operator()(TIFFOpenOptions* o) const { TIFFOpenOptionsFree(o); }
};

}  // namespace

TiffFile::~TiffFile() {
  if (tif_ != nullptr) TIFFClose(tif_);
}

void TiffFile::record_error(std::string message) {
  if (first_error_.empty()) first_error_ = std::move(message);
}

std::string TiffFile::take_error() { return std::exchange(first_error_, std::string()); }

std::string TiffFile::error_message(std::string_view prefix) {
  std::string err = take_error();
  std::string out(prefix);
  if (!err.empty()) out += ": " + err;
  return out;
}

Result<std::unique_ptr<TiffFile>> TiffFile::open(const std::string& path) {
  // Opening the descriptor ourselves gives errno for the Status; libtiff gets it through
  // TIFFFdOpenExt and closes it in TIFFClose.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return core::errno_status(errno, path);
  std::unique_ptr<TiffFile> file(new (std::nothrow) TiffFile());
  if (file == nullptr) {
    ::close(fd);
    return core::resource_exhausted(path + ": out of memory");
  }
  file->path_ = path;
  std::unique_ptr<TIFFOpenOptions, TiffOptionsDeleter> opts(TIFFOpenOptionsAlloc());
  if (opts == nullptr) {
    ::close(fd);
    return core::resource_exhausted(path + ": TIFFOpenOptionsAlloc failed");
  }
  // The handlers are per handle (libtiff >= 4.5), so other users of libtiff in the process keep
  // theirs; the TiffFile is heap-allocated, so the user pointer stays valid.
  TIFFOpenOptionsSetErrorHandlerExtR(opts.get(), tiff_error_handler, file.get());
  TIFFOpenOptionsSetWarningHandlerExtR(opts.get(), tiff_warning_handler, nullptr);
  // "m": no memory mapping; a file truncated while mapped would raise SIGBUS instead of an error.
  file->tif_ = TIFFFdOpenExt(fd, path.c_str(), "rm", opts.get());
  if (file->tif_ == nullptr) {
    ::close(fd);
    return core::invalid_argument(file->error_message(path + ": not a TIFF"));
  }
  return file;
}

double mpp_from_tiff_resolution(double px_per_unit, std::string_view unit) {
  if (!(px_per_unit > 0)) return 0;
  double mpp = 0;
  if (unit == "inch") {
    mpp = 25400.0 / px_per_unit;
  } else if (unit == "centimeter") {
    mpp = 10000.0 / px_per_unit;
  } else {
    return 0;
  }
  return mpp <= 50.0 ? mpp : 0;
}

namespace {

class TiffSlideReader final : public SlideReader {
 public:
  TiffSlideReader(std::unique_ptr<TiffFile> file, SlideProperties props, bool tiled, int64_t unit_w, int64_t unit_h)
      : file_(std::move(file)), props_(std::move(props)), tiled_(tiled), unit_w_(unit_w), unit_h_(unit_h) {}

  const SlideProperties& properties() const override { return props_; }

  Status read_region(int64_t x_l0, int64_t y_l0, int level, int64_t w, int64_t h, uint8_t* rgb) const override;

 private:
  // Decodes strip/tile (ux, uy) into raster_ unless it is the cached one. Requires mutex_.
  Status load_unit(int64_t ux, int64_t uy) const;

  const std::unique_ptr<TiffFile> file_;
  const SlideProperties props_;
  const bool tiled_;
  const int64_t unit_w_;  // tile width, or the image width for strips
  const int64_t unit_h_;  // tile height, or rows per strip

  // libtiff handles are not thread-safe: every use of file_ and the cache is under mutex_.
  mutable std::mutex mutex_;
  mutable int64_t cached_unit_ = -1;
  mutable int64_t raster_rows_ = 0;  // rows in raster_ (a short last strip has fewer)
  mutable std::unique_ptr<uint32_t[]> raster_;  // unit_w_ x unit_h_ ABGR, bottom-up
};

Status TiffSlideReader::load_unit(int64_t ux, int64_t uy) const {
  const int64_t units_across = tiled_ ? (props_.levels[0].width + unit_w_ - 1) / unit_w_ : 1;
  const int64_t index = uy * units_across + ux;
  if (index == cached_unit_) return core::ok_status();
  cached_unit_ = -1;
  const size_t pixels = static_cast<size_t>(unit_w_ * unit_h_);
  if (raster_ == nullptr) {
    // Allocated on first use (nothrow: an allocation failure is a Status, not an exception).
    raster_.reset(new (std::nothrow) uint32_t[pixels]);
    if (raster_ == nullptr) return core::resource_exhausted(file_->path() + ": out of memory for a TIFF strip/tile");
  }
  TIFF* tif = file_->get();
  file_->take_error();
  const auto x = static_cast<uint32_t>(ux * unit_w_);
  const auto y = static_cast<uint32_t>(uy * unit_h_);
  // stop_on_error=1: the plain TIFFReadRGBA* calls carry on past a corrupt strip and return
  // garbage with success.
  const int ok = tiled_ ? TIFFReadRGBATileExt(tif, x, y, raster_.get(), 1)
                        : TIFFReadRGBAStripExt(tif, y, raster_.get(), 1);
  std::string err = file_->take_error();
  if (ok != 1 || !err.empty()) {
    const std::string where = std::string(tiled_ ? "tile" : "strip") + " at (x=" + std::to_string(x) +
                              ", y=" + std::to_string(y) + ")";
    return core::data_loss(file_->path() + ": " + where + (err.empty() ? ": libtiff decode failed" : ": " + err));
  }
  // TIFFReadRGBATile lays a partial edge tile out as a full one; TIFFReadRGBAStrip packs a short
  // last strip into its first rows. Both are bottom-up.
  raster_rows_ = tiled_ ? unit_h_ : std::min(unit_h_, props_.levels[0].height - y);
  cached_unit_ = index;
  return core::ok_status();
}

Status TiffSlideReader::read_region(int64_t x_l0, int64_t y_l0, int level, int64_t w, int64_t h,
                                    uint8_t* rgb) const {
  if (w <= 0 || h <= 0 || w > kMaxCoordinate / 4 || h > kMaxCoordinate / 4)
    return core::invalid_argument("read_region: bad size " + std::to_string(w) + "x" + std::to_string(h));
  const size_t out_bytes = static_cast<size_t>(3 * w * h);
  if (level != 0) {
    std::memset(rgb, 0, out_bytes);
    return core::invalid_argument("read_region: level " + std::to_string(level) + " out of range (1 level)");
  }
  if (x_l0 < -kMaxCoordinate || x_l0 > kMaxCoordinate || y_l0 < -kMaxCoordinate || y_l0 > kMaxCoordinate) {
    std::memset(rgb, 0, out_bytes);
    return core::invalid_argument("read_region: coordinates out of range");
  }
  std::memset(rgb, 255, out_bytes);  // outside the image reads white
  const int64_t width = props_.levels[0].width;
  const int64_t height = props_.levels[0].height;
  const int64_t x0 = std::max<int64_t>(x_l0, 0), x1 = std::min(x_l0 + w, width);
  const int64_t y0 = std::max<int64_t>(y_l0, 0), y1 = std::min(y_l0 + h, height);
  if (x0 >= x1 || y0 >= y1) return core::ok_status();

  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t uy = y0 / unit_h_; uy * unit_h_ < y1; ++uy) {
    for (int64_t ux = x0 / unit_w_; ux * unit_w_ < x1; ++ux) {
      Status s = load_unit(ux, uy);
      if (!s.ok()) {
        std::memset(rgb, 0, out_bytes);
        return s;
      }
      const int64_t ux0 = ux * unit_w_, uy0 = uy * unit_h_;
      const int64_t cx0 = std::max(x0, ux0), cx1 = std::min(x1, ux0 + unit_w_);
      const int64_t cy0 = std::max(y0, uy0), cy1 = std::min(y1, uy0 + unit_h_);
      for (int64_t y = cy0; y < cy1; ++y) {
        const uint32_t* src = raster_.get() + (raster_rows_ - 1 - (y - uy0)) * unit_w_ + (cx0 - ux0);
        uint8_t* dst = rgb + 3 * ((y - y_l0) * w + (cx0 - x_l0));
        for (int64_t x = cx0; x < cx1; ++x, ++src, dst += 3) {
          // libtiff's RGBA interface premultiplies alpha, so compositing onto white is c + (255 - a).
          const uint32_t p = *src;
          const uint32_t inv_a = 255 - TIFFGetA(p);
          dst[0] = static_cast<uint8_t>(std::min<uint32_t>(255, TIFFGetR(p) + inv_a));
          dst[1] = static_cast<uint8_t>(std::min<uint32_t>(255, TIFFGetG(p) + inv_a));
          dst[2] = static_cast<uint8_t>(std::min<uint32_t>(255, TIFFGetB(p) + inv_a));
        }
      }
    }
  }
  return core::ok_status();
}

std::string resolution_unit_name(uint16_t unit) {
  switch (unit) {
    case RESUNIT_INCH: return "inch";
    case RESUNIT_CENTIMETER: return "centimeter";
    default: return "none";
  }
}

}  // namespace

Result<std::unique_ptr<SlideReader>> open_tiff_reader(const std::string& path) {
  SLIDE_ASSIGN_OR_RETURN(std::unique_ptr<TiffFile> file, TiffFile::open(path));
  TIFF* tif = file->get();
  uint32_t width = 0, height = 0;
  uint16_t bits = 0;
  TIFFGetField(tif, TIFFTAG_IMAGEWIDTH, &width);
  TIFFGetField(tif, TIFFTAG_IMAGELENGTH, &height);
  TIFFGetFieldDefaulted(tif, TIFFTAG_BITSPERSAMPLE, &bits);
  if (width == 0 || height == 0) return core::invalid_argument(path + ": TIFF has no image size");
  if (bits != 8) return core::invalid_argument(path + ": TIFF has " + std::to_string(bits) + " bits per sample, not 8");
  char why[1024] = {0};
  if (TIFFRGBAImageOK(tif, why) != 1)
    return core::invalid_argument(path + ": libtiff cannot read it as RGB: " + why);

  const bool tiled = TIFFIsTiled(tif) != 0;
  int64_t unit_w = width, unit_h = height;
  if (tiled) {
    uint32_t tw = 0, th = 0;
    TIFFGetField(tif, TIFFTAG_TILEWIDTH, &tw);
    TIFFGetField(tif, TIFFTAG_TILELENGTH, &th);
    if (tw == 0 || th == 0) return core::invalid_argument(path + ": tiled TIFF without a tile size");
    unit_w = tw;
    unit_h = th;
  } else {
    uint32_t rows_per_strip = 0;
    // Default 2^32-1 (TIFF 6.0): the whole image is one strip.
    TIFFGetFieldDefaulted(tif, TIFFTAG_ROWSPERSTRIP, &rows_per_strip);
    unit_h = std::clamp<int64_t>(rows_per_strip, 1, height);
  }
  if (unit_w * unit_h > kMaxUnitPixels)
    return core::resource_exhausted(path + ": a TIFF " + (tiled ? "tile" : "strip") + " of " + std::to_string(unit_w) +
                                    "x" + std::to_string(unit_h) + " px is too large to decode");

  SlideProperties props;
  props.path = path;
  props.vendor = "tiff";
  props.backend = "libtiff";
  SlideLevel level;
  level.width = width;
  level.height = height;
  level.downsample = 1;
  level.tile_width = tiled ? unit_w : 0;
  level.tile_height = tiled ? unit_h : 0;
  props.levels.push_back(level);

  float xres = 0, yres = 0;
  uint16_t unit = RESUNIT_NONE;
  const bool has_x = TIFFGetField(tif, TIFFTAG_XRESOLUTION, &xres) == 1;
  const bool has_y = TIFFGetField(tif, TIFFTAG_YRESOLUTION, &yres) == 1;
  // The TIFF 6.0 default unit is inch; with the usual 72 dpi that is far above 50 µm/px anyway.
  TIFFGetFieldDefaulted(tif, TIFFTAG_RESOLUTIONUNIT, &unit);
  if (has_x) {
    const std::string unit_name = resolution_unit_name(unit);
    const double mpp_x = mpp_from_tiff_resolution(xres, unit_name);
    const double mpp_y = mpp_from_tiff_resolution(has_y ? yres : xres, unit_name);
    if (mpp_x > 0 && mpp_y > 0) {
      props.mpp_x_um = mpp_x;
      props.mpp_y_um = mpp_y;
      props.mpp_source = "tiff-resolution";
    }
  }
  file->take_error();
  std::unique_ptr<SlideReader> reader(
      new (std::nothrow) TiffSlideReader(std::move(file), std::move(props), tiled, unit_w, unit_h));
  if (reader == nullptr) return core::resource_exhausted(path + ": out of memory");
  return reader;
}

}  // namespace slide::tile::detail
