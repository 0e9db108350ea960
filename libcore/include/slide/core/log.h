// Logging to stderr: human lines ("[12:00:01] warn  message key=value") or one JSON object per
// line (--log-json: {"ts":..., "level":..., "msg":..., "key":"value"}). Thread-safe: each record
// is written with one write(2) under a mutex, so lines from worker threads never interleave.
#pragma once

#include <charconv>
#include <cmath>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace slide::core {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// A record's field. A number is written as std::to_string's text on human lines and as a JSON
// number (the shortest form that reads back to the same value, std::to_chars) with --log-json;
// NaN and infinity, which JSON lacks, as null.
struct LogField {
  std::string key;
  std::string value;  // the human text
  std::string json;   // a JSON literal for numbers; empty for strings (written quoted)
  LogField(std::string k, std::string v) : key(std::move(k)), value(std::move(v)) {}
  LogField(std::string k, const char* v) : key(std::move(k)), value(v) {}
  template <typename N, typename = decltype(std::to_string(N{}))>
  LogField(std::string k, N n) : key(std::move(k)), value(std::to_string(n)), json(json_number(n)) {}

 private:
  template <typename N>
  static std::string json_number(N n) {
    if constexpr (std::is_floating_point_v<N>) {
      if (!std::isfinite(n)) return "null";
      char buf[64];
      const auto r = std::to_chars(buf, buf + sizeof buf, n);
      return std::string(buf, r.ptr);
    } else {
      return std::to_string(n);
    }
  }
};

// Process-wide settings; set them once at start-up (apps/), before worker threads exist.
void set_log_level(LogLevel min_level);  // records below min_level are dropped
void set_log_json(bool json);
LogLevel log_level();
bool log_json();

void log(LogLevel level, std::string_view message, std::initializer_list<LogField> fields = {});
inline void log_debug(std::string_view m, std::initializer_list<LogField> f = {}) { log(LogLevel::kDebug, m, f); }
inline void log_info(std::string_view m, std::initializer_list<LogField> f = {}) { log(LogLevel::kInfo, m, f); }
inline void log_warn(std::string_view m, std::initializer_list<LogField> f = {}) { log(LogLevel::kWarn, m, f); }
inline void log_error(std::string_view m, std::initializer_list<LogField> f = {}) { log(LogLevel::kError, m, f); }

// Escapes a string for inclusion inside a JSON string literal (no surrounding quotes).
std::string json_escape(std::string_view s);

// Writes a whole line to stderr under the logging mutex (used by the progress reporter so its
// lines never interleave with log records).
void write_stderr_locked(std::string_view text);

}  // namespace slide::core
