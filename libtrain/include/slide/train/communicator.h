// Communicator: the collectives that data-parallel training needs between ranks (DESIGN.md,
// "Distributed"), behind one narrow interface with no MPI or NCCL type in it.
//
// Implementations: "local" (one rank, every collective is the identity), "mpi" (CPU ranks,
// Open MPI or any MPI-3 library: non-blocking collectives polled against a deadline) and
// "socket" (the ranks `slide-train --gpus N` starts on one machine, over Unix sockets). "nccl"
// (GPU ranks; its unique id broadcast over MPI or the launcher's sockets) fills the same interface: buffers live on
// device(), and all_reduce_async lets a caller start a bucket's all-reduce while backward is still
// producing the next bucket's gradients. make_communicator() in src/dist/communicator.cpp is the
// one place that knows which implementations were built.
//
// Every collective must be called by every rank, in the same order, with the same count, dtype
// and root ("what" may differ). A collective that has not completed `timeout_s` seconds after it
// started fails with kDeadlineExceeded naming this rank, the step (set_step) and the collective;
// after any failed collective the communicator is broken: later calls fail at once with
// kFailedPrecondition and the caller should take the job down with abort_job(). Not thread-safe:
// one thread (the training loop's) calls the collectives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "slide/train/tensor.h"

namespace slide::train {

class DeviceFence;  // backend.h

enum class ReduceOp : uint8_t { kSum = 0, kAverage = 1 };

// The gradient buckets' default size (data_parallel.h, TrainOptions::bucket_bytes): PyTorch
// DistributedDataParallel's default bucket_cap_mb (25 MiB).
inline constexpr size_t kDefaultBucketBytes = size_t{25} << 20;

// A collective in flight, from Communicator::all_reduce_async.
class CollectiveWork {
 public:
  virtual ~CollectiveWork() = default;
  // Blocks until the collective has completed (its buffer holds the result) or the timeout has
  // passed. Errors: kDeadlineExceeded (the message names rank, step and collective), kInternal
  // (the library's error text). Calling it again after success returns OK at once.
  [[nodiscard]] virtual Status wait() = 0;
  // Lets the library advance the collective without blocking: MPI's non-blocking collectives make
  // progress only inside MPI calls, so a caller that overlaps them with computation calls this
  // between pieces of work (one MPI_Test). Others progress on their own: nothing to do. Errors: as
  // wait() (but never kDeadlineExceeded: only wait() enforces the deadline).
  [[nodiscard]] virtual Status progress() { return slide::core::ok_status(); }
  // Whether progress() or wait() has seen the collective complete (for the step timeline,
  // GradientBuckets::record_timeline): false while in flight, and wherever only wait() learns it.
  virtual bool completed() const { return false; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual std::string name() const = 0;  // "local", "mpi", "socket", "nccl"
  virtual int rank() const = 0;          // 0 .. world_size() - 1
  virtual int world_size() const = 0;
  virtual int local_rank() const = 0;    // rank among the ranks of this node (picks the GPU)
  virtual Device device() const = 0;     // where the buffers given to collectives live
  double timeout_s() const { return timeout_s_; }
  // Bounds the collectives started from now on (seconds, > 0; e.g. longer while ranks load data).
  void set_timeout_s(double s) { timeout_s_ = s; }
  // The training step named in error messages (the global optimizer step).
  void set_step(int64_t step) { step_ = step; }
  int64_t step() const { return step_; }

  // In place: data[0 .. count) of `dtype` (kF32, kF64 or kI32) becomes the element-wise sum (or
  // mean) over the ranks. `what` names the collective in errors ("gradient bucket 2 of 5").
  // Errors: kInvalidArgument (negative count, an unsupported dtype/op pair such as a kI32
  // average), kDeadlineExceeded, kFailedPrecondition (broken by an earlier failure), kInternal.
  [[nodiscard]] virtual Status all_reduce(void* data, int64_t count, DType dtype, ReduceOp op,
                                          const std::string& what) = 0;
  // The same, started now and completed by wait() on the returned work; `data` must stay valid
  // and untouched until then. Several may be in flight; the deadline runs from the start.
  [[nodiscard]] virtual Result<std::unique_ptr<CollectiveWork>> all_reduce_async(void* data, int64_t count,
                                                                                 DType dtype, ReduceOp op,
                                                                                 const std::string& what) = 0;
  // Orders the collectives started after this call behind `fence` on the device (NCCL: its stream
  // waits for the fence's event), so that a caller with device buffers need not synchronise its
  // backend on the host first. Returns false when this communicator cannot (host communicators,
  // or a fence of another kind): the caller then synchronises. Errors: the device's.
  [[nodiscard]] virtual Result<bool> start_after(const DeviceFence& fence) {
    (void)fence;
    return false;
  }
  // data[0 .. bytes) of rank `root` copied to every rank. Errors: as all_reduce, and
  // kInvalidArgument for a root outside 0 .. world_size() - 1.
  [[nodiscard]] virtual Status broadcast(void* data, size_t bytes, int root, const std::string& what) = 0;
  // Returns when every rank has entered it. Errors: as all_reduce.
  [[nodiscard]] virtual Status barrier(const std::string& what) = 0;
  // One small host value per rank, gathered on every rank: (*out)[r] is rank r's `value`.
  // Errors: as all_reduce.
  [[nodiscard]] virtual Status all_gather(double value, std::vector<double>* out, const std::string& what) = 0;
  // Checked without blocking: a rank whose connection to this one has closed (it exited, was
  // killed, or took the job down with abort_job), else -1. For a device communicator's wait
  // (NCCL), which cannot see a peer's death in its own collectives, to fail within moments instead
  // of at the deadline. Only peers this rank holds a connection to are seen (socket: rank 0 sees
  // every rank, the others rank 0, whose own failure then closes theirs); communicators that
  // cannot tell return -1 (local; MPI, where mpirun ends the job when a rank fails).
  virtual int lost_peer() { return -1; }
  // Takes every rank of the job down with `exit_code` (MPI_Abort): what an app does after a
  // failure on one rank so that the others are not left blocked. Only apps call it (libraries
  // return Status). "local" returns, and the app exits as it would without ranks.
  virtual void abort_job(int exit_code) = 0;

 protected:
  explicit Communicator(double timeout_s) : timeout_s_(timeout_s) {}
  // "rank R of P at step S: <what>": how every error of a collective begins.
  std::string describe(const std::string& what) const;
  // kDeadlineExceeded's text: "<describe(what)> did not complete within T s (--dist-timeout)",
  // then ": another rank has stopped, died or fallen behind", or, when the rank waited for is
  // known (`peer` >= 0), " waiting for rank N: it has stopped, died or fallen behind".
  std::string deadline_message(const std::string& what, int peer = -1) const;
  // kFailedPrecondition for a collective called after an earlier one failed.
  Status broken_error(const std::string& what) const;

 private:
  double timeout_s_;
  int64_t step_ = 0;
};

// How many ranks of `comm` run on this rank's host (itself included), for dividing what they
// share, such as RAM: the hosts' names (gethostname) gathered over every rank (one all_gather of
// a 52-bit FNV-1a hash of the name) and those equal to this rank's counted. A collective: every
// rank calls it. Errors: those of all_gather.
[[nodiscard]] Result<int> ranks_on_this_host(Communicator& comm);

// The communicator for `kind`: "local", "mpi", "socket", "nccl", or "auto" ("socket" in a rank
// that `slide-train --gpus N` started, "mpi" when launch_world_size() > 1, else "local"). "mpi"
// initialises MPI (MPI_Init_thread, funneled: only the calling thread makes MPI calls) and
// finalises it when destroyed; it works for a world of one too. "socket" takes the rank, world
// size and sockets from the environment the launcher set (launched_rank()). "nccl" bootstraps
// over "socket" in such a rank, else over "mpi", on GPU `device` (--device; -1: the node-local
// rank's, select_device in device_select.h, as the cuda backend chooses). `timeout_s` in (0, 1e9]
// bounds every collective. Errors: kInvalidArgument (unknown kind, timeout_s out of that range,
// "socket" outside a launched rank or with a malformed environment), kUnimplemented ("mpi" or "nccl" in a build without them),
// kInternal (MPI failed to start).
[[nodiscard]] Result<std::unique_ptr<Communicator>> make_communicator(const std::string& kind, double timeout_s,
                                                                      int device = -1);

// The world size the launcher announced in the environment, before any MPI call: slidestream's
// own SLIDE_LAUNCH_WORLD_SIZE (slide-train --gpus N), Open MPI's OMPI_COMM_WORLD_SIZE (mpirun),
// PMIx/PMI's PMIX_SIZE / PMI_SIZE, Slurm's SLURM_STEP_NUM_TASKS (srun, inside a job step); 1
// when none is set or parsable.
int launch_world_size();

// A rank started by `slide-train --gpus N` (apps/launch.h) finds itself in these environment
// variables, which the launcher sets for each child it starts:
//   SLIDE_LAUNCH_RANK        r, 0 .. P-1 (also SLIDE_LAUNCH_LOCAL_RANK: one machine)
//   SLIDE_LAUNCH_WORLD_SIZE  P
//   SLIDE_LAUNCH_FDS         the inherited socket descriptors, comma-separated: on rank 0 the
//                            sockets to ranks 1 .. P-1 in order, on every other rank its one
//                            socket to rank 0
constexpr const char* kLaunchRankEnv = "SLIDE_LAUNCH_RANK";
constexpr const char* kLaunchLocalRankEnv = "SLIDE_LAUNCH_LOCAL_RANK";
constexpr const char* kLaunchWorldSizeEnv = "SLIDE_LAUNCH_WORLD_SIZE";
constexpr const char* kLaunchFdsEnv = "SLIDE_LAUNCH_FDS";
struct LaunchedRank {
  int rank = 0;
  int world_size = 1;
  std::vector<int> fds;
};
// The rank this process is, from those variables: nullopt-like (world_size 0) when
// SLIDE_LAUNCH_WORLD_SIZE is not set. Errors: kInvalidArgument naming a variable that is set but
// malformed (a rank outside 0..P-1, descriptors that are not numbers, the wrong number of them).
[[nodiscard]] Result<LaunchedRank> launched_rank();

// The communicator of rank `rank` of `world_size` over connected stream sockets (the "socket"
// kind; src/dist/socket_communicator.cpp): on rank 0, `fds` are the sockets to ranks 1 .. P-1 in
// order; on every other rank, its one socket to rank 0. Takes the descriptors (closes them when
// destroyed; sets them non-blocking and close-on-exec). Collectives go through rank 0, which sums
// in rank order; a dead peer fails the collective at once (kUnavailable naming it), a stopped one
// at the deadline (kDeadlineExceeded). Errors: kInvalidArgument (a rank outside 0..P-1, the wrong
// number of descriptors), the fcntl error of a bad descriptor.
[[nodiscard]] Result<std::unique_ptr<Communicator>> make_socket_communicator(int rank, int world_size,
                                                                             std::vector<int> fds, double timeout_s);

// The half-open range of a batch of `n` samples that rank `rank` of `world` takes:
// [n * rank / world, n * (rank + 1) / world). Sizes differ by at most one over the ranks, the
// ranges tile [0, n) in rank order, and an empty range is possible when n < world.
struct ShardRange {
  size_t begin = 0, end = 0;
};
ShardRange shard_range(size_t n, int rank, int world);

}  // namespace slide::train
