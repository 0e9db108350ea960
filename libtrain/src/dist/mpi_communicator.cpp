// The MPI communicator: CPU ranks over any MPI-3 library (Open MPI here).
//
// Every collective is non-blocking (MPI_Iallreduce, MPI_Ibcast, MPI_Ibarrier, MPI_Iallgather)
// and completed by polling MPI_Test against a deadline, so that a rank whose peer has stopped or
// died gets an error naming itself and the step instead of blocking forever (MPI has no
// timeout of its own). Polling is what progresses a non-blocking collective in Open MPI, so the
// loop yields the core between tests for the first milliseconds (an all-reduce of a few MB
// completes within them) and only then sleeps, so a long wait does not burn a core that an
// oversubscribed rank needs.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <thread>

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

class MpiCommunicator;

class MpiWork final : public CollectiveWork {
 public:
  MpiWork(MpiCommunicator* comm, MPI_Request req, std::string what, void* data, int64_t count, DType dtype,
          bool average)
      : comm_(comm), req_(req), what_(std::move(what)), data_(data), count_(count), dtype_(dtype),
        average_(average), start_(Clock::now()) {}
  ~MpiWork() override;
  Status wait() override;
  Status progress() override;

 private:
  void complete();  // the result is in data_: apply the average, mark done
  MpiCommunicator* comm_;
  MPI_Request req_;
  std::string what_;
  void* data_;
  int64_t count_;
  DType dtype_;
  bool average_, done_ = false;
  Clock::time_point start_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(double timeout_s, MPI_Comm comm, int rank, int size, int local_rank)
      : Communicator(timeout_s), comm_(comm), rank_(rank), size_(size), local_rank_(local_rank) {}
  ~MpiCommunicator() override {
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
    MPI_Request req = MPI_REQUEST_NULL;
    if (const int rc = MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), type, MPI_SUM, comm_, &req);
        rc != MPI_SUCCESS)
      return fail_internal(what, rc);
    return std::unique_ptr<CollectiveWork>(
        std::make_unique<MpiWork>(this, req, what, data, count, dtype, op == ReduceOp::kAverage));
  }

  Status broadcast(void* data, size_t bytes, int root, const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    if (root < 0 || root >= size_)
      return slide::core::invalid_argument(what + ": broadcast from rank " + std::to_string(root) + " of " +
                                           std::to_string(size_));
    for (size_t done = 0; done < bytes || (bytes == 0 && done == 0);) {
      const size_t n = std::min<size_t>(bytes - done, size_t{1} << 30);
      MPI_Request req = MPI_REQUEST_NULL;
      if (const int rc = MPI_Ibcast(static_cast<char*>(data) + done, static_cast<int>(n), MPI_BYTE, root, comm_, &req);
          rc != MPI_SUCCESS)
        return fail_internal(what, rc);
      SLIDE_RETURN_IF_ERROR(MpiWork(this, req, what, nullptr, 0, DType::kF32, false).wait());
      done += n;
      if (n == 0) break;
    }
    return slide::core::ok_status();
  }

  Status barrier(const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    MPI_Request req = MPI_REQUEST_NULL;
    if (const int rc = MPI_Ibarrier(comm_, &req); rc != MPI_SUCCESS) return fail_internal(what, rc);
    return MpiWork(this, req, what, nullptr, 0, DType::kF32, false).wait();
  }

  Status all_gather(double value, std::vector<double>* out, const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    std::vector<double> all(static_cast<size_t>(size_));
    MPI_Request req = MPI_REQUEST_NULL;
    if (const int rc = MPI_Iallgather(&value, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, comm_, &req); rc != MPI_SUCCESS)
      return fail_internal(what, rc);
    SLIDE_RETURN_IF_ERROR(MpiWork(this, req, what, nullptr, 0, DType::kF32, false).wait());
    *out = std::move(all);
    return slide::core::ok_status();
  }

  void abort_job(int exit_code) override { MPI_Abort(MPI_COMM_WORLD, exit_code); }

  void mark_broken() { broken_ = true; }
  std::string deadline_message(const std::string& what) const {
    return describe(what) + " did not complete within " + std::to_string(static_cast<int64_t>(timeout_s())) +
           " s (--dist-timeout): another rank has stopped, died or fallen behind";
  }
  Status fail_internal(const std::string& what, int rc) {
    broken_ = true;
    return slide::core::internal_error(describe(what) + ": " + mpi_error_text(rc));
  }

 private:
  Status usable(const std::string& what) const {
    if (broken_)
      return slide::core::failed_precondition(describe(what) + ": an earlier collective failed; the job must stop");
    return slide::core::ok_status();
  }
  MPI_Comm comm_;
  int rank_, size_, local_rank_;
  bool broken_ = false;
};

MpiWork::~MpiWork() {
  // Abandoned in flight: MPI may still write into the buffer and the other ranks still expect
  // this rank's part, so the communicator can no longer be used or finalised.
  if (!done_) comm_->mark_broken();
}

Status MpiWork::wait() {
  if (done_) return slide::core::ok_status();
  const auto deadline = start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(comm_->timeout_s()));
  const auto spin_until = Clock::now() + std::chrono::milliseconds(20);
  for (;;) {
    int flag = 0;
    if (const int rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
      done_ = true;  // the request is dead either way; the communicator is marked broken below
      return comm_->fail_internal(what_, rc);
    }
    if (flag) break;
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
  complete();
  return slide::core::ok_status();
}

Status MpiWork::progress() {
  if (done_) return slide::core::ok_status();
  int flag = 0;
  if (const int rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
    done_ = true;
    return comm_->fail_internal(what_, rc);
  }
  if (flag) complete();
  return slide::core::ok_status();
}

void MpiWork::complete() {
  done_ = true;
  if (average_ && count_ > 0) {
    const double inv = 1.0 / comm_->world_size();
    if (dtype_ == DType::kF32)
      for (int64_t i = 0; i < count_; ++i) static_cast<float*>(data_)[i] *= static_cast<float>(inv);
    else
      for (int64_t i = 0; i < count_; ++i) static_cast<double*>(data_)[i] *= inv;
  }
}

}  // namespace

Result<std::unique_ptr<Communicator>> make_mpi_communicator(double timeout_s) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    if (const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided); rc != MPI_SUCCESS)
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
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(timeout_s, comm, rank, size, local_rank));
}

}  // namespace slide::train::dist
