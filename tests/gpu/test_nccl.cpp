// gpu-labelled: the "nccl" communicator on this node's devices, one rank per device (run directly
// for one rank, or under mpirun -np N). Exits 77 (ctest's skip code) without a device.
#define DOCTEST_CONFIG_IMPLEMENT
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cstdio>
#include <memory>
#include <vector>

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
