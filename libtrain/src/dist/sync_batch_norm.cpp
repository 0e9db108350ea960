// The backend computes, the communicator adds: three all-reduces of per-channel f64 sums per layer
// and step (C + 1, C and 2C values), whose latency, not their size, is the cost.
#include "dist/sync_batch_norm.h"

#include <string>
#include <utility>

namespace slide::train::dist {

namespace {

// A new f64 [n] on be's device.
Result<Tensor> sums_tensor(Backend& be, int64_t n, const char* what) {
  return Tensor::empty({n}, DType::kF64, be.allocator(), what);
}

// `sums` (f64, on be's device) summed over the ranks, in place.
Status all_reduce_sums(Communicator& comm, Backend& be, Tensor& sums, const std::string& what) {
  const Device d = sums.device();
  if (d == Device::kCpu) return comm.all_reduce(sums.data<double>(), sums.numel(), DType::kF64, ReduceOp::kSum, what);
  if (comm.device() == d) {
    // Device buffers (NCCL on cuda): the communicator's stream waits for the backend's work on
    // the device, or the host waits for it. all_reduce returns once the collective is complete,
    // so the ops queued after it read the sums.
    SLIDE_ASSIGN_OR_RETURN(const auto fence, be.fence());
    bool ordered = false;
    if (fence) {
      SLIDE_ASSIGN_OR_RETURN(ordered, comm.start_after(*fence));
    }
    if (!ordered) SLIDE_RETURN_IF_ERROR(be.synchronize());
    return comm.all_reduce(sums.ptr<double>(), sums.numel(), DType::kF64, ReduceOp::kSum, what);
  }
  // A host communicator (MPI, sockets) and device sums: through a host copy.
  SLIDE_ASSIGN_OR_RETURN(Tensor host, to_host(be, sums, what));
  SLIDE_RETURN_IF_ERROR(comm.all_reduce(host.data<double>(), host.numel(), DType::kF64, ReduceOp::kSum, what));
  return be.upload(host, sums);
}

}  // namespace

Status sync_batch_norm_forward(Communicator& comm, Backend& be, const Tensor& x, const Tensor& gamma,
                               const Tensor& beta, double eps, double momentum, Tensor& running_mean,
                               Tensor& running_var, Tensor& y, Tensor& save_mean, Tensor& save_invstd,
                               Tensor* stats) {
  if (x.rank() != 4)
    return slide::core::invalid_argument("sync batch norm: x must be [N,C,H,W], is " + shape_string(x.shape()));
  const int64_t c = x.dim(1);
  SLIDE_ASSIGN_OR_RETURN(Tensor st, sums_tensor(be, c + 1, "sync batch norm sums"));
  SLIDE_RETURN_IF_ERROR(be.batch_norm_stats(x, st));
  SLIDE_RETURN_IF_ERROR(all_reduce_sums(comm, be, st, "sync batch norm sums"));
  SLIDE_ASSIGN_OR_RETURN(Tensor devs, sums_tensor(be, c, "sync batch norm deviations"));
  SLIDE_RETURN_IF_ERROR(be.batch_norm_deviations(x, st, devs));
  SLIDE_RETURN_IF_ERROR(all_reduce_sums(comm, be, devs, "sync batch norm variances"));
  SLIDE_RETURN_IF_ERROR(be.batch_norm_forward_from_stats(x, gamma, beta, st, devs, eps, momentum, running_mean,
                                                         running_var, y, save_mean, save_invstd));
  *stats = std::move(st);
  return slide::core::ok_status();
}

Status sync_batch_norm_backward(Communicator& comm, Backend& be, const Tensor& x, const Tensor& dy,
                                const Tensor& gamma, const Tensor& save_mean, const Tensor& save_invstd,
                                const Tensor& stats, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  if (x.rank() != 4)
    return slide::core::invalid_argument("sync batch norm: x must be [N,C,H,W], is " + shape_string(x.shape()));
  SLIDE_ASSIGN_OR_RETURN(Tensor sums, sums_tensor(be, 2 * x.dim(1), "sync batch norm gradient sums"));
  SLIDE_RETURN_IF_ERROR(be.batch_norm_backward_reduce(x, dy, save_mean, save_invstd, sums, dgamma, dbeta));
  SLIDE_RETURN_IF_ERROR(all_reduce_sums(comm, be, sums, "sync batch norm gradient sums"));
  return be.batch_norm_backward_elemt(x, dy, gamma, save_mean, save_invstd, stats, sums, dx);
}

}  // namespace slide::train::dist
