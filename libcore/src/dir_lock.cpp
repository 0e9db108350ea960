#include "slide/core/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "slide/core/file.h"

namespace slide::core {
namespace {

// The holder's "<pid> <comm>" as written in the lock file; "" when unreadable.
std::string read_holder(int fd) {
  char buf[128];
  ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return "";
  std::string s(buf, static_cast<size_t>(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20) c = '?';
  return s;
}

std::string own_comm() {
  auto comm = read_file("/proc/self/comm");
  if (!comm.ok()) return "";
  std::string s = *comm;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

}  // namespace

Result<std::unique_ptr<DirLock>> DirLock::acquire(const std::string& dir, const std::string& what) {
  if (auto s = make_dirs(dir); !s.ok()) return s;
  std::string path = dir + "/" + kFileName;
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0664);
  if (fd < 0) return errno_status(errno, "create lock file " + path);
  int rc;
  do rc = ::flock(fd, LOCK_EX | LOCK_NB);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int err = errno;
    if (err == EWOULDBLOCK) {
      std::string holder = read_holder(fd);
      ::close(fd);
      std::string pid = holder.substr(0, holder.find(' '));
      std::string comm = holder.find(' ') == std::string::npos ? "" : holder.substr(holder.find(' ') + 1);
      std::string who = pid.empty() ? "another process" : "another process (pid " + pid + (comm.empty() ? "" : ", " + comm) + ")";
      return unavailable(what + " " + dir + " is being written by " + who +
                         "; wait for it to finish or write elsewhere (lock file " + path + ")");
    }
    ::close(fd);
    return errno_status(err, "lock " + path);
  }
  // We hold it: record who we are (best effort; the lock, not the text, is what excludes).
  std::string text = std::to_string(::getpid()) + " " + own_comm() + "\n";
  if (::ftruncate(fd, 0) == 0) {
    ssize_t ignored = ::pwrite(fd, text.data(), text.size(), 0);
    (void)ignored;
  }
  return std::unique_ptr<DirLock>(new DirLock(path, fd));
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace slide::core
