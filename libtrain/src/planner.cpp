#include "slide/train/planner.h"

#include "running_stats_guard.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <string>

namespace slide::train {

namespace {

using slide::core::invalid_argument;
using slide::core::ok_status;

// Tensors of the plan: address space reserved with MAP_NORESERVE and never written by the
// planning backend, so planning ResNet-50 at a batch of 256 costs no memory. Counts bytes (and
// the peak) like every allocator.
class PlanAllocator final : public Allocator {
 public:
  Device device() const override { return Device::kCpu; }
  Result<void*> allocate(size_t bytes, const std::string& what) override {
    if (bytes == 0) return invalid_argument("allocate " + what + ": zero bytes");
    SLIDE_RETURN_IF_ERROR(reserve(bytes, what));
    void* p = ::mmap(nullptr, round(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      release(bytes);
      return slide::core::failed_precondition("memory plan: cannot reserve " + std::to_string(bytes) +
                                              " bytes of address space for " + what);
    }
    return p;
  }
  void deallocate(void* ptr, size_t bytes) override {
    if (ptr == nullptr) return;
    ::munmap(ptr, round(bytes));
    release(bytes);
  }

 private:
  static size_t round(size_t bytes) {
    static const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    return (bytes + page - 1) / page * page;
  }
};

int64_t pad16(int64_t c) { return (c + 15) / 16 * 16; }

// Bytes of an NCHW activation, or an OIHW weight, in oneDNN's blocked layouts: the blocked
// dimensions (channels; both channel dimensions of a weight) padded to a multiple of 16
// (nChw16c, OIhw16i16o on AVX-512; AVX2's 8-blocks pad less, so this errs high there).
size_t blocked_bytes(const Tensor& t) {
  if (t.rank() != 4) return t.bytes();
  const Shape& s = t.shape();
  return static_cast<size_t>(s[0] * pad16(s[1]) * s[2] * s[3]) * dtype_size(t.dtype());
}
size_t blocked_weight_bytes(const Tensor& w) {
  const Shape& s = w.shape();
  return static_cast<size_t>(pad16(s[0]) * pad16(s[1]) * s[2] * s[3]) * dtype_size(w.dtype());
}

// Bytes of the scratch copy the cpu backend makes of activation t around a convolution: none
// when C is a multiple of 8 (the tensor is already in the blocked layout the convolution reads
// and writes: onednn_backend.cpp) or under 8 (oneDNN reads a 3-channel image plain), else a
// blocked copy.
size_t conv_activation_scratch(const Tensor& t) {
  const int64_t c = t.rank() == 4 ? t.dim(1) : 0;
  return c % 8 == 0 || c < 8 ? 0 : blocked_bytes(t);
}

// A backend that computes nothing and, with `cpu_scratch`, holds the scratch the cpu backend
// allocates from its allocator for the length of each op (onednn_backend.cpp: reorders of
// weights and of activations not in a blocked layout, the dw/db scratch of the backward-weights
// ops, batch norm's variance and gradient scratch, max pooling's recomputed output and workspace);
// with a `workspace` backend, each convolution pass also holds that backend's workspace for it
// (conv_workspace_bytes).
class PlanBackend final : public Backend {
 public:
  PlanBackend(Allocator& alloc, bool cpu_scratch, Backend* workspace)
      : alloc_(alloc), cpu_(cpu_scratch), workspace_(workspace) {}
  // Why the planned micro-batch cannot run on the workspace backend ("": it can).
  const std::string& unrunnable() const { return unrunnable_; }
  std::string name() const override { return "plan"; }
  Device device() const override { return Device::kCpu; }
  Allocator& allocator() override { return alloc_; }
  // No bytes move in a plan (activation offload's copies): its tensors are never-touched
  // reservations, and reading them would only cost time.
  Status upload(const Tensor&, Tensor&) override { return ok_status(); }
  Status download(const Tensor&, Tensor&) override { return ok_status(); }

  Status conv2d_forward(const Tensor& x, const Tensor& w, const Tensor&, Conv2dParams p, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(follow(x, y));
    SLIDE_ASSIGN_OR_RETURN(const size_t ws, device_workspace(ConvPass::kForward, x, w, p, y));
    return hold({conv_activation_scratch(x), blocked_weight_bytes(w), conv_activation_scratch(y)}, ws);
  }
  Status conv2d_backward_data(const Tensor& dy, const Tensor& w, Conv2dParams p, Tensor& dx) override {
    SLIDE_RETURN_IF_ERROR(follow(dy, dx));
    SLIDE_ASSIGN_OR_RETURN(const size_t ws, device_workspace(ConvPass::kBackwardData, dx, w, p, dy));
    return hold({conv_activation_scratch(dy), blocked_weight_bytes(w), conv_activation_scratch(dx)}, ws);
  }
  Status conv2d_backward_weights(const Tensor& x, const Tensor& dy, Conv2dParams p, Tensor& dw, Tensor& db) override {
    SLIDE_ASSIGN_OR_RETURN(const size_t ws, device_workspace(ConvPass::kBackwardWeights, x, dw, p, dy));
    return hold({dw.bytes(), db.bytes(), conv_activation_scratch(x), conv_activation_scratch(dy),
                 blocked_weight_bytes(dw)},
                ws);
  }
  Status batch_norm_forward_training(const Tensor& x, const Tensor&, const Tensor&, double, double, Tensor&, Tensor&,
                                     Tensor& y, Tensor&, Tensor&) override {
    SLIDE_RETURN_IF_ERROR(follow(x, y));
    return hold({static_cast<size_t>(x.dim(1)) * dtype_size(x.dtype())}, device_bn_scratch(false, x));
  }
  Status batch_norm_forward_inference(const Tensor& x, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      double, Tensor& y) override {
    return follow(x, y);
  }
  Status batch_norm_backward(const Tensor& x, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor& dx,
                             Tensor&, Tensor&) override {
    SLIDE_RETURN_IF_ERROR(follow(x, dx));
    const size_t c = static_cast<size_t>(x.dim(1)) * dtype_size(x.dtype());
    return hold({c, c, c}, device_bn_scratch(true, x));
  }
  Status relu_forward(const Tensor& x, Tensor& y) override { return follow(x, y); }
  Status relu_backward(const Tensor& y, const Tensor&, Tensor& dx) override { return follow(y, dx); }
  Status add(const Tensor& a, const Tensor&, Tensor& y) override { return follow(a, y); }
  Status mul(const Tensor&, const Tensor&, Tensor&) override { return ok_status(); }
  // Max pooling runs in the layout its input already has (blocked when C is a multiple of 8,
  // else plain): no reorders. Backward recomputes the forward into scratch (y) with its
  // workspace (u8 per output, the kernel being under 256 taps).
  Status max_pool2d_forward(const Tensor& x, Pool2dParams, Tensor& y) override { return follow(x, y); }
  Status max_pool2d_backward(const Tensor& x, const Tensor& dy, Pool2dParams, Tensor& dx) override {
    SLIDE_RETURN_IF_ERROR(follow(x, dx));
    return hold({static_cast<size_t>(dy.numel()), dy.bytes()});
  }
  Status global_avg_pool_forward(const Tensor&, Tensor&) override { return ok_status(); }
  Status global_avg_pool_backward(const Tensor&, Tensor&) override { return ok_status(); }
  Status linear_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&) override { return ok_status(); }
  Status linear_backward_data(const Tensor&, const Tensor&, Tensor&) override { return ok_status(); }
  Status linear_backward_weights(const Tensor&, const Tensor&, Tensor& dw, Tensor& db) override {
    return hold({dw.bytes(), db.bytes()});
  }
  Status softmax_cross_entropy_forward(const Tensor&, const Tensor&, const Tensor&, double, Tensor&,
                                       double* loss) override {
    *loss = 0;
    return ok_status();
  }
  Status softmax_cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, double, Tensor&) override {
    return ok_status();
  }
  Status sgd_update(Tensor&, const Tensor&, Tensor&, double, double, double, double, bool, bool) override {
    return ok_status();
  }
  Status adamw_update(Tensor&, const Tensor&, Tensor&, Tensor&, double, double, double, double, double,
                      int64_t) override {
    return ok_status();
  }
  // Attention MIL's ops: no scratch on any backend.
  Status tanh_forward(const Tensor&, Tensor&) override { return ok_status(); }
  Status tanh_backward(const Tensor&, const Tensor&, Tensor&) override { return ok_status(); }
  Status sigmoid_forward(const Tensor&, Tensor&) override { return ok_status(); }
  Status sigmoid_backward(const Tensor&, const Tensor&, Tensor&) override { return ok_status(); }
  Status softmax_forward(const Tensor&, Tensor&) override { return ok_status(); }
  Status softmax_backward(const Tensor&, const Tensor&, Tensor&) override { return ok_status(); }
  Status matmul(const Tensor&, bool, const Tensor&, bool, Tensor&) override { return ok_status(); }
  // Half-precision activations' casts (enable_half_activations): the copies are the callers'.
  Status cast(const Tensor&, Tensor&) override { return ok_status(); }
  // Channels last (enable_half_activations with kNhwc): the relaid-out copies, labelled as the
  // backend labels them, so that the workspace backend is asked about the layout it will run.
  Result<Tensor> to_channels_last(const Tensor& x) override {
    if (x.layout() == Layout::kNhwc) return x;
    SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty(x.shape(), x.dtype(), alloc_, "channels-last copy"));
    SLIDE_RETURN_IF_ERROR(y.set_layout(Layout::kNhwc));
    return y;
  }
  Result<Tensor> to_plain(const Tensor& x) override {
    if (x.layout() == Layout::kPlain) return x;
    return Tensor::empty(x.shape(), x.dtype(), alloc_, "plain copy");
  }

 private:
  // An image output takes its image input's channels-last label, as the backends write it
  // (backend.h, "Channels last in training"); the blocked layouts are the planner's own model.
  static Status follow(const Tensor& in, Tensor& out) {
    return in.layout() == Layout::kNhwc ? out.set_layout(Layout::kNhwc) : ok_status();
  }
  // A convolution the backend refuses as kResourceExhausted (a tensor past cuDNN's descriptor
  // limit) makes the micro-batch unrunnable, not the plan an error: plan_memory then reports an
  // infinite peak, which no budget fits.
  Result<size_t> device_workspace(ConvPass pass, const Tensor& x, const Tensor& w, Conv2dParams p, const Tensor& y) {
    if (workspace_ == nullptr) return size_t{0};
    auto bytes = workspace_->conv_workspace_bytes(pass, x, w, p, y);
    if (!bytes.ok() && bytes.status().code() == slide::core::StatusCode::kResourceExhausted) {
      if (unrunnable_.empty()) unrunnable_ = bytes.status().message();
      return size_t{0};
    }
    return bytes;
  }
  // Batch norm's device scratch (Backend::batch_norm_scratch_bytes: cuda's partial sums).
  size_t device_bn_scratch(bool backward, const Tensor& x) {
    return workspace_ == nullptr ? 0 : workspace_->batch_norm_scratch_bytes(backward, x);
  }
  // Takes the scratch blocks (the cpu backend's, when planning for it) and a device workspace
  // together, then gives them back: only the peak sees them.
  Status hold(std::initializer_list<size_t> cpu_sizes, size_t device_workspace = 0) {
    std::vector<Tensor> held;
    auto take = [&](size_t b, const char* what) -> Status {
      if (b == 0) return ok_status();
      SLIDE_ASSIGN_OR_RETURN(Tensor t, Tensor::empty({static_cast<int64_t>(b)}, DType::kU8, alloc_, what));
      held.push_back(std::move(t));
      return ok_status();
    };
    if (cpu_)
      for (size_t b : cpu_sizes) SLIDE_RETURN_IF_ERROR(take(b, "scratch"));
    return take(device_workspace, "device workspace");
  }

  Allocator& alloc_;
  bool cpu_;
  Backend* workspace_;
  std::string unrunnable_;  // why this micro-batch cannot run on the backend ("": it can)
};

size_t param_bytes(const std::vector<Parameter*>& ps) {
  size_t n = 0;
  for (auto* p : ps) n += p->value.bytes();
  return n;
}

std::string shape_text(const Shape& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "x" : "") + std::to_string(s[i]);
  return out;
}


}  // namespace

std::string format_bytes(size_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof buf, "%zu B", bytes);
  return buf;
}

std::string MemoryPlan::table() const {
  std::string out;
  char line[256];
  auto mib = [](size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  std::snprintf(line, sizeof line, "memory plan for micro-batch %ld (MiB)\n", static_cast<long>(micro_batch));
  out += line;
  std::snprintf(line, sizeof line, "%-10s %-18s %10s %10s %10s %10s %12s %12s\n", "layer", "output", "params",
                "grads", "optimizer", "saved", "fwd peak", "bwd peak");
  out += line;
  for (const auto& l : layers) {
    std::snprintf(line, sizeof line, "%-10s %-18s %10.2f %10.2f %10.2f %10.2f %12.2f %12.2f\n", l.name.c_str(),
                  shape_text(l.output_shape).c_str(), mib(l.parameter_bytes), mib(l.gradient_bytes),
                  mib(l.optimizer_bytes), mib(l.saved_bytes), mib(l.forward_peak_bytes), mib(l.backward_peak_bytes));
    out += line;
  }
  std::snprintf(line, sizeof line,
                "total: parameters %.2f, gradients %.2f, optimizer %.2f, inputs %.2f, saved activations %.2f, "
                "other %.2f\npeak: %.2f MiB (%zu bytes) at %s\n",
                mib(parameter_bytes), mib(gradient_bytes), mib(optimizer_bytes), mib(input_bytes), mib(saved_bytes),
                mib(other_bytes), mib(peak_bytes), peak_bytes, peak_at.c_str());
  out += line;
  return out;
}

Result<MemoryPlan> plan_memory(Sequential& model, const PlanOptions& o) {
  if (o.micro_batch < 1) return invalid_argument("memory plan: micro-batch " + std::to_string(o.micro_batch));
  if (o.sample_shape.empty()) return invalid_argument("memory plan: no sample shape");
  size_t state_per_param = 0;
  if (o.optimizer == "sgd") state_per_param = o.momentum > 0 ? 1 : 0;
  else if (o.optimizer == "adamw") state_per_param = 2;
  else return invalid_argument("memory plan: optimizer '" + o.optimizer + "' is not one of sgd, adamw");

  MemoryPlan plan;
  plan.micro_batch = o.micro_batch;
  plan.other_bytes = o.other_bytes;
  PlanAllocator pa;
  PlanBackend pb(pa, o.backend == "cpu", o.workspace_backend);
  struct Released {
    Sequential& m;
    ~Released() { m.release(); }
  } released{model};
  model.set_input_gradient(false);  // as train_epoch does: no gradient for the image batch

  // The trainer's batch (and, with prefetch, the next one being decoded meanwhile).
  Shape in_shape{o.micro_batch};
  in_shape.insert(in_shape.end(), o.sample_shape.begin(), o.sample_shape.end());
  SLIDE_ASSIGN_OR_RETURN(Tensor images, Tensor::empty(in_shape, o.dtype, pa, "image batch"));
  SLIDE_ASSIGN_OR_RETURN(Tensor labels, Tensor::empty({o.micro_batch}, DType::kI32, pa, "label batch"));
  Tensor next_images, next_labels;
  if (o.prefetch) {
    SLIDE_ASSIGN_OR_RETURN(next_images, Tensor::empty(in_shape, o.dtype, pa, "next image batch"));
    SLIDE_ASSIGN_OR_RETURN(next_labels, Tensor::empty({o.micro_batch}, DType::kI32, pa, "next label batch"));
  }
  plan.input_bytes = images.bytes() + labels.bytes();
  const size_t inputs_live = pa.current_bytes();

  size_t step_peak = 0;
  auto note_peak = [&](const std::string& where) {
    if (pa.peak_bytes() > step_peak) step_peak = pa.peak_bytes(), plan.peak_at = where;
    return pa.peak_bytes();
  };
  Tensor h = images;
  size_t kept_before = 0;
  for (size_t i = 0; i < model.size(); ++i) {
    LayerPlan lp;
    lp.name = model.name_at(i);
    std::vector<Parameter*> ps;
    std::vector<Buffer*> bs;
    model.at(i).collect(lp.name, &ps, &bs);
    lp.gradient_bytes = param_bytes(ps);
    lp.parameter_bytes = lp.gradient_bytes;
    for (auto* b : bs) lp.parameter_bytes += b->value.bytes();
    lp.optimizer_bytes = lp.gradient_bytes * state_per_param;
    pa.reset_peak();
    auto r = model.at(i).forward(pb, h, true);
    if (!r.ok()) return r.status().with_context("memory plan: layer " + lp.name);
    lp.forward_peak_bytes = note_peak("forward " + lp.name);
    h = std::move(*r);
    lp.output_shape = h.shape();
    // What stays live beside the inputs and this layer's output: the activations kept so far.
    const size_t kept = pa.current_bytes() - inputs_live - h.bytes();
    lp.saved_bytes = kept > kept_before ? kept - kept_before : 0;
    kept_before = kept;
    plan.parameter_bytes += lp.parameter_bytes;
    plan.gradient_bytes += lp.gradient_bytes;
    plan.optimizer_bytes += lp.optimizer_bytes;
    plan.layers.push_back(std::move(lp));
  }
  plan.saved_bytes = kept_before;
  // The loss as the trainer runs it: probabilities kept with the labels, then the logits' gradient.
  pa.reset_peak();
  SLIDE_ASSIGN_OR_RETURN(Tensor probs, Tensor::empty(h.shape(), o.dtype, pa, "probabilities"));
  h = Tensor();
  SLIDE_ASSIGN_OR_RETURN(Tensor dlogits, Tensor::empty(probs.shape(), o.dtype, pa, "logit gradient"));
  note_peak("loss");
  Tensor g = dlogits;
  for (size_t i = model.size(); i-- > 0;) {
    pa.reset_peak();
    auto r = model.at(i).backward(pb, g);
    if (!r.ok()) return r.status().with_context("memory plan: layer " + model.name_at(i) + " backward");
    plan.layers[i].backward_peak_bytes = note_peak("backward " + model.name_at(i));
    g = std::move(*r);
    model.at(i).release();
  }
  const size_t fixed = plan.parameter_bytes + plan.gradient_bytes + plan.optimizer_bytes + plan.other_bytes;
  for (auto& lp : plan.layers) lp.forward_peak_bytes += fixed, lp.backward_peak_bytes += fixed;
  plan.peak_bytes = fixed + step_peak;
  if (!pb.unrunnable().empty()) {
    plan.peak_bytes = std::numeric_limits<size_t>::max();
    plan.peak_at = "nowhere: " + pb.unrunnable();
  }
  return plan;
}

Result<size_t> live_bytes_beside_state(Sequential& model, const PlanOptions& options, const Allocator& alloc) {
  SLIDE_ASSIGN_OR_RETURN(MemoryPlan p, plan_memory(model, options));
  const size_t state = p.parameter_bytes + p.gradient_bytes + p.optimizer_bytes;
  const size_t live = alloc.current_bytes();
  return live > state ? live - state : 0;
}

Result<int64_t> largest_planned_micro_batch(Sequential& model, PlanOptions options, size_t budget_bytes,
                                            int64_t limit) {
  auto fits = [&](int64_t n) -> Result<bool> {
    options.micro_batch = n;
    SLIDE_ASSIGN_OR_RETURN(MemoryPlan p, plan_memory(model, options));
    return p.peak_bytes <= budget_bytes;
  };
  SLIDE_ASSIGN_OR_RETURN(bool one, fits(1));
  if (!one) return int64_t{0};
  int64_t lo = 1, hi = limit + 1;  // lo fits; hi does not (or is past the limit)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    SLIDE_ASSIGN_OR_RETURN(bool ok, fits(mid));
    (ok ? lo : hi) = mid;
  }
  return lo;
}

Status probe_step(Backend& be, Sequential& model, const PlanOptions& o, int64_t n, ProbeTimes* times) {
  if (n < 1) return invalid_argument("probe step: micro-batch " + std::to_string(n));
  // Batch norm statistics are swapped for copies around the probe and put back after it.
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  model.collect("", &params, &buffers);
  detail::RunningStatsGuard guard(buffers);
  struct Cleanup {
    Sequential& m;
    std::vector<Parameter*>& ps;
    ~Cleanup() {
      m.release();
      for (auto* p : ps) (void)p->grad.set_zero();  // a destructor: a device error shows in the next op
    }
  } cleanup{model, params};
  SLIDE_RETURN_IF_ERROR(guard.swap_in_copies("running statistic (probe)"));
  Allocator& a = be.allocator();
  Shape in_shape{n};
  in_shape.insert(in_shape.end(), o.sample_shape.begin(), o.sample_shape.end());
  SLIDE_ASSIGN_OR_RETURN(Tensor images, Tensor::zeros(in_shape, o.dtype, a, "image batch (probe)"));
  SLIDE_ASSIGN_OR_RETURN(Tensor labels, Tensor::zeros({n}, DType::kI32, a, "label batch (probe)"));
  Tensor next_images, next_labels;
  if (o.prefetch) {
    SLIDE_ASSIGN_OR_RETURN(next_images, Tensor::empty(in_shape, o.dtype, a, "next image batch (probe)"));
    SLIDE_ASSIGN_OR_RETURN(next_labels, Tensor::empty({n}, DType::kI32, a, "next label batch (probe)"));
  }
  using Clock = std::chrono::steady_clock;
  if (times != nullptr) SLIDE_RETURN_IF_ERROR(be.synchronize());
  const auto start = Clock::now();
  SLIDE_ASSIGN_OR_RETURN(Tensor logits, model.forward(be, images, true));
  if (times != nullptr) {
    SLIDE_RETURN_IF_ERROR(be.synchronize());
    times->forward_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  SLIDE_ASSIGN_OR_RETURN(Tensor probs, Tensor::empty(logits.shape(), logits.dtype(), a, "probabilities (probe)"));
  double loss = 0;
  SLIDE_RETURN_IF_ERROR(be.softmax_cross_entropy_forward(logits, labels, Tensor(), 0.0, probs, &loss));
  logits = Tensor();
  SLIDE_ASSIGN_OR_RETURN(Tensor dlogits, Tensor::empty(probs.shape(), probs.dtype(), a, "logit gradient (probe)"));
  SLIDE_RETURN_IF_ERROR(be.softmax_cross_entropy_backward(probs, labels, Tensor(), 0.0, dlogits));
  SLIDE_RETURN_IF_ERROR(model.backward(be, dlogits).status());
  if (times != nullptr) {
    SLIDE_RETURN_IF_ERROR(be.synchronize());
    times->step_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return ok_status();
}

Result<AutoBatch> auto_micro_batch(Backend& be, Sequential& model, const PlanOptions& options, size_t budget_bytes,
                                   int64_t limit, const std::function<void(int64_t, bool)>& log) {
  AutoBatch out;
  SLIDE_ASSIGN_OR_RETURN(out.planned, largest_planned_micro_batch(model, options, budget_bytes, limit));
  {
    PlanOptions o = options;
    o.micro_batch = std::max<int64_t>(1, out.planned);
    SLIDE_ASSIGN_OR_RETURN(MemoryPlan p, plan_memory(model, o));
    out.planned_peak_bytes = p.peak_bytes;
  }
  auto fits = [&](int64_t n) -> Result<bool> {
    ++out.probes;
    Status s = probe_step(be, model, options, n);
    if (log) log(n, s.ok());
    if (s.ok()) return true;
    if (s.code() == slide::core::StatusCode::kResourceExhausted) return false;
    return s;
  };
  // Bracket the boundary from the planned size with real steps (growing strides), then bisect.
  int64_t lo = 0, hi = limit + 1;  // lo fits (0: none known); hi does not
  int64_t n = std::clamp<int64_t>(out.planned, 1, limit);
  SLIDE_ASSIGN_OR_RETURN(bool ok, fits(n));
  if (ok) {
    lo = n;
    for (int64_t stride = 1; lo < limit; stride *= 2) {
      const int64_t m = std::min(limit, lo + stride);
      SLIDE_ASSIGN_OR_RETURN(bool up, fits(m));
      if (!up) {
        hi = m;
        break;
      }
      lo = m;
    }
  } else {
    hi = n;
    for (int64_t stride = 1; hi > 1; stride *= 2) {
      const int64_t m = std::max<int64_t>(1, hi - stride);
      SLIDE_ASSIGN_OR_RETURN(bool down, fits(m));
      if (down) {
        lo = m;
        break;
      }
      hi = m;
    }
  }
  if (lo == 0)
    return slide::core::resource_exhausted("--batch-size auto: not even a micro-batch of 1 fits the memory budget of " +
                                           format_bytes(budget_bytes));
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    SLIDE_ASSIGN_OR_RETURN(bool mid_ok, fits(mid));
    (mid_ok ? lo : hi) = mid;
  }
  out.micro_batch = lo;
  return out;
}

}  // namespace slide::train
