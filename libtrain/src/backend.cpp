// The one place that knows which backends this build has (ggml-backend's registry idea).
#include "slide/train/backend.h"

#include <cstring>

#include "cpu/onednn_backend.h"
#include "reference/reference_backend.h"
#if defined(SLIDE_WITH_CUDA)
#include "cuda/cuda_backend.h"
#endif

namespace slide::train {

namespace {

#if defined(SLIDE_WITH_CUDA)
constexpr const char* kBuilt = "reference, cpu, cuda";
#else
constexpr const char* kBuilt = "reference, cpu";
#endif

}  // namespace

static Status check_transfer(const char* op, const Tensor& host, const Tensor& other, Device device) {
  if (!host.defined() || !other.defined() || host.shape() != other.shape() || host.dtype() != other.dtype())
    return slide::core::invalid_argument(std::string(op) + ": host " + shape_string(host.shape()) + " " +
                                         dtype_name(host.dtype()) + " and device " + shape_string(other.shape()) + " " +
                                         dtype_name(other.dtype()) + " differ");
  if (host.device() != Device::kCpu || other.device() != device)
    return slide::core::invalid_argument(std::string(op) + ": the host tensor is on " + device_name(host.device()) +
                                         " and the backend's on " + device_name(other.device()) + ", expected cpu and " +
                                         device_name(device));
  if (host.layout() != Layout::kPlain || other.layout() != Layout::kPlain)
    return slide::core::invalid_argument(std::string(op) + ": tensors must be plain (Backend::to_plain first)");
  return slide::core::ok_status();
}

Status Backend::upload(const Tensor& host, Tensor& dst) {
  SLIDE_RETURN_IF_ERROR(check_transfer("upload", host, dst, device()));
  if (host.bytes() > 0 && host.raw() != dst.raw()) std::memcpy(dst.raw(), host.raw(), host.bytes());
  return slide::core::ok_status();
}

Status Backend::download(const Tensor& src, Tensor& host) {
  SLIDE_RETURN_IF_ERROR(check_transfer("download", host, src, device()));
  if (src.bytes() > 0 && host.raw() != src.raw()) std::memcpy(host.raw(), src.raw(), src.bytes());
  return slide::core::ok_status();
}

Result<std::unique_ptr<Backend>> make_backend(const std::string& name) {
  if (name == "reference") return make_reference_backend(cpu_allocator());
  if (name == "cpu") return make_onednn_backend(cpu_allocator());
#if defined(SLIDE_WITH_CUDA)
  if (name == "cuda") return cuda::make_cuda_backend(0);
#endif
  return slide::core::not_found("backend '" + name + "' is not in this build (built: " + kBuilt + ")");
}

}  // namespace slide::train
