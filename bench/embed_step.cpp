// The compute-only figure for slide-embed, mirroring ../shared/peers/torch_peer.py embed: a model
// cut at a layer (resnet50: layer3 + global average pooling, CLAM's extractor), a batch of random
// tiles, the inference path of embed.h (batch norm folded, ReLU and residual add fused, blocked
// layouts); prints the median images/s over the timed batches (the first is warm-up, and compiles).
//
// usage: embed_step [--model resnet50] [--layer layer3] [--batch 32] [--size 224] [--steps 6]
//                   [--precision fp32|tf32|bf16|fp16]   (the backend's math precision, backend.h)
//                   [--backend cpu|cuda]   (cuda: the batch is uploaded, and the features downloaded, in
//                   every timed step, as slide-embed does; the download waits for the GPU's work)
//   --model vit_b_16 | vit_l_16: torchvision's ViT-B/16 and ViT-L/16 (the peer's names) as
//   libtrain's VisionTransformer (vit.h) on the cpu backend, random weights, class-token features.
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
#include "slide/train/embed.h"
#include "slide/train/vit.h"

using namespace slide::train;

int main(int argc, char** argv) {
  std::string model = "resnet50", layer;
  int64_t batch = 32, size = 224;
  int steps = 6;
  std::string precision = "fp32", backend = "cpu";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--model")) model = argv[i + 1];
    else if (!std::strcmp(argv[i], "--layer")) layer = argv[i + 1];
    else if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--size")) size = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--precision")) precision = argv[i + 1];
    else if (!std::strcmp(argv[i], "--backend")) backend = argv[i + 1];
  }
  std::vector<float> x(static_cast<size_t>(batch * 3 * size * size));
  std::mt19937 g(0);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = nd(g);
  std::vector<double> times;
  auto report = [&](const std::string& what, int64_t dim) {
    std::vector<double> timed(times.begin() + 1, times.end());
    std::sort(timed.begin(), timed.end());
    const double med = timed[timed.size() / 2];
    std::printf("mode=embed backend=%s model=%s layer=%s precision=%s batch=%lld size=%lld feature_dim=%lld images_per_s=%.2f\n",
                backend.c_str(), model.c_str(), what.c_str(), precision.c_str(), static_cast<long long>(batch),
                static_cast<long long>(size), static_cast<long long>(dim), static_cast<double>(batch) / med);
  };
  auto die = [](const slide::core::Status& s) {
    std::fprintf(stderr, "%s\n", s.to_string().c_str());
    return 1;
  };
  auto make_backend = [&] { return slide::apps::open_backend(backend, -1, precision); };
  if (model == "vit_b_16" || model == "vit_l_16") {
    VitConfig c;  // torchvision's vit_b_16 / vit_l_16 (Dosovitskiy et al. 2021), timm's layout
    c.image_size = static_cast<int>(size);
    if (model == "vit_l_16") c.width = 1024, c.depth = 24, c.heads = 16, c.mlp_hidden = 4096;
    auto be = make_backend();
    if (!be.ok()) return die(be.status());
    auto vit = VisionTransformer::create(**be, c);
    if (!vit.ok()) return die(vit.status());
    // Random parameters, drawn on the host and uploaded to the backend's device.
    std::normal_distribution<float> w(0.f, 0.02f);
    for (const NamedTensor& p : (*vit)->named_parameters()) {
      auto host = Tensor::empty(p.tensor->shape(), DType::kF32, cpu_allocator(), "parameter");
      if (!host.ok()) return die(host.status());
      for (int64_t i = 0; i < host->numel(); ++i) host->data<float>()[i] = w(g);
      if (auto st = (*be)->upload(*host, *const_cast<Tensor*>(p.tensor)); !st.ok()) return die(st);
    }
    Allocator& dev = (*be)->allocator();
    auto host_in = Tensor::empty({batch, 3, size, size}, DType::kF32, cpu_allocator(), "images");
    auto host_out = Tensor::empty({batch, c.feature_dim()}, DType::kF32, cpu_allocator(), "features");
    auto in = Tensor::empty({batch, 3, size, size}, DType::kF32, dev, "images");
    auto out = Tensor::empty({batch, c.feature_dim()}, DType::kF32, dev, "features");
    for (const auto* t : {&host_in, &host_out, &in, &out})
      if (!t->ok()) return die(t->status());
    std::copy(x.begin(), x.end(), host_in->data<float>());
    for (int s = 0; s <= steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      if (auto st = (*be)->upload(*host_in, *in); !st.ok()) return die(st);
      if (auto st = (*vit)->forward(*in, *out); !st.ok()) return die(st);
      if (auto st = (*be)->download(*out, *host_out); !st.ok()) return die(st);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    report("token", c.feature_dim());
    return 0;
  }
  if (layer.empty()) layer = default_layer(model);
  const int depth = model == "resnet50" ? 50 : model == "resnet34" ? 34 : 18;
  auto net = make_resnet(cpu_allocator(), DType::kF32, depth, 1000, 0);
  if (!net.ok()) {
    std::fprintf(stderr, "%s\n", net.status().to_string().c_str());
    return 1;
  }
  auto be = make_backend();
  if (!be.ok()) return die(be.status());
  auto ex = FeatureExtractor::create(**net, layer, std::move(*be));
  if (!ex.ok()) {
    std::fprintf(stderr, "%s\n", ex.status().to_string().c_str());
    return 1;
  }
  std::vector<float> f(static_cast<size_t>(batch * (*ex)->feature_dim()));
  for (int s = 0; s <= steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    if (auto st = (*ex)->extract(x.data(), batch, size, size, f.data()); !st.ok()) return die(st);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  report(layer, (*ex)->feature_dim());
  return 0;
}
