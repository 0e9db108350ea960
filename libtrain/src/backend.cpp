// The one place that knows which backends this build has (ggml-backend's registry idea).
#include "slide/train/backend.h"

#include <cstdlib>

#include "slide/train/device_select.h"

#include "cpu/onednn_backend.h"
#include "op_checks.h"
#include "reference/reference_backend.h"
#if defined(SLIDE_WITH_CUDA)
#include "cuda/cuda_backend.h"
#endif

namespace slide::train {


namespace {

#if defined(SLIDE_WITH_CUDA)
constexpr const char* kBuilt = "reference, reference-sim, cpu, cuda";
#else
constexpr const char* kBuilt = "reference, reference-sim, cpu";
#endif

}  // namespace

const char* math_precision_name(MathPrecision p) {
  switch (p) {
    case MathPrecision::kTf32:
      return "tf32";
    case MathPrecision::kBf16:
      return "bf16";
    case MathPrecision::kFp16:
      return "fp16";
    case MathPrecision::kFp32:
      break;
  }
  return "fp32";
}

Result<MathPrecision> parse_math_precision(const std::string& name) {
  for (MathPrecision p : {MathPrecision::kFp32, MathPrecision::kTf32, MathPrecision::kBf16, MathPrecision::kFp16})
    if (name == math_precision_name(p)) return p;
  return slide::core::invalid_argument("precision '" + name + "': expected fp32, tf32, bf16 or fp16");
}

std::string resolve_backend_name(const std::string& name) {
  if (name != "auto") return name;
#if defined(SLIDE_WITH_CUDA)
  if (auto count = cuda::usable_device_count(); count.ok() && *count > 0) return "cuda";
#endif
  return "cpu";
}

Result<std::unique_ptr<Backend>> make_backend(const std::string& name, int device) {
  if (name == "auto") {
    // cuda when this build has it and a device answers, else cpu.
    if (resolve_backend_name(name) == "cuda") return make_backend("cuda", device);
    if (device >= 0) return slide::core::invalid_argument("--device " + std::to_string(device) + ": no CUDA device here");
    return make_backend("cpu");
  }
  if (device >= 0 && name != "cuda")
    return slide::core::invalid_argument("--device " + std::to_string(device) + " is for --backend cuda, not " + name);
  if (name == "reference") return make_reference_backend(cpu_allocator());
  if (name == "reference-sim") return make_reference_backend(sim_device_allocator());
  if (name == "cpu") return make_onednn_backend(cpu_allocator());
#if defined(SLIDE_WITH_CUDA)
  if (name == "cuda") {
    SLIDE_ASSIGN_OR_RETURN(const int count, cuda::usable_device_count());
    SLIDE_ASSIGN_OR_RETURN(const int chosen,
                           select_device(device, count, [](const char* var) { return std::getenv(var); }));
    return cuda::make_cuda_backend(chosen);
  }
#endif
  return slide::core::not_found("backend '" + name + "' is not in this build (built: " + kBuilt + ")");
}

}  // namespace slide::train
