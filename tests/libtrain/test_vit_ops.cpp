// The Vision Transformer's ops (layer norm, GELU, scale, permute): definitions on the reference
// backend (known values, a central-difference check of GELU's gradient), and the cpu backend
// against the reference (test_cpu_ops.cpp's harness).
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "slide/train/backend.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_vit_ops {

using namespace slide::train;
using slide::core::StatusCode;
using testing::compare;
using testing::Pair;

namespace {

Backend& cpu() {
  static std::unique_ptr<Backend> b = testing::must_make("cpu");
  return *b;
}
Backend& ref() { return testing::reference(); }

}  // namespace

TEST_CASE("GELU: exact erf form (PyTorch's default) at known points; its gradient passes a central-difference check") {
  Pair x = testing::make_pair({5});
  const double xs[5] = {-3.0, -1.0, 0.0, 0.5, 2.0};
  for (int i = 0; i < 5; ++i) x.d.data<double>()[i] = xs[i];
  Pair y = testing::make_pair({5});
  OK(ref().gelu_forward(x.d, y.d));
  // torch.nn.functional.gelu(torch.tensor([-3., -1., 0., .5, 2.], dtype=torch.float64))
  const double want[5] = {-0.00404969409489031, -0.15865525393145702, 0.0, 0.34573123063700656, 1.9544997361036416};
  for (int i = 0; i < 5; ++i) CHECK(y.d.data<double>()[i] == doctest::Approx(want[i]).epsilon(1e-12));
  Tensor xin = testing::random_f64({4, 7}, 3, -3, 3), w = testing::random_f64({4, 7}, 4);
  auto out = Tensor::empty({4, 7}, DType::kF64, cpu_allocator()).value();
  auto loss = [&] {
    REQUIRE(ref().gelu_forward(xin, out).ok());
    return testing::dot_f64(out, w);
  };
  auto dx = Tensor::empty({4, 7}, DType::kF64, cpu_allocator()).value();
  OK(ref().gelu_backward(xin, w, dx));
  testing::check_gradient("gelu dx", xin, dx, loss);
}

TEST_CASE("layer norm: each row normalised with its biased variance, then gamma and beta") {
  Pair x = testing::make_pair({2, 4});
  const double rows[8] = {1, 2, 3, 4, -2, 0, 0, 2};
  for (int i = 0; i < 8; ++i) x.d.data<double>()[i] = rows[i];
  Pair g = testing::make_pair({4}, 0, 0, 0, 2.0), b = testing::make_pair({4}, 0, 0, 0, 0.5), y = testing::make_pair({2, 4});
  OK(ref().layer_norm_forward(x.d, g.d, b.d, 1e-6, y.d));
  // Row 0: mean 2.5, var 1.25; element 0: 2 * (1 - 2.5) / sqrt(1.25 + 1e-6) + 0.5.
  CHECK(y.d.data<double>()[0] == doctest::Approx(2 * -1.5 / std::sqrt(1.25 + 1e-6) + 0.5).epsilon(1e-12));
  // Row 1: mean 0, var 2.
  CHECK(y.d.data<double>()[7] == doctest::Approx(2 * 2 / std::sqrt(2 + 1e-6) + 0.5).epsilon(1e-12));
  Pair bad = testing::make_pair({3});
  CHECK(ref().layer_norm_forward(x.d, bad.d, b.d, 1e-6, y.d).code() == StatusCode::kInvalidArgument);
  CHECK(ref().layer_norm_forward(x.d, g.d, b.d, 0.0, y.d).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("permute: y[i...] = x[perm...] for the attention head split and merge; bad permutations refused") {
  Pair x = testing::make_pair({2, 3, 4}, 5);
  Pair y = testing::make_pair({4, 2, 3});
  OK(ref().permute(x.d, {2, 0, 1}, y.d));
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 3; ++b)
      for (int c = 0; c < 4; ++c)
        REQUIRE(y.d.data<double>()[(c * 2 + a) * 3 + b] == x.d.data<double>()[(a * 3 + b) * 4 + c]);
  CHECK(ref().permute(x.d, {0, 0, 1}, y.d).code() == StatusCode::kInvalidArgument);
  CHECK(ref().permute(x.d, {0, 1}, y.d).code() == StatusCode::kInvalidArgument);
  CHECK(ref().permute(x.d, {2, 0, 1}, x.d).code() == StatusCode::kInvalidArgument);  // shape, and aliasing
}

TEST_CASE("cpu vs reference: layer norm, GELU forward and backward, scale, permute (5-d head split)") {
  Pair x = testing::make_pair({7, 13}, 11, -3, 3), g = testing::make_pair({13}, 12, 0.5, 1.5),
       b = testing::make_pair({13}, 13), y = testing::make_pair({7, 13}), dy = testing::make_pair({7, 13}, 14),
       dx = testing::make_pair({7, 13});
  OK(ref().layer_norm_forward(x.d, g.d, b.d, 1e-6, y.d));
  OK(cpu().layer_norm_forward(x.f, g.f, b.f, 1e-6, y.f));
  compare("layer norm", y, 1e-5);
  OK(ref().gelu_forward(x.d, y.d));
  OK(cpu().gelu_forward(x.f, y.f));
  compare("gelu y", y, 1e-6);
  OK(ref().gelu_backward(x.d, dy.d, dx.d));
  OK(cpu().gelu_backward(x.f, dy.f, dx.f));
  compare("gelu dx", dx, 1e-6);
  OK(ref().scale(x.d, 0.125, y.d));
  OK(cpu().scale(x.f, 0.125, y.f));
  compare("scale", y, 1e-7);
  Pair q = testing::make_pair({2, 5, 3, 4, 3}, 15), p = testing::make_pair({3, 2, 4, 5, 3});
  OK(ref().permute(q.d, {2, 0, 3, 1, 4}, p.d));
  OK(cpu().permute(q.f, {2, 0, 3, 1, 4}, p.f));
  compare("permute", p, 1e-7);
}

// Multi-head attention's definition, written out in the test (Vaswani et al., 2017, eq. 1, as
// timm's Attention.forward lays qkv out: per token q | k | v, each of H heads of Dh).
static std::vector<double> attention_by_definition(const double* qkv, int64_t B, int64_t T, int64_t H, int64_t Dh,
                                                   double scale) {
  const int64_t C = H * Dh;
  std::vector<double> out(static_cast<size_t>(B * T * C));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const double* q = qkv + (b * T + i) * 3 * C + h * Dh;
        std::vector<double> s(static_cast<size_t>(T));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < T; ++j) {
          const double* k = qkv + (b * T + j) * 3 * C + C + h * Dh;
          double dot = 0;
          for (int64_t e = 0; e < Dh; ++e) dot += q[e] * k[e];
          s[static_cast<size_t>(j)] = scale * dot;
          mx = std::max(mx, s[static_cast<size_t>(j)]);
        }
        for (double& v : s) sum += (v = std::exp(v - mx));
        for (int64_t e = 0; e < Dh; ++e) {
          double acc = 0;
          for (int64_t j = 0; j < T; ++j) acc += s[static_cast<size_t>(j)] / sum * qkv[(b * T + j) * 3 * C + 2 * C + h * Dh + e];
          out[static_cast<size_t>((b * T + i) * C + h * Dh + e)] = acc;
        }
      }
  return out;
}

TEST_CASE("attention_forward: the definition on the reference; cpu's strided batched matmuls equal it; bad calls refused") {
  const int64_t B = 3, T = 7, H = 4, Dh = 5, C = H * Dh;
  const double scale = 1.0 / std::sqrt(double(Dh));
  Pair qkv = testing::make_pair({B * T, 3 * C}, 21, -2, 2), out = testing::make_pair({B * T, C});
  OK(ref().attention_forward(qkv.d, B, H, scale, out.d));
  const std::vector<double> want = attention_by_definition(qkv.d.data<double>(), B, T, H, Dh, scale);
  for (size_t i = 0; i < want.size(); ++i) REQUIRE(out.d.data<double>()[i] == doctest::Approx(want[i]).epsilon(1e-12));
  OK(cpu().attention_forward(qkv.f, B, H, scale, out.f));
  compare("attention", out, 1e-5);
  // A second shape through the same backend (cached primitives are keyed by shape and scale).
  Pair qkv2 = testing::make_pair({2 * 9, 3 * C}, 22, -2, 2), out2 = testing::make_pair({2 * 9, C});
  OK(ref().attention_forward(qkv2.d, 2, H, 0.3, out2.d));
  OK(cpu().attention_forward(qkv2.f, 2, H, 0.3, out2.f));
  compare("attention, another shape and scale", out2, 1e-5);
  // Layer norm in place (the ViT's final norm writes x).
  Pair x = testing::make_pair({6, 20}, 23, -3, 3), g = testing::make_pair({20}, 24, 0.5, 1.5),
       bb = testing::make_pair({20}, 25);
  OK(ref().layer_norm_forward(x.d, g.d, bb.d, 1e-6, x.d));
  OK(cpu().layer_norm_forward(x.f, g.f, bb.f, 1e-6, x.f));
  compare("layer norm in place", x, 1e-5);
  for (Backend* be : {&ref(), &cpu()}) {
    const Tensor& q = be == &ref() ? qkv.d : qkv.f;
    Tensor& o = be == &ref() ? out.d : out.f;
    CHECK(be->attention_forward(q, 2, H, scale, o).code() == StatusCode::kInvalidArgument);   // 2 does not divide 21 rows
    CHECK(be->attention_forward(q, B, 3, scale, o).code() == StatusCode::kInvalidArgument);   // 3 heads do not divide 20
    CHECK(be->attention_forward(q, B, H, std::nan(""), o).code() == StatusCode::kInvalidArgument);
    Tensor alias = *q.view(0, {B * T, C});
    CHECK(be->attention_forward(q, B, H, scale, alias).code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("linear_gelu_forward: GELU(x w^T + b), cpu's fused post-op against the reference's composition") {
  for (const bool bias : {true, false}) {
    CAPTURE(bias);
    Pair x = testing::make_pair({9, 24}, 21), w = testing::make_pair({40, 24}, 22, -0.5, 0.5),
         b = testing::make_pair({40}, 23), y = testing::make_pair({9, 40});
    const Tensor none;
    OK(ref().linear_gelu_forward(x.d, w.d, bias ? b.d : none, y.d));
    OK(cpu().linear_gelu_forward(x.f, w.f, bias ? b.f : none, y.f));
    compare("linear gelu y", y, 1e-6);
    // And the reference's is linear_forward then gelu_forward, by definition: check one value.
    double pre = bias ? b.d.data<double>()[3] : 0.0;
    for (int64_t i = 0; i < 24; ++i) pre += x.d.data<double>()[2 * 24 + i] * w.d.data<double>()[3 * 24 + i];
    CHECK(y.d.data<double>()[2 * 40 + 3] == doctest::Approx(0.5 * pre * (1 + std::erf(pre / std::sqrt(2.0)))).epsilon(1e-12));
  }
}

}  // namespace libtrain_test_vit_ops
