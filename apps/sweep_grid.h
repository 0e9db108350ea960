// slide-train sweep's grid files (slide_train_sweep.h): the trials a TOML grid or a CSV spans.
// Apart from the sweep's process management so that its fuzz target (tests/fuzz/fuzz_sweep_grid)
// links it alone.
//
// TOML (a subset): `option = value` or `option = [v1, v2, ...]` per line (option names with or
// without the leading dashes; strings quoted or bare; '#' comments outside quotes; [sections]
// skipped); the lists span a cartesian product in file order, the last line's values fastest.
// CSV (slide/core/csv.h's dialect: RFC 4180 double quotes with "" for a quote, no quoted
// newlines; a single quote is an ordinary character): a header row naming the options, then one
// row per trial; an empty cell leaves the option out; '#' lines are comments.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "slide/core/status.h"

namespace slide::apps {

// One trial: its options in order (name without dashes, value; a flag has value "true").
using Trial = std::vector<std::pair<std::string, std::string>>;

// More trials than anyone runs: a grid spanning more is a mistake (a product of long lists), refused
// before it fills memory.
inline constexpr size_t kMaxTrials = 100000;

// `text` is the file's contents; `path` names it in errors. Errors: kInvalidArgument naming the file
// and line (no '=', an empty name or value, a name that is not letters, digits, '-' and '_'
// after its leading dashes, a list not closed on its line, an empty list or list value, no options or trials, a
// row with more cells than the header, more than kMaxTrials trials).
[[nodiscard]] slide::core::Result<std::vector<Trial>> read_toml_grid(const std::string& path, const std::string& text);
[[nodiscard]] slide::core::Result<std::vector<Trial>> read_csv_grid(const std::string& path, const std::string& text);

}  // namespace slide::apps
