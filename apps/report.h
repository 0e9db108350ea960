// report.html: a run's figures and tables on one self-contained page (issue 16 item 5): inline
// CSS, images as data: URIs, no script, nothing fetched from the network, so it opens from a
// cluster's file system, an e-mail or a lab notebook alike. Rendered by a real browser in the
// tests (headless Chromium, tests/e2e/test_slide_train.py TestReport).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace slide::apps {

// Base64 of `bytes` (RFC 4648 section 4: the standard alphabet, '=' padding, no line breaks).
std::string base64(std::string_view bytes);

// `text` for HTML element content and quoted attribute values: & < > " ' as character references.
// Bytes that are not valid UTF-8 become U+FFFD (slide ids come from file names).
std::string html_escape(std::string_view text);

// `value` through printf's `format` (one double conversion, e.g. "%.4g"), for table cells.
std::string format_number(double value, const char* format);

// The current time, "YYYY-MM-DD HH:MM:SS UTC".
std::string utc_now_text();

// A page built section by section; every text argument is escaped. Not thread-safe.
class HtmlReport {
 public:
  explicit HtmlReport(const std::string& title);
  void heading(const std::string& text);
  void paragraph(const std::string& text);
  // A two-column table (name, value).
  void key_values(const std::vector<std::pair<std::string, std::string>>& rows, const std::string& id = "");
  // A table with a header row; `id` (if any) names it for tests and links. A row whose first cell
  // names it is drawn with that cell as a row header (the confusion matrix's true classes).
  void table(const std::vector<std::string>& header, const std::vector<std::vector<std::string>>& rows,
             const std::string& id = "", bool first_column_is_header = false);
  // A PNG (its bytes) inlined as a data: URI, with alternative text.
  void png(std::string_view bytes, const std::string& alt);
  // The whole page (UTF-8).
  std::string html() const;

 private:
  std::string title_, body_;
};

}  // namespace slide::apps
