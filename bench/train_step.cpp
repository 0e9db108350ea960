// The compute-only figure for slide-train, mirroring ../shared/peers/torch_peer.py train: a
// model, a batch of random tiles, SGD-momentum steps (forward, loss, backward, update); prints the
// median images/s over the timed steps (the first step is warm-up).
//
// usage: train_step [--model resnet18] [--batch 32] [--size 224] [--steps 6] [--classes 3] [--backend cpu]
//                   [--precision fp32|tf32|bf16|fp16] [--channels-last auto|on|off]
// Activations as slide-train's --activations auto: f16 / bf16 on cuda under fp16 / bf16
// (enable_half_activations), else f32, and with --channels-last auto channels last where they are
// half on cuda (on: also f32 activations, enable_channels_last); the line printed says which.
// oneDNN's thread count follows OMP_NUM_THREADS (the bench script sets it).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend_options.h"
#include "slide/train/optimizer.h"

using namespace slide::train;

int main(int argc, char** argv) {
  std::string model = "resnet18", backend = "cpu", precision = "fp32", channels_last = "auto";
  int64_t batch = 32, size = 224, classes = 3;
  int steps = 6;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--model")) model = argv[i + 1];
    else if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--size")) size = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--classes")) classes = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--backend")) backend = argv[i + 1];
    else if (!std::strcmp(argv[i], "--precision")) precision = argv[i + 1];
    else if (!std::strcmp(argv[i], "--channels-last")) channels_last = argv[i + 1];
  }
  auto be = slide::apps::open_backend(backend, -1, precision);  // slide-train's rule and messages
  const int depth = model == "resnet50" ? 50 : model == "resnet34" ? 34 : 18;
  auto net = make_resnet(cpu_allocator(), DType::kF32, depth, classes, 0);
  if (!be.ok() || !net.ok()) {
    std::fprintf(stderr, "%s\n", (!be.ok() ? be.status() : net.status()).to_string().c_str());
    return 1;
  }
  (*net)->set_input_gradient(false);  // as the trainer does: the input is data
  // On a device backend (cuda, reference-sim) the model, optimizer state and batch live there, as
  // in slide-train.
  if (Status s = move_to_device(**be, **net); !s.ok()) return std::fprintf(stderr, "%s\n", s.to_string().c_str()), 1;
  const DType act = (*be)->activation_dtype();
  const bool nhwc = slide::apps::channels_last_activations(channels_last, act, **be);
  if (Status s = act != DType::kF32 ? enable_half_activations(**net, act, nhwc ? Layout::kNhwc : Layout::kPlain)
                 : nhwc             ? enable_channels_last(**net)
                                    : Status();
      !s.ok())
    return std::fprintf(stderr, "%s\n", s.to_string().c_str()), 1;
  Allocator& alloc = (*be)->allocator();
  std::vector<Parameter*> params;
  (*net)->collect("", &params, nullptr);
  auto opt = Optimizer::make(OptimizerConfig{}, params, alloc);
  Tensor hx = *Tensor::empty({batch, 3, size, size}, DType::kF32, cpu_allocator());
  Tensor hy = *Tensor::empty({batch}, DType::kI32, cpu_allocator());
  std::mt19937_64 rng(0);
  std::normal_distribution<float> n01;
  for (int64_t i = 0; i < hx.numel(); ++i) hx.data<float>()[i] = n01(rng);
  for (int64_t i = 0; i < batch; ++i) hy.data<int32_t>()[i] = static_cast<int32_t>(i % classes);
  Tensor x = *to_device(**be, hx, "images"), y = *to_device(**be, hy, "labels");
  std::vector<double> times;
  for (int s = 0; s <= steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!(*opt)->zero_grad().ok()) return 1;
    auto logits = (*net)->forward(**be, x, true);
    if (!logits.ok()) {
      std::fprintf(stderr, "%s\n", logits.status().to_string().c_str());
      return 1;
    }
    Tensor probs = *Tensor::empty(logits->shape(), DType::kF32, alloc);
    Tensor dlogits = *Tensor::empty(logits->shape(), DType::kF32, alloc);
    double loss = 0;
    if (!(*be)->softmax_cross_entropy_forward(*logits, y, Tensor(), 0, probs, &loss).ok() ||
        !(*be)->softmax_cross_entropy_backward(probs, y, Tensor(), 0, dlogits).ok() ||
        !(*net)->backward(**be, dlogits).ok() || !(*opt)->step(**be, 0.01).ok() || !(*be)->synchronize().ok()) {
      std::fprintf(stderr, "step failed\n");
      return 1;
    }
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::vector<double> timed(times.begin() + 1, times.end());
  std::sort(timed.begin(), timed.end());
  const double med = timed[timed.size() / 2];
  std::printf("mode=train model=%s batch=%lld size=%lld activations=%s layout=%s images_per_s=%.2f "
              "peak_tensor_mb=%zu\n",
              model.c_str(), static_cast<long long>(batch), static_cast<long long>(size), dtype_name(act),
              nhwc ? "nhwc" : "nchw",
              static_cast<double>(batch) / med, alloc.peak_bytes() >> 20);
  return 0;
}
