// Activation offload (TFLMS's swap-out / swap-in; vDNN, Rhu et al. 2016): the activations a
// segment of layers saves for backward leave the device for host memory once the segment's forward
// is done, and come back before its backward, so the device holds two segments' saved
// activations at a time (plus the segments' boundaries) instead of the whole model's.
//
// Which tensors: every storage made (Tensor::empty) during the segment's training forward that is
// still alive when it ends, but for the segment's output: exactly what its layers keep for
// backward, whatever the layers are (Tensor::set_storage_capture), with no per-layer code. They
// go to host memory through the copy engine and their device storage is freed
// (Tensor::evict_storage); backward allocates it again and copies the bytes back, so every
// tensor that shared it sees the same bytes at the same address kind, and the gradients are
// bit-identical to a run without offload.
//
// The schedule (one OffloadSchedule per model, its segments in forward order), TFLMS's swap-out /
// swap-in with a lookahead of one segment:
// - forward of segment i: its layers run; then segment i-1's copies to the host, started when
//   i-1's forward ended and run while i computed, are waited for and i-1's device memory freed;
//   then i's own copies to the host start;
// - the last segment's activations stay on the device: its backward follows at once;
// - backward of segment i: its activations are on the device (brought back ahead, or now); then
//   segment i-1's copies back to the device
//   start (allocated now: past the budget the prefetch is skipped and i-1 is brought back when
//   its backward starts), and i's backward runs while they copy.
// So the device holds at most two segments' saved activations, and the copies run beside the
// compute on the backend's CopyEngine (copy_engine.h): a copy stream on cuda, a copy thread on
// the simulated device; without an engine (the planning backend, host backends) the same
// schedule copies synchronously, so the planner counts the peak the real run has.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "slide/train/activation_checkpoint.h"
#include "slide/train/allocator.h"

namespace slide::train {

class CopyEngine;
class OffloadSchedule;

// Runs `layers` (in order) as one segment whose saved activations live in host memory between its
// forward and its backward, on its model's schedule (above).
class OffloadedSegment final : public Segment {
 public:
  OffloadedSegment(std::vector<std::unique_ptr<Layer>> layers, std::vector<std::string> names,
                   std::shared_ptr<OffloadSchedule> schedule);
  ~OffloadedSegment() override;
  // Training: runs the layers, frees the previous segment's device copies once they are on the
  // host, and starts moving what these layers saved to host memory. Inference: runs them.
  // Errors: the layers'; the host allocator's (kResourceExhausted naming the offloaded tensor);
  // the copy engine's.
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  // Has the saved activations on the device (device allocations: kResourceExhausted past the
  // budget), starts bringing the previous segment's back, then runs the layers' backward.
  // Errors: kFailedPrecondition without a training forward; the copy engine's.
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  // Waits for this segment's copies in flight, then drops its saved state.
  void release() override;
  // Bytes now held in host memory for this segment (0 outside a forward/backward pair).
  size_t offloaded_bytes() const;

 private:
  friend class OffloadSchedule;
  // Where the saved activations are.
  enum class Where { kNone, kLeaving, kOnHost, kReturning, kOnDevice };
  struct Moved {
    Tensor device;  // the whole storage, flat u8 (evicted while on the host)
    Tensor host;    // its bytes
    uint64_t ticket = 0;
  };
  Status finish_leaving(bool free_device);  // waits the copies to the host; frees or keeps
  Status start_returning(Backend& be, bool required);
  Status finish_returning();
  void drain();  // waits every copy in flight (errors dropped: the segment is being released)

  std::shared_ptr<OffloadSchedule> schedule_;
  size_t index_ = 0;
  CopyEngine* engine_ = nullptr;  // the engine of the copies in flight
  std::vector<Moved> moved_;
  Where where_ = Where::kNone;
};

// Rewrites `model` in place so that its activations are offloaded, segment by segment
// (wrap_segments' modes: "stage", "block", "K", "none"). Parameter names and the computed
// function are unchanged. `host`: where the offloaded bytes go unless the engine has its own
// (pinned memory on cuda). `engine`: the copy engine to use instead of the backend's (tests);
// null: Backend::copy_engine(), else synchronous copies. Returns the number of segments.
// Errors: as wrap_segments.
[[nodiscard]] Result<size_t> offload_activations(Sequential& model, const std::string& mode, Allocator& host,
                                                 CopyEngine* engine = nullptr);

}  // namespace slide::train
