#include "slide/tile/pipeline.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <new>
#include <sstream>
#include <stdexcept>

#include "slide/core/csv.h"
#include "slide/core/file.h"
#include "slide/core/file_name.h"
#include "slide/core/hash.h"
#include "slide/core/log.h"
#include "slide/core/progress.h"
#include "slide/core/thread_pool.h"
#include "slide/tile/annotations.h"
#include "slide/tile/image.h"
#include "slide/tile/slide.h"

namespace slide::tile {
namespace fs = std::filesystem;
using slide::core::log_debug;
using slide::core::log_info;
using slide::core::log_warn;

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool is_slide_extension(const std::string& ext) {
  static const char* kExts[] = {".svs", ".tif", ".tiff", ".ndpi", ".vms", ".vmu", ".scn", ".mrxs", ".svslide", ".bif"};
  std::string e = lower(ext);
  return std::any_of(std::begin(kExts), std::end(kExts), [&](const char* k) { return e == k; });
}

bool is_patch_extension(const std::string& ext) {
  std::string e = lower(ext);
  return e == ".jpg" || e == ".jpeg" || e == ".png" || e == ".tif" || e == ".tiff";
}

Status read_manifest(const std::string& csv, std::vector<SlideInput>* out) {
  // A FIFO or device named as the manifest would block the open below forever.
  struct stat st {};
  if (::stat(csv.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return slide::core::invalid_argument("manifest " + csv + ": not a regular file (a FIFO, device or directory)");
  std::ifstream in(csv);
  if (!in) return slide::core::errno_status(errno, "open manifest " + csv);
  std::string line;
  int line_no = 0;
  fs::path base = fs::path(csv).parent_path();
  int id_col = -1, path_col = -1, label_col = -1, annot_col = -1;
  while (std::getline(in, line)) {
    ++line_no;
    if (slide::core::csv_line_is_blank(line)) continue;
    auto fields = slide::core::split_csv_line(line);
    if (id_col < 0) {
      for (size_t i = 0; i < fields.size(); ++i) {
        if (fields[i] == "slide_id") id_col = static_cast<int>(i);
        if (fields[i] == "path") path_col = static_cast<int>(i);
        if (fields[i] == "label") label_col = static_cast<int>(i);
        if (fields[i] == "annotations") annot_col = static_cast<int>(i);
      }
      if (id_col < 0 || path_col < 0)
        return slide::core::invalid_argument(csv + ":" + std::to_string(line_no) +
                                             ": the header must name the columns slide_id,path[,label]");
      continue;
    }
    int need = std::max(id_col, path_col);
    if (static_cast<int>(fields.size()) <= need)
      return slide::core::invalid_argument(csv + ":" + std::to_string(line_no) + ": expected at least " +
                                           std::to_string(need + 1) + " fields, got " + std::to_string(fields.size()));
    SlideInput s;
    s.slide_id = fields[id_col];
    fs::path p = fields[path_col];
    s.path = p.is_absolute() ? p.string() : (base / p).string();
    if (label_col >= 0 && label_col < static_cast<int>(fields.size())) s.label = fields[label_col];
    if (annot_col >= 0 && annot_col < static_cast<int>(fields.size()) && !fields[annot_col].empty()) {
      fs::path a = fields[annot_col];
      s.annotations = a.is_absolute() ? a.string() : (base / a).string();
    }
    if (s.slide_id.empty() || fields[path_col].empty())
      return slide::core::invalid_argument(csv + ":" + std::to_string(line_no) + ": empty slide_id or path");
    out->push_back(std::move(s));
  }
  if (id_col < 0) return slide::core::invalid_argument(csv + ": empty manifest (no header line)");
  return slide::core::ok_status();
}

std::string fmt_double(double v, int digits = 4) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return buf;
}

// The entries of directory `dir`, sorted by path, through the non-throwing std::filesystem calls
// (a symlink loop or an unreadable entry must not throw). Errors: listing the directory fails
// (errno's code, naming the directory).
Status list_dir(const std::string& dir, std::vector<fs::directory_entry>* out) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) out->push_back(*it);
  if (ec) return slide::core::errno_status(ec.value(), "list directory " + dir);
  std::sort(out->begin(), out->end(),
            [](const fs::directory_entry& a, const fs::directory_entry& b) { return a.path() < b.path(); });
  return slide::core::ok_status();
}

// What an entry is, following symlinks; file_type::unknown when that cannot be told (a symlink
// loop: ELOOP, a dangling link, no permission).
fs::file_type entry_type(const fs::directory_entry& e) {
  std::error_code ec;
  fs::file_status st = e.status(ec);
  return ec ? fs::file_type::unknown : st.type();
}

}  // namespace

Result<std::vector<SlideInput>> collect_inputs(const std::vector<std::string>& paths,
                                               const std::vector<std::string>& manifests,
                                               const std::vector<std::string>& patch_dirs) {
  std::vector<SlideInput> out;
  for (const auto& p : paths) {
    std::error_code ec;
    auto st = fs::status(p, ec);
    if (st.type() == fs::file_type::not_found)
      return slide::core::not_found("input " + p + ": no such file or directory");
    if (fs::is_directory(st)) {
      std::vector<fs::directory_entry> entries;
      SLIDE_RETURN_IF_ERROR(list_dir(p, &entries));
      size_t found = 0;
      for (const auto& e : entries) {
        if (!is_slide_extension(e.path().extension().string())) continue;
        // Anything named like a slide is an input: a regular file is tiled, and a directory, a
        // FIFO, a socket, a symlink loop or a dangling link fails as that one slide, named in the
        // summary, rather than being skipped unseen (folders are not searched recursively).
        out.push_back({e.path().stem().string(), e.path().string(), "", false});
        ++found;
      }
      if (found == 0) log_warn("no slide files in directory", {{"dir", p}});
    } else {
      // A file, or something status() cannot follow (a symlink loop): a slide that fails alone.
      out.push_back({fs::path(p).stem().string(), p, "", false});
    }
  }
  for (const auto& m : manifests) SLIDE_RETURN_IF_ERROR(read_manifest(m, &out));
  for (const auto& d : patch_dirs) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) return slide::core::not_found("patch folder " + d + ": not a directory");
    std::vector<fs::directory_entry> classes;
    SLIDE_RETURN_IF_ERROR(list_dir(d, &classes));
    std::erase_if(classes, [](const fs::directory_entry& e) { return entry_type(e) != fs::file_type::directory; });
    if (classes.empty())
      return slide::core::invalid_argument("patch folder " + d + ": no class sub-folders (expected DIR/<class>/*.jpg)");
    for (const auto& c : classes) {
      std::vector<fs::directory_entry> files;
      SLIDE_RETURN_IF_ERROR(list_dir(c.path().string(), &files));
      std::string cls = c.path().filename().string();
      for (const auto& f : files) {
        if (!is_patch_extension(f.path().extension().string())) continue;
        if (entry_type(f) == fs::file_type::directory) continue;  // as for slides: others fail alone
        out.push_back({cls + "/" + f.path().stem().string(), f.path().string(), cls, true});
      }
    }
  }
  if (out.empty()) return slide::core::invalid_argument("no input slides: give slide files, directories, --manifest or --patches");
  // Ids and labels are text in the store's JSON records (and in bags, CSVs and HDF5 attributes
  // later): bytes of a name in another encoding (a Latin-1 file name) are escaped as %XX, so the
  // id stays exact and two such names never become one.
  for (auto& s : out) {
    for (std::string* text : {&s.slide_id, &s.label}) {
      std::string escaped = slide::core::utf8_or_escaped(*text);
      if (escaped == *text) continue;
      log_warn("not valid UTF-8: bytes escaped as %XX",
               {{"what", text == &s.label ? "label" : "slide id"}, {"now", escaped}, {"input", slide::core::utf8_or_escaped(s.path)}});
      *text = std::move(escaped);
    }
  }
  std::map<std::string, std::string> seen;
  for (const auto& s : out) {
    auto [it, inserted] = seen.emplace(s.slide_id, s.path);
    if (!inserted)
      return slide::core::invalid_argument("duplicate slide id '" + s.slide_id + "' for " + it->second + " and " + s.path +
                                           ": give unique ids with a --manifest");
  }
  return out;
}

int RunSummary::count(SlideOutcomeKind kind) const {
  return static_cast<int>(std::count_if(slides.begin(), slides.end(), [&](const SlideOutcome& o) { return o.kind == kind; }));
}

double auto_thumbnail_mpp(const GridOptions& grid) {
  if (!(grid.target_mpp_um > 0) || grid.tile_size_px < 1) return 8.0;
  return std::clamp(grid.tile_size_px * grid.target_mpp_um / 8.0, 2.0, 16.0);
}

namespace {

class TilingRun {
 public:
  TilingRun(StoreWriter& writer, const TileJobOptions& options, slide::core::ThreadPool& pool)
      : writer_(writer), opt_(options), pool_(pool), tissue_options_(options.tissue) {
    if (!(tissue_options_.thumbnail_mpp_um > 0)) tissue_options_.thumbnail_mpp_um = auto_thumbnail_mpp(options.grid);
  }

  // Tiles one input. Store errors (which end the run) come back as *fatal.
  SlideOutcome run_slide(const SlideInput& in, Status* fatal);

  bool cancelled() const { return opt_.cancel && opt_.cancel->load(); }

 private:
  Status tile_wsi(const SlideInput& in, SlideOutcome* out, SlideRecord* rec, bool* store_error);
  Status apply_annotations(const SlideInput& in, SlideRecord* rec, TilePlan* plan, std::vector<int32_t>* labels);
  Status tile_patch(const SlideInput& in, SlideOutcome* out, SlideRecord* rec, bool* store_error);

  StoreWriter& writer_;
  const TileJobOptions& opt_;
  slide::core::ThreadPool& pool_;
  TissueOptions tissue_options_;  // opt_.tissue with the thumbnail resolution resolved
};

// Center-crops to a square and area-downsamples to `size`; refuses to upsample.
Result<RgbImage> fit_patch(RgbImage img, int size, const std::string& path) {
  int64_t side = std::min(img.width, img.height);
  if (side < size)
    return slide::core::invalid_argument(path + ": patch is " + std::to_string(img.width) + "x" +
                                         std::to_string(img.height) + " px, smaller than the tile size " +
                                         std::to_string(size) + " (upsampling is refused; use --tile-size " +
                                         std::to_string(side) + ")");
  RgbImage out(size, size);
  double x0 = static_cast<double>((img.width - side) / 2);
  double y0 = static_cast<double>((img.height - side) / 2);
  resample_area(img, x0, y0, static_cast<double>(side) / size, &out);
  return out;
}

Status TilingRun::tile_patch(const SlideInput& in, SlideOutcome* out, SlideRecord* rec, bool* store_error) {
  const int T = opt_.grid.tile_size_px;
  SLIDE_ASSIGN_OR_RETURN(RgbImage img, read_image_file(in.path));
  rec->vendor = "patch";
  rec->backend = "image";
  rec->width_l0 = img.width;
  rec->height_l0 = img.height;
  rec->tissue_fraction = 1;
  rec->candidate_tiles = 1;
  std::vector<uint8_t> payload;
  std::string ext = lower(fs::path(in.path).extension().string());
  bool copy_jpeg = opt_.passthrough && opt_.encoding == TileEncoding::kJpeg && (ext == ".jpg" || ext == ".jpeg") &&
                   img.width == T && img.height == T && opt_.stain.method == StainMethod::kNone;
  if (copy_jpeg) {
    // The patch is already a JPEG of the right size: keep its bytes (no generation loss).
    SLIDE_ASSIGN_OR_RETURN(std::string bytes, slide::core::read_file(in.path));
    payload.assign(bytes.begin(), bytes.end());
    rec->passthrough = true;
  } else {
    SLIDE_ASSIGN_OR_RETURN(RgbImage fitted, fit_patch(std::move(img), T, in.path));
    SLIDE_RETURN_IF_ERROR_CTX(normalise_stain(opt_.stain, fitted.pixels.data(), T, T), in.path + ": stain normalisation");
    if (opt_.encoding == TileEncoding::kJpeg) {
      SLIDE_ASSIGN_OR_RETURN(payload, encode_jpeg(fitted.pixels.data(), T, T, opt_.jpeg_quality));
    } else {
      payload = std::move(fitted.pixels);
    }
  }
  auto idx = writer_.begin_slide(in.slide_id);
  if (!idx.ok()) {
    *store_error = true;
    return idx.status();
  }
  TileHeader h;
  h.label = rec->label_index;
  h.width = h.height = static_cast<uint32_t>(T);
  h.encoding = opt_.encoding;
  Status s = writer_.add_tile(h, payload);
  if (!s.ok()) {
    *store_error = true;
    return s;
  }
  rec->level = 0;
  rec->downsample = 1;
  out->tiles = 1;
  out->candidates = 1;
  out->passthrough = rec->passthrough;
  return slide::core::ok_status();
}

// The annotation file of a slide: the manifest's column, else the --annotations file, else
// <dir>/<slide file stem>.geojson or .json. "" when there is none.
static std::string find_annotation_file(const SlideInput& in, const std::string& option) {
  if (!in.annotations.empty()) return in.annotations;
  if (option.empty()) return "";
  std::error_code ec;
  if (!std::filesystem::is_directory(option, ec)) return option;
  const std::string stem = std::filesystem::path(in.path).stem().string();
  for (const char* ext : {".geojson", ".json"}) {
    std::string p = option + "/" + stem + ext;
    if (std::filesystem::exists(p, ec)) return p;
  }
  return "";
}

Status TilingRun::apply_annotations(const SlideInput& in, SlideRecord* rec_out, TilePlan* plan,
                                    std::vector<int32_t>* labels) {
  const SlideRecord& rec = *rec_out;
  const bool needed = opt_.roi_only || opt_.label_from_annotations;
  const std::string file = find_annotation_file(in, opt_.annotations_path);
  if (file.empty()) {
    if (needed)
      return slide::core::not_found(in.path + ": no annotation file (looked for <" + opt_.annotations_path +
                                    ">/<stem>.geojson|.json)");
    return slide::core::ok_status();
  }
  if (!needed) return slide::core::ok_status();
  // The file's content is recorded with the slide: a rerun that finds it changed says so.
  SLIDE_ASSIGN_OR_RETURN(rec_out->annotations_sha256, slide::core::sha256_file(file));
  rec_out->annotations_path = file;
  SLIDE_ASSIGN_OR_RETURN(Annotations ann, load_geojson(file));
  SLIDE_ASSIGN_OR_RETURN(std::unique_ptr<AnnotationIndex> index,
                         AnnotationIndex::build(ann, rec.width_l0, rec.height_l0));
  std::vector<int32_t> class_label(ann.classes.size());
  if (opt_.label_from_annotations)
    for (size_t c = 0; c < ann.classes.size(); ++c) class_label[c] = writer_.label_index(ann.classes[c]);
  const int64_t side_l0 = static_cast<int64_t>(std::llround(plan->tile_size_l0()));
  std::vector<TileSpec> kept;
  size_t dropped_roi = 0;
  for (const TileSpec& t : plan->tiles) {
    TileCoverage c = index->cover(t.x_l0, t.y_l0, side_l0, opt_.min_label_overlap);
    // A tile no annotation touches is outside the ROI, even at --min-roi-overlap 0.
    if (opt_.roi_only && (c.roi_fraction <= 0 || c.roi_fraction < opt_.min_roi_overlap)) {
      ++dropped_roi;
      continue;
    }
    kept.push_back(t);
    if (opt_.label_from_annotations) labels->push_back(c.label < 0 ? -1 : class_label[static_cast<size_t>(c.label)]);
  }
  log_debug("annotations applied", {{"slide", in.slide_id}, {"file", file},
                                    {"tiles_kept", std::to_string(kept.size())},
                                    {"dropped_outside_roi", std::to_string(dropped_roi)}});
  plan->tiles = std::move(kept);
  return slide::core::ok_status();
}

Status TilingRun::tile_wsi(const SlideInput& in, SlideOutcome* out, SlideRecord* rec, bool* store_error) {
  SLIDE_ASSIGN_OR_RETURN(std::unique_ptr<SlideReader> reader, open_slide(in.path));
  const SlideProperties& props = reader->properties();
  rec->vendor = props.vendor;
  rec->backend = props.backend;
  rec->width_l0 = props.levels.at(0).width;
  rec->height_l0 = props.levels.at(0).height;

  double mpp = props.mpp_x_um;
  rec->mpp_source = props.mpp_source;
  if (mpp <= 0) {
    if (opt_.source_mpp_um <= 0) {
      // A vendor's extension read as a plain TIFF: OpenSlide did not recognise the file, which for
      // a real scan usually means it is damaged (a truncated .svs loses the directories that
      // identify it). Say so, since --source-mpp would not mend it.
      std::string ext = std::filesystem::path(in.path).extension().string();
      std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
      const bool vendor_ext = ext == ".svs" || ext == ".ndpi" || ext == ".scn" || ext == ".mrxs" || ext == ".vms" ||
                              ext == ".vmu" || ext == ".svslide" || ext == ".bif";
      const std::string hint = vendor_ext && props.vendor == "tiff"
                                   ? " (OpenSlide did not recognise this " + ext +
                                         " file as its vendor's format and it was read as a plain TIFF: it may be "
                                         "truncated or damaged)"
                                   : "";
      return slide::core::failed_precondition(
          in.path + ": the slide has no resolution (µm/px) in its vendor metadata or TIFF resolution tags; pass "
                    "--source-mpp with its level-0 µm/px" + hint);
    }
    mpp = opt_.source_mpp_um;
    rec->mpp_source = "override";
  }
  rec->source_mpp_um = mpp;

  SLIDE_ASSIGN_OR_RETURN_CTX(TissueMask tissue, detect_tissue(*reader, mpp, tissue_options_, &pool_), "tissue mask");
  rec->tissue_fraction = tissue.tissue_fraction();
  out->tissue_fraction = rec->tissue_fraction;
  // -v: what the mask is and what its size filters took away (thumbnail px at the mask's scale).
  slide::core::log_debug("tissue", {{"slide", in.slide_id},
                                    {"stain", tissue.fluorescence ? "fluorescence" : "brightfield"},
                                    {"signal", tissue.fluorescence ? "brightness" : "saturation"},
                                    {"threshold", tissue.otsu_threshold},
                                    {"tissue_fraction", rec->tissue_fraction},
                                    {"objects_removed", tissue.objects_removed},
                                    {"objects_removed_um2", tissue.objects_removed_px * tissue.downsample_x *
                                                                tissue.downsample_y * mpp * mpp},
                                    {"holes_filled", tissue.holes_filled},
                                    {"holes_filled_um2", tissue.holes_filled_px * tissue.downsample_x *
                                                             tissue.downsample_y * mpp * mpp}});

  // The grid of tissue tiles; --max-tiles-per-slide samples them below, after the annotations have
  // filtered them (a sample drawn first would leave --roi-only a fraction of it).
  GridOptions grid = opt_.grid;
  grid.max_tiles = 0;
  SLIDE_ASSIGN_OR_RETURN_CTX(TilePlan plan, plan_tiles(props, mpp, &tissue, grid), "tile plan");
  rec->level = plan.level;
  rec->downsample = plan.level_downsample;
  rec->tile_mpp_um = plan.tile_mpp_um;
  rec->candidate_tiles = static_cast<uint64_t>(plan.candidates);
  out->candidates = rec->candidate_tiles;

  // Annotations: filter the plan and label its tiles before anything is written.
  std::vector<int32_t> tile_labels;
  SLIDE_RETURN_IF_ERROR(apply_annotations(in, rec, &plan, &tile_labels));
  // --max-tiles-per-slide: a seeded uniform sample of the tiles kept, in grid order (their labels
  // with them); plan_tiles' draw, so a slide without annotations keeps the tiles it always did.
  if (opt_.grid.max_tiles > 0 && plan.tiles.size() > static_cast<size_t>(opt_.grid.max_tiles)) {
    std::vector<TileSpec> tiles;
    std::vector<int32_t> labels;
    for (size_t i : sample_tile_positions(plan.tiles.size(), opt_.grid.max_tiles, opt_.grid.seed)) {
      tiles.push_back(plan.tiles[i]);
      if (!tile_labels.empty()) labels.push_back(tile_labels[i]);
    }
    plan.tiles = std::move(tiles);
    if (!tile_labels.empty()) tile_labels = std::move(labels);
  }

  if (!opt_.qc_dir.empty()) {
    // The QC picture at --qc-mpp, its longer side at most kMaxQcPx, read from the slide again (the
    // mask's thumbnail is coarser: 16 um/px for 256-px tiles at 0.5 um/px).
    constexpr double kMaxQcPx = 2048;
    const double longer = static_cast<double>(std::max(rec->width_l0, rec->height_l0));
    const double qc_ds = std::max({1.0, opt_.qc_mpp_um / mpp, longer / kMaxQcPx});
    double qdx = 1, qdy = 1;
    auto qc_thumb = make_thumbnail(*reader, qc_ds, &qdx, &qdy, &pool_);
    char title[512];
    std::snprintf(title, sizeof title, "%s: %zu tiles of %d px at %.3g um/px", in.slide_id.c_str(), plan.tiles.size(),
                  plan.tile_size_px, plan.tile_mpp_um);
    auto png = qc_thumb.ok() ? render_qc_png(tissue, plan, title, qdx * mpp, &*qc_thumb, qdx, qdy)
                             : Result<std::vector<uint8_t>>(qc_thumb.status());
    Status qs = png.ok() ? slide::core::make_dirs(opt_.qc_dir) : png.status();
    if (qs.ok()) {
      // Slide ids come from manifests: slide_file_stem keeps the name inside qc_dir and unique.
      qs = slide::core::write_file_atomic(opt_.qc_dir + "/" + slide::core::slide_file_stem(in.slide_id) + ".png", *png);
    }
    // A QC picture that cannot be written is worth a warning, not the slide.
    if (!qs.ok()) log_warn("QC picture not written", {{"slide", in.slide_id}, {"error", qs.to_string()}});
  }

  const bool passthrough = opt_.passthrough && opt_.encoding == TileEncoding::kJpeg &&
                           opt_.stain.method == StainMethod::kNone && can_pass_through(*reader, plan);
  rec->passthrough = passthrough;
  out->passthrough = passthrough;

  auto idx = writer_.begin_slide(in.slide_id);
  if (!idx.ok()) {
    *store_error = true;
    return idx.status();
  }
  if (plan.tiles.empty()) return slide::core::ok_status();

  const int T = plan.tile_size_px;
  const SlideReader& rd = *reader;
  const TileEncoding encoding = opt_.encoding;
  const int quality = opt_.jpeg_quality;
  const StainTarget stain = opt_.stain;
  auto make_payload_or_throw = [&rd, &plan, T, encoding, quality, passthrough,
                                stain](const TileSpec& t) -> Result<std::vector<uint8_t>> {
    if (passthrough) {
      auto raw = rd.read_raw_jpeg_tile(plan.level, t.col, t.row);
      // A copied tile is never decoded here otherwise: check it decodes cleanly, or a source
      // tile with corrupt entropy-coded data would land in the store as it is.
      Status s = raw.ok() ? validate_jpeg(*raw, T, T) : raw.status();
      if (!s.ok()) return s.with_context("tile (x0=" + std::to_string(t.x_l0) + ", y0=" + std::to_string(t.y_l0) + ")");
      return raw;
    }
    std::vector<uint8_t> rgb(static_cast<size_t>(3) * T * T);
    Status s = read_tile(rd, plan, t, rgb.data());
    if (s.ok()) s = normalise_stain(stain, rgb.data(), T, T);  // kNone: nothing to do
    if (!s.ok())
      return s.with_context("tile (x0=" + std::to_string(t.x_l0) + ", y0=" + std::to_string(t.y_l0) + ")");
    if (encoding == TileEncoding::kRawRgb) return rgb;
    return encode_jpeg(rgb.data(), T, T, quality);
  };
  // Tasks must not end in an exception: the window's other futures would be left behind.
  auto make_payload = [&make_payload_or_throw](const TileSpec& t) -> Result<std::vector<uint8_t>> {
    try {
      return make_payload_or_throw(t);
    } catch (const std::bad_alloc&) {
      return slide::core::resource_exhausted("tile (x0=" + std::to_string(t.x_l0) + ", y0=" + std::to_string(t.y_l0) +
                                             "): out of memory");
    }
  };

  slide::core::Progress progress("tiles of " + in.slide_id, static_cast<int64_t>(plan.tiles.size()), "tiles/s",
                                 opt_.progress);
  const size_t window = std::max<size_t>(16, 16 * pool_.size());
  std::deque<std::future<Result<std::vector<uint8_t>>>> inflight;
  // Should anything on this thread throw (std::bad_alloc), wait for the window's tasks before
  // this frame, which they reference, goes away.
  struct WaitInflight {
    std::deque<std::future<Result<std::vector<uint8_t>>>>& futures;
    ~WaitInflight() {
      for (auto& f : futures)
        if (f.valid()) f.wait();
    }
  } wait_inflight{inflight};
  size_t next_submit = 0, next_write = 0;
  Status failure;
  while (next_write < plan.tiles.size()) {
    while (failure.ok() && !cancelled() && next_submit < plan.tiles.size() && inflight.size() < window) {
      const TileSpec* t = &plan.tiles[next_submit++];
      inflight.push_back(pool_.submit([t, &make_payload] { return make_payload(*t); }));
    }
    if (inflight.empty()) break;  // cancelled or failed: nothing left to wait for
    auto payload = inflight.front().get();
    inflight.pop_front();
    const TileSpec& t = plan.tiles[next_write++];
    if (!failure.ok() || cancelled()) continue;  // drain the window without writing
    if (!payload.ok()) {
      failure = payload.status();
      continue;
    }
    TileHeader h;
    h.label = tile_labels.empty() ? rec->label_index : tile_labels[next_write - 1];
    h.x_l0 = t.x_l0;
    h.y_l0 = t.y_l0;
    h.width = h.height = static_cast<uint32_t>(T);
    h.encoding = encoding;
    Status s = writer_.add_tile(h, std::move(*payload));
    if (!s.ok()) {
      *store_error = true;
      failure = s;
      continue;
    }
    progress.add(1);
    ++out->tiles;
  }
  if (!failure.ok()) return failure;  // run_slide names the slide
  if (cancelled()) return slide::core::cancelled(in.path + ": interrupted");
  return slide::core::ok_status();
}

SlideOutcome TilingRun::run_slide(const SlideInput& in, Status* fatal) {
  auto t0 = std::chrono::steady_clock::now();
  SlideOutcome out;
  out.slide_id = in.slide_id;
  out.path = in.path;
  SlideRecord rec;
  rec.slide_id = in.slide_id;
  rec.path = in.path;
  rec.label = in.label;
  rec.label_index = writer_.label_index(in.label);
  // A FIFO named like a slide would block the first open() forever: refuse anything that is not
  // a regular file before any reader sees it (patches included).
  Status s = check_regular_file(in.path);
  auto st = slide::core::stat_file(in.path);
  if (st.ok()) {
    rec.source_size_bytes = st->size_bytes;
    rec.source_mtime_ns = st->mtime_ns;
  } else if (s.ok()) {
    s = st.status();
  }
  bool store_error = false;
  if (s.ok()) {
    try {
      s = in.is_patch ? tile_patch(in, &out, &rec, &store_error) : tile_wsi(in, &out, &rec, &store_error);
    } catch (const std::bad_alloc&) {
      // Buffers sized from a header are checked against limits where they are made; this is the
      // net for the rest. Pool tasks return Status, and tile_wsi waits for its window of tasks
      // before an exception leaves it, so nothing still runs on the abandoned frames.
      s = slide::core::resource_exhausted("out of memory");
    } catch (const std::length_error&) {
      s = slide::core::resource_exhausted("out of memory (a buffer larger than the address space)");
    }
    // The slide's file is named once: readers name it in their own errors; anything else
    // (encoding, the tile plan, out of memory) gets it here.
    if (!s.ok() && !store_error && s.message().find(in.path) == std::string::npos) s = s.with_context(in.path);
  }
  if (s.ok()) {
    rec.tile_count = out.tiles;
    s = writer_.finish_slide(rec);
    if (!s.ok()) store_error = true;
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (s.ok()) {
    out.kind = out.tiles == 0 ? SlideOutcomeKind::kZeroTiles : SlideOutcomeKind::kTiled;
    if (out.kind == SlideOutcomeKind::kZeroTiles)
      log_warn("slide has zero tiles", {{"slide", in.slide_id}, {"path", in.path}, {"candidates", out.candidates},
                                        {"tissue_fraction", fmt_double(out.tissue_fraction, 3)}});
    else if (!in.is_patch)
      log_info("slide tiled", {{"slide", in.slide_id}, {"tiles", out.tiles}, {"seconds", fmt_double(out.seconds)},
                               {"passthrough", out.passthrough ? "yes" : "no"}});
    return out;
  }
  out.kind = SlideOutcomeKind::kFailed;
  out.error = s;
  out.tiles = 0;  // a failed slide keeps none: its tiles are deleted (or, interrupted, on the next run)
  if (s.code() == slide::core::StatusCode::kCancelled) {
    // Ctrl-C: commit what is buffered (the current transaction) and stop; the partial slide has
    // no record, so a rerun removes its tiles and redoes it.
    Status f = writer_.flush();
    if (!f.ok()) *fatal = f;
    return out;
  }
  if (store_error) {
    *fatal = s;
    return out;
  }
  Status a = writer_.abort_slide();
  if (!a.ok()) *fatal = a;
  log_warn("slide failed", {{"slide", in.slide_id}, {"error", s.to_string()}});
  return out;
}

}  // namespace

Result<RunSummary> run_tiling(const std::vector<SlideInput>& inputs, const std::string& store_dir,
                              const TileJobOptions& options) {
  auto t0 = std::chrono::steady_clock::now();
  if (options.shard_count < 1 || options.shard_index < 0 || options.shard_index >= options.shard_count)
    return slide::core::invalid_argument("shard " + std::to_string(options.shard_index) + "/" +
                                         std::to_string(options.shard_count) + " is out of range");
  if (options.jpeg_quality < 1 || options.jpeg_quality > 100)
    return slide::core::invalid_argument("--jpeg-quality must be in 1..100");
  StoreMeta meta;
  meta.tile_size_px = options.grid.tile_size_px;
  meta.stride_px = options.grid.stride_px > 0 ? options.grid.stride_px : options.grid.tile_size_px;
  meta.target_mpp_um = options.grid.target_mpp_um;
  meta.encoding = options.encoding;
  meta.jpeg_quality = options.jpeg_quality;
  meta.min_tissue = options.grid.min_tissue;
  meta.shard = std::to_string(options.shard_index) + "/" + std::to_string(options.shard_count);
  meta.max_tiles_per_slide = options.grid.max_tiles;
  meta.seed = options.grid.seed;
  meta.thumbnail_mpp_um =
      options.tissue.thumbnail_mpp_um > 0 ? options.tissue.thumbnail_mpp_um : auto_thumbnail_mpp(options.grid);
  meta.passthrough = options.passthrough;
  meta.tissue_options = tissue_options_text(options.tissue);
  meta.annotation_options = annotation_options_text(options);
  meta.stain_normalization = stain_target_to_json(options.stain);
  meta.command_line = options.command_line;
  StoreWriterOptions wopt;
  wopt.tiles_per_txn = options.tiles_per_txn;
  SLIDE_ASSIGN_OR_RETURN(std::unique_ptr<StoreWriter> writer, StoreWriter::open(store_dir, meta, wopt));

  slide::core::ThreadPool pool(static_cast<size_t>(std::max(1, options.threads)));
  TilingRun run(*writer, options, pool);
  RunSummary summary;
  size_t patches_total = 0, patches_done = 0;
  for (const auto& in : inputs) patches_total += in.is_patch ? 1 : 0;
  slide::core::Progress patch_progress("patches", static_cast<int64_t>(patches_total), "patches/s",
                                       options.progress && patches_total > 0);
  for (size_t k = 0; k < inputs.size(); ++k) {
    const SlideInput& in = inputs[k];
    if (static_cast<int>(k % static_cast<size_t>(options.shard_count)) != options.shard_index) continue;
    if (run.cancelled()) {
      summary.cancelled = true;
      break;
    }
    auto done = writer->slides().find(in.slide_id);
    if (done != writer->slides().end()) {
      SlideOutcome o;
      o.slide_id = in.slide_id;
      o.path = in.path;
      o.kind = SlideOutcomeKind::kAlreadyComplete;
      o.tiles = done->second.tile_count;
      o.passthrough = done->second.passthrough;
      auto st = slide::core::stat_file(in.path);
      if (st.ok() && (st->size_bytes != done->second.source_size_bytes || st->mtime_ns != done->second.source_mtime_ns))
        log_warn("slide changed since it was tiled; its tiles in the store are from the old file",
                 {{"slide", in.slide_id}, {"path", in.path}});
      // Its annotations, likewise: the tiles and labels in the store follow the file as it was.
      if (!done->second.annotations_sha256.empty()) {
        const std::string file = find_annotation_file(in, options.annotations_path);
        auto sha = file.empty() ? Result<std::string>(std::string()) : slide::core::sha256_file(file);
        if (!sha.ok() || *sha != done->second.annotations_sha256)
          log_warn("annotations changed since the slide was tiled; its tiles and labels in the store follow the "
                   "old file (tile it into a new store to use the new one)",
                   {{"slide", in.slide_id}, {"tiled_with", done->second.annotations_path},
                    {"now", file.empty() ? std::string("(none)") : file}});
      }
      summary.slides.push_back(std::move(o));
      continue;
    }
    Status fatal;
    SlideOutcome o = run.run_slide(in, &fatal);
    summary.tiles_written += o.tiles;
    if (o.kind == SlideOutcomeKind::kFailed && o.error.code() == slide::core::StatusCode::kCancelled)
      summary.cancelled = true;
    summary.slides.push_back(std::move(o));
    if (in.is_patch) {
      ++patches_done;
      patch_progress.add(1);
    }
    if (!fatal.ok()) return fatal;  // the store's errors already name the store
    if (summary.cancelled) break;
  }
  patch_progress.finish();
  SLIDE_RETURN_IF_ERROR(writer->close());
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  (void)patches_done;
  return summary;
}

std::string format_summary(const RunSummary& summary, bool quiet) {
  std::ostringstream os;
  int shown = 0, notables = 0;
  const int kMaxLines = 50;
  for (const auto& o : summary.slides) {
    if (o.kind == SlideOutcomeKind::kNotInShard) continue;
    // Patch runs have thousands of one-tile "slides": list only the ones worth a look.
    bool notable = o.kind == SlideOutcomeKind::kFailed || o.kind == SlideOutcomeKind::kZeroTiles;
    notables += notable;
    if (!notable && (quiet || shown >= kMaxLines)) continue;
    ++shown;
    const char* what = "tiled";
    switch (o.kind) {
      case SlideOutcomeKind::kTiled: what = "tiled"; break;
      case SlideOutcomeKind::kAlreadyComplete: what = "already complete"; break;
      case SlideOutcomeKind::kZeroTiles: what = "ZERO TILES"; break;
      case SlideOutcomeKind::kFailed: what = "FAILED"; break;
      case SlideOutcomeKind::kNotInShard: what = "other shard"; break;
    }
    char line[256];
    std::snprintf(line, sizeof line, "  %-40s %-16s %8llu tiles %7.1f s%s", o.slide_id.c_str(), what,
                  static_cast<unsigned long long>(o.tiles), o.seconds, o.passthrough ? "  pass-through" : "");
    os << line;
    if (o.kind == SlideOutcomeKind::kFailed) os << "  " << o.error.to_string();
    os << "\n";
  }
  if (quiet && notables == 0) return os.str();
  int listed = static_cast<int>(summary.slides.size());
  if (shown < listed && !quiet) os << "  ... (" << (listed - shown) << " more, all tiled or already complete)\n";
  os << "summary: " << summary.count(SlideOutcomeKind::kTiled) << " tiled, "
     << summary.count(SlideOutcomeKind::kAlreadyComplete) << " already complete, "
     << summary.count(SlideOutcomeKind::kZeroTiles) << " with zero tiles, " << summary.count(SlideOutcomeKind::kFailed)
     << " failed; " << summary.tiles_written << " tiles written in " << fmt_double(summary.seconds) << " s"
     << (summary.cancelled ? " (interrupted)" : "") << "\n";
  return os.str();
}

std::string annotation_options_text(const TileJobOptions& o) {
  if (!o.roi_only && !o.label_from_annotations) return "none";
  char buf[200];
  std::snprintf(buf, sizeof buf, "roi_only=%d min_roi_overlap=%g label_from_annotations=%d min_label_overlap=%g",
                o.roi_only ? 1 : 0, o.roi_only ? o.min_roi_overlap : 0.0, o.label_from_annotations ? 1 : 0,
                o.label_from_annotations ? o.min_label_overlap : 0.0);
  return buf;
}

}  // namespace slide::tile
