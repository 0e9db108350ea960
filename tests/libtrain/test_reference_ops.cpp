// The reference backend, op by op: hand-computed forward values, and every backward op against
// central differences in double (Caffe's test_gradient_check_util idea): with a fixed random
// projection r, L(inputs) = sum(forward(inputs) * r), dL/dinput from the backward op given dy = r
// must match (L(input + h) - L(input - h)) / 2h element by element.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "slide/train/backend.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_reference_ops {

using slide::core::StatusCode;
using namespace slide::train;

namespace {

Backend& ref() { return testing::reference(); }

Tensor make(const Shape& s, DType dt = DType::kF64) {
  auto t = Tensor::zeros(s, dt, cpu_allocator());
  REQUIRE(t.ok());
  return *t;
}

Tensor random(const Shape& s, uint64_t seed, double lo = -1, double hi = 1) {
  return testing::random_f64(s, seed, lo, hi);
}

Tensor to_f32(const Tensor& t) {
  Tensor f = make(t.shape(), DType::kF32);
  for (int64_t i = 0; i < t.numel(); ++i) f.data<float>()[i] = static_cast<float>(t.data<double>()[i]);
  return f;
}

double dot(const Tensor& a, const Tensor& b) { return testing::dot_f64(a, b); }

using testing::check_gradient;

}  // namespace

TEST_CASE("reference conv2d: hand example, then gradients (stride 2 pad 1, and stride 1 pad 0)") {
  // x = 1..9 as 3x3, w = [[1, 0], [0, -1]]: y[i][j] = x[i][j] - x[i+1][j+1] = -4 everywhere, + b.
  Tensor x = make({1, 1, 3, 3}), w = make({1, 1, 2, 2}), b = make({1}), y = make({1, 1, 2, 2});
  for (int i = 0; i < 9; ++i) x.data<double>()[i] = i + 1;
  w.data<double>()[0] = 1, w.data<double>()[3] = -1, b.data<double>()[0] = 0.5;
  REQUIRE(ref().conv2d_forward(x, w, b, {}, y).ok());
  for (int i = 0; i < 4; ++i) CHECK(y.data<double>()[i] == -3.5);

  for (Conv2dParams p : {Conv2dParams{2, 1}, Conv2dParams{1, 0}}) {
    CAPTURE(p.stride);
    Tensor xx = random({2, 3, 6, 5}, 1), ww = random({4, 3, 3, 3}, 2), bb = random({4}, 3);
    const int64_t P = conv_out_extent(6, 3, p.stride, p.pad), Q = conv_out_extent(5, 3, p.stride, p.pad);
    Tensor yy = make({2, 4, P, Q}), r = random({2, 4, P, Q}, 4);
    auto loss = [&] {
      REQUIRE(ref().conv2d_forward(xx, ww, bb, p, yy).ok());
      return dot(yy, r);
    };
    Tensor dx = make(xx.shape()), dw = make(ww.shape()), db = make(bb.shape());
    REQUIRE(ref().conv2d_backward_data(r, ww, p, dx).ok());
    REQUIRE(ref().conv2d_backward_weights(xx, r, p, dw, db).ok());
    check_gradient("conv dx", xx, dx, loss);
    check_gradient("conv dw", ww, dw, loss);
    check_gradient("conv db", bb, db, loss);
    // Parameter gradients accumulate: a second call doubles them.
    Tensor dw2 = *dw.clone();
    REQUIRE(ref().conv2d_backward_weights(xx, r, p, dw2, db).ok());
    CHECK(dw2.data<double>()[5] == doctest::Approx(2 * dw.data<double>()[5]));
  }
}

TEST_CASE("reference conv2d: f32 agrees with f64; shape errors name the op") {
  Tensor x = random({1, 2, 5, 5}, 5), w = random({3, 2, 3, 3}, 6), y = make({1, 3, 5, 5});
  Tensor y32 = make({1, 3, 5, 5}, DType::kF32);
  REQUIRE(ref().conv2d_forward(x, w, Tensor(), {1, 1}, y).ok());
  REQUIRE(ref().conv2d_forward(to_f32(x), to_f32(w), Tensor(), {1, 1}, y32).ok());
  for (int64_t i = 0; i < y.numel(); ++i) CHECK(y32.data<float>()[i] == doctest::Approx(y.data<double>()[i]).epsilon(1e-5));
  Tensor bad = make({1, 3, 4, 4});
  Status s = ref().conv2d_forward(x, w, Tensor(), {1, 1}, bad);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("conv2d_forward: y is [1, 3, 4, 4], expected [1, 3, 5, 5]") != std::string::npos);
  CHECK(ref().conv2d_forward(x, to_f32(w), Tensor(), {1, 1}, y).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("reference conv2d: each sum in the textbook loop's order, bit for bit (odd shapes, f64)") {
  // The reference's convolution loops run over the valid (output, kernel offset) ranges with the
  // output planes innermost (reference_backend.cpp); the textbook loops below, one output (or one
  // weight) at a time testing every offset, fix the order of each sum's terms that those loops
  // keep. In f64 a change of order shows in the last bits.
  struct Case {
    int64_t N, C, H, W, K, R, S;
    Conv2dParams p;
  };
  for (const Case& t : {Case{2, 3, 7, 6, 5, 3, 3, {1, 1}}, Case{1, 2, 9, 8, 3, 7, 7, {2, 3}},
                        Case{3, 4, 5, 5, 2, 1, 1, {2, 0}}, Case{2, 5, 1, 1, 3, 3, 3, {1, 1}},
                        Case{1, 2, 4, 3, 2, 2, 2, {1, 2}}, Case{1, 1, 6, 7, 1, 3, 2, {3, 1}}}) {
    CAPTURE(t.H);
    CAPTURE(t.R);
    CAPTURE(t.p.stride);
    CAPTURE(t.p.pad);
    const int64_t P = conv_out_extent(t.H, t.R, t.p.stride, t.p.pad), Q = conv_out_extent(t.W, t.S, t.p.stride, t.p.pad);
    const int64_t N = t.N, C = t.C, H = t.H, W = t.W, K = t.K, R = t.R, S = t.S;
    const int stride = t.p.stride, pad = t.p.pad;
    Tensor x = random({N, C, H, W}, 11), w = random({K, C, R, S}, 12), b = random({K}, 13), dy = random({N, K, P, Q}, 14);
    Tensor y = make({N, K, P, Q}), dx = make(x.shape()), dw = make(w.shape()), db = make(b.shape());
    REQUIRE(ref().conv2d_forward(x, w, b, t.p, y).ok());
    REQUIRE(ref().conv2d_backward_data(dy, w, t.p, dx).ok());
    REQUIRE(ref().conv2d_backward_weights(x, dy, t.p, dw, db).ok());
    const double *xp = x.data<double>(), *wp = w.data<double>(), *bp = b.data<double>(), *dyp = dy.data<double>();
    auto xi = [&](int64_t n, int64_t c, int64_t h, int64_t v) { return ((n * C + c) * H + h) * W + v; };
    auto wi = [&](int64_t k, int64_t c, int64_t r, int64_t s) { return ((k * C + c) * R + r) * S + s; };
    auto yi = [&](int64_t n, int64_t k, int64_t h, int64_t v) { return ((n * K + k) * P + h) * Q + v; };
    std::vector<double> want_dx(static_cast<size_t>(x.numel()), 0.0);
    int64_t y_equal = 0, dx_equal = 0, dw_equal = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t oh = 0; oh < P; ++oh)
          for (int64_t ow = 0; ow < Q; ++ow) {
            double acc = bp[k];
            for (int64_t c = 0; c < C; ++c)
              for (int64_t r = 0; r < R; ++r)
                for (int64_t s = 0; s < S; ++s) {
                  const int64_t ih = oh * stride - pad + r, iw = ow * stride - pad + s;
                  if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                  acc += xp[xi(n, c, ih, iw)] * wp[wi(k, c, r, s)];
                  want_dx[static_cast<size_t>(xi(n, c, ih, iw))] += dyp[yi(n, k, oh, ow)] * wp[wi(k, c, r, s)];
                }
            y_equal += y.data<double>()[yi(n, k, oh, ow)] == acc;
          }
    for (int64_t i = 0; i < x.numel(); ++i) dx_equal += dx.data<double>()[i] == want_dx[static_cast<size_t>(i)];
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t s = 0; s < S; ++s) {
            double acc = 0;
            for (int64_t n = 0; n < N; ++n)
              for (int64_t oh = 0; oh < P; ++oh)
                for (int64_t ow = 0; ow < Q; ++ow) {
                  const int64_t ih = oh * stride - pad + r, iw = ow * stride - pad + s;
                  if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                  acc += xp[xi(n, c, ih, iw)] * dyp[yi(n, k, oh, ow)];
                }
            dw_equal += dw.data<double>()[wi(k, c, r, s)] == 0.0 + acc;  // dw was zero: += acc
          }
    CHECK(y_equal == y.numel());
    CHECK(dx_equal == x.numel());
    CHECK(dw_equal == w.numel());
  }
}

TEST_CASE("reference linear: gradients of x, w, b") {
  Tensor x = random({3, 5}, 7), w = random({4, 5}, 8), b = random({4}, 9), y = make({3, 4}), r = random({3, 4}, 10);
  auto loss = [&] {
    REQUIRE(ref().linear_forward(x, w, b, y).ok());
    return dot(y, r);
  };
  Tensor dx = make(x.shape()), dw = make(w.shape()), db = make(b.shape());
  REQUIRE(ref().linear_backward_data(r, w, dx).ok());
  REQUIRE(ref().linear_backward_weights(x, r, dw, db).ok());
  check_gradient("linear dx", x, dx, loss);
  check_gradient("linear dw", w, dw, loss);
  check_gradient("linear db", b, db, loss);
}

TEST_CASE("reference batch norm: training statistics, running update, inference, gradients") {
  Tensor x = random({3, 2, 3, 4}, 11, -2, 3), gamma = random({2}, 12, 0.5, 1.5), beta = random({2}, 13);
  Tensor rm = make({2}), rv = make({2}), y = make(x.shape()), sm = make({2}), si = make({2});
  rv.data<double>()[0] = rv.data<double>()[1] = 1.0;
  REQUIRE(ref().batch_norm_forward_training(x, gamma, beta, 1e-5, 0.1, rm, rv, y, sm, si).ok());
  // Channel 0 by hand: its 36 values, mean, biased var (normalising), unbiased var (running).
  double sum = 0, sq = 0;
  for (int n = 0; n < 3; ++n)
    for (int i = 0; i < 12; ++i) sum += x.data<double>()[n * 24 + i];
  const double mean = sum / 36;
  for (int n = 0; n < 3; ++n)
    for (int i = 0; i < 12; ++i) sq += std::pow(x.data<double>()[n * 24 + i] - mean, 2);
  CHECK(sm.data<double>()[0] == doctest::Approx(mean));
  CHECK(si.data<double>()[0] == doctest::Approx(1 / std::sqrt(sq / 36 + 1e-5)));
  CHECK(rm.data<double>()[0] == doctest::Approx(0.1 * mean));
  CHECK(rv.data<double>()[0] == doctest::Approx(0.9 + 0.1 * sq / 35));
  // Normalised output has the affine parameters' mean and spread.
  double ysum = 0;
  for (int n = 0; n < 3; ++n)
    for (int i = 0; i < 12; ++i) ysum += y.data<double>()[n * 24 + i];
  CHECK(ysum / 36 == doctest::Approx(beta.data<double>()[0]));

  Tensor yi = make(x.shape());
  REQUIRE(ref().batch_norm_forward_inference(x, gamma, beta, rm, rv, 1e-5, yi).ok());
  CHECK(yi.data<double>()[0] == doctest::Approx(gamma.data<double>()[0] * (x.data<double>()[0] - rm.data<double>()[0]) /
                                                     std::sqrt(rv.data<double>()[0] + 1e-5) + beta.data<double>()[0]));

  Tensor r = random(x.shape(), 14), rm2 = make({2}), rv2 = make({2});
  auto loss = [&] {
    REQUIRE(ref().batch_norm_forward_training(x, gamma, beta, 1e-5, 0.1, rm2, rv2, y, sm, si).ok());
    return dot(y, r);
  };
  loss();  // save_mean / save_invstd of the unperturbed x
  Tensor dx = make(x.shape()), dg = make({2}), dbeta = make({2});
  REQUIRE(ref().batch_norm_backward(x, r, gamma, sm, si, dx, dg, dbeta).ok());
  check_gradient("bn dx", x, dx, loss, 1e-6, 1e-5);
  check_gradient("bn dgamma", gamma, dg, loss);
  check_gradient("bn dbeta", beta, dbeta, loss);
}

TEST_CASE("reference relu, add, global average pool: gradients") {
  Tensor x = random({2, 3, 4, 4}, 15);
  for (int64_t i = 0; i < x.numel(); ++i)  // keep away from the kink at 0
    if (std::abs(x.data<double>()[i]) < 0.05) x.data<double>()[i] = 0.3;
  Tensor y = make(x.shape()), r = random(x.shape(), 16), dx = make(x.shape());
  auto relu_loss = [&] {
    REQUIRE(ref().relu_forward(x, y).ok());
    return dot(y, r);
  };
  relu_loss();
  REQUIRE(ref().relu_backward(y, r, dx).ok());
  check_gradient("relu dx", x, dx, relu_loss);

  Tensor a = random({2, 5}, 17), b = random({2, 5}, 18), s = make({2, 5});
  REQUIRE(ref().add(a, b, s).ok());
  CHECK(s.data<double>()[3] == a.data<double>()[3] + b.data<double>()[3]);
  // mul is its own backward: d(sum(a * b * r))/da = r * b.
  Tensor m = make({2, 5}), rm = random({2, 5}, 20), da = make({2, 5});
  auto mul_loss = [&] {
    REQUIRE(ref().mul(a, b, m).ok());
    return dot(m, rm);
  };
  REQUIRE(ref().mul(rm, b, da).ok());
  check_gradient("mul da", a, da, mul_loss);

  Tensor g = make({2, 3}), rg = random({2, 3}, 19), dgx = make(x.shape());
  auto gap_loss = [&] {
    REQUIRE(ref().global_avg_pool_forward(x, g).ok());
    return dot(g, rg);
  };
  REQUIRE(ref().global_avg_pool_backward(rg, dgx).ok());
  check_gradient("gap dx", x, dgx, gap_loss);
}

TEST_CASE("reference max pool: first maximum wins ties; gradients with overlapping windows") {
  Tensor t = make({1, 1, 2, 2}), ty = make({1, 1, 1, 1}), tdy = make({1, 1, 1, 1}), tdx = make({1, 1, 2, 2});
  for (int i = 0; i < 4; ++i) t.data<double>()[i] = 7;
  tdy.data<double>()[0] = 1;
  REQUIRE(ref().max_pool2d_forward(t, {2, 2, 0}, ty).ok());
  REQUIRE(ref().max_pool2d_backward(t, tdy, {2, 2, 0}, tdx).ok());
  CHECK(ty.data<double>()[0] == 7);
  CHECK(tdx.data<double>()[0] == 1);
  CHECK(tdx.data<double>()[3] == 0);

  // ResNet's stem pooling: kernel 3, stride 2, pad 1. Distinct values, so the argmax is stable
  // under the difference step.
  Tensor x = make({2, 2, 7, 6});
  std::vector<double> v(static_cast<size_t>(x.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>((i * 37) % v.size()) / 10.0;
  for (size_t i = 0; i < v.size(); ++i) x.data<double>()[i] = v[i];
  const Pool2dParams p{3, 2, 1};
  Tensor y = make({2, 2, 4, 3}), r = random({2, 2, 4, 3}, 20), dx = make(x.shape());
  auto loss = [&] {
    REQUIRE(ref().max_pool2d_forward(x, p, y).ok());
    return dot(y, r);
  };
  REQUIRE(ref().max_pool2d_backward(x, r, p, dx).ok());
  check_gradient("maxpool dx", x, dx, loss, 1e-4);
  CHECK(ref().max_pool2d_forward(x, {2, 2, 2}, y).code() == StatusCode::kInvalidArgument);  // pad > kernel / 2
}

TEST_CASE("reference softmax cross-entropy: log C at zero logits, class weights, smoothing, gradients") {
  Tensor logits = make({4, 5}), probs = make({4, 5});
  auto labels = Tensor::empty({4}, DType::kI32, cpu_allocator());
  REQUIRE(labels.ok());
  const int32_t lab[] = {0, 3, 4, 3};
  for (int i = 0; i < 4; ++i) labels->data<int32_t>()[i] = lab[i];
  double loss = 0;
  REQUIRE(ref().softmax_cross_entropy_forward(logits, *labels, Tensor(), 0.0, probs, &loss).ok());
  CHECK(loss == doctest::Approx(std::log(5.0)));
  CHECK(probs.data<double>()[7] == doctest::Approx(0.2));

  Tensor z = random({4, 5}, 21, -3, 3), w = random({5}, 22, 0.5, 2.0), dz = make({4, 5});
  for (double smoothing : {0.0, 0.1}) {
    CAPTURE(smoothing);
    auto f = [&] {
      double l = 0;
      REQUIRE(ref().softmax_cross_entropy_forward(z, *labels, w, smoothing, probs, &l).ok());
      return l;
    };
    const double got = f();
    REQUIRE(ref().softmax_cross_entropy_backward(probs, *labels, w, smoothing, dz).ok());
    check_gradient("xent dlogits", z, dz, f);
    // PyTorch's CrossEntropyLoss(weight=w, label_smoothing=s) (aten/src/ATen/native/LossNLL.cpp,
    // cross_entropy_loss_label_smoothing, reduction='mean'): (1 - s) nll_loss(logp, y, w) +
    // (s / C) sum_n sum_c w[c] (-logp[n, c]) / sum_n w[y_n]. The smoothing term weighs each class by
    // its own weight, not by the sample's.
    const double* zp = z.data<double>();
    const double* wp = w.data<double>();
    double nll = 0, smooth = 0, wsum = 0;
    for (int n = 0; n < 4; ++n) {
      double m = zp[n * 5];
      for (int c = 1; c < 5; ++c) m = std::max(m, zp[n * 5 + c]);
      double se = 0;
      for (int c = 0; c < 5; ++c) se += std::exp(zp[n * 5 + c] - m);
      const double lse = m + std::log(se);
      nll += wp[lab[n]] * (lse - zp[n * 5 + lab[n]]);
      for (int c = 0; c < 5; ++c) smooth += wp[c] * (lse - zp[n * 5 + c]);
      wsum += wp[lab[n]];
    }
    CHECK(got == doctest::Approx((1 - smoothing) * nll / wsum + smoothing / 5 * smooth / wsum).epsilon(1e-12));
  }
  // A large logit does not overflow.
  z.data<double>()[0] = 1000;
  REQUIRE(ref().softmax_cross_entropy_forward(z, *labels, Tensor(), 0.0, probs, &loss).ok());
  CHECK(std::isfinite(loss));
  labels->data<int32_t>()[2] = 5;
  Status s = ref().softmax_cross_entropy_forward(z, *labels, Tensor(), 0.0, probs, &loss);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("label 5 of sample 2 is outside [0, 5)") != std::string::npos);
}

TEST_CASE("make_backend: unknown names list what is built") {
  auto b = make_backend("tpu");
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().code() == StatusCode::kNotFound);
  CHECK(b.status().message().find("built: reference, reference-sim, cpu") != std::string::npos);
  // --device is for cuda only; cuda itself, without a device here, is unavailable (or not built).
  auto d = make_backend("cpu", 0);
  CHECK(d.status().code() == StatusCode::kInvalidArgument);
  CHECK(d.status().message().find("--device 0 is for --backend cuda, not cpu") != std::string::npos);
  auto a = make_backend("auto");  // cuda where a GPU answers, else cpu
  REQUIRE(a.ok());
  CHECK(((*a)->name() == "cpu" || (*a)->name() == "cuda"));
  if ((*a)->name() == "cpu") CHECK(make_backend("auto", 1).status().code() == StatusCode::kInvalidArgument);
  auto c = make_backend("cuda");
  if (!c.ok())
    CHECK((c.status().code() == StatusCode::kUnavailable || c.status().code() == StatusCode::kNotFound));
}

}  // namespace libtrain_test_reference_ops
