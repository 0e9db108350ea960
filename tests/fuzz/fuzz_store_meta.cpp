// StoreReader::open's own parsing (the meta values, the slide records and their keys, the tile
// records read back) on stores whose LMDB pages are well formed: each input is a small text that
// this target writes into a fresh LMDB environment with LMDB's own API, then opens as a store.
//
// Input: lines. "M<key>=<value>" puts a meta entry, "S<id>=<json>" a slide record under key <id>,
// "T<bytes>" a tile record at the next tile index (0, 1, ...); "-meta", "-slides", "-tiles" leave
// that database out. Seeds (corpus/fuzz_store_meta/) are dumps of real stores made by slide-tile.
// Properties: never crashes or throws; open's errors are kDataLoss or kFailedPrecondition;
// read_tile's kDataLoss or kOutOfRange; the slides of an open store are in index order.
#include <lmdb.h>

#include <array>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "slide/core/log.h"
#include "slide/tile/store.h"

namespace {

using slide::core::StatusCode;

struct Entry {
  char db;
  std::string key, value;
};

void check_lmdb(int rc, const char* what) {
  if (rc != 0) {
    std::fprintf(stderr, "fuzz_store_meta: %s: %s\n", what, mdb_strerror(rc));
    std::abort();  // the harness, not the store: fix the harness
  }
}

// Writes `entries` into a new environment at `dir`. Returns false when LMDB refuses an entry
// (a key too long, an empty key): such an input is not a store anyone could have written.
bool write_env(const std::string& dir, const std::vector<Entry>& entries, bool meta, bool slides, bool tiles) {
  MDB_env* env = nullptr;
  check_lmdb(mdb_env_create(&env), "mdb_env_create");
  check_lmdb(mdb_env_set_maxdbs(env, 4), "mdb_env_set_maxdbs");
  check_lmdb(mdb_env_set_mapsize(env, 8u << 20), "mdb_env_set_mapsize");
  check_lmdb(mdb_env_open(env, dir.c_str(), MDB_NOSYNC, 0644), "mdb_env_open");
  MDB_txn* txn = nullptr;
  check_lmdb(mdb_txn_begin(env, nullptr, 0, &txn), "mdb_txn_begin");
  MDB_dbi dbis[3] = {0, 0, 0};
  const bool want[3] = {meta, slides, tiles};
  const char* names[3] = {"meta", "slides", "tiles"};
  for (int i = 0; i < 3; ++i)
    if (want[i]) check_lmdb(mdb_dbi_open(txn, names[i], MDB_CREATE, &dbis[i]), "mdb_dbi_open");
  uint64_t next_tile = 0;
  bool ok = true;
  for (const auto& e : entries) {
    const int which = e.db == 'M' ? 0 : e.db == 'S' ? 1 : 2;
    if (!want[which]) continue;
    std::array<uint8_t, 8> tile_key{};
    MDB_val k, v{e.value.size(), const_cast<char*>(e.value.data())};
    if (which == 2) {
      for (int i = 0; i < 8; ++i) tile_key[static_cast<size_t>(i)] = static_cast<uint8_t>(next_tile >> (8 * (7 - i)));
      ++next_tile;
      k = {tile_key.size(), tile_key.data()};
    } else {
      k = {e.key.size(), const_cast<char*>(e.key.data())};
    }
    if (mdb_put(txn, dbis[which], &k, &v, 0) != 0) {
      ok = false;
      break;
    }
  }
  if (ok) {
    check_lmdb(mdb_txn_commit(txn), "mdb_txn_commit");
  } else {
    mdb_txn_abort(txn);
  }
  mdb_env_close(env);
  return ok;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  slide::core::set_log_level(slide::core::LogLevel::kError);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace slide::tile;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<Entry> entries;
  bool meta = true, slides = true, tiles = true;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(start, end - start);
    start = end + 1;
    if (line == "-meta") meta = false;
    if (line == "-slides") slides = false;
    if (line == "-tiles") tiles = false;
    if (line.empty() || (line[0] != 'M' && line[0] != 'S' && line[0] != 'T')) continue;
    if (line[0] == 'T') {
      entries.push_back({'T', {}, std::string(line.substr(1))});
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) continue;
    entries.push_back({line[0], std::string(line.substr(1, eq - 1)), std::string(line.substr(eq + 1))});
  }

  const std::string dir = slide::fuzz::scratch_dir() + "/store";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directory(dir);
  if (!write_env(dir, entries, meta, slides, tiles)) return 0;

  auto reader = StoreReader::open(dir);
  if (!reader.ok()) {
    const StatusCode c = reader.status().code();
    SLIDE_FUZZ_CHECK(c == StatusCode::kDataLoss || c == StatusCode::kFailedPrecondition);
    return 0;
  }
  const auto& records = (*reader)->slides();
  for (size_t i = 1; i < records.size(); ++i) SLIDE_FUZZ_CHECK(records[i - 1].index <= records[i].index);
  const uint64_t n = std::min<uint64_t>((*reader)->tile_count(), 8);
  for (uint64_t i = 0; i <= n; ++i) {
    TileHeader h;
    std::vector<uint8_t> payload;
    auto st = (*reader)->read_tile(i, &h, &payload);
    if (!st.ok()) {
      SLIDE_FUZZ_CHECK(st.code() == StatusCode::kDataLoss || st.code() == StatusCode::kOutOfRange);
    } else {
      SLIDE_FUZZ_CHECK(payload.size() == h.payload_bytes);
    }
  }
  return 0;
}
