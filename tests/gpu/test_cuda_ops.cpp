// gpu-labelled: the cuda backend against the reference backend, op by op (the same harness as
// test_cpu_ops.cpp: reference in f64, cuda in f32 on device copies of the same values; NaN/Inf
// first, then the largest error normalised by the reference's magnitude). Odd shapes: batch 1 and
// 3, channels 3 and 13, 1x1 / 3x3 / 7x7 kernels, stride 2, padding. Parameter gradients start at 1
// so that the accumulate (+=) rule is checked. Exits 77 (ctest's skip code) without a device.
//
// Tolerances: 1e-5 for our own kernels (f32 storage, double accumulation: the CPU's arithmetic
// apart from summation order and FMA contraction); 1e-4 for cuDNN convolutions and cuBLAS GEMMs
// (their algorithms, e.g. Winograd or FFT, reorder and transform the sums).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "../../libtrain/src/batch_uploader.h"
#include "../../libtrain/src/dist/sync_batch_norm.h"
#include "../../libtrain/src/kernels/launch.h"
#include "../libtrain/test_util.h"
#include "device_probe.h"
#include "slide/train/augment.h"
#include "slide/train/backend.h"
#include "slide/train/communicator.h"
#include "slide/train/copy_engine.h"
#include "slide/train/layers.h"
#include "slide/train/offload.h"
#include "slide/train/trainer.h"
#include "slide/train/embed.h"
#include "slide/train/inference_graph.h"
#include "slide/train/checkpoint.h"
#include "slide/train/vit.h"

using namespace slide::train;
using slide::core::StatusCode;
using testing::compare;
using testing::Pair;

namespace {

Backend& gpu() {
  static std::unique_ptr<Backend> b = testing::must_make("cuda");
  return *b;
}
Backend& ref() { return testing::reference(); }

Pair make(const Shape& s, uint64_t seed = 0, double lo = -1, double hi = 1, double fill = 0) {
  return testing::make_pair(s, seed, lo, hi, fill);
}

// A device copy of p.f.
Tensor up(const Tensor& host) {
  auto t = Tensor::empty(host.shape(), host.dtype(), gpu().allocator(), "device copy");
  REQUIRE_MESSAGE(t.ok(), t.status().to_string());
  Status s = gpu().upload(host, *t);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  return *t;
}
void down(const Tensor& dev, Tensor& host) {
  Status s = gpu().download(dev, host);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
}
Tensor labels_host(std::initializer_list<int32_t> v) {
  auto t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::kI32, cpu_allocator(), "labels");
  REQUIRE(t.ok());
  int i = 0;
  for (int32_t x : v) t->data<int32_t>()[i++] = x;
  return *t;
}

}  // namespace

TEST_CASE("cuda vs reference: conv2d forward, backward data, backward weights (+=)") {
  struct Case {
    int64_t N, C, H, W, K, R;
    Conv2dParams p;
  };
  for (Case c : {Case{1, 3, 13, 11, 5, 7, {2, 3}}, Case{3, 13, 9, 9, 7, 3, {1, 1}}, Case{3, 13, 8, 10, 4, 1, {2, 0}},
                 Case{1, 3, 6, 6, 2, 3, {2, 0}}}) {
    CAPTURE(c.N);
    CAPTURE(c.C);
    CAPTURE(c.R);
    CAPTURE(c.p.stride);
    const int64_t P = conv_out_extent(c.H, c.R, c.p.stride, c.p.pad), Q = conv_out_extent(c.W, c.R, c.p.stride, c.p.pad);
    Pair x = make({c.N, c.C, c.H, c.W}, 1), w = make({c.K, c.C, c.R, c.R}, 2), b = make({c.K}, 3),
         y = make({c.N, c.K, P, Q});
    Tensor X = up(x.f), Wt = up(w.f), B = up(b.f), Y = up(y.f);
    OK(ref().conv2d_forward(x.d, w.d, b.d, c.p, y.d));
    OK(gpu().conv2d_forward(X, Wt, B, c.p, Y));
    down(Y, y.f);
    compare("conv y", y, 1e-4);
    Pair dy = make({c.N, c.K, P, Q}, 4), dx = make(x.d.shape()), dw = make(w.d.shape(), 0, 0, 0, 1.0),
         db = make({c.K}, 0, 0, 0, 1.0);
    Tensor DY = up(dy.f), DX = up(dx.f), DW = up(dw.f), DB = up(db.f);
    OK(ref().conv2d_backward_data(dy.d, w.d, c.p, dx.d));
    OK(gpu().conv2d_backward_data(DY, Wt, c.p, DX));
    down(DX, dx.f);
    compare("conv dx", dx, 1e-4);
    OK(ref().conv2d_backward_weights(x.d, dy.d, c.p, dw.d, db.d));
    OK(gpu().conv2d_backward_weights(X, DY, c.p, DW, DB));
    down(DW, dw.f);
    down(DB, db.f);
    compare("conv dw (+=)", dw, 1e-4);
    compare("conv db (+=)", db, 1e-5);
  }
}

TEST_CASE("cuda: conv_workspace_bytes is the workspace each convolution pass then takes (the planner's figure)") {
  // ResNet-50's shapes at batch 16: the stem (7x7, stride 2), a 3x3 of layer1 and a strided 3x3 of
  // layer2. Asked before the pass runs (cuDNN's first deterministic candidate) and after (the
  // cached algorithm): both are the bytes the pass takes from the allocator beside its operands.
  struct Case {
    int64_t C, H, K, R;
    Conv2dParams p;
  };
  // Also on half-precision training storage (f16 under fp16): backward weights then also holds the
  // half filter gradient before it is added to the f32 dw.
  struct Guard {
    ~Guard() { (void)gpu().set_math_precision(MathPrecision::kFp32); }
  } guard;
  // Channels last (f16, nhwc): the passes also hold the KRSC filter copy, and backward weights the
  // filter gradient's KCRS copy.
  Allocator& alloc = gpu().allocator();
  for (const auto& config : {std::pair{DType::kF32, false}, std::pair{DType::kF16, false}, std::pair{DType::kF16, true},
                             std::pair{DType::kF32, true}})
  for (Case c : {Case{3, 224, 64, 7, {2, 3}}, Case{64, 56, 64, 3, {1, 1}}, Case{128, 56, 128, 3, {2, 1}}}) {
    const DType dt = config.first;
    const bool nhwc = config.second;
    const std::string dtype = dtype_name(dt);
    CAPTURE(dtype);
    CAPTURE(nhwc);
    CAPTURE(c.C);
    CAPTURE(c.R);
    OK(gpu().set_math_precision(dt == DType::kF16 ? MathPrecision::kFp16 : MathPrecision::kFp32));
    const int64_t N = 16, P = conv_out_extent(c.H, c.R, c.p.stride, c.p.pad);
    auto dev = [&](const Shape& s, DType t_dtype) {
      auto t = Tensor::empty(s, t_dtype, alloc, "operand");
      REQUIRE(t.ok());
      OK(t->set_zero());
      return *t;
    };
    Tensor x = dev({N, c.C, c.H, c.H}, dt), w = dev({c.K, c.C, c.R, c.R}, dt), y = dev({N, c.K, P, P}, dt),
           dw = dev({c.K, c.C, c.R, c.R}, DType::kF32);
    if (nhwc) {  // zeros in either order
      OK(x.set_layout(Layout::kNhwc));
      OK(y.set_layout(Layout::kNhwc));
    }
    Tensor no_db;
    auto taken = [&](auto&& run) {
      OK(gpu().synchronize());
      const size_t before = alloc.current_bytes();
      alloc.reset_peak();
      OK(run());
      OK(gpu().synchronize());
      return alloc.peak_bytes() - before;
    };
    for (ConvPass pass : {ConvPass::kForward, ConvPass::kBackwardData, ConvPass::kBackwardWeights}) {
      CAPTURE(static_cast<int>(pass));
      // Backward weights is asked with dw in w's place (f32 beside half x and dy).
      const Tensor& wq = pass == ConvPass::kBackwardWeights ? dw : w;
      auto planned = gpu().conv_workspace_bytes(pass, x, wq, c.p, y);
      REQUIRE_MESSAGE(planned.ok(), planned.status().to_string());
      const size_t bytes = taken([&] {
        return pass == ConvPass::kForward        ? gpu().conv2d_forward(x, w, Tensor(), c.p, y)
               : pass == ConvPass::kBackwardData ? gpu().conv2d_backward_data(y, w, c.p, x)
                                                 : gpu().conv2d_backward_weights(x, y, c.p, dw, no_db);
      });
      MESSAGE("pass ", static_cast<int>(pass), ": planned ", *planned, " B, taken ", bytes, " B");
      CHECK(bytes == *planned);
      auto again = gpu().conv_workspace_bytes(pass, x, wq, c.p, y);
      REQUIRE(again.ok());
      CHECK(*again == *planned);
    }
  }
}

TEST_CASE("cuda vs reference: fused inference convolution (cuDNN's bias + residual + ReLU; in place; no ReLU)") {
  struct Case {
    int64_t N, C, H, W, K, R;
    Conv2dParams p;
    bool relu, residual, in_place;
  };
  for (Case c : {Case{1, 3, 13, 11, 5, 7, {2, 3}, true, false, false}, Case{3, 13, 9, 9, 16, 3, {1, 1}, true, true, true},
                 Case{3, 13, 9, 9, 16, 3, {1, 1}, true, true, false}, Case{3, 13, 8, 10, 4, 1, {2, 0}, false, false, false},
                 Case{1, 16, 6, 6, 16, 1, {1, 0}, false, true, true}}) {
    CAPTURE(c.C);
    CAPTURE(c.R);
    CAPTURE(c.relu);
    CAPTURE(c.residual);
    CAPTURE(c.in_place);
    const int64_t P = conv_out_extent(c.H, c.R, c.p.stride, c.p.pad), Q = conv_out_extent(c.W, c.R, c.p.stride, c.p.pad);
    Pair x = make({c.N, c.C, c.H, c.W}, 1), w = make({c.K, c.C, c.R, c.R}, 2), b = make({c.K}, 3),
         z = make({c.N, c.K, P, Q}, 5, -2, 2), y = make({c.N, c.K, P, Q});
    auto pd = ref().prepare_fused_conv2d(w.d, b.d);
    auto pg = gpu().prepare_fused_conv2d(w.f, b.f);  // host tensors in: uploaded by the default prepare
    REQUIRE_MESSAGE(pd.ok(), pd.status().to_string());
    REQUIRE_MESSAGE(pg.ok(), pg.status().to_string());
    CHECK((*pg)->weight().device() == Device::kCuda);
    Tensor X = up(x.f), Z = up(z.f), Y = up(y.f);
    Pair& out = c.in_place ? z : y;
    Tensor& OUT = c.in_place ? Z : Y;
    OK(ref().fused_conv2d_inference(x.d, **pd, c.p, c.relu, c.residual ? &z.d : nullptr, out.d));
    OK(gpu().fused_conv2d_inference(X, **pg, c.p, c.relu, c.residual ? &Z : nullptr, OUT));
    down(OUT, out.f);
    compare("fused conv y", out, 1e-4);
    // Again with the cached algorithm: the same bits (deterministic algorithms only).
    if (!c.in_place) {
      Tensor Y2 = up(y.f);
      OK(gpu().fused_conv2d_inference(X, **pg, c.p, c.relu, c.residual ? &Z : nullptr, Y2));
      Pair again = make(out.d.shape());
      down(Y2, again.f);
      CHECK(std::memcmp(again.f.raw(), out.f.raw(), out.f.bytes()) == 0);
    }
  }
  // Weights prepared by another backend are refused.
  Pair x = make({1, 3, 8, 8}, 1), w = make({4, 3, 3, 3}, 2), y = make({1, 4, 6, 6});
  auto pd = ref().prepare_fused_conv2d(w.d, Tensor());
  REQUIRE(pd.ok());
  Tensor X = up(x.f), Y = up(y.f);
  CHECK(gpu().fused_conv2d_inference(X, **pd, Conv2dParams{1, 0}, true, nullptr, Y).code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("cuda vs reference: batch norm training, inference, backward") {
  // The last shape's channels are 17,995 values: three segments of a block each (kernels::bn_segments),
  // the last one shorter, crossing samples.
  for (Shape s : {Shape{3, 13, 5, 7}, Shape{1, 3, 4, 4}, Shape{5, 3, 59, 61}}) {
    const int64_t C = s[1];
    Pair x = make(s, 11, -2, 3), g = make({C}, 12, 0.5, 1.5), bt = make({C}, 13), rm = make({C}, 14),
         rv = make({C}, 15, 0.5, 2), y = make(s), sm = make({C}), si = make({C});
    Tensor X = up(x.f), G = up(g.f), BT = up(bt.f), RM = up(rm.f), RV = up(rv.f), Y = up(y.f), SM = up(sm.f),
           SI = up(si.f);
    OK(ref().batch_norm_forward_training(x.d, g.d, bt.d, 1e-5, 0.1, rm.d, rv.d, y.d, sm.d, si.d));
    OK(gpu().batch_norm_forward_training(X, G, BT, 1e-5, 0.1, RM, RV, Y, SM, SI));
    for (auto [d, p] : {std::pair{&Y, &y}, {&RM, &rm}, {&RV, &rv}, {&SM, &sm}, {&SI, &si}}) down(*d, p->f);
    compare("bn y", y, 1e-5);
    compare("bn running mean", rm, 1e-5);
    compare("bn running var", rv, 1e-5);
    compare("bn save mean", sm, 1e-5);
    compare("bn save invstd", si, 1e-5);
    Pair yi = make(s);
    Tensor YI = up(yi.f);
    OK(ref().batch_norm_forward_inference(x.d, g.d, bt.d, rm.d, rv.d, 1e-5, yi.d));
    OK(gpu().batch_norm_forward_inference(X, G, BT, RM, RV, 1e-5, YI));
    down(YI, yi.f);
    compare("bn inference y", yi, 1e-5);
    Pair dy = make(s, 16), dx = make(s), dg = make({C}, 0, 0, 0, 1.0), db = make({C}, 0, 0, 0, 1.0);
    Tensor DY = up(dy.f), DX = up(dx.f), DG = up(dg.f), DB = up(db.f);
    OK(ref().batch_norm_backward(x.d, dy.d, g.d, sm.d, si.d, dx.d, dg.d, db.d));
    OK(gpu().batch_norm_backward(X, DY, G, SM, SI, DX, DG, DB));
    down(DX, dx.f);
    down(DG, dg.f);
    down(DB, db.f);
    compare("bn dx", dx, 1e-5);
    compare("bn dgamma (+=)", dg, 1e-5);
    compare("bn dbeta (+=)", db, 1e-5);
  }
}

TEST_CASE("cuda: synchronised batch norm's pieces over one rank are cuda's batch norm, bit for bit (NCHW and "
          "channels last)") {
  // The local communicator's buffers are host memory: the device sums go through the staged
  // all-reduce (download, add, upload). The pieces keep the per-block order of cuda's batch norm.
  auto comm = make_communicator("local", 10).value();
  for (const bool nhwc : {false, true})
  for (Shape s : {Shape{3, 13, 5, 7}, Shape{1, 3, 4, 4}, Shape{5, 3, 59, 61}, Shape{2, 40, 30, 31}}) {
    CAPTURE(nhwc);
    const int64_t C = s[1];
    Pair x = make(s, 11, -2, 3), g = make({C}, 12, 0.5, 1.5), bt = make({C}, 13), rm = make({C}, 14),
         rv = make({C}, 15, 0.5, 2), dy = make(s, 16), one = make({C}, 0, 0, 0, 1.0), out = make(s), ch = make({C});
    auto image = [&](const Tensor& host) { return nhwc ? gpu().to_channels_last(up(host)).value() : up(host); };
    Tensor X = image(x.f), G = up(g.f), BT = up(bt.f), DY = image(dy.f);
    Tensor RM[2] = {up(rm.f), up(rm.f)}, RV[2] = {up(rv.f), up(rv.f)}, Y[2] = {up(out.f), up(out.f)},
           SM[2] = {up(ch.f), up(ch.f)}, SI[2] = {up(ch.f), up(ch.f)}, DX[2] = {up(out.f), up(out.f)},
           DG[2] = {up(one.f), up(one.f)}, DB[2] = {up(one.f), up(one.f)};
    OK(gpu().batch_norm_forward_training(X, G, BT, 1e-5, 0.1, RM[0], RV[0], Y[0], SM[0], SI[0]));
    OK(gpu().batch_norm_backward(X, DY, G, SM[0], SI[0], DX[0], DG[0], DB[0]));
    Tensor stats;
    OK(dist::sync_batch_norm_forward(*comm, gpu(), X, G, BT, 1e-5, 0.1, RM[1], RV[1], Y[1], SM[1], SI[1], &stats));
    OK(dist::sync_batch_norm_backward(*comm, gpu(), X, DY, G, SM[1], SI[1], stats, DX[1], DG[1], DB[1]));
    for (Tensor* t : {RM, RV, Y, SM, SI, DX, DG, DB}) {
      CHECK(t[1].layout() == t[0].layout());
      Tensor a = to_host(gpu(), gpu().to_plain(t[0]).value()).value(),
             b = to_host(gpu(), gpu().to_plain(t[1]).value()).value();
      REQUIRE(std::memcmp(a.data<float>(), b.data<float>(), static_cast<size_t>(a.numel()) * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("cuda: batch norm + ReLU as one op is batch norm then ReLU, bit for bit (f32, f16, bf16; NCHW and "
          "channels last)") {
  // cuda's fused op (the normalising pass stores max(y, 0); the backward passes mask dy as they
  // read it) against Backend's default on the same backend: batch_norm_forward_training then
  // relu_forward, relu_backward then batch_norm_backward. Same kernels, same order: the same bits.
  for (const DType dtype : {DType::kF32, DType::kF16, DType::kBF16})
  for (const bool nhwc : {false, true})
  for (Shape s : {Shape{3, 13, 5, 7}, Shape{2, 40, 30, 31}}) {
    CAPTURE(dtype_name(dtype));
    CAPTURE(nhwc);
    const int64_t C = s[1];
    Pair g = make({C}, 12, 0.5, 1.5), bt = make({C}, 13), rm = make({C}, 14), rv = make({C}, 15, 0.5, 2),
         one = make({C}, 0, 0, 0, 1.0), ch = make({C});
    auto image = [&](uint64_t seed, double lo, double hi) {
      Tensor d = up(testing::host_cast(testing::random_f32(s, seed, lo, hi), dtype));
      return nhwc ? gpu().to_channels_last(d).value() : d;
    };
    const Tensor X = image(11, -2, 3), DY = image(16, -1, 1), G = up(g.f), BT = up(bt.f);
    auto images = [&] { return *Tensor::empty(s, dtype, gpu().allocator(), "output"); };
    Tensor RM[2] = {up(rm.f), up(rm.f)}, RV[2] = {up(rv.f), up(rv.f)}, SM[2] = {up(ch.f), up(ch.f)},
           SI[2] = {up(ch.f), up(ch.f)}, DG[2] = {up(one.f), up(one.f)}, DB[2] = {up(one.f), up(one.f)},
           Y[2] = {images(), images()}, DX[2] = {images(), images()};
    OK(gpu().batch_norm_relu_forward_training(X, G, BT, 1e-5, 0.1, RM[0], RV[0], Y[0], SM[0], SI[0]));
    OK(gpu().batch_norm_relu_backward(X, Y[0], DY, G, SM[0], SI[0], DX[0], DG[0], DB[0]));
    OK(gpu().Backend::batch_norm_relu_forward_training(X, G, BT, 1e-5, 0.1, RM[1], RV[1], Y[1], SM[1], SI[1]));
    OK(gpu().Backend::batch_norm_relu_backward(X, Y[1], DY, G, SM[1], SI[1], DX[1], DG[1], DB[1]));
    for (Tensor* t : {RM, RV, SM, SI, DG, DB, Y, DX}) {
      CHECK(t[0].layout() == t[1].layout());
      Tensor a = to_host(gpu(), gpu().to_plain(t[0]).value()).value(),
             b = to_host(gpu(), gpu().to_plain(t[1]).value()).value();
      REQUIRE(std::memcmp(a.raw(), b.raw(), a.bytes()) == 0);
    }
    // The mask mattered: some outputs were clamped, some passed.
    const std::vector<float> y = testing::host_values(to_host(gpu(), gpu().to_plain(Y[0]).value()).value());
    CHECK(std::count(y.begin(), y.end(), 0.0f) > 0);
    CHECK(std::count_if(y.begin(), y.end(), [](float v) { return v > 0; }) > 0);
  }
}

TEST_CASE("cuda vs reference: element-wise ops, forward and backward") {
  const Shape s{3, 13, 5};
  Pair x = make(s, 21, -3, 3), z = make(s, 22), y = make(s), dy = make(s, 23), dx = make(s);
  Tensor X = up(x.f), Z = up(z.f), Y = up(y.f), DY = up(dy.f), DX = up(dx.f);
  struct Unary {
    const char* name;
    Status (Backend::*fwd)(const Tensor&, Tensor&);
    Status (Backend::*bwd)(const Tensor&, const Tensor&, Tensor&);
  };
  for (Unary u : {Unary{"relu", &Backend::relu_forward, &Backend::relu_backward},
                  Unary{"tanh", &Backend::tanh_forward, &Backend::tanh_backward},
                  Unary{"sigmoid", &Backend::sigmoid_forward, &Backend::sigmoid_backward}}) {
    CAPTURE(u.name);
    OK((ref().*u.fwd)(x.d, y.d));
    OK((gpu().*u.fwd)(X, Y));
    down(Y, y.f);
    compare(std::string(u.name) + " y", y, 1e-5);
    OK((ref().*u.bwd)(y.d, dy.d, dx.d));
    OK((gpu().*u.bwd)(Y, DY, DX));
    down(DX, dx.f);
    compare(std::string(u.name) + " dx", dx, 1e-5);
  }
  OK(ref().add(x.d, z.d, y.d));
  OK(gpu().add(X, Z, Y));
  down(Y, y.f);
  compare("add", y, 1e-6);
  OK(ref().mul(x.d, z.d, y.d));
  OK(gpu().mul(X, Z, Y));
  down(Y, y.f);
  compare("mul", y, 1e-6);
}

TEST_CASE("cuda vs reference: max pooling (first maximum wins ties), global average pooling") {
  for (Pool2dParams p : {Pool2dParams{3, 2, 1}, Pool2dParams{2, 2, 0}, Pool2dParams{3, 1, 1}}) {
    CAPTURE(p.kernel);
    CAPTURE(p.stride);
    const int64_t H = 9, W = 7, P = conv_out_extent(H, p.kernel, p.stride, p.pad),
                  Q = conv_out_extent(W, p.kernel, p.stride, p.pad);
    Pair x = make({3, 13, H, W}, 31), y = make({3, 13, P, Q}), dy = make({3, 13, P, Q}, 32), dx = make({3, 13, H, W});
    // Ties: a quarter of the values repeated, so the tie rule matters.
    for (int64_t i = 0; i < x.d.numel(); i += 4) x.f.data<float>()[i] = static_cast<float>(x.d.data<double>()[i] = 0.5);
    Tensor X = up(x.f), Y = up(y.f), DY = up(dy.f), DX = up(dx.f);
    OK(ref().max_pool2d_forward(x.d, p, y.d));
    OK(gpu().max_pool2d_forward(X, p, Y));
    down(Y, y.f);
    compare("max pool y", y, 1e-6);
    OK(ref().max_pool2d_backward(x.d, dy.d, p, dx.d));
    OK(gpu().max_pool2d_backward(X, DY, p, DX));
    down(DX, dx.f);
    compare("max pool dx", dx, 1e-6);
  }
  Pair x = make({3, 13, 5, 7}, 33), y = make({3, 13}), dy = make({3, 13}, 34), dx = make({3, 13, 5, 7});
  Tensor X = up(x.f), Y = up(y.f), DY = up(dy.f), DX = up(dx.f);
  OK(ref().global_avg_pool_forward(x.d, y.d));
  OK(gpu().global_avg_pool_forward(X, Y));
  down(Y, y.f);
  compare("gap y", y, 1e-6);
  OK(ref().global_avg_pool_backward(dy.d, dx.d));
  OK(gpu().global_avg_pool_backward(DY, DX));
  down(DX, dx.f);
  compare("gap dx", dx, 1e-6);
}

TEST_CASE("cuda vs reference: linear forward, backward data, backward weights (+=); matmul with transposes") {
  for (int64_t N : {1, 7}) {
    const int64_t I = 13, O = 5;
    Pair x = make({N, I}, 41), w = make({O, I}, 42), b = make({O}, 43), y = make({N, O});
    Tensor X = up(x.f), Wt = up(w.f), B = up(b.f), Y = up(y.f);
    OK(ref().linear_forward(x.d, w.d, b.d, y.d));
    OK(gpu().linear_forward(X, Wt, B, Y));
    down(Y, y.f);
    compare("linear y", y, 1e-4);
    Pair dy = make({N, O}, 44), dx = make({N, I}), dw = make({O, I}, 0, 0, 0, 1.0), db = make({O}, 0, 0, 0, 1.0);
    Tensor DY = up(dy.f), DX = up(dx.f), DW = up(dw.f), DB = up(db.f);
    OK(ref().linear_backward_data(dy.d, w.d, dx.d));
    OK(gpu().linear_backward_data(DY, Wt, DX));
    down(DX, dx.f);
    compare("linear dx", dx, 1e-4);
    OK(ref().linear_backward_weights(x.d, dy.d, dw.d, db.d));
    OK(gpu().linear_backward_weights(X, DY, DW, DB));
    down(DW, dw.f);
    down(DB, db.f);
    compare("linear dw (+=)", dw, 1e-4);
    compare("linear db (+=)", db, 1e-5);
  }
  const int64_t M = 3, K = 13, N = 5;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      CAPTURE(ta);
      CAPTURE(tb);
      Pair a = make(ta ? Shape{K, M} : Shape{M, K}, 51), b = make(tb ? Shape{N, K} : Shape{K, N}, 52), y = make({M, N});
      Tensor A = up(a.f), B = up(b.f), Y = up(y.f);
      OK(ref().matmul(a.d, ta, b.d, tb, y.d));
      OK(gpu().matmul(A, ta, B, tb, Y));
      down(Y, y.f);
      compare("matmul", y, 1e-4);
    }
}

TEST_CASE("cuda vs reference: row softmax; softmax cross-entropy with weights and smoothing; bad labels") {
  // A warp per row (rows of at most 1024: 3 rows of 13; 37 rows of 197 over 5 blocks of 8), held in
  // the lanes' registers up to 512 values (4, 8 or 16 a lane: 13, 197, 300), read as it goes beyond
  // (700); a block per row beyond 1024 (2 rows of 1500).
  for (auto [R, C] : {std::pair<int64_t, int64_t>{3, 13}, {37, 197}, {9, 300}, {5, 700}, {2, 1500}}) {
    CAPTURE(C);
    Pair x = make({R, C}, 61, -4, 4), y = make({R, C}), dy = make({R, C}, 62), dx = make({R, C});
    Tensor X = up(x.f), Y = up(y.f), DY = up(dy.f), DX = up(dx.f);
    OK(ref().softmax_forward(x.d, y.d));
    OK(gpu().softmax_forward(X, Y));
    down(Y, y.f);
    compare("softmax y", y, 1e-6);
    OK(ref().softmax_backward(y.d, dy.d, dx.d));
    OK(gpu().softmax_backward(Y, DY, DX));
    down(DX, dx.f);
    compare("softmax dx", dx, 1e-6);
  }

  const Tensor labels = labels_host({2, 0, 4, 4, 1, 3, 0});
  Tensor L = up(labels);
  Pair z = make({7, 5}, 63, -3, 3), w = make({5}, 64, 0.5, 2), probs = make({7, 5}), dz = make({7, 5});
  Tensor Z = up(z.f), Wt = up(w.f), PR = up(probs.f), DZ = up(dz.f);
  for (double smoothing : {0.0, 0.1})
    for (bool weighted : {false, true}) {
      CAPTURE(smoothing);
      CAPTURE(weighted);
      double loss_d = 0, loss_f = 0;
      OK(ref().softmax_cross_entropy_forward(z.d, labels, weighted ? w.d : Tensor(), smoothing, probs.d, &loss_d));
      OK(gpu().softmax_cross_entropy_forward(Z, L, weighted ? Wt : Tensor(), smoothing, PR, &loss_f));
      down(PR, probs.f);
      compare("cross-entropy probs", probs, 1e-6);
      CHECK(loss_f == doctest::Approx(loss_d).epsilon(1e-6));
      OK(ref().softmax_cross_entropy_backward(probs.d, labels, weighted ? w.d : Tensor(), smoothing, dz.d));
      OK(gpu().softmax_cross_entropy_backward(PR, L, weighted ? Wt : Tensor(), smoothing, DZ));
      down(DZ, dz.f);
      compare("cross-entropy dlogits", dz, 1e-6);
    }
  Tensor bad = up(labels_host({2, 0, 9, 4, 1, -1, 0}));
  double loss = 0;
  Status s = gpu().softmax_cross_entropy_forward(Z, bad, Tensor(), 0.0, PR, &loss);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("label 9 of sample 2 is outside [0, 5)") != std::string::npos);
  s = gpu().softmax_cross_entropy_backward(PR, bad, Tensor(), 0.0, DZ);
  CHECK(s.message().find("label 9 of sample 2 is outside [0, 5)") != std::string::npos);
}

TEST_CASE("cuda vs reference: SGD (momentum, Nesterov, weight decay) and AdamW, three steps") {
  const Shape s{13, 7};
  Pair p = make(s, 71), g = make(s, 72), buf = make(s), m = make(s), v = make(s);
  Tensor P = up(p.f), G = up(g.f), BUF = up(buf.f);
  for (int step = 0; step < 3; ++step) {
    OK(ref().sgd_update(p.d, g.d, buf.d, 0.1, 0.9, 0.0, 1e-4, true, step == 0));
    OK(gpu().sgd_update(P, G, BUF, 0.1, 0.9, 0.0, 1e-4, true, step == 0));
  }
  down(P, p.f);
  down(BUF, buf.f);
  compare("sgd param", p, 1e-6);
  compare("sgd momentum", buf, 1e-6);
  Pair q = make(s, 73);
  Tensor Q = up(q.f), M = up(m.f), V = up(v.f);
  for (int64_t step = 1; step <= 3; ++step) {
    OK(ref().adamw_update(q.d, g.d, m.d, v.d, 1e-3, 0.9, 0.999, 1e-8, 0.05, step));
    OK(gpu().adamw_update(Q, G, M, V, 1e-3, 0.9, 0.999, 1e-8, 0.05, step));
  }
  down(Q, q.f);
  compare("adamw param", q, 1e-6);
}

TEST_CASE("cuda vs reference: the ViT ops (layer norm, GELU forward and backward, scale, permute)") {
  Pair x = make({7, 13}, 91, -3, 3), g = make({13}, 92, 0.5, 1.5), b = make({13}, 93), y = make({7, 13}),
       dy = make({7, 13}, 94), dx = make({7, 13});
  Tensor X = up(x.f), G = up(g.f), B = up(b.f), Y = up(y.f), DY = up(dy.f), DX = up(dx.f);
  OK(ref().layer_norm_forward(x.d, g.d, b.d, 1e-6, y.d));
  OK(gpu().layer_norm_forward(X, G, B, 1e-6, Y));
  down(Y, y.f);
  compare("layer norm", y, 1e-5);
  OK(ref().gelu_forward(x.d, y.d));
  OK(gpu().gelu_forward(X, Y));
  down(Y, y.f);
  compare("gelu y", y, 1e-6);
  OK(ref().gelu_backward(x.d, dy.d, dx.d));
  OK(gpu().gelu_backward(X, DY, DX));
  down(DX, dx.f);
  compare("gelu dx", dx, 1e-6);
  OK(ref().scale(x.d, 0.125, y.d));
  OK(gpu().scale(X, 0.125, Y));
  down(Y, y.f);
  compare("scale", y, 1e-7);
  Pair q = make({2, 5, 3, 4, 3}, 95), p = make({3, 2, 4, 5, 3});
  Tensor Q = up(q.f), PT = up(p.f);
  OK(ref().permute(q.d, {2, 0, 3, 1, 4}, p.d));
  OK(gpu().permute(Q, {2, 0, 3, 1, 4}, PT));
  down(PT, p.f);
  compare("permute", p, 1e-7);
}

TEST_CASE("cuda vs reference: multi-head attention (strided-batched GEMMs straight into qkv)") {
  // Odd sizes: 3 sequences of 7 tokens, 4 heads of 5; ViT-B/16's own shape, one sequence and two
  // (each head's GEMMs are batched over the sequences, head-major scores); and 5 sequences of 4000
  // tokens, whose scores (64 MB each) the backend runs in chunks of 4 and 1
  // (kernels::attention_sequences_per_chunk under its 256 MiB scratch cap).
  CHECK(kernels::attention_sequences_per_chunk(5, 1, 4000, kernels::attention_scores_ld(4000), 4) == 4);
  for (auto [B, T, H, Dh] : {std::array<int64_t, 4>{3, 7, 4, 5}, std::array<int64_t, 4>{1, 197, 12, 64},
                             std::array<int64_t, 4>{2, 197, 12, 64}, std::array<int64_t, 4>{5, 4000, 1, 8}}) {
    CAPTURE(B);
    CAPTURE(T);
    const int64_t C = H * Dh;
    const double scale = 1.0 / std::sqrt(double(Dh));
    Pair qkv = make({B * T, 3 * C}, 97, -2, 2), out = make({B * T, C});
    Tensor QKV = up(qkv.f), OUT = up(out.f);
    OK(ref().attention_forward(qkv.d, B, H, scale, out.d));
    OK(gpu().attention_forward(QKV, B, H, scale, OUT));
    down(OUT, out.f);
    compare("attention", out, 1e-4);
  }
  Pair qkv = make({6, 36}, 98), out = make({6, 12});
  Tensor QKV = up(qkv.f), OUT = up(out.f);
  CHECK(gpu().attention_forward(QKV, 4, 3, 0.5, OUT).code() == StatusCode::kInvalidArgument);  // 4 does not divide 6
  CHECK(gpu().attention_forward(qkv.f, 2, 3, 0.5, out.f).code() == StatusCode::kInvalidArgument);  // host tensors
}

TEST_CASE("cuda at tf32, bf16 and fp16 (--precision): convolutions, linear, matmul and attention within the precision's error") {
  // The f64 reference is exact; cuda may round the products' operands (TF32 tensor cores in cuDNN,
  // CUBLAS_COMPUTE_32F_FAST_TF32 / _16BF in cuBLAS). An operand rounded to b mantissa bits has a
  // relative error up to 2^-(b+1); a sum of n such products, with random signs, errs by about
  // sqrt(n) 2^-b times a product's size. Tolerances (of compare's normalised error): tf32 and fp16
  // (b = 10; every operand here is far inside f16's range) 1e-2, bf16 (b = 7; cuDNN runs bf16
  // convolutions in TF32) 5e-2, each well above the typical
  // error (n <= 117 here: 1e-3 and 1e-2) and far below a wrong result's (order 1). The errors
  // are printed, so that whoever runs this sees how much the tensor cores took.
  struct Guard {
    ~Guard() { (void)gpu().set_math_precision(MathPrecision::kFp32); }
  } guard;
  for (auto [prec, tol] : {std::pair{MathPrecision::kTf32, 1e-2}, std::pair{MathPrecision::kBf16, 5e-2},
                           std::pair{MathPrecision::kFp16, 1e-2}}) {
    const std::string name = math_precision_name(prec);
    CAPTURE(name);
    OK(gpu().set_math_precision(prec));
    CHECK(gpu().math_precision() == prec);
    const Conv2dParams p{1, 1};
    const int64_t N = 3, C = 13, H = 9, W = 9, K = 16, R = 3;
    Pair x = make({N, C, H, W}, 121), w = make({K, C, R, R}, 122), b = make({K}, 123), y = make({N, K, H, W});
    Tensor X = up(x.f), Wt = up(w.f), B = up(b.f), Y = up(y.f);
    OK(ref().conv2d_forward(x.d, w.d, b.d, p, y.d));
    OK(gpu().conv2d_forward(X, Wt, B, p, Y));
    down(Y, y.f);
    compare(name + " conv y", y, tol);
    Pair dy = make({N, K, H, W}, 124), dx = make(x.d.shape()), dw = make(w.d.shape(), 0, 0, 0, 1.0),
         db = make({K}, 0, 0, 0, 1.0);
    Tensor DY = up(dy.f), DX = up(dx.f), DW = up(dw.f), DB = up(db.f);
    OK(ref().conv2d_backward_data(dy.d, w.d, p, dx.d));
    OK(gpu().conv2d_backward_data(DY, Wt, p, DX));
    down(DX, dx.f);
    compare(name + " conv dx", dx, tol);
    OK(ref().conv2d_backward_weights(x.d, dy.d, p, dw.d, db.d));
    OK(gpu().conv2d_backward_weights(X, DY, p, DW, DB));
    down(DW, dw.f);
    down(DB, db.f);
    compare(name + " conv dw (+=)", dw, tol * 3);  // n = N H W = 243 terms
    compare(name + " conv db (+=)", db, 1e-5);     // a sum, not a product: our kernel, exact f32
    Pair lx = make({7, 64}, 125), lw = make({32, 64}, 126), lb = make({32}, 127), ly = make({7, 32});
    Tensor LX = up(lx.f), LW = up(lw.f), LB = up(lb.f), LY = up(ly.f);
    OK(ref().linear_forward(lx.d, lw.d, lb.d, ly.d));
    OK(gpu().linear_forward(LX, LW, LB, LY));
    down(LY, ly.f);
    compare(name + " linear y", ly, tol);
    Pair ma = make({64, 5}, 128), mb = make({9, 64}, 129), my = make({5, 9});
    Tensor MA = up(ma.f), MB = up(mb.f), MY = up(my.f);
    OK(ref().matmul(ma.d, true, mb.d, true, my.d));
    OK(gpu().matmul(MA, true, MB, true, MY));
    down(MY, my.f);
    compare(name + " matmul", my, tol);
    const int64_t T = 197, Hh = 12, Dh = 64;  // ViT-B/16's attention, one sequence
    Pair qkv = make({T, 3 * Hh * Dh}, 130, -2, 2), out = make({T, Hh * Dh});
    Tensor QKV = up(qkv.f), OUT = up(out.f);
    OK(ref().attention_forward(qkv.d, 1, Hh, 1.0 / 8.0, out.d));
    OK(gpu().attention_forward(QKV, 1, Hh, 1.0 / 8.0, OUT));
    down(OUT, out.f);
    compare(name + " attention", out, tol);
    double worst = 0;
    for (int64_t i = 0; i < y.d.numel(); ++i)
      worst = std::max(worst, std::abs(double(y.f.data<float>()[i]) - y.d.data<double>()[i]));
    MESSAGE(name, ": conv forward's largest error against f64 ", worst);
  }
  // fp32 again: FMA math and plain f32 GEMMs, the 1e-4 of the cases above.
  OK(gpu().set_math_precision(MathPrecision::kFp32));
  Pair lx = make({7, 64}, 131), lw = make({32, 64}, 132), lb = make({32}, 133), ly = make({7, 32});
  Tensor LX = up(lx.f), LW = up(lw.f), LB = up(lb.f), LY = up(ly.f);
  OK(ref().linear_forward(lx.d, lw.d, lb.d, ly.d));
  OK(gpu().linear_forward(LX, LW, LB, LY));
  down(LY, ly.f);
  compare("fp32 again: linear y", ly, 1e-4);
}

namespace {

// Host f32 values uniform in [lo, hi) as `half` (so every backend sees the same half-precision
// values), through the reference's cast (testing::host_cast).
using testing::host_cast;
using testing::host_values;
using testing::normalised_error;
Tensor host_half(const Shape& s, uint64_t seed, DType half, double lo = -1, double hi = 1) {
  return host_cast(make(s, seed, lo, hi).f, half);
}
// The device tensor's values as host f32 (made plain: channels last is cuda's layout for the
// inference graph's half activations; downloaded, then widened by the reference's cast).
std::vector<float> device_values(const Tensor& dev) {
  auto host = Tensor::empty(dev.shape(), dev.dtype(), cpu_allocator(), "download");
  REQUIRE(host.ok());
  auto plain = gpu().to_plain(dev);
  REQUIRE_MESSAGE(plain.ok(), plain.status().to_string());
  down(*plain, *host);
  return host_values(*host);
}
Tensor empty_on(Backend& be, const Shape& s, DType t) {
  auto r = Tensor::empty(s, t, be.allocator(), "output");
  REQUIRE(r.ok());
  return *r;
}

}  // namespace

TEST_CASE("cuda vs reference: half-precision storage (f16 / bf16 linear, GELU, sigmoid, mul, mixed add, layer norm, "
          "permute, attention)") {
  // The reference computes each op in f32 from the stored values and rounds once (backend.h). cuda's
  // element-wise kernels run the same formulas, so only a last-bit difference of a device function
  // (erff, expf) can flip a rounding: one half-type ulp, at most 2u of the normalised error below.
  // Its GEMMs accumulate in another order (f32 on tensor cores): again one flip apart; attention
  // rounds its probabilities once more (u of each, times |v| <= 2). Bounds in the half type's unit
  // roundoff u (f16 2^-11, bf16 2^-8) of compare's normalised error; a wrong element or layout
  // errs by order 1. The errors are printed.
  for (const DType half : {DType::kF16, DType::kBF16}) {
    const std::string name = dtype_name(half);
    CAPTURE(name);
    const double u = testing::unit_roundoff(half);
    // linear, with and without bias; ViT-B's qkv width, and an odd one.
    for (auto [N, I, O] : {std::array<int64_t, 3>{7, 24, 13}, std::array<int64_t, 3>{394, 768, 2304}}) {
      CAPTURE(O);
      const Tensor x = host_half({N, I}, 201, half), w = host_half({O, I}, 202, half, -0.1, 0.1),
                   b = host_half({O}, 203, half);
      for (const bool bias : {true, false}) {
        Tensor want = empty_on(ref(), {N, O}, half), got = empty_on(gpu(), {N, O}, half);
        OK(ref().linear_forward(x, w, bias ? b : Tensor(), want));
        OK(gpu().linear_forward(up(x), up(w), bias ? up(b) : Tensor(), got));
        const double e = normalised_error(device_values(got), host_values(want));
        MESSAGE(name, " linear ", N, "x", I, "x", O, std::string(bias ? " with bias" : ""), ": ", e / u, " u");
        CHECK(e <= 2 * u);
      }
      Tensor want = empty_on(ref(), {N, O}, half), got = empty_on(gpu(), {N, O}, half);
      OK(ref().linear_gelu_forward(x, w, b, want));
      OK(gpu().linear_gelu_forward(up(x), up(w), up(b), got));
      CHECK(normalised_error(device_values(got), host_values(want)) <= 4 * u);
    }
    // Element-wise: the same formulas.
    const Tensor v = host_half({5, 999}, 204, half, -4, 4), v2 = host_half({5, 999}, 205, half, -4, 4);
    const Tensor V = up(v), V2 = up(v2);
    for (int op = 0; op < 3; ++op) {
      CAPTURE(op);
      Tensor want = empty_on(ref(), v.shape(), half), got = empty_on(gpu(), v.shape(), half);
      if (op == 0) {
        OK(ref().gelu_forward(v, want));
        OK(gpu().gelu_forward(V, got));
      } else if (op == 1) {
        OK(ref().sigmoid_forward(v, want));
        OK(gpu().sigmoid_forward(V, got));
      } else {
        OK(ref().mul(v, v2, want));
        OK(gpu().mul(V, V2, got));
      }
      CHECK(normalised_error(device_values(got), host_values(want)) <= 2 * u);
    }
    // add: an f32 stream taking a half branch, in place (the ViT's x += branch); and all half.
    const Pair a = make({5, 999}, 206, -3, 3);
    Tensor A = up(a.f), want = *a.f.clone();
    OK(ref().add(want, v, want));
    OK(gpu().add(A, V, A));
    CHECK(normalised_error(device_values(A), host_values(want)) == 0);  // one f32 addition of the same values
    Tensor want_h = empty_on(ref(), v.shape(), half), got_h = empty_on(gpu(), v.shape(), half);
    OK(ref().add(v, v2, want_h));
    OK(gpu().add(V, V2, got_h));
    CHECK(normalised_error(device_values(got_h), host_values(want_h)) <= 2 * u);
    // Layer norm: f32 -> half (the ViT's norms), half -> half, half -> f32.
    const Pair g = make({999}, 207, 0.5, 1.5), bb = make({999}, 208);
    const Tensor G = up(g.f), BB = up(bb.f);
    for (auto [from, to] : {std::pair{DType::kF32, half}, std::pair{half, half}, std::pair{half, DType::kF32}}) {
      const Tensor in = from == DType::kF32 ? a.f : v;
      Tensor want_ln = empty_on(ref(), in.shape(), to), got_ln = empty_on(gpu(), in.shape(), to);
      OK(ref().layer_norm_forward(in, g.f, bb.f, 1e-6, want_ln));
      OK(gpu().layer_norm_forward(up(in), G, BB, 1e-6, got_ln));
      CHECK(normalised_error(device_values(got_ln), host_values(want_ln)) <= (to == DType::kF32 ? 1e-5 : 2 * u));
    }
    // permute moves bits.
    const Tensor q = host_half({2, 5, 3, 4, 3}, 209, half);
    Tensor want_p = empty_on(ref(), {3, 2, 4, 5, 3}, half), got_p = empty_on(gpu(), {3, 2, 4, 5, 3}, half);
    OK(ref().permute(q, {2, 0, 3, 1, 4}, want_p));
    OK(gpu().permute(up(q), {2, 0, 3, 1, 4}, got_p));
    CHECK(device_values(got_p) == host_values(want_p));
    // Attention: odd sizes, ViT-B/16's shape over two sequences, and 5 sequences of 4000 tokens whose
    // scores and half probabilities (96 MB each) run in chunks of 2, 2 and 1.
    for (auto [B, T, H, Dh] : {std::array<int64_t, 4>{3, 7, 4, 5}, std::array<int64_t, 4>{2, 197, 12, 64},
                               std::array<int64_t, 4>{5, 4000, 1, 8}}) {
      CAPTURE(B);
      CAPTURE(T);
      const int64_t C = H * Dh;
      const Tensor qkv = host_half({B * T, 3 * C}, 210, half, -2, 2);
      Tensor want_a = empty_on(ref(), {B * T, C}, half), got_a = empty_on(gpu(), {B * T, C}, half);
      OK(ref().attention_forward(qkv, B, H, 1.0 / std::sqrt(double(Dh)), want_a));
      OK(gpu().attention_forward(up(qkv), B, H, 1.0 / std::sqrt(double(Dh)), got_a));
      const double e = normalised_error(device_values(got_a), host_values(want_a));
      MESSAGE(name, " attention ", B, "x", T, " tokens, ", H, " heads of ", Dh, ": ", e / u, " u");
      CHECK(e <= 6 * u);
    }
    // Refused: a half first operand with an f32 second; half where the list has none (relu).
    Tensor out32 = empty_on(gpu(), v.shape(), DType::kF32), outh = empty_on(gpu(), v.shape(), half);
    CHECK(gpu().add(V, A, outh).code() == StatusCode::kInvalidArgument);
    CHECK(gpu().relu_forward(V, outh).code() == StatusCode::kUnimplemented);
    CHECK(gpu().softmax_forward(V, outh).code() == StatusCode::kUnimplemented);
    (void)out32;
  }
}

TEST_CASE("cuda: the ViT at fp16 and bf16 keeps f16 / bf16 activations and matches the reference's f32 features") {
  struct Guard {
    ~Guard() { (void)gpu().set_math_precision(MathPrecision::kFp32); }
  } guard;
  VitConfig c;  // a small Virchow2-like trunk: SwiGLU, layer scale, register tokens, token + mean
  c.image_size = 64;
  c.patch_size = 16;
  c.width = 128;
  c.depth = 4;
  c.heads = 2;
  c.mlp_hidden = 96;
  c.swiglu = true;
  c.layer_scale = true;
  c.reg_tokens = 4;
  c.pool = VitPool::kTokenAndMean;
  auto host_vit = VisionTransformer::create(ref(), c);
  REQUIRE(host_vit.ok());
  std::mt19937_64 rng(211);
  std::uniform_real_distribution<double> uni(-1, 1);
  for (const NamedTensor& nt : (*host_vit)->named_parameters()) {
    const Tensor& t = *nt.tensor;
    const bool gain = nt.name.find("norm") != std::string::npos && nt.name.find(".weight") != std::string::npos;
    const bool ls = nt.name.find("gamma") != std::string::npos;
    const double scale = t.rank() >= 2 ? 1.0 / std::sqrt(double(t.numel() / t.dim(0))) : 0.2;
    for (int64_t i = 0; i < t.numel(); ++i)
      t.data<float>()[i] = static_cast<float>(gain ? 1 + 0.2 * uni(rng) : ls ? 0.3 + 0.2 * uni(rng) : scale * uni(rng));
  }
  const std::string path = "/tmp/slide_gpu_half_vit_" + std::to_string(::getpid()) + ".safetensors";
  OK(save_safetensors(path, (*host_vit)->named_parameters()));
  auto dev_vit = VisionTransformer::create(gpu(), c);
  REQUIRE(dev_vit.ok());
  const Status loaded = (*dev_vit)->load(path);
  OK((*host_vit)->load(path));
  std::remove(path.c_str());
  OK(loaded);
  const int64_t N = 5, F = c.feature_dim();
  const Pair images = make({N, 3, 64, 64}, 212, -2, 2);
  Tensor want = empty_on(ref(), {N, F}, DType::kF32);
  OK((*host_vit)->forward(images.f, want));
  const Tensor IMAGES = up(images.f);
  for (auto [prec, half] : {std::pair{MathPrecision::kFp16, DType::kF16}, std::pair{MathPrecision::kBf16, DType::kBF16}}) {
    const std::string name = math_precision_name(prec);
    CAPTURE(name);
    OK(gpu().set_math_precision(prec));
    CHECK((*dev_vit)->activation_dtype() == half);  // the backend's choice, as slide-embed runs it
    Tensor got = empty_on(gpu(), {N, F}, DType::kF32);
    OK((*dev_vit)->forward(IMAGES, got));
    const double u = testing::unit_roundoff(half);
    const double e = normalised_error(device_values(got), host_values(want));
    MESSAGE(name, " ViT features against the reference's f32: ", e / u, " u");
    // The reference's own half run is within 4 u of its f32 (test_half_storage.cpp); cuda's sums run
    // in another order and its attention rounds the probabilities: 16 u, far below a wrong
    // element's order-1 error.
    CHECK(e < 16 * u);
  }
}

TEST_CASE("cuda vs reference: the inference graph's half-precision ops (fused convolution, max pooling) and "
          "ResNet-18 cut at layer3 at fp16 / bf16") {
  // cuDNN's half-precision convolution (f32 compute) rounds its output, then our epilogue adds
  // bias and residual and rounds again; the reference rounds once: a few roundings apart, plus
  // cuDNN's own summation order. Bounds in u (f16 2^-11, bf16 2^-8) of compare's normalised error.
  struct Guard {
    ~Guard() { (void)gpu().set_math_precision(MathPrecision::kFp32); }
  } guard;
  for (const DType half : {DType::kF16, DType::kBF16}) {
    const std::string name = dtype_name(half);
    CAPTURE(name);
    const double u = testing::unit_roundoff(half);
    const Conv2dParams p{2, 1};
    const int64_t N = 3, C = 13, H = 9, W = 9, K = 16, R = 3, P = 5;
    const Pair w = make({K, C, R, R}, 221, -0.3, 0.3), b = make({K}, 222);
    auto ref_w = ref().prepare_fused_conv2d(w.f, b.f);
    auto gpu_w = gpu().prepare_fused_conv2d(w.f, b.f);
    REQUIRE(ref_w.ok());
    REQUIRE(gpu_w.ok());
    const Tensor x = host_half({N, C, H, W}, 223, half), z = host_half({N, K, P, P}, 224, half);
    for (int variant = 0; variant < 3; ++variant) {  // ReLU; ReLU + residual in place (a block's last); no ReLU
      CAPTURE(variant);
      Tensor want = variant == 1 ? *z.clone() : empty_on(ref(), {N, K, P, P}, half);
      Tensor got = variant == 1 ? up(z) : empty_on(gpu(), {N, K, P, P}, half);
      const bool relu = variant != 2;
      OK(ref().fused_conv2d_inference(x, **ref_w, p, relu, variant == 1 ? &want : nullptr, want));
      OK(gpu().fused_conv2d_inference(up(x), **gpu_w, p, relu, variant == 1 ? &got : nullptr, got));
      // Channels last without a residual; the residual's layout (here plain) with one.
      CHECK(got.layout() == (variant == 1 ? Layout::kPlain : Layout::kNhwc));
      const double e = normalised_error(device_values(got), host_values(want));
      MESSAGE(name, " fused convolution (variant ", variant, "): ", e / u, " u");
      CHECK(e <= 4 * u);
    }
    const Tensor mp = host_half({2, 5, 9, 9}, 225, half, -4, 4);
    Tensor want_mp = empty_on(ref(), {2, 5, 5, 5}, half), got_mp = empty_on(gpu(), {2, 5, 5, 5}, half);
    OK(ref().max_pool2d_forward(mp, Pool2dParams{3, 2, 1}, want_mp));
    OK(gpu().max_pool2d_forward(up(mp), Pool2dParams{3, 2, 1}, got_mp));
    CHECK(device_values(got_mp) == host_values(want_mp));  // a maximum is chosen, not computed
    // Channels last in, channels last out: the same maxima (a fused convolution's NHWC output, then
    // pooling, against the reference's plain pair).
    Tensor conv_ref = empty_on(ref(), {N, K, P, P}, half), conv_gpu = empty_on(gpu(), {N, K, P, P}, half);
    OK(ref().fused_conv2d_inference(x, **ref_w, p, true, nullptr, conv_ref));
    OK(gpu().fused_conv2d_inference(up(x), **gpu_w, p, true, nullptr, conv_gpu));
    REQUIRE(conv_gpu.layout() == Layout::kNhwc);
    Tensor pool_ref = empty_on(ref(), {N, K, 3, 3}, half), pool_gpu = empty_on(gpu(), {N, K, 3, 3}, half);
    OK(ref().max_pool2d_forward(conv_ref, Pool2dParams{3, 2, 1}, pool_ref));
    OK(gpu().max_pool2d_forward(conv_gpu, Pool2dParams{3, 2, 1}, pool_gpu));
    CHECK(pool_gpu.layout() == Layout::kNhwc);
    CHECK(normalised_error(device_values(pool_gpu), host_values(pool_ref)) <= 4 * u);  // the convolution's differences
    // to_plain of channels last is a plain copy (its values: device_values above reads through it).
    auto plain = gpu().to_plain(conv_gpu);
    REQUIRE(plain.ok());
    CHECK(plain->layout() == Layout::kPlain);
    CHECK(plain->raw() != conv_gpu.raw());
  }
  // The graph as slide-embed runs it on cuda (the backend's activation dtype) against the
  // reference's f32 graph.
  auto model = make_resnet(cpu_allocator(), DType::kF32, 18, 3, 226);
  REQUIRE(model.ok());
  auto cut = find_cut(**model, "layer3");
  REQUIRE(cut.ok());
  auto graph = InferenceGraph::build(**model, *cut);
  REQUIRE(graph.ok());
  const Pair images = make({4, 3, 64, 64}, 227, -2, 2);
  OK(graph->prepare(ref()));
  auto want = graph->run(ref(), images.f);
  REQUIRE(want.ok());
  OK(graph->prepare(gpu()));
  for (auto [prec, half] : {std::pair{MathPrecision::kFp16, DType::kF16}, std::pair{MathPrecision::kBf16, DType::kBF16}}) {
    const std::string name = math_precision_name(prec);
    CAPTURE(name);
    OK(gpu().set_math_precision(prec));
    CHECK(graph->activation_dtype(gpu()) == half);
    auto got = graph->run(gpu(), up(images.f));
    REQUIRE_MESSAGE(got.ok(), got.status().to_string());
    CHECK(got->dtype() == DType::kF32);
    const double u = testing::unit_roundoff(half);
    const double e = normalised_error(device_values(*got), host_values(*want));
    MESSAGE(name, " ResNet-18 layer3 features against the reference's f32 graph: ", e / u, " u");
    CHECK(e < 16 * u);  // the reference's own half graph: 1.0 to 1.3 u (test_half_storage.cpp)
  }
}

TEST_CASE("cuda vs reference: training on half-precision storage (convolution's three passes, batch norm, ReLU, "
          "add, pooling, linear backward; f32 parameter gradients), NCHW and channels last") {
  // The reference computes each op in f32 from the stored half values and rounds once (its weight
  // gradients: the product rounded once to the half type, then added in f32). cuda: cuDNN's half
  // convolutions (f32 compute) in their own summation order, our kernels with the same formulas
  // (one flip of a rounding at most), cuBLAS's GemmEx. Bounds in u of the normalised error.
  // Channels last (backend.h "Channels last in training"): cuda's image tensors NHWC
  // (to_channels_last; NHWC convolutions with KRSC filters, batch norm on 32-channel blocks, the
  // [N H W, C] grids) against the reference's plain ones, with the same bounds; each output must
  // come back labelled nhwc. 13 and 40 channels: a partial 32-channel block, and one and a bit.
  struct Guard {
    ~Guard() { (void)gpu().set_math_precision(MathPrecision::kFp32); }
  } guard;
  for (auto [prec, half] : {std::pair{MathPrecision::kFp16, DType::kF16}, std::pair{MathPrecision::kBf16, DType::kBF16}})
  for (const Layout layout : {Layout::kPlain, Layout::kNhwc})
  for (const int64_t C : {int64_t{13}, int64_t{40}}) {
    const std::string name = std::string(dtype_name(half)) + " " + layout_name(layout);
    CAPTURE(name);
    CAPTURE(C);
    OK(gpu().set_math_precision(prec));
    const double u = testing::unit_roundoff(half);
    auto check = [&](const char* what, const Tensor& dev, const Tensor& want, double bound_u) {
      const double e = normalised_error(device_values(dev), host_values(want));
      MESSAGE(name, " C=", C, " ", what, ": ", e / u, " u");
      CAPTURE(what);
      CHECK(e <= bound_u * u);
    };
    // An image tensor on the device in this case's layout; an output's label must be it.
    const bool nhwc = layout == Layout::kNhwc;
    auto img = [&](const Tensor& host) {
      if (!nhwc) return up(host);
      auto t = gpu().to_channels_last(up(host));
      REQUIRE_MESSAGE(t.ok(), t.status().to_string());
      REQUIRE(t->layout() == Layout::kNhwc);
      return *t;
    };
    auto labelled = [&](const Tensor& dev) { CHECK(dev.layout() == layout); };
    const int64_t N = 3, H = 9, W = 9, K = 16, R = 3, P = 5;
    const Conv2dParams p{2, 1};
    const Tensor x = host_half({N, C, H, W}, 301, half), w = host_half({K, C, R, R}, 302, half, -0.3, 0.3),
                 b = host_half({K}, 303, half), dy = host_half({N, K, P, P}, 304, half);
    const Tensor xd = img(x), dyd = img(dy);
    Tensor want_y = empty_on(ref(), {N, K, P, P}, half), got_y = empty_on(gpu(), {N, K, P, P}, half);
    OK(ref().conv2d_forward(x, w, b, p, want_y));
    OK(gpu().conv2d_forward(xd, up(w), up(b), p, got_y));
    labelled(got_y);
    check("conv2d_forward (+ bias)", got_y, want_y, 4);  // cuDNN's rounding, then the bias's
    Tensor want_dx = empty_on(ref(), x.shape(), half), got_dx = empty_on(gpu(), x.shape(), half);
    OK(ref().conv2d_backward_data(dy, w, p, want_dx));
    OK(gpu().conv2d_backward_data(dyd, up(w), p, got_dx));
    labelled(got_dx);
    check("conv2d_backward_data", got_dx, want_dx, 4);
    const Pair dw0 = make({K, C, R, R}, 0, 0, 0, 1), db0 = make({K}, 0, 0, 0, 1);  // gradients start at 1: +=
    Tensor want_dw = *dw0.f.clone(), want_db = *db0.f.clone(), got_dw = up(dw0.f), got_db = up(db0.f);
    OK(ref().conv2d_backward_weights(x, dy, p, want_dw, want_db));
    OK(gpu().conv2d_backward_weights(xd, dyd, p, got_dw, got_db));
    CHECK(got_dw.dtype() == DType::kF32);
    CHECK(got_dw.layout() == Layout::kPlain);  // KCRS, whatever the activations' layout
    check("conv2d_backward_weights dw (f32)", got_dw, want_dw, 4);
    check("conv2d_backward_weights db (f32)", got_db, want_db, 0.01);  // f32 sums in double

    // Batch norm: x, y, dy, dx half; the per-channel tensors f32.
    const Pair gamma = make({C}, 305, 0.5, 1.5), beta = make({C}, 306), rm = make({C}, 307), rv = make({C}, 308, 0.5, 2);
    Tensor want_rm = *rm.f.clone(), want_rv = *rv.f.clone(), got_rm = up(rm.f), got_rv = up(rv.f);
    Tensor want_sm = empty_on(ref(), {C}, DType::kF32), want_si = empty_on(ref(), {C}, DType::kF32);
    Tensor got_sm = empty_on(gpu(), {C}, DType::kF32), got_si = empty_on(gpu(), {C}, DType::kF32);
    Tensor want_by = empty_on(ref(), x.shape(), half), got_by = empty_on(gpu(), x.shape(), half);
    OK(ref().batch_norm_forward_training(x, gamma.f, beta.f, 1e-5, 0.1, want_rm, want_rv, want_by, want_sm, want_si));
    OK(gpu().batch_norm_forward_training(xd, up(gamma.f), up(beta.f), 1e-5, 0.1, got_rm, got_rv, got_by, got_sm, got_si));
    labelled(got_by);
    check("batch_norm_forward_training y", got_by, want_by, 2);
    check("batch_norm_forward_training save_mean", got_sm, want_sm, 0.01);
    check("batch_norm_forward_training save_invstd", got_si, want_si, 0.01);
    check("batch_norm_forward_training running_mean", got_rm, want_rm, 0.01);
    check("batch_norm_forward_training running_var", got_rv, want_rv, 0.01);
    Tensor want_iy = empty_on(ref(), x.shape(), half), got_iy = empty_on(gpu(), x.shape(), half);
    OK(ref().batch_norm_forward_inference(x, gamma.f, beta.f, rm.f, rv.f, 1e-5, want_iy));
    OK(gpu().batch_norm_forward_inference(xd, up(gamma.f), up(beta.f), up(rm.f), up(rv.f), 1e-5, got_iy));
    labelled(got_iy);
    check("batch_norm_forward_inference", got_iy, want_iy, 2);
    const Tensor bdy = host_half(x.shape(), 309, half), bdyd = img(bdy);
    const Pair g1 = make({C}, 0, 0, 0, 1);
    Tensor want_bdx = empty_on(ref(), x.shape(), half), got_bdx = empty_on(gpu(), x.shape(), half);
    Tensor want_dg = *g1.f.clone(), want_dbt = *g1.f.clone(), got_dg = up(g1.f), got_dbt = up(g1.f);
    OK(ref().batch_norm_backward(x, bdy, gamma.f, want_sm, want_si, want_bdx, want_dg, want_dbt));
    OK(gpu().batch_norm_backward(xd, bdyd, up(gamma.f), got_sm, got_si, got_bdx, got_dg, got_dbt));
    labelled(got_bdx);
    check("batch_norm_backward dx", got_bdx, want_bdx, 4);
    check("batch_norm_backward dgamma", got_dg, want_dg, 0.01);
    check("batch_norm_backward dbeta", got_dbt, want_dbt, 0.01);

    // ReLU, the residual add and pooling: choices and f32 sums in the reference's order.
    Tensor want_r = empty_on(ref(), x.shape(), half), got_r = empty_on(gpu(), x.shape(), half);
    OK(ref().relu_forward(x, want_r));
    OK(gpu().relu_forward(xd, got_r));
    labelled(got_r);
    CHECK(device_values(got_r) == host_values(want_r));
    Tensor want_rg = empty_on(ref(), x.shape(), half), got_rg = empty_on(gpu(), x.shape(), half);
    OK(ref().relu_backward(want_r, bdy, want_rg));
    OK(gpu().relu_backward(got_r, bdyd, got_rg));
    labelled(got_rg);
    CHECK(device_values(got_rg) == host_values(want_rg));
    Tensor want_s = empty_on(ref(), x.shape(), half), got_s = empty_on(gpu(), x.shape(), half);
    OK(ref().add(want_r, bdy, want_s));
    OK(gpu().add(got_r, bdyd, got_s));
    labelled(got_s);
    CHECK(device_values(got_s) == host_values(want_s));
    if (nhwc) {  // one layout per call
      Tensor mixed = empty_on(gpu(), x.shape(), half);
      CHECK(gpu().add(got_r, up(bdy), mixed).code() == StatusCode::kInvalidArgument);
    }
    const Pool2dParams pp{3, 2, 1};
    Tensor want_m = empty_on(ref(), {N, C, 5, 5}, half), got_m = empty_on(gpu(), {N, C, 5, 5}, half);
    OK(ref().max_pool2d_forward(x, pp, want_m));
    OK(gpu().max_pool2d_forward(xd, pp, got_m));
    labelled(got_m);
    CHECK(device_values(got_m) == host_values(want_m));
    const Tensor pdy = host_half({N, C, 5, 5}, 310, half);
    Tensor want_pdx = empty_on(ref(), x.shape(), half), got_pdx = empty_on(gpu(), x.shape(), half);
    OK(ref().max_pool2d_backward(x, pdy, pp, want_pdx));
    OK(gpu().max_pool2d_backward(xd, img(pdy), pp, got_pdx));
    labelled(got_pdx);
    CHECK(device_values(got_pdx) == host_values(want_pdx));
    Tensor want_g = empty_on(ref(), {N, C}, half), got_g = empty_on(gpu(), {N, C}, half);
    OK(ref().global_avg_pool_forward(x, want_g));
    OK(gpu().global_avg_pool_forward(xd, got_g));
    check("global_avg_pool_forward", got_g, want_g, 2);
    const Tensor gdy = host_half({N, C}, 311, half);
    Tensor want_gdx = empty_on(ref(), x.shape(), half), got_gdx = empty_on(gpu(), x.shape(), half);
    OK(got_gdx.set_layout(layout));  // dx's label chooses its layout
    OK(ref().global_avg_pool_backward(gdy, want_gdx));
    OK(gpu().global_avg_pool_backward(up(gdy), got_gdx));
    labelled(got_gdx);
    check("global_avg_pool_backward", got_gdx, want_gdx, 2);
    if (nhwc || C != 13) continue;  // the linear layers below have no image tensors

    // Linear backward: data all half; weights into f32 (cuBLAS accumulates the product into dw
    // unrounded; the reference rounds it to the half type first: one rounding apart).
    const int64_t LN = 7, I = 24, O = 13;
    const Tensor lx = host_half({LN, I}, 312, half), lw = host_half({O, I}, 313, half, -0.3, 0.3),
                 ldy = host_half({LN, O}, 314, half);
    Tensor want_ldx = empty_on(ref(), {LN, I}, half), got_ldx = empty_on(gpu(), {LN, I}, half);
    OK(ref().linear_backward_data(ldy, lw, want_ldx));
    OK(gpu().linear_backward_data(up(ldy), up(lw), got_ldx));
    check("linear_backward_data", got_ldx, want_ldx, 2);
    const Pair lw0 = make({O, I}, 0, 0, 0, 1), lb0 = make({O}, 0, 0, 0, 1);
    Tensor want_ldw = *lw0.f.clone(), want_ldb = *lb0.f.clone(), got_ldw = up(lw0.f), got_ldb = up(lb0.f);
    OK(ref().linear_backward_weights(lx, ldy, want_ldw, want_ldb));
    OK(gpu().linear_backward_weights(up(lx), up(ldy), got_ldw, got_ldb));
    check("linear_backward_weights dw (f32)", got_ldw, want_ldw, 2);
    check("linear_backward_weights db (f32)", got_ldb, want_ldb, 0.01);
  }
}

TEST_CASE("cuda: a small CNN trained with half-precision activations (enable_half_activations) has the reference's "
          "gradients, as close as the reference's own half run is to its f32 run") {
  struct Guard {
    ~Guard() { (void)gpu().set_math_precision(MathPrecision::kFp32); }
  } guard;
  auto grads = [&](Backend& be, DType half, Layout layout = Layout::kPlain) {
    auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 4, 8, 3, 0.2);
    REQUIRE(model.ok());
    if (half != DType::kF32) OK(enable_half_activations(**model, half, layout));
    if (half == DType::kF32 && layout == Layout::kNhwc) OK(enable_channels_last(**model));
    OK(move_to_device(be, **model));
    (*model)->set_rng_seed(11);
    (*model)->set_input_gradient(false);
    const Pair images = make({8, 3, 32, 32}, 321, -2, 2);
    const Tensor labels = labels_host({0, 1, 2, 3, 0, 1, 2, 3});
    auto x = to_device(be, images.f);
    auto lab = to_device(be, labels);
    REQUIRE(x.ok());
    REQUIRE(lab.ok());
    auto logits = (*model)->forward(be, *x, true);
    REQUIRE_MESSAGE(logits.ok(), logits.status().to_string());
    REQUIRE(logits->dtype() == DType::kF32);
    Tensor probs = empty_on(be, logits->shape(), DType::kF32), dl = empty_on(be, logits->shape(), DType::kF32);
    double loss = 0;
    OK(be.softmax_cross_entropy_forward(*logits, *lab, Tensor(), 0.0, probs, &loss));
    OK(be.softmax_cross_entropy_backward(probs, *lab, Tensor(), 0.0, dl));
    const double scale = half == DType::kF16 ? 65536.0 : 1.0;  // GradScaler's initial scale under f16
    OK(be.scale(dl, scale, dl));
    REQUIRE((*model)->backward(be, dl).ok());
    std::vector<Parameter*> params;
    (*model)->collect("", &params, nullptr);
    std::vector<std::vector<float>> out;
    for (Parameter* q : params) {
      auto h = to_host(be, q->grad);
      REQUIRE(h.ok());
      std::vector<float> v = host_values(*h);
      for (float& e : v) e = static_cast<float>(e / scale);
      out.push_back(std::move(v));
    }
    return out;
  };
  auto rel = [](const std::vector<float>& got, const std::vector<float>& want) {
    double num = 0, den = 0;
    for (size_t j = 0; j < got.size(); ++j) {
      num += (double(got[j]) - want[j]) * (double(got[j]) - want[j]);
      den += double(want[j]) * want[j];
    }
    return std::sqrt(num / std::max(den, 1e-30));
  };
  const auto f32 = grads(ref(), DType::kF32);
  // f32 channels last (enable_channels_last; cuDNN's NHWC FLOAT convolutions at fp32's FMA math):
  // the reference's f32 gradients but for the summation order.
  {
    const auto last = grads(gpu(), DType::kF32, Layout::kNhwc);
    for (size_t i = 0; i < f32.size(); ++i) {
      const double e = rel(last[i], f32[i]);
      MESSAGE("f32 nhwc gradient ", i, ": ", e, " from the reference's");
      CHECK(e <= 1e-4);
    }
  }
  for (auto [prec, half] : {std::pair{MathPrecision::kFp16, DType::kF16}, std::pair{MathPrecision::kBf16, DType::kBF16}}) {
    const std::string name = dtype_name(half);
    CAPTURE(name);
    OK(gpu().set_math_precision(prec));
    const double u = testing::unit_roundoff(half);
    const auto ref_half = grads(ref(), half);
    for (const Layout layout : {Layout::kPlain, Layout::kNhwc}) {  // NCHW, and channels last
      const std::string layout_text = layout_name(layout);
      CAPTURE(layout_text);
      const auto gpu_half = grads(gpu(), half, layout);
      double sum = 0, sum_ref = 0;
      for (size_t i = 0; i < f32.size(); ++i) {
        const double e = rel(gpu_half[i], f32[i]), base = rel(ref_half[i], f32[i]);
        MESSAGE(name, " ", layout_text, " gradient ", i, ": cuda ", e / u, " u, reference ", base / u,
                " u from the f32 run");
        CHECK(e <= 3 * base + 8 * u);
        sum += e;
        sum_ref += base;
      }
      CHECK(sum <= 2 * sum_ref + 8 * u);
    }
  }
}

TEST_CASE("cuda vs reference: cast f32 <-> f16 / bf16, bit for bit (the same formulas)") {
  Pair x = make({100003}, 43, -70000, 70000);  // beyond f16's range at both ends: inf
  x.f.data<float>()[7] = std::numeric_limits<float>::quiet_NaN();
  x.f.data<float>()[8] = 1e-7f;  // an f16 subnormal
  for (DType half : {DType::kF16, DType::kBF16}) {
    CAPTURE(dtype_name(half));
    auto want = Tensor::empty(x.f.shape(), half, cpu_allocator(), "want");
    auto got = Tensor::empty(x.f.shape(), half, cpu_allocator(), "got");
    auto dev = Tensor::empty(x.f.shape(), half, gpu().allocator(), "device half");
    REQUIRE(want.ok());
    REQUIRE(got.ok());
    REQUIRE(dev.ok());
    OK(ref().cast(x.f, *want));
    OK(gpu().cast(up(x.f), *dev));
    down(*dev, *got);
    int64_t differ = 0;
    for (int64_t i = 0; i < x.f.numel(); ++i) differ += want->data<uint16_t>()[i] != got->data<uint16_t>()[i];
    CHECK(differ == 0);
    Tensor back = up(x.f);
    OK(gpu().cast(*dev, back));
    Pair b = make(x.f.shape());
    down(back, b.f);
    auto ref_back = Tensor::empty(x.f.shape(), DType::kF32, cpu_allocator(), "ref back");
    REQUIRE(ref_back.ok());
    OK(ref().cast(*want, *ref_back));
    CHECK(std::memcmp(ref_back->raw(), b.f.raw(), b.f.bytes()) == 0);
  }
}

TEST_CASE("cuda vs reference: gather_augment (--cache device) with crops, jitter, stain, flips and rotations") {
  // Tiles of random bytes; records covering each transform alone and all together, an odd size.
  const int64_t N = 5, S = 37;
  auto tiles = Tensor::empty({N, S, S, 3}, DType::kU8, cpu_allocator(), "tiles");
  REQUIRE(tiles.ok());
  uint64_t state = 12345;
  for (int64_t i = 0; i < tiles->numel(); ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    tiles->data<uint8_t>()[i] = static_cast<uint8_t>(state >> 56);
  }
  std::vector<AugmentRecord> recs(8);
  for (size_t b = 0; b < recs.size(); ++b) recs[b].index = static_cast<int64_t>(b % N);
  recs[1].flip = 1, recs[1].rot = 3;
  recs[2].crop = 1, recs[2].crop_x = 3, recs[2].crop_y = 5, recs[2].crop_w = 20, recs[2].crop_h = 31;
  recs[3].brightness = 1.3f;
  recs[4].contrast = 0.6f;
  recs[5].saturation = 1.4f, recs[5].hue = -0.2f;
  recs[5].stain = 1, recs[5].stain_alpha[0] = 1.05f, recs[5].stain_alpha[2] = 0.96f, recs[5].stain_beta[1] = -0.03f;
  recs[6] = recs[2], recs[6].index = 4, recs[6].flip = 1, recs[6].rot = 2, recs[6].brightness = 0.8f;
  recs[6].contrast = 1.3f, recs[6].saturation = 0.7f, recs[6].hue = 0.35f;
  recs[6].stain = 1, recs[6].stain_alpha[1] = 0.94f, recs[6].stain_beta[0] = 0.04f, recs[6].stain_beta[2] = -0.02f;
  recs[7] = recs[6], recs[7].rot = 1;
  const auto B = static_cast<int64_t>(recs.size()), R = static_cast<int64_t>(sizeof(AugmentRecord));
  auto rec_host = Tensor::empty({B, R}, DType::kU8, cpu_allocator(), "records");
  REQUIRE(rec_host.ok());
  std::memcpy(rec_host->raw(), recs.data(), static_cast<size_t>(B * R));
  auto want = Tensor::empty({B, 3, S, S}, DType::kF32, cpu_allocator(), "want");
  auto got = Tensor::empty({B, 3, S, S}, DType::kF32, cpu_allocator(), "got");
  auto dev = Tensor::empty({B, 3, S, S}, DType::kF32, gpu().allocator(), "device images");
  REQUIRE(want.ok());
  REQUIRE(got.ok());
  REQUIRE(dev.ok());
  OK(ref().gather_augment(*tiles, *rec_host, *want));
  OK(gpu().gather_augment(up(*tiles), up(*rec_host), *dev));
  down(*dev, *got);
  // The same formulas; the contrast mean is summed in another order, nvcc may contract a * b + c
  // into an FMA, and the device's logf / expf (HED jitter) are within 2 ulps of the host's: a few
  // float ulps of the normalised values (|v| <= 2.7).
  double worst = 0;
  for (int64_t i = 0; i < want->numel(); ++i) {
    const double d = std::abs(double(want->data<float>()[i]) - double(got->data<float>()[i]));
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
  }
  CHECK(worst < 1e-5);
}

TEST_CASE("cuda vs reference: sum of squares (the optimizer's gradient check), NaN and inf propagate") {
  // 1 element; one block; more than kSumOfSquaresBlocks x 256 elements (each thread loops).
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{300001}}) {
    CAPTURE(n);
    Pair x = make({n}, 41, -3, 3);
    double want = 0, got = 0;
    OK(ref().sum_of_squares(x.f, &want));  // the f32 values, summed in double
    OK(gpu().sum_of_squares(up(x.f), &got));
    CHECK(std::abs(got - want) <= 1e-12 * want);  // double sums of the same terms, another order
    double again = 0;
    OK(gpu().sum_of_squares(up(x.f), &again));
    CHECK(again == got);  // a fixed reduction tree: the same bits every run
  }
  Pair bad = make({5000}, 42);
  bad.f.data<float>()[4321] = std::numeric_limits<float>::quiet_NaN();
  double got = 0;
  OK(gpu().sum_of_squares(up(bad.f), &got));
  CHECK(std::isnan(got));
  bad.f.data<float>()[4321] = std::numeric_limits<float>::infinity();
  OK(gpu().sum_of_squares(up(bad.f), &got));
  CHECK(std::isinf(got));
  // Many at once (one wait): each sum the single op's bits, an empty tensor 0, the inf kept in
  // its own slot only.
  const Tensor a = up(make({1000}, 43).f), b = up(make({300001}, 44).f), e = up(make({0}).f), c = up(bad.f);
  std::vector<double> each(4, -1.0);
  OK(gpu().sum_of_squares_each({&a, &b, &e, &c}, each.data()));
  double one = 0;
  OK(gpu().sum_of_squares(a, &one));
  CHECK(each[0] == one);
  OK(gpu().sum_of_squares(b, &one));
  CHECK(each[1] == one);
  CHECK(each[2] == 0.0);
  CHECK(std::isinf(each[3]));
}

TEST_CASE("cuda: tensors on the host are refused; budgets and zeros work on the device") {
  Pair x = make({4}, 81), y = make({4});
  Status s = gpu().relu_forward(x.f, y.f);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("is on cpu") != std::string::npos);
  Allocator& a = gpu().allocator();
  const size_t saved = a.budget_bytes();
  a.set_budget_bytes(a.current_bytes() + 1024);
  auto big = Tensor::empty({1 << 20}, DType::kF32, a, "too big");
  CHECK(big.status().code() == StatusCode::kResourceExhausted);
  a.set_budget_bytes(saved);
  auto z = Tensor::zeros({1000}, DType::kF32, a, "zeros");
  REQUIRE(z.ok());
  Pair h = make({1000}, 0, 0, 0, 5.0);
  down(*z, h.f);
  CHECK(h.f.data<float>()[999] == 0.0f);
}

TEST_CASE("cuda: input batches on their own copy stream (BatchUploader): ordered after their copies, slots reused") {
  auto engine = gpu().new_copy_engine();
  REQUIRE(engine != nullptr);
  REQUIRE(engine->host_allocator() != nullptr);
  BatchUploader up(gpu(), std::move(engine));
  const int64_t n = 1 << 22;  // 16 MiB per batch: a copy long enough to race a kernel that did not wait
  auto batch = [&](float v) {
    Tensor h = Tensor::empty({n}, DType::kF32, up.host_allocator(), "pinned batch").value();
    std::fill_n(h.data<float>(), n, v);
    Tensor l = Tensor::empty({4}, DType::kI32, up.host_allocator(), "pinned labels").value();
    std::fill_n(l.data<int32_t>(), 4, static_cast<int32_t>(v));
    auto r = up.upload(h, l);
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    return std::move(*r);
  };
  for (int round = 0; round < 3; ++round) {
    BatchUploader::Uploaded a = batch(1.0f + round), b = batch(10.0f + round);
    CHECK(a.slot != b.slot);
    // The kernels run on the compute stream after the copies (ready): each reads its whole batch.
    OK(up.ready(a));
    OK(up.ready(b));
    Tensor sa = Tensor::empty({n}, DType::kF32, gpu().allocator()).value();
    Tensor sb = Tensor::empty({n}, DType::kF32, gpu().allocator()).value();
    OK(gpu().scale(a.images, 2.0, sa));
    OK(gpu().scale(b.images, 2.0, sb));
    Pair ha = make({n}), hb = make({n});
    down(sa, ha.f);
    down(sb, hb.f);
    CHECK(std::all_of(ha.f.data<float>(), ha.f.data<float>() + n, [&](float x) { return x == 2.0f * (1.0f + round); }));
    CHECK(std::all_of(hb.f.data<float>(), hb.f.data<float>() + n, [&](float x) { return x == 2.0f * (10.0f + round); }));
  }
  CHECK(up.slot_count() == 2);  // each round reused the two slots
  OK(up.trim());
}

TEST_CASE("cuda: the copy engine (activation offload) round trip, and offloaded ResNet-18 gradients bit for bit") {
  CopyEngine* engine = gpu().copy_engine();
  REQUIRE(engine != nullptr);
  CHECK(engine->asynchronous());
  REQUIRE(engine->host_allocator() != nullptr);
  // Device -> pinned host -> a second device buffer, behind a kernel that wrote the source.
  Pair a = make({1 << 20}, 91);
  Tensor d = up(a.f), d2 = up(make({1 << 20}).f);
  OK(gpu().scale(d, 2.0, d));  // queued on the compute stream: the copy must wait for it
  auto pinned = Tensor::empty({1 << 20}, DType::kF32, *engine->host_allocator(), "pinned");
  REQUIRE(pinned.ok());
  auto t1 = engine->start(gpu(), d, *pinned, CopyDirection::kToHost);
  REQUIRE_MESSAGE(t1.ok(), t1.status().to_string());
  OK(engine->wait(*t1));
  for (int64_t i = 0; i < (1 << 20); i += 4097) CHECK(pinned->data<float>()[i] == 2.0f * a.f.data<float>()[i]);
  auto t2 = engine->start(gpu(), *pinned, d2, CopyDirection::kToDevice);
  REQUIRE(t2.ok());
  OK(engine->wait(*t2));
  Pair back = make({1 << 20});
  down(d2, back.f);
  CHECK(std::memcmp(back.f.raw(), pinned->raw(), pinned->bytes()) == 0);
  CHECK(engine->wait(*t2).code() == StatusCode::kInvalidArgument);  // waited for already

  // One training step of ResNet-18 at 32 px, plain and with every block offloaded: the gradients
  // are the same bits (the copies only move bytes; the kernels see the same inputs).
  auto step = [&](Sequential& m) {
    OK(move_to_device(gpu(), m));
    Pair x = make({4, 3, 32, 32}, 92);
    Tensor xd = up(x.f);
    Tensor y = up(labels_host({0, 1, 2, 1}));
    auto logits = m.forward(gpu(), xd, true);
    REQUIRE_MESSAGE(logits.ok(), logits.status().to_string());
    auto probs = Tensor::empty(logits->shape(), DType::kF32, gpu().allocator(), "probs");
    auto dl = Tensor::empty(logits->shape(), DType::kF32, gpu().allocator(), "dlogits");
    REQUIRE(probs.ok());
    REQUIRE(dl.ok());
    double loss = 0;
    OK(gpu().softmax_cross_entropy_forward(*logits, y, Tensor(), 0, *probs, &loss));
    OK(gpu().softmax_cross_entropy_backward(*probs, y, Tensor(), 0, *dl));
    auto dx = m.backward(gpu(), *dl);
    REQUIRE_MESSAGE(dx.ok(), dx.status().to_string());
    std::vector<Parameter*> ps;
    m.collect("", &ps, nullptr);
    std::vector<std::vector<float>> grads;
    for (Parameter* p : ps) {
      auto h = to_host(gpu(), p->grad);
      REQUIRE(h.ok());
      grads.emplace_back(h->data<float>(), h->data<float>() + h->numel());
    }
    return grads;
  };
  auto plain = make_resnet(cpu_allocator(), DType::kF32, 18, 3, 7);
  auto off = make_resnet(cpu_allocator(), DType::kF32, 18, 3, 7);
  REQUIRE(plain.ok());
  REQUIRE(off.ok());
  REQUIRE(offload_activations(**off, "block", cpu_allocator()).ok());
  CHECK(step(**plain) == step(**off));
}

int main(int argc, char** argv) {
  if (slide::train::cuda::device_count() == 0) {
    std::printf("no CUDA device: skipping the cuda backend's parity tests\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
