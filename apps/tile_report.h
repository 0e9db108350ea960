// slide-tile's report.html (report.h): the store as it stands after a run, and that run.
#pragma once

#include <string>

#include "slide/core/status.h"
#include "slide/tile/pipeline.h"

namespace slide::apps {

// Inlined QC pictures stop at this many bytes of PNG (a page of thousands of slides stays one that
// a browser opens); the rest are named, in --qc-dir.
constexpr size_t kReportQcBytes = size_t{48} << 20;

// <store_dir>/report.html, written atomically: the store's settings and totals (its meta, every
// complete slide's record: tiles, candidates, tissue, level, resolutions, vendor), this run's
// outcomes (`summary`: tiled, already complete, zero tiles, failed with its error), and, when
// `qc_dir` is set, each slide's QC picture from it (thumbnail, tissue mask and tile grid) inlined,
// up to kReportQcBytes. Errors: opening the store (StoreReader::open's), writing the file.
[[nodiscard]] slide::core::Status write_tile_report(const std::string& store_dir, const std::string& qc_dir,
                                                    const slide::tile::RunSummary& summary);

}  // namespace slide::apps
