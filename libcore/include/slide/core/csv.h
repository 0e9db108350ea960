// The CSV dialect of our input files (slide manifests, slide labels): comma-separated, fields
// optionally in double quotes with "" for a quote inside them (RFC 4180), CR before LF ignored,
// no line breaks inside fields.
#pragma once

#include <string>
#include <vector>

namespace slide::core {

// The fields of one line, each trimmed of surrounding spaces and tabs.
std::vector<std::string> split_csv_line(const std::string& line);

// True for lines a reader skips: empty, whitespace only, or a '#' comment.
bool csv_line_is_blank(const std::string& line);

}  // namespace slide::core
