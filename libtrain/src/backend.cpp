// The one place that knows which backends this build has (ggml-backend's registry idea).
#include "slide/train/backend.h"

#include <cstring>

#include "cpu/onednn_backend.h"
#include "op_checks.h"
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

Result<std::unique_ptr<Backend>> make_backend(const std::string& name) {
  if (name == "reference") return make_reference_backend(cpu_allocator());
  if (name == "cpu") return make_onednn_backend(cpu_allocator());
#if defined(SLIDE_WITH_CUDA)
  if (name == "cuda") return cuda::make_cuda_backend(0);
#endif
  return slide::core::not_found("backend '" + name + "' is not in this build (built: " + kBuilt + ")");
}

}  // namespace slide::train
