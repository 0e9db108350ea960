// Memory (issue 6): the planner against the allocator's measured peak, out-of-memory recovery
// inside a step (same weights as an unconstrained run), --batch-size auto's search, and
// activation checkpointing (identical gradients, lower peak). On real LC25000 lung tiles from
// sample_data, tiled by libtile at 64 px.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>

#include "slide/tile/pipeline.h"
#include "slide/train/activation_checkpoint.h"
#include "slide/train/planner.h"
#include "slide/train/trainer.h"
#include "test_fixtures.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_memory {

using namespace slide::train;

TEST_SUITE_BEGIN("memory");

namespace {

constexpr int64_t kTile = 64;

// The LC25000 subset tiled once at 64 px (360 tiles, 3 classes), shared by the cases here.
const TileDataset& lung() {
  static std::unique_ptr<TileDataset> data = testing::tile_lc25000(kTile, "memory");
  return *data;
}

Backend& cpu() {
  static std::unique_ptr<Backend> b = [] {
    auto r = make_backend("cpu");
    REQUIRE(r.ok());
    return std::move(*r);
  }();
  return *b;
}

std::unique_ptr<Sequential> model_of(const std::string& name, uint64_t seed) {
  Result<std::unique_ptr<Sequential>> m = name == "small"      ? make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 16, seed)
                                          : name == "resnet18" ? make_resnet(cpu_allocator(), DType::kF32, 18, 3, seed)
                                                               : Result<std::unique_ptr<Sequential>>(slide::core::invalid_argument(name));
  REQUIRE_MESSAGE(m.ok(), m.status().to_string());
  return std::move(*m);
}

// A CNN without batch norm (conv with bias, relu, max pool; twice; pool; linear), so that split
// micro-batches give exactly one batch's gradient.
std::unique_ptr<Sequential> no_bn_cnn(uint64_t seed) {
  InitRng rng(seed);
  auto net = std::make_unique<Sequential>();
  int64_t c = 3;
  for (int64_t out : {16, 32}) {
    auto conv = Conv2d::make(cpu_allocator(), DType::kF32, c, out, 3, {1, 1}, true, rng);
    REQUIRE(conv.ok());
    net->add(std::move(*conv));
    net->add(std::make_unique<ReLU>());
    net->add(std::make_unique<MaxPool2d>(Pool2dParams{2, 2, 0}));
    c = out;
  }
  net->add(std::make_unique<GlobalAvgPool>());
  auto fc = Linear::make(cpu_allocator(), DType::kF32, c, 3, rng);
  REQUIRE(fc.ok());
  net->add(std::move(*fc), "fc");
  return net;
}

PlanOptions plan_options(int64_t micro) {
  PlanOptions o;
  o.micro_batch = micro;
  o.sample_shape = {3, kTile, kTile};
  o.classes = 3;
  return o;
}

std::vector<size_t> first_tiles(size_t n) {
  std::vector<size_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = i * 360 / n;  // every class
  return p;
}

struct BudgetGuard {
  ~BudgetGuard() { cpu_allocator().set_budget_bytes(Allocator::kUnlimited); }
};

}  // namespace

TEST_CASE("planner: the predicted peak is within 15% of the allocator's measured peak (small CNN, ResNet-18)") {
  slide::core::ThreadPool pool(2);
  for (const std::string name : {"small", "resnet18"}) {
    for (int64_t batch : {8, 32}) {
      auto model = model_of(name, 1);
      std::vector<Parameter*> params;
      model->collect("", &params, nullptr);
      auto opt = Optimizer::make(OptimizerConfig{}, params, cpu_allocator());
      REQUIRE(opt.ok());
      auto plan = plan_memory(*model, plan_options(batch));
      REQUIRE_MESSAGE(plan.ok(), plan.status().to_string());
      // Measured: two real steps through the trainer (the second one prefetched during the first).
      const size_t before = cpu_allocator().current_bytes();
      cpu_allocator().reset_peak();
      TrainOptions to;
      to.batch_size = batch;
      Schedule sched;
      auto st = train_epoch(cpu(), *model, **opt, sched, lung(), first_tiles(static_cast<size_t>(2 * batch)), to, 3, &pool);
      REQUIRE_MESSAGE(st.ok(), st.status().to_string());
      const size_t state = plan->parameter_bytes + plan->gradient_bytes + plan->optimizer_bytes;
      const double measured = static_cast<double>(cpu_allocator().peak_bytes() - before + state);
      const double predicted = static_cast<double>(plan->peak_bytes);
      const double measured_step = measured - static_cast<double>(state);
      const double predicted_step = predicted - static_cast<double>(state);
      MESSAGE(name, " batch ", batch, ": predicted ", format_bytes(plan->peak_bytes), " (", plan->peak_at,
              "), measured ", format_bytes(static_cast<size_t>(measured)), "; step only: predicted ",
              format_bytes(static_cast<size_t>(predicted_step)), ", measured ",
              format_bytes(static_cast<size_t>(measured_step)));
      CHECK(std::abs(predicted - measured) <= 0.15 * measured);
      // The step's own bytes (activations, inputs, scratch; without the weights, which are exact)
      // are never under-predicted: the scratch model assumes oneDNN's blocked layouts, which it
      // picks for all but the smallest spatial sizes (ResNet-18's layer4 at 2 x 2 px here runs in
      // plain layouts: the plan is high there by one weight-sized scratch, 9 MiB).
      CHECK(predicted_step >= 0.97 * measured_step);
      CHECK(plan->layers.size() == model->size());
      CHECK(plan->table().find("peak") != std::string::npos);
    }
  }
}

TEST_CASE("OOM recovery: a budget that fits micro-batch 8 but not 32; batch 32 finishes with the unconstrained weights") {
  slide::core::ThreadPool pool(2);
  BudgetGuard restore;
  const std::vector<size_t> tiles = first_tiles(96);  // 3 steps of 32
  TrainOptions to;
  to.batch_size = 32;
  to.augment = {};
  Schedule sched;
  sched.kind = "constant";
  sched.base_lr = 0.05;

  auto train = [&](size_t budget, bool recover, EpochStats* stats) -> Result<std::vector<std::vector<float>>> {
    auto model = no_bn_cnn(5);
    std::vector<Parameter*> params;
    model->collect("", &params, nullptr);
    auto opt = Optimizer::make(OptimizerConfig{}, params, cpu_allocator());
    REQUIRE(opt.ok());
    if (budget != Allocator::kUnlimited) cpu_allocator().set_budget_bytes(cpu_allocator().current_bytes() + budget);
    TrainOptions o = to;
    o.oom_recovery = recover;
    auto st = train_epoch(cpu(), *model, **opt, sched, lung(), tiles, o, 11, &pool);
    cpu_allocator().set_budget_bytes(Allocator::kUnlimited);
    if (!st.ok()) return st.status();
    *stats = *st;
    std::vector<std::vector<float>> w;
    for (auto* p : params) w.emplace_back(p->value.data<float>(), p->value.data<float>() + p->value.numel());
    return w;
  };
  // The step's bytes beyond the weights (live at the budget's setting) at micro-batch 8 and 32.
  auto model = no_bn_cnn(5);
  auto p8 = plan_memory(*model, plan_options(8));
  auto p32 = plan_memory(*model, plan_options(32));
  REQUIRE(p8.ok());
  REQUIRE(p32.ok());
  const size_t state = p8->parameter_bytes + p8->gradient_bytes + p8->optimizer_bytes;
  const size_t budget = (p8->peak_bytes - state) * 5 / 4;
  REQUIRE(p32->peak_bytes - state > budget * 2);

  EpochStats free_run, tight_run, refused;
  auto w_free = train(Allocator::kUnlimited, true, &free_run);
  REQUIRE_MESSAGE(w_free.ok(), w_free.status().to_string());
  CHECK(free_run.oom_retries == 0);
  CHECK(free_run.accumulate == 1);
  // Without recovery the budget is a hard error: the constraint is real.
  auto w_refused = train(budget, false, &refused);
  REQUIRE_FALSE(w_refused.ok());
  CHECK(w_refused.status().code() == slide::core::StatusCode::kResourceExhausted);
  // With it the epoch finishes, with 4 micro-batches of 8 per step after two halvings.
  auto w_tight = train(budget, true, &tight_run);
  REQUIRE_MESSAGE(w_tight.ok(), w_tight.status().to_string());
  CHECK(tight_run.oom_retries == 2);
  CHECK(tight_run.accumulate == 4);
  CHECK(tight_run.steps == 3);
  CHECK(tight_run.loss == doctest::Approx(free_run.loss).epsilon(1e-5));
  double worst = 0, scale = 0;
  for (size_t i = 0; i < w_free->size(); ++i)
    for (size_t j = 0; j < (*w_free)[i].size(); ++j) {
      worst = std::max(worst, static_cast<double>(std::abs((*w_free)[i][j] - (*w_tight)[i][j])));
      scale = std::max(scale, static_cast<double>(std::abs((*w_free)[i][j])));
    }
  MESSAGE("largest weight difference after 3 steps: ", worst, " (largest weight ", scale, ")");
  // Float sums in another order: a few ulps of the weights, never more.
  CHECK(worst <= 1e-6 * std::max(1.0, scale));
}

TEST_CASE("OOM recovery: a refit (the planner's offload fallback) reruns the step fitted another way, before halving") {
  // RefitFn (oom_recovery.h): here the "other way" is a larger budget, which stands for the
  // memory activation offload frees on a device; slide-train's refit wraps the model for offload
  // (apps/slide_train_memory.cpp, offload_refit_candidate). The step must rerun with the
  // micro-batch count the refit gives, not halved, and end with the unconstrained weights.
  slide::core::ThreadPool pool(2);
  BudgetGuard restore;
  const std::vector<size_t> tiles = first_tiles(64);  // 2 steps of 32
  Schedule sched;
  sched.kind = "constant";
  sched.base_lr = 0.05;
  auto model0 = no_bn_cnn(7);
  auto p8 = plan_memory(*model0, plan_options(8));
  auto p32 = plan_memory(*model0, plan_options(32));
  REQUIRE(p8.ok());
  REQUIRE(p32.ok());
  const size_t state = p8->parameter_bytes + p8->gradient_bytes + p8->optimizer_bytes;
  const size_t tight = (p8->peak_bytes - state) * 5 / 4, roomy = (p32->peak_bytes - state) * 2;

  // refit: what the refit function does; returns the weights, the stats and the refit's calls.
  auto train = [&](const std::function<Result<int64_t>(int64_t, int64_t, size_t)>& refit, size_t budget,
                   EpochStats* stats, int* calls) -> Result<std::vector<std::vector<float>>> {
    auto model = no_bn_cnn(7);
    std::vector<Parameter*> params;
    model->collect("", &params, nullptr);
    auto opt = Optimizer::make(OptimizerConfig{}, params, cpu_allocator());
    REQUIRE(opt.ok());
    const size_t base = cpu_allocator().current_bytes();
    cpu_allocator().set_budget_bytes(base + budget);
    TrainOptions o;
    o.batch_size = 32;
    o.augment = {};
    *calls = 0;
    if (refit)
      o.refit_on_oom = [&, base](int64_t count, int64_t samples) {
        ++*calls;
        return refit(count, samples, base);
      };
    auto st = train_epoch(cpu(), *model, **opt, sched, lung(), tiles, o, 13, &pool);
    cpu_allocator().set_budget_bytes(Allocator::kUnlimited);
    if (!st.ok()) return st.status();
    *stats = *st;
    std::vector<std::vector<float>> w;
    for (auto* p : params) w.emplace_back(p->value.data<float>(), p->value.data<float>() + p->value.numel());
    return w;
  };
  EpochStats free_run, refit_run, halved_run, failed_run;
  int calls = 0;
  auto w_free = train(nullptr, roomy, &free_run, &calls);
  REQUIRE_MESSAGE(w_free.ok(), w_free.status().to_string());
  CHECK(free_run.oom_retries == 0);

  // The refit makes room and keeps the split: one rerun, one micro-batch per step, the same bits
  // as the unconstrained run (the same sums in the same order).
  auto w_refit = train(
      [&](int64_t count, int64_t samples, size_t base) -> Result<int64_t> {
        CHECK(count == 1);
        CHECK(samples == 32);
        cpu_allocator().set_budget_bytes(base + roomy);
        return count;
      },
      tight, &refit_run, &calls);
  REQUIRE_MESSAGE(w_refit.ok(), w_refit.status().to_string());
  CHECK(calls == 1);
  CHECK(refit_run.oom_retries == 1);
  CHECK(refit_run.accumulate == 1);
  CHECK(*w_refit == *w_free);

  // A refit that changes nothing (returns 0): the micro-batches halve as before.
  auto w_halved = train([](int64_t, int64_t, size_t) -> Result<int64_t> { return int64_t{0}; }, tight, &halved_run,
                        &calls);
  REQUIRE_MESSAGE(w_halved.ok(), w_halved.status().to_string());
  CHECK(calls == 2);  // asked again at 2 micro-batches, then 4 fit
  CHECK(halved_run.accumulate == 4);
  CHECK(halved_run.oom_retries == 2);

  // Its error ends the run, named.
  auto w_failed = train([](int64_t, int64_t, size_t) -> Result<int64_t> { return slide::core::internal_error("refit broke"); },
                        tight, &failed_run, &calls);
  REQUIRE_FALSE(w_failed.ok());
  CHECK(w_failed.status().message().find("refit broke") != std::string::npos);
}

TEST_CASE("OOM recovery with batch norm: running statistics are put back before the rerun") {
  slide::core::ThreadPool pool(2);
  BudgetGuard restore;
  auto run_tight = [&] {
    auto model = model_of("small", 2);
    std::vector<Parameter*> params;
    std::vector<Buffer*> buffers;
    model->collect("", &params, &buffers);
    auto opt = Optimizer::make(OptimizerConfig{}, params, cpu_allocator());
    REQUIRE(opt.ok());
    auto p8 = plan_memory(*model, plan_options(8));
    REQUIRE(p8.ok());
    const size_t state = p8->parameter_bytes + p8->gradient_bytes + p8->optimizer_bytes;
    cpu_allocator().set_budget_bytes(cpu_allocator().current_bytes() + (p8->peak_bytes - state) * 5 / 4);
    TrainOptions o;
    o.batch_size = 32;
    Schedule sched;
    auto st = train_epoch(cpu(), *model, **opt, sched, lung(), first_tiles(32), o, 4, &pool);
    cpu_allocator().set_budget_bytes(Allocator::kUnlimited);
    REQUIRE_MESSAGE(st.ok(), st.status().to_string());
    std::vector<float> out;
    for (auto* b : buffers) out.insert(out.end(), b->value.data<float>(), b->value.data<float>() + b->value.numel());
    return std::make_pair(*st, out);
  };
  auto [tight, stats_tight] = run_tight();
  CHECK(tight.oom_retries == 2);
  CHECK(tight.accumulate == 4);
  // The reference: the same four micro-batches of 8, asked for, no failure. Were the running
  // statistics not put back, the discarded forwards (at 32, then 16) would have moved them.
  auto model = model_of("small", 2);
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  model->collect("", &params, &buffers);
  auto opt = Optimizer::make(OptimizerConfig{}, params, cpu_allocator());
  REQUIRE(opt.ok());
  TrainOptions o;
  o.batch_size = 32;
  o.accumulate = 4;
  Schedule sched;
  auto st = train_epoch(cpu(), *model, **opt, sched, lung(), first_tiles(32), o, 4, &pool);
  REQUIRE(st.ok());
  std::vector<float> expect;
  for (auto* b : buffers) expect.insert(expect.end(), b->value.data<float>(), b->value.data<float>() + b->value.numel());
  REQUIRE(expect.size() == stats_tight.size());
  double worst = 0;
  for (size_t i = 0; i < expect.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(expect[i] - stats_tight[i])));
  CHECK(worst <= 1e-6);
}

TEST_CASE("--batch-size auto: the largest micro-batch that fits; one larger does not") {
  BudgetGuard restore;
  auto model = model_of("small", 3);
  std::vector<Parameter*> params;
  model->collect("", &params, nullptr);
  auto opt = Optimizer::make(OptimizerConfig{}, params, cpu_allocator());
  REQUIRE(opt.ok());
  const size_t budget = cpu_allocator().current_bytes() + (size_t{24} << 20);  // 24 MiB for the step
  cpu_allocator().set_budget_bytes(budget);
  PlanOptions po = plan_options(1);
  po.other_bytes = cpu_allocator().current_bytes() -
                   [&] {
                     auto p = plan_memory(*model, plan_options(1));
                     REQUIRE(p.ok());
                     return p->parameter_bytes + p->gradient_bytes + p->optimizer_bytes;
                   }();
  auto a = auto_micro_batch(cpu(), *model, po, budget, 512);
  REQUIRE_MESSAGE(a.ok(), a.status().to_string());
  MESSAGE("planned ", a->planned, ", confirmed ", a->micro_batch, " after ", a->probes, " real steps");
  CHECK(a->micro_batch > 1);
  CHECK(a->micro_batch < 512);
  CHECK(probe_step(cpu(), *model, po, a->micro_batch).ok());
  const Status larger = probe_step(cpu(), *model, po, a->micro_batch + 1);
  CHECK(larger.code() == slide::core::StatusCode::kResourceExhausted);
  // The plan alone is close: within 15% of the size real steps confirm.
  CHECK(std::abs(static_cast<double>(a->planned - a->micro_batch)) <= 0.15 * static_cast<double>(a->micro_batch));
  // The probes left no trace: gradients zero, nothing saved.
  for (auto* p : params)
    for (int64_t i = 0; i < p->grad.numel(); ++i) REQUIRE(p->grad.data<float>()[i] == 0.0f);
}

TEST_CASE("activation checkpointing: identical gradients and running statistics, lower measured peak") {
  for (const std::string mode : {"stage", "block"}) {
    auto plain = model_of("resnet18", 9);
    auto ckpt = model_of("resnet18", 9);
    auto made = checkpoint_activations(*ckpt, mode);
    REQUIRE_MESSAGE(made.ok(), made.status().to_string());
    CHECK(*made == (mode == "stage" ? 6u : 8u));  // stem, 4 stages, head; or 8 blocks
    std::vector<Parameter*> pp, pc;
    std::vector<Buffer*> bp, bc;
    plain->collect("", &pp, &bp);
    ckpt->collect("", &pc, &bc);
    REQUIRE(pp.size() == pc.size());
    REQUIRE(bp.size() == bc.size());
    for (size_t i = 0; i < pp.size(); ++i) CHECK(pp[i]->name == pc[i]->name);  // checkpoints interchangeable
    Tensor images, labels;
    REQUIRE(lung().load_batch(first_tiles(16), {}, 0, nullptr, cpu_allocator(), &images, &labels).ok());
    auto step = [&](Sequential& m) {
      const size_t before = cpu_allocator().current_bytes();
      cpu_allocator().reset_peak();
      auto logits = m.forward(cpu(), images, true);
      REQUIRE(logits.ok());
      auto probs = Tensor::empty(logits->shape(), DType::kF32, cpu_allocator());
      REQUIRE(probs.ok());
      double loss = 0;
      REQUIRE(cpu().softmax_cross_entropy_forward(*logits, labels, Tensor(), 0, *probs, &loss).ok());
      auto dl = Tensor::empty(logits->shape(), DType::kF32, cpu_allocator());
      REQUIRE(dl.ok());
      REQUIRE(cpu().softmax_cross_entropy_backward(*probs, labels, Tensor(), 0, *dl).ok());
      *logits = Tensor();
      REQUIRE(m.backward(cpu(), *dl).ok());
      return cpu_allocator().peak_bytes() - before;
    };
    const size_t peak_plain = step(*plain), peak_ckpt = step(*ckpt);
    MESSAGE(mode, ": measured step peak ", format_bytes(peak_plain), " plain, ", format_bytes(peak_ckpt),
            " checkpointed");
    CHECK(peak_ckpt < peak_plain * 3 / 4);
    for (size_t i = 0; i < pp.size(); ++i) {
      const Tensor &a = pp[i]->grad, &b = pc[i]->grad;
      REQUIRE(a.numel() == b.numel());
      for (int64_t j = 0; j < a.numel(); ++j)
        if (a.data<float>()[j] != b.data<float>()[j]) FAIL_CHECK(pp[i]->name, "[", j, "] differs");
    }
    for (size_t i = 0; i < bp.size(); ++i)  // updated once, not twice
      for (int64_t j = 0; j < bp[i]->value.numel(); ++j)
        if (bp[i]->value.data<float>()[j] != bc[i]->value.data<float>()[j]) FAIL_CHECK(bp[i]->name, " differs");
    // The planner sees the same saving (it runs the same wrapped layers).
    auto plan_plain = plan_memory(*plain, plan_options(16)), plan_ckpt = plan_memory(*ckpt, plan_options(16));
    REQUIRE(plan_plain.ok());
    REQUIRE(plan_ckpt.ok());
    CHECK(plan_ckpt->saved_bytes < plan_plain->saved_bytes * 3 / 5);
  }
  auto small = model_of("small", 9);
  auto grouped = checkpoint_activations(*small, "4");
  REQUIRE(grouped.ok());
  CHECK(*grouped == 4u);  // 14 layers in groups of 4
  CHECK(checkpoint_activations(*small, "sometimes").status().code() == slide::core::StatusCode::kInvalidArgument);
}

TEST_SUITE_END();

}  // namespace libtrain_test_memory
