// Progress reporting on stderr: a live bar redrawn in place when stderr is a terminal, otherwise
// (pipes, CI, --log-json) a line at most every `period_s` seconds and one at the end.
// Thread-safe: add() may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace slide::core {

class Progress {
 public:
  // label: what is counted ("tiles of CMU-1"); total: expected count (0 if unknown);
  // unit: shown after the rate ("tiles/s"). enabled=false silences it (--quiet).
  Progress(std::string label, int64_t total, std::string unit, bool enabled = true, double period_s = 10.0);
  ~Progress();  // calls finish() if not called
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void add(int64_t n = 1);
  // A short text shown after the rate from the next line on, e.g. "loss 0.513, 3.2 steps/s".
  void set_detail(std::string detail);
  // Prints the final line ("label: N unit in S s (R unit/s)"); idempotent.
  void finish();
  int64_t count() const { return count_.load(); }

 private:
  void render(bool final_line);

  std::string label_, unit_, detail_;
  int64_t total_;
  bool enabled_, tty_;
  double period_s_;
  std::atomic<int64_t> count_{0};
  std::chrono::steady_clock::time_point start_, last_;
  std::mutex mutex_;
  bool finished_ = false;
};

}  // namespace slide::core
