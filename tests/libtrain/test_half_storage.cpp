// Half-precision storage (backend.h): the ops that take f16 / bf16 tensors, on the reference backend
// (the oracle the cuda parity suite compares against), their argument checks, and the Vision
// Transformer's trunk run with f16 / bf16 activations against its f32 run.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "../../libtrain/src/kernels/formulas.h"
#include "slide/train/backend.h"
#include "slide/train/checkpoint.h"
#include "slide/train/embed.h"
#include "slide/train/inference_graph.h"
#include "slide/train/layers.h"
#include "slide/train/vit.h"
#include "slide/tile/pipeline.h"
#include "test_fixtures.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_half_storage {

using namespace slide::train;
using slide::core::StatusCode;

namespace {

Backend& ref() { return testing::reference(); }

using testing::random_f32;
using testing::representable;

// One rounding of the half type (testing::unit_roundoff): the ops below round their output once,
// so their error against the f32 op on the same (already half) inputs is within a few of these; a
// test that needed more would have found a second rounding or a wrong value.
using testing::host_cast;
using testing::host_values;
using testing::normalised_error;
using testing::unit_roundoff;

}  // namespace

TEST_CASE("gelu_f32 (half storage's GELU, f32 arithmetic through erfc) is within a few f32 ulps of the double "
          "gelu, tiny negative values included") {
  // Where 1 + erf(x / sqrt 2) would cancel (x < -2) the relative error stays small: erfc keeps it.
  // The oracle is the same expression in double (formulas::gelu's 1 + erf cancels in double too,
  // below x = -5, where it returns 0 for values of order 1e-8 and less).
  double worst = 0, worst_vs_gelu = 0;
  for (int i = -120000; i <= 120000; ++i) {
    const float x = static_cast<float>(i) * 1e-4f;  // [-12, 12]
    const double want = 0.5 * double(x) * std::erfc(-double(x) * 0.70710678118654752440);
    const double got = formulas::gelu_f32(x);
    // erfc's condition number near -x / sqrt 2 is about x^2: the f32 rounding of its argument alone
    // moves the value by x^2 f32 ulps, relative (1e-5 at x = -12, still 50x under f16's unit
    // roundoff).
    if (want != 0.0)
      worst = std::max(worst, std::abs(got - want) / std::abs(want) / (4.0 + double(x) * double(x)));
    if (x > -4.0f && x != 0.0f)
      worst_vs_gelu = std::max(worst_vs_gelu, std::abs(got - formulas::gelu(double(x))) / std::abs(want));
  }
  MESSAGE("gelu_f32 against formulas::gelu on (-4, 12]: ", worst_vs_gelu);
  CHECK(worst_vs_gelu < 1e-4);  // there, gelu's double evaluation loses at most a few digits
  MESSAGE("gelu_f32 worst relative error on [-12, 12], over (4 + x^2): ", worst, " (f32's 2^-24 = 5.96e-8)");
  CHECK(worst < 2 * 5.96e-8);
}

TEST_CASE("half storage: linear, GELU, sigmoid, mul, permute and attention on f16 / bf16 equal the f32 ops "
          "on the same values, rounded once") {
  for (const DType half : {DType::kF16, DType::kBF16}) {
    const std::string half_name = dtype_name(half);
    CAPTURE(half_name);
    const double u = unit_roundoff(half);
    // Inputs already representable in the half type, so the f32 op sees the same values.
    const Tensor x = representable({7, 24}, 1, half), w = representable({13, 24}, 2, half, -0.5, 0.5),
                 b = representable({13}, 3, half);
    Tensor y32 = *Tensor::empty({7, 13}, DType::kF32, cpu_allocator());
    OK(ref().linear_forward(x, w, b, y32));
    Tensor yh = *Tensor::empty({7, 13}, half, cpu_allocator());
    OK(ref().linear_forward(host_cast(x, half), host_cast(w, half), host_cast(b, half), yh));
    CHECK(normalised_error(host_values(yh), host_values(y32)) <= u);  // one rounding of y
    Tensor yg32 = *Tensor::empty({7, 13}, DType::kF32, cpu_allocator()), ygh = *Tensor::empty({7, 13}, half, cpu_allocator());
    OK(ref().linear_gelu_forward(x, w, b, yg32));
    OK(ref().linear_gelu_forward(host_cast(x, half), host_cast(w, half), host_cast(b, half), ygh));
    // GELU of the rounded product: a second rounding of the composition (linear, then GELU).
    CHECK(normalised_error(host_values(ygh), host_values(yg32)) <= 3 * u);

    const Tensor v = representable({5, 9}, 4, half, -4, 4), v2 = representable({5, 9}, 5, half, -4, 4);
    for (int op = 0; op < 3; ++op) {
      CAPTURE(op);
      Tensor want = *Tensor::empty({5, 9}, DType::kF32, cpu_allocator()), got = *Tensor::empty({5, 9}, half, cpu_allocator());
      const Tensor vh = host_cast(v, half), v2h = host_cast(v2, half);
      if (op == 0) {
        OK(ref().gelu_forward(v, want));
        OK(ref().gelu_forward(vh, got));
      } else if (op == 1) {
        OK(ref().sigmoid_forward(v, want));
        OK(ref().sigmoid_forward(vh, got));
      } else {
        OK(ref().mul(v, v2, want));
        OK(ref().mul(vh, v2h, got));
      }
      // Rounded once: each value is its f32 value rounded to the half type, exactly. GELU's f32 value
      // on half storage is formulas::gelu_f32's (f32 arithmetic), within one half-type ulp of the
      // f32 op's (double arithmetic).
      const std::vector<float> g = host_values(got), wv = host_values(want), in = host_values(v);
      if (op == 0) CHECK(normalised_error(g, wv) <= u);
      for (size_t i = 0; i < g.size(); ++i) {
        const float f32 = op == 0 ? formulas::gelu_f32(in[i]) : wv[i];
        REQUIRE(g[i] == (half == DType::kF16 ? formulas::round_to_f16(f32) : formulas::round_to_bf16(f32)));
      }
    }

    // permute moves the 16-bit patterns.
    const Tensor p = host_cast(random_f32({2, 3, 4}, 6), half);
    Tensor q = *Tensor::empty({4, 2, 3}, half, cpu_allocator());
    OK(ref().permute(p, {2, 0, 1}, q));
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t j = 0; j < 3; ++j)
        for (int64_t k = 0; k < 4; ++k)
          REQUIRE(q.data<uint16_t>()[(k * 2 + i) * 3 + j] == p.data<uint16_t>()[(i * 3 + j) * 4 + k]);

    // Attention on half qkv against the f32 op on the same values.
    const int64_t B = 2, T = 5, H = 2, Dh = 4, C = H * Dh;
    const Tensor qkv = representable({B * T, 3 * C}, 7, half, -2, 2);
    Tensor o32 = *Tensor::empty({B * T, C}, DType::kF32, cpu_allocator()), oh = *Tensor::empty({B * T, C}, half, cpu_allocator());
    OK(ref().attention_forward(qkv, B, H, 0.5, o32));
    OK(ref().attention_forward(host_cast(qkv, half), B, H, 0.5, oh));
    CHECK(normalised_error(host_values(oh), host_values(o32)) <= u);  // one rounding
  }
}

TEST_CASE("half storage: add takes a half branch into an f32 stream; layer norm reads and writes either") {
  for (const DType half : {DType::kF16, DType::kBF16}) {
    const std::string half_name = dtype_name(half);
    CAPTURE(half_name);
    const Tensor a = random_f32({6, 10}, 11, -3, 3), bh = host_cast(random_f32({6, 10}, 12), half);
    Tensor y = *Tensor::empty({6, 10}, DType::kF32, cpu_allocator());
    OK(ref().add(a, bh, y));
    const std::vector<float> bv = host_values(bh);
    for (int64_t i = 0; i < a.numel(); ++i) REQUIRE(y.data<float>()[i] == a.data<float>()[i] + bv[static_cast<size_t>(i)]);
    // In place, as the ViT's residual stream: x += branch.
    Tensor x = *a.clone();
    OK(ref().add(x, bh, x));
    for (int64_t i = 0; i < a.numel(); ++i) REQUIRE(x.data<float>()[i] == y.data<float>()[i]);

    // Layer norm: f32 -> half is the f32 result rounded once; half -> f32 normalises the stored values.
    const Tensor g = random_f32({10}, 13, 0.5, 1.5), be = random_f32({10}, 14);
    Tensor ln32 = *Tensor::empty({6, 10}, DType::kF32, cpu_allocator()), lnh = *Tensor::empty({6, 10}, half, cpu_allocator());
    OK(ref().layer_norm_forward(a, g, be, 1e-6, ln32));
    OK(ref().layer_norm_forward(a, g, be, 1e-6, lnh));
    const std::vector<float> l32 = host_values(ln32), lh = host_values(lnh);
    for (size_t i = 0; i < l32.size(); ++i)
      REQUIRE(lh[i] == (half == DType::kF16 ? formulas::round_to_f16(l32[i]) : formulas::round_to_bf16(l32[i])));
    Tensor from_half = *Tensor::empty({6, 10}, DType::kF32, cpu_allocator()), want = *Tensor::empty({6, 10}, DType::kF32, cpu_allocator());
    const Tensor ah = host_cast(a, half);
    OK(ref().layer_norm_forward(ah, g, be, 1e-6, from_half));
    OK(ref().layer_norm_forward(host_cast(ah, DType::kF32), g, be, 1e-6, want));
    CHECK(host_values(from_half) == host_values(want));
  }
}

TEST_CASE("half storage: mixed or unsupported dtypes are refused naming the op") {
  const Tensor a32 = random_f32({4, 6}, 21), a16 = host_cast(a32, DType::kF16), abf = host_cast(a32, DType::kBF16);
  Tensor y32 = *Tensor::empty({4, 6}, DType::kF32, cpu_allocator()), y16 = *Tensor::empty({4, 6}, DType::kF16, cpu_allocator());
  // A half first operand with an f32 second: only f32 + half into f32 is a mixed add.
  Status s = ref().add(a16, a32, y16);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("add") != std::string::npos);
  CHECK(ref().add(a32, a16, y16).code() == StatusCode::kInvalidArgument);  // output must be f32
  CHECK(ref().add(abf, a16, y16).code() == StatusCode::kInvalidArgument);  // two half types
  CHECK(ref().mul(a32, a16, y32).code() == StatusCode::kInvalidArgument);  // mul is not mixed
  const Tensor g32 = random_f32({6}, 22), g16 = host_cast(g32, DType::kF16);
  CHECK(ref().layer_norm_forward(a16, g16, g16, 1e-6, y16).code() == StatusCode::kInvalidArgument);  // gamma f32
  Tensor ybf = *Tensor::empty({4, 6}, DType::kBF16, cpu_allocator());
  CHECK(ref().layer_norm_forward(a16, g32, g32, 1e-6, ybf).code() == StatusCode::kInvalidArgument);  // f16 -> bf16
  // Ops outside the list keep refusing half precision.
  CHECK(ref().tanh_forward(a16, y16).code() == StatusCode::kUnimplemented);
  CHECK(ref().softmax_forward(a16, y16).code() == StatusCode::kUnimplemented);
  // The cpu backend keeps f32 storage (its bf16 is oneDNN's f32-in, bf16-compute path).
  auto cpu = testing::must_make("cpu");
  CHECK(cpu->activation_dtype() == DType::kF32);
  OK(cpu->set_math_precision(MathPrecision::kBf16));
  CHECK(cpu->activation_dtype() == DType::kF32);
  const Tensor w16 = host_cast(random_f32({5, 6}, 23), DType::kF16);
  Tensor o16 = *Tensor::empty({4, 5}, DType::kF16, cpu_allocator());
  CHECK(cpu->linear_forward(a16, w16, Tensor(), o16).code() == StatusCode::kUnimplemented);
  CHECK(ref().activation_dtype() == DType::kF32);
}

namespace {

// A small ViT with random weights written to a safetensors file and loaded (load() makes the
// layer-scale rows), on the reference backend.
std::unique_ptr<VisionTransformer> make_vit(const VitConfig& c, uint64_t seed) {
  auto vit = VisionTransformer::create(ref(), c);
  REQUIRE_MESSAGE(vit.ok(), vit.status().to_string());
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  for (const NamedTensor& nt : (*vit)->named_parameters()) {
    const Tensor& t = *nt.tensor;
    const bool gain = nt.name.find("norm") != std::string::npos && nt.name.find(".weight") != std::string::npos;
    const bool ls = nt.name.find("gamma") != std::string::npos;
    // Weights at timm's scale (about 1 / sqrt(fan-in)), norm gains near 1, layer scale 0.1..0.5.
    const double scale = t.rank() >= 2 ? 1.0 / std::sqrt(double(t.numel() / t.dim(0))) : 0.2;
    for (int64_t i = 0; i < t.numel(); ++i)
      t.data<float>()[i] = static_cast<float>(gain ? 1 + 0.2 * u(g) : ls ? 0.3 + 0.2 * u(g) : scale * u(g));
  }
  const std::string path = (std::filesystem::temp_directory_path() / ("slide_half_vit_" + std::to_string(::getpid()) +
                                                                       "_" + std::to_string(seed) + ".safetensors"))
                               .string();
  const Status saved = save_safetensors(path, (*vit)->named_parameters());
  const Status loaded = saved.ok() ? (*vit)->load(path) : saved;
  std::filesystem::remove(path);
  OK(loaded);
  return std::move(*vit);
}

}  // namespace

TEST_CASE("ViT trunk with f16 / bf16 activations (as torch.autocast runs it) against its f32 run, on the reference") {
  VitConfig plain;  // ViT-B-like: GELU MLP, class token, token pooling
  plain.image_size = 32;
  plain.patch_size = 8;
  plain.width = 32;
  plain.depth = 3;
  plain.heads = 4;
  plain.mlp_hidden = 64;
  VitConfig virchow = plain;  // Virchow2-like: SwiGLU, layer scale, register tokens, token + mean
  virchow.swiglu = true;
  virchow.layer_scale = true;
  virchow.reg_tokens = 2;
  virchow.pool = VitPool::kTokenAndMean;
  virchow.mlp_hidden = 48;
  for (const VitConfig* c : {&plain, &virchow}) {
    CAPTURE(c->swiglu);
    std::unique_ptr<VisionTransformer> vit = make_vit(*c, c->swiglu ? 31 : 32);
    const int64_t N = 3, F = c->feature_dim();
    const Tensor images = random_f32({N, 3, 32, 32}, 33, -2, 2);
    CHECK(vit->activation_dtype() == DType::kF32);  // the reference's default
    Tensor f32 = *Tensor::empty({N, F}, DType::kF32, cpu_allocator());
    OK(vit->forward(images, f32));
    for (const DType half : {DType::kF16, DType::kBF16}) {
      const std::string half_name = dtype_name(half);
      CAPTURE(half_name);
      vit->set_activation_dtype(half);
      REQUIRE(vit->activation_dtype() == half);
      Tensor fh = *Tensor::empty({N, F}, DType::kF32, cpu_allocator());
      OK(vit->forward(images, fh));
      // The features stay f32 and near the f32 run: within a few roundings of the half type (3
      // blocks, each branch added into the f32 stream; measured 1.2 (f16) and 1.5 (bf16) of them).
      const double err = normalised_error(host_values(fh), host_values(f32));
      MESSAGE(std::string(c->layer_scale ? "layer scale, " : ""), half_name, " features: ", err / unit_roundoff(half),
              " u from the f32 run");
      CHECK(err < 4 * unit_roundoff(half));
      // ... and the half path ran: the features are not the f32 ones.
      CHECK(err > 0);
      // A second forward reuses the half weights and gives the same bits.
      Tensor again = *Tensor::empty({N, F}, DType::kF32, cpu_allocator());
      OK(vit->forward(images, again));
      CHECK(host_values(again) == host_values(fh));
    }
    // Back to f32: the f32 run's bits.
    vit->set_activation_dtype(DType::kF32);
    Tensor back = *Tensor::empty({N, F}, DType::kF32, cpu_allocator());
    OK(vit->forward(images, back));
    CHECK(host_values(back) == host_values(f32));
    vit->set_activation_dtype(DType::kF64);
    CHECK(vit->forward(images, back).code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("CNN inference graph with f16 / bf16 activations (ResNet-18 cut at layer3) against its f32 run, on the "
          "reference") {
  auto model = make_resnet(cpu_allocator(), DType::kF32, 18, 3, 61);
  REQUIRE(model.ok());
  testing::randomise_bn(**model, 62);
  auto cut = find_cut(**model, "layer3");
  REQUIRE(cut.ok());
  auto graph = InferenceGraph::build(**model, *cut);
  REQUIRE_MESSAGE(graph.ok(), graph.status().to_string());
  OK(graph->prepare(ref()));
  CHECK(graph->activation_dtype(ref()) == DType::kF32);
  const Tensor images = random_f32({2, 3, 32, 32}, 63, -2, 2);
  auto f32 = graph->run(ref(), images);
  REQUIRE_MESSAGE(f32.ok(), f32.status().to_string());
  REQUIRE(f32->dtype() == DType::kF32);
  for (const DType half : {DType::kF16, DType::kBF16}) {
    const std::string half_name = dtype_name(half);
    CAPTURE(half_name);
    graph->set_activation_dtype(half);
    auto got = graph->run(ref(), images);
    REQUIRE_MESSAGE(got.ok(), got.status().to_string());
    REQUIRE(got->dtype() == DType::kF32);  // the pooled features stay f32
    REQUIRE(got->shape() == f32->shape());
    // 7 fused convolutions (and a max pooling) deep, each output rounded to the half type.
    const double err = normalised_error(host_values(*got), host_values(*f32));
    MESSAGE(std::string(dtype_name(half)), " layer3 features: ", err / unit_roundoff(half), " u from the f32 graph");
    CHECK(err < 4 * unit_roundoff(half));  // measured 1.0 (f16) and 1.3 (bf16)
    CHECK(err > 0);  // the half path ran
  }
  // The fused convolution refuses half weights, and an x of another half type than y.
  graph->set_activation_dtype(DType::kF64);
  CHECK(graph->run(ref(), images).status().code() == StatusCode::kInvalidArgument);
  const Tensor w16 = host_cast(random_f32({4, 3, 3, 3}, 64), DType::kF16);
  auto prepared = ref().prepare_fused_conv2d(w16, Tensor());
  REQUIRE(prepared.ok());
  const Tensor x16 = host_cast(random_f32({1, 3, 5, 5}, 65), DType::kF16);
  Tensor y16 = *Tensor::empty({1, 4, 5, 5}, DType::kF16, cpu_allocator());
  CHECK(ref().fused_conv2d_inference(x16, **prepared, Conv2dParams{1, 1}, true, nullptr, y16).code() ==
        StatusCode::kInvalidArgument);
  auto prepared32 = ref().prepare_fused_conv2d(random_f32({4, 3, 3, 3}, 64), Tensor());
  REQUIRE(prepared32.ok());
  const Tensor xbf = host_cast(random_f32({1, 3, 5, 5}, 65), DType::kBF16);
  CHECK(ref().fused_conv2d_inference(xbf, **prepared32, Conv2dParams{1, 1}, true, nullptr, y16).code() ==
        StatusCode::kInvalidArgument);
  OK(ref().fused_conv2d_inference(x16, **prepared32, Conv2dParams{1, 1}, true, nullptr, y16));
}

}  // namespace libtrain_test_half_storage
