// The communicator implementations' constructors, for make_communicator (communicator.cpp) only.
#pragma once

#include <memory>

#include "slide/train/communicator.h"

namespace slide::train::dist {

std::unique_ptr<Communicator> make_local_communicator(double timeout_s);
// The host arithmetic of the communicators that reduce on the host ("socket", the "mpi" ring):
// y[i] += x[i] for i < count (f32, f64 or i32), and the sum turned into the mean, y[i] *= 1/P (f32
// or f64; MPI's own reductions are sums, so every host communicator scales a mean the same way).
void add_into(void* y, const void* x, int64_t count, DType dtype);
void scale_to_mean(void* data, int64_t count, DType dtype, int world_size);
// all_reduce_async for communicators whose collectives complete before they return ("local",
// "socket"): runs comm.all_reduce and returns work that is already done. Errors: all_reduce's.
[[nodiscard]] Result<std::unique_ptr<CollectiveWork>> all_reduce_now(Communicator& comm, void* data, int64_t count,
                                                                     DType dtype, ReduceOp op, const std::string& what);
// Open MPI's TCP transport (btl tcp, between hosts) set to its send protocol, unless the user has
// set OMPI_MCA_btl_tcp_flags (mpirun --mca btl_tcp_flags ..., or the environment): the default
// flags add "put", an emulated RDMA whose control messages queue behind the bulk data when both
// directions of a link are busy, as in a ring all-reduce. Measured on the two-host rig at 1 Gbit/s
// (tests/dist/two_hosts.sh, build/bench/allreduce_bench, 2 ranks): with "put", 24 MB took 200-400
// ms from one mpirun to the next (bimodal), MPI_Allreduce's too; with the send protocol 201-206 ms
// in every run, 93-95% of the link. Sets the environment variable only (read by MPI_Init); other
// MPI libraries ignore it. Returns whether it was set here.
bool set_mpi_transport_defaults();
#ifdef SLIDE_WITH_MPI
// Errors: kInternal when MPI cannot start (the library's text).
[[nodiscard]] Result<std::unique_ptr<Communicator>> make_mpi_communicator(double timeout_s);
#endif
#ifdef SLIDE_WITH_NCCL
// GPU ranks: GPU `device` (select_device's choice for it: -1 is the node-local rank's), NCCL's unique id broadcast over `bootstrap` (the
// "mpi" communicator under mpirun/srun, the "socket" one under slide-train --gpus), which gives
// the rank and world size and is kept for the communicator's lifetime. Errors:
// kFailedPrecondition (no CUDA device), kDeadlineExceeded (set-up past the timeout), kInternal.
[[nodiscard]] Result<std::unique_ptr<Communicator>> make_nccl_communicator(double timeout_s,
                                                                         std::unique_ptr<Communicator> bootstrap,
                                                                         int device);
#endif

}  // namespace slide::train::dist
