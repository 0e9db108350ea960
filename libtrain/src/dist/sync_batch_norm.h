// Synchronised batch normalisation (--sync-bn): BatchNorm2d's training statistics over the samples
// of every rank (PyTorch's nn.SyncBatchNorm), for layers.cpp. Host tensors (f32 or f64) only.
#pragma once

#include "slide/train/communicator.h"

namespace slide::train::dist {

// Training forward, as Backend::batch_norm_forward_training (same shapes and outputs) but with the
// mean and biased variance over all ranks' N x H x W values per channel: two all-reduces (the
// sums, then the squared deviations from the global mean: two passes, as a single rank's batch
// norm). The running variance takes the unbiased variance over the global count, as PyTorch.
// `*global_count` receives that count (backward needs it). Every rank must call it for the same
// layer in the same order, with at least one sample. Errors: kInvalidArgument (not a host f32/f64
// tensor), the communicator's.
[[nodiscard]] Status sync_batch_norm_forward(Communicator& comm, const Tensor& x, const Tensor& gamma,
                                             const Tensor& beta, double eps, double momentum, Tensor& running_mean,
                                             Tensor& running_var, Tensor& y, Tensor& save_mean, Tensor& save_invstd,
                                             double* global_count);

// Backward: dx = gamma invstd (dy - sum(dy) / M - xhat sum(dy xhat) / M), the sums over all ranks
// (one all-reduce of 2C values) and M the global count; dgamma += and dbeta += this rank's own
// sums (the gradient all-reduce adds the other ranks'). Errors: as the forward.
[[nodiscard]] Status sync_batch_norm_backward(Communicator& comm, const Tensor& x, const Tensor& dy,
                                              const Tensor& gamma, const Tensor& save_mean,
                                              const Tensor& save_invstd, double global_count, Tensor& dx,
                                              Tensor& dgamma, Tensor& dbeta);

}  // namespace slide::train::dist
