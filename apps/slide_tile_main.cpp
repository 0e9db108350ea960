// slide-tile: whole-slide images and patch folders -> LMDB tile stores.
//
//   slide-tile SLIDE|DIR... [--manifest CSV] [--patches DIR] -o STORE [options]
//   slide-tile info STORE [--json]
//   slide-tile export STORE -o DIR [--slide ID]... [--index LIST] [--limit N]
//     (files DIR/<slide_file_stem(slide id)>_t<index>_x<x0>_y<y0>.jpg|.png)
//
// Exit codes: 0 ok, 1 failed, 2 usage, 3 finished with some slides failed, 130 interrupted.
#include <CLI/CLI.hpp>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli_checks.h"
#include "exit_codes.h"
#include "slide/core/file.h"
#include "slide/core/file_name.h"
#include "slide/core/log.h"
#include "slide/tile/image.h"
#include "slide/tile/pipeline.h"
#include "slide/tile/stain.h"
#include "slide/tile/store.h"
#include "log_options.h"
#include "stain_options.h"
#include "tile_report.h"

#include "interrupt.h"

namespace {

using slide::apps::kExitFailed;
using slide::apps::kExitInterrupted;
using slide::apps::kExitOk;
using slide::apps::kExitSomeFailed;
using slide::apps::kExitUsage;

// A second Ctrl-C stops at once: the store stays consistent (LMDB commits are atomic).
std::atomic<bool>& g_cancel = slide::apps::interrupt_flag();

std::string join_argv(int argc, char** argv) {
  std::string s;
  for (int i = 0; i < argc; ++i) {
    if (i) s += ' ';
    std::string a = argv[i];
    bool quote = a.find_first_of(" \t\"'") != std::string::npos || a.empty();
    s += quote ? "'" + a + "'" : a;
  }
  return s;
}

int fail(const slide::core::Status& s) {
  slide::core::log_error(s.to_string());
  return s.code() == slide::core::StatusCode::kInvalidArgument ? kExitUsage : kExitFailed;
}

const char* encoding_name(slide::tile::TileEncoding e) { return e == slide::tile::TileEncoding::kJpeg ? "jpeg" : "raw"; }

int run_info(const std::string& store_dir, bool json) {
  auto reader = slide::tile::StoreReader::open(store_dir);
  if (!reader.ok()) return fail(reader.status());
  const auto& meta = (*reader)->meta();
  const auto& slides = (*reader)->slides();
  std::map<int32_t, uint64_t> per_label;
  for (const auto& s : slides) per_label[s.label_index] += s.tile_count;
  if (json) {
    nlohmann::json j;
    j["store"] = store_dir;
    j["format_version"] = meta.format_version;
    j["tile_size_px"] = meta.tile_size_px;
    j["stride_px"] = meta.stride_px;
    j["target_mpp_um"] = meta.target_mpp_um;
    j["encoding"] = encoding_name(meta.encoding);
    j["jpeg_quality"] = meta.jpeg_quality;
    j["min_tissue"] = meta.min_tissue;
    j["shard"] = meta.shard;
    j["max_tiles_per_slide"] = meta.max_tiles_per_slide;
    j["seed"] = meta.seed;
    j["thumbnail_mpp_um"] = meta.thumbnail_mpp_um;
    j["passthrough"] = meta.passthrough;
    j["tissue_options"] = meta.tissue_options;
    j["annotation_options"] = meta.annotation_options;
    j["stain_normalization"] = meta.stain_normalization;
    j["command_line"] = meta.command_line;
    j["label_names"] = meta.label_names;
    j["tile_count"] = (*reader)->tile_count();
    j["slides"] = nlohmann::json::array();
    for (const auto& s : slides) j["slides"].push_back(nlohmann::json::parse(slide::tile::slide_record_to_json(s)));
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }
  std::printf("store        %s\n", store_dir.c_str());
  std::printf("format       %d, %s tiles, quality %d\n", meta.format_version, encoding_name(meta.encoding), meta.jpeg_quality);
  std::printf("tiles        %d px, stride %d px, %.4g um/px, min tissue %.3g, shard %s\n", meta.tile_size_px,
              meta.stride_px, meta.target_mpp_um, meta.min_tissue, meta.shard.c_str());
  std::printf("made by      %s\n", meta.command_line.c_str());
  const std::string sampling = meta.max_tiles_per_slide > 0
                                   ? "at most " + std::to_string(meta.max_tiles_per_slide) + " tiles per slide"
                                   : std::string("all tiles");
  std::printf("sampling     %s, seed %llu; thumbnail %.4g um/px; pass-through %s\n", sampling.c_str(),
              static_cast<unsigned long long>(meta.seed), meta.thumbnail_mpp_um, meta.passthrough ? "on" : "off");
  if (!meta.tissue_options.empty()) std::printf("tissue       %s\n", meta.tissue_options.c_str());
  if (!meta.annotation_options.empty()) std::printf("annotations  %s\n", meta.annotation_options.c_str());
  if (!meta.stain_normalization.empty()) std::printf("stain        %s\n", meta.stain_normalization.c_str());
  std::printf("slides       %zu complete, %llu tiles\n", slides.size(),
              static_cast<unsigned long long>((*reader)->tile_count()));
  std::printf("labels      ");
  if (meta.label_names.empty()) std::printf(" none (unlabelled tiles: slide-train predict takes them)");
  for (const auto& [idx, n] : per_label) {
    if (meta.label_names.empty()) break;
    std::string name = idx < 0 ? "unlabelled" : meta.label_names.at(static_cast<size_t>(idx));
    std::printf(" %s=%llu", name.c_str(), static_cast<unsigned long long>(n));
  }
  std::printf("\n\n%6s  %-40s %-12s %8s %6s %9s %7s %s\n", "index", "slide", "label", "tiles", "level", "tile_mpp",
              "tissue", "vendor");
  size_t shown = 0;
  for (const auto& s : slides) {
    if (++shown > 200) {
      std::printf("... %zu more (use --json for all)\n", slides.size() - 200);
      break;
    }
    std::printf("%6u  %-40s %-12s %8llu %6d %9.4g %6.1f%% %s%s\n", s.index, s.slide_id.c_str(),
                s.label.empty() ? "-" : s.label.c_str(), static_cast<unsigned long long>(s.tile_count), s.level,
                s.tile_mpp_um, 100.0 * s.tissue_fraction, s.vendor.c_str(), s.passthrough ? " (pass-through)" : "");
  }
  return kExitOk;
}

// Parses "0-9,15,20-22" into sorted unique indices.
bool parse_index_list(const std::string& text, std::vector<uint64_t>* out) {
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty()) continue;
    auto dash = part.find('-');
    try {
      if (dash == std::string::npos) {
        out->push_back(std::stoull(part));
      } else {
        uint64_t a = std::stoull(part.substr(0, dash)), b = std::stoull(part.substr(dash + 1));
        if (b < a || b - a > 10000000) return false;
        for (uint64_t i = a; i <= b; ++i) out->push_back(i);
      }
    } catch (...) {
      return false;
    }
  }
  std::sort(out->begin(), out->end());
  out->erase(std::unique(out->begin(), out->end()), out->end());
  return true;
}

int run_export(const std::string& store_dir, const std::string& out_dir, const std::vector<std::string>& slide_ids,
               const std::string& index_list, uint64_t limit) {
  auto reader = slide::tile::StoreReader::open(store_dir);
  if (!reader.ok()) return fail(reader.status());
  std::vector<uint64_t> indices;
  if (!index_list.empty() && !parse_index_list(index_list, &indices))
    return fail(slide::core::invalid_argument("--index: expected a list like 0-9,15, got '" + index_list + "'"));
  if (!slide_ids.empty()) {
    std::map<std::string, const slide::tile::SlideRecord*> by_id;
    for (const auto& s : (*reader)->slides()) by_id[s.slide_id] = &s;
    for (const auto& id : slide_ids) {
      auto it = by_id.find(id);
      if (it == by_id.end()) return fail(slide::core::not_found("slide '" + id + "' is not in store " + store_dir));
      uint64_t n = limit > 0 ? std::min<uint64_t>(limit, it->second->tile_count) : it->second->tile_count;
      for (uint64_t i = 0; i < n; ++i) indices.push_back(it->second->first_tile_index + i);
    }
  }
  if (indices.empty()) {
    uint64_t n = limit > 0 ? std::min<uint64_t>(limit, (*reader)->tile_count()) : std::min<uint64_t>(16, (*reader)->tile_count());
    for (uint64_t i = 0; i < n; ++i) indices.push_back(i);
  }
  if (auto s = slide::core::make_dirs(out_dir); !s.ok()) return fail(s);
  const auto& slides = (*reader)->slides();
  size_t written = 0;
  for (uint64_t idx : indices) {
    slide::tile::TileHeader h;
    std::vector<uint8_t> payload;
    auto s = (*reader)->read_tile(idx, &h, &payload);
    if (!s.ok()) return fail(s);  // names the store and the tile
    // Slide ids come from manifests: slide_file_stem keeps the file inside out_dir and unique.
    std::string sid = h.slide_index < slides.size() ? slide::core::slide_file_stem(slides[h.slide_index].slide_id)
                                                    : "slide" + std::to_string(h.slide_index);
    std::string base = out_dir + "/" + sid + "_t" + std::to_string(idx) + "_x" + std::to_string(h.x_l0) + "_y" +
                       std::to_string(h.y_l0);
    if (h.encoding == slide::tile::TileEncoding::kJpeg) {
      s = slide::core::write_file_atomic(base + ".jpg", payload);
    } else {
      slide::tile::RgbImage img(h.width, h.height);
      img.pixels = std::move(payload);
      auto png = slide::tile::encode_png(img);
      s = png.ok() ? slide::core::write_file_atomic(base + ".png", *png) : png.status();
    }
    if (!s.ok()) return fail(s);
    ++written;
  }
  std::printf("exported %zu tiles to %s\n", written, out_dir.c_str());
  return kExitOk;
}

int run_main(int argc, char** argv) {
  // Each write transaction allocates and frees its tiles' payloads and LMDB's dirty pages (tens
  // of MB); glibc's defaults hand that memory back to the kernel after every commit and fault it
  // in again, page by page, for the next one. Keep it in the heap instead: peak RSS is unchanged
  // (one transaction's worth), the faults go away (measured in the note on issue 2).
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  CLI::App app{"slide-tile: tile whole-slide images (every format OpenSlide reads, plain TIFFs through libtiff) "
               "and patch folders into an LMDB tile store, with tissue detection, at a target resolution; "
               "resumable: rerun the same command after a crash or Ctrl-C."};
  app.set_version_flag("--version", std::string("slide-tile ") + SLIDE_VERSION);
  app.set_config("--config", "", "Read options from a TOML/INI file (keys are the long option names)");
  app.require_subcommand(0, 1);

  std::vector<std::string> inputs, manifests, patch_dirs;
  std::string out_store, qc_dir, shard = "0/1", encoding = "jpeg";
  double mpp = 0, magnification = 0, source_mpp = 0;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  slide::tile::TileJobOptions opt;
  bool no_passthrough = false;
  slide::apps::LogOptions log;
  int max_tiles = 0;

  app.add_option("inputs", inputs, "Slide files or directories of slides");
  app.add_option("--manifest", manifests, "CSV with header slide_id,path[,label] (paths relative to the CSV)")
      ->check(CLI::ExistingFile);
  app.add_option("--patches", patch_dirs, "Patch folder DIR/<class>/*.jpg|png|tif: each image is one tile, labelled by its folder")
      ->check(CLI::ExistingDirectory);
  app.add_option("-o,--out", out_store, "Output store directory (created, or resumed when it exists)");
  auto* mpp_opt = app.add_option("--mpp", mpp, "Target resolution, micrometres per pixel (e.g. 0.5 ~ 20x)")
                      ->check(slide::apps::positive_number());
  app.add_option("--magnification", magnification, "Target magnification (converted as mpp = 10 / magnification: 20x -> 0.5 um/px)")
      ->check(slide::apps::positive_number())
      ->excludes(mpp_opt);
  app.add_option("--source-mpp", source_mpp, "Level-0 um/px for slides whose metadata has none")->check(slide::apps::positive_number());
  auto* tile_size_opt = app.add_option("--tile-size", opt.grid.tile_size_px,
                                       "Tile side, pixels at the target resolution (patch folders alone: the patches' "
                                       "own size when they all share one)")
                            ->capture_default_str()
                            ->check(CLI::Range(8, 8192));
  app.add_option("--stride", opt.grid.stride_px, "Distance between tile origins, pixels (default: tile size; smaller overlaps)")
      ->check(CLI::Range(1, 8192));
  app.add_option("--min-tissue", opt.grid.min_tissue, "Keep a tile when at least this fraction of it is tissue (0..1; 0 keeps all)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--max-tiles-per-slide", max_tiles, "Keep at most N tiles per slide (seeded uniform sample, grid order); 0 = all")
      ->check(slide::apps::non_negative_number());
  app.add_option("--seed", opt.grid.seed, "Seed for --max-tiles-per-slide sampling")->capture_default_str();
  app.add_option("--encoding", encoding, "Tile payload: jpeg or raw (RGB bytes)")
      ->capture_default_str()
      ->check(CLI::IsMember({"jpeg", "raw"}));
  app.add_option("--jpeg-quality", opt.jpeg_quality, "JPEG quality 1..100")->capture_default_str()->check(CLI::Range(1, 100));
  app.add_flag("--no-passthrough", no_passthrough,
               "Always decode and re-encode, even when the grid is aligned with the slide's own JPEG tiles");
  app.add_option("--threads", threads,
                 "Worker threads that read tiles from the slides and encode them (JPEG); one more thread writes")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--shard", shard, "Write only slides k with k % N == i, as i/N (one store per shard)")->capture_default_str();
  app.add_option("--qc-dir", qc_dir,
                 "Write a QC PNG per slide here: the slide at --qc-mpp with the tissue mask (green) and the kept "
                 "tiles (blue), a title, a legend and a scale bar");
  app.add_option("--qc-mpp", opt.qc_mpp_um, "Resolution of the QC pictures, um/px (the longer side at most 2048 px)")
      ->capture_default_str()->check(slide::apps::positive_number());
  app.add_option("--txn-tiles", opt.tiles_per_txn, "Tiles per LMDB write transaction")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  opt.tissue.thumbnail_mpp_um = 0;  // auto
  app.add_option("--thumbnail-mpp", opt.tissue.thumbnail_mpp_um,
                 "Resolution of the tissue-detection thumbnail, um/px (default: tile size x --mpp / 8, within 2..16)")
      ->check(slide::apps::positive_number());
  // Tissue detection's knobs (CLAM's segmentTissue parameters; tissue.h).
  std::string stain = "auto", tissue_threshold = "otsu";
  app.add_option("--stain", stain,
                 "auto | brightfield | fluorescence: tissue is saturated colour on white glass (brightfield) or "
                 "bright on a dark background (fluorescence); auto decides per slide from the thumbnail's median grey "
                 "(below 60: fluorescence)")
      ->capture_default_str()->check(CLI::IsMember({"auto", "brightfield", "fluorescence"}));
  app.add_option("--tissue-threshold", tissue_threshold,
                 "otsu, or a fixed threshold 0..255 on saturation (brightfield) or brightness (fluorescence); a pixel "
                 "above it is tissue")
      ->capture_default_str()
      ->check([](const std::string& v) -> std::string {
        if (v == "otsu") return "";
        char* end = nullptr;
        const long t = std::strtol(v.c_str(), &end, 10);
        return end != v.c_str() && *end == '\0' && t >= 0 && t <= 255 ? "" : "expected otsu or an integer 0..255";
      });
  app.add_option("--tissue-median", opt.tissue.median_px, "Median filter before the threshold, thumbnail px (odd; 1: off)")
      ->capture_default_str()->check(CLI::Range(1, 101));
  app.add_option("--tissue-close", opt.tissue.close_px, "Morphological close after it, thumbnail px (1: off)")
      ->capture_default_str()->check(CLI::Range(1, 101));
  app.add_option("--min-tissue-area", opt.tissue.min_object_um2,
                 "Tissue pieces smaller than this are dropped, um^2 (0: keep all)")
      ->capture_default_str()->check(slide::apps::non_negative_number());
  app.add_option("--min-hole-area", opt.tissue.min_hole_um2, "Holes in tissue smaller than this are filled, um^2 (0: none)")
      ->capture_default_str()->check(slide::apps::non_negative_number());
  app.add_option("--annotations", opt.annotations_path,
                 "GeoJSON (QuPath export, level-0 px): a file for every slide, or a directory of <slide stem>.geojson|.json");
  app.add_flag("--roi-only", opt.roi_only, "Keep only tiles covered by the annotations (see --min-roi-overlap)");
  app.add_option("--min-roi-overlap", opt.min_roi_overlap, "With --roi-only: keep a tile when at least this fraction is annotated")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_flag("--label-from-annotations", opt.label_from_annotations,
               "Label each tile by the annotation class covering the largest area >= --min-label-overlap (none: -1)");
  app.add_option("--min-label-overlap", opt.min_label_overlap, "Fraction of a tile a class must cover to label it")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  slide::apps::StainOptions stain_norm;
  slide::apps::add_stain_options(app, &stain_norm,
                                 "at tiling time, before the tile is encoded (pass-through off); the store records the "
                                 "fitted target (slide-tile info: stain) and a rerun with another is refused",
                                 "slide-tile info --json's stain_normalization, a bag's stain_normalization attribute");
  slide::apps::add_log_options(app, &log,
                               "per slide: the tissue mask's threshold and what its filters removed; per level: "
                               "pass-through and direct-decode decisions");

  auto* info = app.add_subcommand("info", "Describe a store: settings, slides, tile counts, labels");
  std::string info_store;
  bool info_json = false;
  info->add_option("store", info_store, "Store directory")->required();
  info->add_flag("--json", info_json, "Print JSON instead of a table");

  auto* exp = app.add_subcommand("export", "Write chosen tiles of a store as image files (.jpg, or .png for raw tiles)");
  std::string exp_store, exp_out, exp_index;
  std::vector<std::string> exp_slides;
  uint64_t exp_limit = 0;
  exp->add_option("store", exp_store, "Store directory")->required();
  exp->add_option("-o,--out", exp_out, "Output directory")->required();
  exp->add_option("--slide", exp_slides, "Export tiles of this slide id (repeatable)");
  exp->add_option("--index", exp_index, "Tile indices, e.g. 0-9,15");
  exp->add_option("--limit", exp_limit, "At most N tiles per slide (or in all, without --slide/--index; default 16)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  slide::apps::apply_log_options(log);
  opt.tissue.stain = stain == "fluorescence"  ? slide::tile::TissueStain::kFluorescence
                     : stain == "brightfield" ? slide::tile::TissueStain::kBrightfield
                                              : slide::tile::TissueStain::kAuto;
  opt.tissue.threshold = tissue_threshold == "otsu" ? -1 : std::atoi(tissue_threshold.c_str());

  if (*info) return run_info(info_store, info_json);
  if (*exp) return run_export(exp_store, exp_out, exp_slides, exp_index, exp_limit);

  if (out_store.empty()) {
    std::fprintf(stderr, "slide-tile: -o/--out STORE is required\nRun with --help for more information.\n");
    return kExitUsage;
  }
  if (mpp == 0 && magnification == 0 && patch_dirs.empty()) {
    std::fprintf(stderr, "slide-tile: give the target resolution with --mpp (um/px) or --magnification\n");
    return kExitUsage;
  }
  int si = 0, sn = 1;
  if (std::sscanf(shard.c_str(), "%d/%d", &si, &sn) != 2 || sn < 1 || si < 0 || si >= sn) {
    std::fprintf(stderr, "slide-tile: --shard must be i/N with 0 <= i < N, got '%s'\n", shard.c_str());
    return kExitUsage;
  }
  opt.grid.target_mpp_um = mpp > 0 ? mpp : (magnification > 0 ? 10.0 / magnification : 0.0);
  opt.grid.max_tiles = max_tiles;
  opt.encoding = encoding == "raw" ? slide::tile::TileEncoding::kRawRgb : slide::tile::TileEncoding::kJpeg;
  opt.source_mpp_um = source_mpp;
  opt.passthrough = !no_passthrough;
  opt.threads = threads;
  opt.shard_index = si;
  opt.shard_count = sn;
  opt.qc_dir = qc_dir;
  opt.command_line = join_argv(argc, argv);
  opt.progress = !log.quiet;
  opt.cancel = &g_cancel;
  {
    auto target = slide::apps::stain_target_of(stain_norm, "stain normalisation at tiling time");
    if (!target.ok()) return fail(target.status());
    opt.stain = *target;
  }

  auto collected = slide::tile::collect_inputs(inputs, manifests, patch_dirs);
  if (!collected.ok()) return fail(collected.status());
  if (tile_size_opt->count() == 0 && !collected->empty() &&
      std::all_of(collected->begin(), collected->end(), [](const auto& s) { return s.is_patch; })) {
    // Patch folders alone, no --tile-size: the patches' own size when they all share one (each
    // patch is centre-cropped to a square of its shorter side, then scaled to the tile size).
    int64_t common = -1;
    for (const auto& s : *collected) {
      auto size = slide::tile::read_image_size(s.path);
      if (!size.ok()) {  // the patch fails with that error when it is tiled; no default from it
        common = 0;
        break;
      }
      const int64_t side = std::min(size->width, size->height);
      if (common != -1 && side != common) {
        common = 0;
        break;
      }
      common = side;
    }
    if (common >= 8 && common <= 8192) {
      opt.grid.tile_size_px = static_cast<int>(common);
      slide::core::log_info("--tile-size from the patches: they all share one size", {{"tile_size_px", common}});
    } else {
      slide::core::log_info("patches of several sizes: --tile-size keeps its default; give it to choose",
                            {{"tile_size_px", opt.grid.tile_size_px}});
    }
  }
  if (opt.grid.target_mpp_um == 0) {
    bool any_wsi = std::any_of(collected->begin(), collected->end(), [](const auto& s) { return !s.is_patch; });
    if (any_wsi) {
      std::fprintf(stderr, "slide-tile: give the target resolution with --mpp (um/px) or --magnification\n");
      return kExitUsage;
    }
  }
  slide::apps::install_interrupt_handlers("\ninterrupt: finishing the current transaction (Ctrl-C again to stop now)\n");
  auto summary = slide::tile::run_tiling(*collected, out_store, opt);
  if (!summary.ok()) return fail(summary.status());
  // report.html beside the store's databases; its failure is the run's (exit 1), after the summary.
  const slide::core::Status report = slide::apps::write_tile_report(out_store, qc_dir, *summary);
  if (slide::core::log_json()) {
    // One record per slide worth a look and one for the totals, instead of the table.
    for (const auto& o : summary->slides) {
      if (o.kind == slide::tile::SlideOutcomeKind::kFailed)
        slide::core::log_warn("slide failed", {{"slide", o.slide_id}, {"error", o.error.to_string()}});
      else if (o.kind == slide::tile::SlideOutcomeKind::kZeroTiles)
        slide::core::log_warn("slide has zero tiles", {{"slide", o.slide_id}});
    }
    slide::core::log_info("summary", {{"tiled", summary->count(slide::tile::SlideOutcomeKind::kTiled)},
                                      {"already_complete", summary->count(slide::tile::SlideOutcomeKind::kAlreadyComplete)},
                                      {"zero_tiles", summary->count(slide::tile::SlideOutcomeKind::kZeroTiles)},
                                      {"failed", summary->count(slide::tile::SlideOutcomeKind::kFailed)},
                                      {"tiles_written", summary->tiles_written}, {"seconds", summary->seconds},
                                      {"interrupted", summary->cancelled ? "yes" : "no"}});
  } else {
    std::string table = slide::tile::format_summary(*summary, log.quiet);
    std::fputs(table.c_str(), stderr);
  }
  if (!report.ok()) {
    const int code = fail(report.with_context("report.html"));
    if (!summary->cancelled) return code;
  }
  if (summary->cancelled) return kExitInterrupted;
  if (summary->count(slide::tile::SlideOutcomeKind::kFailed) > 0) return kExitSomeFailed;
  return kExitOk;
}

}  // namespace

// The last line of defence only: every error is meant to come back as a Status. An exception that
// escapes anyway (a library's, or a bug) ends the run with one line and exit 1, not an abort;
// the store stays consistent, as after a crash (LMDB commits are atomic).
int main(int argc, char** argv) {
  try {
    return run_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "slide-tile: internal error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "slide-tile: internal error: an unknown exception\n");
  }
  return kExitFailed;
}
