// slide::cache::BagReader (HDF5 feature bags: written by slide-embed, or by CLAM / TRIDENT, and
// copied between machines) on byte-mutated files: the input is the whole .h5 file, written to a
// temp file. corpus/fuzz_bag/ holds small valid bags written with h5py in our layout (float32,
// float16 + gzip, lzf, CLAM's without attributes, an empty one). Properties:
//   - open never crashes or throws; its errors are kDataLoss or kFailedPrecondition (a newer
//     format_version), naming the path;
//   - a bag it opens: info.path is the path, file_bytes the input's size, num_tiles >= 0,
//     feature_dim >= 1, num_tiles x feature_dim does not overflow, a slide id (the file's stem at
//     least);
//   - reads (the first rows, and the whole bag when it has at most 2^20 values) fail only with
//     kDataLoss naming the path; what they return is finite features and as many values as
//     asked; when read_all succeeds, the first rows read alone succeeded too and equal its own.
//
// Known limit, not a finding: HDF5 trusts its file, like LMDB in fuzz_store_mdb. A corrupt
// object header, global heap or B-tree is followed as written: within a few hundred executions
// this target stops at a crash inside libhdf5 (Debian's 1.10.8: SEGV / memcpy-param-overlap in
// H5HG_read under H5Aread of a string attribute, heap-buffer-overflow in H5O__attr_exists,
// multi-terabyte mallocs in H5C_protect, endless loops under H5AC_protect, and LeakSanitizer
// reports of HDF5's own blocks after a failed H5Fopen). h5py on the same libhdf5 segfaults on
// the first kind too; known_limits/fuzz_bag/ keeps two. So fuzz_bag is not in ctest and not in
// scripts/fuzz.sh's default list (name it to run it); a crash with a frame of ours
// (slide::cache) above the H5* frames, or a failed property, is still a finding.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "slide/cache/bag.h"

namespace {

using slide::core::StatusCode;

bool names(const slide::core::Status& s, const std::string& path) { return s.message().find(path) != std::string::npos; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = slide::fuzz::scratch_dir() + "/slide.h5";
  slide::fuzz::write_bytes(path, data, size);
  auto reader = slide::cache::BagReader::open(path);
  if (!reader.ok()) {
    const auto& st = reader.status();
    SLIDE_FUZZ_CHECK(st.code() == StatusCode::kDataLoss || st.code() == StatusCode::kFailedPrecondition);
    SLIDE_FUZZ_CHECK(names(st, path));
    return 0;
  }
  const auto& r = **reader;
  const auto& info = r.info();
  SLIDE_FUZZ_CHECK(info.path == path);
  SLIDE_FUZZ_CHECK(info.file_bytes == static_cast<int64_t>(size));
  SLIDE_FUZZ_CHECK(!info.attributes.slide_id.empty());
  const int64_t n = r.num_tiles(), d = r.feature_dim();
  SLIDE_FUZZ_CHECK(n >= 0);
  SLIDE_FUZZ_CHECK(d >= 1);
  SLIDE_FUZZ_CHECK(n <= std::numeric_limits<int64_t>::max() / d);

  auto read_ok = [&](const slide::core::Status& s) {
    if (s.ok()) return true;
    SLIDE_FUZZ_CHECK(s.code() == StatusCode::kDataLoss);
    SLIDE_FUZZ_CHECK(names(s, path));
    return false;
  };
  // The first rows, as MIL training reads a slice.
  const int64_t rows = std::min<int64_t>(n, 4);
  std::vector<float> head;
  std::vector<int32_t> head_coords(static_cast<size_t>(rows * 2));
  bool head_ok = false, head_coords_ok = false;
  if (d <= (1 << 20)) {
    head.resize(static_cast<size_t>(rows * d));
    head_ok = read_ok(r.read_features(0, rows, head));
    if (head_ok)
      for (float v : head) SLIDE_FUZZ_CHECK(std::isfinite(v));
  }
  head_coords_ok = read_ok(r.read_coords(0, rows, head_coords));
  // Rows outside the bag are an error, never a read.
  std::vector<float> one(static_cast<size_t>(d <= (1 << 20) ? d : 0));
  if (d <= (1 << 20)) SLIDE_FUZZ_CHECK(r.read_features(n, 1, one).code() == StatusCode::kOutOfRange);

  if (n * d > (1 << 20)) return 0;  // a huge (sparse) dataset in a small file: not read whole here
  auto bag = r.read_all();
  if (!bag.ok()) {
    read_ok(bag.status());
    return 0;
  }
  SLIDE_FUZZ_CHECK(bag->features.size() == static_cast<size_t>(n * d));
  SLIDE_FUZZ_CHECK(bag->coords.size() == static_cast<size_t>(n * 2));
  for (float v : bag->features) SLIDE_FUZZ_CHECK(std::isfinite(v));
  SLIDE_FUZZ_CHECK(head_ok && head_coords_ok);  // d <= 2^20 here
  for (size_t i = 0; i < head.size(); ++i) SLIDE_FUZZ_CHECK(head[i] == bag->features[i]);
  for (size_t i = 0; i < head_coords.size(); ++i) SLIDE_FUZZ_CHECK(head_coords[i] == bag->coords[i]);
  return 0;
}
