// slide::cache::read_manifest (bags.csv, written by slide-embed and edited by users) on arbitrary
// file contents. Properties: never crashes or throws; errors are kDataLoss; every entry read has
// a non-empty file under the manifest's directory, num_tiles >= 0 and feature_dim >= 1.
#include <string>

#include "fuzz_util.h"
#include "slide/cache/bag.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string dir = slide::fuzz::scratch_dir();
  const std::string path = dir + "/bags.csv";
  slide::fuzz::write_bytes(path, data, size);
  auto entries = slide::cache::read_manifest(path);
  if (!entries.ok()) {
    SLIDE_FUZZ_CHECK(entries.status().code() == slide::core::StatusCode::kDataLoss);
    return 0;
  }
  for (const auto& e : *entries) {
    SLIDE_FUZZ_CHECK(e.path.size() > dir.size() + 1 && e.path.compare(0, dir.size() + 1, dir + "/") == 0);
    SLIDE_FUZZ_CHECK(e.num_tiles >= 0);
    SLIDE_FUZZ_CHECK(e.feature_dim >= 1);
  }
  return 0;
}
