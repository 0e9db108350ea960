// The compute-only figure for slide-embed, mirroring ../shared/peers/torch_peer.py embed: a model
// cut at a layer (resnet50: layer3 + global average pooling, CLAM's extractor), a batch of random
// tiles, the inference path of embed.h (batch norm folded, ReLU and residual add fused, blocked
// layouts); prints the median images/s over the timed batches (the first is warm-up, and compiles).
//
// usage: embed_step [--model resnet50] [--layer layer3] [--batch 32] [--size 224] [--steps 6]
// oneDNN's thread count follows OMP_NUM_THREADS (the bench script sets it).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "slide/train/embed.h"

using namespace slide::train;

int main(int argc, char** argv) {
  std::string model = "resnet50", layer;
  int64_t batch = 32, size = 224;
  int steps = 6;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--model")) model = argv[i + 1];
    else if (!std::strcmp(argv[i], "--layer")) layer = argv[i + 1];
    else if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--size")) size = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
  }
  if (layer.empty()) layer = default_layer(model);
  const int depth = model == "resnet50" ? 50 : model == "resnet34" ? 34 : 18;
  auto net = make_resnet(cpu_allocator(), DType::kF32, depth, 1000, 0);
  if (!net.ok()) {
    std::fprintf(stderr, "%s\n", net.status().to_string().c_str());
    return 1;
  }
  auto ex = FeatureExtractor::create(**net, layer);
  if (!ex.ok()) {
    std::fprintf(stderr, "%s\n", ex.status().to_string().c_str());
    return 1;
  }
  std::vector<float> x(static_cast<size_t>(batch * 3 * size * size));
  std::mt19937 g(0);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = nd(g);
  std::vector<float> f(static_cast<size_t>(batch * (*ex)->feature_dim()));
  std::vector<double> times;
  for (int s = 0; s <= steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    auto st = (*ex)->extract(x.data(), batch, size, size, f.data());
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.to_string().c_str());
      return 1;
    }
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::vector<double> timed(times.begin() + 1, times.end());
  std::sort(timed.begin(), timed.end());
  const double med = timed[timed.size() / 2];
  std::printf("mode=embed model=%s layer=%s batch=%lld size=%lld feature_dim=%lld images_per_s=%.2f\n", model.c_str(),
              layer.c_str(), static_cast<long long>(batch), static_cast<long long>(size),
              static_cast<long long>((*ex)->feature_dim()), static_cast<double>(batch) / med);
  return 0;
}
