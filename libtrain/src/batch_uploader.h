// Input batches to a device on a copy engine of their own, double buffered (issue 11, "feeding the
// GPU"): the trainer's prefetch thread decodes micro-batch i+1 into pinned host memory and starts
// its copy while the device computes micro-batch i, and the training thread orders its ops after
// the copy on the device (cuda: cudaStreamWaitEvent, no host wait). PyTorch's DataLoader with
// pin_memory=True and a side stream for .to(non_blocking=True) does the same.
//
// Device buffers are kept and reused ("slots", two in steady state: the batch in use and the one
// being copied). A slot's next copy waits on the device only for the ops of the batch that used it
// last (a fence recorded when that batch was released), not for everything queued since, which is
// what lets the copy run beside the compute. A newly allocated buffer's first copy waits for
// everything queued (the caching allocator is ordered on the compute stream: a block it hands out
// may still be read by ops queued before). Buffers are freed only after their copies are complete.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "slide/train/backend.h"
#include "slide/train/copy_engine.h"

namespace slide::train {

class BatchUploader {
 public:
  // A batch on the device: images and labels are views into a slot's buffers, valid while `lease`
  // (or a copy of it) is held; releasing the last copy records where the batch's ops end, and the
  // slot can take the next batch.
  struct Uploaded {
    Tensor images, labels;
    std::shared_ptr<void> lease;
    int slot = -1;
  };

  // engine: a copy engine of be's device (Backend::new_copy_engine), not null.
  BatchUploader(Backend& be, std::unique_ptr<CopyEngine> engine);
  // Waits for every copy still in flight (a prefetched batch never used), then frees the buffers.
  // Every lease must have been released.
  ~BatchUploader();
  BatchUploader(const BatchUploader&) = delete;
  BatchUploader& operator=(const BatchUploader&) = delete;

  // Where to decode a batch for upload: pinned host memory on cuda (the copy is then a DMA beside
  // the compute), else the host allocator.
  Allocator& host_allocator();

  // Any thread (the prefetch thread): starts copying `images` and `labels` (host tensors, best
  // from host_allocator(); kept alive here until their copies are complete, and not to be written
  // meanwhile) into a free slot, growing its buffers when the batch is larger than any before.
  // Errors: kResourceExhausted (the device buffers, past the budget), the engine's.
  [[nodiscard]] Result<Uploaded> upload(const Tensor& images, const Tensor& labels);

  // The training thread, before the batch's first op: be's ops queued from now on run after the
  // batch's copies. Errors: the engine's.
  [[nodiscard]] Status ready(const Uploaded& batch);

  // Frees the buffers of the slots no batch holds (after their copies are complete): for
  // out-of-memory recovery. Errors: the engine's.
  [[nodiscard]] Status trim();

  // Slots made so far (tests: two in steady state).
  size_t slot_count();

 private:
  struct Slot {
    Tensor images, labels;            // device buffers, flat, at least the batch's element count
    Tensor host_images, host_labels;  // the sources of copies not yet waited for
    std::vector<uint64_t> tickets;    // copies not yet waited for
    std::unique_ptr<DeviceFence> released;  // the ops of the last batch that used the slot end here
    bool fresh = true;                // buffers not yet copied into: order after everything queued
    bool in_use = false;
  };
  // Waits for s's copies (host) and lets their sources go. The slot must be the caller's alone.
  Status settle(Slot& s);
  void release(int slot);

  Backend& be_;
  std::unique_ptr<CopyEngine> engine_;
  std::mutex mu_;  // guards slots_ and each slot's in_use and released
  std::vector<std::unique_ptr<Slot>> slots_;
};

}  // namespace slide::train
