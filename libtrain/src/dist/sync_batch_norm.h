// Synchronised batch normalisation (--sync-bn): BatchNorm2d's training statistics over the samples
// of every rank (PyTorch's nn.SyncBatchNorm), for layers.cpp. On any backend: the per-channel
// sums come from the backend's batch-norm pieces (backend.h: batch_norm_stats ...) and stay on its
// device; only the all-reduces sit between them.
#pragma once

#include "slide/train/backend.h"
#include "slide/train/communicator.h"

namespace slide::train::dist {

// Training forward, as Backend::batch_norm_forward_training (same shapes and outputs) but with the
// mean and biased variance over all ranks' N x H x W values per channel: two all-reduces (the sums
// and count, then the squared deviations from the global mean: two passes, as a single rank's
// batch norm). The running variance takes the unbiased variance over the global count, as
// PyTorch. `*stats` receives the all-reduced sums (f64 [C+1], the global count at C, on be's
// device), which backward needs. x: plain [N,C,H,W] on be's device (Backend::to_plain first).
// Every rank must call it for the same layer in the same order, with at least one sample among
// them. Where the communicator's buffers live on be's device (NCCL on cuda) the sums are
// all-reduced in place, after a fence of the backend's work; otherwise (MPI, sockets) through a
// host copy of a few KB. With a world of one the results are batch_norm_forward_training's bit
// for bit. Errors: the backend's (kInvalidArgument, kUnimplemented), the communicator's.
[[nodiscard]] Status sync_batch_norm_forward(Communicator& comm, Backend& be, const Tensor& x, const Tensor& gamma,
                                             const Tensor& beta, double eps, double momentum, Tensor& running_mean,
                                             Tensor& running_var, Tensor& y, Tensor& save_mean, Tensor& save_invstd,
                                             Tensor* stats);

// Backward: dx = gamma invstd / M (M dy - sum(dy) - xhat sum(dy xhat)), the sums over all ranks
// (one all-reduce of 2C values) and M the global count (stats from the forward); dgamma += and
// dbeta += this rank's own sums (the gradient all-reduce adds the other ranks'). With a world of
// one: batch_norm_backward's results bit for bit. dx may be dy (its pieces read a channel's dy for
// the sums before any dx is written, then each dx element from dy's same element). Errors: as the
// forward.
[[nodiscard]] Status sync_batch_norm_backward(Communicator& comm, Backend& be, const Tensor& x, const Tensor& dy,
                                              const Tensor& gamma, const Tensor& save_mean, const Tensor& save_invstd,
                                              const Tensor& stats, Tensor& dx, Tensor& dgamma, Tensor& dbeta);

}  // namespace slide::train::dist
