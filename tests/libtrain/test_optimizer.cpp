// Optimizers against PyTorch's documented update rules (torch.optim.SGD / AdamW pseudo-code),
// evaluated by hand for these inputs; both backends; and the schedules.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "slide/train/optimizer.h"
#include "slide/train/trainer.h"
#include "test_util.h"

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
