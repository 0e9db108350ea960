// Training on half-precision storage (backend.h, "Half-precision storage"; layers.h,
// enable_half_activations): the training ops on f16 / bf16 activations with f32 parameters, on the
// reference backend (the oracle of the cuda parity suite), their argument checks, and a CNN trained
// with half-precision activations against its f32 run.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "slide/train/activation_checkpoint.h"
#include "slide/train/backend.h"
#include "slide/train/communicator.h"
#include "slide/train/layers.h"
#include "slide/train/loss_scaler.h"
#include "slide/train/optimizer.h"
#include "slide/train/planner.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_half_training {

using namespace slide::train;
using slide::core::StatusCode;

namespace {

Backend& ref() { return testing::reference(); }
using testing::host_cast;
using testing::host_values;
using testing::normalised_error;
using testing::unit_roundoff;

using testing::random_f32;
using testing::representable;
Tensor empty(const Shape& s, DType t) { return *Tensor::empty(s, t, cpu_allocator()); }
Tensor zeros(const Shape& s) { return *Tensor::zeros(s, DType::kF32, cpu_allocator()); }
// The f32 values of `t` rounded once to `half` (round to nearest even), as f32.
std::vector<float> rounded(const Tensor& t, DType half) { return host_values(host_cast(t, half)); }

}  // namespace

TEST_CASE("half training ops: each output is the f32 op's on the same values, rounded once; parameter "
          "gradients stay f32") {
  for (const DType half : {DType::kF16, DType::kBF16}) {
    const std::string half_name = dtype_name(half);
    CAPTURE(half_name);
    auto h = [&](const Tensor& t) { return host_cast(t, half); };
    const int64_t N = 3, C = 5, H = 7, W = 6, K = 4;
    const Conv2dParams cp{2, 1};
    const int64_t P = conv_out_extent(H, 3, 2, 1), Q = conv_out_extent(W, 3, 2, 1);
    const Tensor x = representable({N, C, H, W}, 1, half), w = representable({K, C, 3, 3}, 2, half, -0.3, 0.3),
                 b = representable({K}, 3, half), dy = representable({N, K, P, Q}, 4, half);

    // Convolution forward and backward data: every operand half.
    Tensor y32 = empty({N, K, P, Q}, DType::kF32), yh = empty({N, K, P, Q}, half);
    OK(ref().conv2d_forward(x, w, b, cp, y32));
    OK(ref().conv2d_forward(h(x), h(w), h(b), cp, yh));
    CHECK(host_values(yh) == rounded(y32, half));
    Tensor dx32 = empty(x.shape(), DType::kF32), dxh = empty(x.shape(), half);
    OK(ref().conv2d_backward_data(dy, w, cp, dx32));
    OK(ref().conv2d_backward_data(h(dy), h(w), cp, dxh));
    CHECK(host_values(dxh) == rounded(dx32, half));

    // Backward weights: f32 dw and db accumulate; the product is rounded once to the half type
    // (cuDNN's half filter gradient), the bias sum is not.
    const Tensor dw0 = random_f32(w.shape(), 5), db0 = random_f32({K}, 6);
    Tensor dwp = zeros(w.shape()), dbp = zeros({K});
    OK(ref().conv2d_backward_weights(x, dy, cp, dwp, dbp));
    Tensor dw = *dw0.clone(), db = *db0.clone();
    OK(ref().conv2d_backward_weights(h(x), h(dy), cp, dw, db));
    CHECK(dw.dtype() == DType::kF32);
    const std::vector<float> r = rounded(dwp, half), d0 = host_values(dw0), got = host_values(dw);
    for (size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == d0[i] + r[i]);
    for (int64_t k = 0; k < K; ++k) CHECK(db.data<float>()[k] == db0.data<float>()[k] + dbp.data<float>()[k]);

    // Batch norm: x, y, dy, dx half; gamma, beta, running and saved statistics, dgamma, dbeta f32.
    const Tensor gamma = random_f32({C}, 7, 0.5, 1.5), beta = random_f32({C}, 8);
    Tensor rm32 = random_f32({C}, 9), rv32 = random_f32({C}, 10, 0.5, 2), rmh = *rm32.clone(), rvh = *rv32.clone();
    Tensor sm32 = empty({C}, DType::kF32), si32 = empty({C}, DType::kF32), smh = empty({C}, DType::kF32),
           sih = empty({C}, DType::kF32);
    Tensor by32 = empty(x.shape(), DType::kF32), byh = empty(x.shape(), half);
    OK(ref().batch_norm_forward_training(x, gamma, beta, 1e-5, 0.1, rm32, rv32, by32, sm32, si32));
    OK(ref().batch_norm_forward_training(h(x), gamma, beta, 1e-5, 0.1, rmh, rvh, byh, smh, sih));
    CHECK(host_values(byh) == rounded(by32, half));
    CHECK(host_values(smh) == host_values(sm32));  // statistics of the same values, in f32
    CHECK(host_values(sih) == host_values(si32));
    CHECK(host_values(rmh) == host_values(rm32));
    CHECK(host_values(rvh) == host_values(rv32));
    Tensor iy32 = empty(x.shape(), DType::kF32), iyh = empty(x.shape(), half);
    OK(ref().batch_norm_forward_inference(x, gamma, beta, rm32, rv32, 1e-5, iy32));
    OK(ref().batch_norm_forward_inference(h(x), gamma, beta, rm32, rv32, 1e-5, iyh));
    CHECK(host_values(iyh) == rounded(iy32, half));
    const Tensor bdy = representable(x.shape(), 11, half);
    Tensor bdx32 = empty(x.shape(), DType::kF32), bdxh = empty(x.shape(), half);
    Tensor dg32 = zeros({C}), db32 = zeros({C}), dgh = zeros({C}), dbh = zeros({C});
    OK(ref().batch_norm_backward(x, bdy, gamma, sm32, si32, bdx32, dg32, db32));
    OK(ref().batch_norm_backward(h(x), h(bdy), gamma, smh, sih, bdxh, dgh, dbh));
    CHECK(host_values(bdxh) == rounded(bdx32, half));
    CHECK(host_values(dgh) == host_values(dg32));
    CHECK(host_values(dbh) == host_values(db32));

    // ReLU, max pooling and global average pooling, forward and backward.
    Tensor r32 = empty(x.shape(), DType::kF32), rh = empty(x.shape(), half);
    OK(ref().relu_forward(x, r32));
    OK(ref().relu_forward(h(x), rh));
    CHECK(host_values(rh) == host_values(r32));  // exact: ReLU of a representable value
    Tensor rg32 = empty(x.shape(), DType::kF32), rgh = empty(x.shape(), half);
    OK(ref().relu_backward(r32, bdy, rg32));
    OK(ref().relu_backward(rh, h(bdy), rgh));
    CHECK(host_values(rgh) == host_values(rg32));
    const Pool2dParams pp{3, 2, 1};
    const int64_t PP = conv_out_extent(H, 3, 2, 1), PQ = conv_out_extent(W, 3, 2, 1);
    const Tensor pdy = representable({N, C, PP, PQ}, 12, half);
    Tensor pdx32 = empty(x.shape(), DType::kF32), pdxh = empty(x.shape(), half);
    OK(ref().max_pool2d_backward(x, pdy, pp, pdx32));
    OK(ref().max_pool2d_backward(h(x), h(pdy), pp, pdxh));
    CHECK(host_values(pdxh) == rounded(pdx32, half));  // overlapping windows sum, then one rounding
    Tensor g32 = empty({N, C}, DType::kF32), gh = empty({N, C}, half);
    OK(ref().global_avg_pool_forward(x, g32));
    OK(ref().global_avg_pool_forward(h(x), gh));
    CHECK(host_values(gh) == rounded(g32, half));
    const Tensor gdy = representable({N, C}, 13, half);
    Tensor gdx32 = empty(x.shape(), DType::kF32), gdxh = empty(x.shape(), half);
    OK(ref().global_avg_pool_backward(gdy, gdx32));
    OK(ref().global_avg_pool_backward(h(gdy), gdxh));
    CHECK(host_values(gdxh) == rounded(gdx32, half));

    // Linear backward: data all half; weights with f32 dw, db as the convolution's.
    const Tensor lx = representable({N, 9}, 14, half), lw = representable({4, 9}, 15, half),
                 ldy = representable({N, 4}, 16, half);
    Tensor ldx32 = empty({N, 9}, DType::kF32), ldxh = empty({N, 9}, half);
    OK(ref().linear_backward_data(ldy, lw, ldx32));
    OK(ref().linear_backward_data(h(ldy), h(lw), ldxh));
    CHECK(host_values(ldxh) == rounded(ldx32, half));
    Tensor ldwp = zeros({4, 9}), ldbp = zeros({4}), ldw = zeros({4, 9}), ldb = zeros({4});
    OK(ref().linear_backward_weights(lx, ldy, ldwp, ldbp));
    OK(ref().linear_backward_weights(h(lx), h(ldy), ldw, ldb));
    CHECK(host_values(ldw) == rounded(ldwp, half));
    CHECK(host_values(ldb) == host_values(ldbp));
  }
}

TEST_CASE("half training ops: parameters or statistics in a half type, and mixed activations, are refused "
          "naming the tensor") {
  const Tensor x = host_cast(random_f32({2, 3, 4, 4}, 1), DType::kF16);
  const Tensor g32 = random_f32({3}, 2), g16 = host_cast(g32, DType::kF16);
  Tensor rm = random_f32({3}, 3), rv = random_f32({3}, 4, 0.5, 1), y = empty(x.shape(), DType::kF16);
  Tensor sm = empty({3}, DType::kF32), si = empty({3}, DType::kF32), sm16 = empty({3}, DType::kF16);
  Status s = ref().batch_norm_forward_training(x, g16, g32, 1e-5, 0.1, rm, rv, y, sm, si);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("gamma") != std::string::npos);
  s = ref().batch_norm_forward_training(x, g32, g32, 1e-5, 0.1, rm, rv, y, sm16, si);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("save_mean") != std::string::npos);
  Tensor ybf = empty(x.shape(), DType::kBF16);
  s = ref().batch_norm_forward_training(x, g32, g32, 1e-5, 0.1, rm, rv, ybf, sm, si);
  CHECK(s.code() == StatusCode::kInvalidArgument);  // f16 in, bf16 out
  CHECK(s.message().find("y") != std::string::npos);
  // A half weight gradient (the master gradients are f32).
  const Tensor dy = host_cast(random_f32({2, 2, 4, 4}, 5), DType::kF16);
  Tensor dw16 = host_cast(random_f32({2, 3, 1, 1}, 6), DType::kF16);
  Tensor none;
  s = ref().conv2d_backward_weights(x, dy, {1, 0}, dw16, none);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("dw") != std::string::npos);
  // f32 x with a half dy.
  Tensor dw32 = zeros({2, 3, 1, 1});
  s = ref().conv2d_backward_weights(host_cast(x, DType::kF32), dy, {1, 0}, dw32, none);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  // The cpu backend keeps f32 storage: half training ops are unimplemented there.
  auto cpu = testing::must_make("cpu");
  Tensor yc = empty(x.shape(), DType::kF16);
  CHECK(cpu->relu_forward(x, yc).code() == StatusCode::kUnimplemented);
  const Tensor w16 = host_cast(random_f32({2, 3, 1, 1}, 7), DType::kF16);
  Tensor cy = empty({2, 2, 4, 4}, DType::kF16);
  CHECK(cpu->conv2d_forward(x, w16, Tensor(), {1, 0}, cy).code() == StatusCode::kUnimplemented);
}

namespace {

template <typename T>
std::unique_ptr<T> take(Result<std::unique_ptr<T>> r) {
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(*r);
}

struct Grads {
  std::vector<std::string> names;
  std::vector<std::vector<float>> values;  // per parameter, its gradient
  std::vector<float> logits;
  DType logits_dtype = DType::kF32;
};

using ModelFactory = std::function<std::unique_ptr<Sequential>()>;

// One training forward and backward of `make()`'s model on the reference backend, on a batch of
// random images [N, 3, S, S] (seed 21) with labels n % 4 and the cross-entropy's logit gradient
// times `scale` (the loss scale; the gradients are divided by it again). `half` (f16 / bf16)
// enables half-precision activations; `precision` sets the products' operand rounding.
// `layout` kNhwc makes the activations channels last as well (at f32: enable_channels_last);
// `sync` runs batch norm through the synchronised pieces over that communicator.
Grads gradients(const ModelFactory& make, int64_t N, int64_t S, DType half, double scale,
                MathPrecision precision = MathPrecision::kFp32, Layout layout = Layout::kPlain,
                Communicator* sync = nullptr) {
  OK(ref().set_math_precision(precision));
  std::unique_ptr<Sequential> model = make();
  if (sync != nullptr) model->set_batch_norm_sync(sync);
  if (half != DType::kF32) OK(enable_half_activations(*model, half, layout));
  if (half == DType::kF32 && layout == Layout::kNhwc) OK(enable_channels_last(*model));
  model->set_rng_seed(11);
  const Tensor images = random_f32({N, 3, S, S}, 21, -2, 2);
  Tensor labels = *Tensor::empty({N}, DType::kI32, cpu_allocator());
  for (int64_t i = 0; i < N; ++i) labels.data<int32_t>()[i] = static_cast<int32_t>(i % 4);
  auto logits = model->forward(ref(), images, true);
  REQUIRE_MESSAGE(logits.ok(), logits.status().to_string());
  Grads g;
  g.logits_dtype = logits->dtype();
  g.logits = host_values(*logits);
  Tensor probs = empty(logits->shape(), DType::kF32), dlogits = empty(logits->shape(), DType::kF32);
  double loss = 0;
  OK(ref().softmax_cross_entropy_forward(*logits, labels, Tensor(), 0.0, probs, &loss));
  OK(ref().softmax_cross_entropy_backward(probs, labels, Tensor(), 0.0, dlogits));
  OK(ref().scale(dlogits, scale, dlogits));
  model->set_input_gradient(false);
  auto dx = model->backward(ref(), dlogits);
  REQUIRE_MESSAGE(dx.ok(), dx.status().to_string());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  model->collect("", &params, &buffers);
  for (Parameter* p : params) {
    REQUIRE(p->value.dtype() == DType::kF32);
    REQUIRE(p->grad.dtype() == DType::kF32);
    g.names.push_back(p->name);
    std::vector<float> v = host_values(p->grad);
    for (float& e : v) e = static_cast<float>(e / scale);
    g.values.push_back(std::move(v));
  }
  for (Buffer* b : buffers) REQUIRE(b->value.dtype() == DType::kF32);
  OK(ref().set_math_precision(MathPrecision::kFp32));
  return g;
}

// Each parameter's gradient error against `want`'s, relative to its size (L2).
std::vector<double> relative_errors(const Grads& got, const Grads& want) {
  REQUIRE(got.values.size() == want.values.size());
  std::vector<double> out;
  for (size_t i = 0; i < got.values.size(); ++i) {
    double num = 0, den = 0;
    for (size_t j = 0; j < got.values[i].size(); ++j) {
      const double d = double(got.values[i][j]) - double(want.values[i][j]);
      num += d * d;
      den += double(want.values[i][j]) * double(want.values[i][j]);
    }
    out.push_back(std::sqrt(num / std::max(den, 1e-30)));
  }
  return out;
}

// fp16 takes GradScaler's initial scale, as training does: unscaled, f16's smallest normal (2^-14)
// would flush many small gradients.
double loss_scale(DType half) { return half == DType::kF16 ? 65536.0 : 1.0; }
MathPrecision rounding_of(DType half) { return half == DType::kF16 ? MathPrecision::kFp16 : MathPrecision::kBf16; }

}  // namespace

TEST_CASE("a small CNN with f16 / bf16 activations: logits within a few roundings of the f32 run's, every "
          "gradient as close as rounding the products' operands alone makes it") {
  // 3 x [conv 3x3, batch norm, ReLU, max pool 2], global average pool, dropout 0.2, linear, at
  // 32 px and a batch of 8. Backward through batch norm subtracts the channel's means of dy and
  // dy xhat, which cancels: at initialisation the first layers' gradients move by 50-150 u when only
  // the products' operands are rounded to the half type (f32 storage, MathPrecision; measured
  // here), so half-precision storage is held to that baseline: each gradient within 3x its
  // error (+ 4 u), their sum within 2x. A wrong formula or a lost loss scale is off by O(1).
  const ModelFactory cnn = [] { return take(make_small_cnn(cpu_allocator(), DType::kF32, 3, 4, 8, 3, 0.2)); };
  const Grads f32 = gradients(cnn, 8, 32, DType::kF32, 1.0);
  for (const DType half : {DType::kF16, DType::kBF16}) {
    const std::string half_name = dtype_name(half);
    CAPTURE(half_name);
    const Grads g = gradients(cnn, 8, 32, half, loss_scale(half));
    CHECK(g.names == f32.names);
    CHECK(g.logits_dtype == DType::kF32);
    const double u = unit_roundoff(half);
    const double logit_err = normalised_error(g.logits, f32.logits);
    CAPTURE(logit_err);
    CHECK(logit_err <= 8 * u);
    const std::vector<double> err = relative_errors(g, f32);
    const Grads rounded = gradients(cnn, 8, 32, DType::kF32, 1.0, rounding_of(half));
    const std::vector<double> base = relative_errors(rounded, f32);
    double sum = 0, sum_base = 0;
    for (size_t i = 0; i < err.size(); ++i) {
      CAPTURE(g.names[i]);
      CAPTURE(err[i]);
      CAPTURE(base[i]);
      CHECK(err[i] <= 3 * base[i] + 4 * u);
      sum += err[i];
      sum_base += base[i];
    }
    CHECK(sum <= 2 * sum_base);
  }
}

TEST_CASE("ResNet-18 with f16 / bf16 activations (torch.autocast's casts, f32 master weights): same parameter "
          "names, f32 logits, gradients as far from the f32 run's as rounding the products' operands alone") {
  // A batch of 4 at 32 px leaves layer4's batch norms 4 values per channel: gradients there are ill
  // conditioned, and rounding only the products' operands to the half type (f32 storage,
  // MathPrecision) already moves them by tens of percent. Half-precision storage must stay within
  // twice that.
  const ModelFactory resnet = [] { return take(make_resnet(cpu_allocator(), DType::kF32, 18, 4, 3, 0.2)); };
  const Grads f32 = gradients(resnet, 4, 32, DType::kF32, 1.0);
  for (const DType half : {DType::kF16, DType::kBF16}) {
    const std::string half_name = dtype_name(half);
    CAPTURE(half_name);
    // Under f16, GradScaler's initial 2^16 overflows the weight gradients of this batch (each is
    // rounded to f16 once, as cuDNN writes it): the scaler would skip the step and halve the scale.
    // 2^10 is where it would settle.
    const Grads g = gradients(resnet, 4, 32, half, half == DType::kF16 ? 1024.0 : 1.0);
    if (half == DType::kF16) {
      const Grads over = gradients(resnet, 4, 32, half, 65536.0);
      bool finite = true;
      for (const auto& v : over.values)
        for (float e : v) finite = finite && std::isfinite(e);
      CHECK_FALSE(finite);
    }
    const Grads rounded = gradients(resnet, 4, 32, DType::kF32, 1.0, rounding_of(half));
    CHECK(g.names == f32.names);  // checkpoints move between f32 and half runs
    CHECK(g.logits_dtype == DType::kF32);
    const double logit_err = normalised_error(g.logits, f32.logits),
                 logit_rounded = normalised_error(rounded.logits, f32.logits);
    CAPTURE(logit_err);
    CAPTURE(logit_rounded);
    CHECK(logit_err <= 2 * logit_rounded + 4 * unit_roundoff(half));
    const std::vector<double> err = relative_errors(g, f32), base = relative_errors(rounded, f32);
    double sum = 0, sum_base = 0;
    for (size_t i = 0; i < err.size(); ++i) {
      CAPTURE(g.names[i]);
      CAPTURE(err[i]);
      CAPTURE(base[i]);
      CHECK(err[i] <= 2 * base[i] + 0.05);
      sum += err[i];
      sum_base += base[i];
    }
    CHECK(sum <= 1.5 * sum_base);
  }
}

TEST_CASE("enable_half_activations: casts at both ends, refused twice or for f32; the memory plan halves the "
          "activations") {
  auto model = take(make_resnet(cpu_allocator(), DType::kF32, 18, 4, 3));
  CHECK(half_activation_dtype(*model) == DType::kF32);
  CHECK(enable_half_activations(*model, DType::kF32).code() == StatusCode::kInvalidArgument);
  const size_t layers = model->size();
  OK(enable_half_activations(*model, DType::kBF16));
  CHECK(half_activation_dtype(*model) == DType::kBF16);
  CHECK(model->size() == layers + 2);
  CHECK(model->name_at(0) == "cast_in");
  CHECK(model->name_at(model->size() - 1) == "cast_out");
  CHECK(enable_half_activations(*model, DType::kF16).code() == StatusCode::kInvalidArgument);

  // The input is data (the trainer's set_input_gradient(false)): cast_in passes it on, so conv1
  // skips its backward-data pass and the model returns no input gradient, as without the casts;
  // and a checkpointed stem (cast_in and conv1 in one segment) does the same.
  for (const bool checkpointed : {false, true}) {
    CAPTURE(checkpointed);
    auto cnn = take(make_small_cnn(cpu_allocator(), DType::kF32, 3, 4, 8, 3));
    OK(enable_half_activations(*cnn, DType::kBF16, Layout::kNhwc));
    if (checkpointed) REQUIRE(checkpoint_activations(*cnn, "2").ok());
    cnn->set_input_gradient(false);
    auto y = cnn->forward(ref(), random_f32({2, 3, 16, 16}, 1), true);
    REQUIRE_MESSAGE(y.ok(), y.status().to_string());
    auto dx = cnn->backward(ref(), random_f32(y->shape(), 2));
    REQUIRE_MESSAGE(dx.ok(), dx.status().to_string());
    CHECK_FALSE(dx->defined());
    cnn->set_input_gradient(true);
    y = cnn->forward(ref(), random_f32({2, 3, 16, 16}, 1), true);
    REQUIRE(y.ok());
    dx = cnn->backward(ref(), random_f32(y->shape(), 2));
    REQUIRE_MESSAGE(dx.ok(), dx.status().to_string());
    CHECK(dx->dtype() == DType::kF32);
    CHECK(dx->layout() == Layout::kPlain);
  }

  // The planner runs the layers on placeholders: with half activations the activation bytes halve,
  // the parameters' (and their gradients') do not.
  auto f32_model = take(make_resnet(cpu_allocator(), DType::kF32, 18, 4, 3));
  PlanOptions po;
  po.micro_batch = 32;
  po.sample_shape = {3, 224, 224};
  po.classes = 4;
  po.backend = "reference";
  auto plain = plan_memory(*f32_model, po);
  auto halved = plan_memory(*model, po);
  REQUIRE_MESSAGE(plain.ok(), plain.status().to_string());
  REQUIRE_MESSAGE(halved.ok(), halved.status().to_string());
  CAPTURE(plain->saved_bytes);
  CAPTURE(halved->saved_bytes);
  CHECK(halved->parameter_bytes == plain->parameter_bytes);
  CHECK(halved->gradient_bytes == plain->gradient_bytes);
  CHECK(halved->peak_bytes < plain->peak_bytes);
  // Saved activations: half the bytes, but for batch norm's f32 statistics and the half copies of
  // the weights saved for backward (2 bytes a parameter, as torch.autocast's weight cache).
  CHECK(double(halved->saved_bytes) < 0.6 * double(plain->saved_bytes));
}

TEST_CASE("channels-last training (enable_half_activations with nhwc, enable_channels_last at f32): a small CNN's "
          "and ResNet-18's logits and gradients equal the plain run's bit for bit on the reference") {
  // The reference stores the activations [N][H][W][C] as cuda does and computes each op on plain
  // copies, so every value must be the plain run's: what this checks is the model code (the casts,
  // the layouts the layers hand on, global average pooling's gradient, the residual adds).
  const ModelFactory cnn = [] { return take(make_small_cnn(cpu_allocator(), DType::kF32, 3, 4, 8, 3, 0.2)); };
  const ModelFactory resnet = [] { return take(make_resnet(cpu_allocator(), DType::kF32, 18, 4, 3, 0.2)); };
  for (const DType half : {DType::kF32, DType::kF16, DType::kBF16}) {
    const std::string half_name = dtype_name(half);
    CAPTURE(half_name);
    for (const auto& model : {std::pair{"small cnn", cnn}, std::pair{"resnet18", resnet}}) {
      const std::string name = model.first;
      const ModelFactory& make = model.second;
      CAPTURE(name);
      const double scale = half == DType::kF16 ? 1024.0 : 1.0;
      const Grads plain = gradients(make, 4, 32, half, scale);
      const Grads last = gradients(make, 4, 32, half, scale, MathPrecision::kFp32, Layout::kNhwc);
      CHECK(last.names == plain.names);
      CHECK(last.logits == plain.logits);
      REQUIRE(last.values.size() == plain.values.size());
      for (size_t i = 0; i < last.values.size(); ++i) {
        CAPTURE(plain.names[i]);
        CHECK(last.values[i] == plain.values[i]);
      }
    }
  }
  // --sync-bn keeps channels last: its pieces over one rank are batch norm, bit for bit.
  auto comm = make_communicator("local", 10).value();
  const Grads plain = gradients(cnn, 4, 32, DType::kBF16, 1.0);
  const Grads synced = gradients(cnn, 4, 32, DType::kBF16, 1.0, MathPrecision::kFp32, Layout::kNhwc, comm.get());
  CHECK(synced.logits == plain.logits);
  CHECK(synced.values == plain.values);
  auto model = take(make_resnet(cpu_allocator(), DType::kF32, 18, 4, 3));
  CHECK(activation_layout(*model) == Layout::kPlain);
  CHECK(enable_half_activations(*model, DType::kBF16, Layout::kNChw16c).code() == StatusCode::kInvalidArgument);
  OK(enable_half_activations(*model, DType::kBF16, Layout::kNhwc));
  CHECK(activation_layout(*model) == Layout::kNhwc);
  CHECK(enable_channels_last(*model).code() == StatusCode::kInvalidArgument);  // casts there already
  auto f32_last = take(make_small_cnn(cpu_allocator(), DType::kF32, 3, 4, 8, 3));
  OK(enable_channels_last(*f32_last));
  CHECK(activation_layout(*f32_last) == Layout::kNhwc);
  CHECK(half_activation_dtype(*f32_last) == DType::kF32);
  CHECK(enable_half_activations(*f32_last, DType::kBF16).code() == StatusCode::kInvalidArgument);
  // The planner runs the model on its placeholders (the relaid-out images counted).
  PlanOptions po;
  po.micro_batch = 8;
  po.sample_shape = {3, 64, 64};
  po.classes = 4;
  po.backend = "reference";
  auto plan = plan_memory(*model, po);
  REQUIRE_MESSAGE(plan.ok(), plan.status().to_string());
  CHECK(plan->peak_bytes > 0);
}

}  // namespace libtrain_test_half_training
