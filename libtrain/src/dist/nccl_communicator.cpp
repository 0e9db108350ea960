// The NCCL communicator: GPU ranks, one device each (the node-local rank's), NCCL's unique id
// broadcast over the bootstrap communicator ("mpi" under mpirun/srun, keeping MPI's lifetime;
// "socket" under slide-train --gpus).
//
// Every collective is enqueued on this communicator's own CUDA stream, followed by an event;
// wait() polls the event and ncclCommGetAsyncError against the deadline and, past it, aborts the
// NCCL communicator (ncclCommAbort ends its kernels) so that nothing blocks. The NCCL communicator
// is non-blocking (ncclConfig_t::blocking = 0): no NCCL call blocks the host, including connection
// set-up. Buffers on the device (or managed) are used in place; host buffers go through pinned
// and device staging from a pool, so the host code paths (broadcast_string, all_gather) work too.
// Compiled only with CUDA and NCCL (libtrain/CMakeLists.txt); no GPU was available when it was
// written: it is compile-checked, and tests/gpu/test_nccl.cpp runs it where there is a device.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "cuda/cuda_fence.h"
#include "dist/communicators.h"
#include "slide/core/log.h"
#include "slide/train/device_select.h"

namespace slide::train::dist {

namespace {

using Clock = std::chrono::steady_clock;
// How often a wait on NCCL polls the bootstrap connections for a lost peer (Communicator::lost_peer:
// a poll(2) of at most P - 1 sockets), and how long it then goes on waiting before it fails: a
// rank's death fails the others' collectives within a second instead of at --dist-timeout.
constexpr auto kPeerCheckInterval = std::chrono::milliseconds(10);
constexpr auto kLostPeerGrace = std::chrono::seconds(1);

// Watches the bootstrap connections during one wait on NCCL. A closed connection is not a failure
// at once: a peer that finished the job's last collective may exit while this rank's part of it
// completes moments later. So the wait goes on for kLostPeerGrace after the loss is seen, and
// fails only if it has not completed by then (a dead peer's collective never does).
class PeerWatch {
 public:
  explicit PeerWatch(Communicator& bootstrap) : bootstrap_(bootstrap), next_(Clock::now() + kPeerCheckInterval) {}
  // The lost rank once its grace has passed, else -1.
  int check(Clock::time_point now) {
    if (lost_ < 0) {
      if (now < next_) return -1;
      next_ = now + kPeerCheckInterval;
      lost_ = bootstrap_.lost_peer();
      if (lost_ < 0) return -1;
      lost_at_ = now;
    }
    return now - lost_at_ >= kLostPeerGrace ? lost_ : -1;
  }

 private:
  Communicator& bootstrap_;
  Clock::time_point next_;
  Clock::time_point lost_at_{};
  int lost_ = -1;
};

Result<ncclDataType_t> nccl_type(DType t, const std::string& what) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kI32: return ncclInt32;
    case DType::kU8: return ncclUint8;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
  }
  return slide::core::invalid_argument(what + ": dtype");
}

// A pinned host buffer and a device buffer of the same size, for collectives on host memory.
struct Staging {
  void* host = nullptr;
  void* device = nullptr;
  size_t bytes = 0;
};

class NcclCommunicator;

class NcclWork final : public CollectiveWork {
 public:
  NcclWork(NcclCommunicator* comm, cudaEvent_t event, std::string what, Clock::time_point start, void* host_out,
           size_t host_bytes, Staging* staging)
      : comm_(comm), event_(event), what_(std::move(what)), start_(start), host_out_(host_out),
        host_bytes_(host_bytes), staging_(staging) {}
  ~NcclWork() override;
  Status wait() override;

 private:
  NcclCommunicator* comm_;
  cudaEvent_t event_;
  std::string what_;
  Clock::time_point start_;
  void* host_out_;       // host buffer to copy the result to (staged collectives), else null
  size_t host_bytes_;
  Staging* staging_;     // returned to the pool when done, else null
  bool done_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(double timeout_s, std::unique_ptr<Communicator> bootstrap)
      : Communicator(timeout_s), bootstrap_(std::move(bootstrap)) {}

  ~NcclCommunicator() override {
    if (device_ >= 0) (void)cudaSetDevice(device_);  // this thread may have another current device
    if (comm_ != nullptr) {
      if (broken_) {
        ncclCommAbort(comm_);
      } else {
        // Finalise (flushes, non-blocking: polled for at most the timeout), then free.
        ncclResult_t st = ncclCommFinalize(comm_);
        const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                 std::chrono::duration<double>(timeout_s()));
        while ((st == ncclSuccess || st == ncclInProgress) && ncclCommGetAsyncError(comm_, &st) == ncclSuccess &&
               st == ncclInProgress && Clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (st == ncclSuccess)
          ncclCommDestroy(comm_);
        else
          ncclCommAbort(comm_);
      }
    }
    for (Staging& s : pool_) cudaFreeHost(s.host), cudaFree(s.device);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    // A broken NCCL communicator leaves the other ranks blocked: the job goes down.
    if (broken_) bootstrap_->abort_job(1);
  }

  Status init(int device) {
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return cuda_error("cudaSetDevice", e);
    device_ = device;
    if (const cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); e != cudaSuccess)
      return cuda_error("cudaStreamCreate", e);
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (rank() == 0)
      if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
        return slide::core::internal_error("ncclGetUniqueId: " + std::string(ncclGetErrorString(r)));
    SLIDE_RETURN_IF_ERROR(bootstrap_->broadcast(&id, sizeof id, 0, "broadcast of the NCCL unique id"));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const auto start = Clock::now();
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, world_size(), id, rank(), &config);
    if (r != ncclSuccess && r != ncclInProgress)
      return slide::core::internal_error("ncclCommInitRankConfig: " + std::string(ncclGetErrorString(r)));
    return settle(start, "NCCL communicator set-up");
  }

  std::string name() const override { return "nccl"; }
  int rank() const override { return bootstrap_->rank(); }
  int world_size() const override { return bootstrap_->world_size(); }
  int local_rank() const override { return bootstrap_->local_rank(); }
  Device device() const override { return Device::kCuda; }

  Status all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, const std::string& what) override {
    SLIDE_ASSIGN_OR_RETURN(auto work, all_reduce_async(data, count, dtype, op, what));
    return work->wait();
  }

  Result<std::unique_ptr<CollectiveWork>> all_reduce_async(void* data, int64_t count, DType dtype, ReduceOp op,
                                                           const std::string& what) override {
    if (count < 0) return slide::core::invalid_argument(what + ": negative count");
    if (dtype == DType::kU8 || (dtype == DType::kI32 && op == ReduceOp::kAverage))
      return slide::core::invalid_argument(what + ": all-reduce of " + dtype_name(dtype));
    SLIDE_ASSIGN_OR_RETURN(ncclDataType_t type, nccl_type(dtype, what));
    const ncclRedOp_t nop = op == ReduceOp::kAverage ? ncclAvg : ncclSum;
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
    return enqueue(data, bytes, bytes, what, [&](void* buf, size_t) {
      return ncclAllReduce(buf, buf, static_cast<size_t>(count), type, nop, comm_, stream_);
    });
  }

  // The stream of every later collective waits, on the device, for the cuda backend's fence
  // (cudaStreamWaitEvent uses the event as recorded now).
  Result<bool> start_after(const DeviceFence& fence) override {
    const auto* f = dynamic_cast<const cuda::CudaFence*>(&fence);
    if (f == nullptr) return false;
    if (broken_ || comm_ == nullptr) return broken_error("ordering after the backend's work");
    if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess)
      return fail("ordering after the backend's work", cudaGetErrorString(e));
    if (const cudaError_t e = cudaStreamWaitEvent(stream_, f->event(), 0); e != cudaSuccess)
      return fail("ordering after the backend's work", cudaGetErrorString(e));
    return true;
  }

  Status broadcast(void* data, size_t bytes, int root, const std::string& what) override {
    if (root < 0 || root >= world_size())
      return slide::core::invalid_argument(what + ": broadcast from rank " + std::to_string(root) + " of " +
                                           std::to_string(world_size()));
    SLIDE_ASSIGN_OR_RETURN(auto work, enqueue(data, bytes, bytes, what, [&](void* buf, size_t) {
      return ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_);
    }));
    return work->wait();
  }

  Status barrier(const std::string& what) override {
    int32_t one = 1;
    return all_reduce(&one, 1, DType::kI32, ReduceOp::kSum, what);
  }

  Status all_gather(double value, std::vector<double>* out, const std::string& what) override {
    std::vector<double> all(static_cast<size_t>(world_size()), 0.0);
    all[static_cast<size_t>(rank())] = value;
    SLIDE_ASSIGN_OR_RETURN(auto work, enqueue(all.data(), all.size() * sizeof(double), all.size() * sizeof(double),
                                              what, [&](void* buf, size_t) {
      // In place: this rank's value sits at its own offset of the receive buffer.
      return ncclAllGather(static_cast<double*>(buf) + rank(), buf, 1, ncclFloat64, comm_, stream_);
    }));
    SLIDE_RETURN_IF_ERROR(work->wait());
    *out = std::move(all);
    return slide::core::ok_status();
  }

  void abort_job(int exit_code) override {
    if (comm_ != nullptr) ncclCommAbort(comm_), comm_ = nullptr;
    bootstrap_->abort_job(exit_code);
  }

  // For NcclWork.
  void mark_broken() {
    if (!broken_ && comm_ != nullptr) ncclCommAbort(comm_), comm_ = nullptr;
    broken_ = true;
  }
  void release(Staging* s) { free_.push_back(s); }
  ncclComm_t nccl() const { return comm_; }
  int lost_peer() override { return bootstrap_->lost_peer(); }
  // A peer's bootstrap connection closed while this rank waits on NCCL: its kernels would wait for
  // that rank until the deadline; abort now, naming it (kUnavailable, as the socket communicator).
  Status peer_gone(const std::string& what, int peer) {
    mark_broken();
    return slide::core::unavailable(describe(what) + ": rank " + std::to_string(peer) +
                                    " closed its connection (it has exited, failed or was killed)");
  }
  using Communicator::deadline_message;
  Status fail(const std::string& what, const std::string& why) {
    mark_broken();
    return slide::core::internal_error(describe(what) + ": " + why);
  }

 private:
  static Status cuda_error(const char* call, cudaError_t e) {
    return slide::core::internal_error(std::string(call) + ": " + cudaGetErrorString(e));
  }

  // Waits for a non-blocking NCCL call to leave ncclInProgress, within the deadline.
  Status settle(Clock::time_point start, const std::string& what) {
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s()));
    PeerWatch peers(*bootstrap_);
    for (;;) {
      ncclResult_t st = ncclInProgress;
      if (const ncclResult_t r = ncclCommGetAsyncError(comm_, &st); r != ncclSuccess)
        return fail(what, ncclGetErrorString(r));
      if (st == ncclSuccess) return slide::core::ok_status();
      if (st != ncclInProgress) return fail(what, std::string(ncclGetErrorString(st)) + ": " + ncclGetLastError(comm_));
      if (const int peer = peers.check(Clock::now()); peer >= 0) return peer_gone(what, peer);
      if (Clock::now() >= deadline) {
        mark_broken();
        return Status(slide::core::StatusCode::kDeadlineExceeded, deadline_message(what));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  Result<Staging*> acquire(size_t bytes, const std::string& what) {
    for (size_t i = 0; i < free_.size(); ++i)
      if (free_[i]->bytes >= bytes) {
        Staging* s = free_[i];
        free_.erase(free_.begin() + static_cast<long>(i));
        return s;
      }
    Staging s;
    s.bytes = std::max<size_t>(bytes, 1);
    if (const cudaError_t e = cudaMallocHost(&s.host, s.bytes); e != cudaSuccess)
      return fail(what, std::string("pinned staging: ") + cudaGetErrorString(e));
    if (const cudaError_t e = cudaMalloc(&s.device, s.bytes); e != cudaSuccess) {
      cudaFreeHost(s.host);
      return fail(what, std::string("device staging: ") + cudaGetErrorString(e));
    }
    pool_.push_back(s);
    return &pool_.back();
  }

  // Runs `call(device buffer, bytes)` on the stream: in place for device memory; for host memory
  // through staging (host -> pinned -> device, the collective, device -> pinned; the copy back to
  // the caller's buffer happens in wait()). Then records the completion event.
  template <typename Call>
  Result<std::unique_ptr<CollectiveWork>> enqueue(void* data, size_t in_bytes, size_t out_bytes,
                                                  const std::string& what, Call call) {
    if (broken_ || comm_ == nullptr) return broken_error(what);
    const auto start = Clock::now();
    // The event below is created on the current device, which must be the stream's: the calling
    // thread may have made another device current (cudaSetDevice is per host thread).
    if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return fail(what, cudaGetErrorString(e));
    cudaPointerAttributes attr{};
    const bool on_device = cudaPointerGetAttributes(&attr, data) == cudaSuccess &&
                           (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged);
    cudaGetLastError();  // clear a sticky "invalid value" from probing a plain host pointer
    Staging* staging = nullptr;
    void* buf = data;
    if (!on_device) {
      SLIDE_ASSIGN_OR_RETURN(staging, acquire(std::max(in_bytes, out_bytes), what));
      std::memcpy(staging->host, data, in_bytes);
      if (const cudaError_t e = cudaMemcpyAsync(staging->device, staging->host, in_bytes, cudaMemcpyHostToDevice, stream_);
          e != cudaSuccess)
        return fail(what, cudaGetErrorString(e));
      buf = staging->device;
    }
    const ncclResult_t r = call(buf, in_bytes);
    if (r != ncclSuccess && r != ncclInProgress) return fail(what, std::string(ncclGetErrorString(r)) + ": " + ncclGetLastError(comm_));
    if (r == ncclInProgress) SLIDE_RETURN_IF_ERROR(settle(start, what));
    if (staging != nullptr)
      if (const cudaError_t e = cudaMemcpyAsync(staging->host, staging->device, out_bytes, cudaMemcpyDeviceToHost, stream_);
          e != cudaSuccess)
        return fail(what, cudaGetErrorString(e));
    cudaEvent_t event = nullptr;
    if (const cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); e != cudaSuccess)
      return fail(what, cudaGetErrorString(e));
    if (const cudaError_t e = cudaEventRecord(event, stream_); e != cudaSuccess) {
      cudaEventDestroy(event);
      return fail(what, cudaGetErrorString(e));
    }
    return std::unique_ptr<CollectiveWork>(std::make_unique<NcclWork>(
        this, event, what, start, staging != nullptr ? data : nullptr, out_bytes, staging));
  }

  std::unique_ptr<Communicator> bootstrap_;
  int device_ = -1;  // the CUDA device of comm_ and stream_
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::deque<Staging> pool_;    // every staging made (a deque: works hold pointers into it)
  std::vector<Staging*> free_;  // those not in use
  bool broken_ = false;
};

NcclWork::~NcclWork() {
  // Abandoned in flight: the buffers may still be written and the other ranks expect this one.
  if (!done_) comm_->mark_broken();
  else if (staging_ != nullptr) comm_->release(staging_);
  cudaEventDestroy(event_);
}

Status NcclWork::wait() {
  if (done_) return slide::core::ok_status();
  const auto deadline = start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(comm_->timeout_s()));
  PeerWatch peers(*comm_);
  for (;;) {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) return comm_->fail(what_, cudaGetErrorString(e));
    // Not an error, but the runtime may keep it as this thread's last error, where the backend's
    // next launch check would take it for its own: clear it, and only it.
    if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
    ncclResult_t st = ncclSuccess;
    if (comm_->nccl() == nullptr) return comm_->fail(what_, "the NCCL communicator was aborted");
    if (ncclCommGetAsyncError(comm_->nccl(), &st) == ncclSuccess && st != ncclSuccess && st != ncclInProgress)
      return comm_->fail(what_, std::string(ncclGetErrorString(st)) + ": " + ncclGetLastError(comm_->nccl()));
    if (const int peer = peers.check(Clock::now()); peer >= 0) return comm_->peer_gone(what_, peer);
    if (Clock::now() >= deadline) {
      comm_->mark_broken();
      return Status(slide::core::StatusCode::kDeadlineExceeded, comm_->deadline_message(what_));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  // The event completes too when the communicator was aborted meanwhile (another work's deadline,
  // a peer gone, abort_job: ncclCommAbort makes its kernels return early), over a result that may
  // be partial; NCCL's documentation: after an error nothing can be assumed about the completion
  // or correctness of enqueued operations.
  if (comm_->nccl() == nullptr) return comm_->fail(what_, "the NCCL communicator was aborted");
  if (ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm_->nccl(), &st) == ncclSuccess && st != ncclSuccess && st != ncclInProgress)
    return comm_->fail(what_, std::string(ncclGetErrorString(st)) + ": " + ncclGetLastError(comm_->nccl()));
  done_ = true;
  if (host_out_ != nullptr) std::memcpy(host_out_, staging_->host, host_bytes_);
  return slide::core::ok_status();
}

}  // namespace

Result<std::unique_ptr<Communicator>> make_nccl_communicator(double timeout_s, std::unique_ptr<Communicator> bootstrap,
                                                             int device_flag) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    return slide::core::failed_precondition("--dist nccl: no CUDA device on this node");
  // The GPU the cuda backend opens too (make_backend: select_device): --device, else the
  // launcher's node-local rank; more ranks on a node than GPUs is refused, not shared.
  SLIDE_ASSIGN_OR_RETURN(const int device,
                         select_device(device_flag, devices, [](const char* var) { return std::getenv(var); }));
  auto comm = std::make_unique<NcclCommunicator>(timeout_s, std::move(bootstrap));
  if (Status s = comm->init(device); !s.ok()) {
    // A set-up that broke (a deadline, an asynchronous NCCL error, a peer gone) leaves the other
    // ranks waiting: the communicator's destructor, on the way out of here, takes the job down
    // (MPI_Abort under mpirun) before the caller could print the reason. Say it first.
    slide::core::log_error("NCCL communicator set-up failed", {{"rank", comm->rank()}, {"device", device},
                                                               {"error", s.to_string()}});
    return s;
  }
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace slide::train::dist
