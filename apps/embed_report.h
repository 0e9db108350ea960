// slide-embed's report.html (report.h): the bag directory as it stands after a run, and that run.
#pragma once

#include <string>

#include "slide/core/status.h"
#include "slide/train/embed.h"

namespace slide::apps {

// <out_dir>/report.html, written atomically: the model (name, layer, feature dimension, weights'
// SHA-256), the bag directory's totals (its bags.csv, in `bag_dir`: bags, tiles, dimension, dtype,
// labels), this run's outcome counts and throughput, a row per slide of this run (store, tiles,
// seconds, tiles/s, written / already complete / no tiles / failed with its error / interrupted).
// Errors: reading bags.csv (kNotFound when the run wrote none), writing the file.
[[nodiscard]] slide::core::Status write_embed_report(const std::string& out_dir, const std::string& bag_dir,
                                                     const slide::train::EmbedModel& model, int64_t feature_dim,
                                                     const slide::train::EmbedSummary& summary);

}  // namespace slide::apps
