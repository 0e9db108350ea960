// Attention MIL: the ops it added to the backend (tanh, sigmoid, row softmax, matmul) against
// central differences in double on the reference backend and cpu against reference; the ABMIL
// model as a whole against central differences; a bag dataset, training and attention outputs on
// bags written with the cache writer from real LC25000 patches (colour statistics per tile: real
// pixels, no backbone needed here; the e2e test runs the whole pipeline).
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "slide/cache/bag.h"
#include "slide/core/file.h"
#include "slide/tile/figure.h"
#include "slide/tile/image.h"
#include "slide/train/backend.h"
#include "slide/train/heatmap.h"
#include "slide/train/mil.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_mil {

using slide::core::StatusCode;
using namespace slide::train;
namespace fs = std::filesystem;

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

double dot(const Tensor& a, const Tensor& b) { return testing::dot_f64(a, b); }

using testing::check_gradient;
using testing::compare;
using testing::gradient_error;
using testing::Pair;
Pair pair(const Shape& s, uint64_t seed, double lo = -1, double hi = 1) { return testing::make_pair(s, seed, lo, hi); }

Backend& cpu() {
  static std::unique_ptr<Backend> b = testing::must_make("cpu");
  return *b;
}

#define BOTH(call_d, call_f)                        \
  do {                                             \
    Status sd = ref().call_d;                      \
    Status sf = cpu().call_f;                      \
    REQUIRE_MESSAGE(sd.ok(), sd.to_string());      \
    REQUIRE_MESSAGE(sf.ok(), sf.to_string());      \
  } while (0)

}  // namespace

TEST_CASE("reference tanh, sigmoid: hand values, gradients from the output") {
  Tensor x = make({1, 3}), y = make({1, 3});
  x.data<double>()[0] = 0, x.data<double>()[1] = 1, x.data<double>()[2] = -2;
  REQUIRE(ref().tanh_forward(x, y).ok());
  CHECK(y.data<double>()[1] == doctest::Approx(0.7615941559557649));
  REQUIRE(ref().sigmoid_forward(x, y).ok());
  CHECK(y.data<double>()[0] == doctest::Approx(0.5));
  CHECK(y.data<double>()[2] == doctest::Approx(0.11920292202211755));

  for (bool sigmoid : {false, true}) {
    CAPTURE(sigmoid);
    Tensor xx = random({4, 7}, 1, -3, 3), yy = make({4, 7}), r = random({4, 7}, 2), dx = make({4, 7});
    auto fwd = [&] { REQUIRE((sigmoid ? ref().sigmoid_forward(xx, yy) : ref().tanh_forward(xx, yy)).ok()); };
    auto loss = [&] {
      fwd();
      return dot(yy, r);
    };
    fwd();
    REQUIRE((sigmoid ? ref().sigmoid_backward(yy, r, dx) : ref().tanh_backward(yy, r, dx)).ok());
    check_gradient(sigmoid ? "sigmoid dx" : "tanh dx", xx, dx, loss);
  }
}

TEST_CASE("reference row softmax: rows sum to one, large scores do not overflow, gradient") {
  Tensor x = make({2, 3}), y = make({2, 3});
  for (int i = 0; i < 3; ++i) x.data<double>()[i] = 1000.0 + i, x.data<double>()[3 + i] = -i;
  REQUIRE(ref().softmax_forward(x, y).ok());
  for (int r = 0; r < 2; ++r) {
    double s = 0;
    for (int c = 0; c < 3; ++c) s += y.data<double>()[r * 3 + c];
    CHECK(s == doctest::Approx(1.0));
  }
  CHECK(y.data<double>()[2] == doctest::Approx(1.0 / (1.0 + std::exp(-1.0) + std::exp(-2.0))));

  Tensor xx = random({3, 9}, 3, -2, 2), yy = make({3, 9}), r = random({3, 9}, 4), dx = make({3, 9});
  auto loss = [&] {
    REQUIRE(ref().softmax_forward(xx, yy).ok());
    return dot(yy, r);
  };
  loss();
  REQUIRE(ref().softmax_backward(yy, r, dx).ok());
  check_gradient("softmax dx", xx, dx, loss);
  Tensor bad = make({3, 8});
  Status s = ref().softmax_forward(xx, bad);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("softmax_forward") != std::string::npos);
}

TEST_CASE("reference matmul: hand example, every transpose combination, gradients, errors") {
  Tensor a = make({2, 3}), b = make({3, 2}), y = make({2, 2});
  for (int i = 0; i < 6; ++i) a.data<double>()[i] = i + 1, b.data<double>()[i] = i + 1;
  REQUIRE(ref().matmul(a, false, b, false, y).ok());
  // [[1,2,3],[4,5,6]] x [[1,2],[3,4],[5,6]] = [[22,28],[49,64]]
  CHECK(y.data<double>()[0] == 22);
  CHECK(y.data<double>()[1] == 28);
  CHECK(y.data<double>()[2] == 49);
  CHECK(y.data<double>()[3] == 64);

  const int64_t M = 3, K = 5, N = 4;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      CAPTURE(ta);
      CAPTURE(tb);
      Tensor aa = random(ta ? Shape{K, M} : Shape{M, K}, 5), bb = random(tb ? Shape{N, K} : Shape{K, N}, 6);
      Tensor yy = make({M, N}), r = random({M, N}, 7);
      auto loss = [&] {
        REQUIRE(ref().matmul(aa, ta, bb, tb, yy).ok());
        return dot(yy, r);
      };
      // dL/d op(a) = r op(b)^T, dL/d op(b) = op(a)^T r; transposed back for a transposed operand.
      Tensor da = make(aa.shape()), db = make(bb.shape());
      if (ta) REQUIRE(ref().matmul(bb, tb, r, true, da).ok());   // (r op(b)^T)^T = op(b) r^T
      else REQUIRE(ref().matmul(r, false, bb, !tb, da).ok());
      if (tb) REQUIRE(ref().matmul(r, true, aa, ta, db).ok());   // (op(a)^T r)^T = r^T op(a)
      else REQUIRE(ref().matmul(aa, !ta, r, false, db).ok());
      check_gradient("matmul da", aa, da, loss);
      check_gradient("matmul db", bb, db, loss);
    }
  Tensor bad = make({2, 2});
  Status s = ref().matmul(a, false, a, false, bad);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("do not chain") != std::string::npos);
  CHECK(ref().matmul(a, false, b, false, a).code() == StatusCode::kInvalidArgument);  // y must be [2, 2]
}

TEST_CASE("cpu vs reference: tanh, sigmoid, row softmax, matmul (all transposes)") {
  Pair x = pair({5, 37}, 11, -4, 4), y = pair({5, 37}, 12), dy = pair({5, 37}, 13), dx = pair({5, 37}, 14);
  BOTH(tanh_forward(x.d, y.d), tanh_forward(x.f, y.f));
  compare("tanh y", y, 1e-6);
  BOTH(tanh_backward(y.d, dy.d, dx.d), tanh_backward(y.f, dy.f, dx.f));
  compare("tanh dx", dx, 1e-6);
  BOTH(sigmoid_forward(x.d, y.d), sigmoid_forward(x.f, y.f));
  compare("sigmoid y", y, 1e-6);
  BOTH(sigmoid_backward(y.d, dy.d, dx.d), sigmoid_backward(y.f, dy.f, dx.f));
  compare("sigmoid dx", dx, 1e-6);
  // In place, as ABMIL runs them.
  Pair xi = pair({5, 37}, 11, -4, 4);
  BOTH(tanh_forward(xi.d, xi.d), tanh_forward(xi.f, xi.f));
  compare("tanh in place", xi, 1e-6);

  for (Shape s : {Shape{1, 1}, Shape{1, 257}, Shape{4, 33}}) {
    CAPTURE(shape_string(s));
    Pair sx = pair(s, 15, -6, 6), sy = pair(s, 16), sdy = pair(s, 17), sdx = pair(s, 18);
    BOTH(softmax_forward(sx.d, sy.d), softmax_forward(sx.f, sy.f));
    compare("softmax y", sy, 1e-6);
    BOTH(softmax_backward(sy.d, sdy.d, sdx.d), softmax_backward(sy.f, sdy.f, sdx.f));
    compare("softmax dx", sdx, 1e-6);
  }

  const int64_t M = 7, K = 300, N = 9;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      CAPTURE(ta);
      CAPTURE(tb);
      Pair a = pair(ta ? Shape{K, M} : Shape{M, K}, 19), b = pair(tb ? Shape{N, K} : Shape{K, N}, 20), my = pair({M, N}, 21);
      BOTH(matmul(a.d, ta, b.d, tb, my.d), matmul(a.f, ta, b.f, tb, my.f));
      compare("matmul y", my, 1e-5);
    }
  // The pooling shapes: [1, N] x [N, L].
  Pair a = pair({1, 1000}, 22, 0, 0.002), h = pair({1000, 64}, 23), z = pair({1, 64}, 24);
  BOTH(matmul(a.d, false, h.d, false, z.d), matmul(a.f, false, h.f, false, z.f));
  compare("pooling z", z, 1e-5);
  Tensor x64 = make({2, 3}), y64 = make({2, 3});
  CHECK(cpu().softmax_forward(x64, y64).code() == StatusCode::kUnimplemented);  // f64 on cpu
}

TEST_CASE("ABMIL: every parameter's gradient and the input's against central differences (f64)") {
  AbmilConfig c;
  c.in_features = 6, c.hidden = 5, c.attention = 4, c.classes = 3, c.input_gradient = true;
  auto model = Abmil::make(cpu_allocator(), DType::kF64, c, 42);
  REQUIRE(model.ok());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*model)->collect("", &params, &buffers);
  std::vector<std::string> names;
  for (auto* p : params) names.push_back(p->name);
  CHECK(names == std::vector<std::string>{"attention_net.0.weight", "attention_net.0.bias",
                                          "attention_net.3.attention_a.0.weight", "attention_net.3.attention_a.0.bias",
                                          "attention_net.3.attention_b.0.weight", "attention_net.3.attention_b.0.bias",
                                          "attention_net.3.attention_c.weight", "attention_net.3.attention_c.bias",
                                          "classifiers.weight", "classifiers.bias"});
  Tensor x = random({7, 6}, 31), r = random({1, 3}, 32);
  auto loss = [&] {
    auto y = (*model)->forward(ref(), x, false);
    REQUIRE(y.ok());
    return dot(*y, r);
  };
  for (auto* p : params) p->grad.fill_zero();
  auto y = (*model)->forward(ref(), x, true);
  REQUIRE(y.ok());
  // The attention weights are a distribution over the bag's 7 tiles.
  double sum = 0;
  for (int64_t i = 0; i < 7; ++i) sum += (*model)->attention().data<double>()[i];
  CHECK(sum == doctest::Approx(1.0));
  auto dx = (*model)->backward(ref(), r);
  REQUIRE(dx.ok());
  check_gradient("ABMIL dx", x, *dx, loss);
  for (auto* p : params) check_gradient(p->name, p->value, p->grad, loss);

  // A broken gradient is caught: the check can fail (a wrong sign in one parameter's gradient).
  params[2]->grad.data<double>()[0] = -params[2]->grad.data<double>()[0] + 0.1;
  CHECK(gradient_error(params[2]->value, params[2]->grad, loss) > 1e-3);

  // A bag of one tile: attention 1, the slide embedding is that tile's h.
  Tensor one = random({1, 6}, 33);
  auto y1 = (*model)->forward(ref(), one, false);
  REQUIRE(y1.ok());
  CHECK((*model)->attention().data<double>()[0] == doctest::Approx(1.0));
  // Wrong feature width.
  CHECK((*model)->forward(ref(), random({3, 5}, 34), false).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("ABMIL on cpu (f32) equals the reference (f64) forward and parameter gradients") {
  AbmilConfig c;
  c.in_features = 24, c.hidden = 16, c.attention = 8, c.classes = 2;
  auto md = Abmil::make(cpu_allocator(), DType::kF64, c, 7);
  auto mf = Abmil::make(cpu_allocator(), DType::kF32, c, 7);
  REQUIRE(md.ok());
  REQUIRE(mf.ok());
  std::vector<Parameter*> pd, pf;
  std::vector<Buffer*> bd, bf;
  (*md)->collect("", &pd, &bd);
  (*mf)->collect("", &pf, &bf);
  for (size_t i = 0; i < pd.size(); ++i) {  // same initial values in both precisions
    for (int64_t j = 0; j < pd[i]->value.numel(); ++j) pd[i]->value.data<double>()[j] = pf[i]->value.data<float>()[j];
    pd[i]->grad.fill_zero(), pf[i]->grad.fill_zero();
  }
  Pair x = pair({50, 24}, 41, -1, 1), dy = pair({1, 2}, 42);
  auto yd = (*md)->forward(ref(), x.d, true);
  auto yf = (*mf)->forward(cpu(), x.f, true);
  REQUIRE(yd.ok());
  REQUIRE(yf.ok());
  compare("ABMIL logits", Pair{*yd, *yf}, 1e-5);
  compare("ABMIL attention", Pair{(*md)->attention(), (*mf)->attention()}, 1e-6);
  REQUIRE((*md)->backward(ref(), dy.d).ok());
  REQUIRE((*mf)->backward(cpu(), dy.f).ok());
  for (size_t i = 0; i < pd.size(); ++i) compare(pd[i]->name + " grad", Pair{pd[i]->grad, pf[i]->grad}, 1e-5);
}

TEST_CASE("ABMIL dropout: training masks are a function of the seed; inference is unaffected") {
  AbmilConfig c;
  c.in_features = 6, c.hidden = 32, c.attention = 4, c.classes = 2, c.dropout = 0.5;
  auto model = Abmil::make(cpu_allocator(), DType::kF64, c, 5);
  REQUIRE(model.ok());
  Tensor x = random({9, 6}, 51);
  auto logits = [&](bool training, uint64_t seed) {
    (*model)->set_rng_seed(seed);
    auto y = (*model)->forward(ref(), x, training);
    REQUIRE(y.ok());
    return std::vector<double>(y->data<double>(), y->data<double>() + 2);
  };
  CHECK(logits(true, 1) == logits(true, 1));
  CHECK(logits(true, 1) != logits(true, 2));
  CHECK(logits(false, 1) == logits(false, 2));
  CHECK(logits(false, 1) != logits(true, 1));
  // The gradient with a fixed mask against central differences (the same mask in every evaluation).
  c.dropout = 0.5, c.input_gradient = true;
  auto m2 = Abmil::make(cpu_allocator(), DType::kF64, c, 5);
  REQUIRE(m2.ok());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*m2)->collect("", &params, &buffers);
  for (auto* p : params) p->grad.fill_zero();
  Tensor r = random({1, 2}, 52);
  auto loss = [&] {
    (*m2)->set_rng_seed(3);
    auto y = (*m2)->forward(ref(), x, true);
    REQUIRE(y.ok());
    return dot(*y, r);
  };
  loss();
  auto dx = (*m2)->backward(ref(), r);
  REQUIRE(dx.ok());
  check_gradient("ABMIL with dropout dx", x, *dx, loss);
  for (auto* p : params) check_gradient(p->name + " (dropout)", p->value, p->grad, loss);
  AbmilConfig bad = c;
  bad.dropout = 1.0;
  CHECK(Abmil::make(cpu_allocator(), DType::kF64, bad, 5).status().code() == StatusCode::kInvalidArgument);
}

namespace {

// A bag written with the cache writer: n tiles of `dim` features (tile t's features are
// label * 0.5 + t * 0.01 in every column), a coords grid of 4 columns.
// `model`: its encoder's attributes (model, layer "layer3", weights_sha256 from the name), or none.
void write_test_bag(const std::string& dir, const std::string& id, const std::string& label, int64_t n, int64_t dim,
                    const std::string& model = "") {
  slide::cache::BagAttributes attrs;
  if (!model.empty()) attrs.model = model, attrs.layer = "layer3", attrs.weights_sha256 = model + "0123456789abcdef";
  attrs.slide_id = id;
  attrs.label = label;
  attrs.tile_size_px = 224;
  attrs.tile_size_l0_px = 448;
  auto w = slide::cache::BagWriter::create(dir + "/" + slide::cache::bag_file_name(id), dim, attrs);
  REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  std::vector<float> f(static_cast<size_t>(n * dim));
  std::vector<int64_t> c(static_cast<size_t>(2 * n));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t d = 0; d < dim; ++d) f[static_cast<size_t>(t * dim + d)] = (label == "b" ? 0.5f : 0.f) + 0.01f * t;
    c[static_cast<size_t>(2 * t)] = (t % 4) * 448, c[static_cast<size_t>(2 * t + 1)] = (t / 4) * 448;
  }
  REQUIRE((*w)->append(n, f, c).ok());
  REQUIRE((*w)->commit().ok());
}

// A directory of bags for one test (test_util.h's ScratchDir).
struct TempDir : testing::ScratchDir {
  TempDir() : ScratchDir("mil_test") {}
};

}  // namespace

TEST_CASE("BagDataset: labels from bags or a CSV, split by patient, RAM equals streamed, clear errors") {
  TempDir dir;
  for (int i = 0; i < 6; ++i) write_test_bag(dir.path(), "s" + std::to_string(i), i % 2 ? "b" : "a", 3 + i, 5);
  auto ds = BagDataset::open({dir.path()});
  REQUIRE_MESSAGE(ds.ok(), ds.status().to_string());
  CHECK((*ds)->class_names() == std::vector<std::string>{"a", "b"});
  CHECK((*ds)->bags().size() == 6);
  CHECK((*ds)->feature_dim() == 5);
  CHECK((*ds)->max_tiles() == 8);
  CHECK((*ds)->feature_bytes() == size_t{(3 + 4 + 5 + 6 + 7 + 8) * 5 * 4});
  auto streamed = (*ds)->load(5, cpu_allocator());
  REQUIRE(streamed.ok());
  CHECK(streamed->shape() == Shape{8, 5});
  CHECK(streamed->data<float>()[5 * 7] == doctest::Approx(0.5f + 0.07f));
  REQUIRE((*ds)->cache_in_ram(cpu_allocator()).ok());
  auto cached = (*ds)->load(5, cpu_allocator());
  REQUIRE(cached.ok());
  CHECK(std::equal(cached->data<float>(), cached->data<float>() + 40, streamed->data<float>()));
  auto coords = (*ds)->coords(5);
  REQUIRE(coords.ok());
  CHECK((*coords)[2 * 5] == 448);  // tile 5: column 1, row 1
  CHECK((*coords)[2 * 5 + 1] == 448);

  // A CSV with patients: s0+s1, s2+s3, s4+s5 are one patient each and never split.
  const std::string csv = dir.path() + "/labels.csv";
  REQUIRE(slide::core::write_file_atomic(csv, "slide_id,label,patient\ns0,x,p0\ns1,y,p0\ns2,x,p1\ns3,y,p1\ns4,x,p2\ns5,y,p2\n").ok());
  auto by_patient = BagDataset::open({dir.path()}, csv);
  REQUIRE(by_patient.ok());
  CHECK((*by_patient)->class_names() == std::vector<std::string>{"x", "y"});
  for (uint64_t seed = 0; seed < 5; ++seed) {
    std::vector<size_t> train, val;
    (*by_patient)->split(0.34, seed, &train, &val);
    CHECK(val.size() == 2);
    CHECK((*by_patient)->bags()[val[0]].group == (*by_patient)->bags()[val[1]].group);
  }

  // A slide the CSV lacks is named.
  REQUIRE(slide::core::write_file_atomic(csv, "slide_id,label\ns0,x\ns1,y\n").ok());
  auto missing = BagDataset::open({dir.path()}, csv);
  CHECK(missing.status().code() == StatusCode::kInvalidArgument);
  CHECK(missing.status().message().find("no row for slide 's2'") != std::string::npos);
  // A bag of another feature width is named.
  TempDir mixed;
  write_test_bag(mixed.path(), "w5", "a", 3, 5);
  write_test_bag(mixed.path(), "w7", "b", 3, 7);
  auto wrong_dim = BagDataset::open({mixed.path()});
  CHECK(wrong_dim.status().code() == StatusCode::kInvalidArgument);
  CHECK(wrong_dim.status().message().find("w7.h5 has 7 features per tile") != std::string::npos);
  // One class only: refused for training, fine against a model's class list.
  TempDir one;
  write_test_bag(one.path(), "o1", "b", 2, 5);
  CHECK(BagDataset::open({one.path()}).status().message().find("fewer than two classes") != std::string::npos);
  auto against = BagDataset::open({one.path()}, "", {"a", "b"});
  REQUIRE(against.ok());
  CHECK((*against)->bags()[0].label == 1);
  CHECK(BagDataset::open({one.path()}, "", {"a", "c"}).status().message().find("not one of the model's") !=
        std::string::npos);
  CHECK(BagDataset::open({dir.path() + "/nope"}).status().code() == StatusCode::kNotFound);
}

TEST_CASE("BagDataset: bags of two encoders are refused, naming both; bags that do not say are taken") {
  TempDir a, b, plain;
  for (int i = 0; i < 2; ++i) write_test_bag(a.path(), "a" + std::to_string(i), i ? "b" : "a", 3, 4, "resnet50");
  write_test_bag(b.path(), "u0", "a", 3, 4, "uni");
  write_test_bag(plain.path(), "p0", "b", 3, 4);
  auto one = BagDataset::open({a.path()});
  REQUIRE_MESSAGE(one.ok(), one.status().to_string());
  CHECK((*one)->encoder() == BagEncoder{"resnet50", "layer3", "resnet500123456789abcdef"});
  CHECK((*one)->encoder().describe() == "resnet50 layer3, weights sha256 resnet500123...");
  // Across directories, with and without a manifest (whose first bag speaks for it).
  for (bool manifest : {false, true}) {
    CAPTURE(manifest);
    if (manifest) {
      auto listed = slide::cache::list_bags(b.path());
      REQUIRE(listed.ok());
      REQUIRE(slide::cache::write_manifest(b.path(), *listed).ok());
    }
    auto two = BagDataset::open({a.path(), b.path()});
    CHECK(two.status().code() == StatusCode::kInvalidArgument);
    CHECK(two.status().message().find("u0.h5 holds features of uni layer3, weights sha256 uni012345678...") !=
          std::string::npos);
    CHECK(two.status().message().find("a0.h5 of resnet50 layer3") != std::string::npos);
  }
  // Within one directory too.
  write_test_bag(a.path(), "u1", "a", 3, 4, "uni");
  CHECK(BagDataset::open({a.path()}).status().code() == StatusCode::kInvalidArgument);
  fs::remove(a.path() + "/" + slide::cache::bag_file_name("u1"));
  // A bag without encoder attributes (another tool's) cannot be told apart: taken.
  auto with_plain = BagDataset::open({a.path(), plain.path()});
  REQUIRE_MESSAGE(with_plain.ok(), with_plain.status().to_string());
  CHECK((*with_plain)->encoder().model == "resnet50");
  auto only_plain = BagDataset::open({plain.path()}, "", {"a", "b"});
  REQUIRE(only_plain.ok());
  CHECK_FALSE((*only_plain)->encoder().known());
}

TEST_CASE("MIL training stops at a non-finite loss before any update (issue 20)") {
  TempDir dir;
  for (int i = 0; i < 4; ++i) write_test_bag(dir.path(), "s" + std::to_string(i), i % 2 ? "b" : "a", 3, 6);
  auto ds = BagDataset::open({dir.path()});
  REQUIRE(ds.ok());
  AbmilConfig c;
  c.in_features = 6, c.hidden = 8, c.attention = 4, c.classes = 2;
  auto model = Abmil::make(cpu_allocator(), DType::kF32, c, 1);
  REQUIRE(model.ok());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*model)->collect("", &params, &buffers);
  // A NaN weight of the classifier (as a damaged checkpoint would hold, were loading not checked).
  Parameter* classifier = params.back();
  classifier->value.data<float>()[0] = std::nanf("");
  std::vector<std::vector<float>> before;
  for (auto* p : params) before.emplace_back(p->value.data<float>(), p->value.data<float>() + p->value.numel());
  OptimizerConfig oc;
  oc.name = "adamw";
  auto opt = Optimizer::make(oc, params, cpu_allocator());
  REQUIRE(opt.ok());
  Schedule sched;
  sched.kind = "constant", sched.base_lr = 0.01;
  MilTrainOptions to;
  to.batch_size = 2;
  auto st = train_mil_epoch(cpu(), **model, **opt, sched, **ds, {0, 1, 2, 3}, to, 7);
  REQUIRE(!st.ok());
  CHECK(st.status().code() == StatusCode::kOutOfRange);
  CHECK(st.status().message().find("step 0 of the epoch (optimizer step 1)") != std::string::npos);
  CHECK(st.status().message().find("the loss is nan") != std::string::npos);
  CHECK((*opt)->steps() == 0);
  for (size_t i = 0; i < params.size(); ++i) {
    const float* v = params[i]->value.data<float>();
    for (size_t j = 0; j < before[i].size(); ++j)
      if (!(std::isnan(before[i][j]) && std::isnan(v[j]))) REQUIRE(v[j] == before[i][j]);
  }
}

TEST_CASE("MIL training on bags: the loss falls, streamed (with prefetch) equals RAM, attention outputs") {
  TempDir dir;
  for (int i = 0; i < 8; ++i) write_test_bag(dir.path(), "s" + std::to_string(i), i % 2 ? "b" : "a", 4 + i % 3, 6);
  auto train = [&](bool ram, int prefetch, std::vector<float>* weights) {
    auto ds = BagDataset::open({dir.path()});
    REQUIRE(ds.ok());
    if (ram) REQUIRE((*ds)->cache_in_ram(cpu_allocator()).ok());
    AbmilConfig c;
    c.in_features = 6, c.hidden = 8, c.attention = 4, c.classes = 2;
    auto model = Abmil::make(cpu_allocator(), DType::kF32, c, 1);
    REQUIRE(model.ok());
    std::vector<Parameter*> params;
    std::vector<Buffer*> buffers;
    (*model)->collect("", &params, &buffers);
    OptimizerConfig oc;
    oc.name = "adamw";
    auto opt = Optimizer::make(oc, params, cpu_allocator());
    REQUIRE(opt.ok());
    Schedule sched;
    sched.kind = "constant", sched.base_lr = 0.01;
    std::vector<size_t> all(8);
    std::iota(all.begin(), all.end(), size_t{0});
    MilTrainOptions to;
    to.batch_size = 3, to.prefetch = prefetch;
    std::vector<double> losses;
    for (int e = 0; e < 15; ++e) {
      auto st = train_mil_epoch(cpu(), **model, **opt, sched, **ds, all, to, 100 + static_cast<uint64_t>(e));
      REQUIRE_MESSAGE(st.ok(), st.status().to_string());
      CHECK(st->steps == 3);  // 8 bags in steps of 3: the last partial step is used
      CHECK(st->samples == 8);
      losses.push_back(st->loss);
    }
    CHECK(losses.back() < 0.5 * losses.front());
    for (auto* p : params) weights->insert(weights->end(), p->value.data<float>(), p->value.data<float>() + p->value.numel());
    std::vector<float> probs;
    std::vector<std::vector<float>> attention;  // what on_bag is given, bag by bag, in order
    std::vector<float> probs_seen;
    auto ev = evaluate_mil(cpu(), **model, **ds, all, prefetch, &probs,
                           [&](size_t i, const float* p, const std::vector<float>& a) {
                             CHECK(i == attention.size());
                             attention.push_back(a);
                             probs_seen.insert(probs_seen.end(), p, p + 2);
                             return slide::core::ok_status();
                           });
    REQUIRE(ev.ok());
    CHECK(ev->accuracy == 1.0);
    CHECK(ev->roc_auc == 1.0);
    CHECK(probs_seen == probs);
    REQUIRE(attention.size() == 8);
    CHECK(attention[2].size() == 4 + 2 % 3);
    for (const auto& a : attention) CHECK(std::accumulate(a.begin(), a.end(), 0.0) == doctest::Approx(1.0));
    // An error from on_bag ends the evaluation and is returned.
    size_t calls = 0;
    auto stopped = evaluate_mil(cpu(), **model, **ds, all, prefetch, nullptr,
                                [&](size_t i, const float*, const std::vector<float>&) {
                                  ++calls;
                                  return i == 3 ? slide::core::data_loss("disk full") : slide::core::ok_status();
                                });
    CHECK(stopped.status().code() == StatusCode::kDataLoss);
    CHECK(calls == 4);
  };
  std::vector<float> a, b, c;
  train(true, 0, &a);
  train(false, 2, &b);
  train(false, 0, &c);
  CHECK(a == b);
  CHECK(a == c);

  // The attention file and heatmap.
  std::vector<float> att = {0.1f, 0.2f, 0.3f, 0.4f, 0.0f};
  std::vector<int32_t> xy = {0, 0, 448, 0, 896, 0, 1344, 0, 0, 448};
  REQUIRE(write_attention_h5(dir.path() + "/att.h5", "s", "a", "b", {0.25, 0.75}, att, xy).ok());
  CHECK(fs::exists(dir.path() + "/att.h5"));
  CHECK(!fs::exists(dir.path() + "/att.h5.partial"));
  CHECK(write_attention_h5(dir.path() + "/bad.h5", "s", "a", "b", {0.5, 0.5}, att, {0, 0}).code() ==
        StatusCode::kInvalidArgument);
  REQUIRE(write_attention_heatmap(dir.path() + "/h.png", att, xy, 0).ok());
  auto bytes = slide::core::read_file(dir.path() + "/h.png");
  REQUIRE(bytes.ok());
  auto img = slide::tile::decode_png(std::vector<uint8_t>(bytes->begin(), bytes->end()));
  REQUIRE(img.ok());
  CHECK(img->width == 4 * 8 + 110);  // the map, then the colour bar's panel
  CHECK(img->height == 28 + 200);    // the title band, then the map (padded to the bar's height)
  const uint8_t* hot = img->row(28 + 4) + 3 * (3 * 8 + 4);   // the most attended tile: dark red
  const uint8_t* cold = img->row(28 + 12) + 3 * 4;           // the least: dark blue
  const uint8_t* none = img->row(28 + 12) + 3 * (3 * 8 + 4);  // no tile there: white
  CHECK(hot[0] > 100);
  CHECK(hot[2] < 50);
  CHECK(cold[2] > 100);
  CHECK(cold[0] < 50);
  CHECK((none[0] == 255 && none[1] == 255 && none[2] == 255));
}

namespace {

// One row of tiles at x = llround(c x step), valued 0, 1, 0, ... drawn with draw_tile_grid at
// one px a cell: each tile must get its own cell, in order (jet's blue, red, blue, ...).
void check_one_cell_per_tile(int cols, double step, int64_t tile_l0_px) {
  std::vector<int32_t> coords;
  std::vector<double> values;
  for (int c = 0; c < cols; ++c) {
    coords.push_back(static_cast<int32_t>(std::llround(c * step)));
    coords.push_back(0);
    values.push_back(c % 2 == 0 ? 0.0 : 1.0);
  }
  auto img = draw_tile_grid(values, coords, tile_l0_px, "grid", 1);
  REQUIRE_MESSAGE(img.ok(), img.status().to_string());
  REQUIRE(img->width == cols);
  REQUIRE(img->height == 1);
  uint8_t low[3], high[3];
  slide::tile::jet_colour(0.0, low);
  slide::tile::jet_colour(1.0, high);
  for (int c = 0; c < cols; ++c) {
    CAPTURE(c);
    const uint8_t* want = c % 2 == 0 ? low : high;
    const uint8_t* p = img->row(0) + 3 * c;
    CHECK((p[0] == want[0] && p[1] == want[1] && p[2] == want[2]));
  }
}

}  // namespace

TEST_CASE("draw_tile_grid: tiles at a fractional level-0 step each get their own cell") {
  // 0.2525 um/px tiled at 0.5 um/px with 256 px tiles: a step of 506.93 level-0 px, tile side
  // rounded to 507, tiles at llround(col x 506.93). Column 8 (x = 4055) is 7.998 sides from column
  // 0: its own cell, not column 7's.
  check_one_cell_per_tile(12, 506.93, 507);
}

TEST_CASE("draw_tile_grid: overlapping tiles (stride half the side) each get their own cell") {
  // slide-tile --stride 250 with 500 px tiles: tiles half a side apart. In tile sides they would
  // round into shared cells (0.5 -> 1, 1.0 -> 1) and the later tile would hide the earlier.
  check_one_cell_per_tile(9, 250, 500);
}

TEST_CASE("draw_tile_grid: cells shrink to keep the figure within 4096 px; a grid over 2^24 cells is refused") {
  // Two 256 px tiles 1000 and 5000 tiles apart along x: 8 px cells would make 8008 and 40008 px
  // wide images; the cells shrink to 4 px and to 1 px (the grid is wider than 4096 cells).
  // (Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.)
  for (const std::pair<int32_t, int64_t>& c : {std::pair<int32_t, int64_t>{1000, 4}, {5000, 1}}) {
    const int32_t span = c.first;
    const int64_t want_cell = c.second;
    CAPTURE(span);
    const std::vector<int32_t> coords = {0, 0, span * 256, 0};
    auto img = draw_tile_grid({0.0, 1.0}, coords, 256, "grid");
    REQUIRE_MESSAGE(img.ok(), img.status().to_string());
    CHECK(img->width == (span + 1) * want_cell);
    CHECK(img->height == want_cell);
  }
  // 5000 x 5000 cells (2.5e7 > 2^24): kInvalidArgument naming the grid (slide-train's MIL and
  // predict then leave that slide without a heatmap, and go on).
  auto refused = draw_tile_grid({0.0, 1.0}, {0, 0, 4999 * 256, 4999 * 256}, 256, "huge");
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(refused.status().message() == "huge: a tile grid of 5000 x 5000 cells is too large for a heatmap");
}

TEST_CASE("draw_tile_overlay: where tiles overlap, the colour of their mean value, blended once") {
  // A grey 40 x 10 thumbnail at 1 level-0 px per pixel; two 20 px tiles at x = 0 and x = 10
  // (stride half the side): values 0 and 1. Pixels 0..9 under the first only, 10..19 under both,
  // 20..29 under the second only, 30..39 under none.
  HeatmapCanvas canvas;
  canvas.thumbnail = slide::tile::RgbImage(40, 10, 128);
  const std::vector<int32_t> coords = {0, 0, 10, 0};
  auto img = draw_tile_overlay({0.0, 1.0}, coords, 20, canvas, "overlay");
  REQUIRE_MESSAGE(img.ok(), img.status().to_string());
  auto blended = [](double v, int c) {
    uint8_t rgb[3];
    slide::tile::jet_colour(v, rgb);
    return (128 + rgb[c] + 1) / 2;
  };
  for (int x : {0, 9, 10, 19, 20, 29, 30, 39}) {
    CAPTURE(x);
    const uint8_t* p = img->row(5) + 3 * x;
    const double v = x < 10 ? 0.0 : x < 20 ? 0.5 : 1.0;
    for (int c = 0; c < 3; ++c) CHECK(p[c] == (x < 30 ? blended(v, c) : 128));
  }
}

TEST_CASE("heatmap_canvas refuses a slide file whose level-0 size is not the tiles' slide's") {
  const std::string svs = std::string(SLIDE_SAMPLE_DIR) + "/slides/CMU-1-Small-Region.svs";  // 2220 x 2967
  auto same = heatmap_canvas(svs, 96, 256, 2220, 2967);
  REQUIRE_MESSAGE(same.ok(), same.status().to_string());
  CHECK(std::max(same->thumbnail.width, same->thumbnail.height) >= 256);
  CHECK(heatmap_canvas(svs, 96, 256).ok());  // no record: not checked
  auto other = heatmap_canvas(svs, 96, 256, 2220, 2968);
  CHECK(other.status().code() == StatusCode::kFailedPrecondition);
  CHECK(other.status().message().find("level 0 is 2220 x 2967 px, the tiles were cut from a slide of 2220 x 2968 px") !=
        std::string::npos);
}

TEST_CASE("MIL with class weights and label smoothing: a step's gradient is PyTorch's over its bags") {
  // PyTorch's CrossEntropyLoss(weight=w, label_smoothing=s) over the step's bags as one batch:
  // d loss / d logit_bj = ((sum_c t_bc) p_bj - t_bj) / W, t_bc = (1 - s) w[y_b] [c == y_b] + (s / C) w[c],
  // W = sum_b w[y_b]. The classifier's bias gradient is its sum over the bags.
  TempDir dir;
  for (int i = 0; i < 3; ++i) write_test_bag(dir.path(), "s" + std::to_string(i), i == 1 ? "b" : "a", 4, 6);
  auto ds = BagDataset::open({dir.path()});
  REQUIRE(ds.ok());
  AbmilConfig c;
  c.in_features = 6, c.hidden = 8, c.attention = 4, c.classes = 2;
  auto model = Abmil::make(cpu_allocator(), DType::kF32, c, 3);
  REQUIRE(model.ok());
  const std::vector<size_t> all = {0, 1, 2};
  std::vector<float> probs;
  REQUIRE(evaluate_mil(cpu(), **model, **ds, all, 0, &probs, nullptr).ok());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*model)->collect("", &params, &buffers);
  OptimizerConfig oc;
  oc.name = "sgd", oc.momentum = 0, oc.weight_decay = 0;
  auto opt = Optimizer::make(oc, params, cpu_allocator());
  REQUIRE(opt.ok());
  Schedule sched;
  sched.kind = "constant", sched.base_lr = 0.01;
  MilTrainOptions to;
  to.batch_size = 3, to.prefetch = 0, to.label_smoothing = 0.1;
  auto w = Tensor::empty({2}, DType::kF32, cpu_allocator(), "class weights");
  REQUIRE(w.ok());
  w->data<float>()[0] = 1.0f, w->data<float>()[1] = 5.0f;
  to.class_weights = *w;
  REQUIRE(train_mil_epoch(cpu(), **model, **opt, sched, **ds, all, to, 7).ok());
  const Parameter* bias = nullptr;
  for (const Parameter* p : params)
    if (p->name.find("classifier") != std::string::npos && p->value.numel() == 2 && p->value.shape().size() == 1) bias = p;
  REQUIRE(bias != nullptr);
  const double s = 0.1, wc[2] = {1.0, 5.0};
  double W = 0;
  for (size_t b : all) W += wc[(*ds)->bags()[b].label];
  double want[2] = {0, 0};
  for (size_t b : all) {
    const int y = (*ds)->bags()[b].label;
    const double tsum = (1 - s) * wc[y] + s / 2 * (wc[0] + wc[1]);
    for (int j = 0; j < 2; ++j) {
      const double t = (j == y ? (1 - s) * wc[y] : 0.0) + s / 2 * wc[j];
      want[j] += (tsum * probs[2 * b + static_cast<size_t>(j)] - t) / W;
    }
  }
  CHECK(bias->grad.data<float>()[0] == doctest::Approx(want[0]).epsilon(1e-4));
  CHECK(bias->grad.data<float>()[1] == doctest::Approx(want[1]).epsilon(1e-4));
}

}  // namespace libtrain_test_mil
#undef BOTH
