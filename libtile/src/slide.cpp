// open_slide: the one place that knows which readers exist and in which order they are tried
// (OpenSlide for everything it detects, then libtiff), like OpenSlide's own driver list with
// generic TIFF last.
#include "slide/tile/slide.h"

#include <fcntl.h>
#include <openslide.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "openslide_reader.h"
#include "tiff_reader.h"

namespace slide::tile {

Status SlideReader::read_level_region(int level, int64_t lx, int64_t ly, int64_t w, int64_t h, uint8_t* rgb) const {
  const auto& levels = properties().levels;
  const double d = level >= 0 && static_cast<size_t>(level) < levels.size() ? levels[static_cast<size_t>(level)].downsample : 1.0;
  return read_region(std::llround(static_cast<double>(lx) * d), std::llround(static_cast<double>(ly) * d), level, w, h,
                     rgb);
}

Result<std::vector<uint8_t>> SlideReader::read_raw_jpeg_tile(int level, int64_t col, int64_t row) const {
  (void)col;
  (void)row;
  return core::unimplemented("level " + std::to_string(level) + " has no pass-through JPEG tiles");
}

Status check_regular_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ELOOP)
      return core::invalid_argument(path + ": " + std::strerror(err) + " (a symlink loop), not a slide");
    return core::errno_status(err, path);
  }
  if (S_ISREG(st.st_mode)) return core::ok_status();
  const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                                            : "something other than a regular file";
  return core::invalid_argument(path + ": is " + std::string(kind) + ", not a slide (slides must be regular files)");
}

Result<std::unique_ptr<SlideReader>> open_slide(const std::string& path) {
  // Check the file ourselves first: OpenSlide reports a missing or unreadable file as "not a
  // slide", which would hide the real cause.
  SLIDE_RETURN_IF_ERROR(check_regular_file(path));
  // O_NONBLOCK: should the file have become a FIFO since the check, open() must not wait for a
  // writer (it has no effect on regular files).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return core::errno_status(errno, path);
  ::close(fd);

  if (const char* vendor = openslide_detect_vendor(path.c_str()); vendor != nullptr)
    return detail::open_openslide_reader(path, vendor);

  auto tiff = detail::open_tiff_reader(path);
  if (tiff.ok() || tiff.status().code() != core::StatusCode::kInvalidArgument) return tiff;
  // Keep libtiff's reason after the verdict: it tells a damaged TIFF from a file that is no TIFF.
  std::string why = tiff.status().message();
  if (why.rfind(path + ": ", 0) == 0) why.erase(0, path.size() + 2);
  return core::invalid_argument(path + ": not a slide OpenSlide or libtiff can read (" + why + ")");
}

}  // namespace slide::tile
