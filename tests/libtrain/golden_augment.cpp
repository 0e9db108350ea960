// For the augmentation test against torchvision (tests/e2e/test_slide_train.py, TestAugment):
// reads an image (HWC f32 RGB in [0, 1], S x S) from a safetensors file, applies one of our
// transforms with the given factors, and writes the result, so the test can compare it with
// torchvision.transforms.functional on the same pixels.
//
// usage: golden_augment IN.safetensors OUT.safetensors SIZE jitter B C S H
//        golden_augment IN.safetensors OUT.safetensors SIZE crop X Y W H
//        golden_augment IN.safetensors OUT.safetensors SIZE hed AH AE AD BH BE BD   (stain augmentation)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "slide/train/augment.h"
#include "slide/train/checkpoint.h"
#include "kernels/formulas.h"

using namespace slide::train;

int main(int argc, char** argv) {
  const bool hed = argc == 11 && std::strcmp(argv[4], "hed") == 0;
  if (!hed && (argc != 9 || (std::strcmp(argv[4], "jitter") != 0 && std::strcmp(argv[4], "crop") != 0))) {
    std::fprintf(stderr, "usage: golden_augment IN OUT SIZE jitter B C S H | crop X Y W H | hed AH AE AD BH BE BD\n");
    return 2;
  }
  const int64_t size = std::atoll(argv[3]);
  Tensor img = *Tensor::empty({size, size, 3}, DType::kF32, cpu_allocator());
  if (auto s = load_safetensors(argv[1], {{"image", &img}}); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.to_string().c_str());
    return 1;
  }
  Tensor out = *img.clone();
  if (hed) {
    // The per-pixel formula augment_image applies for a record with stain factors.
    const float alpha[3] = {std::strtof(argv[5], nullptr), std::strtof(argv[6], nullptr), std::strtof(argv[7], nullptr)};
    const float beta[3] = {std::strtof(argv[8], nullptr), std::strtof(argv[9], nullptr), std::strtof(argv[10], nullptr)};
    for (int64_t k = 0; k < size * size; ++k) formulas::hed_jitter(out.data<float>() + 3 * k, alpha, beta);
  } else if (std::strcmp(argv[4], "jitter") == 0) {
    JitterFactors f{std::strtof(argv[5], nullptr), std::strtof(argv[6], nullptr), std::strtof(argv[7], nullptr),
                    std::strtof(argv[8], nullptr)};
    apply_jitter(f, out.data<float>(), size * size);
  } else {
    CropBox box{std::atoll(argv[5]), std::atoll(argv[6]), std::atoll(argv[7]), std::atoll(argv[8])};
    resize_crop(img.data<float>(), size, box, out.data<float>());
  }
  if (auto s = save_safetensors(argv[2], {{"image", &out}}); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.to_string().c_str());
    return 1;
  }
  return 0;
}
