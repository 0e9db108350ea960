#include "slide/core/progress.h"

#include <unistd.h>

#include <cstdio>

#include "slide/core/log.h"

namespace slide::core {

Progress::Progress(std::string label, int64_t total, std::string unit, bool enabled, double period_s)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      enabled_(enabled),
      tty_(::isatty(STDERR_FILENO) == 1 && !log_json()),
      period_s_(period_s),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

Progress::~Progress() { finish(); }

void Progress::add(int64_t n) {
  count_.fetch_add(n);
  if (!enabled_) return;
  auto now = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || finished_) return;  // another thread is drawing
  double since = std::chrono::duration<double>(now - last_).count();
  if (since < (tty_ ? 0.2 : period_s_)) return;
  last_ = now;
  render(false);
}

void Progress::set_detail(std::string detail) {
  std::lock_guard<std::mutex> lock(mutex_);
  detail_ = std::move(detail);
}

void Progress::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_) return;
  finished_ = true;
  if (enabled_) render(true);
}

void Progress::render(bool final_line) {
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  int64_t n = count_.load();
  double rate = secs > 0 ? n / secs : 0.0;
  char buf[512];
  if (tty_ && !final_line) {
    int width = 30;
    int filled = total_ > 0 ? static_cast<int>(width * static_cast<double>(n) / total_) : 0;
    if (filled > width) filled = width;
    std::string bar(filled, '#');
    bar.resize(width, '.');
    std::snprintf(buf, sizeof buf, "\r%s [%s] %lld/%lld %.1f %s%s%s\x1b[K", label_.c_str(), bar.c_str(),
                  static_cast<long long>(n), static_cast<long long>(total_), rate, unit_.c_str(),
                  detail_.empty() ? "" : ", ", detail_.c_str());
    write_stderr_locked(buf);
    return;
  }
  if (final_line) {
    std::snprintf(buf, sizeof buf, "%s%s: %lld in %.1f s (%.1f %s%s%s)\n", tty_ ? "\r\x1b[K" : "", label_.c_str(),
                  static_cast<long long>(n), secs, rate, unit_.c_str(), detail_.empty() ? "" : ", ", detail_.c_str());
    if (log_json()) {
      log_info("progress done", {{"what", label_}, {"count", n}, {"seconds", std::to_string(secs)}});
      return;
    }
  } else {
    if (log_json()) {
      log_info("progress", {{"what", label_}, {"count", n}, {"total", total_}, {"rate", std::to_string(rate)},
                            {"detail", detail_}});
      return;
    }
    std::snprintf(buf, sizeof buf, "%s: %lld/%lld (%.1f %s%s%s)\n", label_.c_str(), static_cast<long long>(n),
                  static_cast<long long>(total_), rate, unit_.c_str(), detail_.empty() ? "" : ", ", detail_.c_str());
  }
  write_stderr_locked(buf);
}

}  // namespace slide::core
