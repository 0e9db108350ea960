#include "slide_train_dist.h"

#include <string>

#include "slide/train/data_parallel.h"

namespace slide::apps {

slide::core::Status broadcast_run(slide::train::Communicator& comm,
                                  const std::vector<slide::train::Parameter*>& params,
                                  const std::vector<slide::train::Buffer*>& buffers,
                                  const std::vector<slide::train::Buffer*>& optimizer_state, nlohmann::json* state,
                                  slide::train::Backend* device) {
  if (comm.world_size() == 1) return slide::core::ok_status();
  std::string text = comm.rank() == 0 ? state->dump() : std::string();
  SLIDE_RETURN_IF_ERROR(slide::train::broadcast_string(comm, &text, 0, "broadcast of the run state"));
  if (comm.rank() != 0) {
    nlohmann::json received = nlohmann::json::parse(text, nullptr, false);
    if (received.is_discarded()) return slide::core::data_loss("the run state from rank 0 does not parse");
    *state = std::move(received);
  }
  std::vector<slide::train::Tensor*> tensors;
  for (auto* p : params) tensors.push_back(&p->value);
  for (auto* b : buffers) tensors.push_back(&b->value);
  for (auto* b : optimizer_state) tensors.push_back(&b->value);
  return slide::train::broadcast_tensors(comm, tensors, 0, "broadcast of parameters, buffers and optimizer state",
                                         size_t{64} << 20, device);
}

slide::core::Status broadcast_buffers(slide::train::Communicator& comm,
                                      const std::vector<slide::train::Buffer*>& buffers, slide::train::Backend* device) {
  std::vector<slide::train::Tensor*> tensors;
  for (auto* b : buffers) tensors.push_back(&b->value);
  return slide::train::broadcast_tensors(comm, tensors, 0, "broadcast of batch norm buffers", size_t{64} << 20, device);
}

}  // namespace slide::apps
