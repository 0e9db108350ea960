// Launch geometry of the cuda backend's own kernels, and how their threads walk a channel, in plain
// C++ (host and device) so that it is unit-tested on the CPU. Every element-wise kernel is a
// grid-stride loop (each thread handles elements i, i + grid * block, ...), so any n is covered by
// a bounded grid.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define SLIDE_LAUNCH_HD __host__ __device__ inline
#define SLIDE_UNROLL_4 _Pragma("unroll 4")
#else
#define SLIDE_LAUNCH_HD inline
#define SLIDE_UNROLL_4
#endif

namespace slide::train::kernels {

struct Launch1d {
  int64_t blocks = 0;  // 0 when n == 0: launch nothing
  int threads = 0;
};

// Blocks of `threads` for n elements: ceil(n / threads), at most max_blocks (then each thread loops).
// 256 threads and 65,535 x 8 blocks cover an H100's 132 SMs at full occupancy many times over.
inline Launch1d launch_1d(int64_t n, int threads = 256, int64_t max_blocks = 65535 * 8) {
  if (n <= 0) return {};
  return {std::min<int64_t>((n + threads - 1) / threads, max_blocks), threads};
}

// Row-wise kernels (softmax over rows of C values): a row of at most kWarpRowMax values goes to one
// warp of 32 threads (shuffles, no block barrier), rows_per_block of them to a block of `threads`;
// a longer row to a whole block (rows_per_block 1). Attention's rows (T = 197 for a ViT at 224 px,
// H * B * T of them a layer) are short and many: a block of 256 threads per row left 59 idle and
// synchronised the block 3 x 8 times per row.
struct RowsLaunch {
  int64_t blocks = 0;  // 0: launch nothing
  int threads = 0;
  int rows_per_block = 0;  // > 1: one warp per row
};
constexpr int64_t kWarpRowMax = 1024;
inline RowsLaunch launch_rows(int64_t rows, int64_t row_length, int threads = 256) {
  if (rows <= 0 || row_length <= 0) return {};
  if (row_length > kWarpRowMax) return {rows, threads, 1};
  const int per_block = threads / 32;
  return {(rows + per_block - 1) / per_block, threads, per_block};
}

// The row stride of attention's score and probability matrices for T tokens: T rounded up to a
// multiple of 8 elements, so that every row and every sequence's matrix starts 16-byte aligned in f32
// and in f16 / bf16. cuBLAS picks its vectorised tensor-core kernels only for aligned leading
// dimensions: with ld = T = 197 (a ViT at 224 px) an H200 ran both attention products on
// cutlass's align1 kernels, 18% of ViT-L/16's GPU time for 3% of its arithmetic. The padding
// columns are never read (the GEMMs' k and n stop at T).
inline int64_t attention_scores_ld(int64_t T) { return T <= 0 ? 0 : (T + 7) / 8 * 8; }

// How many of attention's B sequences the cuda backend runs at once: as many as keep their scores
// and probabilities (H * T * ld elements each of `bytes_per_score`: 4 for f32 scores, 6 with
// half-precision probabilities beside them) within `cap_bytes`, at least 1 and at most B. The
// scratch then grows as T^2 per sequence but not with the batch: a ViT at 448 px (T = 785, 12
// heads) would otherwise take 1.9 GB at batch 64, four times its qkv. B, H, T, ld <= 0: 0.
inline constexpr size_t kAttentionScratchBytes = size_t{256} << 20;
inline int64_t attention_sequences_per_chunk(int64_t B, int64_t H, int64_t T, int64_t ld, int64_t bytes_per_score,
                                             size_t cap_bytes = kAttentionScratchBytes) {
  if (B <= 0 || H <= 0 || T <= 0 || ld <= 0 || bytes_per_score <= 0) return 0;
  const double per_sequence = static_cast<double>(H) * static_cast<double>(T) * static_cast<double>(ld) *
                              static_cast<double>(bytes_per_score);
  const double fit = static_cast<double>(cap_bytes) / per_sequence;
  if (fit >= static_cast<double>(B)) return B;
  return fit < 1.0 ? 1 : static_cast<int64_t>(fit);
}

// The values a lane holds in registers when a warp's row of `row_length` is cached (the cuda
// softmax's softmax_forward_warp_cached_kernel): 4, 8 or 16 per lane (rows of up to 128, 256 or
// 512 values), or 0 for a longer row, read from memory as it goes. A sum over a lane's values adds
// 0.0 past the row's end, which changes no sum.
inline int softmax_cached_values(int64_t row_length) {
  if (row_length <= 0) return 0;
  for (int k : {4, 8, 16})
    if (row_length <= int64_t{k} * 32) return k;
  return 0;
}

// Kernels over a [rows, cols] matrix whose per-element work depends on the row or the column alone
// (a bias row broadcast over a linear layer's output; a convolution epilogue's per-channel bias,
// the channel being the column when channels are last and the row's (row % K) when they are
// planes): a 2-D grid, so that each thread knows its column without a 64-bit division per element
// (which on a GPU costs more than the store it indexes: an H200 profile of ViT-L/16 at bf16 had
// the bias broadcast, y[i] = row[i % cols], at 21% of the GPU time, ten times the memory's time).
// Blocks of threads_x x threads_y threads: threads_x a multiple of 32 covering cols (so short rows
// leave no warp mostly idle), threads_y = threads / threads_x rows at a time; blocks_x blocks across
// the columns, blocks_y (at most max_blocks_y, CUDA's grid y limit) down the rows, each thread
// stepping by blocks_y * threads_y rows (walk_rows_cols).
struct LaunchRowsCols {
  int64_t blocks_x = 0, blocks_y = 0;  // 0: launch nothing
  int threads_x = 0, threads_y = 0;
};
inline LaunchRowsCols launch_rows_cols(int64_t rows, int64_t cols, int threads = 256, int64_t max_blocks_y = 65535) {
  if (rows <= 0 || cols <= 0 || threads < 32) return {};
  const int64_t warps = (cols + 31) / 32;
  const int tx = static_cast<int>(std::min<int64_t>(warps * 32, threads / 32 * 32));
  const int ty = threads / tx;
  return {(cols + tx - 1) / tx, std::min<int64_t>((rows + ty - 1) / ty, max_blocks_y), tx, ty};
}
// Thread (bx, by, tx, ty) of a LaunchRowsCols grid of (gx, gy) blocks: calls f(r, c) for its column
// c = bx * threads_x + tx (if c < cols) and rows r = by * threads_y + ty, then every
// gy * threads_y rows further, in increasing order; f computes r * cols + c itself (a multiply).
// The column of thread x tx in block x bx (kernels that load a per-column value once ask it first).
SLIDE_LAUNCH_HD int64_t rows_cols_column(const LaunchRowsCols& g, int64_t bx, int64_t tx) {
  return bx * g.threads_x + tx;
}
template <typename F>
SLIDE_LAUNCH_HD void walk_rows_cols(int64_t rows, int64_t cols, const LaunchRowsCols& g, int64_t bx, int64_t by,
                                    int64_t tx, int64_t ty, F&& f) {
  const int64_t c = rows_cols_column(g, bx, tx);
  if (c >= cols) return;
  const int64_t step = g.blocks_y * g.threads_y;
  for (int64_t r = by * g.threads_y + ty; r < rows; r += step) f(r, c);
}

// Channel c of an [N, C, HW] tensor (NCHW with HW = H * W), walked with stride T from t: calls
// f(index) for the channel's values j = t, t + T, t + 2T, ... < N * HW, in that order, at
// index = (j / HW * C + c) * HW + j % HW. This is how a block's thread t (T = blockDim.x) walks a
// channel in the bias-gradient kernel (one block per channel), which sums in this order. The
// quotient and remainder are carried from one value to the next (the stride as whole planes and a
// remainder, at most one carry a step) instead of a 64-bit division per value, which on a GPU
// costs more than the load it indexes; the values and their order are the division's. A counted
// loop, unrolled by 4 on the device, so that a thread's next loads are issued before the previous
// values are used (the order of f's calls, and so of any sum, is unchanged).
// for_channel_range walks only the channel's values j in [begin, end), from j = begin + t (batch
// norm's segments, bn_segment).
template <typename F>
SLIDE_LAUNCH_HD void for_channel_range(int64_t N, int64_t C, int64_t HW, int64_t c, int64_t begin, int64_t end,
                                       int64_t t, int64_t T, F&& f) {
  if (end > N * HW) end = N * HW;  // (no std::min: host and device)
  const int64_t j0 = begin + t;
  if (N <= 0 || HW <= 0 || T <= 0 || t < 0 || begin < 0 || j0 >= end) return;
  const int64_t plane = C * HW;                 // one sample's elements
  const int64_t dn = T / HW, dh = T % HW;       // the stride: whole samples, then the rest
  int64_t hw = j0 % HW;
  int64_t base = (j0 / HW * C + c) * HW;        // the current sample's channel c
  const int64_t count = (end - j0 + T - 1) / T;  // values j = j0 + k T < end
  const int64_t step = dn * plane;
  SLIDE_UNROLL_4
  for (int64_t k = 0; k < count; ++k) {
    f(base + hw);
    base += step;
    hw += dh;
    if (hw >= HW) {
      hw -= HW;
      base += plane;
    }
  }
}
template <typename F>
SLIDE_LAUNCH_HD void for_channel(int64_t N, int64_t C, int64_t HW, int64_t c, int64_t t, int64_t T, F&& f) {
  for_channel_range(N, C, HW, c, 0, N * HW, t, T, f);
}

// Batch norm on the GPU: each channel's N * HW values cut into `segments` consecutive runs, one
// block each (C * segments blocks), so that a layer of few channels and large maps (ResNet's stem:
// 64 channels of 112 x 112) still fills the GPU. (With one block per channel, an H200 profile of a
// ResNet-50 training step had batch norm at 30% of the GPU time: 64 blocks leave most of 132 SMs
// idle.) A block's partial sums are reduced per channel in a fixed order, so that results repeat
// bit for bit. The count depends on the shape only (not on the GPU): about kBnSegmentValues values
// a segment, at most kBnMaxSegments (the reducing block's threads).
// Channels last (nhwc, bn_nhwc_segment below), a block takes 32 channels of a segment of rows, and
// its 8 lanes walk the rows one after another: segments of about kBnNhwcSegmentRows rows (64 a
// lane), at most kBnMaxSegments, so that the narrow, short layers (ResNet-50's layer4 at batch 128:
// 512 channels of 6,272 rows) still spread over the GPU (16 blocks with NCHW's count, 208 here).
constexpr int64_t kBnSegmentValues = 8192;
constexpr int64_t kBnNhwcSegmentRows = 512;
constexpr int64_t kBnMaxSegments = 256;
inline int64_t bn_segments(int64_t N, int64_t HW, bool nhwc = false) {
  const int64_t values = N * HW;
  if (values <= 0) return 1;
  const int64_t length = nhwc ? kBnNhwcSegmentRows : kBnSegmentValues;
  return std::min(kBnMaxSegments, (values + length - 1) / length);
}
// The f64 scratch of the cuda batch norm passes: one partial per segment (C * segments; two per
// segment backward), then the per-channel sums (forward: stats [C + 1] and devs [C]; backward:
// sums [2C]).
inline int64_t bn_partials(int64_t N, int64_t C, int64_t HW, bool nhwc = false) {
  return C * bn_segments(N, HW, nhwc);
}
inline int64_t bn_forward_scratch_doubles(int64_t N, int64_t C, int64_t HW, bool nhwc = false) {
  return bn_partials(N, C, HW, nhwc) + 2 * C + 1;
}
inline int64_t bn_backward_scratch_doubles(int64_t N, int64_t C, int64_t HW, bool nhwc = false) {
  return 2 * bn_partials(N, C, HW, nhwc) + 2 * C;
}
// In bytes, as the cuda backend allocates it (at least one value) and reports it to the memory
// planner (Backend::batch_norm_scratch_bytes); the simulated device takes the same (NCHW: it runs
// channels-last batch norm on plain copies).
inline int64_t bn_scratch_bytes(bool backward, int64_t N, int64_t C, int64_t HW, bool nhwc = false) {
  const int64_t doubles =
      backward ? bn_backward_scratch_doubles(N, C, HW, nhwc) : bn_forward_scratch_doubles(N, C, HW, nhwc);
  return 8 * (doubles > 1 ? doubles : 1);
}
// Block b of a batch norm grid of C * segments blocks: channel c = b / segments, and that
// channel's values j in [begin, end), the segment's share of `values` = N * HW (ceil(values /
// segments) each; the last ones may be shorter, or empty).
struct ChannelSegment {
  int64_t c = 0, begin = 0, end = 0;
};
SLIDE_LAUNCH_HD ChannelSegment bn_segment(int64_t block, int64_t segments, int64_t values) {
  const int64_t c = block / segments, s = block - c * segments;
  const int64_t length = (values + segments - 1) / segments;
  const int64_t begin = s * length < values ? s * length : values;
  return {c, begin, begin + length < values ? begin + length : values};
}

// Batch norm on channels-last tensors (Layout::kNhwc, channels-last training): x seen as a matrix
// of rows = N * HW pixels by C channels, the channel being the column. A block of kBlockThreads =
// kBnNhwcColumns x kBnNhwcLanes threads takes kBnNhwcColumns consecutive channels (a warp reads 32
// neighbouring values of one row: coalesced, where walking one channel down the rows would read one
// value per 32-byte sector) over one segment of rows: bn_segment's share for bn_segments(N, HW,
// true) segments, the f64 partials laid out as NCHW's (partials[c * segments + s]) for the same
// reduction (bn_reduce). Lane l of the block
// (thread / kBnNhwcColumns) walks rows begin + l, begin + l + kBnNhwcLanes, ...; the lanes' sums are
// then added in lane order, a fixed order: results repeat bit for bit.
constexpr int64_t kBnNhwcColumns = 32, kBnNhwcLanes = 8;
inline int64_t bn_nhwc_blocks(int64_t C, int64_t segments) {
  return (C + kBnNhwcColumns - 1) / kBnNhwcColumns * segments;
}
struct NhwcSegment {
  int64_t c = 0, segment = 0, begin = 0, end = 0;  // c >= C: an idle thread of the last block column
};
// Thread `thread` of block `block` of a grid of bn_nhwc_blocks(C, segments) blocks over `rows`
// rows: its channel and its segment's rows [begin, end).
SLIDE_LAUNCH_HD NhwcSegment bn_nhwc_segment(int64_t block, int64_t thread, int64_t segments, int64_t rows) {
  const int64_t tile = block / segments, s = block - tile * segments;
  const ChannelSegment r = bn_segment(s, segments, rows);
  return {tile * kBnNhwcColumns + thread % kBnNhwcColumns, s, r.begin, r.end};
}
// Calls f(index) for lane `lane`'s values of channel seg.c: rows begin + lane, + kBnNhwcLanes, ...
// < end, at index = row * C + c, in that order.
template <typename F>
SLIDE_LAUNCH_HD void for_nhwc_segment(const NhwcSegment& seg, int64_t lane, int64_t C, F&& f) {
  if (seg.c >= C) return;
  SLIDE_UNROLL_4
  for (int64_t r = seg.begin + lane; r < seg.end; r += kBnNhwcLanes) f(r * C + seg.c);
}

// Channels last (Layout::kNhwc): the storage position of element j of an [N, C, H, W] tensor in
// NCHW order (j = ((n C + c) H + h) W + w, HW = H W) when it is stored [N][H][W][C]:
// (n HW + h W + w) C + c. The cuda kernels that walk an NHWC tensor in NCHW order (max pooling's
// window scan, formulas.h max_pool_argmax) read and write through it.
SLIDE_LAUNCH_HD int64_t nhwc_position(int64_t j, int64_t C, int64_t HW) {
  const int64_t plane = C * HW;
  const int64_t n = j / plane, rest = j - n * plane, c = rest / HW, hw = rest - c * HW;
  return (n * HW + hw) * C + c;
}

}  // namespace slide::train::kernels
