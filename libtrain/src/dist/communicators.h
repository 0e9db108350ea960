// The communicator implementations' constructors, for make_communicator (communicator.cpp) only.
#pragma once

#include <memory>

#include "slide/train/communicator.h"

namespace slide::train::dist {

std::unique_ptr<Communicator> make_local_communicator(double timeout_s);
// all_reduce_async for communicators whose collectives complete before they return ("local",
// "socket"): runs comm.all_reduce and returns work that is already done. Errors: all_reduce's.
[[nodiscard]] Result<std::unique_ptr<CollectiveWork>> all_reduce_now(Communicator& comm, void* data, int64_t count,
                                                                     DType dtype, ReduceOp op, const std::string& what);
#ifdef SLIDE_WITH_MPI
// Errors: kInternal when MPI cannot start (the library's text).
[[nodiscard]] Result<std::unique_ptr<Communicator>> make_mpi_communicator(double timeout_s);
#endif
#ifdef SLIDE_WITH_NCCL
// GPU ranks: the device of the node-local rank, NCCL's unique id broadcast over `bootstrap` (the
// "mpi" communicator under mpirun/srun, the "socket" one under slide-train --gpus), which gives
// the rank and world size and is kept for the communicator's lifetime. Errors:
// kFailedPrecondition (no CUDA device), kDeadlineExceeded (set-up past the timeout), kInternal.
[[nodiscard]] Result<std::unique_ptr<Communicator>> make_nccl_communicator(double timeout_s,
                                                                         std::unique_ptr<Communicator> bootstrap);
#endif

}  // namespace slide::train::dist
