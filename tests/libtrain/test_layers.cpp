// Every layer (and the residual block and the small CNN as wholes): central-difference gradient
// checks in double on the reference backend, for the input and every parameter; torchvision names.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "slide/train/communicator.h"
#include "slide/train/layers.h"
#include "slide/train/model_registry.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_layers {

using slide::core::StatusCode;
using namespace slide::train;

namespace {

Backend& ref() { return testing::reference(); }
Tensor random(const Shape& s, uint64_t seed) { return testing::random_f64(s, seed); }
double dot(const Tensor& a, const Tensor& b) { return testing::dot_f64(a, b); }

// Checks dL/dx and dL/dparam for L = sum(layer(x) * r), in training mode. Batch norm's running
// statistics change on every forward; they do not enter the training-mode output.
void check_layer(Layer& layer, Tensor x, double tol = 1e-6) {
  std::vector<Parameter*> params;
  layer.collect("", &params, nullptr);
  auto y0 = layer.forward(ref(), x, true);
  REQUIRE_MESSAGE(y0.ok(), y0.status().to_string());
  Tensor r = random(y0->shape(), 99);
  for (Parameter* p : params) p->grad.fill_zero();
  auto dx = layer.backward(ref(), r);
  REQUIRE_MESSAGE(dx.ok(), dx.status().to_string());
  auto loss = [&] {
    auto y = layer.forward(ref(), x, true);
    REQUIRE(y.ok());
    return dot(*y, r);
  };
  auto check = [&](const std::string& what, Tensor& input, const Tensor& analytic) {
    double worst = 0;
    for (int64_t i = 0; i < input.numel(); ++i) {
      double& v = input.data<double>()[i];
      const double saved = v;
      v = saved + 1e-6;
      const double up = loss();
      v = saved - 1e-6;
      const double down = loss();
      v = saved;
      const double num = (up - down) / 2e-6, a = analytic.data<double>()[i];
      worst = std::max(worst, std::abs(num - a) / std::max({1.0, std::abs(num), std::abs(a)}));
    }
    CAPTURE(what);
    CHECK(worst < tol);
  };
  check("input", x, *dx);
  for (Parameter* p : params) check(p->name, p->value, p->grad);
}

}  // namespace

TEST_CASE("layers: Conv2d, BatchNorm2d, ReLU, MaxPool2d, GlobalAvgPool, Linear gradients in double") {
  InitRng rng(1);
  auto conv = Conv2d::make(cpu_allocator(), DType::kF64, 3, 4, 3, {2, 1}, true, rng);
  REQUIRE(conv.ok());
  check_layer(**conv, random({2, 3, 7, 6}, 2));
  auto bn = BatchNorm2d::make(cpu_allocator(), DType::kF64, 3);
  REQUIRE(bn.ok());
  check_layer(**bn, random({4, 3, 3, 2}, 3), 1e-5);
  ReLU relu;
  Tensor rx = random({2, 3, 4, 4}, 4);
  for (int64_t i = 0; i < rx.numel(); ++i)
    if (std::abs(rx.data<double>()[i]) < 0.05) rx.data<double>()[i] = 0.5;
  check_layer(relu, rx);
  MaxPool2d pool({3, 2, 1});
  check_layer(pool, random({2, 2, 7, 7}, 5), 1e-5);
  GlobalAvgPool gap;
  check_layer(gap, random({2, 3, 4, 5}, 6));
  auto fc = Linear::make(cpu_allocator(), DType::kF64, 6, 3, rng);
  REQUIRE(fc.ok());
  check_layer(**fc, random({4, 6}, 7));
}

TEST_CASE("layers: BasicBlock with a downsample shortcut, and the small CNN, end to end") {
  InitRng rng(2);
  auto block = BasicBlock::make(cpu_allocator(), DType::kF64, 3, 4, 2, rng);
  REQUIRE(block.ok());
  check_layer(**block, random({2, 3, 6, 6}, 8), 1e-5);
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*block)->collect("layer2.0", &params, &buffers);
  std::vector<std::string> names;
  for (auto* p : params) names.push_back(p->name);
  CHECK(names == std::vector<std::string>{"layer2.0.conv1.weight", "layer2.0.bn1.weight", "layer2.0.bn1.bias",
                                          "layer2.0.conv2.weight", "layer2.0.bn2.weight", "layer2.0.bn2.bias",
                                          "layer2.0.downsample.0.weight", "layer2.0.downsample.1.weight",
                                          "layer2.0.downsample.1.bias"});
  CHECK(buffers.size() == 6);
  CHECK(buffers[0]->name == "layer2.0.bn1.running_mean");

  auto cnn = make_small_cnn(cpu_allocator(), DType::kF64, 3, 3, 2, 7);
  REQUIRE(cnn.ok());
  check_layer(**cnn, random({3, 3, 8, 8}, 9), 1e-5);
}

namespace {

template <typename L>
std::unique_ptr<Layer> must(Result<std::unique_ptr<L>> r) {
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(*r);
}
// conv, batch norm, ReLU, max pool, conv, batch norm, ReLU, global average pool, linear, from a
// fixed seed. fused: each ReLU added right after its batch norm (Sequential::add fuses the pair);
// else each ReLU in a Sequential of its own, which add does not fuse.
std::unique_ptr<Sequential> conv_bn_relu_net(DType dtype, bool fused) {
  InitRng rng(7);
  auto net = std::make_unique<Sequential>();
  auto relu = [&] {
    if (fused) return net->add(std::make_unique<ReLU>());
    auto own = std::make_unique<Sequential>();
    own->add(std::make_unique<ReLU>());
    net->add(std::move(own));
  };
  net->add(must(Conv2d::make(cpu_allocator(), dtype, 3, 8, 3, {1, 1}, false, rng)));
  net->add(must(BatchNorm2d::make(cpu_allocator(), dtype, 8)));
  relu();
  net->add(std::make_unique<MaxPool2d>(Pool2dParams{2, 2, 0}));
  net->add(must(Conv2d::make(cpu_allocator(), dtype, 8, 8, 3, {2, 1}, false, rng)));
  net->add(must(BatchNorm2d::make(cpu_allocator(), dtype, 8)));
  relu();
  net->add(std::make_unique<GlobalAvgPool>());
  net->add(must(Linear::make(cpu_allocator(), dtype, 8, 4, rng)));
  return net;
}

// The bytes of a training step's (forward, backward) outputs, parameter gradients and running
// statistics, each made plain, then an inference forward's: what two runs must share bit for bit.
std::vector<std::vector<unsigned char>> step_bytes(Backend& be, Sequential& net, const Tensor& x, const Tensor& r) {
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  net.collect("", &params, &buffers);
  for (Parameter* p : params) p->grad.fill_zero();
  std::vector<Tensor> out;
  auto y = net.forward(be, x, true);
  REQUIRE_MESSAGE(y.ok(), y.status().to_string());
  auto dx = net.backward(be, r);
  REQUIRE_MESSAGE(dx.ok(), dx.status().to_string());
  out = {*y, *dx};
  for (Parameter* p : params) out.push_back(p->grad);
  for (Buffer* b : buffers) out.push_back(b->value);
  auto eval = net.forward(be, x, false);
  REQUIRE_MESSAGE(eval.ok(), eval.status().to_string());
  out.push_back(*eval);
  std::vector<std::vector<unsigned char>> bytes;
  for (const Tensor& t : out) {
    auto plain = be.to_plain(t);
    REQUIRE_MESSAGE(plain.ok(), plain.status().to_string());
    auto host = to_host(be, *plain);
    REQUIRE_MESSAGE(host.ok(), host.status().to_string());
    const auto* p = static_cast<const unsigned char*>(host->raw());
    bytes.emplace_back(p, p + host->bytes());
  }
  return bytes;
}

}  // namespace

TEST_CASE("layers: a ReLU added after a BatchNorm2d is fused into it; the fused pair equals the two layers bit for "
          "bit (reference f64 and f32, cpu, synchronised batch norm, bf16 channels last)") {
  auto fused = conv_bn_relu_net(DType::kF32, true);
  auto* bn = dynamic_cast<BatchNorm2d*>(&fused->at(1));
  auto* relu = dynamic_cast<ReLU*>(&fused->at(2));
  REQUIRE(bn != nullptr);
  REQUIRE(relu != nullptr);
  CHECK(bn->relu_fused());
  CHECK(relu->fused());
  auto apart = conv_bn_relu_net(DType::kF32, false);
  CHECK_FALSE(dynamic_cast<BatchNorm2d*>(&apart->at(1))->relu_fused());
  // ResNet: the stem's and each block's inner pairs; the last batch norm of a block feeds the add.
  auto resnet = make_resnet(cpu_allocator(), DType::kF32, 18, 4, 3);
  REQUIRE(resnet.ok());
  CHECK(dynamic_cast<BatchNorm2d*>(&(*resnet)->at(1))->relu_fused());
  auto& block = dynamic_cast<ResidualBlock&>(dynamic_cast<Sequential&>((*resnet)->at(4)).at(0));
  CHECK(dynamic_cast<BatchNorm2d*>(&block.main_path().at(1))->relu_fused());
  CHECK_FALSE(dynamic_cast<BatchNorm2d*>(&block.main_path().at(4))->relu_fused());

  auto cpu = testing::must_make("cpu");
  auto comm = make_communicator("local", 10).value();
  struct Case {
    const char* name;
    Backend* be;
    DType dtype;
    bool sync, bf16_nhwc;
  };
  for (const Case& c : {Case{"reference f64", &ref(), DType::kF64, false, false},
                        Case{"reference f32", &ref(), DType::kF32, false, false},
                        Case{"cpu f32", cpu.get(), DType::kF32, false, false},
                        Case{"reference f32, sync batch norm", &ref(), DType::kF32, true, false},
                        Case{"reference bf16 channels last", &ref(), DType::kF32, false, true}}) {
    CAPTURE(c.name);
    std::vector<std::vector<unsigned char>> runs[2];
    for (const bool f : {true, false}) {
      auto net = conv_bn_relu_net(c.dtype, f);
      if (c.sync) net->set_batch_norm_sync(comm.get());
      if (c.bf16_nhwc) OK(enable_half_activations(*net, DType::kBF16, Layout::kNhwc));
      Tensor x = c.dtype == DType::kF64 ? random({4, 3, 12, 12}, 3) : testing::random_f32({4, 3, 12, 12}, 3, -2, 2);
      Tensor r = c.dtype == DType::kF64 ? random({4, 4}, 4) : testing::random_f32({4, 4}, 4);
      runs[f ? 0 : 1] = step_bytes(*c.be, *net, x, r);
    }
    REQUIRE(runs[0].size() == runs[1].size());
    for (size_t i = 0; i < runs[0].size(); ++i) {
      CAPTURE(i);
      CHECK(runs[0][i] == runs[1][i]);
    }
  }
}

TEST_CASE("layers: backward without a training forward is a precondition error; eval keeps no activations") {
  InitRng rng(3);
  auto fc = Linear::make(cpu_allocator(), DType::kF64, 4, 2, rng);
  REQUIRE(fc.ok());
  auto y = (*fc)->forward(ref(), random({1, 4}, 1), false);
  REQUIRE(y.ok());
  auto dx = (*fc)->backward(ref(), *y);
  CHECK(dx.status().code() == StatusCode::kFailedPrecondition);
  // The same seed gives the same weights (deterministic initialisation).
  InitRng a(42), b(42);
  auto c1 = Conv2d::make(cpu_allocator(), DType::kF32, 3, 8, 3, {1, 1}, false, a);
  auto c2 = Conv2d::make(cpu_allocator(), DType::kF32, 3, 8, 3, {1, 1}, false, b);
  REQUIRE(c1.ok());
  REQUIRE(c2.ok());
  CHECK(std::equal((*c1)->weight.value.data<float>(), (*c1)->weight.value.data<float>() + 216,
                   (*c2)->weight.value.data<float>()));
}

TEST_CASE("resnet18/34/50: torchvision's parameter counts and names; a forward on the cpu backend") {
  // torchvision.models.resnetNN(num_classes=1000): sum(p.numel() for p in m.parameters()).
  const std::pair<int, int64_t> expected[] = {{18, 11689512}, {34, 21797672}, {50, 25557032}};
  for (const auto& [depth_, count] : expected) {
    const int depth = depth_;  // CAPTURE takes it into a lambda; clang < 16 refuses a structured binding there
    CAPTURE(depth);
    auto net = make_resnet(cpu_allocator(), DType::kF32, depth, 1000, 1);
    REQUIRE_MESSAGE(net.ok(), net.status().to_string());
    std::vector<Parameter*> params;
    std::vector<Buffer*> buffers;
    (*net)->collect("", &params, &buffers);
    int64_t n = 0;
    for (auto* p : params) n += p->value.numel();
    CHECK(n == count);
    CHECK(params.front()->name == "conv1.weight");
    CHECK(params.back()->name == "fc.bias");
    CHECK(buffers.front()->name == "bn1.running_mean");
    if (depth == 50) {
      bool found = false;
      for (auto* p : params) found = found || p->name == "layer4.2.conv3.weight";
      CHECK(found);
      CHECK(buffers.back()->name == "layer4.2.bn3.running_var");
    }
  }
  CHECK(make_resnet(cpu_allocator(), DType::kF32, 101, 10, 1).status().code() == StatusCode::kInvalidArgument);

  auto cpu = make_backend("cpu");
  REQUIRE(cpu.ok());
  auto net = make_resnet(cpu_allocator(), DType::kF32, 18, 3, 1);
  REQUIRE(net.ok());
  Tensor x = *Tensor::zeros({2, 3, 64, 64}, DType::kF32, cpu_allocator());
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>((i * 7919) % 255) / 255.0f;
  auto y = (*net)->forward(**cpu, x, true);
  REQUIRE_MESSAGE(y.ok(), y.status().to_string());
  CHECK(y->shape() == Shape{2, 3});
  Tensor dy = *Tensor::zeros({2, 3}, DType::kF32, cpu_allocator());
  dy.data<float>()[0] = 1;
  auto dx = (*net)->backward(**cpu, dy);
  REQUIRE_MESSAGE(dx.ok(), dx.status().to_string());
  CHECK(dx->shape() == x.shape());
}

TEST_CASE("model registry: every CNN family builds by name, with its default cut among its layers") {
  CHECK(cnn_family_names() == "small, resnet18, resnet34, resnet50");
  for (const CnnFamily& f : cnn_families()) {
    CAPTURE(f.name);
    auto m = make_cnn(f.name, 7, 8, 3);
    REQUIRE_MESSAGE(m.ok(), m.status().to_string());
    bool has_cut = std::string(f.default_cut) == "avgpool";  // a GlobalAvgPool, by any name
    for (size_t i = 0; i < (*m)->size(); ++i) has_cut = has_cut || (*m)->name_at(i) == f.default_cut;
    CHECK(has_cut);
    // The classifier has `classes` outputs.
    std::vector<Parameter*> ps;
    (*m)->collect("", &ps, nullptr);
    REQUIRE(!ps.empty());
    CHECK(ps.back()->value.dim(0) == 7);
    CHECK(find_cnn_family(f.name) == &f);
  }
  CHECK(std::string(find_cnn_family("resnet50")->default_cut) == "layer3");
  CHECK(find_cnn_family("resnet101") == nullptr);
  auto bad = make_cnn("resnet101", 2, 8, 1);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(bad.status().message().find("small, resnet18, resnet34, resnet50") != std::string::npos);
}

TEST_CASE("a model built without a seed draws nothing: the same layers and names, convolutions and fc zero") {
  // What evaluate, predict and slide-embed build before loading every weight from a file.
  for (const char* name : {"small", "resnet18"}) {
    CAPTURE(name);
    auto seeded = make_cnn(name, 5, 8, 3);
    auto bare = make_cnn(name, 5, 8, std::nullopt);
    REQUIRE(seeded.ok());
    REQUIRE(bare.ok());
    std::vector<Parameter*> ps, pb;
    std::vector<Buffer*> bs, bb;
    (*seeded)->collect("", &ps, &bs);
    (*bare)->collect("", &pb, &bb);
    REQUIRE(ps.size() == pb.size());
    REQUIRE(bs.size() == bb.size());
    int drawn = 0;
    for (size_t i = 0; i < ps.size(); ++i) {
      CAPTURE(ps[i]->name);
      CHECK(ps[i]->name == pb[i]->name);
      REQUIRE(ps[i]->value.shape() == pb[i]->value.shape());
      const float* a = ps[i]->value.data<float>();
      const float* b = pb[i]->value.data<float>();
      const bool batch_norm = ps[i]->value.rank() == 1 && ps[i]->name.find("fc") == std::string::npos;
      int64_t differ = 0, nonzero = 0;
      for (int64_t j = 0; j < ps[i]->value.numel(); ++j) {
        differ += a[j] != b[j] ? 1 : 0;
        nonzero += b[j] != 0.0f ? 1 : 0;
      }
      if (batch_norm) CHECK(differ == 0);  // batch norm's weight 1 and bias 0 either way
      else CHECK(nonzero == 0);
      drawn += differ > 0 ? 1 : 0;
    }
    CHECK(drawn > 0);  // the seeded model's convolutions and fc were drawn
    for (size_t i = 0; i < bs.size(); ++i) CHECK(testing::host_values(bs[i]->value) == testing::host_values(bb[i]->value));
  }
  // An unseeded generator draws nothing in Conv2d::make; a seeded one the same as before.
  InitRng none = InitRng::none(), seeded = InitRng::from(7), plain(7);
  CHECK_FALSE(none.draws());
  CHECK(seeded.draws());
  CHECK(seeded() == plain());
}

}  // namespace libtrain_test_layers
