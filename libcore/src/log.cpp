#include "slide/core/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace slide::core {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<bool> g_json{false};
std::mutex g_mutex;

const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
  }
  return "info";
}

void write_all(int fd, std::string_view s) {
  while (!s.empty()) {
    ssize_t n = ::write(fd, s.data(), s.size());
    if (n <= 0) return;  // stderr gone: nothing better to do with a log line
    s.remove_prefix(static_cast<size_t>(n));
  }
}
}  // namespace

void set_log_level(LogLevel min_level) { g_level = static_cast<int>(min_level); }
void set_log_json(bool json) { g_json = json; }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }
bool log_json() { return g_json; }

std::string json_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

void write_stderr_locked(std::string_view text) {
  std::lock_guard<std::mutex> lock(g_mutex);
  write_all(STDERR_FILENO, text);
}

void log(LogLevel level, std::string_view message, std::initializer_list<LogField> fields) {
  if (static_cast<int>(level) < g_level.load()) return;
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char ts[64];
  std::string line;
  if (g_json) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
    std::snprintf(ts, sizeof ts, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                  tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
    line = std::string("{\"ts\":\"") + ts + "\",\"level\":\"" + level_name(level) + "\",\"msg\":\"" +
           json_escape(message) + "\"";
    for (const auto& f : fields)
      line += ",\"" + json_escape(f.key) + "\":" + (f.json.empty() ? "\"" + json_escape(f.value) + "\"" : f.json);
    line += "}\n";
  } else {
    std::snprintf(ts, sizeof ts, "%02d:%02d:%02d", tm.tm_hour, tm.tm_min, tm.tm_sec);
    char lv[8];
    std::snprintf(lv, sizeof lv, "%-5s", level_name(level));
    line = std::string("[") + ts + "] " + lv + " " + std::string(message);
    for (const auto& f : fields) {
      bool quote = f.value.find(' ') != std::string::npos || f.value.empty();
      line += " " + f.key + "=" + (quote ? "\"" + f.value + "\"" : f.value);
    }
    line += "\n";
  }
  write_stderr_locked(line);
}

}  // namespace slide::core
