// The cuda backend's own kernels; see kernels.h. Per-element arithmetic comes from
// kernels/formulas.h (shared with the reference backend), launch geometry from kernels/launch.h.
#include "kernels.h"

#include <cstdint>

#include "kernels/formulas.h"
#include "kernels/launch.h"

namespace slide::train::cuda {
namespace {

namespace fm = slide::train::formulas;

constexpr int kBlock = 256;  // threads per block everywhere here (a power of two: block_sum)
static_assert(kernels::kBnMaxSegments <= kBlock, "bn_reduce_kernel sums a channel's segments with one block");

#define SLIDE_GRID_STRIDE(i, n)                                                                 \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);        \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// The sum (or maximum) of every thread's `v` in the block (blockDim.x == B; `shared` holds B
// doubles); every thread gets it. A fixed tree: the same inputs give the same result on every run.
template <int B = kBlock>
__device__ double block_sum(double v, double* shared) {
  const int t = threadIdx.x;
  shared[t] = v;
  __syncthreads();
  for (int s = B / 2; s > 0; s >>= 1) {
    if (t < s) shared[t] += shared[t + s];
    __syncthreads();
  }
  const double total = shared[0];
  __syncthreads();  // the caller may reuse `shared` at once
  return total;
}

__device__ double block_max(double v, double* shared) {
  const int t = threadIdx.x;
  shared[t] = v;
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (t < s) shared[t] = fmax(shared[t], shared[t + s]);
    __syncthreads();
  }
  const double m = shared[0];
  __syncthreads();
  return m;
}

// Every launch goes through these helpers: the thread's last error is cleared right before the
// launch and read right after, so a launch reports its own failure only. (cudaGetLastError also
// returns an earlier call's error that was reported as a Status and never read back, e.g. a cuBLAS
// workspace allocation's out of memory, which would otherwise fail the next good launch as
// kResourceExhausted and set off out-of-memory recovery again.)
inline void clear_last_error() { (void)cudaGetLastError(); }

template <typename Kernel, typename... Args>
cudaError_t launch_grid_stride(int64_t n, cudaStream_t stream, Kernel kernel, Args... args) {
  const kernels::Launch1d g = kernels::launch_1d(n, kBlock);
  if (g.blocks == 0) return cudaSuccess;
  clear_last_error();
  kernel<<<static_cast<unsigned>(g.blocks), g.threads, 0, stream>>>(args...);
  return cudaGetLastError();
}

// A kernel over a [rows, cols] matrix (kernels::launch_rows_cols), given the geometry as its last
// argument.
template <typename Kernel, typename... Args>
cudaError_t launch_rows_cols(int64_t rows, int64_t cols, cudaStream_t stream, Kernel kernel, Args... args) {
  const kernels::LaunchRowsCols g = kernels::launch_rows_cols(rows, cols, kBlock);
  if (g.blocks_x == 0) return cudaSuccess;
  if (g.blocks_x > 2147483647) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(g.blocks_x), static_cast<unsigned>(g.blocks_y));
  const dim3 block(static_cast<unsigned>(g.threads_x), static_cast<unsigned>(g.threads_y));
  clear_last_error();
  kernel<<<grid, block, 0, stream>>>(args..., g);
  return cudaGetLastError();
}

// One block of B threads per channel / row: at most 2^31 - 1 blocks (CUDA's grid x limit).
template <int B = kBlock, typename Kernel, typename... Args>
cudaError_t launch_per_block(int64_t blocks, cudaStream_t stream, Kernel kernel, Args... args) {
  if (blocks <= 0) return cudaSuccess;
  if (blocks > 2147483647) return cudaErrorInvalidConfiguration;
  clear_last_error();
  kernel<<<static_cast<unsigned>(blocks), B, 0, stream>>>(args...);
  return cudaGetLastError();
}

// --- Storage types (half-precision storage, backend.h) ---
// An element as stored (T) and its f32 value: f32 as it is; f16 and bf16 as 16-bit patterns,
// converted by formulas.h (exact to f32; to the half type rounded to nearest even), the functions
// the reference backend's cast runs.
struct F32 {
  using T = float;
  static constexpr bool kHalf = false;
  __device__ static float load(float v) { return v; }
  __device__ static float store(float v) { return v; }
};
struct F16 {
  using T = uint16_t;
  static constexpr bool kHalf = true;
  __device__ static float load(uint16_t v) { return fm::f16_to_f32(v); }
  __device__ static uint16_t store(float v) { return fm::f32_to_f16(v); }
};
struct BF16 {
  using T = uint16_t;
  static constexpr bool kHalf = true;
  __device__ static float load(uint16_t v) { return fm::bf16_to_f32(v); }
  __device__ static uint16_t store(float v) { return fm::f32_to_bf16(v); }
};

// --- Element-wise ---
template <typename S>
__global__ void unary_kernel(Unary f, const typename S::T* x, typename S::T* y, int64_t n) {
  SLIDE_GRID_STRIDE(i, n) {
    const float v = S::load(x[i]);
    y[i] = S::store(f == Unary::kRelu   ? fm::relu(v)
                    : f == Unary::kTanh ? fm::tanh_act(v)
                    : f == Unary::kGelu ? (S::kHalf ? fm::gelu_f32(v) : fm::gelu(v))
                                        : fm::sigmoid(v));
  }
}

template <typename S>
__global__ void unary_grad_kernel(UnaryGrad f, const typename S::T* y, const typename S::T* dy, typename S::T* dx,
                                  int64_t n) {
  SLIDE_GRID_STRIDE(i, n) {
    const float yv = S::load(y[i]), g = S::load(dy[i]);
    dx[i] = S::store(f == UnaryGrad::kRelu   ? fm::relu_grad(yv, g)
                     : f == UnaryGrad::kTanh ? fm::tanh_grad(yv, g)
                     : f == UnaryGrad::kGelu ? fm::gelu_grad(yv, g)
                                             : fm::sigmoid_grad(yv, g));
  }
}

// y (of a's storage) = a op b, in f32.
template <typename SA, typename SB>
__global__ void binary_kernel(Binary op, const typename SA::T* a, const typename SB::T* b, typename SA::T* y,
                              int64_t n) {
  SLIDE_GRID_STRIDE(i, n) {
    const float u = SA::load(a[i]), v = SB::load(b[i]);
    y[i] = SA::store(op == Binary::kAdd ? u + v : u * v);
  }
}

// A thread of a kernels::LaunchRowsCols grid: f(r, c) for its column and rows (walk_rows_cols),
// and that column alone.
template <typename F>
__device__ void walk_rows_cols(int64_t rows, int64_t cols, const kernels::LaunchRowsCols& g, F&& f) {
  kernels::walk_rows_cols(rows, cols, g, blockIdx.x, blockIdx.y, threadIdx.x, threadIdx.y, f);
}
__device__ int64_t rows_cols_column(const kernels::LaunchRowsCols& g) {
  return kernels::rows_cols_column(g, blockIdx.x, threadIdx.x);
}

// y[r, c] = row[c] for y [rows, cols] (a linear layer's bias, before the GEMM adds to it): the
// thread's column's value loaded once.
template <typename S>
__global__ void fill_rows_kernel(typename S::T* y, const typename S::T* row, int64_t rows, int64_t cols,
                                 kernels::LaunchRowsCols g) {
  const int64_t col = rows_cols_column(g);
  if (col >= cols) return;
  const typename S::T v = row[col];
  walk_rows_cols(rows, cols, g, [&](int64_t r, int64_t c) { y[r * cols + c] = v; });
}

__global__ void bias_add_kernel(float* y, const float* b, int64_t K, int64_t inner, int64_t n) {
  SLIDE_GRID_STRIDE(i, n) { y[i] += b[(i / inner) % K]; }
}

// One block per k; dy of storage S, db f32.
template <typename S>
__global__ void bias_grad_kernel(const typename S::T* dy, float* db, int64_t N, int64_t K, int64_t inner) {
  __shared__ double shared[kBlock];
  const int64_t k = blockIdx.x;
  double local = 0;
  kernels::for_channel(N, K, inner, k, threadIdx.x, blockDim.x, [&](int64_t i) { local += S::load(dy[i]); });
  const double total = block_sum(local, shared);
  if (threadIdx.x == 0) db[k] += static_cast<float>(total);
}

// --- Batch norm: C * S blocks of kBlock threads, S segments a channel (kernels::bn_segment) ---
// Segment s of channel c as the block's threads walk it: thread t takes the segment's values
// begin + t, begin + t + blockDim.x, ... (in (n, hw) order; kernels::for_channel_range, without a
// division per value). Each reducing pass writes one partial sum per segment (block b = c S + s
// writes partials[b]); bn_reduce_kernel then adds a channel's S partials with one fixed block_sum
// tree. The one-rank passes are the synchronised pieces run over one rank, so the two agree bit for
// bit, and every run repeats.
struct BnSegment {
  int64_t N, C, HW;
  kernels::ChannelSegment seg;
  __device__ BnSegment(int64_t n, int64_t c, int64_t hw, int64_t segments)
      : N(n), C(c), HW(hw), seg(kernels::bn_segment(blockIdx.x, segments, n * hw)) {}
  // The segment's index within its channel (0 for the channel's first).
  __device__ int64_t index(int64_t segments) const { return static_cast<int64_t>(blockIdx.x) - seg.c * segments; }
  template <typename F>
  __device__ void each(F f) const {
    kernels::for_channel_range(N, C, HW, seg.c, seg.begin, seg.end, threadIdx.x, blockDim.x, f);
  }
};

// partials[b] = the sum of x over block b's segment. x, y, dy and dx below are of storage S (f32,
// or half-precision activations), read as f32 values; the per-channel tensors are f32.
template <typename S>
__global__ void bn_partial_sum_kernel(const typename S::T* x, double* partials, int64_t N, int64_t C, int64_t HW,
                                      int64_t segments) {
  __shared__ double shared[kBlock];
  const BnSegment g(N, C, HW, segments);
  double local = 0;
  g.each([&](int64_t i) { local += S::load(x[i]); });
  const double total = block_sum(local, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// partials[b] = the sum of (x - mean)^2 over block b's segment, mean = stats[c] / stats[C].
template <typename S>
__global__ void bn_partial_deviations_kernel(const typename S::T* x, const double* stats, double* partials, int64_t N,
                                             int64_t C, int64_t HW, int64_t segments) {
  __shared__ double shared[kBlock];
  const BnSegment g(N, C, HW, segments);
  const double mean = stats[g.seg.c] / stats[C];
  double local = 0;
  g.each([&](int64_t i) {
    const double d = S::load(x[i]) - mean;
    local += d * d;
  });
  const double total = block_sum(local, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// dy[i] as f32, masked by ReLU's rule where the batch norm's output relu_y (batch norm + ReLU,
// backend.h batch_norm_relu_backward) is given: the value relu_backward would have stored.
template <typename S>
__device__ float bn_gradient(const typename S::T* dy, const typename S::T* relu_y, int64_t i) {
  const float g = S::load(dy[i]);
  return relu_y != nullptr ? fm::relu_grad(S::load(relu_y[i]), g) : g;
}

// partials[b] = sum dy and partials[C S + b] = sum dy * xhat over block b's segment (dy masked by
// relu_y where given).
template <typename S>
__global__ void bn_partial_grad_kernel(const typename S::T* x, const typename S::T* dy, const typename S::T* relu_y,
                                       const float* save_mean, const float* save_invstd, double* partials, int64_t N,
                                       int64_t C, int64_t HW, int64_t segments) {
  __shared__ double shared[kBlock];
  const BnSegment g(N, C, HW, segments);
  const double mean = save_mean[g.seg.c], invstd = save_invstd[g.seg.c];
  double local_dy = 0, local_dy_xhat = 0;
  g.each([&](int64_t i) {
    const float dyv = bn_gradient<S>(dy, relu_y, i);
    local_dy += dyv;
    local_dy_xhat += double(dyv) * fm::bn_xhat(S::load(x[i]), mean, invstd);
  });
  const double sum_dy = block_sum(local_dy, shared);
  const double sum_dy_xhat = block_sum(local_dy_xhat, shared);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = sum_dy;
    partials[C * segments + blockIdx.x] = sum_dy_xhat;
  }
}

// One block per channel c (segments <= kBlock): out[c] = the sum of partials[c S .. c S + S), by
// block_sum's fixed tree; with_count: count is written to out[C] (batch_norm_stats's count). With
// dgamma and dbeta (backward): out[C + c] likewise from partials[C S + ...], and dbeta[c] += out[c],
// dgamma[c] += out[C + c].
__global__ void bn_reduce_kernel(const double* partials, double* out, int64_t C, int64_t segments, double count,
                                 bool with_count, float* dgamma, float* dbeta) {
  __shared__ double shared[kBlock];
  const int64_t c = blockIdx.x, t = threadIdx.x;
  const double total = block_sum(t < segments ? partials[c * segments + t] : 0.0, shared);
  if (dgamma == nullptr) {
    if (t == 0) out[c] = total;
    if (t == 0 && c == 0 && with_count) out[C] = count;
    return;
  }
  const double total_xhat = block_sum(t < segments ? partials[(C + c) * segments + t] : 0.0, shared);
  if (t == 0) {
    out[c] = total;
    out[C + c] = total_xhat;
    dbeta[c] += static_cast<float>(total);
    dgamma[c] += static_cast<float>(total_xhat);
  }
}

// Channel c's saved statistics (mean, 1 / std) and running ones (momentum; the unbiased variance
// from the sum of squared deviations sq over `count` values), written by one thread per channel.
__device__ void bn_write_statistics(int64_t c, double mean, double invstd, double sq, double count, double momentum,
                                    float* save_mean, float* save_invstd, float* running_mean, float* running_var) {
  save_mean[c] = static_cast<float>(mean);
  save_invstd[c] = static_cast<float>(invstd);
  running_mean[c] = fm::bn_running(running_mean[c], momentum, mean);
  running_var[c] = fm::bn_running(running_var[c], momentum, fm::bn_unbiased_var(sq, count));
}

// y[i] = the normalised value, stored, then ReLU'd when `relu` (batch norm + ReLU; ReLU of the
// stored value: relu_forward's on batch norm's output, bit for bit).
template <typename S>
__device__ void bn_store(typename S::T* y, int64_t i, float v, bool relu) {
  const typename S::T stored = S::store(v);
  y[i] = relu ? S::store(fm::relu(S::load(stored))) : stored;
}

// y over block b's segment from the channel's sum (stats [C+1], count at C) and sum of squared
// deviations (devs [C]), ReLU'd when `relu`; the channel's first segment's thread 0 writes the
// saved and running statistics.
template <typename S>
__global__ void bn_normalise_kernel(const typename S::T* x, const float* gamma, const float* beta, const double* stats,
                                    const double* devs, double eps, double momentum, float* running_mean,
                                    float* running_var, typename S::T* y, float* save_mean, float* save_invstd,
                                    bool relu, int64_t N, int64_t C, int64_t HW, int64_t segments) {
  const BnSegment g(N, C, HW, segments);
  const int64_t c = g.seg.c;
  const double count = stats[C], mean = stats[c] / count, sq = devs[c];
  const double invstd = fm::bn_invstd(sq / count, eps);
  const double gm = gamma[c], bt = beta[c];
  g.each([&](int64_t i) { bn_store<S>(y, i, fm::bn_apply(S::load(x[i]), gm, bt, mean, invstd), relu); });
  if (threadIdx.x == 0 && g.index(segments) == 0)
    bn_write_statistics(c, mean, invstd, sq, count, momentum, save_mean, save_invstd, running_mean, running_var);
}

// dx over block b's segment from the channel's sums (sums [2C]: sum dy, then sum dy * xhat) over
// `count` values (stats[C], the all-reduced count, or N * HW when stats is null); dy masked by
// relu_y where given.
template <typename S>
__global__ void bn_input_grad_kernel(const typename S::T* x, const typename S::T* dy, const typename S::T* relu_y,
                                     const float* gamma, const float* save_mean, const float* save_invstd,
                                     const double* stats,
                                     const double* sums, typename S::T* dx, int64_t N, int64_t C, int64_t HW,
                                     int64_t segments) {
  const BnSegment g(N, C, HW, segments);
  const int64_t c = g.seg.c;
  const double count = stats != nullptr ? stats[C] : double(N * HW);
  const double mean = save_mean[c], invstd = save_invstd[c];
  const double k = double(gamma[c]) * invstd / count;
  const double sum_dy = sums[c], sum_dy_xhat = sums[C + c];
  g.each([&](int64_t i) {
    dx[i] = S::store(fm::bn_input_grad(bn_gradient<S>(dy, relu_y, i), fm::bn_xhat(S::load(x[i]), mean, invstd), k,
                                       count, sum_dy, sum_dy_xhat));
  });
}

// Inference: y = bn_apply with the running statistics, over [N * C planes, HW] (a plane's channel
// once per row, kernels::LaunchRowsCols).
template <typename S>
__global__ void bn_forward_inference_kernel(const typename S::T* x, const float* gamma, const float* beta,
                                            const float* running_mean, const float* running_var, double eps,
                                            typename S::T* y, int64_t C, int64_t rows, int64_t HW,
                                            kernels::LaunchRowsCols g) {
  walk_rows_cols(rows, HW, g, [&](int64_t r, int64_t col) {
    const int64_t c = r % C, i = r * HW + col;
    y[i] = S::store(fm::bn_apply(S::load(x[i]), double(gamma[c]), double(beta[c]), double(running_mean[c]),
                                 fm::bn_invstd(double(running_var[c]), eps)));
  });
}

// --- Batch norm, channels last (Layout::kNhwc): x as [rows = N HW, C], the channel the column ---
// The reducing passes: bn_nhwc_blocks(C, S) blocks of kBlock threads, 32 channels by 8 row lanes
// (kernels::bn_nhwc_segment, S = bn_segments(N, HW, true)), each writing the partial sums of its
// channels' segment into the NCHW passes' layout (partials[c S + s]) for bn_reduce_kernel.
static_assert(kernels::kBnNhwcColumns * kernels::kBnNhwcLanes == kBlock, "a channels-last batch norm block");
struct BnNhwc {
  int64_t C;
  kernels::NhwcSegment seg;
  int64_t lane;
  __device__ BnNhwc(int64_t c, int64_t segments, int64_t rows)
      : C(c), seg(kernels::bn_nhwc_segment(blockIdx.x, threadIdx.x, segments, rows)),
        lane(static_cast<int64_t>(threadIdx.x) / kernels::kBnNhwcColumns) {}
  __device__ bool active() const { return seg.c < C; }
  template <typename F>
  __device__ void each(F f) const {
    kernels::for_nhwc_segment(seg, lane, C, f);
  }
  // The sum of `v` over the block's lanes for this thread's channel, added in lane order (a fixed
  // order); lane 0's threads get it (the others 0). Every thread must call it (barriers).
  __device__ double lanes_sum(double v, double* shared) const {
    shared[threadIdx.x] = v;
    __syncthreads();
    double total = 0;
    if (lane == 0)
      for (int64_t l = 0; l < kernels::kBnNhwcLanes; ++l) total += shared[l * kernels::kBnNhwcColumns + threadIdx.x];
    __syncthreads();
    return total;
  }
  // partials[offset + c S + s] = total, by lane 0's thread of an existing channel.
  __device__ void write(double* partials, int64_t segments, int64_t offset, double total) const {
    if (lane == 0 && active()) partials[offset + seg.c * segments + seg.segment] = total;
  }
};

template <typename S>
__global__ void bn_nhwc_partial_sum_kernel(const typename S::T* x, double* partials, int64_t C, int64_t rows,
                                           int64_t segments) {
  __shared__ double shared[kBlock];
  const BnNhwc g(C, segments, rows);
  double local = 0;
  g.each([&](int64_t i) { local += S::load(x[i]); });
  g.write(partials, segments, 0, g.lanes_sum(local, shared));
}

template <typename S>
__global__ void bn_nhwc_partial_deviations_kernel(const typename S::T* x, const double* stats, double* partials,
                                                  int64_t C, int64_t rows, int64_t segments) {
  __shared__ double shared[kBlock];
  const BnNhwc g(C, segments, rows);
  const double mean = g.active() ? stats[g.seg.c] / stats[C] : 0.0;
  double local = 0;
  g.each([&](int64_t i) {
    const double d = S::load(x[i]) - mean;
    local += d * d;
  });
  g.write(partials, segments, 0, g.lanes_sum(local, shared));
}

template <typename S>
__global__ void bn_nhwc_partial_grad_kernel(const typename S::T* x, const typename S::T* dy,
                                            const typename S::T* relu_y, const float* save_mean,
                                            const float* save_invstd, double* partials, int64_t C, int64_t rows,
                                            int64_t segments) {
  __shared__ double shared[kBlock];
  const BnNhwc g(C, segments, rows);
  const double mean = g.active() ? double(save_mean[g.seg.c]) : 0.0;
  const double invstd = g.active() ? double(save_invstd[g.seg.c]) : 0.0;
  double local_dy = 0, local_dy_xhat = 0;
  g.each([&](int64_t i) {
    const float dyv = bn_gradient<S>(dy, relu_y, i);
    local_dy += dyv;
    local_dy_xhat += double(dyv) * fm::bn_xhat(S::load(x[i]), mean, invstd);
  });
  const double sum_dy = g.lanes_sum(local_dy, shared);
  const double sum_dy_xhat = g.lanes_sum(local_dy_xhat, shared);
  g.write(partials, segments, 0, sum_dy);
  g.write(partials, segments, C * segments, sum_dy_xhat);
}

// The element-wise passes on a kernels::LaunchRowsCols grid over [rows, C]: a thread's channel is
// its column, whose constants it loads once. normalise: y and, by the thread that owns row 0 of its
// column (the grid is launched over at least one row), the saved and running statistics.
template <typename S>
__global__ void bn_nhwc_normalise_kernel(const typename S::T* x, const float* gamma, const float* beta,
                                         const double* stats, const double* devs, double eps, double momentum,
                                         float* running_mean, float* running_var, typename S::T* y, float* save_mean,
                                         float* save_invstd, bool relu, int64_t rows, int64_t C,
                                         kernels::LaunchRowsCols g) {
  const int64_t c = rows_cols_column(g);
  if (c >= C) return;
  const double count = stats[C], mean = stats[c] / count, sq = devs[c];
  const double invstd = fm::bn_invstd(sq / count, eps);
  const double gm = gamma[c], bt = beta[c];
  walk_rows_cols(rows, C, g, [&](int64_t r, int64_t col) {
    const int64_t i = r * C + col;
    bn_store<S>(y, i, fm::bn_apply(S::load(x[i]), gm, bt, mean, invstd), relu);
  });
  if (blockIdx.y == 0 && threadIdx.y == 0)
    bn_write_statistics(c, mean, invstd, sq, count, momentum, save_mean, save_invstd, running_mean, running_var);
}

template <typename S>
__global__ void bn_nhwc_input_grad_kernel(const typename S::T* x, const typename S::T* dy, const typename S::T* relu_y,
                                          const float* gamma,
                                          const float* save_mean, const float* save_invstd, const double* stats,
                                          const double* sums, typename S::T* dx, int64_t rows, int64_t C,
                                          kernels::LaunchRowsCols g) {
  const int64_t c = rows_cols_column(g);
  if (c >= C) return;
  const double count = stats != nullptr ? stats[C] : double(rows);
  const double mean = save_mean[c], invstd = save_invstd[c];
  const double k = double(gamma[c]) * invstd / count;
  const double sum_dy = sums[c], sum_dy_xhat = sums[C + c];
  walk_rows_cols(rows, C, g, [&](int64_t r, int64_t col) {
    const int64_t i = r * C + col;
    dx[i] = S::store(fm::bn_input_grad(bn_gradient<S>(dy, relu_y, i), fm::bn_xhat(S::load(x[i]), mean, invstd), k,
                                       count, sum_dy, sum_dy_xhat));
  });
}

template <typename S>
__global__ void bn_nhwc_forward_inference_kernel(const typename S::T* x, const float* gamma, const float* beta,
                                                 const float* running_mean, const float* running_var, double eps,
                                                 typename S::T* y, int64_t rows, int64_t C, kernels::LaunchRowsCols g) {
  const int64_t c = rows_cols_column(g);
  if (c >= C) return;
  const double gm = gamma[c], bt = beta[c], mean = running_mean[c];
  const double invstd = fm::bn_invstd(double(running_var[c]), eps);
  walk_rows_cols(rows, C, g, [&](int64_t r, int64_t col) {
    const int64_t i = r * C + col;
    y[i] = S::store(fm::bn_apply(S::load(x[i]), gm, bt, mean, invstd));
  });
}

// --- Pooling ---
// Stored elements seen as their f32 values (max_pool_argmax's comparisons), at index i.
template <typename S>
struct Loaded {
  const typename S::T* p;
  __device__ float operator[](int64_t i) const { return S::load(p[i]); }
};

// The stored elements p[0], p[stride], p[2 stride], ... seen as their f32 values (one channel's
// plane of a channels-last tensor: stride C).
template <typename S>
struct Strided {
  const typename S::T* p;
  int64_t stride;
  __device__ float operator[](int64_t i) const { return S::load(p[i * stride]); }
};

// x [N, C, H, W] -> y [N, C, P, Q], both NCHW.
template <typename S>
__global__ void max_pool_forward_kernel(const typename S::T* x, typename S::T* y, int64_t C, int64_t H, int64_t W,
                                        int64_t P, int64_t Q, int kernel, int stride, int pad, int64_t n) {
  const Loaded<S> xv{x};
  SLIDE_GRID_STRIDE(o, n) {
    const int64_t nc = o / (P * Q), oh = (o / Q) % P, ow = o % Q;
    const int64_t best = fm::max_pool_argmax(xv, nc, oh, ow, H, W, kernel, stride, pad);
    y[o] = best >= 0 ? x[best] : S::store(0.0f);
  }
}

// Max pooling's forward channels last: a [N P Q, C] grid (the channel the column, so that a warp
// reads and writes 32 neighbouring channels); thread (row n PQ + o, c) scans window o of the
// plane of (n, c), read with stride C (Strided), by max_pool_argmax as the NCHW kernel, and copies
// the first maximum's stored value. One 64-bit division per output (the sample), the window's
// position in 32-bit arithmetic (P * Q < 2^31, checked by the launcher). (It walked the outputs in
// NCHW order before, mapping every window value's index by nhwc_position: three 64-bit divisions
// a read, and writes C elements apart.)
template <typename S>
__global__ void max_pool_nhwc_forward_kernel(const typename S::T* x, typename S::T* y, int64_t C, int H, int W, int P,
                                             int Q, int kernel, int stride, int pad, int64_t rows,
                                             kernels::LaunchRowsCols g) {
  const int64_t HW = int64_t{H} * W, PQ = int64_t{P} * Q;
  walk_rows_cols(rows, C, g, [&](int64_t r, int64_t c) {
    const int64_t n = r / PQ;
    const int o = static_cast<int>(r - n * PQ), oh = o / Q, ow = o - oh * Q;
    const Strided<S> xp{x + n * HW * C + c, C};
    const int64_t best = fm::max_pool_argmax(xp, 0, oh, ow, H, W, kernel, stride, pad);
    y[r * C + c] = best >= 0 ? xp.p[best * C] : S::store(0.0f);
  });
}

// The fused inference convolution's epilogue on half-precision storage: y = ReLU(c + b[k] + z)
// (ReLU when `relu`; z null for none), in f32, rounded once. c is the convolution's output [N, K,
// inner] (channels last: [N, inner, K]); c, z and y share that layout; y may be c or z (each
// element read before it is written, by the same thread).
// Walked as a [rows, cols] matrix (kernels::LaunchRowsCols): channels last, rows N * inner pixels
// of K channels (the bias is the column's); in planes, rows N * K planes of `inner` values (the
// bias is the row's, row % K).
template <typename S>
__global__ void conv_epilogue_kernel(const typename S::T* c, const typename S::T* b, const typename S::T* z,
                                     typename S::T* y, int64_t K, bool relu, bool nhwc, int64_t rows, int64_t cols,
                                     kernels::LaunchRowsCols g) {
  walk_rows_cols(rows, cols, g, [&](int64_t r, int64_t col) {
    const int64_t i = r * cols + col;
    float v = S::load(c[i]) + S::load(b[nhwc ? col : r % K]);
    if (z != nullptr) v += S::load(z[i]);
    y[i] = S::store(relu ? fm::relu(v) : v);
  });
}

// dx of max pooling, gathered: each input position sums dy over the windows whose first maximum it
// is (formulas.h max_pool_argmax), in window order, so that the result is the same on every run
// (no atomics). Walked as [N * C planes, H * W positions] (kernels::LaunchRowsCols): a thread's
// position, its row and column and the range of windows holding it are worked out once, in 32-bit
// arithmetic (H * W < 2^31, checked by the launcher), and hold for every plane it visits. (An H200
// profile of a ResNet-50 training step had this kernel at 9% of the GPU time when it divided
// 64-bit flat indices for every element.)
// x, dy and dx of storage S, compared and summed as f32 values (the sum rounded once to S).
template <typename S>
__global__ void max_pool_backward_kernel(const typename S::T* x, const typename S::T* dy, typename S::T* dx, int H,
                                         int W, int P, int Q, int kernel, int stride, int pad, int64_t planes,
                                         kernels::LaunchRowsCols g) {
  const int64_t HW = int64_t{H} * W;
  const int64_t col = rows_cols_column(g);
  if (col >= HW) return;
  const int o = static_cast<int>(col), ih = o / W, iw = o - ih * W;
  // Windows containing (ih, iw): oh * stride - pad <= ih < oh * stride - pad + kernel.
  const int oh_hi = min(P - 1, (ih + pad) / stride), ow_hi = min(Q - 1, (iw + pad) / stride);
  const int oh_lo = max(0, oh_hi - (kernel - 1) / stride - 1), ow_lo = max(0, ow_hi - (kernel - 1) / stride - 1);
  walk_rows_cols(planes, HW, g, [&](int64_t nc, int64_t) {
    const Loaded<S> xp{x + nc * HW};
    const typename S::T* dyp = dy + nc * int64_t{P} * Q;
    float acc = 0.0f;
    for (int oh = oh_lo; oh <= oh_hi; ++oh) {
      if (ih < oh * stride - pad || ih >= oh * stride - pad + kernel) continue;
      for (int ow = ow_lo; ow <= ow_hi; ++ow) {
        if (iw < ow * stride - pad || iw >= ow * stride - pad + kernel) continue;
        if (fm::max_pool_argmax(xp, 0, oh, ow, H, W, kernel, stride, pad) == o) acc += S::load(dyp[oh * Q + ow]);
      }
    }
    dx[nc * HW + o] = S::store(acc);
  });
}

// x and y (dy and dx) of storage S; the mean in double, rounded to f32, then to S.
template <typename S>
__global__ void gap_forward_kernel(const typename S::T* x, typename S::T* y, int64_t HW, int64_t n) {
  SLIDE_GRID_STRIDE(j, n) {
    double s = 0;
    for (int64_t i = 0; i < HW; ++i) s += S::load(x[j * HW + i]);
    y[j] = S::store(static_cast<float>(s / double(HW)));
  }
}

template <typename S>
__global__ void gap_backward_kernel(const typename S::T* dy, typename S::T* dx, int64_t HW, int64_t n) {
  SLIDE_GRID_STRIDE(i, n) { dx[i] = S::store(static_cast<float>(double(S::load(dy[i / HW])) / double(HW))); }
}

// Channels last: thread j = n C + c sums x[n][hw][c] over hw (neighbouring threads read neighbouring
// channels), in hw order as the NCHW kernel; backward on a [N HW, C] grid, the channel the column.
template <typename S>
__global__ void gap_nhwc_forward_kernel(const typename S::T* x, typename S::T* y, int64_t C, int64_t HW, int64_t n) {
  SLIDE_GRID_STRIDE(j, n) {
    const int64_t b = j / C, c = j - b * C;
    const typename S::T* p = x + b * HW * C + c;
    double s = 0;
    for (int64_t i = 0; i < HW; ++i) s += S::load(p[i * C]);
    y[j] = S::store(static_cast<float>(s / double(HW)));
  }
}
template <typename S>
__global__ void gap_nhwc_backward_kernel(const typename S::T* dy, typename S::T* dx, int64_t C, int64_t HW,
                                         int64_t rows, kernels::LaunchRowsCols g) {
  walk_rows_cols(rows, C, g, [&](int64_t r, int64_t c) {
    dx[r * C + c] = S::store(static_cast<float>(double(S::load(dy[r / HW * C + c])) / double(HW)));
  });
}

// Max pooling's backward channels last: a [N H W, C] grid (the channel the column, so that a warp
// reads 32 neighbouring channels); thread (row n HW + o, c) gathers, as max_pool_backward_kernel,
// dy of the windows whose first maximum is input position o of channel c, in window order. The
// plane of (n, c) is read with stride C (Strided).
template <typename S>
__global__ void max_pool_nhwc_backward_kernel(const typename S::T* x, const typename S::T* dy, typename S::T* dx,
                                              int64_t C, int H, int W, int P, int Q, int kernel, int stride, int pad,
                                              int64_t rows, kernels::LaunchRowsCols g) {
  const int64_t HW = int64_t{H} * W, PQ = int64_t{P} * Q;
  walk_rows_cols(rows, C, g, [&](int64_t r, int64_t c) {
    const int64_t n = r / HW;
    const int o = static_cast<int>(r - n * HW), ih = o / W, iw = o - ih * W;
    const int oh_hi = min(P - 1, (ih + pad) / stride), ow_hi = min(Q - 1, (iw + pad) / stride);
    const int oh_lo = max(0, oh_hi - (kernel - 1) / stride - 1), ow_lo = max(0, ow_hi - (kernel - 1) / stride - 1);
    const Strided<S> xp{x + n * HW * C + c, C};
    const typename S::T* dyp = dy + n * PQ * C + c;
    float acc = 0.0f;
    for (int oh = oh_lo; oh <= oh_hi; ++oh) {
      if (ih < oh * stride - pad || ih >= oh * stride - pad + kernel) continue;
      for (int ow = ow_lo; ow <= ow_hi; ++ow) {
        if (iw < ow * stride - pad || iw >= ow * stride - pad + kernel) continue;
        if (fm::max_pool_argmax(xp, 0, oh, ow, H, W, kernel, stride, pad) == o)
          acc += S::load(dyp[(int64_t{oh} * Q + ow) * C]);
      }
    }
    dx[r * C + c] = S::store(acc);
  });
}

// --- Row softmax: one block per row, or one warp per row (kernels::launch_rows) ---
// A row's softmax and its backward, walked by `first`, `first + stride`, ... (a block's threads or a
// warp's lanes) with the maximum and sums taken by `max` and `sum` (every walker gets the row's
// value); the per-value arithmetic is formulas.h's, as the reference backend's.
template <typename SY = F32, typename Max, typename Sum>
__device__ void softmax_row(const float* xr, typename SY::T* yr, int64_t C, int first, int stride, Max max, Sum sum) {
  double m = -INFINITY;
  for (int64_t c = first; c < C; c += stride) m = fmax(m, double(xr[c]));
  m = max(m);
  double local = 0;
  for (int64_t c = first; c < C; c += stride) local += fm::softmax_term(xr[c], m);
  const double se = sum(local);
  for (int64_t c = first; c < C; c += stride) yr[c] = SY::store(static_cast<float>(fm::softmax_term(xr[c], m) / se));
}
template <typename Sum>
__device__ void softmax_row_backward(const float* yr, const float* dyr, float* dxr, int64_t C, int first, int stride,
                                     Sum sum) {
  double local = 0;
  for (int64_t c = first; c < C; c += stride) local += double(dyr[c]) * double(yr[c]);
  const double dot = sum(local);
  for (int64_t c = first; c < C; c += stride) dxr[c] = static_cast<float>(fm::softmax_grad(yr[c], dyr[c], dot));
}

template <typename SY>
__global__ void softmax_forward_kernel(const float* x, typename SY::T* y, int64_t C, int64_t ld) {
  __shared__ double shared[kBlock];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * ld;
  softmax_row<SY>(x + base, y + base, C, threadIdx.x, blockDim.x, [&](double v) { return block_max(v, shared); },
                  [&](double v) { return block_sum(v, shared); });
}

__global__ void softmax_backward_kernel(const float* y, const float* dy, float* dx, int64_t C) {
  __shared__ double shared[kBlock];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * C;
  softmax_row_backward(y + base, dy + base, dx + base, C, threadIdx.x, blockDim.x,
                       [&](double v) { return block_sum(v, shared); });
}

// The warp's maximum and sum by a shuffle tree, then lane 0's value for every lane (one result per
// row, the same on every run).
constexpr int kWarp = 32;
__device__ double warp_max(double v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return __shfl_sync(0xffffffffu, v, 0);
}
__device__ double warp_sum(double v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return __shfl_sync(0xffffffffu, v, 0);
}

// Row `row` of R for this warp, or -1 past the last (the whole warp then returns together).
__device__ int64_t warp_row(int64_t R) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  return row < R ? row : -1;
}

template <typename SY>
__global__ void softmax_forward_warp_kernel(const float* x, typename SY::T* y, int64_t R, int64_t C, int64_t ld) {
  const int64_t row = warp_row(R);
  if (row < 0) return;
  softmax_row<SY>(x + row * ld, y + row * ld, C, static_cast<int>(threadIdx.x % kWarp), kWarp, warp_max, warp_sum);
}

// The same row, held in the lanes' registers: a row of at most kCached * 32 values (attention's
// rows: 197 for a ViT at 224 px, 261 for Virchow2's 257 tokens and 4 registers) is read once and
// each exp taken once, where softmax_row reads it three times and takes each exp twice (an H200
// profile of ViT-L/16 at bf16 had this kernel at 12% of the GPU time, several times the memory's
// time). Values, order of the sums and results are softmax_row's, bit for bit: lane l holds
// columns l, l + 32, ..., as softmax_row walks them.
template <typename SY, int kCached>
__global__ void softmax_forward_warp_cached_kernel(const float* x, typename SY::T* y, int64_t R, int64_t C,
                                                   int64_t ld) {
  const int64_t row = warp_row(R);
  if (row < 0) return;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const float* xr = x + row * ld;
  typename SY::T* yr = y + row * ld;
  float v[kCached];
  double m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kCached; ++k) {
    const int64_t c = lane + int64_t{k} * kWarp;
    v[k] = c < C ? xr[c] : 0.0f;
    if (c < C) m = fmax(m, double(v[k]));
  }
  m = warp_max(m);
  double term[kCached];
  double local = 0;
#pragma unroll
  for (int k = 0; k < kCached; ++k) {
    term[k] = lane + int64_t{k} * kWarp < C ? fm::softmax_term(v[k], m) : 0.0;
    local += term[k];  // + 0.0 past the row's end: the same sum
  }
  const double se = warp_sum(local);
#pragma unroll
  for (int k = 0; k < kCached; ++k) {
    const int64_t c = lane + int64_t{k} * kWarp;
    if (c < C) yr[c] = SY::store(static_cast<float>(term[k] / se));
  }
}

__global__ void softmax_backward_warp_kernel(const float* y, const float* dy, float* dx, int64_t R, int64_t C) {
  const int64_t row = warp_row(R);
  if (row < 0) return;
  softmax_row_backward(y + row * C, dy + row * C, dx + row * C, C, static_cast<int>(threadIdx.x % kWarp), kWarp,
                       warp_sum);
}

// --- Cross-entropy ---
// One block per sample: log-softmax (max subtracted), the smoothed nll from the f32 log-
// probabilities (as detail::nll_to_probs does on the CPU), then the probabilities.
__global__ void cross_entropy_rows_kernel(const float* logits, const int32_t* labels, const float* weights,
                                          double smoothing, float* probs, double* row_nll, double* row_w,
                                          int* bad_label, int64_t C) {
  __shared__ double shared[kBlock];
  const int64_t n = blockIdx.x;
  const float* z = logits + n * C;
  float* p = probs + n * C;
  const int32_t label = labels[n];
  const bool valid = label >= 0 && label < C;
  double m = -INFINITY;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) m = fmax(m, double(z[c]));
  m = block_max(m, shared);
  double local = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) local += exp(double(z[c]) - m);
  const double lse = m + log(block_sum(local, shared));
  // The weighted smoothed target (formulas.h): the row's nll is already weighted.
  const double wn = !valid ? 0.0 : weights != nullptr ? double(weights[label]) : 1.0;
  local = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float logp = static_cast<float>(double(z[c]) - lse);
    const double wc = weights != nullptr ? double(weights[c]) : 1.0;
    if (valid) local -= fm::cross_entropy_target(c, label, smoothing, C, wn, wc) * double(logp);
    p[c] = static_cast<float>(exp(double(logp)));
  }
  const double nll = block_sum(local, shared);
  if (threadIdx.x == 0) {
    row_nll[n] = nll;
    row_w[n] = wn;
    if (!valid) atomicMin(bad_label, static_cast<int>(n));
  }
}

// One block: sums[0] = sum of row_nll, sums[1] = sum of row_w, in a fixed order.
__global__ void sum_rows_kernel(const double* row_nll, const double* row_w, double* sums, int64_t N) {
  __shared__ double shared[kBlock];
  double a = 0, b = 0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
    a += row_nll[n];
    b += row_w[n];
  }
  a = block_sum(a, shared);
  b = block_sum(b, shared);
  if (threadIdx.x == 0) {
    sums[0] = a;
    sums[1] = b;
  }
}

// One block: sums[0] = sum_n w[y_n], sums[1] = sum_c w[c] (C without weights); out-of-range
// labels flagged.
__global__ void label_weight_sum_kernel(const int32_t* labels, const float* weights, double* sums,
                                        int* bad_label, int64_t N, int64_t C) {
  __shared__ double shared[kBlock];
  double local = 0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
    const int32_t label = labels[n];
    if (label < 0 || label >= C) {
      atomicMin(bad_label, static_cast<int>(n));
      continue;
    }
    local += weights != nullptr ? double(weights[label]) : 1.0;
  }
  const double total = block_sum(local, shared);
  local = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) local += weights != nullptr ? double(weights[c]) : 1.0;
  const double classes_total = block_sum(local, shared);
  if (threadIdx.x == 0) {
    sums[0] = total;
    sums[1] = classes_total;
  }
}

__global__ void cross_entropy_grad_kernel(const float* probs, const int32_t* labels, const float* weights,
                                          double smoothing, const double* sums, float* dlogits, int64_t C,
                                          int64_t n_elems) {
  SLIDE_GRID_STRIDE(i, n_elems) {
    const int64_t n = i / C, c = i % C;
    const int32_t label = labels[n];
    if (label < 0 || label >= C) {
      dlogits[i] = 0.0f;
      continue;
    }
    const double ws = sums[0];
    const double wn = weights != nullptr ? double(weights[label]) : 1.0;
    const double wc = weights != nullptr ? double(weights[c]) : 1.0;
    dlogits[i] = fm::cross_entropy_grad(probs[i], fm::cross_entropy_target(c, label, smoothing, C, wn, wc),
                                        fm::cross_entropy_target_sum(wn, smoothing, C, sums[1]),
                                        ws > 0 ? 1.0 / ws : 0.0);
  }
}

// --- Vision Transformer ops ---
__device__ float cast_load(const void* x, CastType t, int64_t i) {
  switch (t) {
    case CastType::kF16: return fm::f16_to_f32(static_cast<const uint16_t*>(x)[i]);
    case CastType::kBF16: return fm::bf16_to_f32(static_cast<const uint16_t*>(x)[i]);
    default: return static_cast<const float*>(x)[i];
  }
}

__global__ void cast_kernel(const void* x, CastType from, void* y, CastType to, int64_t n) {
  SLIDE_GRID_STRIDE(i, n) {
    const float v = cast_load(x, from, i);
    switch (to) {
      case CastType::kF16: static_cast<uint16_t*>(y)[i] = fm::f32_to_f16(v); break;
      case CastType::kBF16: static_cast<uint16_t*>(y)[i] = fm::f32_to_bf16(v); break;
      default: static_cast<float*>(y)[i] = v; break;
    }
  }
}

__global__ void sum_of_squares_partial_kernel(const float* x, int64_t n, double* partial) {
  __shared__ double shared[kBlock];
  double local = 0;
  SLIDE_GRID_STRIDE(i, n) local += fm::squared(x[i]);
  const double total = block_sum(local, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void sum_partials_kernel(const double* partial, int64_t m, double* out) {
  __shared__ double shared[kBlock];
  double local = 0;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) local += partial[i];
  const double total = block_sum(local, shared);
  if (threadIdx.x == 0) out[0] = total;
}

__global__ void scale_kernel(const float* x, double alpha, float* y, int64_t n) {
  SLIDE_GRID_STRIDE(i, n) { y[i] = static_cast<float>(alpha * double(x[i])); }
}

// One block per row; x and y of storage SX and SY (f32, or half: backend.h), statistics in double
// from the values as stored.
template <typename SX, typename SY>
__global__ void layer_norm_kernel(const typename SX::T* x, const float* gamma, const float* beta, double eps,
                                  typename SY::T* y, int64_t C) {
  __shared__ double shared[kBlock];
  const typename SX::T* row = x + static_cast<int64_t>(blockIdx.x) * C;
  typename SY::T* out = y + static_cast<int64_t>(blockIdx.x) * C;
  double local = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) local += SX::load(row[c]);
  const double mean = block_sum(local, shared) / double(C);
  local = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const double d = double(SX::load(row[c])) - mean;
    local += d * d;
  }
  const double invstd = fm::bn_invstd(block_sum(local, shared) / double(C), eps);
  // y may be x (same storage only when SX is SY): each element is read before it is written, by
  // the same thread.
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    out[c] = SY::store(fm::bn_apply(SX::load(row[c]), double(gamma[c]), double(beta[c]), mean, invstd));
}

template <typename T>
__global__ void permute_kernel(const T* x, T* y, int64_t n, PermuteGeometry g) {
  SLIDE_GRID_STRIDE(o, n) {
    int64_t rest = o, src = 0;
    for (int i = g.rank - 1; i >= 0; --i) {
      src += (rest % g.y_extent[i]) * g.in_stride[i];
      rest /= g.y_extent[i];
    }
    y[o] = x[src];
  }
}

// --- Training batches from a dataset on the device (Backend::gather_augment) ---
// Pixel (y, x) of the record's crop (or the tile), as u8 / 255, after brightness: the CPU's values
// before the contrast mean (augment.cpp, augment_image).
__device__ void cropped_pixel(const uint8_t* tile, int64_t S, const AugmentRecord& r, int64_t y, int64_t x,
                              float p[3]) {
  const fm::U8Pixel pixel{tile, S};
  if (r.crop) {
    fm::resample_crop(pixel, S, r.crop_x, r.crop_y, r.crop_w, r.crop_h, y, x, p);
  } else {
    for (int c = 0; c < 3; ++c) p[c] = pixel(y, x, c);
  }
  if (r.brightness != 1) fm::jitter_brightness(p, r.brightness);
}

__global__ void gather_augment_kernel(const uint8_t* tiles, int64_t N, int64_t S, const AugmentRecord* records,
                                      float* images) {
  __shared__ double shared[kBlock];
  const AugmentRecord r = records[blockIdx.x];
  float* out = images + static_cast<int64_t>(blockIdx.x) * 3 * S * S;
  const int64_t n = S * S;
  if (r.index < 0 || r.index >= N) {  // never after the host's check; loud if it happens
    for (int64_t i = threadIdx.x; i < 3 * n; i += blockDim.x) out[i] = nanf("");
    return;
  }
  const uint8_t* tile = tiles + r.index * 3 * n;
  float mean = 0;
  if (r.contrast != 1) {  // the same branch for every thread of the block
    double local = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      float p[3];
      cropped_pixel(tile, S, r, i / S, i % S, p);
      local += fm::gray(p);
    }
    mean = static_cast<float>(block_sum(local, shared) / static_cast<double>(n));
  }
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t y = i / S, x = i % S;
    int64_t sy, sx;
    fm::flip_rotate_source(y, x, S, r.flip, r.rot, &sy, &sx);
    float p[3];
    cropped_pixel(tile, S, r, sy, sx, p);
    fm::jitter_rest(p, r.contrast, mean, r.saturation, r.hue);
    if (r.stain) fm::hed_jitter(p, r.stain_alpha, r.stain_beta);
    for (int c = 0; c < 3; ++c) out[(c * S + y) * S + x] = fm::imagenet_normalize(p[c], c);
  }
}

// --- Optimizers ---
__global__ void sgd_kernel(float* param, const float* grad, float* buf, int64_t n, double lr, double momentum,
                           double dampening, double weight_decay, bool nesterov, bool first_step) {
  SLIDE_GRID_STRIDE(i, n) {
    fm::sgd_step(param[i], grad[i], buf != nullptr ? buf + i : nullptr, lr, momentum, dampening, weight_decay,
                 nesterov, first_step);
  }
}

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1,
                             double beta2, double eps, double weight_decay, double c1, double c2) {
  SLIDE_GRID_STRIDE(i, n) {
    fm::adamw_step(param[i], grad[i], m[i], v[i], lr, beta1, beta2, eps, weight_decay, fm::AdamCorrections{c1, c2});
  }
}

// Runs f(S{}) with S the storage type of `t`.
template <typename F>
cudaError_t with_storage(CastType t, F&& f) {
  switch (t) {
    case CastType::kF16: return f(F16{});
    case CastType::kBF16: return f(BF16{});
    case CastType::kF32: return f(F32{});
  }
  return cudaErrorInvalidValue;
}

// Launches a channels-last element-wise batch norm kernel on a [rows, C] kernels::LaunchRowsCols
// grid of at least one row (so that the normalising pass writes the statistics when rows is 0).
template <typename Kernel, typename... Args>
cudaError_t launch_bn_nhwc_elementwise(int64_t rows, int64_t C, cudaStream_t stream, Kernel kernel, Args... args) {
  const kernels::LaunchRowsCols g = kernels::launch_rows_cols(rows > 0 ? rows : 1, C, kBlock);
  if (g.blocks_x == 0) return cudaSuccess;
  if (g.blocks_x > 2147483647) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(g.blocks_x), static_cast<unsigned>(g.blocks_y));
  const dim3 block(static_cast<unsigned>(g.threads_x), static_cast<unsigned>(g.threads_y));
  clear_last_error();
  kernel<<<grid, block, 0, stream>>>(args..., rows, C, g);
  return cudaGetLastError();
}
// The reducing passes' grid: C S blocks (NCHW: a block per channel segment) or bn_nhwc_blocks(C, S)
// (channels last: 32 channels a block).
int64_t bn_blocks(bool nhwc, int64_t C, int64_t S) { return nhwc ? kernels::bn_nhwc_blocks(C, S) : C * S; }

}  // namespace

cudaError_t launch_unary(Unary f, CastType t, const void* x, void* y, int64_t n, cudaStream_t stream) {
  return with_storage(t, [&](auto s) {
    using S = decltype(s);
    using T = typename S::T;
    return launch_grid_stride(n, stream, unary_kernel<S>, f, static_cast<const T*>(x), static_cast<T*>(y), n);
  });
}
cudaError_t launch_unary_grad(UnaryGrad f, CastType t, const void* y, const void* dy, void* dx, int64_t n,
                              cudaStream_t stream) {
  return with_storage(t, [&](auto s) {
    using S = decltype(s);
    using T = typename S::T;
    return launch_grid_stride(n, stream, unary_grad_kernel<S>, f, static_cast<const T*>(y), static_cast<const T*>(dy),
                              static_cast<T*>(dx), n);
  });
}
cudaError_t launch_binary(Binary op, CastType ta, const void* a, CastType tb, const void* b, void* y, int64_t n,
                          cudaStream_t stream) {
  if (ta == tb)
    return with_storage(ta, [&](auto s) {
      using S = decltype(s);
      using T = typename S::T;
      return launch_grid_stride(n, stream, binary_kernel<S, S>, op, static_cast<const T*>(a), static_cast<const T*>(b),
                                static_cast<T*>(y), n);
    });
  if (ta != CastType::kF32) return cudaErrorInvalidValue;  // only f32 a (and y) with a half b
  return with_storage(tb, [&](auto s) {
    using SB = decltype(s);
    return launch_grid_stride(n, stream, binary_kernel<F32, SB>, op, static_cast<const float*>(a),
                              static_cast<const typename SB::T*>(b), static_cast<float*>(y), n);
  });
}
cudaError_t launch_fill_rows(CastType t, void* y, const void* row, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (cols < 1) return rows * cols == 0 ? cudaSuccess : cudaErrorInvalidValue;
  return with_storage(t, [&](auto s) {
    using S = decltype(s);
    using T = typename S::T;
    return launch_rows_cols(rows, cols, stream, fill_rows_kernel<S>, static_cast<T*>(y), static_cast<const T*>(row),
                            rows, cols);
  });
}
cudaError_t launch_bias_add(float* y, const float* b, int64_t N, int64_t K, int64_t inner, cudaStream_t stream) {
  return launch_grid_stride(N * K * inner, stream, bias_add_kernel, y, b, K, inner, N * K * inner);
}
cudaError_t launch_bias_grad(CastType t, const void* dy, float* db, int64_t N, int64_t K, int64_t inner,
                             cudaStream_t stream) {
  return with_storage(t, [&](auto s) {
    using S = decltype(s);
    return launch_per_block(K, stream, bias_grad_kernel<S>, static_cast<const typename S::T*>(dy), db, N, K, inner);
  });
}
cudaError_t launch_bn_stats(CastType t, bool nhwc, const void* x, double* stats, int64_t N, int64_t C, int64_t HW,
                            double* partials, cudaStream_t stream) {
  const int64_t S = kernels::bn_segments(N, HW, nhwc);
  cudaError_t e = with_storage(t, [&](auto s) {
    using St = decltype(s);
    const auto* xs = static_cast<const typename St::T*>(x);
    if (nhwc) return launch_per_block(bn_blocks(true, C, S), stream, bn_nhwc_partial_sum_kernel<St>, xs, partials, C,
                                      N * HW, S);
    return launch_per_block(C * S, stream, bn_partial_sum_kernel<St>, xs, partials, N, C, HW, S);
  });
  if (e != cudaSuccess) return e;
  return launch_per_block(C, stream, bn_reduce_kernel, static_cast<const double*>(partials), stats, C, S,
                          double(N * HW), true, static_cast<float*>(nullptr), static_cast<float*>(nullptr));
}
cudaError_t launch_bn_deviations(CastType t, bool nhwc, const void* x, const double* stats, double* devs, int64_t N,
                                 int64_t C, int64_t HW, double* partials, cudaStream_t stream) {
  const int64_t S = kernels::bn_segments(N, HW, nhwc);
  cudaError_t e = with_storage(t, [&](auto s) {
    using St = decltype(s);
    const auto* xs = static_cast<const typename St::T*>(x);
    if (nhwc) return launch_per_block(bn_blocks(true, C, S), stream, bn_nhwc_partial_deviations_kernel<St>, xs, stats,
                                      partials, C, N * HW, S);
    return launch_per_block(C * S, stream, bn_partial_deviations_kernel<St>, xs, stats, partials, N, C, HW, S);
  });
  if (e != cudaSuccess) return e;
  return launch_per_block(C, stream, bn_reduce_kernel, static_cast<const double*>(partials), devs, C, S, 0.0, false,
                          static_cast<float*>(nullptr), static_cast<float*>(nullptr));
}
cudaError_t launch_bn_forward_from_stats(CastType t, bool nhwc, const void* x, const float* gamma, const float* beta,
                                         const double* stats, const double* devs, double eps, double momentum,
                                         float* running_mean, float* running_var, void* y, float* save_mean,
                                         float* save_invstd, bool relu, int64_t N, int64_t C, int64_t HW,
                                         cudaStream_t stream) {
  const int64_t S = kernels::bn_segments(N, HW, nhwc);
  return with_storage(t, [&](auto s) {
    using St = decltype(s);
    using T = typename St::T;
    if (nhwc)
      return launch_bn_nhwc_elementwise(N * HW, C, stream, bn_nhwc_normalise_kernel<St>, static_cast<const T*>(x),
                                        gamma, beta, stats, devs, eps, momentum, running_mean, running_var,
                                        static_cast<T*>(y), save_mean, save_invstd, relu);
    return launch_per_block(C * S, stream, bn_normalise_kernel<St>, static_cast<const T*>(x), gamma, beta, stats, devs,
                            eps, momentum, running_mean, running_var, static_cast<T*>(y), save_mean, save_invstd, relu,
                            N, C, HW, S);
  });
}
cudaError_t launch_bn_backward_reduce(CastType t, bool nhwc, const void* x, const void* dy, const void* relu_y,
                                      const float* save_mean, const float* save_invstd, double* sums, float* dgamma,
                                      float* dbeta, int64_t N, int64_t C, int64_t HW, double* partials,
                                      cudaStream_t stream) {
  const int64_t S = kernels::bn_segments(N, HW, nhwc);
  cudaError_t e = with_storage(t, [&](auto s) {
    using St = decltype(s);
    using T = typename St::T;
    if (nhwc)
      return launch_per_block(bn_blocks(true, C, S), stream, bn_nhwc_partial_grad_kernel<St>, static_cast<const T*>(x),
                              static_cast<const T*>(dy), static_cast<const T*>(relu_y), save_mean, save_invstd,
                              partials, C, N * HW, S);
    return launch_per_block(C * S, stream, bn_partial_grad_kernel<St>, static_cast<const T*>(x),
                            static_cast<const T*>(dy), static_cast<const T*>(relu_y), save_mean, save_invstd, partials,
                            N, C, HW, S);
  });
  if (e != cudaSuccess) return e;
  return launch_per_block(C, stream, bn_reduce_kernel, static_cast<const double*>(partials), sums, C, S, 0.0, false,
                          dgamma, dbeta);
}
cudaError_t launch_bn_backward_elemt(CastType t, bool nhwc, const void* x, const void* dy, const void* relu_y,
                                     const float* gamma, const float* save_mean, const float* save_invstd,
                                     const double* stats, const double* sums, void* dx, int64_t N, int64_t C,
                                     int64_t HW, cudaStream_t stream) {
  const int64_t S = kernels::bn_segments(N, HW, nhwc);
  return with_storage(t, [&](auto s) {
    using St = decltype(s);
    using T = typename St::T;
    if (nhwc)
      return launch_bn_nhwc_elementwise(N * HW, C, stream, bn_nhwc_input_grad_kernel<St>, static_cast<const T*>(x),
                                        static_cast<const T*>(dy), static_cast<const T*>(relu_y), gamma, save_mean,
                                        save_invstd, stats, sums, static_cast<T*>(dx));
    return launch_per_block(C * S, stream, bn_input_grad_kernel<St>, static_cast<const T*>(x),
                            static_cast<const T*>(dy), static_cast<const T*>(relu_y), gamma, save_mean, save_invstd,
                            stats, sums, static_cast<T*>(dx), N, C, HW, S);
  });
}
// One rank: the synchronised pieces, over `scratch` (kernels::bn_forward_scratch_doubles and
// bn_backward_scratch_doubles: the partials, then the per-channel sums).
cudaError_t launch_bn_forward_training(CastType t, bool nhwc, const void* x, const float* gamma, const float* beta,
                                       double eps, double momentum, float* running_mean, float* running_var, void* y,
                                       float* save_mean, float* save_invstd, bool relu, int64_t N, int64_t C,
                                       int64_t HW, double* scratch, cudaStream_t stream) {
  double* partials = scratch;
  double* stats = scratch + kernels::bn_partials(N, C, HW, nhwc);
  double* devs = stats + C + 1;
  cudaError_t e = launch_bn_stats(t, nhwc, x, stats, N, C, HW, partials, stream);
  if (e == cudaSuccess) e = launch_bn_deviations(t, nhwc, x, stats, devs, N, C, HW, partials, stream);
  if (e == cudaSuccess)
    e = launch_bn_forward_from_stats(t, nhwc, x, gamma, beta, stats, devs, eps, momentum, running_mean, running_var, y,
                                     save_mean, save_invstd, relu, N, C, HW, stream);
  return e;
}
cudaError_t launch_bn_forward_inference(CastType t, bool nhwc, const void* x, const float* gamma, const float* beta,
                                        const float* running_mean, const float* running_var, double eps, void* y,
                                        int64_t N, int64_t C, int64_t HW, cudaStream_t stream) {
  return with_storage(t, [&](auto s) {
    using S = decltype(s);
    using T = typename S::T;
    if (nhwc)
      return launch_rows_cols(N * HW, C, stream, bn_nhwc_forward_inference_kernel<S>, static_cast<const T*>(x), gamma,
                              beta, running_mean, running_var, eps, static_cast<T*>(y), N * HW, C);
    return launch_rows_cols(N * C, HW, stream, bn_forward_inference_kernel<S>, static_cast<const T*>(x), gamma, beta,
                            running_mean, running_var, eps, static_cast<T*>(y), C, N * C, HW);
  });
}
cudaError_t launch_bn_backward(CastType t, bool nhwc, const void* x, const void* dy, const void* relu_y,
                               const float* gamma, const float* save_mean, const float* save_invstd, void* dx,
                               float* dgamma, float* dbeta, int64_t N, int64_t C, int64_t HW, double* scratch,
                               cudaStream_t stream) {
  double* partials = scratch;
  double* sums = scratch + 2 * kernels::bn_partials(N, C, HW, nhwc);
  cudaError_t e = launch_bn_backward_reduce(t, nhwc, x, dy, relu_y, save_mean, save_invstd, sums, dgamma, dbeta, N, C,
                                            HW, partials, stream);
  if (e != cudaSuccess) return e;
  return launch_bn_backward_elemt(t, nhwc, x, dy, relu_y, gamma, save_mean, save_invstd, nullptr, sums, dx, N, C, HW,
                                  stream);
}
cudaError_t launch_max_pool_forward(CastType t, bool nhwc, const void* x, void* y, int64_t N, int64_t C, int64_t H,
                                    int64_t W, int64_t P, int64_t Q, int kernel, int stride, int pad,
                                    cudaStream_t stream) {
  if (nhwc && C < 1) return N * C == 0 ? cudaSuccess : cudaErrorInvalidValue;
  constexpr int64_t kInt = 2147483647;
  if (nhwc && (H > kInt || W > kInt || P > kInt || Q > kInt || H * W > kInt || P * Q > kInt))
    return cudaErrorInvalidValue;
  return with_storage(t, [&](auto s) {
    using S = decltype(s);
    using T = typename S::T;
    if (nhwc)
      return launch_rows_cols(N * P * Q, C, stream, max_pool_nhwc_forward_kernel<S>, static_cast<const T*>(x),
                              static_cast<T*>(y), C, static_cast<int>(H), static_cast<int>(W), static_cast<int>(P),
                              static_cast<int>(Q), kernel, stride, pad, N * P * Q);
    return launch_grid_stride(N * C * P * Q, stream, max_pool_forward_kernel<S>, static_cast<const T*>(x),
                              static_cast<T*>(y), C, H, W, P, Q, kernel, stride, pad, N * C * P * Q);
  });
}
cudaError_t launch_conv_epilogue(CastType t, bool nhwc, const void* c, const void* b, const void* z, void* y, int64_t N,
                                 int64_t K, int64_t inner, bool relu, cudaStream_t stream) {
  if (K < 1 || inner < 1) return N * K * inner == 0 ? cudaSuccess : cudaErrorInvalidValue;
  return with_storage(t, [&](auto s) {
    using S = decltype(s);
    using T = typename S::T;
    const int64_t rows = nhwc ? N * inner : N * K, cols = nhwc ? K : inner;
    return launch_rows_cols(rows, cols, stream, conv_epilogue_kernel<S>, static_cast<const T*>(c),
                            static_cast<const T*>(b), static_cast<const T*>(z), static_cast<T*>(y), K, relu, nhwc,
                            rows, cols);
  });
}
cudaError_t launch_max_pool_backward(CastType t, bool nhwc, const void* x, const void* dy, void* dx, int64_t N,
                                     int64_t C, int64_t H, int64_t W, int64_t P, int64_t Q, int kernel, int stride,
                                     int pad, cudaStream_t stream) {
  constexpr int64_t kInt = 2147483647;
  if (H > kInt || W > kInt || P > kInt || Q > kInt || H * W > kInt || P * Q > kInt) return cudaErrorInvalidValue;
  return with_storage(t, [&](auto s) {
    using S = decltype(s);
    using T = typename S::T;
    if (nhwc)
      return launch_rows_cols(N * H * W, C, stream, max_pool_nhwc_backward_kernel<S>, static_cast<const T*>(x),
                              static_cast<const T*>(dy), static_cast<T*>(dx), C, static_cast<int>(H),
                              static_cast<int>(W), static_cast<int>(P), static_cast<int>(Q), kernel, stride, pad,
                              N * H * W);
    return launch_rows_cols(N * C, H * W, stream, max_pool_backward_kernel<S>, static_cast<const T*>(x),
                            static_cast<const T*>(dy), static_cast<T*>(dx), static_cast<int>(H), static_cast<int>(W),
                            static_cast<int>(P), static_cast<int>(Q), kernel, stride, pad, N * C);
  });
}
cudaError_t launch_global_avg_pool_forward(CastType t, bool nhwc, const void* x, void* y, int64_t N, int64_t C,
                                           int64_t HW, cudaStream_t stream) {
  return with_storage(t, [&](auto s) {
    using S = decltype(s);
    using T = typename S::T;
    if (nhwc)
      return launch_grid_stride(N * C, stream, gap_nhwc_forward_kernel<S>, static_cast<const T*>(x),
                                static_cast<T*>(y), C, HW, N * C);
    return launch_grid_stride(N * C, stream, gap_forward_kernel<S>, static_cast<const T*>(x), static_cast<T*>(y), HW,
                              N * C);
  });
}
cudaError_t launch_global_avg_pool_backward(CastType t, bool nhwc, const void* dy, void* dx, int64_t N, int64_t C,
                                            int64_t HW, cudaStream_t stream) {
  return with_storage(t, [&](auto s) {
    using S = decltype(s);
    using T = typename S::T;
    if (nhwc)
      return launch_rows_cols(N * HW, C, stream, gap_nhwc_backward_kernel<S>, static_cast<const T*>(dy),
                              static_cast<T*>(dx), C, HW, N * HW);
    return launch_grid_stride(N * C * HW, stream, gap_backward_kernel<S>, static_cast<const T*>(dy),
                              static_cast<T*>(dx), HW, N * C * HW);
  });
}
// Rows of a warp each (g.blocks blocks of kBlock threads), or a block each when long
// (kernels::launch_rows).
cudaError_t launch_softmax_forward(const float* x, float* y, int64_t R, int64_t C, cudaStream_t stream) {
  return launch_softmax_forward(x, CastType::kF32, y, R, C, C, stream);
}
cudaError_t launch_softmax_forward(const float* x, CastType ty, void* y, int64_t R, int64_t C, int64_t ld,
                                   cudaStream_t stream) {
  if (ld < C) return cudaErrorInvalidValue;
  const kernels::RowsLaunch g = kernels::launch_rows(R, C, kBlock);
  return with_storage(ty, [&](auto s) {
    using SY = decltype(s);
    using T = typename SY::T;
    if (g.rows_per_block > 1) {
      // Rows that fit the lanes' registers (kernels::softmax_cached_values): read once.
      switch (kernels::softmax_cached_values(C)) {
        case 4:
          return launch_per_block(g.blocks, stream, softmax_forward_warp_cached_kernel<SY, 4>, x, static_cast<T*>(y),
                                  R, C, ld);
        case 8:
          return launch_per_block(g.blocks, stream, softmax_forward_warp_cached_kernel<SY, 8>, x, static_cast<T*>(y),
                                  R, C, ld);
        case 16:
          return launch_per_block(g.blocks, stream, softmax_forward_warp_cached_kernel<SY, 16>, x, static_cast<T*>(y),
                                  R, C, ld);
        default:
          return launch_per_block(g.blocks, stream, softmax_forward_warp_kernel<SY>, x, static_cast<T*>(y), R, C, ld);
      }
    }
    return launch_per_block(R, stream, softmax_forward_kernel<SY>, x, static_cast<T*>(y), C, ld);
  });
}
cudaError_t launch_softmax_backward(const float* y, const float* dy, float* dx, int64_t R, int64_t C,
                                    cudaStream_t stream) {
  const kernels::RowsLaunch g = kernels::launch_rows(R, C, kBlock);
  if (g.rows_per_block > 1) return launch_per_block(g.blocks, stream, softmax_backward_warp_kernel, y, dy, dx, R, C);
  return launch_per_block(R, stream, softmax_backward_kernel, y, dy, dx, C);
}
cudaError_t launch_cross_entropy_forward(const float* logits, const int32_t* labels, const float* weights,
                                         double smoothing, float* probs, double* sums, int* bad_label, int64_t N,
                                         int64_t C, cudaStream_t stream) {
  // sums holds 2 + 2N doubles: the two totals, then the per-row weighted nll and weights.
  double* row_nll = sums + 2;
  double* row_w = sums + 2 + N;
  cudaError_t e = launch_per_block(N, stream, cross_entropy_rows_kernel, logits, labels, weights, smoothing, probs,
                                   row_nll, row_w, bad_label, C);
  if (e != cudaSuccess) return e;
  return launch_per_block(1, stream, sum_rows_kernel, row_nll, row_w, sums, N);
}
cudaError_t launch_cross_entropy_backward(const float* probs, const int32_t* labels, const float* weights,
                                          double smoothing, float* dlogits, double* weight_sums, int* bad_label,
                                          int64_t N, int64_t C, cudaStream_t stream) {
  cudaError_t e = launch_per_block(1, stream, label_weight_sum_kernel, labels, weights, weight_sums, bad_label, N, C);
  if (e != cudaSuccess) return e;
  return launch_grid_stride(N * C, stream, cross_entropy_grad_kernel, probs, labels, weights, smoothing, weight_sums,
                            dlogits, C, N * C);
}
cudaError_t launch_cast(const void* x, CastType from, void* y, CastType to, int64_t n, cudaStream_t stream) {
  return launch_grid_stride(n, stream, cast_kernel, x, from, y, to, n);
}
cudaError_t launch_sum_of_squares(const float* x, int64_t n, double* partial, int64_t blocks, double* out,
                                  cudaStream_t stream) {
  if (blocks < 1 || blocks > kSumOfSquaresBlocks) return cudaErrorInvalidValue;
  cudaError_t e = launch_per_block(blocks, stream, sum_of_squares_partial_kernel, x, n, partial);
  if (e != cudaSuccess) return e;
  return launch_per_block(1, stream, sum_partials_kernel, partial, blocks, out);
}
cudaError_t launch_scale(const float* x, double alpha, float* y, int64_t n, cudaStream_t stream) {
  return launch_grid_stride(n, stream, scale_kernel, x, alpha, y, n);
}
cudaError_t launch_layer_norm_forward(CastType tx, const void* x, const float* gamma, const float* beta, double eps,
                                      CastType ty, void* y, int64_t R, int64_t C, cudaStream_t stream) {
  return with_storage(tx, [&](auto sx) {
    using SX = decltype(sx);
    return with_storage(ty, [&](auto sy) {
      using SY = decltype(sy);
      return launch_per_block(R, stream, layer_norm_kernel<SX, SY>, static_cast<const typename SX::T*>(x), gamma,
                              beta, eps, static_cast<typename SY::T*>(y), C);
    });
  });
}
cudaError_t launch_permute(size_t element_bytes, const void* x, void* y, int64_t n, PermuteGeometry g,
                           cudaStream_t stream) {
  if (element_bytes == sizeof(float))
    return launch_grid_stride(n, stream, permute_kernel<float>, static_cast<const float*>(x), static_cast<float*>(y),
                              n, g);
  if (element_bytes == sizeof(uint16_t))
    return launch_grid_stride(n, stream, permute_kernel<uint16_t>, static_cast<const uint16_t*>(x),
                              static_cast<uint16_t*>(y), n, g);
  return cudaErrorInvalidValue;
}
cudaError_t launch_sgd_update(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
                              double momentum, double dampening, double weight_decay, bool nesterov, bool first_step,
                              cudaStream_t stream) {
  return launch_grid_stride(n, stream, sgd_kernel, param, grad, momentum_buf, n, lr, momentum, dampening,
                            weight_decay, nesterov, first_step);
}
cudaError_t launch_adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                                double beta1, double beta2, double eps, double weight_decay, double c1, double c2,
                                cudaStream_t stream) {
  return launch_grid_stride(n, stream, adamw_kernel, param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, c1,
                            c2);
}

cudaError_t launch_gather_augment(const uint8_t* tiles, int64_t N, int64_t S, const AugmentRecord* records, int64_t B,
                                  float* images, cudaStream_t stream) {
  return launch_per_block(B, stream, gather_augment_kernel, tiles, N, S, records, images);
}

}  // namespace slide::train::cuda
