// The MPI communicator: CPU ranks over any MPI-3 library (Open MPI here).
//
// Every collective is non-blocking (MPI_Iallreduce, MPI_Ibcast, MPI_Ibarrier, MPI_Iallgather)
// and completed by polling MPI_Test against a deadline, so that a rank whose peer has stopped or
// died gets an error naming itself and the step instead of blocking forever (MPI has no
// timeout of its own). Polling is what progresses a non-blocking collective in Open MPI, so the
// loop yields the core between tests for the first milliseconds (an all-reduce of a few MB
// completes within them) and only then sleeps, so a long wait does not burn a core that an
// oversubscribed rank needs.
//
// Progress while the trainer computes: Open MPI's TCP transport moves a large message only inside
// MPI calls (each ring step needs the peer's acknowledgement, the next step needs the reduction
// posted), so collectives polled only between layers crawl during backward. A progress thread
// therefore tests every collective in flight every SLIDE_MPI_PROGRESS_US microseconds (default
// 500; 0: none, polling between layers only) and sleeps on a condition variable when none is in
// flight. Every MPI call of the communicator holds its mutex (MPI_THREAD_SERIALIZED: one thread in
// MPI at a time); without that thread level the thread is not started.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dist/communicators.h"

namespace slide::train::dist {

namespace {

using Clock = std::chrono::steady_clock;

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(len));
}

Result<MPI_Datatype> mpi_type(DType t, const std::string& what) {
  switch (t) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kI32: return MPI_INT;
    default: return slide::core::invalid_argument(what + ": all-reduce of " + dtype_name(t));
  }
}

// All-reduces of at least this many bytes take the ring (MpiRingWork), smaller ones
// MPI_Iallreduce (whose latency-bound algorithms win for small buffers). SLIDE_ALLREDUCE_RING_MIN
// (bytes; 0 = always the ring, a huge value = never) overrides the default, for benchmarks.
size_t ring_threshold_bytes() {
  if (const char* v = std::getenv("SLIDE_ALLREDUCE_RING_MIN"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    if (*end == '\0') return static_cast<size_t>(n);
  }
  // Measured on the two-host rig (tests/dist/two_hosts.sh, 2 ranks, Open MPI 4.1 over TCP with
  // the send protocol, set_mpi_transport_defaults), ms per all-reduce, ring / MPI_Iallreduce:
  //   1 Gbit/s:  256 KB 2.2 / 1.0-2.2, 1 MB 8.7 / 7.6, 4 MB 35-37 / 54-56;
  //   10 Gbit/s: 256 KB 0.27-0.34 / 0.34-0.38, 1 MB 0.84-0.88 / 1.4-1.5, 4 MB 4.2-4.5 / 6.9-7.6.
  // The ring wins from 4 MB at both speeds, so from 4 MiB (the 25 MiB gradient buckets, and the
  // last, smaller bucket when it is 4 MiB or more).
  return size_t{4} << 20;
}

// The progress thread's polling period (SLIDE_MPI_PROGRESS_US, microseconds; 0: no thread).
int progress_period_us() {
  if (const char* v = std::getenv("SLIDE_MPI_PROGRESS_US"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*end == '\0' && n >= 0 && n <= 1000000) return static_cast<int>(n);
  }
  return 500;
}

class MpiCommunicator;

// A collective in flight: wait() drives progress() against the deadline. progress() may be called
// by the owner and by the communicator's progress thread: it holds the communicator's mutex, and a
// failure seen by either is kept and returned to every later call.
class MpiWorkBase : public CollectiveWork {
 public:
  ~MpiWorkBase() override;
  Status wait() final;
  Status progress() final;
  bool completed() const final { return done_.load(std::memory_order_acquire); }
  // progress() with the communicator's mutex held (the progress thread's call).
  Status progress_locked();

 protected:
  MpiWorkBase(MpiCommunicator* comm, std::string what) : comm_(comm), what_(std::move(what)), start_(Clock::now()) {}
  // One test of the collective's requests (the mutex held): done_ set when it has completed.
  virtual Status step() = 0;
  // The result is in the buffer: scale a mean by 1/P, then mark done.
  void complete(void* data, int64_t count, DType dtype, bool average);
  // Marks done after a failure (the requests are dead either way).
  void finish_failed() { done_.store(true, std::memory_order_release); }
  bool is_done() const { return done_.load(std::memory_order_relaxed); }
  MpiCommunicator* comm_;
  std::string what_;
  Clock::time_point start_;

 private:
  std::atomic<bool> done_{false};
  Status failed_;  // a failure seen by progress(), returned again to every later call
};

// One MPI request (MPI_Iallreduce, MPI_Ibcast, MPI_Ibarrier, MPI_Iallgather).
class MpiWork final : public MpiWorkBase {
 public:
  MpiWork(MpiCommunicator* comm, MPI_Request req, std::string what, void* data, int64_t count, DType dtype,
          bool average)
      : MpiWorkBase(comm, std::move(what)), req_(req), data_(data), count_(count), dtype_(dtype), average_(average) {}
  ~MpiWork() override;

 protected:
  Status step() override;

 private:
  MPI_Request req_;
  void* data_;
  int64_t count_;
  DType dtype_;
  bool average_;
};

// The ring all-reduce (reduce-scatter, then all-gather: Patarasuk & Yuan, "Bandwidth optimal
// all-reduce algorithms for clusters of workstations", JPDC 2009; what NCCL's and Horovod's rings
// do). The buffer is cut into P chunks, chunk k = [count k / P, count (k + 1) / P). In step s
// (0 <= s < P - 1) of the reduce-scatter, rank r sends chunk (r - s) mod P to rank r + 1 and
// receives chunk (r - s - 1) mod P from rank r - 1, adding it into its own; after P - 1 steps rank r
// holds the sum of chunk (r + 1) mod P. The all-gather then passes the finished chunks on around
// the ring in P - 1 more steps (received straight into place). Each rank sends and receives
// 2 (P - 1) / P of the buffer, the bound for any all-reduce, with both directions of every link
// busy at once. Every rank ends with the same bits (each chunk is summed once, by its ring order,
// and copied). Non-blocking point-to-point messages, each collective on a tag of its own so that
// several in flight never match each other's messages; progress() advances one step when both of
// its requests are done.
class MpiRingWork final : public MpiWorkBase {
 public:
  MpiRingWork(MpiCommunicator* comm, std::string what, void* data, int64_t count, DType dtype, MPI_Datatype type,
              bool average, int tag);
  ~MpiRingWork() override;
  // Starts the first step (the mutex held). Errors: kInternal (MPI's text).
  Status start();

 protected:
  Status step() override;

 private:
  int64_t chunk_begin(int k) const { return count_ * k / size_; }
  int chunk_count(int k) const { return static_cast<int>(chunk_begin(k + 1) - chunk_begin(k)); }
  char* at(int k) const { return static_cast<char*>(data_) + static_cast<size_t>(chunk_begin(k)) * elem_; }
  Status post();  // this step's send and receive
  void reduce();  // the received chunk into this rank's (reduce-scatter steps)

  void* data_;
  int64_t count_;
  DType dtype_;
  bool average_;
  MPI_Datatype type_;
  int tag_, rank_, size_, step_ = 0;
  size_t elem_;
  std::unique_ptr<char[]> recv_;  // the chunk received in a reduce-scatter step
  MPI_Request reqs_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(double timeout_s, MPI_Comm comm, int rank, int size, int local_rank, int progress_us)
      : Communicator(timeout_s), comm_(comm), rank_(rank), size_(size), local_rank_(local_rank) {
    if (progress_us > 0 && size > 1)
      progress_thread_ = std::thread([this, progress_us] { progress_loop(progress_us); });
  }
  ~MpiCommunicator() override {
    if (progress_thread_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
      }
      wake_.notify_all();
      progress_thread_.join();
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    // A collective that failed or was abandoned may still be matched by the other ranks: finalising
    // would hang, so the job is taken down instead.
    if (broken_) MPI_Abort(MPI_COMM_WORLD, 1);
    MPI_Comm_free(&comm_);
    MPI_Finalize();
  }
  std::string name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  Device device() const override { return Device::kCpu; }

  Status all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, const std::string& what) override {
    // (A negative count would skip the loop below and return OK, as no other communicator does.)
    if (count < 0) return slide::core::invalid_argument(what + ": negative count");
    // MPI counts are int: larger buffers go in pieces.
    const size_t elem = dtype_size(dtype);
    for (int64_t done = 0; done < count || (count == 0 && done == 0);) {
      const int64_t n = std::min<int64_t>(count - done, INT_MAX / 2);
      SLIDE_ASSIGN_OR_RETURN(auto work, all_reduce_async(static_cast<char*>(data) + static_cast<size_t>(done) * elem,
                                                         n, dtype, op, what));
      SLIDE_RETURN_IF_ERROR(work->wait());
      done += n;
      if (n == 0) break;
    }
    return slide::core::ok_status();
  }

  Result<std::unique_ptr<CollectiveWork>> all_reduce_async(void* data, int64_t count, DType dtype, ReduceOp op,
                                                           const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    if (count < 0 || count > INT_MAX) return slide::core::invalid_argument(what + ": count " + std::to_string(count));
    if (dtype == DType::kI32 && op == ReduceOp::kAverage)
      return slide::core::invalid_argument(what + ": average of i32 values");
    SLIDE_ASSIGN_OR_RETURN(MPI_Datatype type, mpi_type(dtype, what));
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
    std::unique_lock<std::mutex> lock(mu_);
    if (size_ > 1 && bytes >= ring_min_bytes_) {
      // Tags 1 .. 30000 in turn (MPI guarantees tags up to 32767): never two in flight at once.
      ring_tag_ = ring_tag_ % 30000 + 1;
      auto work =
          std::make_unique<MpiRingWork>(this, what, data, count, dtype, type, op == ReduceOp::kAverage, ring_tag_);
      if (Status st = work->start(); !st.ok()) {
        lock.unlock();  // the work's destructor takes the mutex
        return st;
      }
      track(work.get());
      return std::unique_ptr<CollectiveWork>(std::move(work));
    }
    MPI_Request req = MPI_REQUEST_NULL;
    if (const int rc = MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), type, MPI_SUM, comm_, &req);
        rc != MPI_SUCCESS)
      return fail_internal(what, rc);
    auto work = std::make_unique<MpiWork>(this, req, what, data, count, dtype, op == ReduceOp::kAverage);
    track(work.get());
    return std::unique_ptr<CollectiveWork>(std::move(work));
  }

  Status broadcast(void* data, size_t bytes, int root, const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    if (root < 0 || root >= size_)
      return slide::core::invalid_argument(what + ": broadcast from rank " + std::to_string(root) + " of " +
                                           std::to_string(size_));
    for (size_t done = 0; done < bytes || (bytes == 0 && done == 0);) {
      const size_t n = std::min<size_t>(bytes - done, size_t{1} << 30);
      MPI_Request req = MPI_REQUEST_NULL;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (const int rc = MPI_Ibcast(static_cast<char*>(data) + done, static_cast<int>(n), MPI_BYTE, root, comm_, &req);
            rc != MPI_SUCCESS)
          return fail_internal(what, rc);
      }
      SLIDE_RETURN_IF_ERROR(MpiWork(this, req, what, nullptr, 0, DType::kF32, false).wait());
      done += n;
      if (n == 0) break;
    }
    return slide::core::ok_status();
  }

  Status barrier(const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    MPI_Request req = MPI_REQUEST_NULL;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (const int rc = MPI_Ibarrier(comm_, &req); rc != MPI_SUCCESS) return fail_internal(what, rc);
    }
    return MpiWork(this, req, what, nullptr, 0, DType::kF32, false).wait();
  }

  Status all_gather(double value, std::vector<double>* out, const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    std::vector<double> all(static_cast<size_t>(size_));
    MPI_Request req = MPI_REQUEST_NULL;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (const int rc = MPI_Iallgather(&value, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, comm_, &req);
          rc != MPI_SUCCESS)
        return fail_internal(what, rc);
    }
    SLIDE_RETURN_IF_ERROR(MpiWork(this, req, what, nullptr, 0, DType::kF32, false).wait());
    *out = std::move(all);
    return slide::core::ok_status();
  }

  // Under the mutex, as every MPI call here (MPI_THREAD_SERIALIZED): the progress thread may be
  // testing a collective at this moment. The callers (apps' failure paths) hold no lock of ours; the
  // progress thread holds the mutex only for its non-blocking MPI_Test calls.
  void abort_job(int exit_code) override {
    std::lock_guard<std::mutex> lock(mu_);
    MPI_Abort(MPI_COMM_WORLD, exit_code);
  }

  void mark_broken() { broken_ = true; }
  using Communicator::deadline_message;
  Status fail_internal(const std::string& what, int rc) {
    broken_ = true;
    return slide::core::internal_error(describe(what) + ": " + mpi_error_text(rc));
  }
  // Guards every MPI call and the in-flight list (MPI_THREAD_SERIALIZED).
  std::mutex& mutex() { return mu_; }
  // A work no longer in flight (done, or destroyed): the progress thread forgets it. Mutex held.
  void untrack(MpiWorkBase* w) { inflight_.erase(std::remove(inflight_.begin(), inflight_.end(), w), inflight_.end()); }

 private:
  Status usable(const std::string& what) const { return broken_ ? broken_error(what) : slide::core::ok_status(); }
  // A collective started by all_reduce_async, for the progress thread. Mutex held.
  void track(MpiWorkBase* w) {
    if (!progress_thread_.joinable() || w->completed()) return;
    inflight_.push_back(w);
    wake_.notify_one();
  }
  // The progress thread: tests the collectives in flight every period_us, sleeps while there are
  // none. A failure stays in its work, for its owner's next progress() or wait().
  void progress_loop(int period_us) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      if (inflight_.empty()) {
        wake_.wait(lock, [this] { return stopping_ || !inflight_.empty(); });
        continue;
      }
      // progress_locked may untrack (a completed work): iterate over a copy.
      const std::vector<MpiWorkBase*> now = inflight_;
      for (MpiWorkBase* w : now) (void)w->progress_locked();
      wake_.wait_for(lock, std::chrono::microseconds(period_us), [this] { return stopping_; });
    }
  }
  MPI_Comm comm_;
  int rank_, size_, local_rank_;
  std::atomic<bool> broken_{false};
  size_t ring_min_bytes_ = ring_threshold_bytes();
  int ring_tag_ = 0;
  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<MpiWorkBase*> inflight_;  // started by all_reduce_async, not yet seen complete
  bool stopping_ = false;
  std::thread progress_thread_;

 public:
  MPI_Comm comm() const { return comm_; }
};

MpiWorkBase::~MpiWorkBase() {
  // Each final class has already left the progress thread's list, in its own destructor, before
  // its members went. Abandoned in flight: MPI may still write into the buffer and the other
  // ranks still expect this rank's part, so the communicator can no longer be used or finalised.
  if (!is_done()) comm_->mark_broken();
}

Status MpiWorkBase::progress() {
  std::lock_guard<std::mutex> lock(comm_->mutex());
  return progress_locked();
}

Status MpiWorkBase::progress_locked() {
  if (!failed_.ok()) return failed_;
  if (is_done()) return slide::core::ok_status();  // untracked when it completed (or never tracked)
  Status st = step();
  if (!st.ok()) failed_ = st;
  if (is_done()) comm_->untrack(this);
  return st;
}

Status MpiWorkBase::wait() {
  const auto deadline = start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(comm_->timeout_s()));
  const auto spin_until = Clock::now() + std::chrono::milliseconds(20);
  for (;;) {
    SLIDE_RETURN_IF_ERROR(progress());
    if (is_done()) break;
    const auto now = Clock::now();
    if (now >= deadline) {
      comm_->mark_broken();
      return Status(slide::core::StatusCode::kDeadlineExceeded, comm_->deadline_message(what_));
    }
    if (now < spin_until)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return slide::core::ok_status();
}

void MpiWorkBase::complete(void* data, int64_t count, DType dtype, bool average) {
  if (average) scale_to_mean(data, count, dtype, comm_->world_size());
  done_.store(true, std::memory_order_release);  // after the result: completed() publishes it
}

MpiWork::~MpiWork() {
  // Out of the progress thread's reach before this part of the object is gone.
  std::lock_guard<std::mutex> lock(comm_->mutex());
  comm_->untrack(this);
}

Status MpiWork::step() {
  int flag = 0;
  if (const int rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
    finish_failed();  // the request is dead either way; the communicator is marked broken
    return comm_->fail_internal(what_, rc);
  }
  if (flag) complete(data_, count_, dtype_, average_);
  return slide::core::ok_status();
}

MpiRingWork::MpiRingWork(MpiCommunicator* comm, std::string what, void* data, int64_t count, DType dtype,
                         MPI_Datatype type, bool average, int tag)
    : MpiWorkBase(comm, std::move(what)), data_(data), count_(count), dtype_(dtype), average_(average), type_(type),
      tag_(tag), rank_(comm->rank()), size_(comm->world_size()), elem_(dtype_size(dtype)),
      recv_(new char[static_cast<size_t>(count / comm->world_size() + 1) * dtype_size(dtype)]) {}

MpiRingWork::~MpiRingWork() {
  std::lock_guard<std::mutex> lock(comm_->mutex());
  comm_->untrack(this);  // out of the progress thread's reach first
  // Abandoned in flight (a failed step, a deadline): MPI may still write into the receive buffer,
  // so it is left allocated (leaked) rather than freed under it; the base marks the communicator
  // broken and the job goes down (MPI_Abort), as for an abandoned MPI_Iallreduce.
  if (reqs_[0] != MPI_REQUEST_NULL || reqs_[1] != MPI_REQUEST_NULL) {
    for (MPI_Request& r : reqs_)
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    (void)recv_.release();
  }
}

Status MpiRingWork::start() {
  if (count_ == 0) {
    complete(data_, 0, dtype_, false);
    return slide::core::ok_status();
  }
  return post();
}

Status MpiRingWork::post() {
  const int p = size_, s = step_ % (p - 1);
  const bool scatter = step_ < p - 1;
  // Reduce-scatter step s: send chunk (r - s), receive chunk (r - s - 1). All-gather step s: send
  // the finished chunk (r + 1 - s), receive (r - s) into place.
  const int send_k = ((scatter ? rank_ - s : rank_ + 1 - s) % p + p) % p;
  const int recv_k = ((scatter ? rank_ - s - 1 : rank_ - s) % p + p) % p;
  const int next = (rank_ + 1) % p, prev = (rank_ + p - 1) % p;
  void* into = scatter ? static_cast<void*>(recv_.get()) : static_cast<void*>(at(recv_k));
  if (const int rc = MPI_Irecv(into, chunk_count(recv_k), type_, prev, tag_, comm_->comm(), &reqs_[0]);
      rc != MPI_SUCCESS) {
    finish_failed();
    return comm_->fail_internal(what_, rc);
  }
  if (const int rc = MPI_Isend(at(send_k), chunk_count(send_k), type_, next, tag_, comm_->comm(), &reqs_[1]);
      rc != MPI_SUCCESS) {
    finish_failed();
    return comm_->fail_internal(what_, rc);
  }
  return slide::core::ok_status();
}

void MpiRingWork::reduce() {
  const int p = size_, k = ((rank_ - step_ - 1) % p + p) % p;
  add_into(at(k), recv_.get(), chunk_count(k), dtype_);
}

Status MpiRingWork::step() {
  while (!is_done()) {
    int flag = 0;
    if (const int rc = MPI_Testall(2, reqs_, &flag, MPI_STATUSES_IGNORE); rc != MPI_SUCCESS) {
      finish_failed();
      return comm_->fail_internal(what_, rc);
    }
    if (!flag) return slide::core::ok_status();
    if (step_ < size_ - 1) reduce();
    if (++step_ == 2 * (size_ - 1)) {
      // Every chunk is final; a mean is scaled here, on each rank, as MpiWork does.
      complete(data_, count_, dtype_, average_);
      return slide::core::ok_status();
    }
    SLIDE_RETURN_IF_ERROR(post());
  }
  return slide::core::ok_status();
}

}  // namespace

Result<std::unique_ptr<Communicator>> make_mpi_communicator(double timeout_s) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    set_mpi_transport_defaults();
    int provided = 0;
    if (const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided); rc != MPI_SUCCESS)
      return slide::core::internal_error("MPI_Init_thread: " + mpi_error_text(rc));
  }
  // Errors come back as return codes (the default handler aborts the job with MPI's own text).
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm comm = MPI_COMM_NULL;
  if (const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm); rc != MPI_SUCCESS)
    return slide::core::internal_error("MPI_Comm_dup: " + mpi_error_text(rc));
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 1, local_rank = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  MPI_Comm node = MPI_COMM_NULL;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
  }
  // The progress thread needs MPI calls from two threads, one at a time (every call holds the
  // communicator's mutex): MPI_THREAD_SERIALIZED, else none.
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  const int progress_us = level >= MPI_THREAD_SERIALIZED ? progress_period_us() : 0;
  return std::unique_ptr<Communicator>(
      std::make_unique<MpiCommunicator>(timeout_s, comm, rank, size, local_rank, progress_us));
}

}  // namespace slide::train::dist
