#include "embed_report.h"

#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <vector>

#include "report.h"
#include "slide/cache/bag.h"
#include "slide/core/file.h"

namespace slide::apps {

namespace {

std::string outcome_of(const slide::train::SlideOutcome& s) {
  if (s.status.code() == slide::core::StatusCode::kCancelled) return "interrupted (bag discarded)";
  if (!s.status.ok()) return "failed";
  if (s.skipped) return "already complete";
  if (s.tiles == 0) return "no tiles (no bag)";
  return "written";
}

}  // namespace

slide::core::Status write_embed_report(const std::string& out_dir, const std::string& bag_dir,
                                       const slide::train::EmbedModel& model, int64_t feature_dim,
                                       const slide::train::EmbedSummary& summary) {
  SLIDE_ASSIGN_OR_RETURN(const auto bags,
                         slide::cache::read_manifest(bag_dir + "/" + slide::cache::kManifestName));
  HtmlReport r("slide-embed report: " + std::filesystem::path(out_dir).filename().string());

  r.heading("Model");
  r.key_values({{"model", model.model},
                {"layer", model.layer},
                {"precision", slide::train::math_precision_name(model.precision)},
                {"feature dimension", std::to_string(feature_dim)},
                {"weights", model.weights_path},
                {"weights SHA-256", model.weights_sha256}},
               "model");

  r.heading("Bags");
  int64_t tiles = 0;
  std::set<int64_t> dims;
  std::set<std::string> dtypes;
  std::map<std::string, int64_t> per_label;
  for (const auto& b : bags) {
    tiles += b.num_tiles;
    dims.insert(b.feature_dim);
    dtypes.insert(slide::cache::feature_dtype_name(b.dtype));
    ++per_label[b.label.empty() ? "(none)" : b.label];
  }
  std::string dim_text, dtype_text, label_text;
  for (int64_t d : dims) dim_text += (dim_text.empty() ? "" : ", ") + std::to_string(d);
  for (const auto& d : dtypes) dtype_text += (dtype_text.empty() ? "" : ", ") + d;
  for (const auto& [l, n] : per_label) label_text += (label_text.empty() ? "" : ", ") + l + " " + std::to_string(n);
  r.key_values({{"directory", bag_dir},
                {"written", utc_now_text()},
                {"bags (bags.csv)", std::to_string(bags.size())},
                {"tiles", std::to_string(tiles)},
                {"feature dimension", dim_text.empty() ? "-" : dim_text},
                {"dtype", dtype_text.empty() ? "-" : dtype_text},
                {"bags per label", label_text.empty() ? "-" : label_text}},
               "bags");

  r.heading("This run");
  const auto counts = summary.counts();
  r.key_values({{"bags written", std::to_string(counts.written)},
                {"already complete", std::to_string(counts.skipped)},
                {"slides without tiles", std::to_string(counts.empty)},
                {"failed", std::to_string(summary.failed())},
                {"tiles embedded", std::to_string(summary.tiles_embedded)},
                {"seconds", format_number(summary.seconds, "%.1f")},
                {"tiles per second",
                 summary.seconds > 0 ? format_number(static_cast<double>(summary.tiles_embedded) / summary.seconds, "%.1f") : "-"},
                {"interrupted", summary.interrupted ? "yes (rerun the same command to finish)" : "no"}},
               "run");
  std::vector<std::vector<std::string>> rows;
  for (const auto& s : summary.slides)
    rows.push_back({s.slide_id, s.store, outcome_of(s), std::to_string(s.tiles), format_number(s.seconds, "%.2f"),
                    s.seconds > 0 && s.tiles > 0 && !s.skipped ? format_number(static_cast<double>(s.tiles) / s.seconds, "%.1f")
                                                               : std::string("-"),
                    s.status.ok() ? std::string() : s.status.to_string()});
  r.table({"slide", "store", "outcome", "tiles", "seconds", "tiles/s", "error"}, rows, "slides", true);
  return slide::core::write_file_atomic(out_dir + "/report.html", r.html());
}

}  // namespace slide::apps
