// slide-train sweep's grid files (apps/sweep_grid.h), TOML and CSV, on arbitrary bytes: a grid is
// written by hand or by a script and read before any trial starts. Properties:
//   - never crashes or throws, and never spans more than kMaxTrials trials (a product of long
//     lists is refused before it fills memory);
//   - errors are kInvalidArgument naming the file;
//   - an accepted grid has at least one trial, and every option name is a letter or digit then
//     letters, digits, '-' and '_' (each becomes one `--name value` on a trial's command line);
//   - TOML: every trial names the same options in the same order (the grid's lines), each with a
//     non-empty value.
#include <cctype>
#include <string>

#include "fuzz_util.h"
#include "sweep_grid.h"

namespace {

void check_trials(const std::vector<slide::apps::Trial>& trials) {
  SLIDE_FUZZ_CHECK(!trials.empty() && trials.size() <= slide::apps::kMaxTrials);
  for (const auto& t : trials)
    for (const auto& [name, value] : t) {
      SLIDE_FUZZ_CHECK(!name.empty() && std::isalnum(static_cast<unsigned char>(name[0])));
      for (char c : name) SLIDE_FUZZ_CHECK(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_');
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const bool csv : {false, true}) {
    const std::string path = csv ? "grid.csv" : "grid.toml";
    auto r = csv ? slide::apps::read_csv_grid(path, text) : slide::apps::read_toml_grid(path, text);
    if (!r.ok()) {
      SLIDE_FUZZ_CHECK(r.status().code() == slide::core::StatusCode::kInvalidArgument);
      SLIDE_FUZZ_CHECK(r.status().message().rfind(path + ":", 0) == 0);
      continue;
    }
    check_trials(*r);
    if (csv) continue;
    const auto& first = r->front();
    for (const auto& t : *r) {
      SLIDE_FUZZ_CHECK(t.size() == first.size());
      for (size_t i = 0; i < t.size(); ++i) SLIDE_FUZZ_CHECK(t[i].first == first[i].first);
    }
    // Every value is given (an empty one would be `--name ""`).
    for (const auto& t : *r)
      for (const auto& [name, value] : t) SLIDE_FUZZ_CHECK(!value.empty());
  }
  return 0;
}
