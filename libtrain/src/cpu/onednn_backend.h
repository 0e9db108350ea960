// The `cpu` backend: backend.h's op list on oneDNN 2.x primitives (Debian's libdnnl-dev), f32
// tensors (bf16 product operands under MathPrecision::kBf16 where the CPU has bf16 instructions).
#pragma once

#include <memory>

#include "slide/train/backend.h"

namespace slide::train {

std::unique_ptr<Backend> make_onednn_backend(Allocator& alloc);

}  // namespace slide::train
