// slide::tile::decode_tile_record on arbitrary bytes (a tile store's tiles database values).
// Properties: never crashes; on success the payload is the record's tail, its size is the
// header's payload_bytes, the size fields are in range, and encoding the decoded header again
// gives back the record (but for the reserved bytes 42..43, which the decoder ignores).
#include <cstring>
#include <span>
#include <vector>

#include "fuzz_util.h"
#include "slide/tile/store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace slide::tile;
  // A copy of exactly `size` bytes, so ASan sees any read past the record.
  std::vector<uint8_t> record(data, data + size);
  TileHeader header;
  std::span<const uint8_t> payload;
  auto st = decode_tile_record(std::span<const uint8_t>(record.data(), record.size()), &header, &payload);
  if (!st.ok()) {
    SLIDE_FUZZ_CHECK(st.code() == slide::core::StatusCode::kDataLoss);
    SLIDE_FUZZ_CHECK(!st.message().empty());
    return 0;
  }
  SLIDE_FUZZ_CHECK(size >= kTileHeaderBytes);
  SLIDE_FUZZ_CHECK(payload.data() == record.data() + kTileHeaderBytes);
  SLIDE_FUZZ_CHECK(payload.size() == header.payload_bytes);
  SLIDE_FUZZ_CHECK(header.channels == 3);
  SLIDE_FUZZ_CHECK(header.width >= 1 && header.width <= kMaxTileSidePx);
  SLIDE_FUZZ_CHECK(header.height >= 1 && header.height <= kMaxTileSidePx);
  if (header.encoding == TileEncoding::kRawRgb)
    SLIDE_FUZZ_CHECK(uint64_t{header.width} * header.height * 3 == payload.size());
  std::vector<uint8_t> again;
  encode_tile_record(header, payload, &again);
  SLIDE_FUZZ_CHECK(again.size() == record.size());
  record[42] = record[43] = 0;
  SLIDE_FUZZ_CHECK(std::memcmp(again.data(), record.data(), record.size()) == 0);
  return 0;
}
