// Optimizers against PyTorch's documented update rules (torch.optim.SGD / AdamW pseudo-code),
// evaluated by hand for these inputs; both backends; and the schedules.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "slide/train/checkpoint.h"
#include "slide/train/fine_tune.h"
#include "slide/train/optimizer.h"
#include "slide/train/trainer.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_optimizer {

using slide::core::StatusCode;
using namespace slide::train;

namespace {

using testing::must_make;

Parameter param(std::vector<double> v, DType dt) {
  Parameter p{"w", *Tensor::zeros({static_cast<int64_t>(v.size())}, dt, cpu_allocator()),
              *Tensor::zeros({static_cast<int64_t>(v.size())}, dt, cpu_allocator())};
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == DType::kF64) p.value.data<double>()[i] = v[i];
    else p.value.data<float>()[i] = static_cast<float>(v[i]);
  }
  return p;
}

void set_grad(Parameter& p, std::vector<double> g) {
  for (size_t i = 0; i < g.size(); ++i) {
    if (p.grad.dtype() == DType::kF64) p.grad.data<double>()[i] = g[i];
    else p.grad.data<float>()[i] = static_cast<float>(g[i]);
  }
}

double at(const Tensor& t, int i) { return t.dtype() == DType::kF64 ? t.data<double>()[i] : t.data<float>()[i]; }

}  // namespace

TEST_CASE("sgd with Nesterov momentum and weight decay: two steps as torch.optim.SGD") {
  for (const char* name : {"reference", "cpu"}) {
    CAPTURE(name);
    auto be = must_make(name);
    const DType dt = std::string(name) == "cpu" ? DType::kF32 : DType::kF64;
    Parameter p = param({1.0, -2.0, 0.5}, dt);
    OptimizerConfig c;
    c.momentum = 0.9;
    c.weight_decay = 0.01;
    c.nesterov = true;
    auto opt = Optimizer::make(c, {&p}, cpu_allocator());
    REQUIRE(opt.ok());
    set_grad(p, {0.5, 0.25, -1.0});
    REQUIRE((*opt)->step(*be, 0.1).ok());
    CHECK(at(p.value, 0) == doctest::Approx(0.9031));
    CHECK(at(p.value, 2) == doctest::Approx(0.68905));
    set_grad(p, {0.1, -0.3, 0.2});
    REQUIRE((*opt)->step(*be, 0.1).ok());
    CHECK(at(p.value, 0) == doctest::Approx(0.84107411));
    CHECK(at(p.value, 1) == doctest::Approx(-2.00144697));
    CHECK(at(p.value, 2) == doctest::Approx(0.730335805));
    CHECK((*opt)->state().at(0)->name == "w.momentum_buffer");
    CHECK(at((*opt)->state()[0]->value, 0) == doctest::Approx(0.568031));
  }
}

TEST_CASE("adamw: one step as torch.optim.AdamW (decoupled decay, bias correction)") {
  for (const char* name : {"reference", "cpu"}) {
    CAPTURE(name);
    auto be = must_make(name);
    const DType dt = std::string(name) == "cpu" ? DType::kF32 : DType::kF64;
    Parameter p = param({1.0, -2.0, 0.5}, dt);
    OptimizerConfig c;
    c.name = "adamw";
    c.weight_decay = 0.05;
    auto opt = Optimizer::make(c, {&p}, cpu_allocator());
    REQUIRE(opt.ok());
    set_grad(p, {0.5, 0.25, -1.0});
    REQUIRE((*opt)->step(*be, 0.01).ok());
    // p (1 - lr wd) - lr * mhat / (sqrt(vhat) + eps), mhat = g, sqrt(vhat) = |g| on step 1.
    CHECK(at(p.value, 0) == doctest::Approx(0.9895));
    CHECK(at(p.value, 1) == doctest::Approx(-2.009));
    CHECK(at(p.value, 2) == doctest::Approx(0.50975));
    auto st = (*opt)->state();
    REQUIRE(st.size() == 2);
    CHECK(st[0]->name == "w.exp_avg");
    CHECK(at(st[0]->value, 2) == doctest::Approx(-0.1));
    CHECK(at(st[1]->value, 0) == doctest::Approx(0.00025));
  }
}

TEST_CASE("optimizer: bad configurations are refused; zero_grad") {
  Parameter p = param({1.0}, DType::kF64);
  OptimizerConfig c;
  c.name = "lion";
  CHECK(Optimizer::make(c, {&p}, cpu_allocator()).status().code() == StatusCode::kInvalidArgument);
  c.name = "sgd";
  c.momentum = 0;
  c.nesterov = true;
  CHECK(Optimizer::make(c, {&p}, cpu_allocator()).status().code() == StatusCode::kInvalidArgument);
  c.nesterov = false;
  auto opt = Optimizer::make(c, {&p}, cpu_allocator());
  REQUIRE(opt.ok());
  CHECK((*opt)->state().empty());  // no momentum, no buffer
  set_grad(p, {3.0});
  REQUIRE((*opt)->zero_grad().ok());
  CHECK(at(p.grad, 0) == 0.0);
}

TEST_CASE("optimizer: per-parameter options (fine-tuning): a frozen parameter keeps its value and has no state; "
          "lr_scale multiplies the rate") {
  auto be = must_make("reference");
  for (const char* name : {"sgd", "adamw"}) {
    CAPTURE(name);
    Parameter frozen = param({1.0, 2.0}, DType::kF64), half = param({1.0, 2.0}, DType::kF64),
              full = param({1.0, 2.0}, DType::kF64);
    frozen.name = "frozen", half.name = "half", full.name = "full";
    OptimizerConfig c;
    c.name = name;
    c.momentum = 0.9;
    c.weight_decay = 0;
    auto opt = Optimizer::make(c, {&frozen, &half, &full}, cpu_allocator(), {{true, 1.0}, {false, 0.5}, {false, 1.0}});
    REQUIRE(opt.ok());
    // State for the two trainable parameters only, under their names.
    for (Buffer* b : (*opt)->state()) CHECK(b->name.rfind("frozen", 0) == std::string::npos);
    CHECK((*opt)->state().size() == (std::string(name) == "sgd" ? 2u : 4u));
    for (Parameter* p : {&frozen, &half, &full}) set_grad(*p, {0.5, -1.0});
    REQUIRE((*opt)->step(*be, 0.1).ok());
    CHECK(at(frozen.value, 0) == 1.0);
    CHECK(at(frozen.value, 1) == 2.0);
    if (std::string(name) == "sgd") {
      // First step: the momentum buffer is the gradient; p -= lr x scale x g.
      CHECK(at(full.value, 0) == doctest::Approx(1.0 - 0.1 * 0.5).epsilon(1e-15));
      CHECK(at(half.value, 0) == doctest::Approx(1.0 - 0.05 * 0.5).epsilon(1e-15));
      CHECK(at(half.value, 1) == doctest::Approx(2.0 + 0.05 * 1.0).epsilon(1e-15));
    } else {
      // AdamW's first step moves each element by lr x scale (m_hat / sqrt(v_hat) = sign(g)).
      CHECK(at(full.value, 0) == doctest::Approx(1.0 - 0.1).epsilon(1e-7));
      CHECK(at(half.value, 0) == doctest::Approx(1.0 - 0.05).epsilon(1e-7));
      CHECK(at(half.value, 1) == doctest::Approx(2.0 + 0.05).epsilon(1e-7));
    }
    // A frozen parameter's gradient is still zeroed; a NaN in it is not the optimizer's concern.
    set_grad(frozen, {NAN, 1.0});
    REQUIRE((*opt)->step(*be, 0.1).ok());
    REQUIRE((*opt)->zero_grad().ok());
    CHECK(at(frozen.grad, 1) == 0.0);
    CHECK(at(frozen.value, 0) == 1.0);
  }
  Parameter p = param({1.0}, DType::kF64);
  OptimizerConfig c;
  CHECK(Optimizer::make(c, {&p}, cpu_allocator(), {{false, 1.0}, {false, 1.0}}).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(Optimizer::make(c, {&p}, cpu_allocator(), {{false, NAN}}).status().code() == StatusCode::kInvalidArgument);
  CHECK(Optimizer::make(c, {&p}, cpu_allocator(), {{false, -1.0}}).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("optimizer: out-of-range or non-finite hyper-parameters are refused as PyTorch's (issue 20)") {
  Parameter p = param({1.0}, DType::kF64);
  for (auto bad : std::vector<void (*)(OptimizerConfig&)>{
           [](OptimizerConfig& c) { c.momentum = 5; }, [](OptimizerConfig& c) { c.momentum = -0.1; },
           [](OptimizerConfig& c) { c.momentum = std::nan(""); }, [](OptimizerConfig& c) { c.weight_decay = -1; },
           [](OptimizerConfig& c) { c.weight_decay = HUGE_VAL; }, [](OptimizerConfig& c) { c.eps = 0; },
           [](OptimizerConfig& c) { c.name = "adamw", c.beta1 = 1.0; },
           [](OptimizerConfig& c) { c.name = "adamw", c.beta2 = std::nan(""); }}) {
    OptimizerConfig c;
    bad(c);
    CHECK(Optimizer::make(c, {&p}, cpu_allocator()).status().code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("optimizer: a NaN learning rate or gradient is never applied (issue 20)") {
  for (const char* name : {"reference", "cpu"}) {
    CAPTURE(name);
    auto be = must_make(name);
    const DType dt = std::string(name) == "cpu" ? DType::kF32 : DType::kF64;
    for (const char* optimizer : {"sgd", "adamw"}) {
      CAPTURE(optimizer);
      Parameter a = param({1.0, -2.0}, dt), b = param({0.5}, dt);
      a.name = "a.weight", b.name = "b.weight";
      OptimizerConfig c;
      c.name = optimizer;
      auto opt = Optimizer::make(c, {&a, &b}, cpu_allocator());
      REQUIRE(opt.ok());
      set_grad(a, {0.5, 0.25});
      set_grad(b, {std::nan("")});
      Status s = (*opt)->step(*be, 0.1);
      CHECK(s.code() == StatusCode::kOutOfRange);
      CHECK(s.message().find("optimizer step 1") != std::string::npos);
      CHECK(s.message().find("first in b.weight's gradient") != std::string::npos);
      set_grad(b, {HUGE_VAL});
      CHECK((*opt)->step(*be, 0.1).code() == StatusCode::kOutOfRange);
      set_grad(b, {0.1});
      for (double lr : {std::nan(""), HUGE_VAL, -1.0}) {
        s = (*opt)->step(*be, lr);
        CHECK(s.code() == StatusCode::kOutOfRange);
        CHECK(s.message().find("learning rate") != std::string::npos);
      }
      // Nothing was updated, and the step count did not move: the next good step is step 1.
      CHECK(at(a.value, 0) == 1.0);
      CHECK(at(a.value, 1) == -2.0);
      CHECK(at(b.value, 0) == 0.5);
      CHECK((*opt)->steps() == 0);
      REQUIRE((*opt)->step(*be, 0.1).ok());
      CHECK(at(a.value, 0) < 1.0);
    }
  }
}

TEST_CASE("schedules: warm-up then cosine; step decay") {
  Schedule s;
  s.base_lr = 0.1;
  s.warmup_steps = 10;
  s.total_steps = 110;
  CHECK(s.at(0) == doctest::Approx(0.01));
  CHECK(s.at(9) == doctest::Approx(0.1));
  CHECK(s.at(10) == doctest::Approx(0.1));
  CHECK(s.at(60) == doctest::Approx(0.05));
  CHECK(s.at(110) == doctest::Approx(0.0));
  Schedule st;
  st.kind = "step";
  st.base_lr = 0.1;
  st.step_size = 30;
  CHECK(st.at(29) == doctest::Approx(0.1));
  CHECK(st.at(30) == doctest::Approx(0.01));
  CHECK(st.at(65) == doctest::Approx(0.001));
}

TEST_CASE("macro ROC AUC: Mann-Whitney by hand, ties count half, undefined classes skipped") {
  // Two classes; class-0 scores of the class-0 samples 0.9, 0.8, 0.4 and of the others 0.7, 0.3:
  // 5 of the 6 (positive, negative) pairs are ordered right.
  std::vector<float> probs{0.9f, 0.1f, 0.8f, 0.2f, 0.4f, 0.6f, 0.7f, 0.3f, 0.3f, 0.7f};
  std::vector<int32_t> labels{0, 0, 0, 1, 1};
  CHECK(macro_roc_auc(probs, labels, 2) == doctest::Approx(5.0 / 6.0));
  // A tie between a positive and a negative counts one half.
  CHECK(macro_roc_auc({0.5f, 0.5f, 0.5f, 0.5f}, {0, 1}, 2) == doctest::Approx(0.5));
  // A third class with no samples is skipped; a single class has no AUC.
  std::vector<float> p3{0.9f, 0.05f, 0.05f, 0.2f, 0.7f, 0.1f};
  CHECK(macro_roc_auc(p3, {0, 1}, 3) == doctest::Approx(1.0));
  CHECK(macro_roc_auc({1.0f, 1.0f}, {0, 0}, 1) == -1.0);
}

TEST_CASE("confusion matrix: rows are true classes, columns the argmax (first on ties), as sklearn's") {
  // sklearn.metrics.confusion_matrix([0, 0, 0, 1, 1], [0, 0, 1, 0, 1]) = [[2, 1], [1, 1]].
  std::vector<float> probs{0.9f, 0.1f, 0.8f, 0.2f, 0.4f, 0.6f, 0.7f, 0.3f, 0.3f, 0.7f};
  CHECK(confusion_matrix(probs, {0, 0, 0, 1, 1}, 2) == std::vector<int64_t>{2, 1, 1, 1});
  // A tie predicts the first class; a label outside [0, classes) is skipped.
  CHECK(confusion_matrix({0.5f, 0.5f, 0.2f, 0.8f}, {1, 7}, 2) == std::vector<int64_t>{0, 0, 1, 0});
  // Three classes, one of them absent: its row is zeros.
  std::vector<float> p3{0.9f, 0.05f, 0.05f, 0.2f, 0.1f, 0.7f, 0.1f, 0.2f, 0.7f};
  CHECK(confusion_matrix(p3, {0, 2, 2}, 3) == std::vector<int64_t>{1, 0, 0, 0, 0, 0, 0, 0, 2});
}

TEST_CASE("fine-tuning: initial weights by name, the classifier replaced for another class count, another "
          "architecture refused; freezing and the backbone's rate by layer") {
  const std::string dir = std::filesystem::temp_directory_path() / ("slide_finetune_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto a = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 4, /*seed=*/1);
  auto b = make_small_cnn(cpu_allocator(), DType::kF32, 3, 5, 4, /*seed=*/2);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  std::vector<Parameter*> pa, pb;
  std::vector<Buffer*> ba, bb;
  (*a)->collect("", &pa, &ba);
  (*b)->collect("", &pb, &bb);
  std::vector<NamedTensor> saved;
  for (Parameter* p : pa) saved.push_back({p->name, &p->value});
  for (Buffer* x : ba) saved.push_back({x->name, &x->value});
  Tensor extra = *Tensor::zeros({2}, DType::kF32, cpu_allocator());
  std::vector<NamedTensor> with_head = saved;
  with_head.push_back({"projection.weight", &extra});  // another model's head: ignored
  REQUIRE(save_safetensors(dir + "/a.safetensors", with_head).ok());
  auto report = load_initial_weights(dir + "/a.safetensors", pb, bb, "fc");
  REQUIRE(report.ok());
  CHECK(report->kept == std::vector<std::string>{"fc.weight", "fc.bias"});
  CHECK(report->ignored == std::vector<std::string>{"projection.weight"});
  CHECK(report->loaded.size() == pb.size() + bb.size() - 2);
  for (size_t i = 0; i < pb.size(); ++i) {
    CAPTURE(pb[i]->name);
    const bool head = pb[i]->name.rfind("fc.", 0) == 0;
    const bool same = std::equal(pb[i]->value.data<float>(), pb[i]->value.data<float>() + pb[i]->value.numel(),
                                 pa[i]->value.data<float>());
    CHECK((head ? pb[i]->value.dim(0) == 5 : same));
  }
  // A tensor under one of the model's layers that the model lacks: another architecture.
  std::vector<NamedTensor> deeper = saved;
  deeper.push_back({"0.extra", &extra});
  REQUIRE(save_safetensors(dir + "/deeper.safetensors", deeper).ok());
  auto refused = load_initial_weights(dir + "/deeper.safetensors", pb, bb, "fc");
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK(refused.status().message().find("'0.extra'") != std::string::npos);
  // A model tensor the file lacks (not the head's): refused, naming it.
  std::vector<NamedTensor> missing(saved.begin() + 1, saved.end());
  REQUIRE(save_safetensors(dir + "/missing.safetensors", missing).ok());
  auto lacks = load_initial_weights(dir + "/missing.safetensors", pb, bb, "fc");
  CHECK(lacks.status().code() == StatusCode::kInvalidArgument);
  CHECK(lacks.status().message().find("has no tensor '" + saved[0].name + "'") != std::string::npos);

  // Freezing through the second top-level layer; the backbone at half the rate.
  Sequential& model = **b;
  REQUIRE(model.size() > 3);
  const std::string through = model.name_at(1);
  auto opts = fine_tune_options(model, pb, through, "fc", 0.5);
  REQUIRE(opts.ok());
  for (size_t i = 0; i < pb.size(); ++i) {
    CAPTURE(pb[i]->name);
    const std::string child = pb[i]->name.substr(0, pb[i]->name.find('.'));
    CHECK((*opts)[i].frozen == (child == model.name_at(0) || child == model.name_at(1)));
    CHECK((*opts)[i].lr_scale == (child == "fc" ? 1.0 : 0.5));
  }
  CHECK(fine_tune_options(model, pb, "nope", "fc", 1).status().code() == StatusCode::kInvalidArgument);
  CHECK(fine_tune_options(model, pb, "fc", "fc", 1).status().code() == StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

}  // namespace libtrain_test_optimizer
