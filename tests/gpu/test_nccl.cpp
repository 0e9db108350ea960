// gpu-labelled: the "nccl" communicator on this node's devices, one rank per device (run directly
// for one rank, or under mpirun -np N). Exits 77 (ctest's skip code) without a device.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <memory>
#include <vector>

#include "../../libtrain/src/dist/sync_batch_norm.h"
#include "../libtrain/test_util.h"
#include "slide/train/backend.h"
#include "slide/train/communicator.h"
#include "slide/train/data_parallel.h"

using namespace slide::train;

namespace {
std::unique_ptr<Communicator> g_comm;
}

TEST_CASE("nccl: all-reduce of a device buffer, in place, sum and average") {
  Communicator& comm = *g_comm;
  CHECK(comm.name() == "nccl");
  CHECK(comm.device() == Device::kCuda);
  const int p = comm.world_size(), r = comm.rank();
  std::vector<float> host(1 << 20);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(r + 1) * static_cast<float>(i % 13);
  float* dev = nullptr;
  REQUIRE(cudaMalloc(&dev, host.size() * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMemcpy(dev, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(comm.all_reduce(dev, static_cast<int64_t>(host.size()), DType::kF32, ReduceOp::kSum, "sum").ok());
  std::vector<float> got(host.size());
  REQUIRE(cudaMemcpy(got.data(), dev, got.size() * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  for (size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == static_cast<float>(p * (p + 1) / 2 * (i % 13)));
  // The average of each rank's own values (dev holds the sum now: reload them), (r + 1) * 3 at
  // element 3: 3 (P + 1) / 2 over P ranks.
  REQUIRE(cudaMemcpy(dev, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(comm.all_reduce(dev, static_cast<int64_t>(host.size()), DType::kF32, ReduceOp::kAverage, "avg").ok());
  REQUIRE(cudaMemcpy(got.data(), dev, 4 * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(got[3] == doctest::Approx(3.0 * (p + 1) / 2));
  cudaFree(dev);
}

TEST_CASE("nccl: host buffers go through staging: gradient buckets, strings, all-gather") {
  Communicator& comm = *g_comm;
  const int p = comm.world_size(), r = comm.rank();
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 8, 1).value();
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  model->collect("", &params, &buffers);
  for (Parameter* q : params)
    for (int64_t k = 0; k < q->grad.numel(); ++k) q->grad.data<float>()[k] = static_cast<float>(r + 1);
  auto buckets = GradientBuckets::make(params, cpu_allocator(), 4096).value();
  auto stop = buckets->all_reduce(comm, r == 0);
  REQUIRE(stop.ok());
  CHECK(*stop);
  for (Parameter* q : params) REQUIRE(q->grad.data<float>()[0] == static_cast<float>(p * (p + 1) / 2));
  std::string text = r == 0 ? "from rank 0" : "";
  REQUIRE(broadcast_string(comm, &text, 0, "text").ok());
  CHECK(text == "from rank 0");
  std::vector<double> all;
  REQUIRE(comm.all_gather(0.5 + r, &all, "gather").ok());
  REQUIRE(all.size() == static_cast<size_t>(p));
  for (int k = 0; k < p; ++k) CHECK(all[static_cast<size_t>(k)] == 0.5 + k);
  REQUIRE(comm.barrier("barrier").ok());
}

TEST_CASE("nccl: synchronised batch norm on cuda tensors, the sums all-reduced in place on the device") {
  // Every rank holds 2 + rank samples of a batch that every rank can rebuild; the reference
  // backend normalises the whole batch in f64 on the host, and each rank's slice of y and dx,
  // and the statistics, must match it (f32 storage on the GPU: 1e-5 as the op tests).
  Communicator& comm = *g_comm;
  const int p = comm.world_size(), r = comm.rank();
  const int64_t C = 13, H = 5, W = 7, per = C * H * W;
  int64_t total = 0, first = 0;
  for (int k = 0; k < p; ++k) {
    if (k == r) first = total;
    total += 2 + k;
  }
  const int64_t n = 2 + r;
  using testing::make_pair;
  testing::Pair x = make_pair({total, C, H, W}, 21, -2, 3), dy = make_pair({total, C, H, W}, 22);
  testing::Pair g = make_pair({C}, 23, 0.5, 1.5), bt = make_pair({C}, 24), rm = make_pair({C}, 25),
                rv = make_pair({C}, 26, 0.5, 2), y = make_pair({total, C, H, W}), sm = make_pair({C}),
                si = make_pair({C}), dx = make_pair({total, C, H, W}), dg = make_pair({C}, 0, 0, 0, 1.0),
                db = make_pair({C}, 0, 0, 0, 1.0);
  Backend& ref = testing::reference();
  REQUIRE(ref.batch_norm_forward_training(x.d, g.d, bt.d, 1e-5, 0.1, rm.d, rv.d, y.d, sm.d, si.d).ok());
  REQUIRE(ref.batch_norm_backward(x.d, dy.d, g.d, sm.d, si.d, dx.d, dg.d, db.d).ok());

  auto made = make_backend("cuda");
  REQUIRE_MESSAGE(made.ok(), made.status().to_string());
  Backend& gpu = **made;
  // This rank's rows of an f32 host tensor, on the device.
  auto mine = [&](const Tensor& host, bool rows) {
    const Shape s = rows ? Shape{n, C, H, W} : host.shape();
    Tensor h = Tensor::empty(s, DType::kF32, cpu_allocator()).value();
    std::memcpy(h.data<float>(), host.data<float>() + (rows ? first * per : 0), static_cast<size_t>(h.numel()) * 4);
    return to_device(gpu, h).value();
  };
  // Fresh start values for the stateful tensors (the reference's were updated in place).
  testing::Pair rm0 = make_pair({C}, 25), rv0 = make_pair({C}, 26, 0.5, 2), one = make_pair({C}, 0, 0, 0, 1.0);
  Tensor X = mine(x.f, true), DY = mine(dy.f, true), G = mine(g.f, false), BT = mine(bt.f, false),
         RM = mine(rm0.f, false), RV = mine(rv0.f, false), DG = mine(one.f, false), DB = mine(one.f, false);
  Tensor Y = Tensor::empty(X.shape(), DType::kF32, gpu.allocator()).value(),
         DX = Tensor::empty(X.shape(), DType::kF32, gpu.allocator()).value(),
         SM = Tensor::empty({C}, DType::kF32, gpu.allocator()).value(),
         SI = Tensor::empty({C}, DType::kF32, gpu.allocator()).value(), stats;
  Status s = dist::sync_batch_norm_forward(comm, gpu, X, G, BT, 1e-5, 0.1, RM, RV, Y, SM, SI, &stats);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  s = dist::sync_batch_norm_backward(comm, gpu, X, DY, G, SM, SI, stats, DX, DG, DB);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  // Compare with the reference's: this rank's rows of y and dx, all of the statistics; dgamma
  // and dbeta hold this rank's share (1 + own sums): all-reduced (minus the p starting ones)
  // they are the whole batch's.
  auto host_of = [&](const Tensor& t) { return to_host(gpu, t).value(); };
  auto rows_of = [&](const testing::Pair& whole) {
    testing::Pair part = make_pair({n, C, H, W});
    std::memcpy(part.d.data<double>(), whole.d.data<double>() + first * per, static_cast<size_t>(n * per) * 8);
    return part;
  };
  testing::Pair ym = rows_of(y), dxm = rows_of(dx);
  std::memcpy(ym.f.data<float>(), host_of(Y).data<float>(), static_cast<size_t>(n * per) * 4);
  std::memcpy(dxm.f.data<float>(), host_of(DX).data<float>(), static_cast<size_t>(n * per) * 4);
  testing::compare("sync bn y", ym, 1e-5);
  testing::compare("sync bn dx", dxm, 1e-5);
  for (auto [dev, want, what] : {std::tuple{&SM, &sm, "save mean"}, {&SI, &si, "save invstd"},
                                 {&RM, &rm, "running mean"}, {&RV, &rv, "running var"}}) {
    const Tensor h = host_of(*dev);
    std::memcpy(want->f.data<float>(), h.data<float>(), static_cast<size_t>(C) * 4);
    testing::compare(std::string("sync bn ") + what, *want, 1e-5);
  }
  for (auto [dev, want, what] : {std::tuple{&DG, &dg, "dgamma"}, {&DB, &db, "dbeta"}}) {
    Tensor h = host_of(*dev);
    REQUIRE(comm.all_reduce(h.data<float>(), C, DType::kF32, ReduceOp::kSum, what).ok());
    for (int64_t k = 0; k < C; ++k) want->f.data<float>()[k] = h.data<float>()[k] - static_cast<float>(p - 1);
    testing::compare(std::string("sync bn ") + what, *want, 1e-5);
  }
}

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipping the nccl tests\n");
    return 77;
  }
  auto c = make_communicator("nccl", 60);
  if (!c.ok()) {
    std::fprintf(stderr, "%s\n", c.status().to_string().c_str());
    return 1;
  }
  g_comm = std::move(*c);
  doctest::Context ctx(argc, argv);
  const int rc = ctx.run();
  g_comm.reset();
  return rc;
}
