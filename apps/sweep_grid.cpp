#include "sweep_grid.h"

#include <sstream>

#include "slide/core/csv.h"

namespace slide::apps {

namespace {

using slide::core::invalid_argument;
using slide::core::Result;

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

std::string unquote(const std::string& v) {
  if (v.size() >= 2 && (v.front() == '"' || v.front() == '\'') && v.back() == v.front()) return v.substr(1, v.size() - 2);
  return v;
}

// `[a, "b", 3]` -> {a, b, 3}: commas outside quotes split.
std::vector<std::string> split_list(const std::string& body) {
  std::vector<std::string> out;
  std::string cur;
  char quote = 0;
  for (char c : body) {
    if (quote) {
      cur += c;
      if (c == quote) quote = 0;
    } else if (c == '"' || c == '\'') {
      quote = c;
      cur += c;
    } else if (c == ',') {
      out.push_back(unquote(trim(cur)));
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!trim(cur).empty()) out.push_back(unquote(trim(cur)));
  return out;
}

// The line without its '#' comment: from the first '#' outside quotes ("..." or '...').
std::string strip_comment(const std::string& line) {
  char quote = 0;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quote) {
      if (c == quote) quote = 0;
    } else if (c == '"' || c == '\'') {
      quote = c;
    } else if (c == '#') {
      return line.substr(0, i);
    }
  }
  return line;
}

std::string at(const std::string& path, int line) { return path + ":" + std::to_string(line) + ": "; }

// An option name as slide-train spells it after its dashes: a letter or digit, then letters,
// digits, '-' or '_' (so that `--name` is one option on a trial's command line).
bool option_name(const std::string& name) {
  auto word = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); };
  if (name.empty() || !word(name.front())) return false;
  for (char c : name)
    if (!word(c) && c != '-' && c != '_') return false;
  return true;
}

// "--lr" -> "lr".
std::string strip_dashes(const std::string& name) { return name.rfind("--", 0) == 0 ? name.substr(2) : name; }

}  // namespace

Result<std::vector<Trial>> read_toml_grid(const std::string& path, const std::string& text) {
  std::vector<std::pair<std::string, std::vector<std::string>>> axes;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  size_t product = 1;
  while (std::getline(in, line)) {
    ++n;
    const std::string t = trim(strip_comment(line));
    if (t.empty() || (t.front() == '[' && t.find('=') == std::string::npos)) continue;  // [section]
    const auto eq = t.find('=');
    if (eq == std::string::npos) return invalid_argument(at(path, n) + "expected 'option = value' or 'option = [v1, v2]'");
    const std::string key = strip_dashes(trim(t.substr(0, eq))), value = trim(t.substr(eq + 1));
    if (key.empty() || value.empty()) return invalid_argument(at(path, n) + "an option name and a value are needed");
    if (!option_name(key))
      return invalid_argument(at(path, n) + "'" + key + "' is not an option name (letters, digits, '-', '_')");
    std::vector<std::string> values;
    if (value.front() == '[') {
      if (value.back() != ']') return invalid_argument(at(path, n) + "a list must end with ']' on its line");
      values = split_list(value.substr(1, value.size() - 2));
      if (values.empty()) return invalid_argument(at(path, n) + "an empty list");
      for (const std::string& v : values)
        if (v.empty()) return invalid_argument(at(path, n) + "an empty value in the list");
    } else {
      values = {unquote(value)};
      if (values[0].empty()) return invalid_argument(at(path, n) + "an empty value");
    }
    if (values.size() > kMaxTrials / product)
      return invalid_argument(at(path, n) + "the grid spans more than " + std::to_string(kMaxTrials) +
                              " trials (the product of its lists)");
    product *= values.size();
    axes.push_back({key, values});
  }
  if (axes.empty()) return invalid_argument(path + ": no options");
  std::vector<Trial> trials{Trial{}};
  for (const auto& [key, values] : axes) {  // the cartesian product, the last axis fastest
    std::vector<Trial> next;
    next.reserve(trials.size() * values.size());
    for (const Trial& t : trials)
      for (const std::string& v : values) {
        Trial u = t;
        u.push_back({key, v});
        next.push_back(std::move(u));
      }
    trials = std::move(next);
  }
  return trials;
}

Result<std::vector<Trial>> read_csv_grid(const std::string& path, const std::string& text) {
  std::istringstream in(text);
  std::string line;
  std::vector<std::string> header;
  std::vector<Trial> trials;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (slide::core::csv_line_is_blank(line) || trim(line).front() == '#') continue;  // also an indented comment
    std::vector<std::string> cells = slide::core::split_csv_line(line);
    if (header.empty()) {
      for (auto& c : cells) {
        header.push_back(strip_dashes(c));
        if (!option_name(header.back()))
          return invalid_argument(at(path, n) + "'" + header.back() +
                                  "' in the header is not an option name (letters, digits, '-', '_')");
      }
      continue;
    }
    if (cells.size() > header.size()) return invalid_argument(at(path, n) + "more cells than the header names");
    if (trials.size() == kMaxTrials)
      return invalid_argument(at(path, n) + "more than " + std::to_string(kMaxTrials) + " trials");
    Trial t;
    for (size_t i = 0; i < cells.size(); ++i)
      if (!cells[i].empty()) t.push_back({header[i], cells[i]});
    trials.push_back(std::move(t));
  }
  if (trials.empty()) return invalid_argument(path + ": no trials (a header row, then one row per trial)");
  return trials;
}

}  // namespace slide::apps
