#include "report.h"

#include <cstdint>
#include <cstdio>
#include <ctime>

#include "slide/core/file_name.h"

namespace slide::apps {

std::string base64(std::string_view bytes) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = (uint32_t{static_cast<uint8_t>(bytes[i])} << 16) |
                       (uint32_t{static_cast<uint8_t>(bytes[i + 1])} << 8) | static_cast<uint8_t>(bytes[i + 2]);
    out += kAlphabet[(v >> 18) & 63], out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63], out += kAlphabet[v & 63];
  }
  if (const size_t rest = bytes.size() - i; rest > 0) {
    uint32_t v = uint32_t{static_cast<uint8_t>(bytes[i])} << 16;
    if (rest == 2) v |= uint32_t{static_cast<uint8_t>(bytes[i + 1])} << 8;
    out += kAlphabet[(v >> 18) & 63], out += kAlphabet[(v >> 12) & 63];
    out += rest == 2 ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    switch (c) {
      case '&': out += "&amp;"; ++i; continue;
      case '<': out += "&lt;"; ++i; continue;
      case '>': out += "&gt;"; ++i; continue;
      case '"': out += "&quot;"; ++i; continue;
      case '\'': out += "&#39;"; ++i; continue;
      default: break;
    }
    const size_t n = slide::core::utf8_sequence_length(text, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

std::string format_number(double value, const char* format) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, value);
  return buf;
}

std::string utc_now_text() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return when;
}

HtmlReport::HtmlReport(const std::string& title) : title_(title) {}

void HtmlReport::heading(const std::string& text) { body_ += "<h2>" + html_escape(text) + "</h2>\n"; }

void HtmlReport::paragraph(const std::string& text) { body_ += "<p>" + html_escape(text) + "</p>\n"; }

void HtmlReport::key_values(const std::vector<std::pair<std::string, std::string>>& rows, const std::string& id) {
  body_ += "<table class=\"kv\"" + (id.empty() ? std::string() : " id=\"" + html_escape(id) + "\"") + ">\n";
  for (const auto& [k, v] : rows) body_ += "<tr><th>" + html_escape(k) + "</th><td>" + html_escape(v) + "</td></tr>\n";
  body_ += "</table>\n";
}

void HtmlReport::table(const std::vector<std::string>& header, const std::vector<std::vector<std::string>>& rows,
                       const std::string& id, bool first_column_is_header) {
  body_ += "<table" + (id.empty() ? std::string() : " id=\"" + html_escape(id) + "\"") + ">\n<thead><tr>";
  for (const auto& h : header) body_ += "<th>" + html_escape(h) + "</th>";
  body_ += "</tr></thead>\n<tbody>\n";
  for (const auto& row : rows) {
    body_ += "<tr>";
    for (size_t i = 0; i < row.size(); ++i) {
      const char* tag = first_column_is_header && i == 0 ? "th" : "td";
      body_ += std::string("<") + tag + ">" + html_escape(row[i]) + "</" + tag + ">";
    }
    body_ += "</tr>\n";
  }
  body_ += "</tbody></table>\n";
}

void HtmlReport::png(std::string_view bytes, const std::string& alt) {
  body_ += "<p><img alt=\"" + html_escape(alt) + "\" src=\"data:image/png;base64," + base64(bytes) + "\"></p>\n";
}

std::string HtmlReport::html() const {
  return "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>" + html_escape(title_) +
         "</title>\n<style>\n"
         "body { font-family: 'DejaVu Sans', Arial, sans-serif; margin: 2em; color: #222; }\n"
         "table { border-collapse: collapse; margin: 0.5em 0 1.5em; }\n"
         "th, td { border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: right; }\n"
         "th { background: #eee; } tbody th, table.kv th, table.kv td { text-align: left; }\n"
         "img { max-width: 100%; }\n"
         "</style>\n</head>\n<body>\n<h1>" +
         html_escape(title_) + "</h1>\n" + body_ + "</body>\n</html>\n";
}

}  // namespace slide::apps
