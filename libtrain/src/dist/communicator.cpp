// The factory (the one place that knows which communicators were built), the local one, and the
// helpers every implementation shares.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dist/communicators.h"

namespace slide::train {

namespace {

// One rank: every collective leaves its buffer as it is (the sum and mean over one rank).
class LocalCommunicator final : public Communicator {
 public:
  explicit LocalCommunicator(double timeout_s) : Communicator(timeout_s) {}
  std::string name() const override { return "local"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  int local_rank() const override { return 0; }
  Device device() const override { return Device::kCpu; }
  Status all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, const std::string& what) override {
    (void)data;
    if (count < 0) return slide::core::invalid_argument(what + ": negative count");
    if (dtype == DType::kU8 || (dtype == DType::kI32 && op == ReduceOp::kAverage))
      return slide::core::invalid_argument(what + ": all-reduce of " + dtype_name(dtype));
    return slide::core::ok_status();
  }
  Result<std::unique_ptr<CollectiveWork>> all_reduce_async(void* data, int64_t count, DType dtype, ReduceOp op,
                                                           const std::string& what) override {
    return dist::all_reduce_now(*this, data, count, dtype, op, what);
  }
  Status broadcast(void*, size_t, int root, const std::string& what) override {
    if (root != 0) return slide::core::invalid_argument(what + ": broadcast from rank " + std::to_string(root) + " of 1");
    return slide::core::ok_status();
  }
  Status barrier(const std::string&) override { return slide::core::ok_status(); }
  Status all_gather(double value, std::vector<double>* out, const std::string&) override {
    out->assign(1, value);
    return slide::core::ok_status();
  }
  void abort_job(int) override {}
};

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return (*end == '\0' && n > 0 && n < (1L << 30)) ? static_cast<int>(n) : -1;
}

}  // namespace

std::string Communicator::describe(const std::string& what) const {
  return "rank " + std::to_string(rank()) + " of " + std::to_string(world_size()) + " at step " +
         std::to_string(step_) + ": " + what;
}

std::string Communicator::deadline_message(const std::string& what, int peer) const {
  return describe(what) + " did not complete within " + std::to_string(static_cast<int64_t>(timeout_s_)) +
         " s (--dist-timeout)" +
         (peer < 0 ? std::string(": another rank has stopped, died or fallen behind")
                   : " waiting for rank " + std::to_string(peer) + ": it has stopped, died or fallen behind");
}

Status Communicator::broken_error(const std::string& what) const {
  return slide::core::failed_precondition(describe(what) + ": an earlier collective failed; the job must stop");
}

int launch_world_size() {
  for (const char* name : {kLaunchWorldSizeEnv, "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"})
    if (const int n = env_int(name); n > 0) return n;
  return 1;
}

Result<LaunchedRank> launched_rank() {
  LaunchedRank out;
  const char* world = std::getenv(kLaunchWorldSizeEnv);
  if (world == nullptr) {
    out.world_size = 0;
    return out;
  }
  const auto bad = [](const char* name, const char* value, const std::string& why) {
    return slide::core::invalid_argument(std::string(name) + "='" + (value != nullptr ? value : "") + "': " + why +
                                         " (set by slide-train --gpus for the ranks it starts)");
  };
  out.world_size = env_int(kLaunchWorldSizeEnv);
  if (out.world_size < 1) return bad(kLaunchWorldSizeEnv, world, "not a world size");
  const char* rank = std::getenv(kLaunchRankEnv);
  if (rank != nullptr && std::strcmp(rank, "0") == 0)
    out.rank = 0;
  else if (const int r = env_int(kLaunchRankEnv); r > 0 && r < out.world_size)
    out.rank = r;
  else
    return bad(kLaunchRankEnv, rank, "not a rank of " + std::to_string(out.world_size));
  const char* fds = std::getenv(kLaunchFdsEnv);
  for (const char* p = fds != nullptr ? fds : ""; *p != '\0';) {
    char* end = nullptr;
    const long fd = std::strtol(p, &end, 10);
    if (end == p || fd < 0 || fd > (1L << 30) || (*end != ',' && *end != '\0'))
      return bad(kLaunchFdsEnv, fds, "not a list of descriptors");
    out.fds.push_back(static_cast<int>(fd));
    p = *end == ',' ? end + 1 : end;
  }
  const size_t want = out.rank == 0 ? static_cast<size_t>(out.world_size - 1) : 1;
  if (out.fds.size() != want)
    return bad(kLaunchFdsEnv, fds, "rank " + std::to_string(out.rank) + " needs " + std::to_string(want) + " socket(s)");
  return out;
}

ShardRange shard_range(size_t n, int rank, int world) {
  const auto r = static_cast<size_t>(rank), p = static_cast<size_t>(world);
  return {n * r / p, n * (r + 1) / p};
}

namespace dist {
std::unique_ptr<Communicator> make_local_communicator(double timeout_s) {
  return std::make_unique<LocalCommunicator>(timeout_s);
}

bool set_mpi_transport_defaults() {
  // Open MPI 4.1's default is "send,put,inplace,need-ack,need-csum,hetero-rdma" (ompi_info --param
  // btl tcp --level 9); without put, hetero-rdma (which qualifies put) goes too.
  if (std::getenv("OMPI_MCA_btl_tcp_flags") != nullptr) return false;  // the user's choice
  return setenv("OMPI_MCA_btl_tcp_flags", "send,inplace,need-ack,need-csum", /*overwrite=*/0) == 0;
}

void add_into(void* y, const void* x, int64_t count, DType dtype) {
  const auto add = [count](auto* out, const auto* in) {
    for (int64_t i = 0; i < count; ++i) out[i] += in[i];
  };
  switch (dtype) {
    case DType::kF32: add(static_cast<float*>(y), static_cast<const float*>(x)); break;
    case DType::kF64: add(static_cast<double*>(y), static_cast<const double*>(x)); break;
    default: add(static_cast<int32_t*>(y), static_cast<const int32_t*>(x)); break;
  }
}

void scale_to_mean(void* data, int64_t count, DType dtype, int world_size) {
  const double inv = 1.0 / world_size;
  if (dtype == DType::kF32)
    for (int64_t i = 0; i < count; ++i) static_cast<float*>(data)[i] *= static_cast<float>(inv);
  else
    for (int64_t i = 0; i < count; ++i) static_cast<double*>(data)[i] *= inv;
}

Result<std::unique_ptr<CollectiveWork>> all_reduce_now(Communicator& comm, void* data, int64_t count, DType dtype,
                                                        ReduceOp op, const std::string& what) {
  struct Done final : CollectiveWork {
    Status wait() override { return slide::core::ok_status(); }
    bool completed() const override { return true; }
  };
  SLIDE_RETURN_IF_ERROR(comm.all_reduce(data, count, dtype, op, what));
  return std::unique_ptr<CollectiveWork>(std::make_unique<Done>());
}
}  // namespace dist

Result<int> ranks_on_this_host(Communicator& comm) {
  if (comm.world_size() == 1) return 1;
  char host[HOST_NAME_MAX + 1] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  // FNV-1a, 64 bits (Fowler, Noll, Vo), cut to the 52 bits a double holds exactly.
  uint64_t h = 14695981039346656037ull;
  for (const char* c = host; *c != '\0'; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  const double mine = static_cast<double>(h & ((uint64_t{1} << 52) - 1));
  std::vector<double> all;
  SLIDE_RETURN_IF_ERROR(comm.all_gather(mine, &all, "all-gather of the ranks' host names"));
  int same = 0;
  for (double v : all) same += v == mine ? 1 : 0;
  return std::max(same, 1);
}

Result<std::unique_ptr<Communicator>> make_communicator(const std::string& kind, double timeout_s, int device) {
  if (!(timeout_s > 0) || timeout_s > 1e9)  // 1e9 s: the deadlines are 64-bit nanoseconds
    return slide::core::invalid_argument("the collective timeout must be in (0, 1e9] seconds, not " +
                                         std::to_string(timeout_s));
  SLIDE_ASSIGN_OR_RETURN(LaunchedRank launched, launched_rank());
  std::string k = kind;
  if (k == "auto") k = launched.world_size > 0 ? "socket" : launch_world_size() > 1 ? "mpi" : "local";
  if (k == "local") return dist::make_local_communicator(timeout_s);
  if (k == "socket") {
    if (launched.world_size == 0)
      return slide::core::invalid_argument("--dist socket is for the ranks that slide-train --gpus N starts");
    return make_socket_communicator(launched.rank, launched.world_size, std::move(launched.fds), timeout_s);
  }
  if (k == "mpi") {
#ifdef SLIDE_WITH_MPI
    return dist::make_mpi_communicator(timeout_s);
#else
    return slide::core::unimplemented("--dist mpi: this build has no MPI (install libopenmpi-dev and rebuild)");
#endif
  }
  if (k == "nccl") {
#ifdef SLIDE_WITH_NCCL
    if (launched.world_size > 0) {
      SLIDE_ASSIGN_OR_RETURN(auto bootstrap, make_socket_communicator(launched.rank, launched.world_size,
                                                                      std::move(launched.fds), timeout_s));
      return dist::make_nccl_communicator(timeout_s, std::move(bootstrap), device);
    }
#ifdef SLIDE_WITH_MPI
    SLIDE_ASSIGN_OR_RETURN(auto bootstrap, dist::make_mpi_communicator(timeout_s));
    return dist::make_nccl_communicator(timeout_s, std::move(bootstrap), device);
#else
    return slide::core::unimplemented("--dist nccl outside slide-train --gpus bootstraps over MPI, which this build "
                                      "has not (install libopenmpi-dev and rebuild)");
#endif
#else
    (void)device;
    return slide::core::unimplemented("--dist nccl: this build has no NCCL (CUDA and NCCL are needed)");
#endif
  }
  return slide::core::invalid_argument("--dist '" + kind + "' is not one of auto, local, mpi, socket, nccl");
}

}  // namespace slide::train
