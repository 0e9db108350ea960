#include "slide/core/file.h"

#include "slide/core/durable.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>

namespace slide::core {
namespace {

std::string parent_dir(const std::string& path) {
  auto p = std::filesystem::path(path).parent_path();
  return p.empty() ? std::string(".") : p.string();
}

}  // namespace

Status fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), (directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, std::string("open ") + (directory ? "directory " : "") + path);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some filesystems (e.g. certain network mounts) refuse fsync on directories: not data loss.
  if (rc != 0 && !(directory && (err == EINVAL || err == EROFS)))
    return errno_status(err, std::string("fsync ") + (directory ? "directory " : "") + path);
  return ok_status();
}

Status commit_file(const std::string& partial, const std::string& path) {
  if (Status s = fsync_path(partial, false); !s.ok()) {
    ::unlink(partial.c_str());
    return s;
  }
  if (::rename(partial.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(partial.c_str());
    return errno_status(err, "rename " + partial + " to " + path);
  }
  return fsync_path(parent_dir(path), true);
}

Status write_file_atomic(const std::string& path, std::span<const uint8_t> bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return errno_status(errno, "create " + tmp);
  auto fail = [&](int err, const std::string& what) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return errno_status(err, what + " " + tmp);
  };
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail(errno, "write");
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) return fail(errno, "fsync");
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return errno_status(err, "close " + tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return errno_status(err, "rename " + tmp + " to " + path);
  }
  return fsync_path(parent_dir(path), true);
}

Status write_file_atomic(const std::string& path, std::string_view text) {
  return write_file_atomic(path, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

Result<std::string> read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, "open " + path);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return errno_status(err, "read " + path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

Status make_dirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return errno_status(ec.value(), "create directory " + path);
  return ok_status();
}

Result<FileStat> stat_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return errno_status(errno, "stat " + path);
  FileStat fs;
  fs.size_bytes = st.st_size;
  fs.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;
  fs.is_dir = S_ISDIR(st.st_mode);
  return fs;
}

}  // namespace slide::core
