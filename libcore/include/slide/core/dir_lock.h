// One writer per output directory: an exclusive advisory lock held for a whole run.
//
// DirLock::acquire(dir, what) creates `dir` if missing, opens (or creates) the file
// `<dir>/writer.lock` and takes flock(2)'s exclusive lock on it without waiting. The lock
// belongs to the open file description: the kernel releases it when the process exits, however
// it exits (SIGKILL included), so a killed run never leaves a stale lock; a rerun simply takes
// it. The file holds the holder's pid and command name ("<pid> <comm>\n"), read back only to name
// the holder in the error of a second writer.
//
// Readers take no lock (LMDB readers, bag readers and checkpoint readers work beside a writer).
//
// Errors: kUnavailable when another process holds the lock ("<what> <dir> is being written by
// another process (pid N, slide-tile); wait for it to finish or write elsewhere"); kNotFound /
// kPermissionDenied / kResourceExhausted / kInternal from creating the directory or the file,
// naming the path. flock(2) on NFS is emulated with POSIX byte-range locks by Linux (>= 2.6.12),
// so the rule holds across hosts of one NFS mount too.
#pragma once

#include <memory>
#include <string>

#include "slide/core/status.h"

namespace slide::core {

class DirLock {
 public:
  // `what` names the directory's role in messages ("store", "output directory").
  [[nodiscard]] static Result<std::unique_ptr<DirLock>> acquire(const std::string& dir, const std::string& what);
  ~DirLock();  // releases the lock (the file stays: removing it would race a second acquirer)
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

  const std::string& path() const { return path_; }

  // The lock file's name inside the directory.
  static constexpr const char* kFileName = "writer.lock";

 private:
  DirLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

}  // namespace slide::core
