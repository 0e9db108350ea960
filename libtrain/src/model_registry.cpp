// The CNN families (model_registry.h).
#include "slide/train/model_registry.h"

namespace slide::train {

namespace {

template <int Depth>
Result<std::unique_ptr<Sequential>> resnet(int64_t classes, int64_t /*width*/, std::optional<uint64_t> seed,
                                           double dropout) {
  return make_resnet(cpu_allocator(), DType::kF32, Depth, classes, seed, dropout);
}

Result<std::unique_ptr<Sequential>> small(int64_t classes, int64_t width, std::optional<uint64_t> seed,
                                          double dropout) {
  return make_small_cnn(cpu_allocator(), DType::kF32, 3, classes, width, seed, dropout);
}

}  // namespace

const std::vector<CnnFamily>& cnn_families() {
  static const std::vector<CnnFamily> families{
      {"small", "avgpool", "a small CNN (three conv-BN-ReLU stages of --width, 2x, 4x channels)", small},
      {"resnet18", "avgpool", "ResNet-18 (He et al. 2016; torchvision's names)", resnet<18>},
      {"resnet34", "avgpool", "ResNet-34 (He et al. 2016; torchvision's names)", resnet<34>},
      {"resnet50", "layer3", "ResNet-50 (He et al. 2016; torchvision's names); default cut layer3 as CLAM", resnet<50>},
  };
  return families;
}

const CnnFamily* find_cnn_family(const std::string& name) {
  for (const CnnFamily& f : cnn_families())
    if (name == f.name) return &f;
  return nullptr;
}

std::string cnn_family_names() {
  std::string out;
  for (const CnnFamily& f : cnn_families()) out += (out.empty() ? "" : ", ") + std::string(f.name);
  return out;
}

Result<std::unique_ptr<Sequential>> make_cnn(const std::string& name, int64_t classes, int64_t width,
                                             std::optional<uint64_t> seed, double dropout) {
  const CnnFamily* f = find_cnn_family(name);
  if (f == nullptr)
    return slide::core::invalid_argument("model '" + name + "' is not one of " + cnn_family_names() +
                                         " (or, for slide-embed, a ViT preset)");
  return f->build(classes, width, seed, dropout);
}

}  // namespace slide::train
