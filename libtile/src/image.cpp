// Single-image codecs (TurboJPEG, libpng, libtiff) and area resampling.
#include "slide/tile/image.h"

#include <fcntl.h>
#include <png.h>
#include <tiffio.h>
#include <turbojpeg.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csetjmp>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "slide/core/file.h"
#include "resample.h"

namespace slide::tile {

namespace {

// Decoded images larger than this are refused rather than allocated: a corrupt header must not
// turn into a multi-gigabyte allocation (2^28 px = 768 MiB of RGB).
constexpr int64_t kMaxDecodedPixels = int64_t{1} << 28;

// ---------------------------------------------------------------------------------------------
// JPEG. One compressor and one decompressor per thread: TurboJPEG handles are not thread-safe
// but are cheap to reuse, and creating one per call costs more than a small tile's encode.

struct TjDeleter {
  void operator()(void* handle) const {
    if (handle != nullptr) tjDestroy(handle);
  }
};
using TjHandle = std::unique_ptr<void, TjDeleter>;

// One TurboJPEG handle of each kind per thread. After an error the handle is replaced: TurboJPEG
// 2.1 can leave libjpeg mid-stream (tjDecompressHeader3 failing inside a marker), and the next
// image on that handle then fails with nonsense, so one corrupt file would poison the thread.
tjhandle thread_compressor(bool replace = false) {
  thread_local TjHandle handle(tjInitCompress());
  if (replace) handle.reset(tjInitCompress());
  return handle.get();
}

tjhandle thread_decompressor(bool replace = false) {
  thread_local TjHandle handle(tjInitDecompress());
  if (replace) handle.reset(tjInitDecompress());
  return handle.get();
}

struct TjBufferDeleter {
  void operator()(unsigned char* p) const { tjFree(p); }
};

}  // namespace

Result<std::vector<uint8_t>> encode_jpeg(const uint8_t* rgb, int64_t width, int64_t height, int quality) {
  if (quality < 1 || quality > 100)
    return core::invalid_argument("JPEG quality " + std::to_string(quality) + " is outside 1..100");
  // 65535 is the JPEG format's own limit on each dimension (ITU T.81, the SOF frame header).
  if (width < 1 || height < 1 || width > 65535 || height > 65535 || rgb == nullptr)
    return core::invalid_argument("JPEG size " + std::to_string(width) + "x" + std::to_string(height) +
                                  " is outside 1..65535 px");
  tjhandle tj = thread_compressor();
  if (tj == nullptr) return core::internal_error(std::string("tjInitCompress: ") + tjGetErrorStr2(nullptr));
  unsigned char* out = nullptr;
  unsigned long out_size = 0;
  // Default flags (no TJFLAG_FASTDCT, no progressive): the output depends only on the input,
  // quality and libjpeg-turbo's version, so the same tile always gives the same bytes.
  int rc = tjCompress2(tj, rgb, static_cast<int>(width), 0, static_cast<int>(height), TJPF_RGB, &out, &out_size,
                       TJSAMP_420, quality, 0);
  std::unique_ptr<unsigned char, TjBufferDeleter> owned(out);
  if (rc != 0) {
    Status s = core::internal_error(std::string("JPEG encode: ") + tjGetErrorStr2(tj));
    thread_compressor(true);
    return s;
  }
  return std::vector<uint8_t>(out, out + out_size);
}

Result<RgbImage> decode_jpeg(std::span<const uint8_t> jpeg) {
  tjhandle tj = thread_decompressor();
  if (tj == nullptr) return core::internal_error(std::string("tjInitDecompress: ") + tjGetErrorStr2(nullptr));
  if (jpeg.empty()) return core::data_loss("JPEG decode: empty stream");
  int width = 0, height = 0, subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(tj, jpeg.data(), static_cast<unsigned long>(jpeg.size()), &width, &height, &subsamp,
                          &colorspace) != 0) {
    Status s = core::data_loss(std::string("JPEG decode: ") + tjGetErrorStr2(tj));
    thread_decompressor(true);
    return s;
  }
  if (width < 1 || height < 1 || int64_t{width} * height > kMaxDecodedPixels)
    return core::data_loss("JPEG decode: implausible size " + std::to_string(width) + "x" + std::to_string(height));
  RgbImage img(width, height);
  // Warnings count as errors: libjpeg-turbo reports a truncated stream ("Premature end of JPEG
  // file") as a warning and pads the image with grey, which would be silent data loss.
  if (tjDecompress2(tj, jpeg.data(), static_cast<unsigned long>(jpeg.size()), img.pixels.data(), width, 0, height,
                    TJPF_RGB, 0) != 0) {
    Status s = core::data_loss(std::string("JPEG decode: ") + tjGetErrorStr2(tj));
    thread_decompressor(true);
    return s;
  }
  return img;
}

Status validate_jpeg(std::span<const uint8_t> jpeg, int64_t expect_width, int64_t expect_height) {
  tjhandle tj = thread_decompressor();
  if (tj == nullptr) return core::internal_error(std::string("tjInitDecompress: ") + tjGetErrorStr2(nullptr));
  if (jpeg.empty()) return core::data_loss("JPEG check: empty stream");
  int width = 0, height = 0, subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(tj, jpeg.data(), static_cast<unsigned long>(jpeg.size()), &width, &height, &subsamp,
                          &colorspace) != 0) {
    Status s = core::data_loss(std::string("JPEG check: ") + tjGetErrorStr2(tj));
    thread_decompressor(true);
    return s;
  }
  if (width != expect_width || height != expect_height)
    return core::data_loss("JPEG check: the stream is " + std::to_string(width) + "x" + std::to_string(height) +
                           " px, expected " + std::to_string(expect_width) + "x" + std::to_string(expect_height));
  // Decoding at 1/8 scale still entropy-decodes every coefficient of every block (Huffman codes
  // must be parsed to find the next block), so corrupt or truncated entropy-coded data is found,
  // while the IDCT and colour conversion shrink to the DC terms. TJFLAG_STOPONWARNING: libjpeg
  // reports "Corrupt JPEG data: ..." and "Premature end of JPEG file" as warnings.
  const int sw = (width + 7) / 8, sh = (height + 7) / 8;
  thread_local std::vector<uint8_t> scratch;
  scratch.resize(static_cast<size_t>(3) * static_cast<size_t>(sw) * static_cast<size_t>(sh));
  if (tjDecompress2(tj, jpeg.data(), static_cast<unsigned long>(jpeg.size()), scratch.data(), sw, 0, sh, TJPF_RGB,
                    TJFLAG_STOPONWARNING) != 0) {
    Status s = core::data_loss(std::string("JPEG check: ") + tjGetErrorStr2(tj));
    thread_decompressor(true);
    return s;
  }
  return core::ok_status();
}

// -----------------------------------------------------------------------------------------------
// PNG. libpng reports errors by longjmp from its error callback. Each setjmp lives in a function
// whose frame holds no C++ object with a destructor (jumping over one is undefined behaviour);
// the C++ state is reached through a pointer set up by the caller, and the message is copied
// into a plain char array.

namespace {

struct PngState {
  char message[256] = {0};
  // Encoder output / decoder input.
  std::vector<uint8_t>* out = nullptr;
  const uint8_t* in = nullptr;
  size_t in_size = 0;
  size_t in_pos = 0;
};

[[noreturn]] void png_error_fn(png_structp png, png_const_charp msg) {
  auto* st = static_cast<PngState*>(png_get_error_ptr(png));
  if (st != nullptr) std::snprintf(st->message, sizeof st->message, "%s", msg != nullptr ? msg : "unknown error");
  png_longjmp(png, 1);
}

void png_warning_fn(png_structp, png_const_charp) {}  // warnings (e.g. bad sRGB profiles) are not errors

void png_write_fn(png_structp png, png_bytep data, size_t length) {
  auto* st = static_cast<PngState*>(png_get_io_ptr(png));
  // push_back may throw bad_alloc; letting it cross libpng's C frames would be undefined, so
  // report it through libpng's own error path instead.
  try {
    st->out->insert(st->out->end(), data, data + length);
  } catch (...) {
    png_error(png, "out of memory");
  }
}

void png_read_fn(png_structp png, png_bytep data, size_t length) {
  auto* st = static_cast<PngState*>(png_get_io_ptr(png));
  if (st->in_size - st->in_pos < length) png_error(png, "truncated PNG stream");
  std::memcpy(data, st->in + st->in_pos, length);
  st->in_pos += length;
}

// Writes `rows` (height pointers to 3 * width bytes). Returns false on a libpng error.
bool png_encode_raw(png_structp png, png_infop info, png_bytepp rows, png_uint_32 width, png_uint_32 height) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_IHDR(png, info, width, height, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  // zlib level 3: PNG is the lossless tile format, so encode speed matters more than the last few
  // per cent of size (levels above 3 cost 2-3x the time for ~5% smaller files on H&E tiles).
  png_set_compression_level(png, 3);
  png_write_info(png, info);
  png_write_image(png, rows);
  png_write_end(png, nullptr);
  return true;
}

// Reads the header and sets up transforms to 8-bit RGBA. Returns false on a libpng error.
bool png_decode_header(png_structp png, png_infop info, png_uint_32* width, png_uint_32* height) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_info(png, info);
  int bit_depth = 0, color_type = 0;
  png_get_IHDR(png, info, width, height, &bit_depth, &color_type, nullptr, nullptr, nullptr);
  // Normalise every colour type and depth to 8-bit RGBA: palettes and low-depth grey expand,
  // tRNS becomes an alpha channel, 16-bit samples scale (rounding) to 8, grey replicates to RGB,
  // and images without alpha get an opaque one so that one compositing loop serves all.
  png_set_expand(png);
  png_set_scale_16(png);
  png_set_gray_to_rgb(png);
  png_set_add_alpha(png, 0xff, PNG_FILLER_AFTER);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  return true;
}

bool png_decode_rows(png_structp png, png_bytepp rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_image(png, rows);
  png_read_end(png, nullptr);
  return true;
}

// Composites a straight (not premultiplied) alpha onto white, rounding to nearest.
inline uint8_t over_white(uint32_t c, uint32_t a) { return static_cast<uint8_t>((c * a + 255 * (255 - a) + 127) / 255); }

}  // namespace

Result<std::vector<uint8_t>> encode_png(const RgbImage& image) {
  if (image.width < 1 || image.height < 1 || image.width > 0x7fffffff || image.height > 0x7fffffff ||
      image.pixels.size() != static_cast<size_t>(3 * image.width * image.height))
    return core::internal_error("PNG encode: invalid image " + std::to_string(image.width) + "x" +
                                std::to_string(image.height));
  PngState st;
  std::vector<uint8_t> out;
  out.reserve(image.pixels.size() / 2);
  st.out = &out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &st, png_error_fn, png_warning_fn);
  if (png == nullptr) return core::internal_error("PNG encode: png_create_write_struct failed");
  png_infop info = png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_write_struct(&png, nullptr);
    return core::internal_error("PNG encode: png_create_info_struct failed");
  }
  png_set_write_fn(png, &st, png_write_fn, nullptr);
  std::vector<png_bytep> rows(static_cast<size_t>(image.height));
  for (int64_t y = 0; y < image.height; ++y) rows[static_cast<size_t>(y)] = const_cast<png_bytep>(image.row(y));
  bool ok = png_encode_raw(png, info, rows.data(), static_cast<png_uint_32>(image.width),
                           static_cast<png_uint_32>(image.height));
  png_destroy_write_struct(&png, &info);
  if (!ok) return core::internal_error(std::string("PNG encode: ") + st.message);
  return out;
}

Result<RgbImage> decode_png(std::span<const uint8_t> bytes) {
  if (bytes.size() < 8 || png_sig_cmp(bytes.data(), 0, 8) != 0) return core::data_loss("PNG decode: not a PNG stream");
  PngState st;
  st.in = bytes.data();
  st.in_size = bytes.size();
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &st, png_error_fn, png_warning_fn);
  if (png == nullptr) return core::internal_error("PNG decode: png_create_read_struct failed");
  png_infop info = png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    return core::internal_error("PNG decode: png_create_info_struct failed");
  }
  // Let libpng refuse absurd headers before we allocate for them.
  png_set_user_limits(png, 0x7fffffff, 0x7fffffff);
  png_set_read_fn(png, &st, png_read_fn);
  png_uint_32 width = 0, height = 0;
  if (!png_decode_header(png, info, &width, &height)) {
    png_destroy_read_struct(&png, &info, nullptr);
    return core::data_loss(std::string("PNG decode: ") + st.message);
  }
  if (width < 1 || height < 1 || int64_t{width} * height > kMaxDecodedPixels || png_get_rowbytes(png, info) != 4 * size_t{width}) {
    png_destroy_read_struct(&png, &info, nullptr);
    return core::data_loss("PNG decode: implausible size " + std::to_string(width) + "x" + std::to_string(height));
  }
  std::vector<uint8_t> rgba(size_t{4} * width * height);
  std::vector<png_bytep> rows(height);
  for (png_uint_32 y = 0; y < height; ++y) rows[y] = rgba.data() + size_t{4} * width * y;
  bool ok = png_decode_rows(png, rows.data());
  png_destroy_read_struct(&png, &info, nullptr);
  if (!ok) return core::data_loss(std::string("PNG decode: ") + st.message);
  RgbImage img(width, height);
  const size_t n = size_t{width} * height;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* s = &rgba[4 * i];
    uint8_t* d = &img.pixels[3 * i];
    if (s[3] == 255) {
      d[0] = s[0], d[1] = s[1], d[2] = s[2];
    } else {
      d[0] = over_white(s[0], s[3]), d[1] = over_white(s[1], s[3]), d[2] = over_white(s[2], s[3]);
    }
  }
  return img;
}

// -----------------------------------------------------------------------------------------------
// TIFF (single images: Kather patches and the like).

namespace {

// libtiff's per-handle handlers (libtiff >= 4.5): the first error message is kept for the Status
// and nothing is printed. Returning 1 stops libtiff from also calling the process-wide handler,
// which other code may own.
struct TiffMessages {
  char first_error[256] = {0};
};

int tiff_error_handler(TIFF*, void* user, const char* module, const char* fmt, va_list ap) {
  auto* m = static_cast<TiffMessages*>(user);
  if (m != nullptr && m->first_error[0] == '\0') {
    char text[200];
    std::vsnprintf(text, sizeof text, fmt, ap);
    std::snprintf(m->first_error, sizeof m->first_error, "%s%s%s", module != nullptr ? module : "",
                  module != nullptr ? ": " : "", text);
  }
  return 1;
}

int tiff_warning_handler(TIFF*, void*, const char*, const char*, va_list) { return 1; }

struct TiffCloser {
  void operator()(TIFF* t) const { TIFFClose(t); }
};
struct TiffOptionsDeleter {
  void operator()(TIFFOpenOptions* o) const { TIFFOpenOptionsFree(o); }
};

struct FdCloser {
  int fd = -1;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

// `path` opened by libtiff, its errors collected in *messages (which must outlive the handle).
// Opening the descriptor ourselves gives an errno for the Status (kNotFound and so on) and keeps
// libtiff from reporting the failure through its global handler.
Result<std::unique_ptr<TIFF, TiffCloser>> open_tiff(const std::string& path, TiffMessages* messages) {
  FdCloser fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) return core::errno_status(errno, path);
  std::unique_ptr<TIFFOpenOptions, TiffOptionsDeleter> opts(TIFFOpenOptionsAlloc());
  if (opts == nullptr) return core::internal_error(path + ": TIFFOpenOptionsAlloc failed");
  TIFFOpenOptionsSetErrorHandlerExtR(opts.get(), tiff_error_handler, messages);
  TIFFOpenOptionsSetWarningHandlerExtR(opts.get(), tiff_warning_handler, nullptr);
  // TIFFClose closes the descriptor it was given.
  std::unique_ptr<TIFF, TiffCloser> tif(TIFFFdOpenExt(fd.fd, path.c_str(), "rm", opts.get()));
  if (tif == nullptr)
    return core::data_loss(path + ": not a readable TIFF" +
                           (messages->first_error[0] != '\0' ? std::string(": ") + messages->first_error : ""));
  fd.fd = -1;
  return tif;
}

Result<RgbImage> read_tiff_file(const std::string& path) {
  TiffMessages messages;
  SLIDE_ASSIGN_OR_RETURN(auto tif, open_tiff(path, &messages));
  uint32_t width = 0, height = 0;
  TIFFGetField(tif.get(), TIFFTAG_IMAGEWIDTH, &width);
  TIFFGetField(tif.get(), TIFFTAG_IMAGELENGTH, &height);
  if (width < 1 || height < 1 || int64_t{width} * height > kMaxDecodedPixels)
    return core::data_loss(path + ": implausible TIFF size " + std::to_string(width) + "x" + std::to_string(height));
  std::vector<uint32_t> abgr(size_t{width} * height);
  if (TIFFReadRGBAImageOriented(tif.get(), width, height, abgr.data(), ORIENTATION_TOPLEFT, 0) != 1)
    return core::data_loss(path + ": TIFF decode" +
                           (messages.first_error[0] != '\0' ? std::string(": ") + messages.first_error : " failed"));
  RgbImage img(width, height);
  for (size_t i = 0; i < abgr.size(); ++i) {
    const uint32_t p = abgr[i];
    // TIFFReadRGBAImage returns premultiplied alpha (it premultiplies unassociated alpha
    // itself), so compositing onto white is c + (255 - a).
    const uint32_t a = TIFFGetA(p);
    img.pixels[3 * i + 0] = static_cast<uint8_t>(std::min<uint32_t>(255, TIFFGetR(p) + (255 - a)));
    img.pixels[3 * i + 1] = static_cast<uint8_t>(std::min<uint32_t>(255, TIFFGetG(p) + (255 - a)));
    img.pixels[3 * i + 2] = static_cast<uint8_t>(std::min<uint32_t>(255, TIFFGetB(p) + (255 - a)));
  }
  return img;
}

std::string lower_extension(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const size_t dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return "";
  std::string ext = path.substr(dot);
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext;
}

}  // namespace

Result<RgbImage> read_image_file(const std::string& path) {
  const std::string ext = lower_extension(path);
  if (ext == ".tif" || ext == ".tiff") return read_tiff_file(path);
  const bool jpeg = ext == ".jpg" || ext == ".jpeg";
  const bool png = ext == ".png";
  if (!jpeg && !png)
    return core::invalid_argument(path + ": unknown image extension '" + ext + "' (expected .jpg, .jpeg, .png, .tif, .tiff)");
  SLIDE_ASSIGN_OR_RETURN(std::string bytes, core::read_file(path));
  std::span<const uint8_t> span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  Result<RgbImage> img = jpeg ? decode_jpeg(span) : decode_png(span);
  if (!img.ok()) return img.status().with_context(path);
  return img;
}

// -----------------------------------------------------------------------------------------------
// Area resampling.

namespace detail {

std::vector<AreaTap> area_taps(double origin, double scale, int64_t begin, int64_t count, int64_t src_size,
                               std::vector<int64_t>* tap_begin) {
  std::vector<AreaTap> taps;
  tap_begin->assign(static_cast<size_t>(count + 1), 0);
  taps.reserve(static_cast<size_t>(count * (static_cast<int64_t>(std::ceil(scale)) + 1)));
  const double inv = 1.0 / scale;
  for (int64_t i = 0; i < count; ++i) {
    (*tap_begin)[static_cast<size_t>(i)] = static_cast<int64_t>(taps.size());
    // Destination pixel i covers [a, b) in source coordinates (OpenCV INTER_AREA,
    // imgproc/src/resize.cpp computeResizeAreaTab: weights are the overlaps / the cell width).
    const double a = origin + static_cast<double>(begin + i) * scale;
    const double b = origin + static_cast<double>(begin + i + 1) * scale;
    const int64_t k0 = static_cast<int64_t>(std::floor(a));
    const int64_t k1 = static_cast<int64_t>(std::ceil(b));
    for (int64_t k = k0; k < k1; ++k) {
      const double w = (std::min(b, static_cast<double>(k + 1)) - std::max(a, static_cast<double>(k))) * inv;
      if (w <= 1e-12) continue;
      const int64_t idx = std::clamp<int64_t>(k, 0, src_size - 1);
      // Clamped taps beyond the edge repeat the edge pixel: merge them to keep the loops short.
      if (!taps.empty() && static_cast<int64_t>(taps.size()) > (*tap_begin)[static_cast<size_t>(i)] &&
          taps.back().index == idx) {
        taps.back().weight += w;
      } else {
        taps.push_back({idx, w});
      }
    }
  }
  (*tap_begin)[static_cast<size_t>(count)] = static_cast<int64_t>(taps.size());
  return taps;
}

void resample_rows(const uint8_t* const* src_rows, const std::vector<AreaTap>& x_taps,
                   const std::vector<int64_t>& x_begin, const AreaTap* y_taps, int64_t y_count, int64_t dst_width,
                   uint8_t* dst_row, std::vector<double>* scratch) {
  // Vertical pass first (the weighted sum of the source rows this destination row covers, over
  // the columns the x taps touch; taps are non-decreasing), then the horizontal taps on that one
  // accumulated row: two multiply-adds per source sample.
  const int64_t lo = x_taps.empty() ? 0 : x_taps.front().index;
  const int64_t hi = x_taps.empty() ? 0 : x_taps.back().index + 1;
  std::vector<double>& col = *scratch;
  col.assign(static_cast<size_t>(3 * (hi - lo)), 0.0);
  for (int64_t k = 0; k < y_count; ++k) {
    const uint8_t* s = src_rows[k] + 3 * lo;
    const double w = y_taps[k].weight;
    for (int64_t x = 0; x < 3 * (hi - lo); ++x) col[static_cast<size_t>(x)] += w * s[x];
  }
  for (int64_t i = 0; i < dst_width; ++i) {
    double r = 0, g = 0, b = 0;
    for (int64_t t = x_begin[static_cast<size_t>(i)]; t < x_begin[static_cast<size_t>(i + 1)]; ++t) {
      const AreaTap& tap = x_taps[static_cast<size_t>(t)];
      const double* c = &col[static_cast<size_t>(3 * (tap.index - lo))];
      r += tap.weight * c[0], g += tap.weight * c[1], b += tap.weight * c[2];
    }
    // Round half up; the epsilon absorbs the error of weights such as 1/3 so that an exact .5
    // mean is not rounded down by a last-bit error.
    dst_row[3 * i + 0] = static_cast<uint8_t>(std::clamp(std::floor(r + 0.5 + 1e-7), 0.0, 255.0));
    dst_row[3 * i + 1] = static_cast<uint8_t>(std::clamp(std::floor(g + 0.5 + 1e-7), 0.0, 255.0));
    dst_row[3 * i + 2] = static_cast<uint8_t>(std::clamp(std::floor(b + 0.5 + 1e-7), 0.0, 255.0));
  }
}

void resample_area_xy(const RgbImage& src, int64_t src_y0, double x0, double y0, double scale_x, double scale_y,
                      int64_t src_full_height, RgbImage* dst, int64_t dst_row_begin, int64_t dst_row_end) {
  std::vector<int64_t> x_begin, y_begin;
  const std::vector<AreaTap> x_taps = area_taps(x0, scale_x, 0, dst->width, src.width, &x_begin);
  const int64_t rows = dst_row_end - dst_row_begin;
  const std::vector<AreaTap> y_taps = area_taps(y0, scale_y, dst_row_begin, rows, src_full_height, &y_begin);
  std::vector<double> scratch;
  std::vector<const uint8_t*> src_rows;
  for (int64_t j = 0; j < rows; ++j) {
    src_rows.clear();
    for (int64_t t = y_begin[static_cast<size_t>(j)]; t < y_begin[static_cast<size_t>(j + 1)]; ++t) {
      const int64_t local = std::clamp<int64_t>(y_taps[static_cast<size_t>(t)].index - src_y0, 0, src.height - 1);
      src_rows.push_back(src.row(local));
    }
    resample_rows(src_rows.data(), x_taps, x_begin, y_taps.data() + y_begin[static_cast<size_t>(j)],
                  static_cast<int64_t>(src_rows.size()), dst->width, dst->row(dst_row_begin + j), &scratch);
  }
}

}  // namespace detail

void resample_area(const RgbImage& src, double x0, double y0, double scale, RgbImage* dst) {
  if (dst == nullptr) return;
  dst->pixels.resize(static_cast<size_t>(3 * std::max<int64_t>(0, dst->width) * std::max<int64_t>(0, dst->height)));
  if (dst->width < 1 || dst->height < 1) return;
  if (src.width < 1 || src.height < 1 || !(scale > 0) || !std::isfinite(x0) || !std::isfinite(y0)) {
    // Nothing to sample: white, the colour of an empty slide area.
    std::fill(dst->pixels.begin(), dst->pixels.end(), uint8_t{255});
    return;
  }
  detail::resample_area_xy(src, 0, x0, y0, scale, scale, src.height, dst, 0, dst->height);
}

Result<ImageSize> read_image_size(const std::string& path) {
  const std::string ext = lower_extension(path);
  if (ext == ".tif" || ext == ".tiff") {
    TiffMessages messages;
    SLIDE_ASSIGN_OR_RETURN(auto tif, open_tiff(path, &messages));
    uint32_t width = 0, height = 0;
    TIFFGetField(tif.get(), TIFFTAG_IMAGEWIDTH, &width);
    TIFFGetField(tif.get(), TIFFTAG_IMAGELENGTH, &height);
    if (width < 1 || height < 1) return core::data_loss(path + ": TIFF without a size");
    return ImageSize{width, height};
  }
  const bool jpeg = ext == ".jpg" || ext == ".jpeg";
  if (!jpeg && ext != ".png")
    return core::invalid_argument(path + ": unknown image extension '" + ext + "' (expected .jpg, .jpeg, .png, .tif, .tiff)");
  SLIDE_ASSIGN_OR_RETURN(std::string bytes, core::read_file(path));
  const auto* b = reinterpret_cast<const uint8_t*>(bytes.data());
  if (jpeg) {
    tjhandle tj = thread_decompressor();
    if (tj == nullptr) return core::internal_error(std::string("tjInitDecompress: ") + tjGetErrorStr2(nullptr));
    int width = 0, height = 0, subsamp = 0, colorspace = 0;
    if (bytes.empty() || tjDecompressHeader3(tj, b, static_cast<unsigned long>(bytes.size()), &width, &height, &subsamp,
                                             &colorspace) != 0) {
      Status s = core::data_loss(path + ": JPEG header: " + (bytes.empty() ? "empty file" : tjGetErrorStr2(tj)));
      thread_decompressor(true);
      return s;
    }
    return ImageSize{width, height};
  }
  // PNG: the 8-byte signature, then the IHDR chunk (length, "IHDR", big-endian width and height).
  static const uint8_t kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() < 24 || std::memcmp(b, kSignature, 8) != 0 || std::memcmp(b + 12, "IHDR", 4) != 0)
    return core::data_loss(path + ": not a PNG (no signature and IHDR chunk)");
  auto be32 = [&](size_t at) {
    return (uint32_t{b[at]} << 24) | (uint32_t{b[at + 1]} << 16) | (uint32_t{b[at + 2]} << 8) | uint32_t{b[at + 3]};
  };
  if (be32(16) < 1 || be32(20) < 1) return core::data_loss(path + ": PNG without a size");
  return ImageSize{be32(16), be32(20)};
}

}  // namespace slide::tile
