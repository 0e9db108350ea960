#include "tile_report.h"

#include <cstdio>
#include <filesystem>
#include <map>
#include <vector>

#include "report.h"
#include "slide/core/file.h"
#include "slide/core/file_name.h"
#include "slide/tile/store.h"

namespace slide::apps {

namespace {

const char* outcome_name(slide::tile::SlideOutcomeKind k) {
  switch (k) {
    case slide::tile::SlideOutcomeKind::kTiled: return "tiled";
    case slide::tile::SlideOutcomeKind::kAlreadyComplete: return "already complete";
    case slide::tile::SlideOutcomeKind::kZeroTiles: return "zero tiles";
    case slide::tile::SlideOutcomeKind::kFailed: return "failed";
    default: return "not in this shard";
  }
}

}  // namespace

slide::core::Status write_tile_report(const std::string& store_dir, const std::string& qc_dir,
                                      const slide::tile::RunSummary& summary) {
  using slide::tile::SlideOutcomeKind;
  SLIDE_ASSIGN_OR_RETURN(auto reader, slide::tile::StoreReader::open(store_dir));
  const auto& meta = reader->meta();
  const auto& slides = reader->slides();

  HtmlReport r("slide-tile report: " + std::filesystem::path(store_dir).filename().string());
  r.heading("Store");
  std::map<int32_t, uint64_t> per_label;
  for (const auto& s : slides) per_label[s.label_index] += s.tile_count;
  std::string labels;
  for (const auto& [idx, n] : per_label) {
    if (meta.label_names.empty()) break;
    labels += (labels.empty() ? "" : ", ") +
              (idx < 0 ? std::string("unlabelled") : meta.label_names.at(static_cast<size_t>(idx))) + " " +
              std::to_string(n);
  }
  std::vector<std::pair<std::string, std::string>> store = {
      {"store", store_dir},
      {"written", utc_now_text()},
      {"slides", std::to_string(slides.size()) + " complete"},
      {"tiles", std::to_string(reader->tile_count())},
      {"tile size", std::to_string(meta.tile_size_px) + " px, stride " + std::to_string(meta.stride_px) + " px"},
      {"resolution", meta.target_mpp_um > 0 ? format_number(meta.target_mpp_um, "%.4g um/px") : std::string("as stored (patches)")},
      {"encoding", std::string(meta.encoding == slide::tile::TileEncoding::kJpeg ? "jpeg" : "raw") +
                       (meta.encoding == slide::tile::TileEncoding::kJpeg ? ", quality " + std::to_string(meta.jpeg_quality) : "")},
      {"minimum tissue per tile", format_number(meta.min_tissue, "%.3g")},
      {"labels (tiles)", labels.empty() ? "none" : labels},
      {"made by", meta.command_line}};
  if (!meta.tissue_options.empty()) store.push_back({"tissue detection", meta.tissue_options});
  if (!meta.annotation_options.empty()) store.push_back({"annotations", meta.annotation_options});
  if (!meta.stain_normalization.empty()) store.push_back({"stain normalisation", meta.stain_normalization});
  r.key_values(store, "store");

  r.heading("This run");
  r.key_values({{"tiled", std::to_string(summary.count(SlideOutcomeKind::kTiled))},
                {"already complete", std::to_string(summary.count(SlideOutcomeKind::kAlreadyComplete))},
                {"zero tiles", std::to_string(summary.count(SlideOutcomeKind::kZeroTiles))},
                {"failed", std::to_string(summary.count(SlideOutcomeKind::kFailed))},
                {"tiles written", std::to_string(summary.tiles_written)},
                {"seconds", format_number(summary.seconds, "%.1f")},
                {"interrupted", summary.cancelled ? "yes (rerun the same command to finish)" : "no"}},
               "run");
  std::vector<std::vector<std::string>> notable;
  for (const auto& o : summary.slides)
    if (o.kind == SlideOutcomeKind::kFailed || o.kind == SlideOutcomeKind::kZeroTiles)
      notable.push_back({o.slide_id, outcome_name(o.kind), o.path,
                         o.kind == SlideOutcomeKind::kFailed ? o.error.to_string()
                                                             : "no tile passed the tissue filter (see its QC picture)"});
  if (!notable.empty()) {
    r.heading("Slides that failed or gave no tiles");
    r.table({"slide", "outcome", "path", "error"}, notable, "failures", true);
  }

  r.heading("Slides");
  std::vector<std::vector<std::string>> rows;
  for (const auto& s : slides)
    rows.push_back({s.slide_id, s.label.empty() ? "-" : s.label, std::to_string(s.tile_count),
                    std::to_string(s.candidate_tiles), format_number(100.0 * s.tissue_fraction, "%.1f%%"),
                    std::to_string(s.level), format_number(s.downsample, "%.4g"),
                    s.tile_mpp_um > 0 ? format_number(s.tile_mpp_um, "%.4g") : std::string("-"),
                    s.source_mpp_um > 0 ? format_number(s.source_mpp_um, "%.4g") + " (" + s.mpp_source + ")" : std::string("-"),
                    std::to_string(s.width_l0) + " x " + std::to_string(s.height_l0), s.vendor,
                    s.passthrough ? "yes" : "no"});
  r.table({"slide", "label", "tiles", "candidates", "tissue", "level", "downsample", "tile um/px", "level-0 um/px",
           "level-0 size (px)", "vendor", "pass-through"},
          rows, "slides", true);

  if (!qc_dir.empty()) {
    r.heading("Quality control: thumbnail, tissue mask and tiles");
    size_t inlined = 0, bytes = 0;
    std::vector<std::string> left_out;
    for (const auto& s : slides) {
      const std::string path = qc_dir + "/" + slide::core::slide_file_stem(s.slide_id) + ".png";
      auto png = slide::core::read_file(path);
      if (!png.ok()) continue;  // made by an earlier run without --qc-dir, or removed since
      if (bytes + png->size() > kReportQcBytes) {
        left_out.push_back(s.slide_id);
        continue;
      }
      bytes += png->size(), ++inlined;
      r.png(*png, "QC picture of " + s.slide_id);
    }
    if (!left_out.empty())
      r.paragraph(std::to_string(left_out.size()) + " more QC pictures are in " + qc_dir + " (past the page's " +
                  std::to_string(kReportQcBytes >> 20) + " MiB of pictures), the first " + left_out.front());
    if (inlined == 0 && left_out.empty()) r.paragraph("No QC picture in " + qc_dir + ".");
  }
  return slide::core::write_file_atomic(store_dir + "/report.html", r.html());
}

}  // namespace slide::apps
