// The cuda backend's host-side logic, tested on the CPU (no GPU needed): launch geometry, the
// convolution-algorithm order, the device checks every backend shares, and the host <-> device
// door (Backend::upload / download) on host backends.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>

#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <string>
#include <unordered_set>
#include <tuple>
#include <vector>

#include "../../libtrain/src/cuda/conv_plan.h"
#include "../../libtrain/src/kernels/launch.h"
#include "slide/train/backend.h"
#include "slide/train/caching_allocator.h"
#include "slide/train/device_select.h"
#include "slide/train/loss_scaler.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_cuda_host {

using namespace slide::train;
using slide::core::StatusCode;

TEST_CASE("launch_1d: ceil(n / threads) blocks, bounded; nothing for n == 0") {
  CHECK(kernels::launch_1d(0).blocks == 0);
  CHECK(kernels::launch_1d(-5).blocks == 0);
  CHECK(kernels::launch_1d(1).blocks == 1);
  CHECK(kernels::launch_1d(1).threads == 256);
  CHECK(kernels::launch_1d(256).blocks == 1);
  CHECK(kernels::launch_1d(257).blocks == 2);
  // A ResNet-50 activation of batch 256 (256 x 256 x 56 x 56 = 205,520,896 elements): capped, and
  // the grid-stride loop covers the rest (blocks x threads x rounds >= n).
  const int64_t n = 256LL * 256 * 56 * 56;
  const auto g = kernels::launch_1d(n);
  CHECK(g.blocks == 65535 * 8);
  CHECK(g.blocks * g.threads * ((n + g.blocks * g.threads - 1) / (g.blocks * g.threads)) >= n);
}

TEST_CASE("launch_rows: a warp per row up to 1024 values, 8 rows a block of 256; a block per longer row") {
  auto g = kernels::launch_rows(37, 197);
  CHECK(g.rows_per_block == 8);
  CHECK(g.threads == 256);
  CHECK(g.blocks == 5);  // 40 >= 37 rows
  g = kernels::launch_rows(16 * 64 * 197, 197);  // UNI's attention at batch 64: every row covered once
  CHECK(g.blocks * g.rows_per_block >= 16 * 64 * 197);
  CHECK((g.blocks - 1) * g.rows_per_block < 16 * 64 * 197);
  g = kernels::launch_rows(2, 1024);
  CHECK(g.rows_per_block == 8);
  g = kernels::launch_rows(2, 1025);
  CHECK(g.rows_per_block == 1);
  CHECK(g.blocks == 2);
  CHECK(kernels::launch_rows(0, 5).blocks == 0);
  CHECK(kernels::launch_rows(5, 0).blocks == 0);
}

TEST_CASE("attention_sequences_per_chunk: the scores of a chunk stay within the cap, at least one sequence") {
  using kernels::attention_sequences_per_chunk;
  const int64_t ld197 = kernels::attention_scores_ld(197);
  // ViT-L/16 at 224 px, batch 64: 16 * 197 * 200 * 4 B = 2.5 MB a sequence, all 64 in one chunk.
  CHECK(attention_sequences_per_chunk(64, 16, 197, ld197, 4) == 64);
  // ViT-B/16 at 448 px (CONCH), batch 64: 12 * 785 * 792 * 4 B = 29.8 MB a sequence -> 8 of them.
  const int64_t ld785 = kernels::attention_scores_ld(785);
  const int64_t c = attention_sequences_per_chunk(64, 12, 785, ld785, 4);
  CHECK(c == 8);
  CHECK(static_cast<size_t>(c * 12 * 785 * ld785 * 4) <= kernels::kAttentionScratchBytes);
  CHECK(static_cast<size_t>((c + 1) * 12 * 785 * ld785 * 4) > kernels::kAttentionScratchBytes);
  // Half-precision probabilities beside the f32 scores: 6 bytes an element, fewer sequences.
  CHECK(attention_sequences_per_chunk(64, 12, 785, ld785, 6) == 5);
  // One sequence over the cap still runs (alone); a batch under it runs whole.
  CHECK(attention_sequences_per_chunk(8, 16, 4000, 4000, 4) == 1);
  CHECK(attention_sequences_per_chunk(3, 2, 8, 8, 4, 1) == 1);
  CHECK(attention_sequences_per_chunk(3, 2, 8, 8, 4, 2 * 8 * 8 * 4 * 2) == 2);
  CHECK(attention_sequences_per_chunk(3, 2, 8, 8, 4, 1 << 20) == 3);
  CHECK(attention_sequences_per_chunk(0, 2, 8, 8, 4) == 0);
  CHECK(attention_sequences_per_chunk(3, 2, 0, 0, 4) == 0);
}

TEST_CASE("attention_scores_ld: rows of scores and probabilities start 16-byte aligned in f32 and in 16-bit types") {
  CHECK(kernels::attention_scores_ld(0) == 0);
  CHECK(kernels::attention_scores_ld(1) == 8);
  CHECK(kernels::attention_scores_ld(197) == 200);  // ViT-B/L at 224 px
  CHECK(kernels::attention_scores_ld(261) == 264);  // Virchow2
  CHECK(kernels::attention_scores_ld(256) == 256);  // already aligned: no padding
  for (int64_t T = 1; T <= 600; ++T) {
    const int64_t ld = kernels::attention_scores_ld(T);
    CHECK(ld >= T);
    CHECK(ld - T < 8);
    CHECK((ld * 2) % 16 == 0);  // a row of f16 / bf16; f32's 4 bytes follow
    CHECK((T * ld * 2) % 16 == 0);  // a sequence's matrix, as the strided-batched GEMMs step
  }
}

TEST_CASE("softmax_cached_values: a warp's row in registers up to 512 values, the fewest per lane that hold it") {
  CHECK(kernels::softmax_cached_values(0) == 0);
  CHECK(kernels::softmax_cached_values(1) == 4);
  CHECK(kernels::softmax_cached_values(128) == 4);
  CHECK(kernels::softmax_cached_values(129) == 8);
  CHECK(kernels::softmax_cached_values(197) == 8);  // ViT at 224 px, patch 16: 196 + class token
  CHECK(kernels::softmax_cached_values(261) == 16);  // Virchow2: 256 + class + 4 registers
  CHECK(kernels::softmax_cached_values(512) == 16);
  CHECK(kernels::softmax_cached_values(513) == 0);  // read as it goes
  for (int64_t c = 1; c <= 512; ++c) CHECK(kernels::softmax_cached_values(c) * 32 >= c);
}

TEST_CASE("launch_rows_cols: every element of [rows, cols] is visited once, by a thread that owns its column") {
  struct Case {
    int64_t rows, cols, max_blocks_y;
  };
  // A ViT-L/16 linear at batch 64 (qkv), a ResNet layer3 epilogue channels last (K = 1024) and in
  // planes (inner = 14 x 14), a 1-column and a 33-column matrix, short rows, and a grid y cap that
  // makes threads loop.
  for (const Case k : {Case{64 * 197, 3072, 65535}, Case{256 * 196, 1024, 65535}, Case{256 * 1024, 196, 65535},
                       Case{5, 1, 65535}, Case{7, 33, 65535}, Case{1, 8, 65535}, Case{1000, 40, 3}}) {
    CAPTURE(k.rows);
    CAPTURE(k.cols);
    const auto g = kernels::launch_rows_cols(k.rows, k.cols, 256, k.max_blocks_y);
    REQUIRE(g.threads_x % 32 == 0);
    REQUIRE(g.threads_x * g.threads_y <= 256);
    CHECK(g.threads_x <= ((k.cols + 31) / 32) * 32);  // no warp wholly past the last column
    CHECK(g.blocks_y <= k.max_blocks_y);
    if (k.rows * k.cols > 2'000'000) {  // the geometry only, on the large shapes
      CHECK(g.blocks_x * g.threads_x >= k.cols);
      CHECK(g.blocks_y * g.threads_y >= std::min(k.rows, k.max_blocks_y * g.threads_y));
      continue;
    }
    std::vector<int> seen(static_cast<size_t>(k.rows * k.cols), 0);
    bool column_mismatch = false, order = true;
    for (int64_t bx = 0; bx < g.blocks_x; ++bx)
      for (int64_t by = 0; by < g.blocks_y; ++by)
        for (int64_t ty = 0; ty < g.threads_y; ++ty)
          for (int64_t tx = 0; tx < g.threads_x; ++tx) {
            int64_t last = -1;
            kernels::walk_rows_cols(k.rows, k.cols, g, bx, by, tx, ty, [&](int64_t r, int64_t c) {
              column_mismatch |= c != bx * g.threads_x + tx;
              order &= r > last;
              last = r;
              ++seen[static_cast<size_t>(r * k.cols + c)];
            });
          }
    CHECK_FALSE(column_mismatch);
    CHECK(order);
    CHECK(std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; }));
  }
  CHECK(kernels::launch_rows_cols(0, 5).blocks_x == 0);
  CHECK(kernels::launch_rows_cols(5, 0).blocks_y == 0);
  const auto narrow = kernels::launch_rows_cols(100, 64);  // K = 64 channels last: 4 rows a block
  CHECK(narrow.threads_x == 64);
  CHECK(narrow.threads_y == 4);
}

TEST_CASE("for_channel_range: a segment's walk is the division's over [begin, end), in order") {
  struct Case {
    int64_t N, C, HW, T, begin, end;
  };
  for (Case k : {Case{3, 5, 7, 4, 0, 21}, Case{3, 5, 7, 4, 5, 13}, Case{4, 64, 3136, 256, 8192, 12544},
                 Case{2, 3, 49, 256, 50, 98}, Case{2, 2, 1000, 3, 999, 1001}, Case{3, 2, 10, 8, 25, 40}}) {
    CAPTURE(k.begin);
    CAPTURE(k.end);
    for (int64_t c : {int64_t{0}, k.C - 1})
      for (int64_t t : {int64_t{0}, int64_t{1}, k.T - 1}) {
        std::vector<int64_t> want, got;
        for (int64_t j = k.begin + t; j < std::min(k.end, k.N * k.HW); j += k.T)
          want.push_back((j / k.HW * k.C + c) * k.HW + j % k.HW);
        kernels::for_channel_range(k.N, k.C, k.HW, c, k.begin, k.end, t, k.T, [&](int64_t i) { got.push_back(i); });
        CHECK(got == want);
      }
  }
}

TEST_CASE("bn_segment: a channel's segments cut its N * HW values into consecutive runs, in order, covering each once") {
  CHECK(kernels::bn_segments(64, 112 * 112) == 98);  // ResNet's stem at batch 64: 6,272 blocks of its 64 channels
  CHECK(kernels::bn_segments(64, 7 * 7) == 1);
  CHECK(kernels::bn_segments(256, 112 * 112) == kernels::kBnMaxSegments);
  CHECK(kernels::bn_segments(0, 5) == 1);
  for (const auto& vs : {std::pair<int64_t, int64_t>{10, 4}, {9, 4}, {1, 1}, {3, 7}, {802816, 98}, {8193, 2},
                         {100, 256}}) {
    const int64_t values = vs.first, segments = vs.second;
    CAPTURE(values);
    CAPTURE(segments);
    for (int64_t c : {int64_t{0}, int64_t{5}}) {
      int64_t next = 0;
      for (int64_t s = 0; s < segments; ++s) {
        const auto seg = kernels::bn_segment(c * segments + s, segments, values);
        CHECK(seg.c == c);
        CHECK(seg.begin == next);
        CHECK(seg.end >= seg.begin);
        CHECK(seg.end - seg.begin <= (values + segments - 1) / segments);
        next = seg.end;
      }
      CHECK(next == values);
    }
  }
}

TEST_CASE("bn_nhwc_segment: a channels-last batch norm grid visits every (row, channel) once, in the block and "
          "segment whose partial sum holds that channel's segment") {
  CHECK(kernels::kBnNhwcColumns * kernels::kBnNhwcLanes == 256);  // kernels.cu's block
  // ResNet-50's layer4 at batch 128 (6,272 rows): 13 segments of 512 rows; 512 channels are 16
  // block columns, 208 blocks (NCHW's count, one segment, would leave 16).
  CHECK(kernels::bn_segments(128, 49, true) == 13);
  CHECK(kernels::bn_nhwc_blocks(512, kernels::bn_segments(128, 49, true)) == 208);
  CHECK(kernels::bn_segments(128, 112 * 112, true) == kernels::kBnMaxSegments);  // the stem: capped
  CHECK(kernels::bn_segments(0, 5, true) == 1);
  CHECK(kernels::bn_scratch_bytes(false, 128, 512, 49, true) == 8 * (512 * 13 + 2 * 512 + 1));
  for (const auto& shape : {std::tuple<int64_t, int64_t, int64_t>{3, 5, 42}, {2, 33, 9}, {1, 64, 8193 * 2}, {2, 5, 70000},
                             {7, 13, 1}, {4, 32, 3000}}) {
    // Plain locals, not a structured binding: the lambdas below use them (clang before 16).
    const int64_t N = std::get<0>(shape), C = std::get<1>(shape), HW = std::get<2>(shape);
    CAPTURE(N);
    CAPTURE(C);
    CAPTURE(HW);
    const int64_t rows = N * HW, segments = kernels::bn_segments(N, HW, true);
    std::vector<int> seen(static_cast<size_t>(rows * C), 0);
    for (int64_t b = 0; b < kernels::bn_nhwc_blocks(C, segments); ++b)
      for (int64_t t = 0; t < kernels::kBnNhwcColumns * kernels::kBnNhwcLanes; ++t) {
        const kernels::NhwcSegment seg = kernels::bn_nhwc_segment(b, t, segments, rows);
        // The segment is NCHW's segment of the same index (same partial sums' layout).
        const kernels::ChannelSegment plain = kernels::bn_segment(seg.segment, segments, rows);
        REQUIRE(seg.begin == plain.begin);
        REQUIRE(seg.end == plain.end);
        REQUIRE(seg.segment == b % segments);
        int64_t last = -1;
        kernels::for_nhwc_segment(seg, t / kernels::kBnNhwcColumns, C, [&](int64_t i) {
          REQUIRE(i % C == seg.c);
          REQUIRE(i / C >= seg.begin);
          REQUIRE(i / C < seg.end);
          REQUIRE(i > last);  // rows in increasing order
          last = i;
          ++seen[static_cast<size_t>(i)];
        });
        if (seg.c >= C) CHECK(last == -1);
      }
    bool once = true;
    for (int v : seen) once = once && v == 1;
    CHECK(once);
  }
}

TEST_CASE("for_channel: a thread's walk over a channel is the division's, value for value, in order") {
  // The batch norm and bias-gradient kernels sum in this order: it must be (j / HW, j % HW) for
  // j = t, t + T, ... exactly (the results are then the same bits as with the divisions).
  struct Case {
    int64_t N, C, HW, T;
  };
  for (Case k : {Case{1, 1, 1, 1}, Case{3, 5, 7, 4}, Case{2, 3, 49, 256}, Case{4, 64, 3136, 256}, Case{5, 2, 256, 256},
                 Case{3, 4, 300, 256}, Case{7, 3, 1, 256}, Case{2, 2, 1000, 3}}) {
    CAPTURE(k.HW);
    CAPTURE(k.T);
    for (int64_t c : {int64_t{0}, k.C - 1}) {
      for (int64_t t : {int64_t{0}, int64_t{1}, k.T / 2, k.T - 1}) {
        std::vector<int64_t> want, got;
        for (int64_t j = t; j < k.N * k.HW; j += k.T) want.push_back((j / k.HW * k.C + c) * k.HW + j % k.HW);
        kernels::for_channel(k.N, k.C, k.HW, c, t, k.T, [&](int64_t i) { got.push_back(i); });
        CHECK(got == want);
      }
    }
  }
  int calls = 0;
  kernels::for_channel(0, 3, 4, 0, 0, 256, [&](int64_t) { ++calls; });
  kernels::for_channel(3, 3, 0, 0, 0, 256, [&](int64_t) { ++calls; });
  CHECK(calls == 0);
}

TEST_CASE("order_candidates: deterministic runnable algorithms first, in cuDNN's order, without repeats; one per "
          "algorithm and math type") {
  using cuda::AlgoCandidate;
  const std::vector<AlgoCandidate> from_cudnn = {
      {7, true, false, 100},  // fastest, but non-deterministic
      {1, true, true, 4096},
      {5, false, true, 0},    // not runnable for this shape
      {1, true, true, 4096},  // listed twice
      {0, true, true, 0},
  };
  auto strict = cuda::order_candidates(from_cudnn, false);
  REQUIRE(strict.size() == 2);
  CHECK(strict[0].algo == 1);
  CHECK(strict[1].algo == 0);
  auto any = cuda::order_candidates(from_cudnn, true);
  REQUIRE(any.size() == 3);
  CHECK(any[2].algo == 7);
  CHECK(cuda::order_candidates({{3, false, true, 0}}, true).empty());
  // Under tensor-op math the same algorithm is listed once per math type (CUDNN_TENSOR_OP_MATH = 1,
  // CUDNN_FMA_MATH = 3): two candidates, each with its own workspace; the same pair twice is one.
  const std::vector<AlgoCandidate> math_types = {
      {1, true, true, 8192, 1}, {1, true, true, 1024, 3}, {1, true, true, 8192, 1}};
  auto both = cuda::order_candidates(math_types, false);
  REQUIRE(both.size() == 2);
  CHECK((both[0].math_type == 1 && both[0].workspace_bytes == 8192));
  CHECK((both[1].math_type == 3 && both[1].workspace_bytes == 1024));
}

TEST_CASE("choose_candidates: deterministic algorithms only when cuDNN has one, else its non-deterministic ones; "
          "describe names the convolution") {
  using cuda::AlgoCandidate;
  bool deterministic = false;
  // A deterministic candidate exists: only those, even if a non-deterministic one is faster.
  auto both = cuda::choose_candidates({{7, true, false, 100}, {1, true, true, 4096}}, &deterministic);
  CHECK(deterministic);
  REQUIRE(both.size() == 1);
  CHECK(both[0].algo == 1);
  // None deterministic (or none runnable that is): the runnable non-deterministic ones, in order.
  auto none = cuda::choose_candidates({{7, true, false, 100}, {2, false, true, 0}, {4, true, false, 0}}, &deterministic);
  CHECK_FALSE(deterministic);
  REQUIRE(none.size() == 2);
  CHECK(none[0].algo == 7);
  CHECK(none[1].algo == 4);
  CHECK(cuda::choose_candidates({{2, false, true, 0}}, &deterministic).empty());
  cuda::ConvKey k;
  k.direction = cuda::ConvDirection::kBackwardFilter;
  k.N = 256, k.C = 3, k.H = 224, k.W = 224, k.K = 64, k.R = 7, k.S = 7, k.stride = 2, k.pad = 3;
  k.math = cuda::ConvMath::kTensorOp;
  k.storage = cuda::ConvStorage::kF16;
  k.nhwc = true;
  CHECK(cuda::describe(k) == "backward filter 256x3x224x224 (f16, channels last) * 64x7x7, stride 2, pad 3, "
                             "tensor-op math");
}

TEST_CASE("fits_cudnn_descriptor: at most 2^31 - 1 elements, products checked without overflow") {
  CHECK(cuda::fits_cudnn_descriptor(64, 64, 112, 112));
  CHECK(cuda::fits_cudnn_descriptor(1, 1, 1, 2147483647));
  CHECK_FALSE(cuda::fits_cudnn_descriptor(1, 1, 2, 1073741824));  // 2^31
  CHECK(cuda::fits_cudnn_descriptor(2674, 64, 112, 112));        // ResNet's stem output at 224 px: 2,146,729,984
  CHECK_FALSE(cuda::fits_cudnn_descriptor(2675, 64, 112, 112));  // 2,147,532,800
  CHECK_FALSE(cuda::fits_cudnn_descriptor(int64_t{1} << 40, int64_t{1} << 40, 1, 1));  // no wrap-around
  CHECK(cuda::fits_cudnn_descriptor(0, 3, 224, 224));
  CHECK_FALSE(cuda::fits_cudnn_descriptor(-1, 3, 224, 224));
}

TEST_CASE("nhwc_position: element (n, c, h, w) of an NCHW walk lands at [n][h][w][c], a permutation") {
  for (auto [N, C, H, W] : {std::array<int64_t, 4>{2, 3, 4, 5}, std::array<int64_t, 4>{1, 16, 7, 7},
                            std::array<int64_t, 4>{3, 1, 2, 9}}) {
    std::vector<int> hits(static_cast<size_t>(N * C * H * W), 0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t w = 0; w < W; ++w) {
            const int64_t j = ((n * C + c) * H + h) * W + w;
            const int64_t at = kernels::nhwc_position(j, C, H * W);
            REQUIRE(at == ((n * H + h) * W + w) * C + c);
            ++hits[static_cast<size_t>(at)];
          }
    for (int h : hits) REQUIRE(h == 1);
  }
}

TEST_CASE("ConvKey: every field tells shapes apart") {
  using cuda::ConvKey;
  const ConvKey base{cuda::ConvDirection::kForward, 8, 3, 224, 224, 64, 7, 7, 2, 3};
  std::unordered_set<ConvKey, cuda::ConvKeyHash> keys{base};
  auto differs = [&](ConvKey k) {
    CHECK_FALSE(k == base);
    keys.insert(k);
  };
  ConvKey k = base;
  k.direction = cuda::ConvDirection::kBackwardFilter;
  differs(k);
  k = base, k.N = 7, differs(k);
  k = base, k.C = 4, differs(k);
  k = base, k.H = 225, differs(k);
  k = base, k.W = 225, differs(k);
  k = base, k.K = 65, differs(k);
  k = base, k.R = 3, differs(k);
  k = base, k.S = 3, differs(k);
  k = base, k.stride = 1, differs(k);
  k = base, k.pad = 1, differs(k);
  k = base, k.math = cuda::ConvMath::kTensorOp, differs(k);
  k = base, k.math = cuda::ConvMath::kTensorOpConvert, differs(k);
  k = base, k.storage = cuda::ConvStorage::kF16, differs(k);
  k = base, k.storage = cuda::ConvStorage::kBF16, differs(k);
  k = base, k.nhwc = true, differs(k);
  CHECK(keys.size() == 16);
  CHECK(keys.count(base) == 1);
}

TEST_CASE("math precision on cuda: cuDNN FMA math only for fp32; cuBLAS's compute type per precision") {
  CHECK(cuda::conv_math(MathPrecision::kFp32) == cuda::ConvMath::kFma);
  CHECK(cuda::conv_math(MathPrecision::kTf32) == cuda::ConvMath::kTensorOp);
  CHECK(cuda::conv_math(MathPrecision::kBf16) == cuda::ConvMath::kTensorOp);  // TF32: cuDNN has no bf16 for f32 data
  CHECK(cuda::conv_math(MathPrecision::kFp16) == cuda::ConvMath::kTensorOpConvert);
  CHECK(cuda::gemm_compute(MathPrecision::kFp16) == cuda::GemmCompute::kF32Fast16F);
  CHECK(cuda::gemm_compute(MathPrecision::kFp32) == cuda::GemmCompute::kF32);
  CHECK(cuda::gemm_compute(MathPrecision::kTf32) == cuda::GemmCompute::kF32FastTf32);
  CHECK(cuda::gemm_compute(MathPrecision::kBf16) == cuda::GemmCompute::kF32Fast16Bf);
}

namespace {

// Host memory that calls itself a GPU: lets the CPU suite make "cuda" tensors.
class PretendDevice final : public RawDeviceMemory {
 public:
  Device device() const override { return Device::kCuda; }
  Result<void*> malloc(size_t bytes) override { return std::malloc(bytes); }
  void free(void* p) override { std::free(p); }
  Status zero(void* p, size_t bytes) override {
    std::memset(p, 0, bytes);
    return slide::core::ok_status();
  }
  Status copy(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return slide::core::ok_status();
  }
};

}  // namespace

TEST_CASE("Every backend refuses tensors on another device, naming it; zeros and clone go through the allocator") {
  CachingDeviceAllocator pretend(std::make_unique<PretendDevice>());
  auto be = make_backend("reference");
  REQUIRE(be.ok());
  auto x = Tensor::zeros({2, 3}, DType::kF32, pretend, "x");
  REQUIRE(x.ok());
  CHECK(x->device() == Device::kCuda);
  CHECK(x->ptr<float>()[5] == 0.0f);  // zeroed by the allocator's zero_bytes
  auto y = Tensor::zeros({2, 3}, DType::kF32, cpu_allocator(), "y");
  REQUIRE(y.ok());
  Status s = (*be)->relu_forward(*x, *y);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("relu_forward: first operand is on cuda, this backend's tensors are on cpu") != std::string::npos);
  x->ptr<float>()[4] = 7.0f;
  auto c = x->clone();
  REQUIRE(c.ok());
  CHECK(c->device() == Device::kCuda);
  CHECK(c->ptr<float>()[4] == 7.0f);
}

TEST_CASE("Backend::upload / download: host backends copy bytes and refuse mismatches") {
  auto be = make_backend("cpu");
  REQUIRE(be.ok());
  auto host = Tensor::empty({4}, DType::kF32, cpu_allocator(), "host");
  auto dev = Tensor::zeros({4}, DType::kF32, (*be)->allocator(), "dev");
  REQUIRE(host.ok());
  REQUIRE(dev.ok());
  for (int i = 0; i < 4; ++i) host->data<float>()[i] = static_cast<float>(i) + 0.5f;
  REQUIRE((*be)->upload(*host, *dev).ok());
  CHECK(dev->data<float>()[3] == 3.5f);
  auto back = Tensor::zeros({4}, DType::kF32, cpu_allocator(), "back");
  REQUIRE(back.ok());
  REQUIRE((*be)->download(*dev, *back).ok());
  CHECK(back->data<float>()[2] == 2.5f);
  auto wrong = Tensor::zeros({5}, DType::kF32, cpu_allocator(), "wrong");
  REQUIRE(wrong.ok());
  Status s = (*be)->upload(*wrong, *dev);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("upload") != std::string::npos);
}

TEST_CASE("LossScaler: GradScaler's rules (2^16 start, halve and skip on inf/NaN, double after 2000 good steps)") {
  auto made = LossScaler::make({});
  REQUIRE(made.ok());
  LossScaler s = *made;
  CHECK(s.scale() == 65536.0);
  CHECK(s.inv_scale() == 1.0 / 65536.0);
  for (int i = 0; i < 1999; ++i) CHECK(s.update(false));
  CHECK(s.scale() == 65536.0);
  CHECK(s.growth_tracker() == 1999);
  CHECK(s.update(false));  // the 2000th good step grows the scale
  CHECK(s.scale() == 131072.0);
  CHECK(s.growth_tracker() == 0);
  for (int i = 0; i < 10; ++i) s.update(false);
  CHECK_FALSE(s.update(true));  // inf: skip, halve, reset the tracker
  CHECK(s.scale() == 65536.0);
  CHECK(s.growth_tracker() == 0);
  CHECK(s.skipped_steps() == 1);
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 32768.0);
  // Growth stops where the scale would overflow to inf.
  s.restore(1.5e308, 1999);
  CHECK(s.update(false));
  CHECK(s.scale() == 1.5e308);
  // A resumed scaler continues where it stopped.
  LossScaler r = *LossScaler::make({});
  r.restore(1024.0, 1998);
  r.update(false);
  r.update(false);
  CHECK(r.scale() == 2048.0);
}

TEST_CASE("LossScaler: disabled (FP32, BF16) has scale 1 and reports non-finite steps; bad options refused") {
  LossScalerOptions off;
  off.enabled = false;
  LossScaler s = *LossScaler::make(off);
  CHECK(s.scale() == 1.0);
  CHECK(s.update(false));
  CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 1.0);
  for (auto bad : {LossScalerOptions{true, 0.0}, LossScalerOptions{true, 65536, 1.0}, LossScalerOptions{true, 65536, 2, 1.5},
                   LossScalerOptions{true, 65536, 2, 0.5, 0}}) {
    auto r = LossScaler::make(bad);
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("select_device: --device, else the launcher's node-local rank, else 0; refuses sharing a GPU") {
  std::unordered_map<std::string, std::string> env;
  auto getenv_fn = [&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  CHECK(*select_device(-1, 8, getenv_fn) == 0);
  CHECK(*select_device(3, 8, getenv_fn) == 3);
  env["SLURM_LOCALID"] = "5";
  CHECK(*select_device(-1, 8, getenv_fn) == 5);
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "2";  // Open MPI's variable comes first
  CHECK(*select_device(-1, 8, getenv_fn) == 2);
  CHECK(*select_device(7, 8, getenv_fn) == 7);  // --device overrides the launcher
  auto over = select_device(-1, 2, getenv_fn);
  CHECK(over.status().code() == StatusCode::kFailedPrecondition);
  CHECK(over.status().message().find("node-local rank 2 but this node shows 2 GPU(s)") != std::string::npos);
  // Slurm's --gpus-per-task=1: each rank sees one GPU, its own, whatever its local rank.
  CHECK(select_device(-1, 1, getenv_fn).status().code() == StatusCode::kFailedPrecondition);
  env["CUDA_VISIBLE_DEVICES"] = "5";
  CHECK(*select_device(-1, 1, getenv_fn) == 0);
  CHECK(select_device(-1, 2, getenv_fn).status().code() == StatusCode::kFailedPrecondition);  // two visible: refused
  // slide-train --gpus 2 under CUDA_VISIBLE_DEVICES=0: both ranks see the same one GPU; rank 1
  // must not take it too.
  env["SLIDE_LAUNCH_LOCAL_RANK"] = "1";
  auto shared = select_device(-1, 1, getenv_fn);
  CHECK(shared.status().code() == StatusCode::kFailedPrecondition);
  CHECK(shared.status().message().find("node-local rank 1 but this node shows 1 GPU(s)") != std::string::npos);
  env["SLIDE_LAUNCH_LOCAL_RANK"] = "0";
  CHECK(*select_device(-1, 1, getenv_fn) == 0);
  env.erase("SLIDE_LAUNCH_LOCAL_RANK");
  env.erase("CUDA_VISIBLE_DEVICES");
  auto bad_flag = select_device(8, 8, getenv_fn);
  CHECK(bad_flag.status().code() == StatusCode::kInvalidArgument);
  CHECK(select_device(-1, 0, getenv_fn).status().code() == StatusCode::kUnavailable);
  env.clear();
  env["LOCAL_RANK"] = "x1";
  auto garbage = select_device(-1, 8, getenv_fn);
  CHECK(garbage.status().code() == StatusCode::kInvalidArgument);
  CHECK(garbage.status().message().find("LOCAL_RANK='x1'") != std::string::npos);
}

}  // namespace libtrain_test_cuda_host
