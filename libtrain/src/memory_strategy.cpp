#include "slide/train/memory_strategy.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "slide/core/log.h"
#include "slide/train/copy_engine.h"
#include "slide/train/activation_checkpoint.h"
#include "slide/train/copy_engine.h"
#include "slide/train/offload.h"

namespace slide::train {

namespace {

using slide::core::StatusCode;

int64_t micro_batches_of(int64_t batch, int64_t micro_batch) { return (batch + micro_batch - 1) / micro_batch; }
// The micro-batch the trainer runs for a step of `batch` split for at most `largest` samples each.
int64_t effective_micro_batch(int64_t batch, int64_t largest) {
  const int64_t k = micro_batches_of(batch, largest);
  return (batch + k - 1) / k;
}

// Unwraps on every path out of a scope.
struct Unwrap {
  Sequential& model;
  ~Unwrap() { unwrap_segments(model); }
};

std::string seconds_text(double s) {
  char buf[32];
  if (s < 0) return "-";
  if (!std::isfinite(s)) return "inf";
  if (s < 1) std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.2f s", s);
  return buf;
}

}  // namespace

const char* mechanism_name(Mechanism m) {
  switch (m) {
    case Mechanism::kNone: return "micro-batch";
    case Mechanism::kCheckpoint: return "checkpoint";
    case Mechanism::kOffload: return "offload";
    case Mechanism::kCheckpointOffload: return "checkpoint+offload";
  }
  return "?";
}

bool recomputes(Mechanism m) { return m == Mechanism::kCheckpoint || m == Mechanism::kCheckpointOffload; }
bool offloads(Mechanism m) { return m == Mechanism::kOffload || m == Mechanism::kCheckpointOffload; }

Result<std::pair<std::string, std::string>> split_combined_segments(const std::string& segments) {
  const size_t plus = segments.find('+');
  if (plus == std::string::npos || plus == 0 || plus + 1 == segments.size() ||
      segments.find('+', plus + 1) != std::string::npos)
    return slide::core::invalid_argument("checkpoint+offload segments '" + segments +
                                         "' are not CHECKPOINT_MODE+OFFLOAD_MODE (e.g. block+stage)");
  return std::make_pair(segments.substr(0, plus), segments.substr(plus + 1));
}

std::string StrategyCandidate::name() const {
  return mechanism == Mechanism::kNone ? std::string(mechanism_name(mechanism))
                                       : std::string(mechanism_name(mechanism)) + " " + segments;
}

double predict_step_seconds(const StepCost& c, int64_t batch, int64_t micro_batch, bool recompute,
                            size_t offloaded_bytes) {
  const auto k = static_cast<double>(micro_batches_of(batch, std::max<int64_t>(1, micro_batch)));
  double t = k * c.micro_batch_seconds + static_cast<double>(batch) * c.sample_seconds;
  if (recompute) t += t * c.forward_fraction;
  if (offloaded_bytes > 0) {
    if (!(c.copy_bytes_per_second > 0)) return std::numeric_limits<double>::infinity();
    const double copies = 2.0 * k * static_cast<double>(offloaded_bytes) / c.copy_bytes_per_second;
    t = c.copies_overlap ? std::max(t, copies) : t + copies;
  }
  return t;
}

int cheapest_candidate(const std::vector<StrategyCandidate>& cs) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(cs.size()); ++i) {
    const StrategyCandidate& c = cs[static_cast<size_t>(i)];
    if (!c.fits()) continue;
    if (best < 0) {
      best = i;
      continue;
    }
    const double b = cs[static_cast<size_t>(best)].seconds;
    if (c.seconds >= 0 && (b < 0 || c.seconds < b)) best = i;
  }
  return best;
}

int offload_refit_candidate(const StrategyPlan& plan, int64_t batch, int64_t micro_count) {
  if (batch < 1 || micro_count < 1) return -1;
  const int64_t micro_now = micro_batches_of(batch, micro_count);  // samples per micro-batch now
  if (micro_now <= 1) {  // nothing left to halve: the first fitting offload candidate, timed or not
    for (int i = 0; i < static_cast<int>(plan.candidates.size()); ++i) {
      const StrategyCandidate& c = plan.candidates[static_cast<size_t>(i)];
      if (c.fits() && c.mechanism == Mechanism::kOffload) return i;
    }
    return -1;
  }
  if (plan.cost.measured_steps <= 0 || !(plan.cost.copy_bytes_per_second > 0)) return -1;
  double halved = std::numeric_limits<double>::infinity();
  if (micro_now > 1) halved = predict_step_seconds(plan.cost, batch, (micro_now + 1) / 2, false, 0);
  int best = -1;
  double best_seconds = halved;
  for (int i = 0; i < static_cast<int>(plan.candidates.size()); ++i) {
    const StrategyCandidate& c = plan.candidates[static_cast<size_t>(i)];
    if (!c.fits() || c.mechanism != Mechanism::kOffload) continue;
    // Offload at the micro-batch that just failed without it, or the plan's (smaller) one.
    const int64_t micro = std::min(c.micro_batch, micro_now);
    const auto per_sample = static_cast<double>(c.offloaded_bytes) / static_cast<double>(c.micro_batch);
    const auto bytes = static_cast<size_t>(per_sample * static_cast<double>(micro));
    const double t = predict_step_seconds(plan.cost, batch, micro, false, bytes);
    if (t < best_seconds) best = i, best_seconds = t;
  }
  return best;
}

Result<double> measure_copy_bandwidth(Backend& be, Allocator& host, size_t bytes) {
  // The path activation offload copies on: the device's copy engine from its host memory (pinned
  // on cuda: 2-3x the bandwidth of the plain uploads from pageable memory), where there is one.
  CopyEngine* engine = be.copy_engine();
  Allocator& from = engine != nullptr && engine->host_allocator() != nullptr ? *engine->host_allocator() : host;
  SLIDE_ASSIGN_OR_RETURN(Tensor h, Tensor::zeros({static_cast<int64_t>(bytes)}, DType::kU8, from, "copy probe (host)"));
  SLIDE_ASSIGN_OR_RETURN(Tensor d, Tensor::empty(h.shape(), DType::kU8, be.allocator(), "copy probe (device)"));
  auto copy = [&](const Tensor& src, Tensor& dst, CopyDirection dir) -> Status {
    if (engine == nullptr) return dir == CopyDirection::kToDevice ? be.upload(src, dst) : be.download(src, dst);
    SLIDE_ASSIGN_OR_RETURN(const uint64_t ticket, engine->start(be, src, dst, dir));
    return engine->wait(ticket);
  };
  double seconds = 0;
  for (int round = 0; round < 2; ++round) {
    SLIDE_RETURN_IF_ERROR(be.synchronize());
    const auto start = std::chrono::steady_clock::now();
    SLIDE_RETURN_IF_ERROR(copy(h, d, CopyDirection::kToDevice));
    SLIDE_RETURN_IF_ERROR(copy(d, h, CopyDirection::kToHost));
    SLIDE_RETURN_IF_ERROR(be.synchronize());
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return 2.0 * static_cast<double>(bytes) / std::max(seconds, 1e-9);
}

Result<StepCost> measure_step_cost(Backend& be, Sequential& model, const PlanOptions& options, int64_t micro_batch,
                                   bool recompute, double offloaded_bytes_per_sample, double copy_bytes_per_second,
                                   bool copies_overlap) {
  if (micro_batch < 1) return slide::core::invalid_argument("step cost: micro-batch " + std::to_string(micro_batch));
  StepCost c;
  c.copy_bytes_per_second = copy_bytes_per_second;
  c.copies_overlap = copies_overlap;
  struct Point {
    double n = 0, base = 0, forward = 0;
  };
  std::vector<Point> points;
  std::vector<int64_t> sizes{micro_batch};
  if (micro_batch >= 2) sizes.push_back(micro_batch / 2);
  for (int64_t n : sizes) {
    SLIDE_RETURN_IF_ERROR(probe_step(be, model, options, n));  // warm-up: primitives, kernel choice
    ProbeTimes t;
    SLIDE_RETURN_IF_ERROR(probe_step(be, model, options, n, &t));
    c.measured_steps += 2;
    // Each way, synchronous: the download in forward, the upload in backward.
    // (Copies beside the compute are counted as hidden in the measured step.)
    const double copy = offloaded_bytes_per_sample > 0 && copy_bytes_per_second > 0 && !copies_overlap
                            ? offloaded_bytes_per_sample * static_cast<double>(n) / copy_bytes_per_second
                            : 0.0;
    Point p;
    p.n = static_cast<double>(n);
    p.forward = std::max(1e-9, t.forward_seconds - copy);
    p.base = std::max(1e-9, t.step_seconds - 2 * copy - (recompute ? p.forward : 0.0));
    points.push_back(p);
  }
  const Point& hi = points[0];
  c.sample_seconds = hi.base / hi.n;
  c.micro_batch_seconds = 0;
  if (points.size() == 2) {
    const Point& lo = points[1];
    const double slope = (hi.base - lo.base) / (hi.n - lo.n);
    const double fixed = hi.base - slope * hi.n;
    // Timing noise can tilt the line past what a step can cost (a negative part): then all of it
    // is per sample.
    if (slope > 0 && fixed >= 0) c.sample_seconds = slope, c.micro_batch_seconds = fixed;
  }
  c.forward_fraction = std::clamp(hi.forward / hi.base, 0.05, 1.0);
  return c;
}

Mechanism mechanism_named(const std::string& name) {
  return name == "checkpoint"           ? Mechanism::kCheckpoint
         : name == "offload"            ? Mechanism::kOffload
         : name == "checkpoint+offload" ? Mechanism::kCheckpointOffload
                                        : Mechanism::kNone;
}

Result<size_t> apply_strategy(Sequential& model, const StrategyCandidate& candidate, Allocator& host) {
  switch (candidate.mechanism) {
    case Mechanism::kNone: return size_t{0};
    case Mechanism::kCheckpoint: return checkpoint_activations(model, candidate.segments);
    case Mechanism::kOffload: return offload_activations(model, candidate.segments, host);
    case Mechanism::kCheckpointOffload: {
      SLIDE_ASSIGN_OR_RETURN(auto modes, split_combined_segments(candidate.segments));
      SLIDE_ASSIGN_OR_RETURN(size_t checkpointed, checkpoint_activations(model, modes.first));
      auto offloaded = offload_activations(model, modes.second, host);
      if (!offloaded.ok()) {
        unwrap_segments(model);  // all or nothing
        return offloaded.status().with_context("offload segments '" + modes.second +
                                               "' over the model checkpointed by '" + modes.first + "'");
      }
      return checkpointed + *offloaded;
    }
  }
  return size_t{0};
}

Result<StrategyPlan> plan_memory_strategy(Backend& be, Sequential& model, const PlanOptions& options,
                                          const StrategyRequest& req, Allocator& host) {
  if (req.batch < 1 || req.micro_batch < 1 || req.micro_batch > req.batch)
    return slide::core::invalid_argument("memory strategy: batch " + std::to_string(req.batch) + ", micro-batch " +
                                         std::to_string(req.micro_batch));
  StrategyPlan out;
  out.batch = req.batch;
  out.requested_micro_batch = req.micro_batch;
  out.budget_bytes = req.budget_bytes;
  const bool device = be.device() != Device::kCpu;
  PlanOptions po = options;
  auto plan_at = [&](int64_t n) -> Result<MemoryPlan> {
    po.micro_batch = n;
    return plan_memory(model, po);
  };
  for (Mechanism m : req.mechanisms) {
    if (offloads(m) && !device) continue;  // host memory already
    const std::vector<std::string> modes = m == Mechanism::kNone                ? std::vector<std::string>{"none"}
                                           : m == Mechanism::kCheckpointOffload ? req.combined_segment_modes
                                                                                : req.segment_modes;
    for (const std::string& mode : modes) {
      StrategyCandidate c;
      c.mechanism = m;
      c.segments = mode;
      size_t saved_wrapped = 0;
      {
        auto wrapped = apply_strategy(model, c, host);
        Unwrap unwrap{model};
        if (!wrapped.ok()) {
          if (wrapped.status().code() == StatusCode::kInvalidArgument) continue;  // nothing to wrap
          return wrapped.status();
        }
        SLIDE_ASSIGN_OR_RETURN(c.micro_batch, largest_planned_micro_batch(model, po, req.budget_bytes, req.micro_batch));
        // The trainer splits a step evenly: k micro-batches of ceil(batch / k).
        if (c.fits()) c.micro_batch = effective_micro_batch(req.batch, c.micro_batch);
        SLIDE_ASSIGN_OR_RETURN(MemoryPlan p, plan_at(std::max<int64_t>(1, c.micro_batch)));
        c.peak_bytes = p.peak_bytes;
        saved_wrapped = p.saved_bytes;
      }
      if (c.fits()) c.micro_batches = micro_batches_of(req.batch, c.micro_batch);
      if (offloads(m) && c.fits()) {
        // What offload takes off the device: the saved bytes without it (checkpointed alone, for
        // the combination) less those with it.
        size_t without = 0;
        if (m == Mechanism::kOffload) {
          SLIDE_ASSIGN_OR_RETURN(MemoryPlan plain, plan_at(c.micro_batch));
          without = plain.saved_bytes;
        } else {
          SLIDE_ASSIGN_OR_RETURN(auto modes, split_combined_segments(mode));
          SLIDE_RETURN_IF_ERROR(checkpoint_activations(model, modes.first).status());
          Unwrap unwrap{model};
          SLIDE_ASSIGN_OR_RETURN(MemoryPlan checkpointed, plan_at(c.micro_batch));
          without = checkpointed.saved_bytes;
        }
        c.offloaded_bytes = without > saved_wrapped ? without - saved_wrapped : 0;
      }
      out.candidates.push_back(std::move(c));
    }
  }
  std::vector<size_t> fitting;
  for (size_t i = 0; i < out.candidates.size(); ++i)
    if (out.candidates[i].fits()) fitting.push_back(i);
  if (fitting.empty()) {
    out.why = "nothing fits the budget, not even a micro-batch of 1";
    return out;
  }
  const StrategyCandidate& first = out.candidates[fitting[0]];
  if (fitting.size() == 1 || (first.mechanism == Mechanism::kNone && first.micro_batch == req.micro_batch)) {
    out.chosen = static_cast<int>(fitting[0]);
    out.why = first.micro_batch == req.micro_batch && first.mechanism == Mechanism::kNone
                  ? "the requested micro-batch fits as it is"
                  : "the only one that fits";
    return out;
  }
  // Several fit: measure the step on the first (the simplest), then predict each.
  const bool offload_fits = std::any_of(fitting.begin(), fitting.end(), [&](size_t i) {
    return offloads(out.candidates[i].mechanism);
  });
  Allocator& dev = be.allocator();
  out.cost.copies_overlap = be.copy_engine() != nullptr && be.copy_engine()->asynchronous();
  if (offload_fits) {
    size_t bytes = size_t{16} << 20;
    if (dev.budget_bytes() != Allocator::kUnlimited)
      bytes = std::min(bytes, (dev.budget_bytes() - std::min(dev.budget_bytes(), dev.current_bytes())) / 2);
    if (bytes >= (size_t{64} << 10)) {
      auto bw = measure_copy_bandwidth(be, host, bytes);
      if (bw.ok()) out.cost.copy_bytes_per_second = *bw;
    }
  }
  Status measured;
  {
    auto wrapped = apply_strategy(model, first, host);
    Unwrap unwrap{model};
    measured = wrapped.status();
    if (measured.ok()) {
      const double per_sample = static_cast<double>(first.offloaded_bytes) / static_cast<double>(first.micro_batch);
      auto cost = measure_step_cost(be, model, po, first.micro_batch, recomputes(first.mechanism), per_sample,
                                    out.cost.copy_bytes_per_second, out.cost.copies_overlap);
      measured = cost.status();
      if (cost.ok()) out.cost = *cost;
    }
  }
  if (!measured.ok()) {
    if (measured.code() != StatusCode::kResourceExhausted) return measured;
    out.chosen = static_cast<int>(fitting[0]);
    out.why = "the simplest that fits (its step could not be timed: " + measured.to_string() + ")";
    return out;
  }
  const double ideal = predict_step_seconds(out.cost, req.batch, req.micro_batch, false, 0);
  for (size_t i : fitting) {
    StrategyCandidate& c = out.candidates[i];
    c.seconds = predict_step_seconds(out.cost, req.batch, c.micro_batch, recomputes(c.mechanism), c.offloaded_bytes);
    c.overhead = ideal > 0 ? c.seconds / ideal - 1 : 0;
  }
  out.chosen = cheapest_candidate(out.candidates);
  out.why = "the least predicted step time of the " + std::to_string(fitting.size()) + " that fit";
  return out;
}

std::string StrategyPlan::table() const {
  std::string s;
  char buf[256];
  std::snprintf(buf, sizeof buf, "memory strategy: a step of %lld samples, micro-batch %lld asked for, budget %s\n",
                static_cast<long long>(batch), static_cast<long long>(requested_micro_batch),
                format_bytes(budget_bytes).c_str());
  s += buf;
  std::snprintf(buf, sizeof buf, "%-18s %11s %13s %12s %12s %9s\n", "strategy", "micro-batch", "micro-batches",
                "peak", "step time", "overhead");
  s += buf;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const StrategyCandidate& c = candidates[i];
    std::string over = "-";
    if (c.seconds >= 0 && std::isfinite(c.seconds)) {
      char o[32];
      std::snprintf(o, sizeof o, "%+.0f%%", c.overhead * 100);
      over = o;
    }
    if (c.fits())
      std::snprintf(buf, sizeof buf, "%-18s %11lld %13lld %12s %12s %9s%s\n", c.name().c_str(),
                    static_cast<long long>(c.micro_batch), static_cast<long long>(c.micro_batches),
                    format_bytes(c.peak_bytes).c_str(), seconds_text(c.seconds).c_str(), over.c_str(),
                    static_cast<int>(i) == chosen ? "  <- chosen" : "");
    else
      std::snprintf(buf, sizeof buf, "%-18s %11s %13s %12s  does not fit (micro-batch 1 plans %s)\n",
                    c.name().c_str(), "-", "-", "-", format_bytes(c.peak_bytes).c_str());
    s += buf;
  }
  s += "chosen: " + (chosen >= 0 ? candidates[static_cast<size_t>(chosen)].name() : std::string("none")) + ", " + why +
       "\n";
  if (cost.measured_steps > 0) {
    std::snprintf(buf, sizeof buf,
                  "time model (%d real steps): %s per micro-batch + %s per sample; forward %.0f%% of a step; "
                  "copies %s%s\n",
                  cost.measured_steps, seconds_text(cost.micro_batch_seconds).c_str(),
                  seconds_text(cost.sample_seconds).c_str(), cost.forward_fraction * 100,
                  cost.copy_bytes_per_second > 0
                      ? (format_bytes(static_cast<size_t>(cost.copy_bytes_per_second)) + "/s").c_str()
                      : "not measured",
                  cost.copies_overlap ? ", beside the compute" : ", synchronous");
    s += buf;
  }
  return s;
}

RefitFn offload_refit(Backend& be, Sequential& model, const PlanOptions& options, size_t budget,
                      const std::vector<std::string>& segment_modes) {
  auto tried = std::make_shared<bool>(false);
  return [&be, &model, options, budget, segment_modes, tried](int64_t micro_count,
                                                              int64_t step_samples) -> Result<int64_t> {
    if (*tried || micro_count < 1 || step_samples < 1) return int64_t{0};
    *tried = true;  // one try per run: later, out of memory halves the micro-batch as before
    const int64_t micro_now = (step_samples + micro_count - 1) / micro_count;
    PlanOptions po = options;
    // What else lives on the device now (a --cache device dataset, ...), as prepare_memory counts it.
    SLIDE_ASSIGN_OR_RETURN(po.other_bytes, live_bytes_beside_state(model, po, be.allocator()));
    StrategyRequest req;
    req.batch = step_samples;
    req.micro_batch = micro_now;
    req.budget_bytes = budget;
    req.mechanisms = {Mechanism::kNone, Mechanism::kOffload};
    req.segment_modes = segment_modes;
    // A plan that cannot be made changes nothing: the step's own recovery goes on as before.
    auto planned = plan_memory_strategy(be, model, po, req, cpu_allocator());
    if (!planned.ok()) {
      slide::core::log_info("out of memory in a step: no offload plan at this micro-batch",
                            {{"micro_batch", micro_now}, {"why", planned.status().to_string()}});
      return int64_t{0};
    }
    const StrategyPlan& sp = *planned;
    const int pick = offload_refit_candidate(sp, step_samples, micro_count);
    if (pick < 0) {
      slide::core::log_info("out of memory in a step: the plan finds halving the micro-batch cheaper than offload",
                            {{"micro_batch", micro_now}});
      return int64_t{0};
    }
    const StrategyCandidate& c = sp.candidates[static_cast<size_t>(pick)];
    SLIDE_ASSIGN_OR_RETURN(size_t segments, apply_strategy(model, c, cpu_allocator()));
    const int64_t micro = std::min(c.micro_batch, micro_now);
    slide::core::log_warn("out of memory in a step: activation offload from now on, which the plan predicts cheaper "
                          "than halving the micro-batch",
                          {{"segments", c.segments}, {"segment_count", static_cast<int64_t>(segments)},
                           {"micro_batch", micro}, {"offloaded_per_micro_batch", format_bytes(c.offloaded_bytes)}});
    return (step_samples + micro - 1) / micro;
  };
}


}  // namespace slide::train
