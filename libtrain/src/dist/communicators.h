// The communicator implementations' constructors, for make_communicator (communicator.cpp) only.
#pragma once

#include <memory>

#include "slide/train/communicator.h"

namespace slide::train::dist {

std::unique_ptr<Communicator> make_local_communicator(double timeout_s);
#ifdef SLIDE_WITH_MPI
// Errors: kInternal when MPI cannot start (the library's text).
[[nodiscard]] Result<std::unique_ptr<Communicator>> make_mpi_communicator(double timeout_s);
#endif
#ifdef SLIDE_WITH_NCCL
// GPU ranks: the device of the node-local rank, NCCL's unique id broadcast over MPI. Errors:
// kFailedPrecondition (no CUDA device), kDeadlineExceeded (set-up past the timeout), kInternal.
[[nodiscard]] Result<std::unique_ptr<Communicator>> make_nccl_communicator(double timeout_s);
#endif

}  // namespace slide::train::dist
