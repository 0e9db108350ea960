// Math precision of the products (backend.h MathPrecision, --precision): the operand rounding of
// kernels/formulas.h against an independent formulation (frexp, nearbyint, ldexp); the reference
// backend under tf32 / bf16 equals the exact f32 reference on operands rounded beforehand, bit for
// bit, op by op; the cpu backend under bf16 stays within bf16's error of the f64 result (oneDNN
// may compute in bf16 or f32, both allowed) and gives its f32 results back exactly after fp32 is
// set again; the names parse.
#include <doctest/doctest.h>

#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../libtrain/src/kernels/formulas.h"
#include "slide/train/backend.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_precision {

using namespace slide::train;
using slide::core::StatusCode;

namespace {

// f rounded to `bits` significant bits (the implicit one included), to nearest, ties to even:
// frexp's mantissa in [0.5, 1) scaled to an integer by nearbyint under FE_TONEAREST. Normal
// numbers only (as the tests use).
float round_significand(float f, int bits) {
  int e = 0;
  const double m = std::frexp(static_cast<double>(f), &e);
  const double r = std::nearbyint(std::ldexp(m, bits));
  return static_cast<float>(std::ldexp(r, e - bits));
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

Tensor f32_tensor(const Shape& s, uint64_t seed) {
  auto t = Tensor::empty(s, DType::kF32, cpu_allocator());
  REQUIRE(t.ok());
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = u(g);
  return *t;
}

Tensor zeros(const Shape& s) {
  auto t = Tensor::zeros(s, DType::kF32, cpu_allocator());
  REQUIRE(t.ok());
  return *t;
}

// A copy of t with every element rounded as `p` rounds product operands.
Tensor rounded(const Tensor& t, MathPrecision p) {
  Tensor r = zeros(t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = t.data<float>()[i];
    r.data<float>()[i] = p == MathPrecision::kBf16   ? formulas::round_to_bf16(v)
                         : p == MathPrecision::kTf32 ? formulas::round_to_tf32(v)
                         : p == MathPrecision::kFp16 ? formulas::round_to_f16(v)
                                                     : v;
  }
  return r;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

struct PrecisionGuard {  // puts the backend back to fp32 whatever the test does
  Backend& be;
  ~PrecisionGuard() { (void)be.set_math_precision(MathPrecision::kFp32); }
};

}  // namespace

TEST_CASE("round_to_bf16 / round_to_tf32: to nearest, ties to even, as frexp/nearbyint/ldexp round") {
  REQUIRE(std::fegetround() == FE_TONEAREST);
  // Ties: 1 + 2^-8 is halfway between bf16's 1 and 1 + 2^-7: to the even one, 1.
  CHECK(formulas::round_to_bf16(1.0f + 0x1p-8f) == 1.0f);
  CHECK(formulas::round_to_bf16(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);  // tie, up to the even one
  CHECK(formulas::round_to_tf32(1.0f + 0x1p-11f) == 1.0f);
  CHECK(formulas::round_to_tf32(1.0f + 3 * 0x1p-11f) == 1.0f + 0x1p-9f);
  CHECK(formulas::round_to_tf32(1.0f + 0x1p-11f + 0x1p-20f) == 1.0f + 0x1p-10f);  // past the tie: up
  // Exact values stay; signs, zeros, infinities and NaN too; overflow rounds to inf.
  for (float v : {0.0f, -0.0f, 1.0f, -2.5f, 0x1p-126f, std::numeric_limits<float>::infinity()}) {
    CHECK(bits_of(formulas::round_to_bf16(v)) == bits_of(v));
    CHECK(bits_of(formulas::round_to_tf32(v)) == bits_of(v));
  }
  CHECK(std::isnan(formulas::round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isnan(formulas::round_to_tf32(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isinf(formulas::round_to_bf16(std::numeric_limits<float>::max())));
  CHECK(std::isinf(formulas::round_to_tf32(std::numeric_limits<float>::max())));
  // Random normal floats over many binades, and their halfway points.
  std::mt19937 g(7);
  std::uniform_int_distribution<uint32_t> bits(0x00800000u, 0x7F000000u);
  int64_t checked = 0;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = bits(g) | (i % 2 ? 0x80000000u : 0u);
    if (i % 4 == 2) u = (u & ~0xFFFFu) | 0x8000u;  // a bf16 tie
    if (i % 4 == 3) u = (u & ~0x1FFFu) | 0x1000u;  // a tf32 tie
    float f;
    std::memcpy(&f, &u, sizeof f);
    REQUIRE(bits_of(formulas::round_to_bf16(f)) == bits_of(round_significand(f, 8)));
    REQUIRE(bits_of(formulas::round_to_tf32(f)) == bits_of(round_significand(f, 11)));
    ++checked;
  }
  CHECK(checked == 200000);
  // binary16: 11 significant bits over its normal range [2^-14, 65504]; beyond it inf, subnormals
  // in steps of 2^-24, below half of that zero.
  std::uniform_real_distribution<float> normal(-14.f, 15.9f);
  for (int i = 0; i < 100000; ++i) {
    float f = std::exp2(normal(g)) * (i % 2 ? -1.f : 1.f);
    if (i % 3 == 0) f = round_significand(f, 12) + 0.f;  // many of them ties
    if (std::abs(f) > 65504.f) continue;
    REQUIRE(bits_of(formulas::round_to_f16(f)) == bits_of(round_significand(f, 11)));
  }
  CHECK(formulas::round_to_f16(65504.f) == 65504.f);
  CHECK(std::isinf(formulas::round_to_f16(65520.f)));  // the tie above 65504 rounds to inf
  CHECK(formulas::round_to_f16(65519.f) == 65504.f);
  CHECK(formulas::round_to_f16(0x1p-24f) == 0x1p-24f);      // the smallest subnormal
  CHECK(formulas::round_to_f16(0x1p-25f) == 0.0f);          // a tie with zero: to even (zero)
  CHECK(formulas::round_to_f16(0x1.8p-24f) == 0x1p-23f);    // 1.5 steps: a tie, to even (2 steps)
  CHECK(formulas::round_to_f16(3 * 0x1p-26f) == 0x1p-24f);  // 0.75 of a step: up
}

TEST_CASE("parse_math_precision: fp32, tf32, bf16, fp16; others refused") {
  for (MathPrecision p : {MathPrecision::kFp32, MathPrecision::kTf32, MathPrecision::kBf16, MathPrecision::kFp16}) {
    auto r = parse_math_precision(math_precision_name(p));
    REQUIRE(r.ok());
    CHECK(*r == p);
  }
  CHECK(parse_math_precision("FP32").status().code() == StatusCode::kInvalidArgument);
  CHECK(parse_math_precision("").status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("reference under tf32, bf16 and fp16: every product op equals f32 on operands rounded beforehand") {
  auto be = testing::must_make("reference");
  PrecisionGuard guard{*be};
  const Conv2dParams p{2, 1};
  const int64_t N = 2, C = 3, H = 9, W = 7, K = 4, R = 3;
  const int64_t P = conv_out_extent(H, R, p.stride, p.pad), Q = conv_out_extent(W, R, p.stride, p.pad);
  const Tensor x = f32_tensor({N, C, H, W}, 1), w = f32_tensor({K, C, R, R}, 2), b = f32_tensor({K}, 3),
               dy = f32_tensor({N, K, P, Q}, 4);
  const Tensor lx = f32_tensor({5, 13}, 5), lw = f32_tensor({6, 13}, 6), lb = f32_tensor({6}, 7),
               ldy = f32_tensor({5, 6}, 8);
  const Tensor ma = f32_tensor({13, 5}, 9), mb = f32_tensor({6, 13}, 10);
  // Each product op at the precision on the raw operands, and at fp32 on the rounded ones.
  struct Outputs {
    Tensor y, dx, dw, db, ly, ldx, ldw, ldb, my;
  };
  auto run = [&](MathPrecision prec, const Tensor& x_, const Tensor& w_, const Tensor& dy_, const Tensor& lx_,
                 const Tensor& lw_, const Tensor& ldy_, const Tensor& ma_, const Tensor& mb_) {
    REQUIRE(be->set_math_precision(prec).ok());
    Outputs o{zeros({N, K, P, Q}), zeros(x.shape()), zeros(w.shape()), zeros({K}), zeros({5, 6}), zeros(lx.shape()),
              zeros(lw.shape()), zeros({6}), zeros({5, 6})};
    REQUIRE(be->conv2d_forward(x_, w_, b, p, o.y).ok());
    REQUIRE(be->conv2d_backward_data(dy_, w_, p, o.dx).ok());
    REQUIRE(be->conv2d_backward_weights(x_, dy_, p, o.dw, o.db).ok());
    REQUIRE(be->linear_forward(lx_, lw_, lb, o.ly).ok());
    REQUIRE(be->linear_backward_data(ldy_, lw_, o.ldx).ok());
    REQUIRE(be->linear_backward_weights(lx_, ldy_, o.ldw, o.ldb).ok());
    REQUIRE(be->matmul(ma_, true, mb_, true, o.my).ok());  // ma^T [5,13] times mb^T [13,6]
    return o;
  };
  const Outputs exact = run(MathPrecision::kFp32, x, w, dy, lx, lw, ldy, ma, mb);
  for (MathPrecision prec : {MathPrecision::kTf32, MathPrecision::kBf16, MathPrecision::kFp16}) {
    const std::string name = math_precision_name(prec);
    CAPTURE(name);
    const Outputs got = run(prec, x, w, dy, lx, lw, ldy, ma, mb);
    const Outputs want = run(MathPrecision::kFp32, rounded(x, prec), rounded(w, prec), rounded(dy, prec),
                             rounded(lx, prec), rounded(lw, prec), rounded(ldy, prec), rounded(ma, prec),
                             rounded(mb, prec));
    CHECK(same_bits(got.y, want.y));
    CHECK(same_bits(got.dx, want.dx));
    CHECK(same_bits(got.dw, want.dw));
    CHECK(same_bits(got.db, exact.db));  // the bias gradients are sums, not products: as at fp32
    CHECK(same_bits(got.ly, want.ly));
    CHECK(same_bits(got.ldx, want.ldx));
    CHECK(same_bits(got.ldw, want.ldw));
    CHECK(same_bits(got.ldb, exact.ldb));
    CHECK(same_bits(got.my, want.my));
    // And the rounding did something: the results are not fp32's.
    CHECK_FALSE(same_bits(got.y, exact.y));
    CHECK_FALSE(same_bits(got.ldw, exact.ldw));
    CHECK_FALSE(same_bits(got.my, exact.my));
  }
}

TEST_CASE("cpu under bf16: within bf16's error of the f64 result; fp32 again gives fp32's bits") {
  auto cpu = testing::must_make("cpu");
  PrecisionGuard guard{*cpu};
  const Conv2dParams p{1, 1};
  const int64_t N = 2, C = 16, H = 10, W = 10, K = 16, R = 3;
  const Tensor x = f32_tensor({N, C, H, W}, 11), w = f32_tensor({K, C, R, R}, 12), b = f32_tensor({K}, 13);
  const Tensor lx = f32_tensor({8, 64}, 14), lw = f32_tensor({32, 64}, 15), lb = f32_tensor({32}, 16);
  auto run = [&](MathPrecision prec, Tensor* y, Tensor* ly) {
    REQUIRE(cpu->set_math_precision(prec).ok());
    CHECK(cpu->math_precision() == prec);
    *y = zeros({N, K, H, W});
    *ly = zeros({8, 32});
    REQUIRE(cpu->conv2d_forward(x, w, b, p, *y).ok());
    REQUIRE(cpu->linear_forward(lx, lw, lb, *ly).ok());
    auto plain = cpu->to_plain(*y);
    REQUIRE(plain.ok());
    *y = *plain;
  };
  Tensor y32, ly32, y16, ly16, y32again, ly32again;
  run(MathPrecision::kFp32, &y32, &ly32);
  run(MathPrecision::kBf16, &y16, &ly16);
  run(MathPrecision::kFp32, &y32again, &ly32again);
  CHECK(same_bits(y32, y32again));
  CHECK(same_bits(ly32, ly32again));
  // The f64 reference: each output is a sum of C*R*R (144) or 64 products of operands in [-1, 1].
  // bf16 operands carry a relative error of 2^-9 each, so a product 2^-8; the sum's error is at
  // most 2^-8 times the sum of |products| (the bound, not the typical 2^-8 sqrt(n)).
  auto ref = testing::must_make("reference");
  auto to_f64 = [](const Tensor& t) {
    Tensor d = testing::random_f64(t.shape(), 0);
    for (int64_t i = 0; i < t.numel(); ++i) d.data<double>()[i] = t.data<float>()[i];
    return d;
  };
  Tensor yd = testing::random_f64({N, K, H, W}, 0), lyd = testing::random_f64({8, 32}, 0);
  REQUIRE(ref->conv2d_forward(to_f64(x), to_f64(w), to_f64(b), p, yd).ok());
  REQUIRE(ref->linear_forward(to_f64(lx), to_f64(lw), to_f64(lb), lyd).ok());
  auto worst = [](const Tensor& got, const Tensor& want, double bound) {
    double w = 0;
    for (int64_t i = 0; i < got.numel(); ++i) w = std::max(w, std::abs(got.data<float>()[i] - want.data<double>()[i]) / bound);
    return w;
  };
  CHECK(worst(y16, yd, 144 * 0x1p-8) <= 1.0);
  CHECK(worst(ly16, lyd, 64 * 0x1p-8) <= 1.0);
  CHECK(worst(y32, yd, 144 * 0x1p-20) <= 1.0);  // and f32 far tighter
}

// On a CPU with bf16 instructions the cpu backend rounds every product operand to bf16 itself
// (oneDNN 2.6's fpmath mode alone changes nothing), so its results are the reference's under bf16
// (operands rounded exactly, formulas.h round_to_bf16) up to the order of the f32 sums: far closer
// than bf16's own error, which separates them from fp32's. Without those instructions bf16 is f32
// on cpu, bit for bit. Every product op: convolution forward, backward data and weights, the fused
// inference convolution (with residual and ReLU), linear forward and backward, matmul with
// transposes, attention, linear with GELU; channel counts that take oneDNN's blocked layouts (16)
// and ones that do not (13).
TEST_CASE("cpu under bf16: operands rounded as the reference rounds them where the CPU has bf16 instructions") {
  auto cpu = testing::must_make("cpu");
  auto ref = testing::must_make("reference");
  PrecisionGuard cpu_guard{*cpu}, ref_guard{*ref};
  const bool bf16 = cpu_has_bf16_instructions();
  const std::string isa = bf16 ? "yes" : "no (bf16 is f32 on cpu)";
  MESSAGE("this CPU has bf16 instructions: " << isa);
  for (const int64_t C : {16, 13}) {
    CAPTURE(C);
    const Conv2dParams p{1, 1};
    const int64_t N = 2, H = 9, W = 8, K = C, R = 3;
    const Tensor x = f32_tensor({N, C, H, W}, 21), w = f32_tensor({K, C, R, R}, 22), b = f32_tensor({K}, 23),
                 dy = f32_tensor({N, K, H, W}, 24), z = f32_tensor({N, K, H, W}, 25);
    const Tensor lx = f32_tensor({7, 4 * C}, 26), lw = f32_tensor({2 * C, 4 * C}, 27), lb = f32_tensor({2 * C}, 28),
                 ldy = f32_tensor({7, 2 * C}, 29);
    const Tensor ma = f32_tensor({4 * C, 9}, 30), mb = f32_tensor({5, 4 * C}, 31);
    const int64_t B = 2, T = 11, heads = C % 2 == 0 ? 2 : 1;  // attention: C = heads * Dh wide
    const Tensor qkv = f32_tensor({B * T, 3 * C}, 32);
    // Each op's outputs, plain; names[i] says which.
    const std::vector<std::string> names{"conv y", "conv dx", "conv dw", "fused y", "linear y", "linear dx",
                                         "linear dw", "matmul y", "attention out", "linear gelu y"};
    auto run = [&](Backend& be, MathPrecision prec) {
      REQUIRE(be.set_math_precision(prec).ok());
      std::vector<Tensor> o{zeros({N, K, H, W}), zeros(x.shape()), zeros(w.shape()), zeros({N, K, H, W}),
                            zeros({7, 2 * C}),   zeros(lx.shape()), zeros(lw.shape()), zeros({9, 5}),
                            zeros({B * T, C}),   zeros({7, 2 * C})};
      Tensor db = zeros({K}), ldb = zeros({2 * C});
      REQUIRE(be.conv2d_forward(x, w, b, p, o[0]).ok());
      REQUIRE(be.conv2d_backward_data(dy, w, p, o[1]).ok());
      REQUIRE(be.conv2d_backward_weights(x, dy, p, o[2], db).ok());
      auto fw = be.prepare_fused_conv2d(w, b);
      REQUIRE(fw.ok());
      std::copy(z.data<float>(), z.data<float>() + z.numel(), o[3].data<float>());
      REQUIRE(be.fused_conv2d_inference(x, **fw, p, true, &o[3], o[3]).ok());  // in place over z
      REQUIRE(be.linear_forward(lx, lw, lb, o[4]).ok());
      REQUIRE(be.linear_backward_data(ldy, lw, o[5]).ok());
      REQUIRE(be.linear_backward_weights(lx, ldy, o[6], ldb).ok());
      REQUIRE(be.matmul(ma, true, mb, true, o[7]).ok());  // ma^T [9, 4C] times mb^T [4C, 5]
      REQUIRE(be.attention_forward(qkv, B, heads, 0.25, o[8]).ok());
      REQUIRE(be.linear_gelu_forward(lx, lw, lb, o[9]).ok());
      for (Tensor& t : o) {
        auto plain = be.to_plain(t);
        REQUIRE(plain.ok());
        t = *plain;
      }
      return o;
    };
    const std::vector<Tensor> got = run(*cpu, MathPrecision::kBf16), f32 = run(*cpu, MathPrecision::kFp32),
                              want = run(*ref, MathPrecision::kBf16);
    auto max_diff = [](const Tensor& a, const Tensor& c) {
      double m = 0;
      for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, double(std::abs(a.data<float>()[i] - c.data<float>()[i])));
      return m;
    };
    for (size_t i = 0; i < names.size(); ++i) {
      CAPTURE(names[i]);
      if (!bf16) {
        CHECK(same_bits(got[i], f32[i]));
        continue;
      }
      // Sums of at most 4C*9 = 144 products of operands in [-1, 1] (attention's second product:
      // T = 11 probabilities summing to 1): two f32 orders of such sums differ by well under
      // 2^-14, while bf16's rounding moves them by about 2^-9 each (the second check).
      CHECK(max_diff(got[i], want[i]) <= 0x1p-14);
      CHECK(max_diff(got[i], f32[i]) > 0x1p-12);
    }
  }
}

}  // namespace libtrain_test_precision
