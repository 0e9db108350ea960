// The one place that knows which backends this build has (ggml-backend's registry idea).
#include "slide/train/backend.h"

#include "cpu/onednn_backend.h"
#include "reference/reference_backend.h"

namespace slide::train {

Result<std::unique_ptr<Backend>> make_backend(const std::string& name) {
  if (name == "reference") return make_reference_backend(cpu_allocator());
  if (name == "cpu") return make_onednn_backend(cpu_allocator());
  return slide::core::not_found("backend '" + name + "' is not in this build (built: reference, cpu)");
}

}  // namespace slide::train
