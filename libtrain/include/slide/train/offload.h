// Activation offload (TFLMS's swap-out / swap-in; vDNN, Rhu et al. 2016): the activations a
// segment of layers saves for backward leave the device for host memory once the segment's forward
// is done, and come back just before its backward, so the device holds one segment's saved
// activations at a time (plus the segments' boundaries) instead of the whole model's.
//
// Which tensors: every storage made (Tensor::empty) during the segment's training forward that is
// still alive when it ends, but for the segment's output: exactly what its layers keep for
// backward, whatever the layers are (Tensor::set_storage_capture), with no per-layer code. They
// go to host memory through Backend::download and their device storage is freed
// (Tensor::evict_storage); backward allocates it again and uploads the bytes back, so every
// tensor that shared it sees the same bytes at the same address kind, and the gradients are
// bit-identical to a run without offload.
//
// Copies are synchronous in this version (on the training thread, in the backend's stream order):
// the device's peak falls as planned, the time is not yet hidden behind compute (no copy stream
// or prefetch thread yet).
//
// The memory planner (planner.h) runs the same segments on its planning backend, so a plan counts
// offload's effect on the device peak with no planner code of its own.
#pragma once

#include <string>
#include <vector>

#include "slide/train/activation_checkpoint.h"
#include "slide/train/allocator.h"

namespace slide::train {

// Runs `layers` (in order) as one segment whose saved activations live in host memory between its
// forward and its backward.
class OffloadedSegment final : public Segment {
 public:
  // `host`: where the offloaded bytes go (the process's host allocator, whose budget they count
  // against).
  OffloadedSegment(std::vector<std::unique_ptr<Layer>> layers, std::vector<std::string> names, Allocator& host);
  // Training: runs the layers, then moves what they saved to host memory. Inference: runs them.
  // Errors: the layers'; the host allocator's (kResourceExhausted naming the offloaded tensor);
  // the backend's download.
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  // Brings the saved activations back (device allocations: kResourceExhausted past the budget),
  // then runs the layers' backward. Errors: kFailedPrecondition without a training forward.
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void release() override;
  // Bytes now held in host memory for this segment (0 outside a forward/backward pair).
  size_t offloaded_bytes() const;

 private:
  struct Moved {
    Tensor device;  // the whole storage, flat u8, evicted
    Tensor host;    // its bytes
  };
  Allocator* host_;
  std::vector<Moved> moved_;
  bool training_forward_ = false;
};

// Rewrites `model` in place so that its activations are offloaded, segment by segment
// (wrap_segments' modes: "stage", "block", "K", "none"). Parameter names and the computed
// function are unchanged. Returns the number of segments. Errors: as wrap_segments.
[[nodiscard]] Result<size_t> offload_activations(Sequential& model, const std::string& mode, Allocator& host);

}  // namespace slide::train
