#include "slide/train/device_select.h"

#include <charconv>
#include <cstring>

namespace slide::train {

slide::core::Result<int> launcher_local_rank(const std::function<const char*(const char*)>& getenv_fn) {
  for (const char* name : {"SLIDE_LAUNCH_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID",
                           "LOCAL_RANK"}) {
    const char* v = getenv_fn(name);
    if (v == nullptr) continue;
    int rank = -1;
    const char* end = v + std::strlen(v);
    auto res = std::from_chars(v, end, rank);
    if (res.ec != std::errc() || res.ptr != end || rank < 0)
      return slide::core::invalid_argument(std::string(name) + "='" + v + "' is not a local rank (a number >= 0)");
    return rank;
  }
  return -1;
}

slide::core::Result<int> select_device(int requested, int device_count,
                                       const std::function<const char*(const char*)>& getenv_fn) {
  if (device_count <= 0) return slide::core::unavailable("no CUDA device is visible to this process");
  if (requested >= 0) {
    if (requested >= device_count)
      return slide::core::invalid_argument("--device " + std::to_string(requested) + ", but this process sees " +
                                           std::to_string(device_count) + " GPU(s) (devices 0.." +
                                           std::to_string(device_count - 1) + " after CUDA_VISIBLE_DEVICES)");
    return requested;
  }
  SLIDE_ASSIGN_OR_RETURN(int local, launcher_local_rank(getenv_fn));
  if (local < 0) return 0;
  // A launcher that gives each rank a GPU of its own hides the others (Slurm's --gpus-per-task=1,
  // a CUDA_VISIBLE_DEVICES per rank): the one device this process sees is its own. Never for
  // slide-train --gpus N's ranks: it starts every rank with the user's environment, so one visible
  // device there is one GPU for all the ranks (CUDA_VISIBLE_DEVICES=0 slide-train --gpus 2).
  if (local >= device_count && device_count == 1 && getenv_fn("SLIDE_LAUNCH_LOCAL_RANK") == nullptr) {
    const char* visible = getenv_fn("CUDA_VISIBLE_DEVICES");
    if (visible != nullptr && *visible != '\0') return 0;
  }
  if (local >= device_count)
    return slide::core::failed_precondition(
        "node-local rank " + std::to_string(local) + " but this node shows " + std::to_string(device_count) +
        " GPU(s): start at most one rank per GPU per node (e.g. mpirun --npernode " + std::to_string(device_count) +
        "), or give each rank --device");
  return local;
}

}  // namespace slide::train
