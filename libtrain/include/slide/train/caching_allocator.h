// A caching allocator for device memory (the cuda backend's), written as plain C++ over a raw
// memory source so that its logic (size classes, reuse, the budget, out-of-memory retry) is
// tested on the CPU with a fake source.
//
// Why a cache: cudaMalloc and cudaFree synchronise the device and cost tens to hundreds of
// microseconds each, and a training step allocates the same activation shapes every step; like
// PyTorch's CUDACachingAllocator, freed blocks are kept by size and handed out again without
// calling the device.
//
// Size classes (round_block_size): requests up to 1 MiB are rounded up to a multiple of 512 bytes;
// larger ones to a multiple of one eighth of the power of two at or above them (at most 12.5%
// waste; PyTorch's "roundup_power2_divisions" of 8). A cached block is reused only for a request
// of the same size class.
//
// Accounting: the budget (Allocator::budget_bytes, `--memory-budget`) counts the bytes asked for
// by live tensors, as on the CPU, so the planner's figures and the OOM-recovery paths mean the
// same on both devices. reserved_bytes() is what the device holds: live blocks at their rounded
// size plus cached blocks.
//
// Stream order: a block is handed out again as soon as it is deallocated. That is safe when every
// kernel touching device tensors runs on one stream, in order (the cuda backend's compute
// stream): the next user's kernels are queued after the last reader's. A block read by work on
// another stream (a copy stream) must not be deallocated before that work has completed (record
// and wait for an event first).
//
// Thread-safe: allocate/deallocate may be called from any thread.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "slide/train/allocator.h"

namespace slide::train {

// Where the caching allocator gets and returns memory (cudaMalloc/cudaFree for the cuda backend,
// a host heap in tests).
class RawDeviceMemory {
 public:
  virtual ~RawDeviceMemory() = default;
  virtual Device device() const = 0;
  // `bytes` (> 0, already rounded). Errors: kResourceExhausted when the device has no memory left
  // (the message names the device and the library's error), kInternal for any other failure.
  [[nodiscard]] virtual Result<void*> malloc(size_t bytes) = 0;
  virtual void free(void* ptr) = 0;
  // Allocator::zero_bytes / copy_bytes on this memory (cudaMemsetAsync / cudaMemcpyAsync on the
  // backend's stream). Errors: the device's.
  [[nodiscard]] virtual Status zero(void* ptr, size_t bytes) = 0;
  [[nodiscard]] virtual Status copy(void* dst, const void* src, size_t bytes) = 0;
};

// The size class of a request (see the file comment). round_block_size(0) == 0.
size_t round_block_size(size_t bytes);

class CachingDeviceAllocator final : public Allocator {
 public:
  explicit CachingDeviceAllocator(std::unique_ptr<RawDeviceMemory> raw);
  ~CachingDeviceAllocator() override;  // returns every cached block to the source

  Device device() const override { return raw_->device(); }
  // Errors: kInvalidArgument (bytes == 0); kResourceExhausted when the budget is exceeded (as
  // every Allocator), or when the device has no memory left even after every cached block was
  // returned to it ("cuda: out of device memory allocating B bytes for WHAT (L live, C reserved)").
  [[nodiscard]] Result<void*> allocate(size_t bytes, const std::string& what) override;
  void deallocate(void* ptr, size_t bytes) override;
  [[nodiscard]] Status zero_bytes(void* ptr, size_t bytes) override { return raw_->zero(ptr, bytes); }
  [[nodiscard]] Status copy_bytes(void* dst, const void* src, size_t bytes) override {
    return raw_->copy(dst, src, bytes);
  }

  // Returns every cached block to the source (cudaFree), e.g. before a cuDNN call that needs a
  // large workspace, or at the end of a run.
  void empty_cache();
  void trim_cache() override { empty_cache(); }
  size_t cached_bytes() const;
  size_t reserved_bytes() const;
  // Device calls made so far (for tests and logs: a warmed-up step makes none).
  size_t raw_mallocs() const;

 private:
  std::unique_ptr<RawDeviceMemory> raw_;
  mutable std::mutex mu_;
  std::unordered_multimap<size_t, void*> free_;  // size class -> block
  size_t cached_ = 0;
  size_t reserved_ = 0;
  size_t raw_mallocs_ = 0;
};

}  // namespace slide::train
