// The tiling pipeline: inputs (slides, directories, a CSV manifest, patch folders) -> one LMDB
// tile store, slide by slide, resumable.
//
// Per slide: open (OpenSlide, else libtiff) -> mpp (vendor, TIFF tags, else --source-mpp, else a
// per-slide error) -> tissue mask on a thumbnail -> tile grid -> tiles read and JPEG-encoded by a
// thread pool (or copied from the source's JPEG tiles when the grid is aligned with them) ->
// committed in order by one writer (this thread) -> the slide record with the last tiles.
// Memory is bounded by the thumbnail plus a window of in-flight tiles (4 per thread).
//
// Failure isolation: any error of one slide (corrupt, unreadable, missing mpp, zero tiles is not
// an error but is reported) aborts that slide's tiles, is recorded in the summary, and the run
// goes on. Errors of the store itself (disk full, unwritable) end the run: what was committed
// stays readable. A tile that cannot be read is such an error, pass-through included: every
// copied source JPEG tile is first checked to decode cleanly (validate_jpeg: its size, and no
// libjpeg warning such as "Corrupt JPEG data"), and a corrupt one fails its slide, naming the
// tile's level-0 (x0, y0), exactly as a tile whose pixels cannot be decoded does.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "slide/core/status.h"
#include "slide/tile/grid.h"
#include "slide/tile/stain.h"
#include "slide/tile/store.h"
#include "slide/tile/tissue.h"

namespace slide::tile {

struct SlideInput {
  std::string slide_id;  // unique within a run: file stem, manifest id, or "class/stem" for patches
  std::string path;
  std::string label;     // "" = none
  bool is_patch = false;  // a single patch image (from a patch folder), not a whole-slide image
  std::string annotations;  // GeoJSON file from the manifest's `annotations` column ("" = none)
};

// Expands inputs into slides, in a deterministic order:
// - a file: one slide, id = file name without its extension;
// - a directory: every entry in it (not recursive) whose extension is a slide format (.svs .tif
//   .tiff .ndpi .vms .vmu .scn .mrxs .svslide .bif; .czi is not OpenSlide 3.4), sorted by name;
//   entries that are not regular files (directories named like slides, FIFOs, sockets, symlink
//   loops, dangling links) are listed too, so that they fail as slides, named in the summary;
// - manifests: CSV with a header line `slide_id,path[,label][,annotations]` (paths relative to
//   the CSV's directory; annotations: a GeoJSON file for that slide), in file order;
// - patch folders: DIR/<class>/*.{jpg,jpeg,png,tif,tiff}, classes and files sorted by name, id
//   "<class>/<file stem>", label = class.
// Ids and labels that are not valid UTF-8 (a file name in Latin-1) have their stray bytes escaped
// as %XX (slide::core::utf8_or_escaped), with a warning: they are text in the store's records.
// Never throws (std::filesystem's error_code overloads throughout).
// Errors: kNotFound (a path that does not exist), errno's code for a directory that cannot be
// listed, naming it; kInvalidArgument (bad CSV line, with the line
// number; duplicate slide ids, naming both paths; an empty input list).
[[nodiscard]] Result<std::vector<SlideInput>> collect_inputs(const std::vector<std::string>& paths,
                                                             const std::vector<std::string>& manifests,
                                                             const std::vector<std::string>& patch_dirs);

struct TileJobOptions {
  GridOptions grid;
  TissueOptions tissue;  // tissue.thumbnail_mpp_um <= 0: auto_thumbnail_mpp(grid)
  TileEncoding encoding = TileEncoding::kJpeg;
  int jpeg_quality = 90;
  double source_mpp_um = 0;   // used when a slide has no mpp of its own (0 = none)
  bool passthrough = true;    // copy aligned source JPEG tiles without re-encoding
  // Stain normalisation at tiling time (stain.h; method kNone: tiles as read): each tile's pixels
  // are normalised to the target before they are encoded, so pass-through is off; the store's
  // meta records the target (StoreMeta::stain_normalization) and a rerun with another is refused.
  StainTarget stain;
  int threads = 2;            // read + encode workers
  int shard_index = 0;        // this run writes slides k with k % shard_count == shard_index
  int shard_count = 1;
  std::string qc_dir;         // "" = no QC pictures; else <qc_dir>/<slide_file_stem(slide id)>.png
  double qc_mpp_um = 8;       // the QC picture's resolution (its longer side at most 2048 px)
  size_t tiles_per_txn = 256;
  std::string command_line;
  bool progress = true;
  // Annotations (slide/tile/annotations.h). annotations_path: a GeoJSON file (every slide) or a
  // directory holding <slide file stem>.geojson or .json; a manifest's `annotations` column wins.
  // A slide with no annotation file found is tiled as without annotations when neither
  // roi_only nor label_from_annotations is set, else it fails (kNotFound).
  std::string annotations_path;
  bool roi_only = false;            // keep tiles whose square is >= min_roi_overlap annotated
  double min_roi_overlap = 0.5;
  bool label_from_annotations = false;  // tile label = class covering >= min_label_overlap
  double min_label_overlap = 0.5;
  // Set from a signal handler: the run stops after committing the current transaction.
  const std::atomic<bool>* cancel = nullptr;
};

// The annotation options that decide a store's tiles and labels, as one line for its record
// (StoreMeta::annotation_options): "none" when annotations are not used (neither roi_only nor
// label_from_annotations), else "roi_only=1 min_roi_overlap=0.5 label_from_annotations=0
// min_label_overlap=0.5" (the overlaps only where they apply). The GeoJSON files themselves are
// recorded per slide (SlideRecord::annotations_sha256).
std::string annotation_options_text(const TileJobOptions& options);

// The tissue thumbnail's resolution (µm/px) for a grid: at least 8 thumbnail pixels across a
// tile's side, so a tile's tissue fraction comes from >= 64 mask pixels, but never coarser than
// 16 µm/px (CLAM segments at a 64x downsample: 16 µm/px on a 40x scan) nor finer than 2 µm/px.
// tile_size_px * target_mpp_um / 8, clamped to [2, 16]; 8 when the target is unknown (patches).
double auto_thumbnail_mpp(const GridOptions& grid);

enum class SlideOutcomeKind { kTiled, kAlreadyComplete, kZeroTiles, kFailed, kNotInShard };

struct SlideOutcome {
  std::string slide_id;
  std::string path;
  SlideOutcomeKind kind = SlideOutcomeKind::kFailed;
  Status error;             // for kFailed
  uint64_t tiles = 0;
  uint64_t candidates = 0;
  double seconds = 0;
  bool passthrough = false;
  double tissue_fraction = 0;
};

struct RunSummary {
  std::vector<SlideOutcome> slides;
  bool cancelled = false;
  uint64_t tiles_written = 0;
  double seconds = 0;

  int count(SlideOutcomeKind kind) const;
};

// Runs the job into the store at `store_dir` (created or resumed). Returns the summary; a
// non-OK Result only for errors that end the whole run (the store cannot be opened or written:
// kPermissionDenied, kResourceExhausted, kFailedPrecondition when any setting recorded in the
// store's meta differs (StoreWriter::open), kUnavailable when another process is writing the
// store, ...). Per slide, anything that is not a regular file (a FIFO, socket, device, symlink
// loop) fails that slide before it is opened, and an allocation failure while tiling a slide
// fails that slide with kResourceExhausted; the run goes on. A failed slide's error names its
// path once.
[[nodiscard]] Result<RunSummary> run_tiling(const std::vector<SlideInput>& inputs, const std::string& store_dir,
                                            const TileJobOptions& options);

// Human-readable summary table (one line per slide, then totals).
// `quiet` (slide-tile -q): only the failed and zero-tile slides, and the summary line when there
// is any (an empty string otherwise).
std::string format_summary(const RunSummary& summary, bool quiet = false);

}  // namespace slide::tile
