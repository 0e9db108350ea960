// slide-embed's inference path (FeatureExtractor: batch norm folded, ReLU and residual adds fused,
// blocked layouts) against the engine's own forward pass cut at the same layer (engine_features,
// the training code path in inference mode), on torchvision ResNets and the small CNN with
// randomised batch norm statistics, so that a wrong fold or fusion shows.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "slide/train/embed.h"
#include "../libtrain/test_fixtures.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace cache_test_embed {

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
  // Two cuts per backend, an early one and the whole network (the cuts themselves are the case
  // above's; on the reference backend's loops every image costs: 54 s under ASan with five cuts at
  // 40 x 48, 2026-11-29).
  for (const char* graph : {"reference", "reference-sim"}) {
    CAPTURE(graph);
    for (const char* layer : {"maxpool", "fc"}) check_cut(*ref, **model, layer, 2, 32, 40, 1e-4, graph);
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

namespace {

// An encoder whose device holds `capacity` images per forward pass: more is kResourceExhausted, as
// the budgeted allocator answers. Each feature row is a function of its own image only.
class CappedEncoder final : public TileEncoder {
 public:
  explicit CappedEncoder(int64_t capacity) : capacity_(capacity) {}
  int64_t feature_dim() const override { return 2; }
  const std::string& layer() const override { return layer_; }
  Status extract(const float* images, int64_t n, int64_t h, int64_t w, float* features) override {
    calls.push_back(n);
    if (n > capacity_) return slide::core::resource_exhausted("memory budget exceeded: " + std::to_string(n) + " images");
    for (int64_t i = 0; i < n; ++i) {
      const float* x = images + i * 3 * h * w;
      features[2 * i] = x[0];
      features[2 * i + 1] = x[0] + x[3 * h * w - 1];
    }
    return fail_next.ok() ? slide::core::ok_status() : std::exchange(fail_next, slide::core::ok_status());
  }
  void release_cached_memory() override { ++released; }
  std::vector<int64_t> calls;
  int released = 0;
  Status fail_next;

 private:
  int64_t capacity_;
  std::string layer_ = "test";
};

}  // namespace

TEST_CASE("extract_in_micro_batches: out of memory halves the micro-batch, rows in order, the size kept") {
  const int64_t n = 7, h = 2, w = 2, image = 3 * h * w;
  std::vector<float> x(n * image);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < image; ++j) x[i * image + j] = static_cast<float>(100 * i + j);
  std::vector<float> want(n * 2);
  for (int64_t i = 0; i < n; ++i) want[2 * i] = x[i * image], want[2 * i + 1] = x[i * image] + x[i * image + image - 1];

  CappedEncoder enc(2);
  std::vector<float> f(n * 2, -1.f);
  int64_t micro = 0, reruns = 0;  // 0: the whole batch at once
  REQUIRE(extract_in_micro_batches(enc, x.data(), n, h, w, f.data(), &micro, &reruns).ok());
  CHECK(f == want);
  CHECK(micro == 2);  // 7 -> 4 -> 2
  CHECK(reruns == 2);
  CHECK(enc.released == 2);
  CHECK(enc.calls == std::vector<int64_t>{7, 4, 2, 2, 2, 1});

  // The next batch starts at the kept size: no failed attempt.
  enc.calls.clear();
  std::fill(f.begin(), f.end(), -1.f);
  REQUIRE(extract_in_micro_batches(enc, x.data(), n, h, w, f.data(), &micro, &reruns).ok());
  CHECK(f == want);
  CHECK(enc.calls == std::vector<int64_t>{2, 2, 2, 1});
  CHECK(reruns == 2);

  // A failure part-way halves what failed, not the rows already done.
  CappedEncoder enc3(3);
  micro = 6;
  std::fill(f.begin(), f.end(), -1.f);
  REQUIRE(extract_in_micro_batches(enc3, x.data(), n, h, w, f.data(), &micro).ok());
  CHECK(f == want);
  CHECK(enc3.calls == std::vector<int64_t>{6, 3, 3, 1});
  CHECK(micro == 3);
}

TEST_CASE("extract_in_micro_batches: one image that does not fit, and other errors, are returned") {
  std::vector<float> x(4 * 3 * 2 * 2), f(4 * 2);
  CappedEncoder none(0);
  int64_t micro = 4;
  Status s = extract_in_micro_batches(none, x.data(), 4, 2, 2, f.data(), &micro);
  CHECK(s.code() == slide::core::StatusCode::kResourceExhausted);
  CHECK(s.message().find("one image per forward pass") != std::string::npos);
  CHECK(none.calls == std::vector<int64_t>{4, 2, 1});

  CappedEncoder enc(4);
  enc.fail_next = slide::core::internal_error("a kernel failed");
  micro = 4;
  s = extract_in_micro_batches(enc, x.data(), 4, 2, 2, f.data(), &micro);
  CHECK(s.code() == slide::core::StatusCode::kInternal);  // not retried
  CHECK(enc.calls == std::vector<int64_t>{4});
  CHECK(micro == 4);
  CHECK(extract_in_micro_batches(enc, x.data(), 0, 2, 2, f.data(), &micro).code() ==
        slide::core::StatusCode::kInvalidArgument);
}

}  // namespace cache_test_embed
