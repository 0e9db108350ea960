// The reference backend: every op of backend.h as plain loops over plain tensors, in f32 or f64.
// It is the oracle that other backends and the gradient checks are tested against: written for
// obviousness, not speed (no blocking, no threads).
#pragma once

#include <memory>

#include "slide/train/backend.h"

namespace slide::train {

std::unique_ptr<Backend> make_reference_backend(Allocator& alloc);

}  // namespace slide::train
