// Memory benchmark (issue 6): for ResNet-18 and ResNet-50 training at 224 px, with and without
// activation checkpointing (--checkpoint-activations stage: the stem, ResNet's four stages and the
// head, close to Chen et al.'s sqrt(n) segments), the measured peak of live tensors and the
// images/s of real SGD steps at one batch size (the fastest of the timed steps), the planner's
// peak beside it, and the largest micro-batch that the planner fits in a 4 GiB budget each way;
// and for activation offload (issue 13, stage segments) and for both (blocks checkpointed, their
// inputs offloaded by stage) the planned peak and largest micro-batch (planned only: offload moves
// activations off a device; on a host backend there is nowhere to move them).
// With --backend cuda (or reference-sim, the simulated device) the model, optimizer state and batch
// live on the device, the peaks are the device allocator's, and offload and both are measured too:
// their peak and time beside the plain run's (vDNN's figure: 18% more time).
// bench/memory_bench.sh prints the peers' figures beside these.
//
// usage: memory_bench [--batch 16] [--steps 3] [--size 224] [--budget 4G] [--models resnet18,resnet50]
//                     [--backend cpu|cuda|reference|reference-sim] [--precision fp32|tf32|bf16|fp16]
// oneDNN's thread count follows OMP_NUM_THREADS.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend_options.h"
#include "slide/train/activation_checkpoint.h"
#include "slide/train/offload.h"
#include "slide/train/optimizer.h"
#include "slide/train/planner.h"

using namespace slide::train;

namespace {

struct Figures {
  double peak_mib = 0, planned_mib = 0, images_per_s = 0;
  double offloaded_mib = 0;  // what the offload segments held in host memory at the end of forward
  int64_t largest_batch = 0;
};

int run(const std::string& model, const std::string& mode, int64_t batch, int64_t size, int steps, size_t budget,
        Backend& be, Figures* out) {
  const int depth = model == "resnet50" ? 50 : model == "resnet34" ? 34 : 18;
  auto net = make_resnet(cpu_allocator(), DType::kF32, depth, 3, 0);
  if (!net.ok()) return std::fprintf(stderr, "%s\n", net.status().to_string().c_str()), 1;
  (*net)->set_input_gradient(false);  // as the trainer does: the input is data
  const bool on_device = be.device() != Device::kCpu;
  // "offload": --offload-activations stage; "both": --checkpoint-activations block
  // --offload-activations stage. Planned only (the copies need a device; the planner counts what
  // stays on it).
  const bool offload = mode == "offload" || mode == "both";
  if (mode == "both") {
    auto made = checkpoint_activations(**net, "block");
    if (made.ok()) made = offload_activations(**net, "stage", cpu_allocator());
    if (!made.ok()) return std::fprintf(stderr, "%s\n", made.status().to_string().c_str()), 1;
  } else if (mode != "none") {
    auto made = offload ? offload_activations(**net, "stage", cpu_allocator()) : checkpoint_activations(**net, mode);
    if (!made.ok()) return std::fprintf(stderr, "%s\n", made.status().to_string().c_str()), 1;
  }
  // On a device backend the model, optimizer state and batch live there, as in slide-train; the
  // offloaded activations go to the copy engine's (pinned) host memory.
  if (Status s = move_to_device(be, **net); !s.ok()) return std::fprintf(stderr, "%s\n", s.to_string().c_str()), 1;
  // Activations as slide-train's --activations auto and --channels-last auto (half precision,
  // channels last, on cuda under fp16 / bf16).
  if (const DType act = be.activation_dtype(); act != DType::kF32)
    if (Status s = enable_half_activations(
            **net, act, slide::apps::channels_last_activations("auto", act, be) ? Layout::kNhwc : Layout::kPlain);
        !s.ok())
      return std::fprintf(stderr, "%s\n", s.to_string().c_str()), 1;
  Allocator& alloc = be.allocator();
  std::vector<Parameter*> params;
  (*net)->collect("", &params, nullptr);
  auto opt = Optimizer::make(OptimizerConfig{}, params, alloc);
  if (!opt.ok()) return std::fprintf(stderr, "%s\n", opt.status().to_string().c_str()), 1;
  PlanOptions po;
  po.micro_batch = batch;
  po.sample_shape = {3, size, size};
  po.classes = 3;
  po.prefetch = false;  // the steps below keep one batch, as train_step does
  po.backend = be.name();
  po.workspace_backend = &be;  // cuDNN's convolution workspaces on cuda
  auto plan = plan_memory(**net, po);
  if (!plan.ok()) return std::fprintf(stderr, "%s\n", plan.status().to_string().c_str()), 1;
  const size_t state = plan->parameter_bytes + plan->gradient_bytes + plan->optimizer_bytes;
  out->planned_mib = static_cast<double>(plan->peak_bytes) / (1 << 20);
  po.prefetch = true;  // the trainer's step, for the budget
  auto largest = largest_planned_micro_batch(**net, po, budget, 4096);
  if (!largest.ok()) return std::fprintf(stderr, "%s\n", largest.status().to_string().c_str()), 1;
  out->largest_batch = *largest;
  if (offload && !on_device) return 0;

  Tensor hx = *Tensor::empty({batch, 3, size, size}, DType::kF32, cpu_allocator());
  Tensor hy = *Tensor::empty({batch}, DType::kI32, cpu_allocator());
  std::mt19937_64 rng(0);
  std::normal_distribution<float> n01;
  for (int64_t i = 0; i < hx.numel(); ++i) hx.data<float>()[i] = n01(rng);
  for (int64_t i = 0; i < batch; ++i) hy.data<int32_t>()[i] = static_cast<int32_t>(i % 3);
  Tensor x = hx, y = hy;
  if (on_device) {  // the upload can run out of device memory: say so, as every other step does
    auto dx = to_device(be, hx, "images");
    auto dy = dx.ok() ? to_device(be, hy, "labels") : Result<Tensor>(dx.status());
    if (!dy.ok()) return std::fprintf(stderr, "%s\n", dy.status().to_string().c_str()), 1;
    x = *dx, y = *dy, hx = Tensor(), hy = Tensor();
  }
  const size_t before = alloc.current_bytes() - x.bytes() - y.bytes();
  alloc.reset_peak();
  std::vector<double> times;
  for (int s = 0; s <= steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!(*opt)->zero_grad().ok()) return 1;
    auto logits = (*net)->forward(be, x, true);
    if (offload && logits.ok()) {  // bytes copied out (and, in backward, back) this step
      size_t moved = 0;
      for (size_t i = 0; i < (*net)->size(); ++i)
        if (const auto* seg = dynamic_cast<const OffloadedSegment*>(&(*net)->at(i))) moved += seg->offloaded_bytes();
      out->offloaded_mib = static_cast<double>(moved) / (1 << 20);
    }
    if (!logits.ok()) return std::fprintf(stderr, "%s\n", logits.status().to_string().c_str()), 1;
    Tensor probs = *Tensor::empty(logits->shape(), DType::kF32, alloc);
    double loss = 0;
    if (!be.softmax_cross_entropy_forward(*logits, y, Tensor(), 0, probs, &loss).ok()) return 1;
    *logits = Tensor();
    Tensor dlogits = *Tensor::empty(probs.shape(), DType::kF32, alloc);
    if (!be.softmax_cross_entropy_backward(probs, y, Tensor(), 0, dlogits).ok()) return 1;
    if (!(*net)->backward(be, dlogits).ok() || !(*opt)->step(be, 0.01).ok() || !be.synchronize().ok()) return 1;
    if (s > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  // The fastest timed step: the machine may be shared, and other work only ever slows a step.
  out->images_per_s = static_cast<double>(batch) / *std::min_element(times.begin(), times.end());
  out->peak_mib = static_cast<double>(alloc.peak_bytes() - before + state) / (1 << 20);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 16, size = 224;
  int steps = 3;
  std::string models = "resnet18,resnet50", budget_text = "4G", backend = "cpu", precision = "fp32";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--size")) size = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--models")) models = argv[i + 1];
    else if (!std::strcmp(argv[i], "--budget")) budget_text = argv[i + 1];
    else if (!std::strcmp(argv[i], "--backend")) backend = argv[i + 1];
    else if (!std::strcmp(argv[i], "--precision")) precision = argv[i + 1];
  }
  auto budget = parse_bytes(budget_text);
  if (!budget.ok()) return std::fprintf(stderr, "--budget %s: %s\n", budget_text.c_str(), budget.status().to_string().c_str()), 2;
  auto be = slide::apps::open_backend(backend, -1, precision);  // slide-train's rule and messages
  if (!be.ok()) return std::fprintf(stderr, "%s\n", be.status().to_string().c_str()), 2;
  const bool on_device = (*be)->device() != Device::kCpu;
  std::printf("backend %s (%s), precision %s\n", backend.c_str(), device_name((*be)->device()), precision.c_str());
  std::stringstream list(models);
  std::string model;
  while (std::getline(list, model, ',')) {
    Figures plain, ckpt, ckpt_block, off, both;
    if (run(model, "none", batch, size, steps, *budget, **be, &plain) != 0) return 1;
    if (run(model, "stage", batch, size, steps, *budget, **be, &ckpt) != 0) return 1;
    if (run(model, "block", batch, size, steps, *budget, **be, &ckpt_block) != 0) return 1;
    if (run(model, "offload", batch, size, steps, *budget, **be, &off) != 0) return 1;
    if (run(model, "both", batch, size, steps, *budget, **be, &both) != 0) return 1;
    for (auto [mode, f] : {std::pair<const char*, Figures*>{"none", &plain}, {"stage", &ckpt}, {"block", &ckpt_block}})
      std::printf("%-9s checkpoint=%-5s batch=%ld peak_mib=%.1f planned_mib=%.1f images_per_s=%.2f "
                  "largest_batch_in_%s=%ld\n",
                  model.c_str(), mode, static_cast<long>(batch), f->peak_mib, f->planned_mib, f->images_per_s,
                  budget_text.c_str(), static_cast<long>(f->largest_batch));
    std::printf("%-9s checkpointing: peak x%.2f, time per image +%.0f%%, largest batch in %s x%.2f (%ld -> %ld)\n",
                model.c_str(), ckpt.peak_mib / plain.peak_mib, 100.0 * (plain.images_per_s / ckpt.images_per_s - 1),
                budget_text.c_str(), static_cast<double>(ckpt.largest_batch) / static_cast<double>(plain.largest_batch),
                static_cast<long>(plain.largest_batch), static_cast<long>(ckpt.largest_batch));
    std::printf("%-9s offload (stage, planned; its time needs a device): planned peak at batch %ld %.1f MiB, "
                "largest batch in %s x%.2f (%ld -> %ld)\n",
                model.c_str(), static_cast<long>(batch), off.planned_mib, budget_text.c_str(),
                static_cast<double>(off.largest_batch) / static_cast<double>(plain.largest_batch),
                static_cast<long>(plain.largest_batch), static_cast<long>(off.largest_batch));
    std::printf("%-9s both (blocks checkpointed, their inputs offloaded by stage, planned): planned peak at batch %ld "
                "%.1f MiB, largest batch in %s x%.2f (%ld -> %ld)\n",
                model.c_str(), static_cast<long>(batch), both.planned_mib, budget_text.c_str(),
                static_cast<double>(both.largest_batch) / static_cast<double>(plain.largest_batch),
                static_cast<long>(plain.largest_batch), static_cast<long>(both.largest_batch));
    if (on_device)
      for (auto [mode, f] : {std::pair<const char*, Figures*>{"offload", &off}, {"both", &both}}) {
        std::printf("%-9s %s measured on the device: peak_mib=%.1f planned_mib=%.1f images_per_s=%.2f, time per "
                    "image +%.0f%% against the plain run (vDNN: +18%%)\n",
                    model.c_str(), mode, f->peak_mib, f->planned_mib, f->images_per_s,
                    100.0 * (plain.images_per_s / f->images_per_s - 1));
        // Is it the host link? The copies move 2 x offloaded bytes a step: the rate they need over
        // the whole step (copies hidden behind compute) and over the extra time alone (none hidden),
        // to read beside the link's measured bandwidth.
        const double step_s = static_cast<double>(batch) / f->images_per_s;
        const double extra_s = step_s - static_cast<double>(batch) / plain.images_per_s;
        const double moved_gb = 2.0 * f->offloaded_mib * (1 << 20) / 1e9;
        std::printf("%-9s %s: %.1f MiB to the host and back per step; step %.1f ms (plain %.1f ms): %.1f GB/s over "
                    "the whole step, %.1f GB/s over the extra time\n",
                    model.c_str(), mode, f->offloaded_mib, 1e3 * step_s, 1e3 * (step_s - extra_s),
                    moved_gb / step_s, extra_s > 0 ? moved_gb / extra_s : 0.0);
      }
    std::fflush(stdout);
  }
  return 0;
}
