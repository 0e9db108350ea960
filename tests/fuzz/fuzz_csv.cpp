// The CSV dialect of manifests and label files (slide/core/csv.h) on arbitrary lines.
// Properties, with the input taken as one line:
//   - split_csv_line and csv_line_is_blank never crash; a line has at least one field and every
//     field is trimmed of spaces and tabs;
//   - round trip: the fields written back with csv_quote and joined by ',' split into the same
//     fields, and that line is blank only when the row is one empty field;
//   - every piece of the input cut at '\n' (an arbitrary field) comes back from
//     split_csv_line(csv_quote(piece)) as the one field piece, trimmed.
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "slide/core/csv.h"

namespace {

std::string trimmed(const std::string& s) {
  auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  auto e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace slide::core;
  const std::string line(reinterpret_cast<const char*>(data), size);
  (void)csv_line_is_blank(line);
  const std::vector<std::string> fields = split_csv_line(line);
  SLIDE_FUZZ_CHECK(!fields.empty());
  for (const auto& f : fields) SLIDE_FUZZ_CHECK(f == trimmed(f));

  std::string joined;
  for (size_t i = 0; i < fields.size(); ++i) joined += (i ? "," : "") + csv_quote(fields[i]);
  SLIDE_FUZZ_CHECK(split_csv_line(joined) == fields);
  const bool one_empty_field = fields.size() == 1 && fields[0].empty();
  SLIDE_FUZZ_CHECK(csv_line_is_blank(joined) == one_empty_field);

  size_t start = 0;
  while (start <= line.size()) {
    size_t end = line.find('\n', start);
    if (end == std::string::npos) end = line.size();
    const std::string piece = line.substr(start, end - start);
    const std::vector<std::string> back = split_csv_line(csv_quote(piece));
    SLIDE_FUZZ_CHECK(back.size() == 1);
    SLIDE_FUZZ_CHECK(back[0] == trimmed(piece));
    start = end + 1;
  }
  return 0;
}
