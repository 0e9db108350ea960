// StoreReader::open (and read_tile on the first tiles) on a store directory whose data.mdb is the
// fuzzer's bytes, seeded from small real stores (corpus/fuzz_store_mdb/, made by slide-tile).
//
// Known limit, not a finding: LMDB trusts its file. It validates the two meta pages (magic,
// version, page size) and StoreReader checks the file holds every page the newest meta page
// names, but a corrupt branch or leaf page (a bad page number, an offset past the page, a key
// count that does not fit) is followed as written and can crash inside liblmdb (SIGSEGV / an
// ASan report with mdb_* frames only) or loop. Runs of this target therefore stop at the first
// such crash; a crash with a frame of ours (slide::tile) above the mdb_* frames is a finding.
// fuzz_store_meta covers our own parsing of the store's meta values and slide records on
// well-formed LMDB pages.
#include <filesystem>
#include <string>

#include "fuzz_util.h"
#include "slide/core/log.h"
#include "slide/tile/store.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  slide::core::set_log_level(slide::core::LogLevel::kError);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace slide::tile;
  const std::string dir = slide::fuzz::scratch_dir() + "/store";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directory(dir);
  slide::fuzz::write_bytes(dir + "/data.mdb", data, size);
  auto reader = StoreReader::open(dir);
  if (!reader.ok()) return 0;
  const uint64_t n = std::min<uint64_t>((*reader)->tile_count(), 8);
  for (uint64_t i = 0; i < n; ++i) {
    TileHeader h;
    std::vector<uint8_t> payload;
    (void)(*reader)->read_tile(i, &h, &payload);
  }
  return 0;
}
