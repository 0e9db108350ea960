// slide-train's data-parallel set-up (README, "Several ranks"), beside slide_train_main.cpp.
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "slide/train/communicator.h"
#include "slide/train/layers.h"

namespace slide::apps {

// Gives every rank rank 0's run: the state record (`state`, as JSON text) and then every tensor
// (parameters, batch norm buffers, optimizer state, each list in the same order on every rank),
// so every replica starts from rank 0's bits, whether initialised or resumed from a checkpoint
// that only rank 0 has read. A no-op on one rank. Errors: kDataLoss when the record does not parse
// on a receiving rank, and the communicator's. Tensors on a device go through host copies via
// `device`, their backend (broadcast_tensors).
[[nodiscard]] slide::core::Status broadcast_run(slide::train::Communicator& comm,
                                                const std::vector<slide::train::Parameter*>& params,
                                                const std::vector<slide::train::Buffer*>& buffers,
                                                const std::vector<slide::train::Buffer*>& optimizer_state,
                                                nlohmann::json* state, slide::train::Backend* device = nullptr);

// Gives every rank rank 0's batch norm buffers (running statistics), which per-rank batch norm
// lets drift apart, so that every rank evaluates the model rank 0 saves. A no-op on one rank.
// Errors: the communicator's. Device tensors as broadcast_run.
[[nodiscard]] slide::core::Status broadcast_buffers(slide::train::Communicator& comm,
                                                    const std::vector<slide::train::Buffer*>& buffers,
                                                    slide::train::Backend* device = nullptr);

}  // namespace slide::apps
