// The single-process parts of data parallelism: the batch split, the local communicator, the
// factory's errors and the gradient buckets' layout. The collectives over real ranks are in
// tests/dist/test_mpi.cpp (label mpi).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "slide/train/communicator.h"
#include "slide/train/data_parallel.h"

using namespace slide::train;

TEST_CASE("shard_range: ranks tile the batch in order, sizes differ by at most one") {
  for (size_t n : {0, 1, 2, 5, 7, 32, 33, 101})
    for (int p : {1, 2, 3, 4, 8}) {
      size_t next = 0, smallest = n, largest = 0;
      for (int r = 0; r < p; ++r) {
        const ShardRange s = shard_range(n, r, p);
        REQUIRE(s.begin == next);
        REQUIRE(s.end >= s.begin);
        smallest = std::min(smallest, s.end - s.begin), largest = std::max(largest, s.end - s.begin);
        next = s.end;
      }
      CHECK(next == n);
      CHECK(largest - smallest <= 1);
    }
  // B = 5 over 2 ranks: 2 + 3, the split --accumulate 2 makes on one rank.
  CHECK(shard_range(5, 0, 2).end == 2);
  CHECK(shard_range(1, 0, 2).end == 0);  // rank 0 has nothing; rank 1 the sample
}

TEST_CASE("local communicator: one rank, collectives leave the data, bad arguments are named") {
  unsetenv("OMPI_COMM_WORLD_SIZE"), unsetenv("PMIX_SIZE"), unsetenv("PMI_SIZE"), unsetenv("SLURM_STEP_NUM_TASKS");
  CHECK(launch_world_size() == 1);
  auto c = make_communicator("auto", 10);
  REQUIRE(c.ok());
  Communicator& comm = **c;
  CHECK(comm.name() == "local");
  CHECK(comm.world_size() == 1);
  float x[3] = {1, 2, 3};
  REQUIRE(comm.all_reduce(x, 3, DType::kF32, ReduceOp::kAverage, "x").ok());
  CHECK(x[2] == 3.0f);
  std::vector<double> all;
  REQUIRE(comm.all_gather(2.5, &all, "g").ok());
  CHECK(all == std::vector<double>{2.5});
  CHECK(comm.broadcast(x, sizeof x, 1, "b").code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(comm.all_reduce(x, 1, DType::kI32, ReduceOp::kAverage, "i").code() == slide::core::StatusCode::kInvalidArgument);
  auto bad = make_communicator("nccl2", 10);
  CHECK(bad.status().code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(bad.status().message().find("'nccl2' is not one of auto, local, mpi, nccl") != std::string::npos);
  CHECK(make_communicator("local", 0).status().code() == slide::core::StatusCode::kInvalidArgument);
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  CHECK(launch_world_size() == 4);
  setenv("OMPI_COMM_WORLD_SIZE", "four", 1);
  CHECK(launch_world_size() == 1);
  unsetenv("OMPI_COMM_WORLD_SIZE");
}

TEST_CASE("gradient buckets: reverse parameter order, capped size, the stop flag, gradients kept on one rank") {
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 8, 1).value();
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  model->collect("", &params, &buffers);
  int64_t total = 0, largest = 0;
  for (Parameter* p : params) {
    for (int64_t k = 0; k < p->grad.numel(); ++k) p->grad.data<float>()[k] = static_cast<float>(k % 5);
    total += p->grad.numel(), largest = std::max(largest, p->grad.numel());
  }
  auto one = GradientBuckets::make(params, cpu_allocator()).value();
  CHECK(one->bucket_count() == 1);  // the small CNN is far below 25 MiB
  CHECK(one->elements() == total + 1);
  auto many = GradientBuckets::make(params, cpu_allocator(), 8192).value();
  CHECK(many->bucket_count() > 2);
  CHECK(many->bucket_count() < params.size() + 1);
  auto comm = make_communicator("local", 10).value();
  auto stop = many->all_reduce(*comm, true);
  REQUIRE(stop.ok());
  CHECK(*stop);
  CHECK_FALSE(*many->all_reduce(*comm, false));
  for (Parameter* p : params)
    for (int64_t k = 0; k < p->grad.numel(); ++k) REQUIRE(p->grad.data<float>()[k] == static_cast<float>(k % 5));
  // The gradients now live in the last buffer made: views of one allocation, backward-order
  // adjacent (no copies in or out of the all-reduce).
  for (Parameter* p : params) CHECK(p->grad.shares_storage(params.front()->grad));
  const Parameter* last = params.back();
  const Parameter* before_last = params[params.size() - 2];
  CHECK(before_last->grad.data<float>() == last->grad.data<float>() + last->grad.numel());
  // A gradient replaced behind the buckets' back is refused, not silently left out of the sum.
  Tensor saved = params.front()->grad;
  params.front()->grad = *saved.clone();
  auto refused = many->all_reduce(*comm, false);
  CHECK(refused.status().code() == slide::core::StatusCode::kFailedPrecondition);
  params.front()->grad = saved;
  CHECK(GradientBuckets::make(params, cpu_allocator(), 2).status().code() == slide::core::StatusCode::kInvalidArgument);
}

namespace {

// Records the collectives started, in order; they complete at once (one rank).
class RecordingComm final : public Communicator {
 public:
  RecordingComm() : Communicator(10) {}
  std::string name() const override { return "recording"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  int local_rank() const override { return 0; }
  Device device() const override { return Device::kCpu; }
  Status all_reduce(void*, int64_t, DType, ReduceOp, const std::string& what) override {
    started.push_back(what);
    return slide::core::ok_status();
  }
  Result<std::unique_ptr<CollectiveWork>> all_reduce_async(void*, int64_t, DType, ReduceOp,
                                                           const std::string& what) override {
    started.push_back(what);
    struct Done final : CollectiveWork {
      Status wait() override { return slide::core::ok_status(); }
    };
    return std::unique_ptr<CollectiveWork>(std::make_unique<Done>());
  }
  Status broadcast(void*, size_t, int, const std::string&) override { return slide::core::ok_status(); }
  Status barrier(const std::string&) override { return slide::core::ok_status(); }
  Status all_gather(double value, std::vector<double>* out, const std::string&) override {
    *out = {value};
    return slide::core::ok_status();
  }
  void abort_job(int) override {}
  std::vector<std::string> started;
};

}  // namespace

TEST_CASE("gradient buckets overlapped with backward: each starts, in order, once its gradients are done") {
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 8, 1).value();
  std::vector<Parameter*> params;
  model->collect("", &params, nullptr);
  auto buckets = GradientBuckets::make(params, cpu_allocator(), 8192).value();
  const size_t n = buckets->bucket_count();
  REQUIRE(n > 2);
  RecordingComm comm;
  REQUIRE(buckets->start_step(comm, false).ok());
  CHECK(buckets->start_step(comm, false).code() == slide::core::StatusCode::kFailedPrecondition);
  CHECK_FALSE(buckets->started_any());
  // Backward finishes the parameters in reverse order, the buckets' order: after the last
  // parameter's gradient the first bucket may start; by the first parameter's, all but none
  // are left for finish_step.
  std::vector<size_t> started_after;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    REQUIRE(buckets->gradients_ready({*it, *it}).ok());  // a repeat counts once
    started_after.push_back(comm.started.size());
  }
  CHECK(std::is_sorted(started_after.begin(), started_after.end()));
  CHECK(started_after.front() <= 1);
  CHECK(started_after.back() == n);  // every bucket started during "backward"
  CHECK(buckets->started_any());
  auto stop = buckets->finish_step();
  REQUIRE(stop.ok());
  CHECK_FALSE(*stop);
  REQUIRE(comm.started.size() == n);
  for (size_t b = 0; b < n; ++b)
    CHECK(comm.started[b].find("gradient bucket " + std::to_string(b + 1) + " of " + std::to_string(n)) !=
          std::string::npos);
  // Half the parameters done: only the buckets they complete have started; finish_step starts the
  // rest (a rank without samples, or a layer no container reports).
  comm.started.clear();
  REQUIRE(buckets->start_step(comm, true).ok());
  REQUIRE(buckets->gradients_ready({params.back()}).ok());
  const size_t early = comm.started.size();
  CHECK(early <= 1);
  auto stop2 = buckets->finish_step();
  REQUIRE(stop2.ok());
  CHECK(*stop2);
  CHECK(comm.started.size() == n);
  CHECK(buckets->finish_step().status().code() == slide::core::StatusCode::kFailedPrecondition);
  // A step that started nothing can be disarmed and started again (out-of-memory rerun).
  REQUIRE(buckets->start_step(comm, false).ok());
  buckets->cancel_step();
  REQUIRE(buckets->start_step(comm, false).ok());
  REQUIRE(buckets->finish_step().ok());
}
