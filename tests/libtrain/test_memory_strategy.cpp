// The memory planner's choice among micro-batching, activation checkpointing and offload (issue
// 13 item 3, memory_strategy.h): the time model and the choice as pure functions; wrapping undone
// exactly (unwrap_segments); and the whole planner on the simulated device (`reference-sim`)
// with ResNet-18, where every candidate it says fits has a planned peak within the budget, the
// model comes back unwrapped, and the chosen strategy's real step fits the budget.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "slide/train/activation_checkpoint.h"
#include "slide/train/memory_strategy.h"
#include "slide/train/offload.h"
#include "slide/train/oom_recovery.h"
#include "slide/train/planner.h"
#include "slide/train/trainer.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_memory_strategy {

using namespace slide::train;

TEST_SUITE_BEGIN("memory");

namespace {

std::unique_ptr<Sequential> resnet18() {
  auto m = make_resnet(cpu_allocator(), DType::kF32, 18, 3, 5);
  REQUIRE_MESSAGE(m.ok(), m.status().to_string());
  return std::move(*m);
}

std::vector<std::pair<std::string, Parameter*>> parameters(Sequential& m) {
  std::vector<Parameter*> ps;
  m.collect("", &ps, nullptr);
  std::vector<std::pair<std::string, Parameter*>> out;
  for (Parameter* p : ps) out.emplace_back(p->name, p);
  return out;
}

StrategyCandidate candidate(Mechanism m, int64_t micro, int64_t batch, double seconds) {
  StrategyCandidate c;
  c.mechanism = m;
  c.segments = m == Mechanism::kNone ? "none" : "stage";
  c.micro_batch = micro;
  c.micro_batches = micro > 0 ? (batch + micro - 1) / micro : 0;
  c.seconds = seconds;
  return c;
}

}  // namespace

TEST_CASE("memory strategy: the step time model and the cheapest candidate") {
  StepCost c;
  c.micro_batch_seconds = 0.01;
  c.sample_seconds = 0.1;
  c.forward_fraction = 0.5;
  c.copy_bytes_per_second = 1e9;
  // 32 samples in 4 micro-batches of 8: 4 x 0.01 + 32 x 0.1.
  CHECK(predict_step_seconds(c, 32, 8, false, 0) == doctest::Approx(3.24));
  CHECK(predict_step_seconds(c, 32, 8, true, 0) == doctest::Approx(3.24 * 1.5));
  // 1e8 bytes each way per micro-batch: 8e8 bytes at 1e9 B/s.
  CHECK(predict_step_seconds(c, 32, 8, false, 100000000) == doctest::Approx(3.24 + 0.8));
  CHECK(predict_step_seconds(c, 32, 7, false, 0) == doctest::Approx(5 * 0.01 + 3.2));  // 5 of at most 7
  // Copies beside the compute cost only what they take beyond it.
  c.copies_overlap = true;
  CHECK(predict_step_seconds(c, 32, 8, false, 100000000) == doctest::Approx(3.24));
  CHECK(predict_step_seconds(c, 32, 8, false, 1000000000) == doctest::Approx(8.0));
  c.copies_overlap = false;
  c.copy_bytes_per_second = 0;
  CHECK(std::isinf(predict_step_seconds(c, 32, 8, false, 1)));

  // A large fixed cost per micro-batch (a GPU at micro-batch 1): recomputing beats 32 micro-batches.
  c.micro_batch_seconds = 1.0;
  c.sample_seconds = 0.01;
  c.forward_fraction = 1.0 / 3;
  std::vector<StrategyCandidate> cs = {
      candidate(Mechanism::kNone, 1, 32, predict_step_seconds(c, 32, 1, false, 0)),
      candidate(Mechanism::kCheckpoint, 32, 32, predict_step_seconds(c, 32, 32, true, 0))};
  CHECK(cs[0].seconds == doctest::Approx(32.32));
  CHECK(cheapest_candidate(cs) == 1);
  // Ties go to the earlier (simpler) one; a candidate that does not fit is never chosen.
  cs[1].seconds = cs[0].seconds;
  CHECK(cheapest_candidate(cs) == 0);
  cs[0].micro_batch = 0;
  CHECK(cheapest_candidate(cs) == 1);
  cs[1].micro_batch = 0;
  CHECK(cheapest_candidate(cs) == -1);
  // Without predictions (one fits, or the timing failed): the first that fits.
  std::vector<StrategyCandidate> unpredicted = {candidate(Mechanism::kNone, 0, 8, -1),
                                                candidate(Mechanism::kCheckpoint, 4, 8, -1),
                                                candidate(Mechanism::kOffload, 8, 8, -1)};
  CHECK(cheapest_candidate(unpredicted) == 1);
  CHECK(candidate(Mechanism::kOffload, 8, 8, -1).name() == "offload stage");
  CHECK(candidate(Mechanism::kNone, 8, 8, -1).name() == "micro-batch");
}

TEST_CASE("measure_copy_bandwidth: the copy engine's path where the device has one, plain transfers else; nothing kept") {
  for (const char* name : {"reference-sim", "reference"}) {
    CAPTURE(name);
    auto be = make_backend(name);
    REQUIRE_MESSAGE(be.ok(), be.status().to_string());
    CHECK(((*be)->copy_engine() != nullptr) == (std::string(name) == "reference-sim"));
    Allocator& dev = (*be)->allocator();
    const size_t before = dev.current_bytes();
    auto bw = measure_copy_bandwidth(**be, cpu_allocator(), size_t{1} << 20);
    REQUIRE_MESSAGE(bw.ok(), bw.status().to_string());
    CHECK(std::isfinite(*bw));
    CHECK(*bw > 0);
    CHECK(dev.current_bytes() == before);
    // A probe larger than the device's budget fails as the allocation does, not later.
    dev.set_budget_bytes(before + (size_t{1} << 19));
    CHECK(measure_copy_bandwidth(**be, cpu_allocator(), size_t{1} << 20).status().code() ==
          slide::core::StatusCode::kResourceExhausted);
    dev.set_budget_bytes(Allocator::kUnlimited);
  }
}

TEST_CASE("offload_refit_candidate: offload after an out-of-memory step when the plan predicts it cheaper than halving") {
  StrategyPlan plan;
  plan.cost.micro_batch_seconds = 0.05;
  plan.cost.sample_seconds = 0.01;
  plan.cost.copy_bytes_per_second = 1e9;
  plan.cost.copies_overlap = true;
  plan.cost.measured_steps = 4;
  StrategyCandidate plain = candidate(Mechanism::kNone, 8, 32, -1);
  StrategyCandidate off = candidate(Mechanism::kOffload, 16, 32, -1);
  off.offloaded_bytes = 16 * 1000000;  // 1 MB a sample
  plan.candidates = {plain, off};
  // 32 samples in 2 micro-batches of 16 ran out of memory. Halving: 4 x 0.05 + 0.32 = 0.52 s.
  // Offload at 16: 2 x 0.05 + 0.32 = 0.42 s of compute, copies 2 x 2 x 16 MB at 1 GB/s = 0.064 s
  // beside it: 0.42 s. Offload wins.
  CHECK(offload_refit_candidate(plan, 32, 2) == 1);
  // Copies in series and slow: 0.42 + 2 x 2 x 16 MB / 0.1 GB/s = 1.06 s > 0.52 s: halve.
  plan.cost.copies_overlap = false;
  plan.cost.copy_bytes_per_second = 1e8;
  CHECK(offload_refit_candidate(plan, 32, 2) == -1);
  // One sample per micro-batch already: nothing to halve, so offload wins, timed or not.
  CHECK(offload_refit_candidate(plan, 32, 32) == 1);
  StrategyPlan untimed = plan;
  untimed.cost = StepCost{};
  CHECK(offload_refit_candidate(untimed, 32, 32) == 1);
  // The failed micro-batch (4) is below the candidate's 16: offload runs at 4, its bytes scaled.
  plan.cost.copies_overlap = true;
  plan.cost.copy_bytes_per_second = 1e9;
  CHECK(offload_refit_candidate(plan, 32, 8) == 1);  // halving 16 x 0.05 + 0.32 = 1.12 s; offload 0.72 s
  // No fitting offload candidate, no measured time, no bandwidth: -1.
  StrategyPlan none = plan;
  none.candidates = {plain, candidate(Mechanism::kOffload, 0, 32, -1)};
  CHECK(offload_refit_candidate(none, 32, 2) == -1);
  StrategyPlan unmeasured = plan;
  unmeasured.cost.measured_steps = 0;
  CHECK(offload_refit_candidate(unmeasured, 32, 2) == -1);
  StrategyPlan no_bandwidth = plan;
  no_bandwidth.cost.copy_bytes_per_second = 0;
  CHECK(offload_refit_candidate(no_bandwidth, 32, 2) == -1);
  // A checkpoint candidate is never the answer (the fallback is offload only).
  StrategyPlan ck = plan;
  ck.candidates = {plain, candidate(Mechanism::kCheckpoint, 16, 32, -1)};
  CHECK(offload_refit_candidate(ck, 32, 2) == -1);
}

TEST_CASE("offload_refit on the simulated device: a step out of memory without offload is refitted with offload") {
  auto made = make_backend("reference-sim");
  REQUIRE_MESSAGE(made.ok(), made.status().to_string());
  Backend& be = **made;
  // The small CNN (width 8) in segments of 3 layers: the refit's logic whatever the model, and the
  // ThreadSanitizer entry that runs this case for the simulated device's copy thread spends its
  // time on that, not on reference convolutions (ResNet-18 at 48 px took 43 s under TSan here,
  // 2026-11-30).
  auto made_model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 5, 8, 5);
  REQUIRE_MESSAGE(made_model.ok(), made_model.status().to_string());
  auto m = std::move(*made_model);
  REQUIRE(move_to_device(be, *m).ok());
  PlanOptions po;
  po.sample_shape = {3, 128, 128};
  po.classes = 5;
  po.backend = "reference";
  po.momentum = 0;
  auto peak_at = [&](int64_t n) {
    po.micro_batch = n;
    auto p = plan_memory(*m, po);
    REQUIRE_MESSAGE(p.ok(), p.status().to_string());
    return p->peak_bytes;
  };
  // One sample per micro-batch ran out of memory without offload: the budget lies between the
  // planned peaks at micro-batch 1 with offload (block segments) and without, so halving has
  // nothing left and offload is the only way; the refit must take it, and the step then fits.
  const size_t p1 = peak_at(1);
  StrategyCandidate off;
  off.mechanism = Mechanism::kOffload;
  off.segments = "3";
  REQUIRE(apply_strategy(*m, off, cpu_allocator()).ok());
  const size_t p1_offload = peak_at(1);
  unwrap_segments(*m);
  REQUIRE(p1_offload < p1);
  const size_t budget = (p1_offload + p1) / 2;
  MESSAGE("planned peak at micro-batch 1: ", p1, " bytes, with offload ", p1_offload, "; budget ", budget);
  RefitFn refit = offload_refit(be, *m, po, budget, {"3"});
  auto count = refit(4, 4);  // 4 samples in 4 micro-batches of 1
  REQUIRE_MESSAGE(count.ok(), count.status().to_string());
  CHECK(*count == 4);
  int segments = 0;
  for (size_t i = 0; i < m->size(); ++i) segments += dynamic_cast<Segment*>(&m->at(i)) != nullptr ? 1 : 0;
  CHECK(segments > 0);
  // Offload saves little at micro-batch 1 (two segments' activations stay on the device: here 64 KiB
  // of 2.6 MiB at 128 px), so the real steps are held to the budget within 16 KiB (batch norm's
  // small temporaries), under half the gap between the two peaks (33 KiB).
  be.allocator().set_budget_bytes(budget + 16 * 1024);
  po.micro_batch = 1;
  const Status real = probe_step(be, *m, po, 1);
  CHECK_MESSAGE(real.ok(), real.to_string());
  unwrap_segments(*m);
  CHECK(probe_step(be, *m, po, 1).code() == slide::core::StatusCode::kResourceExhausted);  // why it was needed
  be.allocator().set_budget_bytes(Allocator::kUnlimited);
  REQUIRE(apply_strategy(*m, off, cpu_allocator()).ok());  // as the refit left it, for the next call
  // Once per run: a second out-of-memory step is the halving's.
  auto again = refit(4, 4);
  REQUIRE(again.ok());
  CHECK(*again == 0);
  unwrap_segments(*m);
}

TEST_CASE("unwrap_segments gives every layer back to its place") {
  auto m = resnet18();
  const auto before = parameters(*m);
  for (const char* mode : {"stage", "block", "3"}) {
    for (int offload = 0; offload < 2; ++offload) {
      auto made = offload ? offload_activations(*m, mode, cpu_allocator()) : checkpoint_activations(*m, mode);
      REQUIRE_MESSAGE(made.ok(), made.status().to_string());
      CHECK(parameters(*m) == before);  // wrapped: the same names and the same parameters
      CHECK(unwrap_segments(*m) == *made);
      CHECK(parameters(*m) == before);
      for (size_t i = 0; i < m->size(); ++i) CHECK(dynamic_cast<Segment*>(&m->at(i)) == nullptr);
      CHECK(unwrap_segments(*m) == 0u);
    }
  }
  // Both, nested (checkpointed blocks inside offloaded stages): one unwrap takes off both kinds.
  for (const char* modes : {"block+stage", "block+2", "2+3"}) {
    StrategyCandidate both;
    both.mechanism = Mechanism::kCheckpointOffload;
    both.segments = modes;
    auto made = apply_strategy(*m, both, cpu_allocator());
    REQUIRE_MESSAGE(made.ok(), made.status().to_string());
    CHECK(parameters(*m) == before);
    CHECK(unwrap_segments(*m) == *made);
    CHECK(parameters(*m) == before);
    CHECK(unwrap_segments(*m) == 0u);
  }
  // ResNet-18 "block+stage": 8 checkpointed blocks, then stem, 4 stages and head offloaded.
  StrategyCandidate both;
  both.mechanism = Mechanism::kCheckpointOffload;
  both.segments = "block+stage";
  auto made = apply_strategy(*m, both, cpu_allocator());
  REQUIRE(made.ok());
  CHECK(*made == 14u);
  CHECK(unwrap_segments(*m) == 14u);
  // "stage+stage": the checkpointed stages leave no stage to offload; all or nothing.
  both.segments = "stage+stage";
  auto none = apply_strategy(*m, both, cpu_allocator());
  REQUIRE(!none.ok());
  CHECK(none.status().message().find("offload segments 'stage' over the model checkpointed by 'stage'") !=
        std::string::npos);
  CHECK(unwrap_segments(*m) == 0u);
  CHECK(parameters(*m) == before);
  for (const char* bad : {"block", "+stage", "block+", "a+b+c"}) {
    both.segments = bad;
    CHECK(apply_strategy(*m, both, cpu_allocator()).status().code() == slide::core::StatusCode::kInvalidArgument);
  }
  CHECK(mechanism_named("checkpoint+offload") == Mechanism::kCheckpointOffload);
  CHECK(std::string(mechanism_name(Mechanism::kCheckpointOffload)) == "checkpoint+offload");
  CHECK(recomputes(Mechanism::kCheckpointOffload));
  CHECK(offloads(Mechanism::kCheckpointOffload));
  // Wrapping again after an unwrap works as on a fresh model.
  auto again = checkpoint_activations(*m, "stage");
  REQUIRE(again.ok());
  CHECK(*again == 6u);
}

TEST_CASE("memory strategy on the simulated device: ResNet-18, a budget that fits half the micro-batch") {
  auto made = make_backend("reference-sim");
  REQUIRE_MESSAGE(made.ok(), made.status().to_string());
  Backend& be = **made;
  auto m = resnet18();
  REQUIRE(move_to_device(be, *m).ok());
  const auto before = parameters(*m);
  PlanOptions po;
  po.sample_shape = {3, 16, 16};
  po.classes = 5;
  po.backend = "reference";
  po.momentum = 0;  // no optimizer state: none is allocated here
  auto peak_at = [&](int64_t n) {
    po.micro_batch = n;
    auto p = plan_memory(*m, po);
    REQUIRE_MESSAGE(p.ok(), p.status().to_string());
    return p->peak_bytes;
  };
  const size_t p4 = peak_at(4), p8 = peak_at(8);
  StrategyRequest req;
  req.batch = 16;
  req.micro_batch = 8;
  req.budget_bytes = (p4 + p8) / 2;
  auto sp = plan_memory_strategy(be, *m, po, req, cpu_allocator());
  REQUIRE_MESSAGE(sp.ok(), sp.status().to_string());
  MESSAGE(sp->table());
  CHECK(parameters(*m) == before);  // left unwrapped
  for (size_t i = 0; i < m->size(); ++i) CHECK(dynamic_cast<Segment*>(&m->at(i)) == nullptr);
  // micro-batch; checkpoint stage and block; offload stage and block; both, block+stage (a device
  // backend).
  REQUIRE(sp->candidates.size() == 6);
  CHECK(sp->candidates[5].name() == "checkpoint+offload block+stage");
  const StrategyCandidate& plain = sp->candidates[0];
  CHECK(plain.mechanism == Mechanism::kNone);
  CHECK(plain.micro_batch >= 4);
  CHECK(plain.micro_batch < 8);
  int fitting = 0;
  for (const StrategyCandidate& c : sp->candidates) {
    if (!c.fits()) continue;
    ++fitting;
    CHECK(c.peak_bytes <= req.budget_bytes);
    CHECK(c.micro_batches == (req.batch + c.micro_batch - 1) / c.micro_batch);
    CHECK(c.seconds > 0);
    if (offloads(c.mechanism)) CHECK(c.offloaded_bytes > 0);
    if (c.mechanism != Mechanism::kNone) CHECK(c.micro_batch >= plain.micro_batch);  // they save memory
  }
  CHECK(fitting >= 2);
  CHECK(sp->cost.measured_steps == 4);  // two sizes, each a warm-up and a timed step
  CHECK(sp->cost.sample_seconds > 0);
  CHECK(sp->cost.copy_bytes_per_second > 0);
  CHECK(sp->cost.copies_overlap);  // the simulated device's copy thread
  REQUIRE(sp->chosen >= 0);
  const StrategyCandidate& chosen = sp->candidates[static_cast<size_t>(sp->chosen)];
  for (const StrategyCandidate& c : sp->candidates)
    if (c.fits()) CHECK(chosen.seconds <= c.seconds);

  // The chosen strategy's real step fits the budget, up to the planner's rounding: a candidate
  // planned right at the budget may need a few hundred bytes more in the real step (seen: 1.4 KB
  // over 86 MiB for micro-batch 6, small temporaries of batch norm), so 1% of slack. The plans
  // themselves are checked against measured peaks in the planner tests (within 15%).
  REQUIRE(apply_strategy(*m, chosen, cpu_allocator()).ok());
  be.allocator().set_budget_bytes(req.budget_bytes + req.budget_bytes / 100);
  po.micro_batch = chosen.micro_batch;
  const Status real = probe_step(be, *m, po, chosen.micro_batch);
  CHECK_MESSAGE(real.ok(), real.to_string());
  // And the step as asked does not (why a strategy was needed).
  unwrap_segments(*m);
  be.allocator().set_budget_bytes(req.budget_bytes);
  CHECK(probe_step(be, *m, po, req.micro_batch).code() == slide::core::StatusCode::kResourceExhausted);
  be.allocator().set_budget_bytes(Allocator::kUnlimited);

  // Forcing one mechanism plans only it; a budget below every plan chooses nothing.
  StrategyRequest only;
  only = req;
  only.mechanisms = {Mechanism::kCheckpoint};
  only.segment_modes = {"block"};
  auto ck = plan_memory_strategy(be, *m, po, only, cpu_allocator());
  REQUIRE(ck.ok());
  REQUIRE(ck->candidates.size() == 1);
  CHECK(ck->chosen == 0);
  CHECK(ck->cost.measured_steps == 0);  // nothing to weigh
  only.budget_bytes = 1024;
  auto none = plan_memory_strategy(be, *m, po, only, cpu_allocator());
  REQUIRE(none.ok());
  CHECK(none->chosen == -1);
  CHECK(none->table().find("does not fit") != std::string::npos);
}

TEST_SUITE_END();

}  // namespace libtrain_test_memory_strategy
