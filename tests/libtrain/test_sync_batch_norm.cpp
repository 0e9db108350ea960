// Synchronised batch norm (--sync-bn) from the backends' pieces (backend.h: batch_norm_stats ...
// batch_norm_backward_elemt) and the all-reduces between them (dist/sync_batch_norm.cpp):
// - over one rank, the composition is batch_norm_forward_training / batch_norm_backward bit for
//   bit, on the host and on the simulated device (whose tensors host code may not read: the sums
//   go through the staged all-reduce there);
// - two ranks, each with half of a batch, get one rank's statistics and gradients of the whole
//   batch (two threads joined by an in-process communicator; f64, so to 1e-12).
#include <doctest/doctest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../../libtrain/src/dist/sync_batch_norm.h"
#include "slide/train/communicator.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_sync_batch_norm {

using namespace slide::train;
using slide::train::testing::must_make;

namespace {

// `host` (f32 or f64, host memory) on be's device.
Tensor on(Backend& be, const Tensor& host) {
  auto t = to_device(be, host);
  REQUIRE_MESSAGE(t.ok(), t.status().to_string());
  return *t;
}

std::vector<double> values(Backend& be, const Tensor& t) {
  auto h = to_host(be, t);
  REQUIRE_MESSAGE(h.ok(), h.status().to_string());
  std::vector<double> out(static_cast<size_t>(h->numel()));
  for (int64_t i = 0; i < h->numel(); ++i)
    out[static_cast<size_t>(i)] = h->dtype() == DType::kF64 ? h->data<double>()[i] : h->data<float>()[i];
  return out;
}

Tensor random(const Shape& s, DType dt, uint64_t seed, double lo = -1, double hi = 1) {
  Tensor d = testing::random_f64(s, seed, lo, hi);
  if (dt == DType::kF64) return d;
  Tensor f = Tensor::empty(s, DType::kF32, cpu_allocator()).value();
  for (int64_t i = 0; i < d.numel(); ++i) f.data<float>()[i] = static_cast<float>(d.data<double>()[i]);
  return f;
}

// A batch norm layer's tensors on be's device: x [N,C,H,W] (the batch), dy, and [C] parameters,
// running statistics and gradient accumulators (starting non-zero: the ops add to them).
struct Bn {
  Tensor x, dy, gamma, beta, running_mean, running_var, y, save_mean, save_invstd, dx, dgamma, dbeta;
};

Bn make_bn(Backend& be, const Tensor& x, const Tensor& dy, DType dt) {
  const int64_t c = x.dim(1);
  Bn b;
  b.x = on(be, x);
  b.dy = on(be, dy);
  b.gamma = on(be, random({c}, dt, 3, 0.5, 1.5));
  b.beta = on(be, random({c}, dt, 4));
  b.running_mean = on(be, random({c}, dt, 5));
  b.running_var = on(be, random({c}, dt, 6, 0.5, 2));
  b.dgamma = on(be, random({c}, dt, 7));
  b.dbeta = on(be, random({c}, dt, 8));
  Allocator& a = be.allocator();
  b.y = Tensor::empty(x.shape(), dt, a).value();
  b.dx = Tensor::empty(x.shape(), dt, a).value();
  b.save_mean = Tensor::empty({c}, dt, a).value();
  b.save_invstd = Tensor::empty({c}, dt, a).value();
  return b;
}

// Forward then backward through the synchronised path over `comm`.
void run_sync(Communicator& comm, Backend& be, Bn& b) {
  Tensor stats;
  Status s = dist::sync_batch_norm_forward(comm, be, b.x, b.gamma, b.beta, 1e-5, 0.1, b.running_mean, b.running_var,
                                           b.y, b.save_mean, b.save_invstd, &stats);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  s = dist::sync_batch_norm_backward(comm, be, b.x, b.dy, b.gamma, b.save_mean, b.save_invstd, stats, b.dx, b.dgamma,
                                     b.dbeta);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
}

// The same through one rank's ops.
void run_plain(Backend& be, Bn& b) {
  Status s = be.batch_norm_forward_training(b.x, b.gamma, b.beta, 1e-5, 0.1, b.running_mean, b.running_var, b.y,
                                            b.save_mean, b.save_invstd);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  s = be.batch_norm_backward(b.x, b.dy, b.gamma, b.save_mean, b.save_invstd, b.dx, b.dgamma, b.dbeta);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
}

std::vector<std::vector<double>> outputs(Backend& be, const Bn& b) {
  return {values(be, b.y),           values(be, b.save_mean), values(be, b.save_invstd), values(be, b.running_mean),
          values(be, b.running_var), values(be, b.dx),        values(be, b.dgamma),      values(be, b.dbeta)};
}

const char* const kOutputNames[] = {"y", "save_mean", "save_invstd", "running_mean", "running_var", "dx", "dgamma",
                                    "dbeta"};

// Two ranks in one process: all_reduce sums the two threads' buffers (each thread is a rank).
struct PairState {
  std::barrier<> meet{2};
  void* data[2] = {nullptr, nullptr};
};

class PairComm final : public Communicator {
 public:
  PairComm(PairState* s, int rank) : Communicator(10), s_(s), rank_(rank) {}
  std::string name() const override { return "pair"; }
  int rank() const override { return rank_; }
  int world_size() const override { return 2; }
  int local_rank() const override { return rank_; }
  Device device() const override { return Device::kCpu; }
  Status all_reduce(void* data, int64_t count, DType dtype, ReduceOp, const std::string&) override {
    REQUIRE(dtype == DType::kF64);
    s_->data[rank_] = data;
    s_->meet.arrive_and_wait();
    const auto* a = static_cast<const double*>(s_->data[0]);
    const auto* b = static_cast<const double*>(s_->data[1]);
    std::vector<double> sum(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) sum[static_cast<size_t>(i)] = a[i] + b[i];
    s_->meet.arrive_and_wait();  // both have read before either writes
    std::copy(sum.begin(), sum.end(), static_cast<double*>(data));
    return slide::core::ok_status();
  }
  Result<std::unique_ptr<CollectiveWork>> all_reduce_async(void*, int64_t, DType, ReduceOp,
                                                           const std::string&) override {
    return slide::core::unimplemented("pair: all_reduce_async");
  }
  Status broadcast(void*, size_t, int, const std::string&) override { return slide::core::unimplemented("pair"); }
  Status barrier(const std::string&) override { return slide::core::unimplemented("pair"); }
  Status all_gather(double, std::vector<double>*, const std::string&) override {
    return slide::core::unimplemented("pair");
  }
  void abort_job(int) override {}

 private:
  PairState* s_;
  int rank_;
};

// Rows [begin, end) of an NCHW host tensor.
Tensor rows(const Tensor& t, int64_t begin, int64_t end) {
  Shape s = t.shape();
  s[0] = end - begin;
  Tensor out = Tensor::empty(s, t.dtype(), cpu_allocator()).value();
  const int64_t per = t.numel() / t.dim(0) * static_cast<int64_t>(dtype_size(t.dtype()));
  std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + begin * per, static_cast<size_t>((end - begin) * per));
  return out;
}

}  // namespace

TEST_CASE("sync batch norm over one rank is the backend's batch norm, bit for bit (host and simulated device)") {
  auto comm = make_communicator("local", 10).value();
  for (const char* name : {"reference", "reference-sim", "cpu"}) {
    CAPTURE(name);
    auto be = must_make(name);
    const Tensor x = random({3, 4, 5, 6}, DType::kF32, 1, -2, 3), dy = random({3, 4, 5, 6}, DType::kF32, 2);
    Bn a = make_bn(*be, x, dy, DType::kF32), b = make_bn(*be, x, dy, DType::kF32);
    run_sync(*comm, *be, a);
    // cpu's own batch norm is oneDNN's; its pieces are the reference's loops: compared with those.
    Backend& plain_be = std::string(name) == "cpu" ? testing::reference() : *be;
    Bn ref = make_bn(plain_be, x, dy, DType::kF32);
    run_plain(plain_be, ref);
    const auto got = outputs(*be, a), want = outputs(plain_be, ref);
    for (size_t i = 0; i < got.size(); ++i) {
      CAPTURE(kOutputNames[i]);
      CHECK(got[i] == want[i]);
    }
    // ... and b, through the same composition, is not a copy of a: the running statistics and
    // gradient accumulators moved from their initial values.
    CHECK(values(*be, a.running_mean) != values(*be, b.running_mean));
    CHECK(values(*be, a.dgamma) != values(*be, b.dgamma));
  }
}

TEST_CASE("sync batch norm on half-precision activations (f16 / bf16 x, y, dy, dx; f32 statistics) over one rank "
          "is the backend's half batch norm, bit for bit") {
  auto comm = make_communicator("local", 10).value();
  for (const char* name : {"reference", "reference-sim"})
    for (const DType half : {DType::kF16, DType::kBF16}) {
      const std::string half_name = dtype_name(half);
      CAPTURE(name);
      CAPTURE(half_name);
      auto be = must_make(name);
      const Tensor x = testing::host_cast(random({3, 4, 5, 6}, DType::kF32, 1, -2, 3), half),
                   dy = testing::host_cast(random({3, 4, 5, 6}, DType::kF32, 2), half);
      auto half_bn = [&] {
        Bn b = make_bn(*be, x, dy, DType::kF32);  // x and dy as given (half); the [C] tensors f32
        b.y = Tensor::empty(x.shape(), half, be->allocator()).value();
        b.dx = Tensor::empty(x.shape(), half, be->allocator()).value();
        return b;
      };
      Bn a = half_bn(), ref = half_bn();
      run_sync(*comm, *be, a);
      run_plain(*be, ref);
      auto host = [&](const Tensor& t) { return testing::host_values(to_host(*be, t).value()); };
      CHECK(a.y.dtype() == half);
      const Tensor* got[] = {&a.y, &a.save_mean, &a.save_invstd, &a.running_mean, &a.running_var, &a.dx, &a.dgamma, &a.dbeta};
      const Tensor* want[] = {&ref.y, &ref.save_mean, &ref.save_invstd, &ref.running_mean, &ref.running_var, &ref.dx,
                              &ref.dgamma, &ref.dbeta};
      for (size_t i = 0; i < 8; ++i) {
        CAPTURE(kOutputNames[i]);
        CHECK(host(*got[i]) == host(*want[i]));
      }
      // The f32 run of the same values differs only by y's and dx's rounding to the half type.
      Bn f = make_bn(*be, testing::host_cast(x, DType::kF32), testing::host_cast(dy, DType::kF32), DType::kF32);
      run_plain(*be, f);
      CHECK(host(a.save_invstd) == host(f.save_invstd));
      CHECK(host(a.dgamma) == host(f.dgamma));
      CHECK(host(a.y) == testing::host_values(testing::host_cast(to_host(*be, f.y).value(), half)));
    }
}

TEST_CASE("sync batch norm: two ranks with half a batch each get one rank's whole-batch results") {
  // f64 on the simulated device (its sums staged through host copies) and the host.
  for (const char* name : {"reference-sim", "reference"}) {
    CAPTURE(name);
    auto whole_be = must_make(name);
    // 5 samples: 2 on rank 0, 3 on rank 1 (an uneven split, as the trainer's).
    const Tensor x = random({5, 3, 4, 3}, DType::kF64, 11, -1, 2), dy = random({5, 3, 4, 3}, DType::kF64, 12);
    Bn whole = make_bn(*whole_be, x, dy, DType::kF64);
    run_plain(*whole_be, whole);
    const auto want = outputs(*whole_be, whole);

    PairState state;
    std::unique_ptr<Backend> be[2] = {must_make(name), must_make(name)};
    Bn part[2] = {make_bn(*be[0], rows(x, 0, 2), rows(dy, 0, 2), DType::kF64),
                  make_bn(*be[1], rows(x, 2, 5), rows(dy, 2, 5), DType::kF64)};
    std::thread other([&] {
      PairComm c(&state, 1);
      run_sync(c, *be[1], part[1]);
    });
    {
      PairComm c(&state, 0);
      run_sync(c, *be[0], part[0]);
    }
    other.join();
    const auto got0 = outputs(*be[0], part[0]), got1 = outputs(*be[1], part[1]);
    const auto& y_want = want[0];
    const auto& dx_want = want[5];
    // y and dx: rank 0 has the first 2 samples, rank 1 the other 3.
    const size_t split = y_want.size() * 2 / 5;
    for (size_t i = 0; i < y_want.size(); ++i) {
      const double y = i < split ? got0[0][i] : got1[0][i - split];
      const double dx = i < split ? got0[5][i] : got1[5][i - split];
      REQUIRE(std::abs(y - y_want[i]) < 1e-12);
      REQUIRE(std::abs(dx - dx_want[i]) < 1e-12);
    }
    // The statistics are the whole batch's on both ranks.
    for (size_t k : {1, 2, 3, 4}) {
      CAPTURE(kOutputNames[k]);
      for (size_t c = 0; c < want[k].size(); ++c) {
        CHECK(std::abs(got0[k][c] - want[k][c]) < 1e-12);
        CHECK(std::abs(got1[k][c] - want[k][c]) < 1e-12);
      }
    }
    // dgamma, dbeta: each rank adds its own samples' share; the two shares sum to the whole's
    // (the gradient all-reduce adds them; the accumulators started at the same values).
    const auto start_g = values(*whole_be, make_bn(*whole_be, x, dy, DType::kF64).dgamma);
    const auto start_b = values(*whole_be, make_bn(*whole_be, x, dy, DType::kF64).dbeta);
    for (size_t c = 0; c < start_g.size(); ++c) {
      CHECK(std::abs(got0[6][c] + got1[6][c] - start_g[c] - want[6][c]) < 1e-12);
      CHECK(std::abs(got0[7][c] + got1[7][c] - start_b[c] - want[7][c]) < 1e-12);
    }
  }
}

TEST_CASE("sync batch norm pieces refuse bad shapes and dtypes by name") {
  Backend& be = testing::reference();
  const Tensor x = random({2, 3, 2, 2}, DType::kF32, 1);
  Tensor wrong = Tensor::empty({3}, DType::kF64, cpu_allocator()).value();  // C, not C + 1
  Status s = be.batch_norm_stats(x, wrong);
  CHECK(s.code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(s.to_string().find("stats") != std::string::npos);
  Tensor f32 = Tensor::empty({4}, DType::kF32, cpu_allocator()).value();
  s = be.batch_norm_stats(x, f32);
  CHECK(s.code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(s.to_string().find("f64") != std::string::npos);
}

}  // namespace libtrain_test_sync_batch_norm
