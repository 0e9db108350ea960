// Durable commits of files that a library writes itself under a temporary name (HDF5 files):
// what write_file_atomic (file.h) does for bytes held in memory.
#pragma once

#include <string>

#include "slide/core/status.h"

namespace slide::core {

// fsync(2)s the file (directory = false) or the directory (directory = true) at `path`. A
// directory whose filesystem refuses fsync (EINVAL, EROFS: some network mounts) is not an error:
// nothing is lost. Errors (errno_status, naming the path): kNotFound, kPermissionDenied,
// kResourceExhausted (ENOSPC / EDQUOT), kInternal.
[[nodiscard]] Status fsync_path(const std::string& path, bool directory);

// Commits the closed file `partial` under the name `path`, in the same directory: fsync(partial),
// rename(2) over `path`, fsync of the directory. After it returns OK a reader sees the whole file
// under `path`, even after a crash; before, the old file or none. Any error removes `partial` and
// names the step and the file (fsync_path's codes; rename's through errno_status).
[[nodiscard]] Status commit_file(const std::string& partial, const std::string& path);

}  // namespace slide::core
