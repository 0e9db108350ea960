// Which GPU a rank uses: one process per GPU, each taking its node-local GPU from the launcher
// (docs/design.md, "Distributed"). Plain C++ (the device count is passed in), tested on the CPU.
#pragma once

#include <functional>
#include <string>

#include "slide/core/status.h"

namespace slide::train {

// The node-local rank the launcher gave this process, from the first of these environment
// variables that is set: SLIDE_LAUNCH_LOCAL_RANK (slide-train --gpus N, for the ranks it starts),
// OMPI_COMM_WORLD_LOCAL_RANK (Open MPI's mpirun), SLURM_LOCALID (Slurm's srun), MPI_LOCALRANKID
// (MPICH, Intel MPI), LOCAL_RANK (torchrun). -1 when none is set. Errors: kInvalidArgument when the variable set is not a
// non-negative integer (naming it).
[[nodiscard]] slide::core::Result<int> launcher_local_rank(
    const std::function<const char*(const char*)>& getenv_fn);

// The device index to open: `requested` (--device, -1 = unset) when given, else the local rank,
// else 0. `device_count` is what the runtime reports for this process (after CUDA_VISIBLE_DEVICES).
// One exception: a process that sees exactly one device while CUDA_VISIBLE_DEVICES is set takes
// device 0 whatever its local rank (the launcher gave each rank its own GPU: Slurm's
// --gpus-per-task=1); not a rank of slide-train --gpus N (SLIDE_LAUNCH_LOCAL_RANK set), which all
// see the same devices. Errors: kUnavailable when device_count is 0; kInvalidArgument for --device
// outside [0, device_count); kFailedPrecondition when the local rank is >= device_count otherwise
// (more ranks on this node than GPUs: two ranks would share one GPU and both run out of memory;
// the message says to lower the ranks per node or pass --device).
[[nodiscard]] slide::core::Result<int> select_device(int requested, int device_count,
                                                    const std::function<const char*(const char*)>& getenv_fn);

// What make_backend(name) opens (backend.h): "auto" is "cuda" when this build has CUDA and a
// device answers, else "cpu"; any other name is itself. For choices made before the backend is
// open (slide-train --gpus N's ranks join over NCCL when they train on GPUs). Defined in
// backend.cpp.
[[nodiscard]] std::string resolve_backend_name(const std::string& name);

}  // namespace slide::train
