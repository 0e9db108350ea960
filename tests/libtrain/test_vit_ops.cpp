// The Vision Transformer's ops (layer norm, GELU, scale, permute): definitions on the reference
// backend (known values, a central-difference check of GELU's gradient), and the cpu backend
// against the reference (test_cpu_ops.cpp's harness).
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "slide/train/backend.h"
#include "test_util.h"

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

#define OK(expr)                              \
  do {                                        \
    Status s_ = (expr);                       \
    REQUIRE_MESSAGE(s_.ok(), s_.to_string()); \
  } while (0)

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
