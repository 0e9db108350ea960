// The cuda backend's DeviceFence (backend.h): an event recorded on the device's compute stream.
// Shared with the NCCL communicator (dist/nccl_communicator.cpp), whose stream waits for it.
#pragma once

#include <cuda_runtime.h>

#include "slide/train/backend.h"

namespace slide::train::cuda {

class CudaFence final : public DeviceFence {
 public:
  explicit CudaFence(cudaEvent_t event) : event_(event) {}
  // cudaEventDestroy returns at once for an event not yet complete; its resources go when it is.
  ~CudaFence() override { (void)cudaEventDestroy(event_); }
  CudaFence(const CudaFence&) = delete;
  CudaFence& operator=(const CudaFence&) = delete;
  cudaEvent_t event() const { return event_; }

 private:
  cudaEvent_t event_;
};

}  // namespace slide::train::cuda
