// The cpu (oneDNN) backend against the reference backend, op by op (ggml's test-backend-ops
// idea): same inputs, the reference in f64, cpu in f32; NaN/Inf first, then the largest error
// normalised by the reference's magnitude, under a tolerance per op. Parameter gradients are
// pre-filled so that the accumulate (+=) rule is checked too.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "slide/train/backend.h"
#include "slide/train/layers.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_cpu_ops {

using slide::core::StatusCode;
using namespace slide::train;

namespace {

using testing::must_make;

Backend& backend(const std::string& name) {
  static std::unique_ptr<Backend> ref = must_make("reference");
  static std::unique_ptr<Backend> cpu = must_make("cpu");
  return name == "cpu" ? *cpu : *ref;
}

using testing::compare;
using testing::Pair;
Pair make(const Shape& s, uint64_t seed = 0, double lo = -1, double hi = 1, double fill = 0) {
  return testing::make_pair(s, seed, lo, hi, fill);
}

#define BOTH(call_d, call_f)                                         \
  do {                                                              \
    Status sd = backend("reference").call_d;                        \
    Status sf = backend("cpu").call_f;                              \
    REQUIRE_MESSAGE(sd.ok(), sd.to_string());                       \
    REQUIRE_MESSAGE(sf.ok(), sf.to_string());                       \
  } while (0)

}  // namespace

TEST_CASE("cpu vs reference: conv2d forward, backward data, backward weights (+=)") {
  for (Conv2dParams p : {Conv2dParams{1, 1}, Conv2dParams{2, 3}, Conv2dParams{2, 0}}) {
    CAPTURE(p.stride);
    CAPTURE(p.pad);
    const int64_t H = 13, W = 11, R = 7;  // the ResNet stem's 7x7 at stride 2, pad 3, among others
    const int64_t P = conv_out_extent(H, R, p.stride, p.pad), Q = conv_out_extent(W, R, p.stride, p.pad);
    Pair x = make({2, 3, H, W}, 1), w = make({5, 3, R, R}, 2), b = make({5}, 3), y = make({2, 5, P, Q});
    BOTH(conv2d_forward(x.d, w.d, b.d, p, y.d), conv2d_forward(x.f, w.f, b.f, p, y.f));
    compare("conv y", y, 1e-5);
    BOTH(conv2d_forward(x.d, w.d, Tensor(), p, y.d), conv2d_forward(x.f, w.f, Tensor(), p, y.f));
    compare("conv y (no bias)", y, 1e-5);
    Pair dy = make({2, 5, P, Q}, 4), dx = make(x.d.shape()), dw = make(w.d.shape(), 0, 0, 0, 1.0), db = make({5}, 0, 0, 0, 1.0);
    BOTH(conv2d_backward_data(dy.d, w.d, p, dx.d), conv2d_backward_data(dy.f, w.f, p, dx.f));
    compare("conv dx", dx, 1e-5);
    BOTH(conv2d_backward_weights(x.d, dy.d, p, dw.d, db.d), conv2d_backward_weights(x.f, dy.f, p, dw.f, db.f));
    compare("conv dw", dw, 1e-5);
    compare("conv db", db, 1e-5);
  }
}

TEST_CASE("cpu vs reference: batch norm training, inference, backward (+=)") {
  Pair x = make({4, 3, 5, 6}, 5, -2, 3), g = make({3}, 6, 0.5, 1.5), be = make({3}, 7);
  Pair rm = make({3}, 0, 0, 0, 0.2), rv = make({3}, 0, 0, 0, 1.0), y = make(x.d.shape()), sm = make({3}), si = make({3});
  BOTH(batch_norm_forward_training(x.d, g.d, be.d, 1e-5, 0.1, rm.d, rv.d, y.d, sm.d, si.d),
       batch_norm_forward_training(x.f, g.f, be.f, 1e-5, 0.1, rm.f, rv.f, y.f, sm.f, si.f));
  compare("bn y", y, 1e-5);
  compare("bn save_mean", sm, 1e-5);
  compare("bn save_invstd", si, 1e-5);
  compare("bn running_mean", rm, 1e-5);
  compare("bn running_var", rv, 1e-5);
  Pair yi = make(x.d.shape());
  BOTH(batch_norm_forward_inference(x.d, g.d, be.d, rm.d, rv.d, 1e-5, yi.d),
       batch_norm_forward_inference(x.f, g.f, be.f, rm.f, rv.f, 1e-5, yi.f));
  compare("bn inference y", yi, 1e-5);
  Pair dy = make(x.d.shape(), 8), dx = make(x.d.shape()), dg = make({3}, 0, 0, 0, 1.0), db = make({3}, 0, 0, 0, 1.0);
  BOTH(batch_norm_backward(x.d, dy.d, g.d, sm.d, si.d, dx.d, dg.d, db.d),
       batch_norm_backward(x.f, dy.f, g.f, sm.f, si.f, dx.f, dg.f, db.f));
  compare("bn dx", dx, 1e-4);
  compare("bn dgamma", dg, 1e-5);
  compare("bn dbeta", db, 1e-5);
}

TEST_CASE("relu maps NaN to 0 on both backends (oneDNN's relu; PyTorch's propagates it), its gradient there 0") {
  for (const std::string name : {"reference", "cpu"}) {
    CAPTURE(name);
    auto be = make_backend(name);
    REQUIRE(be.ok());
    auto x = Tensor::empty({5}, DType::kF32, cpu_allocator());
    auto y = Tensor::empty({5}, DType::kF32, cpu_allocator());
    auto dy = Tensor::empty({5}, DType::kF32, cpu_allocator());
    auto dx = Tensor::empty({5}, DType::kF32, cpu_allocator());
    REQUIRE((x.ok() && y.ok() && dy.ok() && dx.ok()));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float in[5] = {nan, -1.0f, 2.0f, -0.0f, 0.5f};
    std::copy(in, in + 5, x->data<float>());
    std::fill_n(dy->data<float>(), 5, 3.0f);
    REQUIRE((*be)->relu_forward(*x, *y).ok());
    CHECK(y->data<float>()[0] == 0.0f);  // formulas::relu on reference, oneDNN's on cpu
    CHECK(y->data<float>()[1] == 0.0f);
    CHECK(y->data<float>()[2] == 2.0f);
    CHECK(y->data<float>()[3] == 0.0f);
    CHECK(y->data<float>()[4] == 0.5f);
    REQUIRE((*be)->relu_backward(*y, *dy, *dx).ok());
    const float want[5] = {0.0f, 0.0f, 3.0f, 0.0f, 3.0f};
    for (int i = 0; i < 5; ++i) CHECK(dx->data<float>()[i] == want[i]);
  }
}

TEST_CASE("cpu vs reference: relu, add, mul, max pool, global average pool") {
  Pair x = make({2, 4, 9, 7}, 9), y = make(x.d.shape()), dy = make(x.d.shape(), 10), dx = make(x.d.shape());
  BOTH(relu_forward(x.d, y.d), relu_forward(x.f, y.f));
  compare("relu y", y, 1e-6);
  BOTH(relu_backward(y.d, dy.d, dx.d), relu_backward(y.f, dy.f, dx.f));
  compare("relu dx", dx, 1e-6);
  Pair s = make(x.d.shape());
  BOTH(add(x.d, dy.d, s.d), add(x.f, dy.f, s.f));
  compare("add", s, 1e-6);
  BOTH(mul(x.d, dy.d, s.d), mul(x.f, dy.f, s.f));
  compare("mul", s, 1e-6);

  for (Pool2dParams p : {Pool2dParams{3, 2, 1}, Pool2dParams{2, 2, 0}}) {
    CAPTURE(p.kernel);
    const int64_t P = conv_out_extent(9, p.kernel, p.stride, p.pad), Q = conv_out_extent(7, p.kernel, p.stride, p.pad);
    Pair py = make({2, 4, P, Q}), pdy = make({2, 4, P, Q}, 11), pdx = make(x.d.shape());
    BOTH(max_pool2d_forward(x.d, p, py.d), max_pool2d_forward(x.f, p, py.f));
    compare("maxpool y", py, 1e-6);
    BOTH(max_pool2d_backward(x.d, pdy.d, p, pdx.d), max_pool2d_backward(x.f, pdy.f, p, pdx.f));
    compare("maxpool dx", pdx, 1e-6);
  }

  Pair gy = make({2, 4}), gdy = make({2, 4}, 12), gdx = make(x.d.shape());
  BOTH(global_avg_pool_forward(x.d, gy.d), global_avg_pool_forward(x.f, gy.f));
  compare("gap y", gy, 1e-6);
  BOTH(global_avg_pool_backward(gdy.d, gdx.d), global_avg_pool_backward(gdy.f, gdx.f));
  compare("gap dx", gdx, 1e-6);
}

TEST_CASE("cpu vs reference: linear and softmax cross-entropy") {
  Pair x = make({6, 20}, 13), w = make({7, 20}, 14), b = make({7}, 15), y = make({6, 7});
  BOTH(linear_forward(x.d, w.d, b.d, y.d), linear_forward(x.f, w.f, b.f, y.f));
  compare("linear y", y, 1e-5);
  Pair dy = make({6, 7}, 16), dx = make({6, 20}), dw = make({7, 20}, 0, 0, 0, 1.0), db = make({7}, 0, 0, 0, 1.0);
  BOTH(linear_backward_data(dy.d, w.d, dx.d), linear_backward_data(dy.f, w.f, dx.f));
  compare("linear dx", dx, 1e-5);
  BOTH(linear_backward_weights(x.d, dy.d, dw.d, db.d), linear_backward_weights(x.f, dy.f, dw.f, db.f));
  compare("linear dw", dw, 1e-5);
  compare("linear db", db, 1e-5);

  auto labels = Tensor::empty({6}, DType::kI32, cpu_allocator());
  REQUIRE(labels.ok());
  for (int i = 0; i < 6; ++i) labels->data<int32_t>()[i] = (i * 5) % 7;
  Pair z = make({6, 7}, 17, -4, 4), cw = make({7}, 18, 0.5, 2), probs = make({6, 7}), dz = make({6, 7});
  for (double smoothing : {0.0, 0.1}) {
    double ld = 0, lf = 0;
    BOTH(softmax_cross_entropy_forward(z.d, *labels, cw.d, smoothing, probs.d, &ld),
         softmax_cross_entropy_forward(z.f, *labels, cw.f, smoothing, probs.f, &lf));
    CHECK(lf == doctest::Approx(ld).epsilon(1e-5));
    compare("xent probs", probs, 1e-5);  // exp of an f32 log-probability
    BOTH(softmax_cross_entropy_backward(probs.d, *labels, cw.d, smoothing, dz.d),
         softmax_cross_entropy_backward(probs.f, *labels, cw.f, smoothing, dz.f));
    compare("xent dlogits", dz, 1e-6);
  }
}

TEST_CASE("cpu backend: f64 is unimplemented, bad shapes are invalid, scratch respects the budget") {
  Tensor x = *Tensor::zeros({1, 1, 4, 4}, DType::kF64, cpu_allocator()), y = *Tensor::zeros({1, 1, 4, 4}, DType::kF64, cpu_allocator());
  CHECK(backend("cpu").relu_forward(x, y).code() == StatusCode::kUnimplemented);
  Tensor a = *Tensor::zeros({2, 3}, DType::kF32, cpu_allocator()), c = *Tensor::zeros({3, 2}, DType::kF32, cpu_allocator());
  CHECK(backend("cpu").add(a, a, c).code() == StatusCode::kInvalidArgument);

  // dw's scratch copy comes from the budgeted allocator: a budget too small for it is
  // kResourceExhausted, and the accumulated gradient is left as it was.
  auto cpu = must_make("cpu");
  Tensor xx = *Tensor::zeros({1, 2, 8, 8}, DType::kF32, cpu_allocator()), dy = *Tensor::zeros({1, 4, 8, 8}, DType::kF32, cpu_allocator());
  Tensor dw = *Tensor::zeros({4, 2, 3, 3}, DType::kF32, cpu_allocator()), db;
  cpu_allocator().set_budget_bytes(cpu_allocator().current_bytes() + 100);  // dw needs 288 bytes of scratch
  Status s = cpu->conv2d_backward_weights(xx, dy, {1, 1}, dw, db);
  cpu_allocator().set_budget_bytes(Allocator::kUnlimited);
  CHECK(s.code() == StatusCode::kResourceExhausted);
}

// Channels that are a multiple of 8: the cpu backend writes its image outputs in oneDNN's blocked
// layout (nChw8c, or nChw16c on AVX-512) and the next ops read them without reordering.
TEST_CASE("cpu: blocked layouts between ops give the reference's values, forward and backward") {
  Backend& cpu = backend("cpu");
  auto plain_f = [&](const Pair& p) {
    auto r = cpu.to_plain(p.f);
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    return Pair{p.d, *r};
  };
  const Conv2dParams cp{1, 1};
  Pair x = make({2, 16, 10, 9}, 21), w = make({16, 16, 3, 3}, 22), y = make({2, 16, 10, 9});
  BOTH(conv2d_forward(x.d, w.d, Tensor(), cp, y.d), conv2d_forward(x.f, w.f, Tensor(), cp, y.f));
  CHECK(y.f.layout() != Layout::kPlain);  // oneDNN's jit convolution picks a blocked layout
  compare("blocked conv y", plain_f(y), 1e-5);

  // Batch norm, ReLU and max pooling keep the layout; the add mixes a blocked and a plain input.
  Pair g = make({16}, 23, 0.5, 1.5), bt = make({16}, 24), rm = make({16}, 0, 0, 0, 0), rv = make({16}, 0, 0, 0, 1);
  Pair bn = make(y.d.shape()), sm = make({16}), si = make({16});
  BOTH(batch_norm_forward_training(y.d, g.d, bt.d, 1e-5, 0.1, rm.d, rv.d, bn.d, sm.d, si.d),
       batch_norm_forward_training(y.f, g.f, bt.f, 1e-5, 0.1, rm.f, rv.f, bn.f, sm.f, si.f));
  CHECK(bn.f.layout() == y.f.layout());
  compare("blocked bn y", plain_f(bn), 1e-5);
  compare("blocked bn running_var", rv, 1e-5);
  Pair r = make(y.d.shape());
  BOTH(relu_forward(bn.d, r.d), relu_forward(bn.f, r.f));
  CHECK(r.f.layout() == y.f.layout());
  compare("blocked relu y", plain_f(r), 1e-5);
  Pair s = make(y.d.shape());
  BOTH(add(r.d, x.d, s.d), add(r.f, x.f, s.f));  // x is plain
  CHECK(s.f.layout() == y.f.layout());
  compare("blocked + plain add", plain_f(s), 1e-5);
  BOTH(add(x.d, r.d, s.d), add(x.f, r.f, s.f));  // the output takes the first input's layout
  CHECK(s.f.layout() == Layout::kPlain);
  compare("plain + blocked add", s, 1e-5);
  const Pool2dParams pp{3, 2, 1};
  Pair py = make({2, 16, 5, 5});
  BOTH(max_pool2d_forward(r.d, pp, py.d), max_pool2d_forward(r.f, pp, py.f));
  CHECK(py.f.layout() != Layout::kPlain);
  compare("blocked maxpool y", plain_f(py), 1e-6);
  Pair gy = make({2, 16});
  BOTH(global_avg_pool_forward(py.d, gy.d), global_avg_pool_forward(py.f, gy.f));
  compare("gap of blocked", gy, 1e-6);

  // Backward through the same ops, with the gradients arriving blocked and plain.
  Pair gdy = make({2, 16}, 25), gdx = make(py.d.shape()), pdx = make(r.d.shape());
  BOTH(global_avg_pool_backward(gdy.d, gdx.d), global_avg_pool_backward(gdy.f, gdx.f));
  BOTH(max_pool2d_backward(r.d, gdx.d, pp, pdx.d), max_pool2d_backward(r.f, gdx.f, pp, pdx.f));
  compare("blocked maxpool dx", plain_f(pdx), 1e-6);
  Pair rdx = make(r.d.shape());
  BOTH(relu_backward(r.d, pdx.d, rdx.d), relu_backward(r.f, pdx.f, rdx.f));
  compare("blocked relu dx", plain_f(rdx), 1e-6);
  Pair bdx = make(y.d.shape()), dg = make({16}, 0, 0, 0, 1.0), db = make({16}, 0, 0, 0, 1.0);
  BOTH(batch_norm_backward(y.d, rdx.d, g.d, sm.d, si.d, bdx.d, dg.d, db.d),
       batch_norm_backward(y.f, rdx.f, g.f, sm.f, si.f, bdx.f, dg.f, db.f));
  CHECK(bdx.f.layout() == y.f.layout());
  compare("blocked bn dx", plain_f(bdx), 1e-4);
  compare("blocked bn dgamma", dg, 1e-5);
  Pair cdx = make(x.d.shape()), dw = make(w.d.shape(), 0, 0, 0, 1.0), nb;
  BOTH(conv2d_backward_data(bdx.d, w.d, cp, cdx.d), conv2d_backward_data(bdx.f, w.f, cp, cdx.f));
  CHECK(cdx.f.layout() != Layout::kPlain);
  compare("blocked conv dx", plain_f(cdx), 1e-5);
  BOTH(conv2d_backward_weights(x.d, bdx.d, cp, dw.d, nb.d), conv2d_backward_weights(x.f, bdx.f, cp, dw.f, nb.f));
  compare("conv dw from a blocked dy", dw, 1e-5);  // parameter gradients stay plain

  // to_plain of a plain tensor is the tensor; the reference backend refuses blocked tensors;
  // a blocked tensor cannot be reshaped, and a layout needs a shape that can carry it.
  auto same = cpu.to_plain(x.f);
  REQUIRE(same.ok());
  CHECK(same->raw() == x.f.raw());
  Pair rr = make(y.d.shape());
  CHECK(backend("reference").relu_forward(y.f, rr.f).code() == StatusCode::kInvalidArgument);
  CHECK(y.f.reshape({2, 16 * 90}).status().code() == StatusCode::kInvalidArgument);
  Tensor odd = *Tensor::empty({2, 12, 4, 4}, DType::kF32, cpu_allocator());
  CHECK(odd.set_layout(Layout::kNChw8c).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("cpu: a ResNet's activations stay blocked from layer to layer") {
  auto net = make_resnet(cpu_allocator(), DType::kF32, 18, 3, 1);
  REQUIRE(net.ok());
  Tensor x = *Tensor::zeros({2, 3, 64, 64}, DType::kF32, cpu_allocator());
  Tensor h = x;
  for (size_t i = 0; i < (*net)->size(); ++i) {
    auto r = (*net)->at(i).forward(backend("cpu"), h, true);
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    h = *r;
    CAPTURE((*net)->name_at(i));
    if (h.rank() == 4) CHECK(h.layout() != Layout::kPlain);  // conv1 to layer4
  }
  CHECK(h.layout() == Layout::kPlain);  // the logits
  (*net)->release();
}

namespace {

// y = act(conv(x, w) + b + z) by plain loops in double: the fused inference convolution's formula
// (backend.h), independent of the backends' composition.
std::vector<double> naive_fused(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor* z, bool relu,
                                Conv2dParams p) {
  const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3), K = w.dim(0), R = w.dim(2), S = w.dim(3);
  const int64_t P = conv_out_extent(H, R, p.stride, p.pad), Q = conv_out_extent(W, S, p.stride, p.pad);
  std::vector<double> y(static_cast<size_t>(N * K * P * Q));
  const double* xd = x.data<double>();
  const double* wd = w.data<double>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < P; ++i)
        for (int64_t j = 0; j < Q; ++j) {
          double acc = b.data<double>()[k];
          for (int64_t c = 0; c < C; ++c)
            for (int64_t r = 0; r < R; ++r)
              for (int64_t s = 0; s < S; ++s) {
                const int64_t h = i * p.stride - p.pad + r, ww = j * p.stride - p.pad + s;
                if (h < 0 || h >= H || ww < 0 || ww >= W) continue;
                acc += xd[((n * C + c) * H + h) * W + ww] * wd[((k * C + c) * R + r) * S + s];
              }
          const size_t o = static_cast<size_t>(((n * K + k) * P + i) * Q + j);
          if (z != nullptr) acc += z->data<double>()[o];
          y[o] = relu ? std::max(acc, 0.0) : acc;
        }
  return y;
}

}  // namespace

TEST_CASE("cpu vs reference: fused inference convolution (bias, residual add, ReLU; in place)") {
  Backend& ref = backend("reference");
  Backend& cpu = backend("cpu");
  struct Case {
    int64_t C, K, R;
    Conv2dParams p;
    bool relu, residual, in_place;
  };
  for (const Case c : {Case{3, 5, 7, {2, 3}, true, false, false}, Case{13, 16, 3, {1, 1}, true, true, true},
                       Case{16, 16, 1, {1, 0}, false, true, false}, Case{16, 32, 3, {2, 1}, true, true, false},
                       Case{13, 7, 1, {2, 0}, false, false, false}}) {
    CAPTURE(c.C);
    CAPTURE(c.K);
    CAPTURE(c.R);
    CAPTURE(c.relu);
    CAPTURE(c.residual);
    CAPTURE(c.in_place);
    const int64_t H = 9, W = 11;
    const int64_t P = conv_out_extent(H, c.R, c.p.stride, c.p.pad), Q = conv_out_extent(W, c.R, c.p.stride, c.p.pad);
    Pair x = make({2, c.C, H, W}, 31), w = make({c.K, c.C, c.R, c.R}, 32), b = make({c.K}, 33);
    Pair z = make({2, c.K, P, Q}, 34, -2, 2), y = make({2, c.K, P, Q});
    auto pd = ref.prepare_fused_conv2d(w.d, b.d);
    auto pf = cpu.prepare_fused_conv2d(w.f, b.f);
    REQUIRE_MESSAGE(pd.ok(), pd.status().to_string());
    REQUIRE_MESSAGE(pf.ok(), pf.status().to_string());
    const std::vector<double> want = naive_fused(x.d, w.d, b.d, c.residual ? &z.d : nullptr, c.relu, c.p);
    Pair& out = c.in_place ? z : y;  // in place: the residual is overwritten by the output
    BOTH(fused_conv2d_inference(x.d, **pd, c.p, c.relu, c.residual ? &z.d : nullptr, out.d),
         fused_conv2d_inference(x.f, **pf, c.p, c.relu, c.residual ? &z.f : nullptr, out.f));
    // The reference's composition equals the formula ...
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(out.d.data<double>()[i] - want[i]));
    CHECK(worst < 1e-12);
    // ... and cpu's fused primitive equals the reference.
    auto plain = cpu.to_plain(out.f);
    REQUIRE(plain.ok());
    compare("fused conv y", Pair{out.d, *plain}, 1e-5);
    // Run again with the same prepared weights (their reorder is kept): the same bits.
    if (!c.in_place) {
      Pair y2 = make({2, c.K, P, Q});
      REQUIRE(cpu.fused_conv2d_inference(x.f, **pf, c.p, c.relu, c.residual ? &z.f : nullptr, y2.f).ok());
      auto p2 = cpu.to_plain(y2.f);
      REQUIRE(p2.ok());
      CHECK(std::memcmp(p2->raw(), plain->raw(), plain->bytes()) == 0);
    }
  }
}

TEST_CASE("cpu: fused inference convolution on blocked activations, in place over a blocked or plain shortcut") {
  Backend& ref = backend("reference");
  Backend& cpu = backend("cpu");
  const Conv2dParams cp{1, 1};
  // A blocked input, as the convolution before it leaves it.
  Pair x0 = make({2, 16, 8, 8}, 41), w0 = make({16, 16, 3, 3}, 42), x = make({2, 16, 8, 8});
  BOTH(conv2d_forward(x0.d, w0.d, Tensor(), cp, x.d), conv2d_forward(x0.f, w0.f, Tensor(), cp, x.f));
  REQUIRE(x.f.layout() != Layout::kPlain);
  Pair w = make({16, 16, 3, 3}, 43), b = make({16}, 44);
  auto pd = ref.prepare_fused_conv2d(w.d, b.d);
  auto pf = cpu.prepare_fused_conv2d(w.f, b.f);
  REQUIRE(pd.ok());
  REQUIRE(pf.ok());
  // Shortcut blocked (the ResNet block's identity shortcut, written over in place, no copy) ...
  Pair zb = make({2, 16, 8, 8});
  BOTH(conv2d_forward(x0.d, w.d, Tensor(), cp, zb.d), conv2d_forward(x0.f, w.f, Tensor(), cp, zb.f));
  REQUIRE(zb.f.layout() != Layout::kPlain);
  void* before = zb.f.raw();
  BOTH(fused_conv2d_inference(x.d, **pd, cp, true, &zb.d, zb.d), fused_conv2d_inference(x.f, **pf, cp, true, &zb.f, zb.f));
  CHECK(zb.f.raw() == before);
  CHECK(zb.f.layout() != Layout::kPlain);
  auto p1 = cpu.to_plain(zb.f);
  REQUIRE(p1.ok());
  compare("in place over a blocked shortcut", Pair{zb.d, *p1}, 1e-5);
  // ... and plain (copied aside first, then the output takes the primitive's layout).
  Pair zp = make({2, 16, 8, 8}, 45);
  BOTH(fused_conv2d_inference(x.d, **pd, cp, true, &zp.d, zp.d), fused_conv2d_inference(x.f, **pf, cp, true, &zp.f, zp.f));
  auto p2 = cpu.to_plain(zp.f);
  REQUIRE(p2.ok());
  compare("in place over a plain shortcut", Pair{zp.d, *p2}, 1e-5);

  // Errors: weights of another backend, y aliasing x, a residual of another shape.
  Pair y = make({2, 16, 8, 8}), bad = make({2, 16, 4, 4});
  CHECK(cpu.fused_conv2d_inference(x.f, **pd, cp, true, nullptr, y.f).code() == StatusCode::kInvalidArgument);
  CHECK(cpu.fused_conv2d_inference(y.f, **pf, cp, true, nullptr, y.f).code() == StatusCode::kInvalidArgument);
  CHECK(cpu.fused_conv2d_inference(x.f, **pf, cp, true, &bad.f, y.f).code() == StatusCode::kInvalidArgument);
  CHECK(ref.fused_conv2d_inference(x.d, **pd, cp, true, &bad.d, y.d).code() == StatusCode::kInvalidArgument);
  CHECK(cpu.prepare_fused_conv2d(b.f, b.f).status().code() == StatusCode::kInvalidArgument);
}

}  // namespace libtrain_test_cpu_ops
#undef BOTH
