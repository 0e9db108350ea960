#include "slide/core/csv.h"

#include <string_view>

namespace slide::core {
namespace {

constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";

// Where a line's text starts: after a UTF-8 byte-order mark, if it has one.
size_t text_start(const std::string& line) { return std::string_view(line).starts_with(kUtf8Bom) ? kUtf8Bom.size() : 0; }

}  // namespace

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  bool quoted = false;
  for (size_t i = text_start(line); i < line.size(); ++i) {
    char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        cur += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        cur += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.push_back(cur);
      cur.clear();
    } else if (c != '\r') {
      cur += c;
    }
  }
  out.push_back(cur);
  for (auto& f : out) {
    auto b = f.find_first_not_of(" \t");
    auto e = f.find_last_not_of(" \t");
    f = b == std::string::npos ? std::string() : f.substr(b, e - b + 1);
  }
  return out;
}

bool csv_line_is_blank(const std::string& line) {
  size_t start = text_start(line);
  return line.find_first_not_of(" \t\r", start) == std::string::npos || line[start] == '#';
}

std::string csv_quote(const std::string& field) {
  // A leading '#' would make a first field's line a comment, and a leading byte-order mark would
  // be skipped as the line's: both are kept only inside quotes.
  if (field.find_first_of(",\"\n\r") == std::string::npos && (field.empty() || field.front() != '#') &&
      !std::string_view(field).starts_with(kUtf8Bom))
    return field;
  std::string out = "\"";
  for (char c : field) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace slide::core
