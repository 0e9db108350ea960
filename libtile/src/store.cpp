// The LMDB tile store (format: store.h; design: DESIGN.md "The tile store (LMDB)").
//
// Writer: every change goes through a pending list of operations that one bounded write
// transaction applies (deletes first, then puts). Nothing outside that list is ever written, so a
// transaction that fails (MDB_MAP_FULL, ENOSPC, ...) is aborted and either replayed after growing
// the map or reported with the pending list intact: a committed slide is never lost and a slide
// record never lands without its last tiles.
//
// Reader: one environment opened MDB_RDONLY | MDB_NOTLS, so read transactions are tied to the
// MDB_txn object rather than the thread and any number of threads may read at once.
#include "slide/tile/store.h"

#include <lmdb.h>
#include <setjmp.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <shared_mutex>
#include <utility>

#include "slide/core/dir_lock.h"
#include "slide/core/file.h"
#include "slide/core/log.h"
// auto_thumbnail_mpp: what a store without a thumbnail_mpp_um key was made with.
#include "slide/tile/pipeline.h"

namespace slide::tile {

using slide::core::log_debug;
using slide::core::log_info;
using slide::core::log_warn;

// ---------------------------------------------------------------------------------------------
// Tile records
// ---------------------------------------------------------------------------------------------

namespace {

constexpr char kTileMagic[4] = {'S', 'L', 'T', '1'};

template <typename T>
void put_le(uint8_t* p, T v) {
  using U = std::make_unsigned_t<T>;
  U u = static_cast<U>(v);
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(u >> (8 * i));
}

template <typename T>
T get_le(const uint8_t* p) {
  using U = std::make_unsigned_t<T>;
  U u = 0;
  for (size_t i = 0; i < sizeof(T); ++i) u = static_cast<U>(u | (static_cast<U>(p[i]) << (8 * i)));
  return static_cast<T>(u);
}

}  // namespace

void write_tile_header(const TileHeader& header, uint8_t* p) {
  std::memcpy(p, kTileMagic, 4);
  put_le<uint16_t>(p + 4, kTileRecordVersion);
  put_le<uint16_t>(p + 6, static_cast<uint16_t>(kTileHeaderBytes));
  put_le<uint32_t>(p + 8, header.slide_index);
  put_le<int32_t>(p + 12, header.label);
  put_le<int64_t>(p + 16, header.x_l0);
  put_le<int64_t>(p + 24, header.y_l0);
  put_le<uint32_t>(p + 32, header.width);
  put_le<uint32_t>(p + 36, header.height);
  p[40] = header.channels;
  p[41] = static_cast<uint8_t>(header.encoding);
  put_le<uint16_t>(p + 42, 0);
  put_le<uint32_t>(p + 44, header.payload_bytes);
}

void encode_tile_record(TileHeader header, std::span<const uint8_t> payload, std::vector<uint8_t>* out) {
  header.payload_bytes = static_cast<uint32_t>(payload.size());
  const size_t start = out->size();
  out->resize(start + kTileHeaderBytes + payload.size());
  write_tile_header(header, out->data() + start);
  if (!payload.empty()) std::memcpy(out->data() + start + kTileHeaderBytes, payload.data(), payload.size());
}

Status decode_tile_record(std::span<const uint8_t> record, TileHeader* header, std::span<const uint8_t>* payload) {
  using slide::core::data_loss;
  if (record.size() < kTileHeaderBytes)
    return data_loss("tile record of " + std::to_string(record.size()) + " bytes is shorter than its " +
                     std::to_string(kTileHeaderBytes) + "-byte header");
  const uint8_t* p = record.data();
  if (std::memcmp(p, kTileMagic, 4) != 0) return data_loss("tile record has a bad magic (expected \"SLT1\")");
  const uint16_t version = get_le<uint16_t>(p + 4);
  if (version != kTileRecordVersion)
    return data_loss("tile record version " + std::to_string(version) + " is not supported (expected " +
                     std::to_string(kTileRecordVersion) + ")");
  const uint16_t header_bytes = get_le<uint16_t>(p + 6);
  if (header_bytes != kTileHeaderBytes)
    return data_loss("tile record header is " + std::to_string(header_bytes) + " bytes, expected " +
                     std::to_string(kTileHeaderBytes));
  const uint8_t encoding = p[41];
  if (encoding != static_cast<uint8_t>(TileEncoding::kRawRgb) && encoding != static_cast<uint8_t>(TileEncoding::kJpeg))
    return data_loss("tile record has unknown encoding " + std::to_string(encoding));
  const uint32_t payload_bytes = get_le<uint32_t>(p + 44);
  if (payload_bytes != record.size() - kTileHeaderBytes)
    return data_loss("tile record says its payload is " + std::to_string(payload_bytes) + " bytes but holds " +
                     std::to_string(record.size() - kTileHeaderBytes));
  // The header's size fields size the consumer's buffers (export, training): check them against
  // the payload before anyone allocates from them.
  const uint32_t width = get_le<uint32_t>(p + 32), height = get_le<uint32_t>(p + 36);
  const uint8_t channels = p[40];
  if (channels != 3) return data_loss("tile record has " + std::to_string(channels) + " channels (expected 3)");
  if (width < 1 || height < 1 || width > kMaxTileSidePx || height > kMaxTileSidePx)
    return data_loss("tile record says the tile is " + std::to_string(width) + "x" + std::to_string(height) +
                     " px (each side must be 1.." + std::to_string(kMaxTileSidePx) + ")");
  if (encoding == static_cast<uint8_t>(TileEncoding::kRawRgb) &&
      uint64_t{width} * height * channels != payload_bytes)
    return data_loss("raw tile record says " + std::to_string(width) + "x" + std::to_string(height) + "x" +
                     std::to_string(channels) + " = " + std::to_string(uint64_t{width} * height * channels) +
                     " bytes but its payload is " + std::to_string(payload_bytes) + " bytes");
  TileHeader h;
  h.slide_index = get_le<uint32_t>(p + 8);
  h.label = get_le<int32_t>(p + 12);
  h.x_l0 = get_le<int64_t>(p + 16);
  h.y_l0 = get_le<int64_t>(p + 24);
  h.width = get_le<uint32_t>(p + 32);
  h.height = get_le<uint32_t>(p + 36);
  h.channels = p[40];
  h.encoding = static_cast<TileEncoding>(encoding);
  h.payload_bytes = payload_bytes;
  *header = h;
  *payload = record.subspan(kTileHeaderBytes);
  return slide::core::ok_status();
}

// ---------------------------------------------------------------------------------------------
// Slide records (JSON)
// ---------------------------------------------------------------------------------------------

int32_t tile_size_level0_px(const SlideRecord& r, int64_t tile_size_px) {
  return r.source_mpp_um > 0 && r.tile_mpp_um > 0
             ? static_cast<int32_t>(std::lround(static_cast<double>(tile_size_px) * r.tile_mpp_um / r.source_mpp_um))
             : static_cast<int32_t>(tile_size_px);
}

std::string slide_record_to_json(const SlideRecord& r) {
  nlohmann::json j;
  j["index"] = r.index;
  j["slide_id"] = r.slide_id;
  j["path"] = r.path;
  j["source_size_bytes"] = r.source_size_bytes;
  j["source_mtime_ns"] = r.source_mtime_ns;
  j["vendor"] = r.vendor;
  j["backend"] = r.backend;
  j["width_l0"] = r.width_l0;
  j["height_l0"] = r.height_l0;
  j["source_mpp_um"] = r.source_mpp_um;
  j["mpp_source"] = r.mpp_source;
  j["level"] = r.level;
  j["downsample"] = r.downsample;
  j["tile_mpp_um"] = r.tile_mpp_um;
  j["tissue_fraction"] = r.tissue_fraction;
  j["candidate_tiles"] = r.candidate_tiles;
  j["tile_count"] = r.tile_count;
  j["first_tile_index"] = r.first_tile_index;
  j["label"] = r.label;
  j["label_index"] = r.label_index;
  j["passthrough"] = r.passthrough;
  if (!r.annotations_sha256.empty()) {
    j["annotations_path"] = r.annotations_path;
    j["annotations_sha256"] = r.annotations_sha256;
  }
  j["status"] = r.status;
  // Invalid UTF-8 in a path must not throw: replace it (the record is informational).
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

namespace {

// Reads j[key] into *out when present; a wrong type is DataLoss. Numbers are range-checked
// through nlohmann's number kinds rather than get<> so a hostile record cannot throw.
template <typename T>
Status read_field(const nlohmann::json& j, const char* key, T* out, bool required) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return slide::core::data_loss(std::string("slide record has no \"") + key + "\"");
    return slide::core::ok_status();
  }
  auto bad = [&] { return slide::core::data_loss(std::string("slide record field \"") + key + "\" has a bad value"); };
  if constexpr (std::is_same_v<T, std::string>) {
    if (!it->is_string()) return bad();
    *out = it->template get_ref<const std::string&>();
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) return bad();
    *out = it->template get<bool>();
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!it->is_number()) return bad();
    *out = it->template get<double>();
  } else {
    if (it->is_number_unsigned()) {
      uint64_t v = it->template get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<T>::max())) return bad();
      *out = static_cast<T>(v);
    } else if (it->is_number_integer()) {
      int64_t v = it->template get<int64_t>();
      if constexpr (std::is_unsigned_v<T>) {
        if (v < 0) return bad();
        if (static_cast<uint64_t>(v) > static_cast<uint64_t>(std::numeric_limits<T>::max())) return bad();
      } else {
        if (v < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
            v > static_cast<int64_t>(std::numeric_limits<T>::max()))
          return bad();
      }
      *out = static_cast<T>(v);
    } else {
      return bad();
    }
  }
  return slide::core::ok_status();
}

}  // namespace

Result<SlideRecord> slide_record_from_json(const std::string& json) {
  nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return slide::core::data_loss("slide record is not valid JSON");
  if (!j.is_object()) return slide::core::data_loss("slide record is not a JSON object");
  SlideRecord r;
  SLIDE_RETURN_IF_ERROR(read_field(j, "index", &r.index, true));
  SLIDE_RETURN_IF_ERROR(read_field(j, "slide_id", &r.slide_id, true));
  SLIDE_RETURN_IF_ERROR(read_field(j, "path", &r.path, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "source_size_bytes", &r.source_size_bytes, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "source_mtime_ns", &r.source_mtime_ns, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "vendor", &r.vendor, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "backend", &r.backend, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "width_l0", &r.width_l0, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "height_l0", &r.height_l0, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "source_mpp_um", &r.source_mpp_um, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "mpp_source", &r.mpp_source, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "level", &r.level, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "downsample", &r.downsample, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "tile_mpp_um", &r.tile_mpp_um, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "tissue_fraction", &r.tissue_fraction, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "candidate_tiles", &r.candidate_tiles, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "tile_count", &r.tile_count, true));
  SLIDE_RETURN_IF_ERROR(read_field(j, "first_tile_index", &r.first_tile_index, true));
  SLIDE_RETURN_IF_ERROR(read_field(j, "label", &r.label, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "label_index", &r.label_index, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "passthrough", &r.passthrough, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "annotations_path", &r.annotations_path, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "annotations_sha256", &r.annotations_sha256, false));
  SLIDE_RETURN_IF_ERROR(read_field(j, "status", &r.status, false));
  if (r.tile_count > std::numeric_limits<uint64_t>::max() - r.first_tile_index)
    return slide::core::data_loss("slide record's tile range overflows");
  return r;
}

// ---------------------------------------------------------------------------------------------
// LMDB helpers
// ---------------------------------------------------------------------------------------------

namespace {

constexpr const char* kMetaDb = "meta";
constexpr const char* kSlidesDb = "slides";
constexpr const char* kTilesDb = "tiles";
// A map can only double so often before size_t overflows; far beyond any real store.
constexpr int kMaxMapGrowths = 40;

struct EnvCloser {
  void operator()(MDB_env* env) const { mdb_env_close(env); }
};
using EnvPtr = std::unique_ptr<MDB_env, EnvCloser>;

// Aborts the transaction unless release()d (to commit it): a failed write transaction is dead in
// LMDB and must never be committed.
class TxnGuard {
 public:
  explicit TxnGuard(MDB_txn* txn) : txn_(txn) {}
  TxnGuard(const TxnGuard&) = delete;
  TxnGuard& operator=(const TxnGuard&) = delete;
  ~TxnGuard() {
    if (txn_) mdb_txn_abort(txn_);
  }
  MDB_txn* get() const { return txn_; }
  MDB_txn* release() { return std::exchange(txn_, nullptr); }

 private:
  MDB_txn* txn_;
};

// LMDB's consistency checks (mdb_assert: a page of the wrong type, a branch page with one key)
// call the environment's assert callback and then abort(): a flipped byte in data.mdb would kill
// every reader. Readers therefore make their LMDB calls through lmdb_guarded, which arms a
// per-thread jump point: the callback jumps back to it and the call returns MDB_CORRUPTED, with
// LMDB's message kept for lmdb_status. Only read transactions are guarded: jumping out of one
// leaves nothing held but its reader slot, which mdb_txn_abort releases (a cursor LMDB was
// moving is closed by its owner as usual). Between the jump point and LMDB's frames there are
// only frames without non-trivial destructors (lmdb_guarded's own and LMDB's C), as siglongjmp
// requires. Unguarded calls (a writer's) still abort, after the callback has said which file.
struct LmdbAssertGuard {
  sigjmp_buf jump;
  bool armed = false;
  char message[400] = {};
};
LmdbAssertGuard& lmdb_assert_guard() {
  thread_local LmdbAssertGuard guard;
  return guard;
}

extern "C" void on_lmdb_assert(MDB_env* env, const char* message) {
  LmdbAssertGuard& g = lmdb_assert_guard();
  std::snprintf(g.message, sizeof g.message, "%s", message);
  if (g.armed) {
    g.armed = false;
    siglongjmp(g.jump, 1);
  }
  const char* dir = nullptr;
  if (mdb_env_get_path(env, &dir) != 0 || dir == nullptr) dir = "?";
  std::fprintf(stderr, "store %s: data.mdb is damaged (LMDB's check failed: %s); stopping\n", dir, message);
}

// fn(args...) with LMDB's assertion failures returned as MDB_CORRUPTED instead of aborting.
template <typename... Params, typename... Args>
int lmdb_guarded(int (*fn)(Params...), Args... args) {
  // No local lives across the jump (each use asks for the thread's guard again).
  if (sigsetjmp(lmdb_assert_guard().jump, 0) != 0) return MDB_CORRUPTED;
  lmdb_assert_guard().message[0] = '\0';
  lmdb_assert_guard().armed = true;
  const int rc = fn(args...);
  lmdb_assert_guard().armed = false;
  return rc;
}

// Maps an LMDB return code to a Status: errno values as the OS meant them (ENOSPC/EDQUOT is a
// full disk), LMDB's own codes for a broken file as DataLoss, the rest Internal. MDB_CORRUPTED
// from lmdb_guarded carries LMDB's failed check.
Status lmdb_status(int rc, const std::string& what) {
  std::string m = what + ": " + mdb_strerror(rc);
  if (rc == MDB_CORRUPTED && lmdb_assert_guard().message[0] != '\0') {
    m += " (LMDB's check failed: " + std::string(lmdb_assert_guard().message) + ")";
    lmdb_assert_guard().message[0] = '\0';  // told once
  }
  switch (rc) {
    case ENOSPC:
    case EFBIG:
#ifdef EDQUOT
    case EDQUOT:
#endif
      return slide::core::resource_exhausted(std::move(m));
    case EACCES:
    case EPERM:
    case EROFS: return slide::core::permission_denied(std::move(m));
    case ENOENT:
    case ENOTDIR: return slide::core::not_found(std::move(m));
    case MDB_INVALID:
    case MDB_VERSION_MISMATCH:
    case MDB_CORRUPTED:
    case MDB_PAGE_NOTFOUND:
    case MDB_INCOMPATIBLE: return slide::core::data_loss(std::move(m));
    default: return slide::core::internal_error(std::move(m));
  }
}

MDB_val as_val(const void* data, size_t size) {
  MDB_val v;
  v.mv_size = size;
  v.mv_data = const_cast<void*>(data);
  return v;
}
MDB_val as_val(const std::string& s) { return as_val(s.data(), s.size()); }

std::array<uint8_t, 8> tile_key(uint64_t index) {
  std::array<uint8_t, 8> k{};
  for (int i = 0; i < 8; ++i) k[static_cast<size_t>(i)] = static_cast<uint8_t>(index >> (8 * (7 - i)));
  return k;
}

uint64_t tile_key_value(const MDB_val& v) {
  uint64_t x = 0;
  const auto* p = static_cast<const uint8_t*>(v.mv_data);
  for (size_t i = 0; i < 8 && i < v.mv_size; ++i) x = (x << 8) | p[i];
  return x;
}

std::string format_double(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v);  // shortest text that round-trips
  return std::string(buf, res.ptr);
}

template <typename Int>
bool parse_int(const std::string& s, Int* out) {
  auto res = std::from_chars(s.data(), s.data() + s.size(), *out);
  return res.ec == std::errc() && res.ptr == s.data() + s.size();
}

bool parse_double(const std::string& s, double* out) {
  auto res = std::from_chars(s.data(), s.data() + s.size(), *out);
  return res.ec == std::errc() && res.ptr == s.data() + s.size() && std::isfinite(*out);
}

const char* encoding_name(TileEncoding e) { return e == TileEncoding::kJpeg ? "jpeg" : "raw"; }

bool same_double(double a, double b) {
  return std::fabs(a - b) <= 1e-9 * std::max(std::fabs(a), std::fabs(b));
}

std::string labels_json(const std::vector<std::string>& names) {
  return nlohmann::json(names).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// The meta database's key -> value pairs for `meta` (the format of store.h).
std::vector<std::pair<std::string, std::string>> meta_entries(const StoreMeta& meta) {
  return {
      {"format_version", std::to_string(meta.format_version)},
      {"tile_size_px", std::to_string(meta.tile_size_px)},
      {"stride_px", std::to_string(meta.stride_px)},
      {"target_mpp_um", format_double(meta.target_mpp_um)},
      {"encoding", encoding_name(meta.encoding)},
      {"jpeg_quality", std::to_string(meta.jpeg_quality)},
      {"min_tissue", format_double(meta.min_tissue)},
      {"shard", meta.shard},
      {"max_tiles_per_slide", std::to_string(meta.max_tiles_per_slide)},
      {"seed", std::to_string(meta.seed)},
      {"thumbnail_mpp_um", format_double(meta.thumbnail_mpp_um)},
      {"passthrough", meta.passthrough ? "true" : "false"},
      {"tissue_options", meta.tissue_options},
      {"annotation_options", meta.annotation_options},
      {"stain_normalization", meta.stain_normalization},
      {"command_line", meta.command_line},
      {"label_names", labels_json(meta.label_names)},
  };
}

Result<std::optional<std::string>> get_string(MDB_txn* txn, MDB_dbi dbi, const std::string& key) {
  MDB_val k = as_val(key), v;
  int rc = lmdb_guarded(mdb_get, txn, dbi, &k, &v);
  if (rc == MDB_NOTFOUND) return std::optional<std::string>();
  if (rc != 0) return lmdb_status(rc, "read meta " + key);
  return std::optional<std::string>(std::string(static_cast<const char*>(v.mv_data), v.mv_size));
}

// Checks, right after mdb_env_open and before any data page is touched, that data.mdb holds every
// page its newest meta page references. LMDB maps the file and reads pages through the map, so a
// page past the end of a truncated file (a copy cut short, a full disk under cp) is a SIGBUS in
// the first transaction, not an error. mdb_env_open reads the two meta pages with pread and
// mdb_env_info/mdb_env_stat only read the meta pages, so this touches nothing beyond them.
// Errors: kDataLoss naming the file and both sizes.
Status check_data_file_size(MDB_env* env, const std::string& dir) {
  MDB_envinfo info;
  MDB_stat st;
  int rc = mdb_env_info(env, &info);
  if (rc == 0) rc = mdb_env_stat(env, &st);
  if (rc != 0) return lmdb_status(rc, "read environment info");
  mdb_filehandle_t fd;
  rc = mdb_env_get_fd(env, &fd);
  if (rc != 0) return lmdb_status(rc, "get data file descriptor");
  struct stat fst;
  if (::fstat(fd, &fst) != 0) return slide::core::errno_status(errno, "stat " + dir + "/data.mdb");
  // Pages 0..me_last_pgno are in use (0 and 1 are the meta pages).
  const uint64_t need = (static_cast<uint64_t>(info.me_last_pgno) + 1) * st.ms_psize;
  if (static_cast<uint64_t>(fst.st_size) < need)
    return slide::core::data_loss(dir + "/data.mdb is truncated: it has " + std::to_string(fst.st_size) +
                                  " bytes, but its last committed transaction uses pages up to " +
                                  std::to_string(info.me_last_pgno) + " (" + std::to_string(need) +
                                  " bytes); restore the store from a complete copy or tile again");
  return slide::core::ok_status();
}

// Reads and validates the meta database. A newer format is FailedPrecondition (checked first:
// its other keys may mean something else); a missing or unparsable key is DataLoss.
Result<StoreMeta> read_meta(MDB_txn* txn, MDB_dbi dbi) {
  StoreMeta m;
  auto required = [&](const char* key) -> Result<std::string> {
    SLIDE_ASSIGN_OR_RETURN(std::optional<std::string> v, get_string(txn, dbi, key));
    if (!v) return slide::core::data_loss(std::string("meta has no \"") + key + "\"");
    return *v;
  };
  auto bad = [](const char* key, const std::string& value) {
    return slide::core::data_loss(std::string("meta \"") + key + "\" has a bad value '" + value + "'");
  };
  SLIDE_ASSIGN_OR_RETURN(std::string version, required("format_version"));
  if (!parse_int(version, &m.format_version) || m.format_version < 1) return bad("format_version", version);
  if (m.format_version > kStoreFormatVersion)
    return slide::core::failed_precondition("store format version " + version +
                                            " is newer than this build reads (" +
                                            std::to_string(kStoreFormatVersion) + "); upgrade slidestream");
  const std::pair<const char*, int*> ints[] = {
      {"tile_size_px", &m.tile_size_px}, {"stride_px", &m.stride_px}, {"jpeg_quality", &m.jpeg_quality}};
  for (const auto& [key, out] : ints) {
    SLIDE_ASSIGN_OR_RETURN(std::string v, required(key));
    if (!parse_int(v, out)) return bad(key, v);
  }
  const std::pair<const char*, double*> doubles[] = {{"target_mpp_um", &m.target_mpp_um},
                                                     {"min_tissue", &m.min_tissue}};
  for (const auto& [key, out] : doubles) {
    SLIDE_ASSIGN_OR_RETURN(std::string v, required(key));
    if (!parse_double(v, out)) return bad(key, v);
  }
  SLIDE_ASSIGN_OR_RETURN(std::string enc, required("encoding"));
  if (enc == "jpeg") {
    m.encoding = TileEncoding::kJpeg;
  } else if (enc == "raw") {
    m.encoding = TileEncoding::kRawRgb;
  } else {
    return bad("encoding", enc);
  }
  SLIDE_ASSIGN_OR_RETURN(std::optional<std::string> shard, get_string(txn, dbi, "shard"));
  m.shard = shard.value_or("0/1");
  // Keys added by issue 20: a store written before them was made with the defaults of that time,
  // which are what a missing key means.
  auto optional_key = [&](const char* key, auto* out, auto parse) -> Status {
    SLIDE_ASSIGN_OR_RETURN(std::optional<std::string> v, get_string(txn, dbi, key));
    if (v && !parse(*v, out)) return bad(key, *v);
    return slide::core::ok_status();
  };
  auto parse_i64 = [](const std::string& v, int64_t* out) { return parse_int(v, out) && *out >= 0; };
  auto parse_u64 = [](const std::string& v, uint64_t* out) { return parse_int(v, out); };
  auto parse_mpp = [](const std::string& v, double* out) { return parse_double(v, out) && *out >= 0; };
  auto parse_bool = [](const std::string& v, bool* out) {
    if (v != "true" && v != "false") return false;
    *out = v == "true";
    return true;
  };
  m.max_tiles_per_slide = 0;
  m.seed = 0;
  m.passthrough = true;
  GridOptions grid;
  grid.tile_size_px = m.tile_size_px;
  grid.target_mpp_um = m.target_mpp_um;
  m.thumbnail_mpp_um = auto_thumbnail_mpp(grid);
  SLIDE_RETURN_IF_ERROR(optional_key("max_tiles_per_slide", &m.max_tiles_per_slide, parse_i64));
  SLIDE_RETURN_IF_ERROR(optional_key("seed", &m.seed, parse_u64));
  SLIDE_RETURN_IF_ERROR(optional_key("thumbnail_mpp_um", &m.thumbnail_mpp_um, parse_mpp));
  SLIDE_RETURN_IF_ERROR(optional_key("passthrough", &m.passthrough, parse_bool));
  SLIDE_ASSIGN_OR_RETURN(std::optional<std::string> tissue, get_string(txn, dbi, "tissue_options"));
  m.tissue_options = tissue.value_or("");
  SLIDE_ASSIGN_OR_RETURN(std::optional<std::string> annotations, get_string(txn, dbi, "annotation_options"));
  m.annotation_options = annotations.value_or("");
  SLIDE_ASSIGN_OR_RETURN(std::optional<std::string> stain, get_string(txn, dbi, "stain_normalization"));
  m.stain_normalization = stain.value_or("");
  SLIDE_ASSIGN_OR_RETURN(std::optional<std::string> cmd, get_string(txn, dbi, "command_line"));
  m.command_line = cmd.value_or("");
  SLIDE_ASSIGN_OR_RETURN(std::optional<std::string> labels, get_string(txn, dbi, "label_names"));
  if (labels) {
    nlohmann::json j = nlohmann::json::parse(*labels, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_array()) return bad("label_names", *labels);
    for (const auto& e : j) {
      if (!e.is_string()) return bad("label_names", *labels);
      m.label_names.push_back(e.get<std::string>());
    }
  }
  return m;
}

// Reads every slide record (any order: the slides database is keyed by id).
Result<std::vector<SlideRecord>> read_slides(MDB_txn* txn, MDB_dbi dbi) {
  std::vector<SlideRecord> out;
  MDB_cursor* raw = nullptr;
  int rc = lmdb_guarded(mdb_cursor_open, txn, dbi, &raw);  // may read a stale database's root
  if (rc != 0) return lmdb_status(rc, "open cursor on slides");
  std::unique_ptr<MDB_cursor, void (*)(MDB_cursor*)> cur(raw, mdb_cursor_close);
  MDB_val k, v;
  for (rc = lmdb_guarded(mdb_cursor_get, raw, &k, &v, MDB_FIRST); rc == 0;
       rc = lmdb_guarded(mdb_cursor_get, raw, &k, &v, MDB_NEXT)) {
    std::string id(static_cast<const char*>(k.mv_data), k.mv_size);
    auto rec = slide_record_from_json(std::string(static_cast<const char*>(v.mv_data), v.mv_size));
    if (!rec.ok()) return rec.status().with_context("slide '" + id + "'");
    if (rec->slide_id != id)
      return slide::core::data_loss("slide record under key '" + id + "' names slide '" + rec->slide_id + "'");
    out.push_back(std::move(rec).value());
  }
  if (rc != MDB_NOTFOUND) return lmdb_status(rc, "read slides");
  return out;
}

// Opens the three named databases in `txn` (a read transaction: only existing ones). Missing
// databases mean the environment is not a slidestream store.
Status open_dbis(MDB_txn* txn, MDB_dbi* meta, MDB_dbi* slides, MDB_dbi* tiles) {
  const std::pair<const char*, MDB_dbi*> dbs[] = {{kMetaDb, meta}, {kSlidesDb, slides}, {kTilesDb, tiles}};
  for (const auto& [name, out] : dbs) {
    int rc = lmdb_guarded(mdb_dbi_open, txn, name, 0u, out);
    if (rc == MDB_NOTFOUND)
      return slide::core::data_loss(std::string("not a slidestream store: no \"") + name + "\" database");
    if (rc != 0) return lmdb_status(rc, std::string("open database ") + name);
  }
  return slide::core::ok_status();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// StoreWriter
// ---------------------------------------------------------------------------------------------

struct StoreWriter::Impl {
  // One buffered change. Tiles are keyed by index, slide records by id.
  struct Op {
    enum class Kind { kPutTile, kPutSlide, kDelTile } kind;
    uint64_t tile_index = 0;
    std::string slide_id;
    std::vector<uint8_t> value;  // a tile's payload (its header is in `header`), or a slide record
    std::array<uint8_t, kTileHeaderBytes> header{};
  };

  std::string dir;
  StoreWriterOptions options;
  // The single-writer lock on the directory; declared before env so that it is released only
  // after the environment is closed.
  std::unique_ptr<slide::core::DirLock> lock;
  EnvPtr env;
  MDB_dbi meta_dbi = 0, slides_dbi = 0, tiles_dbi = 0;
  StoreMeta meta;
  std::map<std::string, SlideRecord> slides;
  uint64_t next_tile_index = 0;
  uint32_t next_slide_index = 0;
  // Every tile below this index is committed (the tiles database ends here after a commit).
  uint64_t committed_tile_end = 0;

  std::vector<Op> pending;
  size_t pending_tiles = 0;
  bool labels_dirty = false;

  bool slide_open = false;
  std::string open_id;
  uint32_t open_index = 0;
  uint64_t open_first_tile = 0;
  size_t open_pending_start = 0;  // the open slide's ops are pending[open_pending_start..]

  std::string where() const { return "store " + dir; }

  // Why a write may have come up short, or "" when neither cause applies: under 16 MiB free on
  // the store's filesystem, or data.mdb within 16 MiB of the process's file-size limit (ulimit -f).
  std::string short_write_cause() const {
    constexpr uint64_t kSlack = 16ull << 20;
    struct statvfs fs;
    if (::statvfs(dir.c_str(), &fs) == 0) {
      const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
      if (free_bytes < kSlack) return "the disk is full (" + std::to_string(free_bytes) + " bytes free)";
    }
    struct rlimit lim;
    struct stat st;
    if (::getrlimit(RLIMIT_FSIZE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
        ::stat((dir + "/data.mdb").c_str(), &st) == 0 && static_cast<uint64_t>(st.st_size) + kSlack >= lim.rlim_cur)
      return "data.mdb reached the file-size limit (ulimit -f) of " + std::to_string(lim.rlim_cur) + " bytes";
    return "";
  }

  Status grow_map() {
    MDB_envinfo info;
    int rc = mdb_env_info(env.get(), &info);
    if (rc != 0) return lmdb_status(rc, "read map size");
    const size_t grown = info.me_mapsize * 2;
    // Only legal with no transaction open in this process: the caller has just aborted its own.
    rc = mdb_env_set_mapsize(env.get(), grown);
    if (rc != 0) return lmdb_status(rc, "grow map to " + std::to_string(grown) + " bytes");
    log_info("store map grown", {{"store", dir}, {"map_bytes", grown}});
    return slide::core::ok_status();
  }

  // Runs `body` in a write transaction and commits it. On MDB_MAP_FULL (from a put or from the
  // commit) the transaction is aborted, the map doubled and `body` replayed from scratch, so the
  // body must be a pure function of the writer's state. `*op` names what failed, for the error.
  Status run_write_txn(const std::function<int(MDB_txn*, std::string*)>& body) {
    for (int attempt = 0;; ++attempt) {
      std::string op = "begin write transaction";
      int rc = 0;
      {
        MDB_txn* raw = nullptr;
        rc = mdb_txn_begin(env.get(), nullptr, 0, &raw);
        if (rc == 0) {
          TxnGuard txn(raw);
          rc = body(raw, &op);
          if (rc == 0) {
            op = "commit";
            rc = mdb_txn_commit(txn.release());  // frees the txn whether it succeeds or not
          }
        }
      }
      if (rc == 0) return slide::core::ok_status();
      if (rc == MDB_MAP_FULL && attempt < kMaxMapGrowths) {
        SLIDE_RETURN_IF_ERROR_CTX(grow_map(), where());
        continue;
      }
      if (rc == EIO) {
        // LMDB reports a short write (the disk filled up, or the file hit RLIMIT_FSIZE) as EIO.
        if (auto why = short_write_cause(); !why.empty())
          return slide::core::resource_exhausted(op + ": " + mdb_strerror(rc) + ": " + why).with_context(where());
      }
      return lmdb_status(rc, op).with_context(where());
    }
  }

  // Applies every pending op in one transaction: deletes first (abort_slide's, so a later slide
  // may append at the same keys in the same transaction), then puts in order. On failure the ops
  // stay pending.
  Status commit() {
    if (pending.empty() && !labels_dirty) return slide::core::ok_status();
    Status s = run_write_txn([this](MDB_txn* txn, std::string* op) -> int {
      for (const Op& o : pending) {
        if (o.kind != Op::Kind::kDelTile) continue;
        auto key = tile_key(o.tile_index);
        MDB_val k = as_val(key.data(), key.size());
        int rc = mdb_del(txn, tiles_dbi, &k, nullptr);
        if (rc != 0 && rc != MDB_NOTFOUND) {
          *op = "delete tile " + std::to_string(o.tile_index);
          return rc;
        }
      }
      for (const Op& o : pending) {
        int rc = 0;
        if (o.kind == Op::Kind::kPutTile) {
          auto key = tile_key(o.tile_index);
          // MDB_RESERVE: LMDB hands back the value's space and header and payload are copied
          // straight into it, with no intermediate record buffer.
          MDB_val k = as_val(key.data(), key.size()), v = as_val(nullptr, kTileHeaderBytes + o.value.size());
          rc = mdb_put(txn, tiles_dbi, &k, &v, MDB_APPEND | MDB_RESERVE);
          if (rc == 0) {
            auto* dst = static_cast<uint8_t*>(v.mv_data);
            std::memcpy(dst, o.header.data(), kTileHeaderBytes);
            if (!o.value.empty()) std::memcpy(dst + kTileHeaderBytes, o.value.data(), o.value.size());
          } else {
            *op = "put tile " + std::to_string(o.tile_index);
          }
        } else if (o.kind == Op::Kind::kPutSlide) {
          MDB_val k = as_val(o.slide_id), v = as_val(o.value.data(), o.value.size());
          rc = mdb_put(txn, slides_dbi, &k, &v, 0);
          if (rc != 0) *op = "put slide record '" + o.slide_id + "'";
        }
        if (rc != 0) return rc;
      }
      if (labels_dirty) {
        const std::string key = "label_names", value = labels_json(meta.label_names);
        MDB_val k = as_val(key), v = as_val(value);
        int rc = mdb_put(txn, meta_dbi, &k, &v, 0);
        if (rc != 0) {
          *op = "put meta label_names";
          return rc;
        }
      }
      return 0;
    });
    if (!s.ok()) return s;
    pending.clear();
    pending_tiles = 0;
    labels_dirty = false;
    committed_tile_end = next_tile_index;
    open_pending_start = 0;
    return s;
  }

  Status check_usable() const {
    if (!env) return slide::core::failed_precondition(where() + ": the writer is closed");
    return slide::core::ok_status();
  }
};

namespace {

Status check_requested_meta(const StoreMeta& m) {
  if (m.tile_size_px <= 0 || m.stride_px <= 0)
    return slide::core::invalid_argument("tile_size_px and stride_px must be positive");
  if (m.jpeg_quality < 1 || m.jpeg_quality > 100) return slide::core::invalid_argument("jpeg_quality must be in 1..100");
  if (!std::isfinite(m.target_mpp_um) || m.target_mpp_um < 0 || !std::isfinite(m.min_tissue))
    return slide::core::invalid_argument("target_mpp_um and min_tissue must be finite, target_mpp_um >= 0");
  if (m.max_tiles_per_slide < 0 || !std::isfinite(m.thumbnail_mpp_um) || m.thumbnail_mpp_um < 0)
    return slide::core::invalid_argument("max_tiles_per_slide and thumbnail_mpp_um must be finite and >= 0");
  return slide::core::ok_status();
}

// "tile_size_px=256, this run asks 224; ..." for each field that differs, "" when they agree.
std::string meta_differences(const StoreMeta& stored, const StoreMeta& asked) {
  std::string out;
  auto add = [&](const char* key, const std::string& s, const std::string& a) {
    if (!out.empty()) out += "; ";
    out += std::string(key) + "=" + s + ", this run asks " + a;
  };
  if (stored.tile_size_px != asked.tile_size_px)
    add("tile_size_px", std::to_string(stored.tile_size_px), std::to_string(asked.tile_size_px));
  if (stored.stride_px != asked.stride_px)
    add("stride_px", std::to_string(stored.stride_px), std::to_string(asked.stride_px));
  if (!same_double(stored.target_mpp_um, asked.target_mpp_um))
    add("target_mpp_um", format_double(stored.target_mpp_um), format_double(asked.target_mpp_um));
  if (stored.encoding != asked.encoding) add("encoding", encoding_name(stored.encoding), encoding_name(asked.encoding));
  if (stored.jpeg_quality != asked.jpeg_quality)
    add("jpeg_quality", std::to_string(stored.jpeg_quality), std::to_string(asked.jpeg_quality));
  if (!same_double(stored.min_tissue, asked.min_tissue))
    add("min_tissue", format_double(stored.min_tissue), format_double(asked.min_tissue));
  if (stored.shard != asked.shard) add("shard", stored.shard, asked.shard);
  if (stored.max_tiles_per_slide != asked.max_tiles_per_slide)
    add("max_tiles_per_slide", std::to_string(stored.max_tiles_per_slide), std::to_string(asked.max_tiles_per_slide));
  // The seed only picks the sample of --max-tiles-per-slide; without one it decides nothing.
  if (stored.seed != asked.seed && (stored.max_tiles_per_slide > 0 || asked.max_tiles_per_slide > 0))
    add("seed", std::to_string(stored.seed), std::to_string(asked.seed));
  if (!same_double(stored.thumbnail_mpp_um, asked.thumbnail_mpp_um))
    add("thumbnail_mpp_um", format_double(stored.thumbnail_mpp_um), format_double(asked.thumbnail_mpp_um));
  if (stored.tissue_options != asked.tissue_options && !stored.tissue_options.empty() && !asked.tissue_options.empty())
    add("tissue_options", "'" + stored.tissue_options + "'", "'" + asked.tissue_options + "'");
  if (stored.annotation_options != asked.annotation_options && !stored.annotation_options.empty() &&
      !asked.annotation_options.empty())
    add("annotation_options", "'" + stored.annotation_options + "'", "'" + asked.annotation_options + "'");
  // A store from before the key holds unnormalised tiles.
  const std::string none_stain = "{\"method\":\"none\"}";
  const std::string stored_stain = stored.stain_normalization.empty() ? none_stain : stored.stain_normalization;
  const std::string asked_stain = asked.stain_normalization.empty() ? none_stain : asked.stain_normalization;
  if (stored_stain != asked_stain) add("stain_normalization", stored_stain, asked_stain);
  // Pass-through only ever applies to JPEG stores.
  if (stored.passthrough != asked.passthrough && stored.encoding == TileEncoding::kJpeg &&
      asked.encoding == TileEncoding::kJpeg)
    add("passthrough", stored.passthrough ? "true" : "false", asked.passthrough ? "true" : "false");
  return out;
}

}  // namespace

StoreWriter::StoreWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

// Pending ops are simply dropped: no transaction is open between calls, and committing here
// would write a half-finished batch the caller never asked for.
StoreWriter::~StoreWriter() = default;

Result<std::unique_ptr<StoreWriter>> StoreWriter::open(const std::string& dir, const StoreMeta& meta,
                                                       const StoreWriterOptions& options) {
  SLIDE_RETURN_IF_ERROR_CTX(check_requested_meta(meta), "store " + dir);
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  impl->options = options;
  if (impl->options.tiles_per_txn == 0) impl->options.tiles_per_txn = 1;
  const std::string where = impl->where();
  // One writer per store, for the whole life of this writer: a second one appending at the same
  // tile indices would lose tiles (MDB_APPEND past keys it never saw). acquire() creates `dir`.
  SLIDE_ASSIGN_OR_RETURN(impl->lock, slide::core::DirLock::acquire(dir, "store"));

  MDB_env* raw_env = nullptr;
  int rc = mdb_env_create(&raw_env);
  if (rc != 0) return lmdb_status(rc, "create environment").with_context(where);
  impl->env.reset(raw_env);
  rc = mdb_env_set_maxdbs(raw_env, 4);
  if (rc == 0) rc = mdb_env_set_mapsize(raw_env, std::max<size_t>(options.initial_map_bytes, 1 << 16));
  if (rc != 0) return lmdb_status(rc, "configure environment").with_context(where);
  // Default flags: every commit is synced, so a committed slide survives a crash.
  // A writer's LMDB checks still abort (see on_lmdb_assert), but name the file first.
  rc = mdb_env_set_assert(raw_env, on_lmdb_assert);
  if (rc == 0) rc = mdb_env_open(raw_env, dir.c_str(), 0, 0664);
  if (rc != 0) return lmdb_status(rc, "open environment").with_context(where);
  SLIDE_RETURN_IF_ERROR(check_data_file_size(raw_env, dir));

  // Look at what is there in a read transaction: opening a store that needs no repair writes
  // nothing. The read transaction is committed, not aborted, so the database handles stay open.
  bool existing = false;
  std::vector<uint64_t> leftover_keys;  // tiles past the last complete slide
  {
    MDB_txn* raw = nullptr;
    rc = mdb_txn_begin(raw_env, nullptr, MDB_RDONLY, &raw);
    if (rc != 0) return lmdb_status(rc, "begin read transaction").with_context(where);
    TxnGuard txn(raw);
    MDB_dbi probe;
    rc = mdb_dbi_open(raw, kMetaDb, 0, &probe);
    if (rc == 0) {
      existing = true;
      SLIDE_RETURN_IF_ERROR_CTX(open_dbis(raw, &impl->meta_dbi, &impl->slides_dbi, &impl->tiles_dbi), where);
      SLIDE_ASSIGN_OR_RETURN_CTX(StoreMeta stored, read_meta(raw, impl->meta_dbi), where);
      std::string diff = meta_differences(stored, meta);
      if (!diff.empty()) return slide::core::failed_precondition(where + " was made with " + diff);
      impl->meta = std::move(stored);
      SLIDE_ASSIGN_OR_RETURN_CTX(std::vector<SlideRecord> records, read_slides(raw, impl->slides_dbi), where);
      for (auto& r : records) {
        impl->next_tile_index = std::max(impl->next_tile_index, r.first_tile_index + r.tile_count);
        // Indices are dense (count == max + 1); max + 1 stays safe even if they were not.
        impl->next_slide_index = std::max(impl->next_slide_index, r.index + 1);
        impl->slides.emplace(r.slide_id, std::move(r));
      }
      MDB_cursor* cur = nullptr;
      rc = mdb_cursor_open(raw, impl->tiles_dbi, &cur);
      if (rc != 0) return lmdb_status(rc, "open cursor on tiles").with_context(where);
      auto key = tile_key(impl->next_tile_index);
      MDB_val k = as_val(key.data(), key.size()), v;
      for (rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE); rc == 0; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT))
        leftover_keys.push_back(tile_key_value(k));
      mdb_cursor_close(cur);
      if (rc != MDB_NOTFOUND) return lmdb_status(rc, "scan tiles").with_context(where);
      rc = mdb_txn_commit(txn.release());
      if (rc != 0) return lmdb_status(rc, "end read transaction").with_context(where);
    } else if (rc == MDB_NOTFOUND) {
      // No meta: a fresh environment (empty main database) becomes a store; anything else is
      // somebody else's LMDB and is left alone.
      MDB_dbi main_dbi;
      MDB_stat st;
      rc = mdb_dbi_open(raw, nullptr, 0, &main_dbi);
      if (rc == 0) rc = mdb_stat(raw, main_dbi, &st);
      if (rc != 0) return lmdb_status(rc, "read main database").with_context(where);
      if (st.ms_entries != 0)
        return slide::core::data_loss(where + " is an LMDB environment but not a slidestream store (no meta database)");
    } else {
      return lmdb_status(rc, "open meta database").with_context(where);
    }
  }

  Impl& w = *impl;
  if (!existing) {
    w.meta = meta;
    w.meta.format_version = kStoreFormatVersion;
    SLIDE_RETURN_IF_ERROR(w.run_write_txn([&w](MDB_txn* txn, std::string* op) -> int {
      const std::pair<const char*, MDB_dbi*> dbs[] = {
          {kMetaDb, &w.meta_dbi}, {kSlidesDb, &w.slides_dbi}, {kTilesDb, &w.tiles_dbi}};
      for (const auto& [name, out] : dbs) {
        int rc = mdb_dbi_open(txn, name, MDB_CREATE, out);
        if (rc != 0) {
          *op = std::string("create database ") + name;
          return rc;
        }
      }
      for (const auto& [key, value] : meta_entries(w.meta)) {
        MDB_val k = as_val(key), v = as_val(value);
        int rc = mdb_put(txn, w.meta_dbi, &k, &v, 0);
        if (rc != 0) {
          *op = "put meta " + key;
          return rc;
        }
      }
      return 0;
    }));
  } else if (!leftover_keys.empty()) {
    // A killed run's partial slide: its tiles have no record, so they are not in the store.
    SLIDE_RETURN_IF_ERROR(w.run_write_txn([&w, &leftover_keys](MDB_txn* txn, std::string* op) -> int {
      for (uint64_t index : leftover_keys) {
        auto key = tile_key(index);
        MDB_val k = as_val(key.data(), key.size());
        int rc = mdb_del(txn, w.tiles_dbi, &k, nullptr);
        if (rc != 0 && rc != MDB_NOTFOUND) {
          *op = "delete leftover tile " + std::to_string(index);
          return rc;
        }
      }
      return 0;
    }));
    log_warn("removed the tiles of an unfinished slide (a previous run was interrupted)",
             {{"store", dir}, {"tiles", leftover_keys.size()}, {"from_index", w.next_tile_index}});
  }
  w.committed_tile_end = w.next_tile_index;
  return std::unique_ptr<StoreWriter>(new StoreWriter(std::move(impl)));
}

const StoreMeta& StoreWriter::meta() const { return impl_->meta; }
const std::map<std::string, SlideRecord>& StoreWriter::slides() const { return impl_->slides; }
uint64_t StoreWriter::next_tile_index() const { return impl_->next_tile_index; }
uint32_t StoreWriter::next_slide_index() const { return impl_->next_slide_index; }

int32_t StoreWriter::label_index(const std::string& name) {
  if (name.empty()) return -1;
  auto& names = impl_->meta.label_names;
  auto it = std::find(names.begin(), names.end(), name);
  if (it != names.end()) return static_cast<int32_t>(it - names.begin());
  names.push_back(name);
  impl_->labels_dirty = true;
  return static_cast<int32_t>(names.size() - 1);
}

Result<uint32_t> StoreWriter::begin_slide(const std::string& slide_id) {
  Impl& w = *impl_;
  SLIDE_RETURN_IF_ERROR(w.check_usable());
  if (w.slide_open)
    return slide::core::failed_precondition(w.where() + ": slide '" + slide_id + "' begun while slide '" + w.open_id +
                                            "' is still open");
  if (w.slides.count(slide_id))
    return slide::core::failed_precondition(w.where() + ": slide '" + slide_id + "' is already complete");
  w.slide_open = true;
  w.open_id = slide_id;
  w.open_index = w.next_slide_index;
  w.open_first_tile = w.next_tile_index;
  w.open_pending_start = w.pending.size();
  return w.open_index;
}

Status StoreWriter::add_tile(const TileHeader& header, std::span<const uint8_t> payload) {
  return add_tile(header, std::vector<uint8_t>(payload.begin(), payload.end()));
}

Status StoreWriter::add_tile(const TileHeader& header, std::vector<uint8_t>&& payload) {
  Impl& w = *impl_;
  SLIDE_RETURN_IF_ERROR(w.check_usable());
  if (!w.slide_open) return slide::core::failed_precondition(w.where() + ": add_tile without begin_slide");
  if (payload.size() > std::numeric_limits<uint32_t>::max())
    return slide::core::invalid_argument(w.where() + ": tile payload of " + std::to_string(payload.size()) +
                                         " bytes does not fit the record's 32-bit size");
  // Commit before queueing, not after: the slide's last tile then always stays pending until
  // finish_slide queues the record beside it.
  if (w.pending_tiles >= w.options.tiles_per_txn) SLIDE_RETURN_IF_ERROR(w.commit());
  TileHeader h = header;
  h.slide_index = w.open_index;
  h.payload_bytes = static_cast<uint32_t>(payload.size());
  Impl::Op op{Impl::Op::Kind::kPutTile, w.next_tile_index, {}, std::move(payload), {}};
  write_tile_header(h, op.header.data());
  w.pending.push_back(std::move(op));
  ++w.pending_tiles;
  ++w.next_tile_index;
  return slide::core::ok_status();
}

Status StoreWriter::finish_slide(SlideRecord record) {
  Impl& w = *impl_;
  SLIDE_RETURN_IF_ERROR(w.check_usable());
  if (!w.slide_open) return slide::core::failed_precondition(w.where() + ": finish_slide without begin_slide");
  if (!record.slide_id.empty() && record.slide_id != w.open_id)
    return slide::core::invalid_argument(w.where() + ": finish_slide for '" + record.slide_id + "' but slide '" +
                                         w.open_id + "' is open");
  record.slide_id = w.open_id;
  record.index = w.open_index;
  record.first_tile_index = w.open_first_tile;
  record.tile_count = w.next_tile_index - w.open_first_tile;
  record.status = "complete";
  const std::string json = slide_record_to_json(record);
  w.pending.push_back(Impl::Op{Impl::Op::Kind::kPutSlide, 0, record.slide_id, {json.begin(), json.end()}, {}});
  w.slides[record.slide_id] = std::move(record);
  ++w.next_slide_index;
  w.slide_open = false;
  if (w.pending_tiles >= w.options.tiles_per_txn) return w.commit();
  return slide::core::ok_status();
}

Status StoreWriter::abort_slide() {
  Impl& w = *impl_;
  SLIDE_RETURN_IF_ERROR(w.check_usable());
  if (!w.slide_open) return slide::core::ok_status();  // nothing begun: nothing to drop
  w.pending.resize(w.open_pending_start);
  w.pending_tiles = static_cast<size_t>(std::count_if(
      w.pending.begin(), w.pending.end(), [](const Impl::Op& o) { return o.kind == Impl::Op::Kind::kPutTile; }));
  const uint64_t committed_end = std::max(w.committed_tile_end, w.open_first_tile);
  w.slide_open = false;
  w.next_tile_index = w.open_first_tile;
  if (committed_end == w.open_first_tile) return slide::core::ok_status();
  // Some tiles already reached the store: delete them now so the next slide can append from the
  // same index (MDB_APPEND requires keys past the last one).
  for (uint64_t i = w.open_first_tile; i < committed_end; ++i)
    w.pending.push_back(Impl::Op{Impl::Op::Kind::kDelTile, i, {}, {}, {}});
  return w.commit();
}

Status StoreWriter::flush() {
  SLIDE_RETURN_IF_ERROR(impl_->check_usable());
  return impl_->commit();
}

Status StoreWriter::close() {
  if (!impl_->env) return slide::core::ok_status();
  SLIDE_RETURN_IF_ERROR(impl_->commit());
  impl_->env.reset();
  impl_->lock.reset();  // after the environment is closed: the next writer may start now
  return slide::core::ok_status();
}

// ---------------------------------------------------------------------------------------------
// StoreReader
// ---------------------------------------------------------------------------------------------

struct StoreReader::Impl {
  std::string dir;
  EnvPtr env;
  MDB_dbi meta_dbi = 0, slides_dbi = 0, tiles_dbi = 0;
  StoreMeta meta;
  std::vector<SlideRecord> slides;
  uint64_t tile_count = 0;
  // Readers hold it shared for the life of their transaction; adopting a map grown by a writer
  // (mdb_env_set_mapsize(env, 0)) is only legal with no transaction open, so it holds it unique.
  mutable std::shared_mutex resize_mu;

  // Begins a read transaction; the caller holds resize_mu shared (released and re-taken here
  // around a resize).
  int begin_read(std::shared_lock<std::shared_mutex>& lock, MDB_txn** txn) const {
    int rc = lmdb_guarded(mdb_txn_begin, env.get(), static_cast<MDB_txn*>(nullptr), static_cast<unsigned>(MDB_RDONLY), txn);
    if (rc != MDB_MAP_RESIZED) return rc;
    lock.unlock();
    {
      std::unique_lock<std::shared_mutex> excl(resize_mu);
      rc = mdb_env_set_mapsize(env.get(), 0);
    }
    lock.lock();
    if (rc != 0) return rc;
    return lmdb_guarded(mdb_txn_begin, env.get(), static_cast<MDB_txn*>(nullptr), static_cast<unsigned>(MDB_RDONLY), txn);
  }
};

StoreReader::StoreReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StoreReader::~StoreReader() = default;

Result<std::unique_ptr<StoreReader>> StoreReader::open(const std::string& dir) {
  const std::string where = "store " + dir;
  auto st = slide::core::stat_file(dir);
  if (!st.ok() || !st->is_dir) return slide::core::not_found("no store at " + dir + " (not a directory)");
  if (!slide::core::stat_file(dir + "/data.mdb").ok())
    return slide::core::not_found("no store at " + dir + " (no data.mdb)");

  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  auto try_open = [&](unsigned flags) -> int {
    MDB_env* raw = nullptr;
    int rc = mdb_env_create(&raw);
    if (rc != 0) return rc;
    impl->env.reset(raw);  // mdb_env_close also discards a failed open, as LMDB requires
    rc = mdb_env_set_maxdbs(raw, 4);
    // 0 adopts the size the file was written with instead of LMDB's 10 MiB default.
    if (rc == 0) rc = mdb_env_set_mapsize(raw, 0);
    if (rc == 0) rc = mdb_env_set_assert(raw, on_lmdb_assert);
    if (rc == 0) rc = lmdb_guarded(mdb_env_open, raw, dir.c_str(), flags, static_cast<mdb_mode_t>(0664));
    if (rc != 0) impl->env.reset();
    return rc;
  };
  int rc = try_open(MDB_RDONLY | MDB_NOTLS);
  if (rc == EACCES || rc == EROFS) {
    // A read-only copy (archive, shared dataset): lock.mdb cannot be created or opened for
    // writing. Without the lock table readers are not registered, which is safe only while no
    // writer runs on this store; a read-only directory cannot have one.
    log_debug("store lock file not writable; reading without locks", {{"store", dir}});
    rc = try_open(MDB_RDONLY | MDB_NOTLS | MDB_NOLOCK);
  }
  if (rc != 0) return lmdb_status(rc, "open environment").with_context(where);
  SLIDE_RETURN_IF_ERROR(check_data_file_size(impl->env.get(), dir));

  Impl& r = *impl;
  {
    std::shared_lock<std::shared_mutex> lock(r.resize_mu);
    MDB_txn* raw = nullptr;
    rc = r.begin_read(lock, &raw);
    if (rc != 0) return lmdb_status(rc, "begin read transaction").with_context(where);
    TxnGuard txn(raw);
    SLIDE_RETURN_IF_ERROR_CTX(open_dbis(raw, &r.meta_dbi, &r.slides_dbi, &r.tiles_dbi), where);
    SLIDE_ASSIGN_OR_RETURN_CTX(r.meta, read_meta(raw, r.meta_dbi), where);
    SLIDE_ASSIGN_OR_RETURN_CTX(r.slides, read_slides(raw, r.slides_dbi), where);
    std::sort(r.slides.begin(), r.slides.end(),
              [](const SlideRecord& a, const SlideRecord& b) { return a.index < b.index; });
    MDB_stat ms;
    rc = lmdb_guarded(mdb_stat, raw, r.tiles_dbi, &ms);
    if (rc != 0) return lmdb_status(rc, "stat tiles").with_context(where);
    r.tile_count = ms.ms_entries;
    // Committed, not aborted, so the database handles opened in it stay valid for the env.
    rc = mdb_txn_commit(txn.release());
    if (rc != 0) return lmdb_status(rc, "end read transaction").with_context(where);
  }
  return std::unique_ptr<StoreReader>(new StoreReader(std::move(impl)));
}

const StoreMeta& StoreReader::meta() const { return impl_->meta; }
const std::vector<SlideRecord>& StoreReader::slides() const { return impl_->slides; }
uint64_t StoreReader::tile_count() const { return impl_->tile_count; }

namespace {

// Tile `index`'s record inside the open read transaction `txn` of reader `r`: its header and a view
// of its payload (valid until the transaction ends). Errors: those of StoreReader::read_tile.
Status get_tile_in(const StoreReader::Impl& r, MDB_txn* txn, uint64_t index, TileHeader* header,
                   std::span<const uint8_t>* body) {
  const auto what = [&] { return "store " + r.dir + ": tile " + std::to_string(index); };
  auto key = tile_key(index);
  MDB_val k = as_val(key.data(), key.size()), v;
  int rc = lmdb_guarded(mdb_get, txn, r.tiles_dbi, &k, &v);
  if (rc == MDB_NOTFOUND) {
    if (index < r.tile_count)  // the meta counts it, the B-tree lacks it: damaged, not a caller's mistake
      return slide::core::data_loss(what() + " is missing although the store holds " + std::to_string(r.tile_count) +
                                    " tiles: data.mdb is damaged (tile it again into a new store)");
    return slide::core::out_of_range(what() + " is not in the store (" + std::to_string(r.tile_count) + " tiles)");
  }
  if (rc != 0) return lmdb_status(rc, "read").with_context(what());
  SLIDE_RETURN_IF_ERROR_CTX(
      decode_tile_record(std::span<const uint8_t>(static_cast<const uint8_t*>(v.mv_data), v.mv_size), header, body),
      what());
  return slide::core::ok_status();
}

}  // namespace

Status StoreReader::read_tile(uint64_t index, TileHeader* header, std::vector<uint8_t>* payload) const {
  const Impl& r = *impl_;
  std::shared_lock<std::shared_mutex> lock(r.resize_mu);
  MDB_txn* raw = nullptr;
  int rc = r.begin_read(lock, &raw);
  if (rc != 0)
    return lmdb_status(rc, "begin read transaction").with_context("store " + r.dir + ": tile " + std::to_string(index));
  TxnGuard txn(raw);
  TileHeader h;
  std::span<const uint8_t> body;
  SLIDE_RETURN_IF_ERROR(get_tile_in(r, raw, index, &h, &body));
  // Copy while the transaction is open: LMDB's pointer is only valid until it ends.
  payload->assign(body.begin(), body.end());
  *header = h;
  return slide::core::ok_status();
}

Status StoreReader::read_tile_headers(uint64_t first, uint64_t count, std::vector<TileHeader>* headers) const {
  const Impl& r = *impl_;
  headers->clear();
  if (count > r.tile_count || first > r.tile_count - count)
    return slide::core::out_of_range("store " + r.dir + ": tiles " + std::to_string(first) + " + " +
                                     std::to_string(count) + " are not in the store (" + std::to_string(r.tile_count) +
                                     " tiles)");
  std::shared_lock<std::shared_mutex> lock(r.resize_mu);
  MDB_txn* raw = nullptr;
  int rc = r.begin_read(lock, &raw);
  if (rc != 0) return lmdb_status(rc, "begin read transaction").with_context("store " + r.dir);
  TxnGuard txn(raw);
  headers->resize(static_cast<size_t>(count));
  std::span<const uint8_t> body;
  for (uint64_t i = 0; i < count; ++i) SLIDE_RETURN_IF_ERROR(get_tile_in(r, raw, first + i, &(*headers)[i], &body));
  return slide::core::ok_status();
}

}  // namespace slide::tile
