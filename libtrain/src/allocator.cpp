#include "slide/train/allocator.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

namespace slide::train {

const char* device_name(Device d) {
  switch (d) {
    case Device::kCpu: return "cpu";
    case Device::kCuda: return "cuda";
    case Device::kSim: return "sim";
  }
  return "?";
}

Status Allocator::reserve(size_t bytes, const std::string& what) {
  const size_t budget = budget_bytes();
  size_t now = current_.load(std::memory_order_relaxed);
  do {
    if (bytes > budget || now > budget - bytes)
      return slide::core::resource_exhausted(std::string(device_name(device())) + " memory budget of " +
                                             std::to_string(budget) + " bytes exceeded: " + what + " needs " +
                                             std::to_string(bytes) + " bytes with " + std::to_string(now) +
                                             " in use");
  } while (!current_.compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
  size_t peak = peak_.load(std::memory_order_relaxed);
  while (now + bytes > peak && !peak_.compare_exchange_weak(peak, now + bytes, std::memory_order_relaxed)) {
  }
  return slide::core::ok_status();
}

void Allocator::release(size_t bytes) { current_.fetch_sub(bytes, std::memory_order_relaxed); }

Status Allocator::zero_bytes(void* ptr, size_t bytes) {
  if (bytes > 0) std::memset(ptr, 0, bytes);
  return slide::core::ok_status();
}

Status Allocator::copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return slide::core::ok_status();
}

CpuAllocator::~CpuAllocator() { trim_cache(); }

Result<void*> CpuAllocator::allocate(size_t bytes, const std::string& what) {
  if (bytes == 0) return slide::core::invalid_argument("allocate " + what + ": zero bytes");
  SLIDE_RETURN_IF_ERROR(reserve(bytes, what));
  // aligned_alloc needs a size that is a multiple of the alignment.
  const size_t rounded = (bytes + 63) / 64 * 64;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(rounded);
    if (it != free_.end()) {
      void* p = it->second;
      free_.erase(it);
      cached_ -= rounded;
      return p;
    }
  }
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) {
    trim_cache();  // the cache may hold what the system now lacks
    p = std::aligned_alloc(64, rounded);
  }
  if (p == nullptr) {
    release(bytes);
    return slide::core::resource_exhausted(std::string(device_name(device_)) + ": out of memory allocating " + std::to_string(bytes) + " bytes for " +
                                           what);
  }
  return p;
}

void CpuAllocator::deallocate(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  release(bytes);
  const size_t rounded = (bytes + 63) / 64 * 64;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_ + rounded <= cache_limit_) {
      free_.emplace(rounded, ptr);
      cached_ += rounded;
      return;
    }
  }
  std::free(ptr);
}

void CpuAllocator::trim_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [size, p] : free_) std::free(p);
  free_.clear();
  cached_ = 0;
}

size_t CpuAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

void CpuAllocator::set_cache_limit_bytes(size_t limit) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cache_limit_ = limit;
  }
  if (cached_bytes() > limit) trim_cache();
}

CpuAllocator& cpu_allocator() {
  static CpuAllocator a;
  return a;
}

CpuAllocator& sim_device_allocator() {
  static CpuAllocator a(Device::kSim);
  return a;
}

Result<size_t> parse_bytes(const std::string& text) {
  const char* s = text.c_str();
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  if (end == s || !(v >= 0) || !std::isfinite(v))
    return slide::core::invalid_argument("'" + text + "' is not a byte count (e.g. 512M, 2G, 4096)");
  std::string unit(end);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult = 1;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "K" || unit == "KB" || unit == "KIB") mult = 1024.0;
  else if (unit == "M" || unit == "MB" || unit == "MIB") mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GB" || unit == "GIB") mult = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TB" || unit == "TIB") mult = 1024.0 * 1024 * 1024 * 1024;
  else return slide::core::invalid_argument("'" + text + "': unknown unit '" + std::string(end) + "' (B, K, M, G, T)");
  const double bytes = v * mult;
  if (bytes >= 1.8e19) return slide::core::invalid_argument("'" + text + "' is too large");
  return static_cast<size_t>(bytes);
}

}  // namespace slide::train
