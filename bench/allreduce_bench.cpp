// The all-reduce alone, over the ranks mpirun starts: our Communicator (MPI_Iallreduce polled
// against a deadline, and GradientBuckets' 25 MiB buckets) against a blocking MPI_Allreduce of the
// same floats (the peer: what the polling costs). Prints per size: ms per all-reduce (median of
// 10 after a warm-up), the ratio, and the bus bandwidth 2 (p - 1) / p x bytes / time (NCCL's busbw).
//
// usage: mpirun -np 2 allreduce_bench [floats...]   (default: 256, 262144, 11180000 = ResNet-18's
//        gradients, 44.7 MB)
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "slide/train/communicator.h"

namespace {

template <typename F>
double median_ms(F f) {
  std::vector<double> t;
  for (int i = 0; i < 11; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  t.erase(t.begin());  // warm-up
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace slide::train;
  auto made = make_communicator("mpi", 600);
  if (!made.ok()) {
    std::fprintf(stderr, "%s\n", made.status().to_string().c_str());
    return 1;
  }
  Communicator& comm = **made;
  std::vector<long> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atol(argv[i]));
  if (sizes.empty()) sizes = {256, 262144, 11180000};
  const int p = comm.world_size();
  if (comm.rank() == 0)
    std::printf("%d ranks\n%12s %14s %14s %8s %14s\n", p, "floats", "ours ms", "MPI_Allreduce", "ratio", "busbw GB/s");
  for (long n : sizes) {
    std::vector<float> buf(static_cast<size_t>(n), 1.0f);
    bool ok = true;
    const double ours = median_ms([&] {
      // In 25 MiB pieces, all in flight, as GradientBuckets does.
      std::vector<std::unique_ptr<CollectiveWork>> work;
      const long cap = (25l << 20) / 4;
      for (long at = 0; at < n; at += cap) {
        auto w = comm.all_reduce_async(buf.data() + at, std::min(cap, n - at), DType::kF32, ReduceOp::kSum, "bench");
        if (!w.ok()) { ok = false; return; }
        work.push_back(std::move(*w));
      }
      for (auto& w : work) ok = ok && w->wait().ok();
    });
    const double peer = median_ms([&] {
      MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    });
    if (!ok) {
      std::fprintf(stderr, "all-reduce failed\n");
      return 1;
    }
    if (comm.rank() == 0)
      std::printf("%12ld %14.3f %14.3f %7.2fx %14.2f\n", n, ours, peer, peer / ours,
                  2.0 * (p - 1) / p * static_cast<double>(n) * 4 / (ours / 1000) / 1e9);
  }
  return 0;
}
