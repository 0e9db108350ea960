// The LMDB tile store: one LMDB environment (a directory holding data.mdb and lock.mdb) with three
// named databases. Written by one process (StoreWriter), which holds the flock(2) of
// <store>/writer.lock (slide::core::DirLock) for its whole life; read by many, lock-free
// (StoreReader). writer.lock is not part of the data: readers ignore it, and copying a store
// without it is fine.
//
//   meta   : UTF-8 key -> UTF-8 value. Keys: format_version ("1"), tile_size_px, stride_px,
//            target_mpp_um, encoding ("jpeg" | "raw"), jpeg_quality, min_tissue, shard ("i/N"),
//            max_tiles_per_slide (0 = all), seed, thumbnail_mpp_um (the tissue thumbnail's
//            resolution, resolved), passthrough ("true" | "false"), command_line, label_names
//            (JSON array; label index i is label_names[i]). Every key but command_line and
//            label_names is a setting that decides which tiles the store holds; a writer
//            reopening the store must ask for the same ones (StoreWriter::open). --source-mpp is
//            not among them: it applies per slide and each slide record keeps the mpp it used.
//            Stores written before max_tiles_per_slide .. passthrough existed lack them: a missing
//            key means the default of that time (0, 0, auto_thumbnail_mpp of the stored tile
//            size and target mpp, "true"), and a missing shard means "0/1".
//   slides : slide id (UTF-8) -> slide record, a JSON object (SlideRecord below). A record is
//            written in the same transaction as the slide's last tiles: a slide without a record
//            is not in the store, and a rerun deletes its leftover tiles and redoes it.
//   tiles  : tile index (uint64, 8 bytes big-endian, dense from 0, appended with MDB_APPEND) ->
//            48-byte little-endian header (TileHeader, layout below) followed by the payload.
//
// Tile header, little-endian, 48 bytes (Python: struct.unpack_from("<4sHHIiqqIIBBHI", value)):
//   off size field
//    0   4  magic "SLT1"
//    4   2  version (1)
//    6   2  header bytes (48); the payload starts here
//    8   4  slide index (uint32: SlideRecord::index)
//   12   4  label index (int32, -1 = none)
//   16   8  x (int64, level-0 px of the tile's top-left)
//   24   8  y (int64, level-0 px)
//   32   4  width (uint32, px)
//   36   4  height (uint32, px)
//   40   1  channels (3)
//   41   1  encoding (0 = raw RGB, interleaved row-major; 1 = JPEG)
//   42   2  reserved (0)
//   44   4  payload bytes (uint32)
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "slide/core/status.h"

namespace slide::tile {

using slide::core::Result;
using slide::core::Status;

enum class TileEncoding : uint8_t { kRawRgb = 0, kJpeg = 1 };

inline constexpr size_t kTileHeaderBytes = 48;
inline constexpr uint16_t kTileRecordVersion = 1;
inline constexpr int kStoreFormatVersion = 1;
// The largest tile side a record may declare (twice slide-tile's --tile-size limit), so that a
// corrupt header cannot size a reader's buffer.
inline constexpr uint32_t kMaxTileSidePx = 16384;

struct TileHeader {
  uint32_t slide_index = 0;
  int32_t label = -1;
  int64_t x_l0 = 0;
  int64_t y_l0 = 0;
  uint32_t width = 0;
  uint32_t height = 0;
  uint8_t channels = 3;
  TileEncoding encoding = TileEncoding::kJpeg;
  uint32_t payload_bytes = 0;  // filled by encode_tile_record
};

// Writes the kTileHeaderBytes-byte little-endian record header to `out` (layout in DESIGN.md).
void write_tile_header(const TileHeader& header, uint8_t* out);
// Appends header + payload to `out` (header.payload_bytes is set from payload.size()).
void encode_tile_record(TileHeader header, std::span<const uint8_t> payload, std::vector<uint8_t>* out);
// Parses a record; `payload` points into `record`. Validates the header against the payload before
// anything is sized from it: channels must be 3, width and height 1..kMaxTileSidePx, and a raw
// tile's payload exactly width * height * channels bytes. Errors: kDataLoss (short record, bad
// magic, unknown version or encoding, payload size mismatch, a size field out of range), with
// what is wrong.
[[nodiscard]] Status decode_tile_record(std::span<const uint8_t> record, TileHeader* header,
                                        std::span<const uint8_t>* payload);

struct StoreMeta {
  int format_version = kStoreFormatVersion;
  int tile_size_px = 256;
  int stride_px = 256;
  double target_mpp_um = 0;  // 0 for stores of patch folders without a resolution
  TileEncoding encoding = TileEncoding::kJpeg;
  int jpeg_quality = 90;
  double min_tissue = 0.5;
  std::string shard = "0/1";
  int64_t max_tiles_per_slide = 0;  // GridOptions::max_tiles (0 = all)
  uint64_t seed = 0;                // GridOptions::seed
  double thumbnail_mpp_um = 0;      // tissue thumbnail resolution (µm/px) after auto_thumbnail_mpp
  bool passthrough = true;          // TileJobOptions::passthrough (only compared for JPEG stores)
  // The tissue-detection options (tissue.h tissue_options_text); "" in stores made before they
  // were recorded, which are then not compared.
  std::string tissue_options;
  // The annotation options that decide tiles and labels (pipeline.h annotation_options_text:
  // "none", or "roi_only=... min_roi_overlap=... label_from_annotations=... min_label_overlap=...");
  // "" in stores made before it was recorded, which are then not compared.
  std::string annotation_options;
  // The stain normalisation the tiles went through at tiling time (stain.h stain_target_to_json:
  // {"method":"none"}, or the fitted Reinhard / Macenko target); "" in stores made before it was
  // recorded, which hold unnormalised tiles (compared as {"method":"none"}).
  std::string stain_normalization;
  std::string command_line;
  std::vector<std::string> label_names;
};

struct SlideRecord {
  uint32_t index = 0;            // dense slide index, the order slides were committed in
  std::string slide_id;
  std::string path;              // source path as given
  int64_t source_size_bytes = 0;
  int64_t source_mtime_ns = 0;
  std::string vendor;            // SlideProperties::vendor, or "patch" for patch images
  std::string backend;           // "openslide", "libtiff", "image"
  int64_t width_l0 = 0, height_l0 = 0;
  double source_mpp_um = 0;      // level-0 mpp used (0 unknown, for patches)
  std::string mpp_source;        // "vendor", "tiff-resolution", "override", ""
  int level = 0;                 // level read
  double downsample = 1;         // that level's downsample
  double tile_mpp_um = 0;        // resolution of the stored tiles
  double tissue_fraction = 0;    // of the whole slide (thumbnail), 0..1
  uint64_t candidate_tiles = 0;  // grid positions
  uint64_t tile_count = 0;
  uint64_t first_tile_index = 0;  // tiles are [first_tile_index, first_tile_index + tile_count)
  std::string label;             // "" = none
  int32_t label_index = -1;
  bool passthrough = false;      // tiles copied from the source's JPEG tiles without re-encoding
  std::string annotations_path;    // the GeoJSON file that filtered or labelled its tiles ("" = none)
  std::string annotations_sha256;  // its SHA-256 when it did (a rerun warns when the file changed)
  std::string status = "complete";
};

// The side in level-0 px of a tile of `tile_size_px` px at the record's tile resolution
// (tile_size_px x tile_mpp_um / source_mpp_um, rounded); tile_size_px when either mpp is unknown
// (patches). The bags' and predictions' patch_size_level0.
int32_t tile_size_level0_px(const SlideRecord& record, int64_t tile_size_px);

// JSON (nlohmann) round trip of a slide record; from_json errors are kDataLoss.
std::string slide_record_to_json(const SlideRecord& record);
[[nodiscard]] Result<SlideRecord> slide_record_from_json(const std::string& json);

struct StoreWriterOptions {
  size_t tiles_per_txn = 256;          // bounded write transactions
  size_t initial_map_bytes = 1ull << 30;  // grows (doubling) on MDB_MAP_FULL
};

// Writes a store. Not thread-safe: one writer thread calls it.
//
// Transactions: add_tile/finish_slide buffer puts; a transaction commits when the buffer holds
// tiles_per_txn tiles, on flush(), and on close(). A slide's record is always in the same
// transaction as its last tile. MDB_MAP_FULL aborts the transaction, doubles the map and replays
// it. A failed commit leaves every earlier transaction intact.
class StoreWriter {
 public:
  // Opens or creates the store at `dir` (created if missing). For an existing store, the meta in
  // it must agree with `meta` on every setting that decides the tiles: tile size, stride, target
  // mpp, encoding, JPEG quality, min_tissue, shard, max_tiles_per_slide, seed (only when either
  // side samples: max_tiles_per_slide > 0), thumbnail_mpp_um, passthrough (only when both are
  // JPEG stores), else kFailedPrecondition listing each difference as
  // "key=stored, this run asks asked"; label names and the command line are taken from the
  // store. Tiles past the last complete slide (a killed run's partial slide) are deleted, and
  // their count logged. The writer takes the store's single-writer lock (<dir>/writer.lock)
  // before it opens or changes anything and holds it until close() or its destruction; a second
  // writer fails at once with kUnavailable, naming the store and the holder's pid.
  // Errors also: kPermissionDenied / kNotFound (unwritable directory),
  // kResourceExhausted (disk full), kDataLoss (not an LMDB store, a truncated data.mdb, or an
  // unreadable record),
  // kFailedPrecondition (a newer format version).
  [[nodiscard]] static Result<std::unique_ptr<StoreWriter>> open(const std::string& dir, const StoreMeta& meta,
                                                                 const StoreWriterOptions& options = {});
  ~StoreWriter();  // aborts any uncommitted transaction, never commits

  const StoreMeta& meta() const;
  // Complete slides by id.
  const std::map<std::string, SlideRecord>& slides() const;
  uint64_t next_tile_index() const;
  uint32_t next_slide_index() const;
  // Index of label `name` ("" -> -1), appending it to label_names if new (persisted with the
  // next commit).
  int32_t label_index(const std::string& name);

  // Starts a slide; returns its slide index. kFailedPrecondition if a slide is already open or
  // the id is already complete.
  [[nodiscard]] Result<uint32_t> begin_slide(const std::string& slide_id);
  // Appends a tile of the open slide (slide_index is set by the writer). Errors: those of commit.
  [[nodiscard]] Status add_tile(const TileHeader& header, std::span<const uint8_t> payload);
  // The same, taking the payload without copying it (it is written into LMDB's page at commit).
  [[nodiscard]] Status add_tile(const TileHeader& header, std::vector<uint8_t>&& payload);
  // Completes the open slide: fills record.index, first_tile_index, tile_count, status and queues
  // it with the slide's last tiles.
  [[nodiscard]] Status finish_slide(SlideRecord record);
  // Drops the open slide: its buffered tiles are discarded and its committed tiles deleted; the
  // next slide reuses its tile and slide indices.
  [[nodiscard]] Status abort_slide();
  // Commits what is buffered (tiles of an open slide may be committed without their record).
  // Errors: kResourceExhausted (disk full: ENOSPC), kInternal with LMDB's message.
  [[nodiscard]] Status flush();
  // flush() and close the environment.
  [[nodiscard]] Status close();

  struct Impl;

 private:
  explicit StoreWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Reads a store. Thread-safe: each call uses its own read transaction (MDB_NOTLS), so any number
// of threads may read at once, beside a live writer.
class StoreReader {
 public:
  // Errors: kNotFound (no store at dir), kDataLoss (not a slidestream store: missing databases
  // or meta; data.mdb shorter than the pages its meta page references, e.g. a truncated copy,
  // found before any data page is read, so never a SIGBUS), kFailedPrecondition (newer format
  // version). Works on read-only directories.
  [[nodiscard]] static Result<std::unique_ptr<StoreReader>> open(const std::string& dir);
  ~StoreReader();

  const StoreMeta& meta() const;
  // Complete slides, ordered by slide index.
  const std::vector<SlideRecord>& slides() const;
  // Number of tiles (entries of the tiles database).
  uint64_t tile_count() const;
  // Reads tile `index`: header and payload (the payload is copied). Errors: kOutOfRange (index at or
  // past tile_count()), kDataLoss (bad record, or a tile below tile_count() missing: a damaged
  // data.mdb).
  [[nodiscard]] Status read_tile(uint64_t index, TileHeader* header, std::vector<uint8_t>* payload) const;
  // The headers of tiles [first, first + count) in one read transaction, payloads not copied
  // (e.g. the per-tile labels of a store tiled with --label-from-annotations); `headers` gets
  // `count` entries. Errors: those of read_tile, kOutOfRange for a range past tile_count().
  [[nodiscard]] Status read_tile_headers(uint64_t first, uint64_t count, std::vector<TileHeader>* headers) const;

  struct Impl;

 private:
  explicit StoreReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace slide::tile
