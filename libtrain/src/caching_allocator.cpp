#include "slide/train/caching_allocator.h"

#include <bit>
#include <vector>

namespace slide::train {

size_t round_block_size(size_t bytes) {
  constexpr size_t kSmall = size_t{1} << 20, kGranule = 512;
  if (bytes <= kSmall) return (bytes + kGranule - 1) / kGranule * kGranule;
  const size_t pow2 = std::bit_ceil(bytes);
  const size_t step = pow2 / 8;
  return (bytes + step - 1) / step * step;
}

CachingDeviceAllocator::CachingDeviceAllocator(std::unique_ptr<RawDeviceMemory> raw) : raw_(std::move(raw)) {}

CachingDeviceAllocator::~CachingDeviceAllocator() { empty_cache(); }

Result<void*> CachingDeviceAllocator::allocate(size_t bytes, const std::string& what) {
  if (bytes == 0) return slide::core::invalid_argument("allocate " + what + ": zero bytes");
  SLIDE_RETURN_IF_ERROR(reserve(bytes, what));
  const size_t size = round_block_size(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(size);
    if (it != free_.end()) {
      void* p = it->second;
      free_.erase(it);
      cached_ -= size;
      return p;
    }
  }
  Result<void*> p = raw_->malloc(size);
  if (!p.ok() && p.status().code() == slide::core::StatusCode::kResourceExhausted) {
    empty_cache();  // cached blocks of other sizes may be what the device now lacks
    p = raw_->malloc(size);
  }
  if (!p.ok()) {
    release(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    return slide::core::Status(p.status().code(),
                               std::string(device_name(device())) + ": allocating " + std::to_string(bytes) +
                                   " bytes for " + what + " (" + std::to_string(current_bytes()) + " live, " +
                                   std::to_string(reserved_) + " reserved): " + p.status().message());
  }
  std::lock_guard<std::mutex> lock(mu_);
  reserved_ += size;
  ++raw_mallocs_;
  return *p;
}

void CachingDeviceAllocator::deallocate(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  release(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t size = round_block_size(bytes);
  free_.emplace(size, ptr);
  cached_ += size;
}

void CachingDeviceAllocator::empty_cache() {
  std::vector<std::pair<size_t, void*>> blocks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    blocks.assign(free_.begin(), free_.end());
    free_.clear();
    reserved_ -= cached_;
    cached_ = 0;
  }
  for (auto& [size, p] : blocks) raw_->free(p);
}

size_t CachingDeviceAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

size_t CachingDeviceAllocator::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

size_t CachingDeviceAllocator::raw_mallocs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return raw_mallocs_;
}

}  // namespace slide::train
