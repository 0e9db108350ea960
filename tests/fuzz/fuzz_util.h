// Helpers shared by the fuzz targets: a property check that aborts (so libFuzzer saves the input)
// and a per-process scratch directory for parsers that take a path.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

// A property of the parser under test; a failure is a finding, reported like a crash.
#define SLIDE_FUZZ_CHECK(cond)                                                                   \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      std::fprintf(stderr, "%s:%d: property failed: %s\n", __FILE__, __LINE__, #cond);           \
      std::abort();                                                                              \
    }                                                                                            \
  } while (0)

namespace slide::fuzz {

// A directory of this process's own under $TMPDIR (or /tmp), removed at exit.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/slide-fuzz-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    static std::string keep = templ;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(keep, ec);
    });
    return templ;
  }();
  return dir;
}

// Writes `size` bytes to `path` (replacing it); aborts on an I/O error (not a finding).
inline void write_bytes(const std::string& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(path.c_str());
    std::abort();
  }
}

}  // namespace slide::fuzz
