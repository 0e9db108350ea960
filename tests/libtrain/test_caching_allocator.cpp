// The caching device allocator's logic on a fake device (a host heap with a capacity), so that
// the rules the cuda backend relies on are tested without a GPU.
#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <set>
#include <unordered_map>
#include <vector>

#include "slide/train/caching_allocator.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_caching_allocator {

using namespace slide::train;

namespace {

// A device with `capacity` bytes: malloc fails with kResourceExhausted past it, like cudaMalloc's
// cudaErrorMemoryAllocation mapped by the cuda backend.
class FakeDevice final : public RawDeviceMemory {
 public:
  explicit FakeDevice(size_t capacity, size_t* in_use, size_t* calls) : capacity_(capacity), in_use_(in_use), calls_(calls) {}
  Device device() const override { return Device::kCuda; }
  Result<void*> malloc(size_t bytes) override {
    ++*calls_;
    if (*in_use_ + bytes > capacity_) return slide::core::resource_exhausted("out of memory (fake cudaMalloc)");
    void* p = std::malloc(bytes);
    sizes_[p] = bytes;
    *in_use_ += bytes;
    return p;
  }
  Status zero(void* p, size_t bytes) override {
    std::memset(p, 0, bytes);
    return slide::core::ok_status();
  }
  Status copy(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return slide::core::ok_status();
  }
  void free(void* p) override {
    *in_use_ -= sizes_.at(p);
    sizes_.erase(p);
    std::free(p);
  }

 private:
  size_t capacity_;
  size_t* in_use_;
  size_t* calls_;
  std::unordered_map<void*, size_t> sizes_;
};

}  // namespace

TEST_CASE("round_block_size: 512-byte granules up to 1 MiB, then eighths of the next power of two") {
  CHECK(round_block_size(0) == 0);
  CHECK(round_block_size(1) == 512);
  CHECK(round_block_size(512) == 512);
  CHECK(round_block_size(513) == 1024);
  CHECK(round_block_size(1 << 20) == (1 << 20));
  CHECK(round_block_size((1 << 20) + 1) == (1 << 20) + (1 << 18));  // bit_ceil 2 MiB, step 256 KiB
  CHECK(round_block_size(100'000'000) == 100'663'296);               // bit_ceil 128 MiB, step 16 MiB: 6 steps
  for (size_t b : {size_t{3}, size_t{4097}, size_t{1} << 21, size_t{123456789}}) {
    CHECK(round_block_size(b) >= b);
    CHECK(round_block_size(b) <= b + b / 8 + 512);  // at most 12.5% waste (plus a granule)
  }
}

TEST_CASE("CachingDeviceAllocator: a warmed-up step makes no device calls; budget counts live bytes") {
  size_t in_use = 0, calls = 0;
  CachingDeviceAllocator a(std::make_unique<FakeDevice>(size_t{1} << 30, &in_use, &calls));
  CHECK(a.device() == Device::kCuda);
  auto step = [&] {
    std::vector<std::pair<void*, size_t>> live;
    for (size_t bytes : {size_t{1000}, size_t{1} << 20, size_t{3} << 20, size_t{1000}}) {
      auto p = a.allocate(bytes, "activation");
      REQUIRE(p.ok());
      live.push_back({*p, bytes});
    }
    CHECK(a.current_bytes() == 1000 + (1 << 20) + (3 << 20) + 1000);
    for (auto& [p, b] : live) a.deallocate(p, b);
  };
  step();
  const size_t after_first = calls;
  CHECK(after_first == 4);
  step();
  step();
  CHECK(calls == after_first);  // served from the cache
  CHECK(a.current_bytes() == 0);
  CHECK(a.cached_bytes() == a.reserved_bytes());
  CHECK(a.reserved_bytes() == in_use);
  a.empty_cache();
  CHECK(in_use == 0);
  CHECK(a.reserved_bytes() == 0);

  a.set_budget_bytes(4096);
  auto over = a.allocate(8192, "conv1 output");
  REQUIRE_FALSE(over.ok());
  CHECK(over.status().code() == slide::core::StatusCode::kResourceExhausted);
  CHECK(over.status().message().find("cuda memory budget of 4096 bytes exceeded: conv1 output") != std::string::npos);
  CHECK(a.current_bytes() == 0);
}

TEST_CASE("CachingDeviceAllocator: device out of memory returns the cache to the device and retries") {
  size_t in_use = 0, calls = 0;
  CachingDeviceAllocator a(std::make_unique<FakeDevice>(size_t{4} << 20, &in_use, &calls));
  // Fill the cache with 3 MiB of one size class, then ask for 2 MiB of another: the device has
  // 1 MiB free, so the first try fails, the cache is emptied, and the retry succeeds.
  auto p = a.allocate(size_t{3} << 20, "a");
  REQUIRE(p.ok());
  a.deallocate(*p, size_t{3} << 20);
  CHECK(a.cached_bytes() == (size_t{3} << 20));
  auto q = a.allocate(size_t{2} << 20, "b");
  REQUIRE(q.ok());
  CHECK(a.cached_bytes() == 0);
  CHECK(a.reserved_bytes() == (size_t{2} << 20));
  // A request the device cannot hold at all: kResourceExhausted naming the tensor, nothing counted.
  auto r = a.allocate(size_t{3} << 20, "layer4 output");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == slide::core::StatusCode::kResourceExhausted);
  CHECK(r.status().message().find("layer4 output") != std::string::npos);
  CHECK(r.status().message().find("fake cudaMalloc") != std::string::npos);
  CHECK(a.current_bytes() == (size_t{2} << 20));
  a.deallocate(*q, size_t{2} << 20);
}

TEST_CASE("CachingDeviceAllocator: blocks are reused only within their size class and never twice at once") {
  size_t in_use = 0, calls = 0;
  CachingDeviceAllocator a(std::make_unique<FakeDevice>(size_t{1} << 30, &in_use, &calls));
  std::set<void*> live;
  for (int i = 0; i < 8; ++i) {
    auto p = a.allocate(5000, "x");
    REQUIRE(p.ok());
    CHECK(live.insert(*p).second);  // distinct while live
  }
  for (void* p : live) a.deallocate(p, 5000);
  auto other = a.allocate(100, "small");  // another size class: a new block
  REQUIRE(other.ok());
  CHECK(live.count(*other) == 0);
  a.deallocate(*other, 100);
  auto same = a.allocate(5100, "same class");  // 5000 and 5100 both round to 5120
  REQUIRE(same.ok());
  CHECK(live.count(*same) == 1);
  a.deallocate(*same, 5100);
}

}  // namespace libtrain_test_caching_allocator
