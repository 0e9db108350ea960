// Asynchronous copies between a backend's device and host memory, for activation offload
// (offload.h): a segment's saved activations leave the device while the next segment computes,
// and come back while the segment after it in backward computes (TFLMS's swap-out / swap-in with
// a lookahead of one; vDNN's offload and prefetch).
//
// One interface, three engines:
// - the cuda backend's (cuda_backend.cpp): a copy stream per engine, ordered after the compute
//   stream's work by an event, cudaMemcpyAsync from and to pinned host memory (cudaHostAlloc,
//   cached by size), and an event per copy that wait() synchronises on;
// - the host-thread engine (make_thread_copy_engine) for devices in host memory (the simulated
//   device, `reference-sim`): one copy thread, jobs in order, so the whole offload schedule runs
//   and is tested on a CPU, with an optional delay per copy that tests use to show the schedule
//   waits for its copies;
// - none (Backend::copy_engine() == nullptr): offload copies at once through Backend::upload /
//   download (SyncCopyEngine), as the planning backend does.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "slide/train/backend.h"

namespace slide::train {

enum class CopyDirection { kToHost, kToDevice };

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // Starts copying all of `src`'s bytes into `dst` (the same byte count; kToHost: `src` on be's
  // device and `dst` in host memory, kToDevice the other way), after every op `be` has queued so
  // far. Both must stay allocated, and `src` unwritten, until wait(ticket) returns. Returns the
  // copy's ticket. Errors: kInvalidArgument (sizes or devices wrong), the device's.
  [[nodiscard]] virtual Result<uint64_t> start(Backend& be, const Tensor& src, Tensor& dst, CopyDirection dir) = 0;
  // As start, but the copy waits (on the device) only for the work `be` had queued before `after`
  // (a fence of be's, Backend::fence), not for everything queued since: for a buffer the caller
  // knows no later op reads or writes (a double-buffered input batch whose previous user's ops
  // ended at `after`), so that the copy runs beside the ops queued after the fence. Null `after`:
  // as start. Default: start (ordered after everything: correct, without the overlap).
  [[nodiscard]] virtual Result<uint64_t> start_after(Backend& be, const DeviceFence* after, const Tensor& src,
                                                     Tensor& dst, CopyDirection dir) {
    (void)after;
    return start(be, src, dst, dir);
  }
  // Returns when the copy of `ticket` is complete: its bytes are in `dst`, `src` may be freed or
  // written, and the backend's later ops see `dst`. Each ticket is waited for once. Errors: the
  // copy's (the first failure of the engine is reported by every later wait too).
  [[nodiscard]] virtual Status wait(uint64_t ticket) = 0;
  // The ops `be` queues from now on run after the copy of `ticket` (cuda: the compute stream waits
  // for the copy's event on the device, and the host goes on at once). The ticket must still be
  // waited for (wait) before the copy's source is reused. Default: wait for it on the host, without
  // using the ticket up (the host-thread engine's and the synchronous engine's waits may repeat).
  [[nodiscard]] virtual Status order_ops_after(Backend& be, uint64_t ticket) {
    (void)be;
    return wait(ticket);
  }
  // Whether copies run concurrently with the backend's ops (false: start() copies at once).
  virtual bool asynchronous() const = 0;
  // Where host copies should live (pinned memory on cuda), or null for the caller's host
  // allocator.
  virtual Allocator* host_allocator() { return nullptr; }
};

// The checks every engine's start() makes: equal byte counts, and `src` / `dst` on the devices
// `dir` says (be's device and the host). Errors: kInvalidArgument naming what is wrong.
[[nodiscard]] Status validate_copy(const Backend& be, const Tensor& src, const Tensor& dst, CopyDirection dir);

// start() copies at once with Backend::download / upload; wait() returns the result.
class SyncCopyEngine final : public CopyEngine {
 public:
  Result<uint64_t> start(Backend& be, const Tensor& src, Tensor& dst, CopyDirection dir) override;
  Status wait(uint64_t ticket) override;
  bool asynchronous() const override { return false; }
};

// One copy thread for a device whose memory is host memory (Device::kSim): copies run in order on
// it while the training thread computes. `delay`: slept before each copy (tests).
std::unique_ptr<CopyEngine> make_thread_copy_engine(std::chrono::microseconds delay = std::chrono::microseconds(0));

}  // namespace slide::train
