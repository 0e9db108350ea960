// slide-embed's inference path (FeatureExtractor: batch norm folded, ReLU and residual adds fused,
// blocked layouts) against the engine's own forward pass cut at the same layer (engine_features,
// the training code path in inference mode), on torchvision ResNets and the small CNN with
// randomised batch norm statistics, so that a wrong fold or fusion shows.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "slide/train/embed.h"
#include "../libtrain/test_fixtures.h"

using namespace slide::train;

namespace {

std::unique_ptr<Backend> backend(const char* name) {
  auto r = make_backend(name);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(*r);
}

using testing::randomise_bn;

std::vector<float> random_images(int64_t n, int64_t h, int64_t w, uint64_t seed) {
  std::vector<float> x(static_cast<size_t>(n * 3 * h * w));
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = nd(g);
  return x;
}

// max |a - b| / max(1, max |b|).
double rel_err(const std::vector<float>& a, const float* b, size_t n) {
  double err = 0, scale = 1;
  for (size_t i = 0; i < n; ++i) {
    err = std::max(err, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return err / scale;
}

// `graph_backend`: where the inference graph runs (null: cpu, FeatureExtractor's default).
void check_cut(Backend& be, Sequential& model, const std::string& layer, int64_t n, int64_t h, int64_t w,
               double tol, const char* graph_backend = nullptr) {
  CAPTURE(layer);
  auto cut = find_cut(model, layer);
  REQUIRE_MESSAGE(cut.ok(), cut.status().to_string());
  auto ex = FeatureExtractor::create(model, layer, graph_backend ? backend(graph_backend) : nullptr);
  REQUIRE_MESSAGE(ex.ok(), ex.status().to_string());
  const std::vector<float> x = random_images(n, h, w, 7);
  auto t = Tensor::empty({n, 3, h, w}, DType::kF32, cpu_allocator());
  REQUIRE(t.ok());
  std::copy(x.begin(), x.end(), t->data<float>());
  auto want = engine_features(be, model, *cut, *t);
  REQUIRE_MESSAGE(want.ok(), want.status().to_string());
  REQUIRE(want->rank() == 2);
  CHECK(want->dim(1) == (*ex)->feature_dim());
  const int64_t D = (*ex)->feature_dim();
  std::vector<float> got(static_cast<size_t>(n * D));
  auto s = (*ex)->extract(x.data(), n, h, w, got.data());
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  const double err = rel_err(got, want->data<float>(), got.size());
  CHECK_MESSAGE(err < tol, "max |fused - engine| / scale = " << err);
  // Another batch size (a second compiled plan), then the first again (the cached one): each
  // image's features do not depend on the batch it is in.
  std::vector<float> one(static_cast<size_t>(D));
  REQUIRE((*ex)->extract(x.data() + (n - 1) * 3 * h * w, 1, h, w, one.data()).ok());
  CHECK(rel_err(one, want->data<float>() + (n - 1) * D, one.size()) < tol);
  std::vector<float> again(got.size());
  REQUIRE((*ex)->extract(x.data(), n, h, w, again.data()).ok());
  CHECK(again == got);
}

}  // namespace

TEST_CASE("fused inference equals the engine's forward: resnet18, every cut, against the reference backend") {
  auto model = make_resnet(cpu_allocator(), DType::kF32, 18, 5, 11);
  REQUIRE(model.ok());
  randomise_bn(**model, 3);
  auto ref = backend("reference");
  for (const char* layer : {"relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"}) {
    check_cut(*ref, **model, layer, 2, 40, 48, 1e-4);
  }
}

TEST_CASE("one inference graph on every backend: reference and the simulated device equal the engine's forward") {
  auto model = make_resnet(cpu_allocator(), DType::kF32, 18, 5, 11);
  REQUIRE(model.ok());
  randomise_bn(**model, 3);
  auto ref = backend("reference");
  for (const char* graph : {"reference", "reference-sim"}) {
    CAPTURE(graph);
    for (const char* layer : {"relu", "maxpool", "layer2", "layer4", "fc"}) check_cut(*ref, **model, layer, 2, 40, 48, 1e-4, graph);
  }
  // The same graph on the reference backend and on the simulated device gives the same bits (the
  // same ops; the device only adds the uploads and downloads).
  auto a = FeatureExtractor::create(**model, "layer3", backend("reference"));
  auto b = FeatureExtractor::create(**model, "layer3", backend("reference-sim"));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK((*b)->backend().name() == "reference-sim");
  const std::vector<float> x = random_images(3, 32, 32, 9);
  std::vector<float> fa(3 * 256), fb(3 * 256);
  REQUIRE((*a)->extract(x.data(), 3, 32, 32, fa.data()).ok());
  REQUIRE((*b)->extract(x.data(), 3, 32, 32, fb.data()).ok());
  CHECK(fa == fb);
}

TEST_CASE("fused inference equals the engine's forward: resnet50 layer3 (CLAM's cut) and layer4, cpu backend") {
  auto model = make_resnet(cpu_allocator(), DType::kF32, 50, 10, 5);
  REQUIRE(model.ok());
  randomise_bn(**model, 4);
  auto cpu = backend("cpu");
  check_cut(*cpu, **model, "layer3", 3, 64, 64, 1e-4);
  check_cut(*cpu, **model, "layer4", 2, 64, 64, 1e-4);
  auto ex = FeatureExtractor::create(**model, "layer3");
  REQUIRE(ex.ok());
  CHECK((*ex)->feature_dim() == 1024);
}

TEST_CASE("fused inference equals the engine's forward: the small CNN") {
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 8, 2);
  REQUIRE(model.ok());
  randomise_bn(**model, 5);
  auto ref = backend("reference");
  check_cut(*ref, **model, "avgpool", 3, 32, 32, 1e-4);
  check_cut(*ref, **model, "fc", 3, 32, 32, 1e-4);
}

TEST_CASE("cuts: names, defaults and errors") {
  auto model = make_resnet(cpu_allocator(), DType::kF32, 18, 2, 1);
  REQUIRE(model.ok());
  CHECK(default_layer("resnet50") == "layer3");
  CHECK(default_layer("resnet18") == "avgpool");
  auto bad = find_cut(**model, "layer9");
  CHECK(bad.status().code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(bad.status().message().find("layer4") != std::string::npos);
  auto ex = FeatureExtractor::create(**model, "layer4");
  REQUIRE(ex.ok());
  std::vector<float> x(3 * 8 * 8), f(512);
  // 8 px is too small for layer4 of a ResNet (the spatial extent would vanish) -> not a crash.
  auto s = (*ex)->extract(x.data(), 1, 8, 8, f.data());
  if (!s.ok()) CHECK(s.code() == slide::core::StatusCode::kInvalidArgument);
}
