// The single-process parts of data parallelism: the batch split, the local communicator, the
// factory's errors and the gradient buckets' layout. The collectives over real ranks are in
// tests/dist/test_mpi.cpp (label mpi); the "socket" communicator's, over forked ranks, are here.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <thread>

#include "slide/train/backend.h"
#include "slide/train/communicator.h"
#include "slide/train/data_parallel.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_communicator {

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
  CHECK(bad.status().message().find("'nccl2' is not one of auto, local, mpi, socket, nccl") != std::string::npos);
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
  Device device() const override { return dev; }
  Result<bool> start_after(const DeviceFence&) override {
    started.push_back("after a fence");
    return orders;
  }
  Status all_reduce(void*, int64_t, DType, ReduceOp, const std::string& what) override {
    started.push_back(what);
    return slide::core::ok_status();
  }
  Result<std::unique_ptr<CollectiveWork>> all_reduce_async(void*, int64_t, DType, ReduceOp,
                                                           const std::string& what) override {
    started.push_back(what);
    struct Done final : CollectiveWork {
      explicit Done(bool says) : says_completed(says) {}
      Status wait() override { return slide::core::ok_status(); }
      bool completed() const override { return says_completed; }
      bool says_completed;
    };
    return std::unique_ptr<CollectiveWork>(std::make_unique<Done>(reports_completed));
  }
  Status broadcast(void*, size_t, int, const std::string&) override { return slide::core::ok_status(); }
  Status barrier(const std::string&) override { return slide::core::ok_status(); }
  Status all_gather(double value, std::vector<double>* out, const std::string&) override {
    *out = {value};
    return slide::core::ok_status();
  }
  void abort_job(int) override {}
  std::vector<std::string> started;
  Device dev = Device::kCpu;  // where its collectives take buffers
  bool orders = false;        // whether start_after orders them (NCCL's does)
  bool reports_completed = true;  // CollectiveWork::completed (false: only wait() knows, as NCCL)
};

// A small CNN's parameters in 8 KiB gradient buckets (several of them).
struct SmallCnnBuckets {
  std::unique_ptr<Sequential> model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 8, 1).value();
  std::vector<Parameter*> params;
  std::unique_ptr<GradientBuckets> buckets;
  size_t n = 0;  // buckets
  RecordingComm comm;
  SmallCnnBuckets() {
    model->collect("", &params, nullptr);
    buckets = GradientBuckets::make(params, cpu_allocator(), 8192).value();
    n = buckets->bucket_count();
    REQUIRE(n > 2);
  }
};

}  // namespace

TEST_CASE("gradient buckets overlapped with backward: each starts, in order, once its gradients are done") {
  SmallCnnBuckets cnn;
  auto& [model, params, buckets, n, comm] = cnn;
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

TEST_CASE("gradient buckets: the step timeline records layers, bucket starts and completions in order") {
  using Kind = AllReduceEvent::Kind;
  SmallCnnBuckets cnn;
  auto& [model, params, buckets, n, comm] = cnn;
  // Not recording: nothing kept.
  REQUIRE(buckets->start_step(comm, false).ok());
  for (auto it = params.rbegin(); it != params.rend(); ++it) REQUIRE(buckets->gradients_ready({*it}).ok());
  REQUIRE(buckets->finish_step().ok());
  CHECK(buckets->timeline().empty());
  buckets->record_timeline(true);
  for (bool reports : {true, false}) {
    CAPTURE(reports);
    comm.reports_completed = reports;
    REQUIRE(buckets->start_step(comm, false).ok());
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      REQUIRE(buckets->gradients_ready({*it}).ok());
      REQUIRE(buckets->gradients_ready({*it}).ok());  // a repeat completes nothing: not recorded
    }
    REQUIRE(buckets->finish_step().ok());
    const auto& ev = buckets->timeline();
    std::vector<std::string> layers;
    std::vector<int64_t> starts, dones;
    size_t wait_at = ev.size(), last_layer = 0;
    for (size_t k = 0; k < ev.size(); ++k) {
      if (k > 0) CHECK(ev[k].t_s >= ev[k - 1].t_s);
      switch (ev[k].kind) {
        case Kind::kLayerDone: layers.push_back(ev[k].name), last_layer = k; break;
        case Kind::kBucketStart: starts.push_back(ev[k].bucket); break;
        case Kind::kBucketDone:
          // After its own start; seen at once when the work says so, else only by finish_step's wait.
          CHECK(std::find(starts.begin(), starts.end(), ev[k].bucket) != starts.end());
          CHECK((reports || k > wait_at));
          dones.push_back(ev[k].bucket);
          break;
        case Kind::kWaitStart: wait_at = k; break;
        case Kind::kStepEnd: CHECK(k + 1 == ev.size()); break;
      }
    }
    // One layer event per parameter, in backward's (reverse) order, named by the parameter.
    REQUIRE(layers.size() == params.size());
    for (size_t k = 0; k < params.size(); ++k) CHECK(layers[k] == params[params.size() - 1 - k]->name);
    CHECK(wait_at > last_layer);
    CHECK(ev.back().kind == Kind::kStepEnd);
    // Every bucket started once, in order, during backward (before finish_step), and completed once.
    REQUIRE(starts.size() == n);
    for (size_t b = 0; b < n; ++b) CHECK(starts[b] == static_cast<int64_t>(b));
    std::sort(dones.begin(), dones.end());
    CHECK(dones == starts);
    for (size_t k = 0; k < ev.size(); ++k)
      if (ev[k].kind == Kind::kBucketStart) CHECK(k < wait_at);
    CHECK(std::string(GradientBuckets::timeline_kind_name(Kind::kBucketDone)) == "bucket_done");
  }
}

TEST_CASE("gradient buckets on a device: each bucket's all-reduce is ordered after a fence of backward's work") {
  // The simulated device gives fences as the cuda backend does (an event on its stream); a
  // communicator of that device that can order after them (NCCL) gets one before every bucket,
  // so the host never waits for backward (it used to synchronise the device per bucket).
  auto be = make_backend("reference-sim").value();
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 8, 1).value();
  REQUIRE(move_to_device(*be, *model).ok());
  std::vector<Parameter*> params;
  model->collect("", &params, nullptr);
  auto buckets = GradientBuckets::make(params, be->allocator(), 8192, be.get()).value();
  const size_t n = buckets->bucket_count();
  REQUIRE(n > 2);
  RecordingComm comm;
  comm.dev = Device::kSim;
  for (bool orders : {true, false}) {
    comm.orders = orders;
    comm.started.clear();
    REQUIRE(buckets->start_step(comm, false).ok());
    for (auto it = params.rbegin(); it != params.rend(); ++it) REQUIRE(buckets->gradients_ready({*it}).ok());
    auto stop = buckets->finish_step();
    REQUIRE_MESSAGE(stop.ok(), stop.status().to_string());
    CHECK_FALSE(*stop);
    // fence, bucket 1, fence, bucket 2, ...: every collective behind a fence made just before it
    // (a communicator that cannot order after it says so, and the device is synchronised instead).
    REQUIRE(comm.started.size() == 2 * n);
    for (size_t b = 0; b < n; ++b) {
      CHECK(comm.started[2 * b] == "after a fence");
      CHECK(comm.started[2 * b + 1].find("gradient bucket " + std::to_string(b + 1) + " of ") != std::string::npos);
    }
  }
}

namespace {

// Ranks 1 .. P-1 forked, rank 0 this process, joined as slide-train --gpus joins them. Each
// child runs `child(rank, fd)` and exits with its return value; returns the children's pids and
// rank 0's sockets.
struct Forked {
  std::vector<pid_t> pids;
  std::vector<int> fds0;
};
Forked fork_ranks(int world, const std::function<int(int, int)>& child) {
  Forked f;
  std::vector<int> ends1;
  for (int r = 1; r < world; ++r) {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    f.fds0.push_back(sv[0]), ends1.push_back(sv[1]);
  }
  for (int r = 1; r < world; ++r) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      for (int fd : f.fds0) ::close(fd);
      for (size_t k = 0; k < ends1.size(); ++k)
        if (static_cast<int>(k) != r - 1) ::close(ends1[k]);
      ::_exit(child(r, ends1[static_cast<size_t>(r - 1)]));
    }
    f.pids.push_back(pid);
  }
  for (int fd : ends1) ::close(fd);
  return f;
}

// The children's exit codes, in rank order.
std::vector<int> reap(const Forked& f) {
  std::vector<int> codes;
  for (pid_t pid : f.pids) {
    int st = 0;
    ::waitpid(pid, &st, 0);
    codes.push_back(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
  }
  return codes;
}

// What rank r contributes: distinct, non-integer values, so the summation order shows in the bits.
float value_f(int r, int64_t i) { return 0.1f * static_cast<float>(r + 1) + 1e-3f * static_cast<float>(i % 977); }

// The collectives every rank runs; 0 when every result is what it must be.
int collectives(Communicator& c, int world) {
  const int r = c.rank();
  // An all-reduce of 3M floats (12 MB: many partial reads and writes) sums in rank order.
  const int64_t n = 3 << 20;
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = value_f(r, i);
  if (!c.all_reduce(x.data(), n, DType::kF32, ReduceOp::kSum, "f32 sum").ok()) return 10;
  for (int64_t i = 0; i < n; ++i) {
    float want = value_f(0, i);
    for (int q = 1; q < world; ++q) want += value_f(q, i);
    if (std::memcmp(&want, &x[static_cast<size_t>(i)], sizeof want) != 0) return 11;
  }
  double m[2] = {1.0 + r, -2.0 * r};
  if (!c.all_reduce(m, 2, DType::kF64, ReduceOp::kAverage, "f64 mean").ok()) return 12;
  double s0 = 0, s1 = 0;
  for (int q = 0; q < world; ++q) s0 += 1.0 + q, s1 += -2.0 * q;
  if (m[0] != s0 * (1.0 / world) || m[1] != s1 * (1.0 / world)) return 13;
  int32_t k = r + 1;
  if (!c.all_reduce(&k, 1, DType::kI32, ReduceOp::kSum, "i32 sum").ok() || k != world * (world + 1) / 2) return 14;
  // A broadcast from the last rank (through rank 0), and an empty one.
  std::vector<char> b(1000, static_cast<char>(r));
  if (!c.broadcast(b.data(), b.size(), world - 1, "broadcast").ok()) return 15;
  for (char v : b)
    if (v != static_cast<char>(world - 1)) return 16;
  if (!c.broadcast(nullptr, 0, 0, "empty broadcast").ok()) return 17;
  std::vector<double> all;
  if (!c.all_gather(0.5 * r, &all, "all-gather").ok() || all.size() != static_cast<size_t>(world)) return 18;
  for (int q = 0; q < world; ++q)
    if (all[static_cast<size_t>(q)] != 0.5 * q) return 19;
  if (!c.barrier("barrier").ok()) return 20;
  // The async form completes as the blocking one does.
  float y = 1.0f;
  auto w = c.all_reduce_async(&y, 1, DType::kF32, ReduceOp::kAverage, "async");
  if (!w.ok() || !(*w)->wait().ok() || y != 1.0f) return 21;
  // Every forked rank runs on this host.
  auto here = ranks_on_this_host(c);
  if (!here.ok() || *here != world) return 22;
  return 0;
}

}  // namespace

TEST_CASE("socket communicator: 3 forked ranks; sums in rank order, broadcast, gather, barrier, bit-identical results") {
  const int world = 3;
  Forked f = fork_ranks(world, [&](int r, int fd) {
    auto c = make_socket_communicator(r, world, {fd}, 60);
    if (!c.ok()) return 2;
    if ((*c)->rank() != r || (*c)->world_size() != world || (*c)->name() != "socket") return 3;
    return collectives(**c, world);
  });
  // Rank 0 finds its rank and sockets in the environment, as a rank started by --gpus does.
  std::string fds = std::to_string(f.fds0[0]) + "," + std::to_string(f.fds0[1]);
  setenv(kLaunchWorldSizeEnv, "3", 1), setenv(kLaunchRankEnv, "0", 1), setenv(kLaunchFdsEnv, fds.c_str(), 1);
  CHECK(launch_world_size() == 3);
  auto c = make_communicator("auto", 60);
  unsetenv(kLaunchWorldSizeEnv), unsetenv(kLaunchRankEnv), unsetenv(kLaunchFdsEnv);
  REQUIRE(c.ok());
  CHECK((*c)->name() == "socket");
  CHECK((*c)->rank() == 0);
  CHECK(collectives(**c, world) == 0);
  CHECK(reap(f) == std::vector<int>{0, 0});
}

TEST_CASE("socket communicator: lost_peer names a rank whose connection closed, without blocking") {
  int release[2];
  REQUIRE(::pipe(release) == 0);
  // Rank 1 waits for the word to exit; rank 2 exits at once.
  Forked f = fork_ranks(3, [&](int r, int) {
    if (r == 2) return 0;
    char c;
    return ::read(release[0], &c, 1) == 1 ? 0 : 9;
  });
  auto c = make_socket_communicator(0, 3, f.fds0, 60);
  REQUIRE(c.ok());
  int lost = -1;
  for (int i = 0; i < 500 && lost < 0; ++i) {  // rank 2's exit closes its socket (within 5 s)
    lost = (*c)->lost_peer();
    if (lost < 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(lost == 2);
  REQUIRE(::write(release[1], "x", 1) == 1);
  CHECK(reap(f) == std::vector<int>{0, 0});
  CHECK((*c)->lost_peer() >= 1);  // both gone now
  ::close(release[0]), ::close(release[1]);
  // One rank: nobody to lose.
  auto local = make_communicator("local", 10);
  REQUIRE(local.ok());
  CHECK((*local)->lost_peer() == -1);
  CHECK(*ranks_on_this_host(**local) == 1);
}

TEST_CASE("socket communicator: a dead peer fails the collective at once, naming it; later calls are refused") {
  Forked f = fork_ranks(2, [](int, int) { return 3; });  // exits without a collective
  auto c = make_socket_communicator(0, 2, f.fds0, 60);
  REQUIRE(c.ok());
  (*c)->set_step(7);
  const auto t0 = std::chrono::steady_clock::now();
  float x = 1;
  const Status s = (*c)->all_reduce(&x, 1, DType::kF32, ReduceOp::kSum, "gradient bucket 1 of 1");
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  CHECK(s.code() == slide::core::StatusCode::kUnavailable);
  CHECK(s.message().find("rank 0 of 2 at step 7: gradient bucket 1 of 1: rank 1 closed its connection") !=
        std::string::npos);
  CHECK((*c)->barrier("next").code() == slide::core::StatusCode::kFailedPrecondition);
  CHECK(reap(f) == std::vector<int>{3});
}

TEST_CASE("socket communicator: a stopped peer gives kDeadlineExceeded at the deadline; other collectives are named") {
  int release[2];
  REQUIRE(::pipe(release) == 0);
  // Rank 1 waits (alive, silent) until the parent writes to the pipe, then sends a barrier.
  Forked f = fork_ranks(2, [&](int, int fd) {
    char b;
    ::close(release[1]);
    (void)!::read(release[0], &b, 1);
    auto c = make_socket_communicator(1, 2, {fd}, 5);
    if (!c.ok()) return 2;
    (void)(*c)->barrier("barrier");
    return 0;
  });
  ::close(release[0]);
  {
    auto c = make_socket_communicator(0, 2, {f.fds0[0]}, 0.3);
    REQUIRE(c.ok());
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = (*c)->barrier("barrier before validation");
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(s.code() == slide::core::StatusCode::kDeadlineExceeded);
    CHECK(s.message().find("did not complete within 0 s (--dist-timeout) waiting for rank 1") != std::string::npos);
    CHECK(waited >= 0.29);
    CHECK(waited < 3);
  }
  (void)!::write(release[1], "x", 1);
  ::close(release[1]);
  CHECK(reap(f) == std::vector<int>{0});

  // Ranks in different collectives: rank 1 enters a barrier while rank 0 is in an all-reduce.
  Forked g = fork_ranks(2, [](int, int fd) {
    auto c = make_socket_communicator(1, 2, {fd}, 5);
    if (!c.ok()) return 2;
    (void)(*c)->barrier("barrier");
    return 0;
  });
  auto c = make_socket_communicator(0, 2, g.fds0, 5);
  REQUIRE(c.ok());
  float x = 0;
  const Status s = (*c)->all_reduce(&x, 1, DType::kF32, ReduceOp::kSum, "loss");
  CHECK(s.code() == slide::core::StatusCode::kInternal);
  CHECK(s.message().find("rank 1 sent a barrier of 0 bytes (collective #1) where an all-reduce of 4 bytes "
                         "(collective #1) was expected") != std::string::npos);
  c->reset();
  CHECK(reap(g) == std::vector<int>{0});

  // Bytes that are not a message at all (another program on the socket): named, never read as
  // data or as a length.
  Forked h = fork_ranks(2, [](int, int fd) {
    const char junk[24] = "GET / HTTP/1.1\r\n\r\n";
    return ::write(fd, junk, sizeof junk) == static_cast<ssize_t>(sizeof junk) ? 0 : 2;
  });
  auto k = make_socket_communicator(0, 2, h.fds0, 5);
  REQUIRE(k.ok());
  float y = 0;
  const Status junk = (*k)->all_reduce(&y, 1, DType::kF32, ReduceOp::kSum, "loss");
  CHECK(junk.code() == slide::core::StatusCode::kInternal);
  CHECK(junk.message().find("rank 1 sent bytes that are not a slidestream message") != std::string::npos);
  CHECK(y == 0.0f);
  k->reset();
  CHECK(reap(h) == std::vector<int>{0});
}

TEST_CASE("launched_rank: the variables slide-train --gpus sets, and malformed ones named") {
  unsetenv(kLaunchWorldSizeEnv), unsetenv(kLaunchRankEnv), unsetenv(kLaunchFdsEnv);
  auto none = launched_rank();
  REQUIRE(none.ok());
  CHECK(none->world_size == 0);
  CHECK(make_communicator("socket", 5).status().message().find("--dist socket is for the ranks") != std::string::npos);
  setenv(kLaunchWorldSizeEnv, "4", 1), setenv(kLaunchRankEnv, "0", 1), setenv(kLaunchFdsEnv, "7,8,9", 1);
  auto r0 = launched_rank();
  REQUIRE(r0.ok());
  CHECK(r0->rank == 0);
  CHECK(r0->world_size == 4);
  CHECK(r0->fds == std::vector<int>{7, 8, 9});
  setenv(kLaunchRankEnv, "2", 1), setenv(kLaunchFdsEnv, "11", 1);
  auto r2 = launched_rank();
  REQUIRE(r2.ok());
  CHECK(r2->rank == 2);
  CHECK(r2->fds == std::vector<int>{11});
  setenv(kLaunchRankEnv, "4", 1);
  CHECK(launched_rank().status().message().find("SLIDE_LAUNCH_RANK='4': not a rank of 4") != std::string::npos);
  setenv(kLaunchRankEnv, "1", 1), setenv(kLaunchFdsEnv, "3,x", 1);
  CHECK(launched_rank().status().message().find("SLIDE_LAUNCH_FDS='3,x': not a list of descriptors") !=
        std::string::npos);
  setenv(kLaunchFdsEnv, "3,4", 1);
  CHECK(launched_rank().status().message().find("rank 1 needs 1 socket(s)") != std::string::npos);
  setenv(kLaunchWorldSizeEnv, "0", 1);
  CHECK(launched_rank().status().code() == slide::core::StatusCode::kInvalidArgument);
  unsetenv(kLaunchWorldSizeEnv), unsetenv(kLaunchRankEnv), unsetenv(kLaunchFdsEnv);
  CHECK(make_socket_communicator(0, 3, {5}, 5).status().message().find("needs 2 socket(s), not 1") != std::string::npos);
}

}  // namespace libtrain_test_communicator
