// The CSV dialect of our input files (slide manifests, slide labels): comma-separated, fields
// optionally in double quotes with "" for a quote inside them (RFC 4180), CR before LF ignored,
// no line breaks inside fields. A UTF-8 byte-order mark at the start of a line (Excel's "CSV UTF-8"
// writes one before the header) is skipped by both functions below, so every reader accepts it.
#pragma once

#include <string>
#include <vector>

namespace slide::core {

// The fields of one line, each trimmed of surrounding spaces and tabs.
std::vector<std::string> split_csv_line(const std::string& line);

// One field written so that split_csv_line gives it back unchanged: in double quotes (with ""
// for a quote) when it holds a comma, quote, CR or LF, starts with '#' (else
// csv_line_is_blank would take a first field's line for a comment) or starts with a UTF-8
// byte-order mark (else it would be skipped as the line's). The dialect trims spaces and tabs
// around every field, quoted or not: a field with them comes back trimmed.
std::string csv_quote(const std::string& field);

// True for lines a reader skips: empty, whitespace only, or a '#' comment.
bool csv_line_is_blank(const std::string& line);

}  // namespace slide::core
