// The one door between host code and a backend's device: Backend::upload / download (the
// host backends' byte copies, available_memory_bytes, conv_workspace_bytes's 0; also where Backend's vtable is emitted), the transfer check every
// backend shares, and to_host / to_device. Apart from backend.cpp so that the checkpoint code
// (and its fuzz target) needs no backend implementation.
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "op_checks.h"
#include "slide/train/backend.h"
#include "slide/train/copy_engine.h"

namespace slide::train {

Result<size_t> Backend::available_memory_bytes() {
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages < 0 || page < 0) return slide::core::errno_status(errno, "sysconf(_SC_AVPHYS_PAGES)");
  return static_cast<size_t>(pages) * static_cast<size_t>(page);
}

Result<size_t> Backend::conv_workspace_bytes(ConvPass, const Tensor&, const Tensor&, Conv2dParams, const Tensor&) {
  return size_t{0};
}
size_t Backend::batch_norm_scratch_bytes(bool, const Tensor&) { return 0; }
Status Backend::sum_of_squares_each(const std::vector<const Tensor*>& xs, double* out) {
  for (size_t i = 0; i < xs.size(); ++i) SLIDE_RETURN_IF_ERROR(sum_of_squares(*xs[i], &out[i]));
  return slide::core::ok_status();
}

namespace detail {

Status validate_transfer(const char* op, const Tensor& host, const Tensor& dev, Device device) {
  if (!host.defined() || !dev.defined() || host.shape() != dev.shape() || host.dtype() != dev.dtype())
    return slide::core::invalid_argument(std::string(op) + ": host " + shape_string(host.shape()) + " " +
                                         dtype_name(host.dtype()) + " and device " + shape_string(dev.shape()) + " " +
                                         dtype_name(dev.dtype()) + " differ");
  if (host.device() != Device::kCpu || dev.device() != device)
    return slide::core::invalid_argument(std::string(op) + ": the host tensor is on " + device_name(host.device()) +
                                         " and the backend's on " + device_name(dev.device()) + ", expected cpu and " +
                                         device_name(device));
  if (host.layout() != Layout::kPlain || dev.layout() != Layout::kPlain)
    return slide::core::invalid_argument(std::string(op) + ": tensors must be plain (Backend::to_plain first)");
  return slide::core::ok_status();
}

}  // namespace detail

// (Here, beside the other defaults of Backend's copies, where CopyEngine is complete; every
// libtrain build, the fuzz targets' small one included, links this file.)
std::unique_ptr<CopyEngine> Backend::new_copy_engine() { return nullptr; }

Status Backend::upload(const Tensor& host, Tensor& dst) {
  SLIDE_RETURN_IF_ERROR(detail::validate_transfer("upload", host, dst, device()));
  if (host.bytes() > 0 && host.raw() != dst.raw()) std::memcpy(dst.raw(), host.raw(), host.bytes());
  return slide::core::ok_status();
}

Status Backend::download(const Tensor& src, Tensor& host) {
  SLIDE_RETURN_IF_ERROR(detail::validate_transfer("download", host, src, device()));
  if (src.bytes() > 0 && host.raw() != src.raw()) std::memcpy(host.raw(), src.raw(), src.bytes());
  return slide::core::ok_status();
}

Status check_transfer_backend(const Tensor& t, const Backend* device, const std::string& what) {
  if (t.device() == Device::kCpu || (device != nullptr && device->device() == t.device()))
    return slide::core::ok_status();
  return slide::core::invalid_argument(what + " is on " + device_name(t.device()) +
                                       " and no backend of that device was given to copy it");
}

Result<Tensor> to_host(Backend& be, const Tensor& t, const std::string& what) {
  if (!t.defined() || t.device() == Device::kCpu) return t;
  SLIDE_ASSIGN_OR_RETURN(Tensor host, Tensor::empty(t.shape(), t.dtype(), cpu_allocator(), what));
  SLIDE_RETURN_IF_ERROR(be.download(t, host));
  return host;
}

Result<Tensor> to_device(Backend& be, const Tensor& host, const std::string& what) {
  if (!host.defined() || be.device() == Device::kCpu) return host;
  SLIDE_ASSIGN_OR_RETURN(Tensor dev, Tensor::empty(host.shape(), host.dtype(), be.allocator(), what));
  SLIDE_RETURN_IF_ERROR(be.upload(host, dev));
  return dev;
}

}  // namespace slide::train
