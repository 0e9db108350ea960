// Atomic file writes and small filesystem helpers.
//
// write_file_atomic(path, bytes): writes `<path>.tmp.<pid>` in the same directory, fsync(2)s it,
// rename(2)s it over `path` and fsyncs the directory: a reader sees the old file or the whole
// new one, never a torn write, even after a crash or SIGKILL. Errors: kPermissionDenied
// (unwritable directory), kResourceExhausted (ENOSPC/EDQUOT: disk full), kNotFound (missing
// directory), kInternal otherwise; the message names the path. On error the temporary is removed.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "slide/core/status.h"

namespace slide::core {

[[nodiscard]] Status write_file_atomic(const std::string& path, std::span<const uint8_t> bytes);
[[nodiscard]] Status write_file_atomic(const std::string& path, std::string_view text);

// Reads a whole file. kNotFound / kPermissionDenied / kInternal, naming the path.
[[nodiscard]] Result<std::string> read_file(const std::string& path);

// mkdir -p. kPermissionDenied / kResourceExhausted / kInternal naming the path.
[[nodiscard]] Status make_dirs(const std::string& path);

struct FileStat {
  int64_t size_bytes = 0;
  int64_t mtime_ns = 0;  // modification time, ns since the Unix epoch
  bool is_dir = false;
};
[[nodiscard]] Result<FileStat> stat_file(const std::string& path);

}  // namespace slide::core
