// Channels last in training (backend.h, "Channels last in training"; layers.h
// enable_half_activations with Layout::kNhwc): to_channels_last / to_plain and the training ops on
// kNhwc image tensors on the reference backend, which stores them as cuda does and must give the
// plain ops' values bit for bit (it is the oracle of cuda's channels-last parity cases), and the
// refusals.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "../../libtrain/src/kernels/launch.h"
#include "slide/train/backend.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_channels_last {

using namespace slide::train;
using slide::core::StatusCode;

namespace {

Backend& ref() { return testing::reference(); }
using testing::host_cast;
using testing::random_f32;

Tensor empty(const Shape& s, DType t) { return *Tensor::empty(s, t, cpu_allocator()); }
Tensor nhwc(const Tensor& t) {
  auto r = ref().to_channels_last(t);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return *r;
}
// The elements of `t` in NCHW order as their bit patterns (f32, or a half type's 16 bits), whatever
// its layout, so that comparisons are exact.
std::vector<uint32_t> bits(const Tensor& t) {
  auto p = ref().to_plain(t);
  REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  std::vector<uint32_t> out(static_cast<size_t>(p->numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = dtype_size(p->dtype()) == 2 ? p->data<uint16_t>()[i] : p->data<uint32_t>()[i];
  return out;
}
// `t` (f32 values) in `dtype`: f32 as it is, else rounded once.
Tensor in(const Tensor& t, DType dtype) { return dtype == DType::kF32 ? *t.clone() : host_cast(t, dtype); }

}  // namespace

TEST_CASE("to_channels_last stores [N][H][W][C] (cuda's order, kernels::nhwc_position); to_plain undoes it; "
          "refusals") {
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    CAPTURE(dtype_name(dtype));
    const Tensor x = in(random_f32({2, 3, 4, 5}, 1), dtype);
    const Tensor y = nhwc(x);
    CHECK(y.layout() == Layout::kNhwc);
    CHECK(y.shape() == x.shape());
    CHECK(y.dtype() == dtype);
    const size_t e = dtype_size(dtype);
    const auto* xs = static_cast<const unsigned char*>(x.raw());
    const auto* ys = static_cast<const unsigned char*>(y.raw());
    bool moved = true;
    for (int64_t j = 0; j < x.numel(); ++j)
      moved = moved && std::memcmp(ys + static_cast<size_t>(kernels::nhwc_position(j, 3, 20)) * e,
                                   xs + static_cast<size_t>(j) * e, e) == 0;
    CHECK(moved);
    // n = 1, h = 0, w = 1, c = 2: stored at ((1 * 20) + 1) * 3 + 2.
    CHECK(std::memcmp(ys + 65 * e, xs + static_cast<size_t>(((1 * 3 + 2) * 4 + 0) * 5 + 1) * e, e) == 0);
    CHECK(nhwc(y).raw() == y.raw());  // already channels last: itself
    CHECK(bits(y) == bits(x));
    auto p = ref().to_plain(y);
    REQUIRE(p.ok());
    CHECK(p->layout() == Layout::kPlain);
  }
  CHECK(ref().to_channels_last(random_f32({2, 3, 4}, 2)).status().code() == StatusCode::kInvalidArgument);
  auto cpu = testing::must_make("cpu");
  CHECK(cpu->to_channels_last(random_f32({1, 2, 3, 3}, 3)).status().code() == StatusCode::kUnimplemented);
}

TEST_CASE("training ops on channels-last tensors: the plain ops' values bit for bit, outputs labelled nhwc, "
          "parameter gradients and pooled features plain") {
  for (const DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    CAPTURE(dtype_name(dtype));
    const int64_t N = 3, C = 5, H = 7, W = 6, K = 4;
    const Conv2dParams cp{2, 1};
    const int64_t P = conv_out_extent(H, 3, 2, 1), Q = conv_out_extent(W, 3, 2, 1);
    const Tensor x = in(random_f32({N, C, H, W}, 1), dtype), w = in(random_f32({K, C, 3, 3}, 2, -0.3, 0.3), dtype),
                 b = in(random_f32({K}, 3), dtype), dy = in(random_f32({N, K, P, Q}, 4), dtype);
    const Tensor xl = nhwc(x), dyl = nhwc(dy);

    Tensor y = empty({N, K, P, Q}, dtype), yl = empty({N, K, P, Q}, dtype);
    OK(ref().conv2d_forward(x, w, b, cp, y));
    OK(ref().conv2d_forward(xl, w, b, cp, yl));
    CHECK(yl.layout() == Layout::kNhwc);
    CHECK(bits(yl) == bits(y));
    Tensor dx = empty(x.shape(), dtype), dxl = empty(x.shape(), dtype);
    OK(ref().conv2d_backward_data(dy, w, cp, dx));
    OK(ref().conv2d_backward_data(dyl, w, cp, dxl));
    CHECK(dxl.layout() == Layout::kNhwc);
    CHECK(bits(dxl) == bits(dx));
    // Backward weights: f32 master gradients (dw, db plain) accumulate the same values.
    const Tensor dw0 = random_f32(w.shape(), 5), db0 = random_f32({K}, 6);
    Tensor dw = *dw0.clone(), db = *db0.clone(), dwl = *dw0.clone(), dbl = *db0.clone();
    OK(ref().conv2d_backward_weights(x, dy, cp, dw, db));
    OK(ref().conv2d_backward_weights(xl, dyl, cp, dwl, dbl));
    CHECK(dwl.layout() == Layout::kPlain);
    CHECK(bits(dwl) == bits(dw));
    CHECK(bits(dbl) == bits(db));

    // Batch norm, training forward: y channels last; saved and running statistics the plain run's.
    const Tensor gamma = random_f32({C}, 7, 0.5, 1.5), beta = random_f32({C}, 8);
    Tensor rm = random_f32({C}, 9), rv = random_f32({C}, 10, 0.5, 1), rml = *rm.clone(), rvl = *rv.clone();
    Tensor bn = empty(x.shape(), dtype), bnl = empty(x.shape(), dtype);
    Tensor sm = empty({C}, DType::kF32), si = empty({C}, DType::kF32), sml = empty({C}, DType::kF32),
           sil = empty({C}, DType::kF32);
    OK(ref().batch_norm_forward_training(x, gamma, beta, 1e-5, 0.1, rm, rv, bn, sm, si));
    OK(ref().batch_norm_forward_training(xl, gamma, beta, 1e-5, 0.1, rml, rvl, bnl, sml, sil));
    CHECK(bnl.layout() == Layout::kNhwc);
    CHECK(bits(bnl) == bits(bn));
    CHECK(bits(sml) == bits(sm));
    CHECK(bits(sil) == bits(si));
    CHECK(bits(rml) == bits(rm));
    CHECK(bits(rvl) == bits(rv));
    Tensor bi = empty(x.shape(), dtype), bil = empty(x.shape(), dtype);
    OK(ref().batch_norm_forward_inference(x, gamma, beta, rm, rv, 1e-5, bi));
    OK(ref().batch_norm_forward_inference(xl, gamma, beta, rm, rv, 1e-5, bil));
    CHECK(bits(bil) == bits(bi));
    const Tensor dbn = in(random_f32(x.shape(), 11), dtype), dbnl = nhwc(dbn);
    Tensor dg = random_f32({C}, 12), dbt = random_f32({C}, 13), dgl = *dg.clone(), dbtl = *dbt.clone();
    Tensor bdx = empty(x.shape(), dtype), bdxl = empty(x.shape(), dtype);
    OK(ref().batch_norm_backward(x, dbn, gamma, sm, si, bdx, dg, dbt));
    OK(ref().batch_norm_backward(xl, dbnl, gamma, sm, si, bdxl, dgl, dbtl));
    CHECK(bdxl.layout() == Layout::kNhwc);
    CHECK(bits(bdxl) == bits(bdx));
    CHECK(bits(dgl) == bits(dg));
    CHECK(bits(dbtl) == bits(dbt));

    // ReLU (in place, as the layers may call it), its gradient, the residual add.
    Tensor r = *bn.clone(), rl = *bnl.clone();
    OK(ref().relu_forward(r, r));
    OK(ref().relu_forward(rl, rl));
    CHECK(rl.layout() == Layout::kNhwc);
    CHECK(bits(rl) == bits(r));
    Tensor rg = empty(x.shape(), dtype), rgl = empty(x.shape(), dtype);
    OK(ref().relu_backward(r, dbn, rg));
    OK(ref().relu_backward(rl, dbnl, rgl));
    CHECK(bits(rgl) == bits(rg));
    Tensor s = empty(x.shape(), dtype), sl = empty(x.shape(), dtype);
    OK(ref().add(r, bn, s));
    OK(ref().add(rl, bnl, sl));
    CHECK(sl.layout() == Layout::kNhwc);
    CHECK(bits(sl) == bits(s));

    // Max pooling 3x3 stride 2 pad 1 (ResNet's stem), forward and backward.
    const Pool2dParams pp{3, 2, 1};
    const int64_t PH = conv_out_extent(H, 3, 2, 1), PW = conv_out_extent(W, 3, 2, 1);
    Tensor m = empty({N, C, PH, PW}, dtype), ml = empty({N, C, PH, PW}, dtype);
    OK(ref().max_pool2d_forward(x, pp, m));
    OK(ref().max_pool2d_forward(xl, pp, ml));
    CHECK(ml.layout() == Layout::kNhwc);
    CHECK(bits(ml) == bits(m));
    const Tensor dm = in(random_f32(m.shape(), 14), dtype), dml = nhwc(dm);
    Tensor mdx = empty(x.shape(), dtype), mdxl = empty(x.shape(), dtype);
    OK(ref().max_pool2d_backward(x, dm, pp, mdx));
    OK(ref().max_pool2d_backward(xl, dml, pp, mdxl));
    CHECK(mdxl.layout() == Layout::kNhwc);
    CHECK(bits(mdxl) == bits(mdx));

    // Global average pooling: features [N, C] plain; the gradient in the layout dx is labelled.
    Tensor g = empty({N, C}, dtype), gl = empty({N, C}, dtype);
    OK(ref().global_avg_pool_forward(x, g));
    OK(ref().global_avg_pool_forward(xl, gl));
    CHECK(gl.layout() == Layout::kPlain);
    CHECK(bits(gl) == bits(g));
    const Tensor dg2 = in(random_f32({N, C}, 15), dtype);
    Tensor gdx = empty(x.shape(), dtype), gdxl = empty(x.shape(), dtype);
    OK(gdxl.set_layout(Layout::kNhwc));
    OK(ref().global_avg_pool_backward(dg2, gdx));
    OK(ref().global_avg_pool_backward(dg2, gdxl));
    CHECK(gdxl.layout() == Layout::kNhwc);
    CHECK(bits(gdxl) == bits(gdx));
  }
}

TEST_CASE("channels last: a call mixing layouts, and ops outside the list, are refused naming the op") {
  const Tensor a = random_f32({2, 3, 4, 4}, 1), al = nhwc(a);
  Tensor y = empty(a.shape(), DType::kF32);
  Status s = ref().add(al, a, y);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("add") != std::string::npos);
  CHECK(s.message().find("layout") != std::string::npos);
  s = ref().relu_backward(a, al, y);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("relu_backward") != std::string::npos);
  s = ref().mul(al, al, y);  // not a channels-last op
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("nhwc") != std::string::npos);
}

TEST_CASE("synchronised batch norm's pieces on channels-last tensors: the plain pieces' values bit for bit") {
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    CAPTURE(dtype_name(dtype));
    const int64_t N = 2, C = 3, H = 5, W = 4;
    const Tensor x = in(random_f32({N, C, H, W}, 1), dtype), dy = in(random_f32({N, C, H, W}, 2), dtype);
    const Tensor xl = nhwc(x), dyl = nhwc(dy);
    auto f64 = [](int64_t n) { return *Tensor::empty({n}, DType::kF64, cpu_allocator()); };
    Tensor st = f64(C + 1), stl = f64(C + 1), dv = f64(C), dvl = f64(C);
    OK(ref().batch_norm_stats(x, st));
    OK(ref().batch_norm_stats(xl, stl));
    OK(ref().batch_norm_deviations(x, st, dv));
    OK(ref().batch_norm_deviations(xl, stl, dvl));
    CHECK(std::memcmp(st.raw(), stl.raw(), st.bytes()) == 0);
    CHECK(std::memcmp(dv.raw(), dvl.raw(), dv.bytes()) == 0);
    const Tensor gamma = random_f32({C}, 3, 0.5, 1.5), beta = random_f32({C}, 4);
    Tensor rm = random_f32({C}, 5), rv = random_f32({C}, 6, 0.5, 1), rml = *rm.clone(), rvl = *rv.clone();
    Tensor y = empty(x.shape(), dtype), yl = empty(x.shape(), dtype), sm = empty({C}, DType::kF32),
           si = empty({C}, DType::kF32), sml = empty({C}, DType::kF32), sil = empty({C}, DType::kF32);
    OK(ref().batch_norm_forward_from_stats(x, gamma, beta, st, dv, 1e-5, 0.1, rm, rv, y, sm, si));
    OK(ref().batch_norm_forward_from_stats(xl, gamma, beta, stl, dvl, 1e-5, 0.1, rml, rvl, yl, sml, sil));
    CHECK(yl.layout() == Layout::kNhwc);
    CHECK(bits(yl) == bits(y));
    CHECK(bits(rml) == bits(rm));
    Tensor su = f64(2 * C), sul = f64(2 * C), dg = random_f32({C}, 7), db = random_f32({C}, 8), dgl = *dg.clone(),
           dbl = *db.clone();
    OK(ref().batch_norm_backward_reduce(x, dy, sm, si, su, dg, db));
    OK(ref().batch_norm_backward_reduce(xl, dyl, sm, si, sul, dgl, dbl));
    CHECK(std::memcmp(su.raw(), sul.raw(), su.bytes()) == 0);
    CHECK(bits(dgl) == bits(dg));
    Tensor dx = empty(x.shape(), dtype), dxl = empty(x.shape(), dtype);
    OK(ref().batch_norm_backward_elemt(x, dy, gamma, sm, si, st, su, dx));
    OK(ref().batch_norm_backward_elemt(xl, dyl, gamma, sm, si, stl, sul, dxl));
    CHECK(dxl.layout() == Layout::kNhwc);
    CHECK(bits(dxl) == bits(dx));
    Tensor bad = empty(x.shape(), dtype);
    CHECK(ref().batch_norm_backward_elemt(xl, dy, gamma, sm, si, st, su, bad).code() == StatusCode::kInvalidArgument);
  }
}

}  // namespace libtrain_test_channels_last
