// slide::tile::slide_record_from_json on arbitrary bytes (a tile store's slides database values).
// Properties: never crashes or throws; errors are kDataLoss; a record read is written back
// (slide_record_to_json) to JSON that reads again into the same record.
#include <string>

#include "fuzz_util.h"
#include "slide/tile/store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace slide::tile;
  const std::string json(reinterpret_cast<const char*>(data), size);
  auto r = slide_record_from_json(json);
  if (!r.ok()) {
    SLIDE_FUZZ_CHECK(r.status().code() == slide::core::StatusCode::kDataLoss);
    return 0;
  }
  SLIDE_FUZZ_CHECK(r->tile_count <= UINT64_MAX - r->first_tile_index);
  const std::string once = slide_record_to_json(*r);
  auto again = slide_record_from_json(once);
  SLIDE_FUZZ_CHECK(again.ok());
  SLIDE_FUZZ_CHECK(slide_record_to_json(*again) == once);
  return 0;
}
