// Device allocators that count bytes and enforce a budget (DESIGN.md, "Memory: never die of OOM").
//
// Every tensor's storage comes from its device's Allocator. An allocation that would take the
// device's live bytes past the budget fails with kResourceExhausted instead of reaching the
// system allocator, on CPU as on GPU, so the trainer's recovery paths (smaller micro-batch, more
// accumulation steps) are exercised on CPU in tests. Counters are atomic: allocate/deallocate
// may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "slide/core/status.h"

namespace slide::train {

using slide::core::Result;
using slide::core::Status;

// kSim, the simulated device: host memory that only a backend reads or writes (the reference
// backend on it is `reference-sim`). Host code must treat its tensors as on a GPU (upload,
// download; Tensor::data refuses them), so the CPU test suite runs the device paths of the
// trainer, evaluation and checkpoints without a GPU.
enum class Device : uint8_t { kCpu = 0, kCuda = 1, kSim = 2 };
const char* device_name(Device d);

class Allocator {
 public:
  // No budget: the default, until set_budget_bytes.
  static constexpr size_t kUnlimited = SIZE_MAX;

  virtual ~Allocator() = default;
  virtual Device device() const = 0;

  // `bytes` (> 0) of device memory, aligned to at least 64 bytes. Errors: kResourceExhausted when
  // current_bytes() + bytes would exceed the budget ("memory budget of B bytes exceeded: ..."),
  // or when the device itself has no memory left; kInvalidArgument for bytes == 0.
  [[nodiscard]] virtual Result<void*> allocate(size_t bytes, const std::string& what) = 0;
  // Returns memory from allocate(); `bytes` must be the size it was allocated with.
  virtual void deallocate(void* ptr, size_t bytes) = 0;
  // Zeroes `bytes` at `ptr`, and copies `bytes` between two blocks of this allocator's device
  // (Tensor::zeros and Tensor::clone call them). The defaults are the host's memset and memcpy; a
  // device allocator runs them on its device, in its stream order. Errors: the device's.
  [[nodiscard]] virtual Status zero_bytes(void* ptr, size_t bytes);
  [[nodiscard]] virtual Status copy_bytes(void* dst, const void* src, size_t bytes);
  // Returns cached free blocks to the system (or the driver), e.g. after an out-of-memory error
  // so that a retry with a smaller batch finds them. Allocators without a cache: nothing to do.
  virtual void trim_cache() {}

  size_t current_bytes() const { return current_.load(std::memory_order_relaxed); }
  size_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  size_t budget_bytes() const { return budget_.load(std::memory_order_relaxed); }
  void set_budget_bytes(size_t budget) { budget_.store(budget, std::memory_order_relaxed); }
  void reset_peak() { peak_.store(current_bytes(), std::memory_order_relaxed); }

 protected:
  // Counts `bytes` as live if the budget allows; the error names `what` and the figures.
  [[nodiscard]] Status reserve(size_t bytes, const std::string& what);
  void release(size_t bytes);

 private:
  std::atomic<size_t> current_{0};
  std::atomic<size_t> peak_{0};
  std::atomic<size_t> budget_{kUnlimited};
};

// Host memory, 64-byte aligned (a cache line; oneDNN's preferred alignment), with a cache of freed
// blocks by size: a training step allocates the same activation shapes every time, and fresh
// large blocks come from mmap and are faulted in page by page (measured: the page faults cost as
// much as the layers' arithmetic for batch norm and ReLU). Cached blocks do not count as live
// bytes against the budget; the cache holds at most cache_limit_bytes (default 4 GiB) and
// trim_cache() returns it to the system.
//
// With Device::kSim it is the simulated device's allocator (sim_device_allocator()): the same host
// memory and budget rules, its tensors labelled as a device's.
class CpuAllocator final : public Allocator {
 public:
  explicit CpuAllocator(Device device = Device::kCpu) : device_(device) {}
  ~CpuAllocator() override;
  Device device() const override { return device_; }
  [[nodiscard]] Result<void*> allocate(size_t bytes, const std::string& what) override;
  void deallocate(void* ptr, size_t bytes) override;
  void trim_cache() override;
  size_t cached_bytes() const;
  void set_cache_limit_bytes(size_t limit);

 private:
  const Device device_;
  mutable std::mutex mu_;
  std::unordered_multimap<size_t, void*> free_;  // rounded size -> block
  size_t cached_ = 0;
  size_t cache_limit_ = size_t{4} << 30;
};

// The process's CPU allocator (one budget for all host tensors).
CpuAllocator& cpu_allocator();
// The simulated device's allocator (Device::kSim; its own budget), for `reference-sim`.
CpuAllocator& sim_device_allocator();

// Parses a byte count with an optional binary suffix: "512M", "2G", "1.5GiB", "4096".
// Errors: kInvalidArgument naming the text.
[[nodiscard]] Result<size_t> parse_bytes(const std::string& text);

}  // namespace slide::train
