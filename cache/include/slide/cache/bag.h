// HDF5 feature bags: one file per slide holding one feature vector per tile, the input of
// slide-level multiple-instance learning (MIL). Written by slide-embed, read by MIL training.
//
// File layout (CLAM's extract_features_fp.py and TRIDENT read it unchanged: they use `features`
// and `coords`; everything else is extra):
//
//   /features   N x D dataset, float32 (H5T_IEEE_F32LE) or float16 (IEEE 754 binary16, little-
//               endian: h5py and PyTorch read it as numpy.float16), chunked (chunk_rows x D rows),
//               maximum shape (unlimited) x D, optionally compressed (gzip, or lzf: HDF5 filter
//               32000 in h5py's format, which h5py reads natively; this library registers it on
//               Debian's liblzf; other C readers need an LZF filter plugin).
//   /coords     N x 2 dataset, int32 (H5T_STD_I32LE), chunked the same: row i is the level-0 x and
//               y, in pixels, of tile i's top-left corner. Row i of /coords is row i of /features.
//               Attributes: patch_size_level0 (int32, the tile's side in level-0 px); patch_level
//               and patch_size (int32) in TRIDENT's convention by default (0, and the tile's side
//               at the tile resolution) or CLAM's with slide-embed --layout clam (the level read,
//               and the tile's side at that level: CLAM's read_region(coord, patch_level,
//               (patch_size, patch_size)) covers the tile); TRIDENT's level0_magnification and
//               target_magnification (int32, 10 / mpp rounded; 0 unknown), overlap (int32, 0),
//               level0_width and level0_height (int64). Coordinates are always level-0.
//   attributes on the root group "/" (scalars; strings are variable-length UTF-8):
//     slide_id        string   the store's slide id
//     label           string   the store's slide label ("" when the store has none)
//     tile_size_px    int32    tile side in pixels, as embedded
//     mpp_um          float64  µm per pixel of the tiles (0 = unknown, e.g. patch folders)
//     model           string   backbone name ("resnet50", "resnet18", "small_cnn", ...)
//     layer           string   where the backbone was cut ("layer3", "layer4", "fc", ...)
//     feature_dim     int32    D
//     weights_sha256  string   SHA-256 (hex) of the weights file the features came from
//     tool_version    string   "slide-embed <version>"
//     format_version  int32    1 (kBagFormatVersion)
//   and, only when they apply: encoder_input_px (int32, tiles resized to the encoder's input),
//     stain_normalization (string, JSON of the fitted stain target: slide-embed --stain-normalize)
//     precision (string, "tf32", "bf16" or "fp16": the encoder's math precision, slide-embed --precision)
//     and attention_heads (int32, a ViT encoder's head count: slide-embed --heads or the preset's)
//
// Atomicity: BagWriter writes `<path>.partial` and renames it to `<path>` in commit(): a bag that
// exists under its final name is complete. A `.partial` file is garbage from a killed run; the
// next writer of the same bag truncates it.
//
// Locking: HDF5's own file locking is used as HDF5 configures it, so HDF5_USE_FILE_LOCKING=FALSE
// in the environment turns it off (as HDF5 documents). Readers ask for locking but ignore it
// where the filesystem does not support it (NFS, Lustre), and open files read-only, so bags on a
// read-only or network filesystem can be read.
//
// Threads: Debian's HDF5 is built thread-safe (one global lock), so different readers may be used
// from different threads (their calls are serialised by HDF5); one BagReader or BagWriter object
// must not be used from two threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "slide/core/status.h"

namespace slide::cache {

using slide::core::Result;
using slide::core::Status;

inline constexpr int kBagFormatVersion = 1;

enum class FeatureDtype { kFloat32, kFloat16 };
// "float32" / "float16".
const char* feature_dtype_name(FeatureDtype dtype);
// Parses "float32" / "float16" (also "f32", "f16", "fp32", "fp16", "half"). kInvalidArgument otherwise.
[[nodiscard]] Result<FeatureDtype> parse_feature_dtype(const std::string& name);

enum class Compression { kNone, kGzip, kLzf };
// "none" / "gzip" / "lzf".
const char* compression_name(Compression compression);
// Parses "none" / "gzip" / "lzf". kInvalidArgument otherwise.
[[nodiscard]] Result<Compression> parse_compression(const std::string& name);
// True when the HDF5 library can encode `compression` here (gzip: HDF5's deflate; lzf: registered
// by this library). kNone is always available.
bool compression_available(Compression compression);

// The root attributes of a bag (see the layout above).
struct BagAttributes {
  std::string slide_id;
  std::string label;            // "" = none
  int32_t tile_size_px = 0;
  int32_t tile_size_l0_px = 0;  // the tile's side in level-0 px (coords attribute patch_size_level0)
  double mpp_um = 0;            // of the tiles; 0 = unknown
  std::string model;
  std::string layer;
  std::string weights_sha256;
  std::string tool_version;
  // /coords' patch_level and patch_size. TRIDENT's convention (the default): patch_level 0 and
  // patch_size the tile's side at the tile resolution (patch_size 0 here: tile_size_px). CLAM's
  // (slide-embed --layout clam): patch_level the pyramid level the tiles were read from and
  // patch_size the tile's side at that level, so that CLAM's read_region(coord, patch_level,
  // (patch_size, patch_size)) covers the tile.
  int32_t patch_level = 0;
  int32_t patch_size = 0;
  // TRIDENT's other /coords attributes (0 when unknown): magnifications as 10 / mpp, rounded
  // (0.25 um/px is 40x), the tiles' overlap in px, and the slide's level-0 size.
  int32_t level0_magnification = 0, target_magnification = 0, overlap = 0;
  int64_t level0_width = 0, level0_height = 0;
  // The side of the images the encoder ran on when the tiles were resized to its input size
  // (root attribute encoder_input_px, written only then); 0: the tiles went in as stored.
  int32_t encoder_input_px = 0;
  // The stain normalisation the tiles went through before the encoder (slide-embed
  // --stain-normalize): the fitted target as JSON (slide/train/stain.h stain_target_to_json, e.g.
  // {"macenko_he":[[..],[..],[..]],"macenko_max_c":[..],"method":"macenko"}), root string attribute
  // stain_normalization, written only then; "": none (and bags from before the option).
  std::string stain_normalization;
  // The math precision of the encoder's products (slide-embed --precision: "tf32", "bf16" or "fp16"), root
  // string attribute precision, written only then; "": fp32 (and bags from before the option).
  std::string precision;
  // A Vision Transformer encoder's attention heads (root attribute attention_heads, written only for
  // ViTs); 0: a CNN, or a bag from before the attribute.
  int32_t attention_heads = 0;
};

// The most bytes of features in one HDF5 chunk (BagWriterOptions::chunk_rows is lowered to fit;
// HDF5 refuses chunks of 4 GiB or more).
inline constexpr int64_t kMaxChunkFeatureBytes = int64_t{64} << 20;

struct BagWriterOptions {
  FeatureDtype dtype = FeatureDtype::kFloat32;
  Compression compression = Compression::kNone;
  int gzip_level = 4;        // 1..9, for kGzip
  int64_t chunk_rows = 256;  // rows per HDF5 chunk and per write; the writer buffers at most this
                             // (fewer where chunk_rows x D features would pass kMaxChunkFeatureBytes)
};

// Writes one bag, appending rows as tiles are embedded. Memory: one chunk of rows
// (chunk_rows x (D + 2) values) whatever the number of rows. Not thread-safe.
class BagWriter {
 public:
  // Creates (truncating any leftover) `<path>.partial` with empty /features (0 x feature_dim) and
  // /coords (0 x 2) and the attributes. `path` is the final name (e.g. "bags/slide-1.h5"); its
  // directory must exist. Errors: kInvalidArgument (feature_dim < 1, chunk_rows < 1, gzip_level
  // outside 1..9, empty slide_id), kFailedPrecondition (the compression filter is not available),
  // kPermissionDenied / kNotFound / kResourceExhausted / kInternal when HDF5 cannot create the
  // file, each naming the path.
  [[nodiscard]] static Result<std::unique_ptr<BagWriter>> create(const std::string& path, int64_t feature_dim,
                                                                 const BagAttributes& attributes,
                                                                 const BagWriterOptions& options = {});
  // Removes `<path>.partial` if still there (an uncommitted bag is never left behind to look
  // complete; it would not anyway, under its .partial name).
  ~BagWriter();

  // Appends `rows` rows: `features` is rows x D float32 (row-major; converted to float16 with
  // round-to-nearest-even when the dtype is float16), `coords` is rows x 2 (x_l0, y_l0) per row.
  // Errors: kInvalidArgument (span sizes are not rows x D and rows x 2; coordinates outside
  // int32), kOutOfRange (a NaN or inf feature, or with float16 one that would round to inf,
  // |v| >= 65520: naming its row and column; nothing of this call is written), kResourceExhausted (disk full, or
  // the file size limit: EFBIG),
  // kInternal (HDF5 write error, with its message); after an error the writer is dead: every
  // later call returns kFailedPrecondition.
  [[nodiscard]] Status append(int64_t rows, std::span<const float> features, std::span<const int64_t> coords);

  // Writes the buffered rows, closes the file, fsyncs it and renames `<path>.partial` to `<path>`
  // (replacing an existing file of that name), then fsyncs the directory. Errors: those of
  // append, and kInternal / kPermissionDenied / kResourceExhausted from close, fsync or rename;
  // on error every HDF5 object of the bag is closed (or, where HDF5 cannot close a file whose
  // flush failed, never touched again: see quiet_hdf5 in bag.cpp), the .partial file is removed
  // and `<path>` is untouched; the process can go on (other bags) and exits normally.
  [[nodiscard]] Status commit();

  // Removes `<path>.partial` without committing. Idempotent.
  void discard();

  int64_t rows() const;          // rows appended so far
  int64_t feature_dim() const;
  const std::string& path() const;          // the final name
  std::string partial_path() const;         // `<path>.partial`

  struct Impl;

 private:
  explicit BagWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What a bag holds, read from its header only (no feature data).
struct BagInfo {
  std::string path;
  BagAttributes attributes;
  int64_t num_tiles = 0;     // N
  int64_t feature_dim = 0;   // D
  FeatureDtype dtype = FeatureDtype::kFloat32;
  Compression compression = Compression::kNone;
  int64_t file_bytes = 0;
};

// A whole bag in memory: features N x D float32 (row-major), coords N x 2 (x_l0, y_l0).
struct Bag {
  BagInfo info;
  std::vector<float> features;
  std::vector<int32_t> coords;
};

// Reads one bag, a slice at a time if wished (only the chunks a slice touches are read). Not
// thread-safe (one object per thread; see the file comment).
class BagReader {
 public:
  // Opens `path` read-only. Errors: kNotFound (no such file), kPermissionDenied, kDataLoss (not
  // an HDF5 file, a missing or mis-shaped /features or /coords, a dtype other than float32/16,
  // N differing between them), kFailedPrecondition (format_version newer than this reader);
  // the message names the path. Bags without our attributes (e.g. CLAM's own .h5 files) open:
  // the attributes missing are left at their defaults.
  [[nodiscard]] static Result<std::unique_ptr<BagReader>> open(const std::string& path);
  ~BagReader();

  const BagInfo& info() const;
  int64_t num_tiles() const { return info().num_tiles; }
  int64_t feature_dim() const { return info().feature_dim; }

  // Reads rows [row_begin, row_begin + row_count) of /features into `out` (row_count x D float32,
  // float16 widened exactly). Errors: kOutOfRange (rows outside 0..N), kInvalidArgument
  // (out.size() != row_count x D), kDataLoss (HDF5 read error: a truncated or corrupt file; a
  // NaN or inf value, naming the file, its row and column: features must be finite).
  [[nodiscard]] Status read_features(int64_t row_begin, int64_t row_count, std::span<float> out) const;
  // The same for /coords: out is row_count x 2 (x_l0, y_l0).
  [[nodiscard]] Status read_coords(int64_t row_begin, int64_t row_count, std::span<int32_t> out) const;
  // The whole bag. Errors: those of read_features / read_coords.
  [[nodiscard]] Result<Bag> read_all() const;

  struct Impl;

 private:
  explicit BagReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Convenience: BagReader::open(path)->read_all().
[[nodiscard]] Result<Bag> read_bag(const std::string& path);

// The bags of a directory: every `*.h5` file directly in `dir` (not `*.h5.partial`), sorted by
// file name, each opened for its header only. Errors: kNotFound (no such directory), and the first
// bag that fails to open (kDataLoss naming it), unless `skip_bad` is true, in which case bad files
// are left out and their errors appended to `*skipped` (when not null).
[[nodiscard]] Result<std::vector<BagInfo>> list_bags(const std::string& dir, bool skip_bad = false,
                                                     std::vector<Status>* skipped = nullptr);

// The bag manifest, `<dir>/bags.csv` written by slide-embed at the end of a run:
//   slide_id,file,num_tiles,feature_dim,dtype,label
// `file` is the bag's file name relative to the manifest's directory. One row per bag, sorted by
// slide id; fields quoted as RFC 4180 where needed (slide/core/csv.h reads them).
struct ManifestEntry {
  std::string slide_id;
  std::string path;          // absolute or relative to the working directory: dir + "/" + file
  int64_t num_tiles = 0;
  int64_t feature_dim = 0;
  FeatureDtype dtype = FeatureDtype::kFloat32;
  std::string label;
};
inline constexpr const char* kManifestName = "bags.csv";

// Writes `<dir>/bags.csv` atomically (core::write_file_atomic) from `bags` (paths must be in `dir`).
// Errors: those of write_file_atomic.
[[nodiscard]] Status write_manifest(const std::string& dir, const std::vector<BagInfo>& bags);
// Reads a manifest written by write_manifest; `path` is the CSV. Errors: kNotFound, kDataLoss (a
// wrong header, a row with a missing or non-numeric field, naming the line).
[[nodiscard]] Result<std::vector<ManifestEntry>> read_manifest(const std::string& path);

// The file name of a slide's bag: slide::core::slide_file_stem(slide_id) + ".h5" (the one rule
// for file names made from slide ids, slide/core/file_name.h: never leaves its directory, at most
// 203 bytes, unique per id; "TCGA-A1-0001.svs" -> "TCGA-A1-0001.svs.h5", "../../x" ->
// "_._.._x~<12 hex digits>.h5"). The full id is the bag's slide_id attribute.
std::string bag_file_name(const std::string& slide_id);

// The rule of bags written before bag_file_name used slide_file_stem: every character other than
// [A-Za-z0-9._-] replaced by '_', a leading '.' by '_', then ".h5" (ids differing only in
// replaced characters collided; long ids could exceed the file-name limit). slide-embed uses it
// only to find such a bag from an earlier run, checking its slide_id attribute.
std::string legacy_bag_file_name(const std::string& slide_id);

// IEEE 754 binary16 <-> binary32: round to nearest even (overflow to inf, NaN kept NaN), and
// the exact widening. Used by the writer and the reader; public for tests and MIL code.
uint16_t float_to_half(float value);
float half_to_float(uint16_t bits);

}  // namespace slide::cache
