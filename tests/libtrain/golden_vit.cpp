// For the ViT numerics test against PyTorch (tests/e2e/test_vit.py): builds a VisionTransformer
// from KEY=VALUE arguments, loads its timm-named weights and an image batch ("images" [N,3,S,S]
// f32) from safetensors, runs forward on the named backend and writes "features" [N,F] to OUT.
//
// usage: golden_vit BACKEND WEIGHTS.safetensors INPUT.safetensors OUT.safetensors N KEY=VALUE...
//   keys: image, patch, width, depth, heads, mlp, reg, class_token (0/1), no_embed_class (0/1),
//   layer_scale (0/1), fc_norm (0/1), swiglu (0/1), pool (token|mean|token_mean|attention),
//   pool_dim, pool_heads (the attentional pooler), prefix (the trunk's name prefix, e.g. visual.trunk.),
//   activations (f32|f16|bf16: VisionTransformer::set_activation_dtype; default the backend's)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "slide/train/checkpoint.h"
#include "slide/train/vit.h"

using namespace slide::train;

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: golden_vit BACKEND WEIGHTS INPUT OUT N KEY=VALUE...\n");
    return 2;
  }
  auto die = [](const slide::core::Status& s) {
    std::fprintf(stderr, "%s\n", s.to_string().c_str());
    return 1;
  };
  VitConfig c;
  std::string activations;
  for (int i = 6; i < argc; ++i) {
    const std::string kv = argv[i];
    const auto eq = kv.find('=');
    if (eq == std::string::npos) return die(slide::core::invalid_argument("not KEY=VALUE: " + kv));
    const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
    const int n = std::atoi(v.c_str());
    if (k == "image") c.image_size = n;
    else if (k == "patch") c.patch_size = n;
    else if (k == "width") c.width = n;
    else if (k == "depth") c.depth = n;
    else if (k == "heads") c.heads = n;
    else if (k == "mlp") c.mlp_hidden = n;
    else if (k == "reg") c.reg_tokens = n;
    else if (k == "class_token") c.class_token = n != 0;
    else if (k == "no_embed_class") c.no_embed_class = n != 0;
    else if (k == "layer_scale") c.layer_scale = n != 0;
    else if (k == "fc_norm") c.fc_norm = n != 0;
    else if (k == "swiglu") c.swiglu = n != 0;
    else if (k == "pool")
      c.pool = v == "mean"         ? VitPool::kMean
               : v == "token_mean" ? VitPool::kTokenAndMean
               : v == "attention"  ? VitPool::kAttentional
                                   : VitPool::kToken;
    else if (k == "pool_dim") c.pool_dim = n;
    else if (k == "pool_heads") c.pool_heads = n;
    else if (k == "prefix") c.name_prefix = v;
    else if (k == "activations") activations = v;
    else return die(slide::core::invalid_argument("unknown key " + k));
  }
  const int64_t N = std::atoll(argv[5]);
  auto be = make_backend(argv[1]);
  if (!be.ok()) return die(be.status());
  auto vit = VisionTransformer::create(**be, c);
  if (!vit.ok()) return die(vit.status());
  if (auto s = (*vit)->load(argv[2]); !s.ok()) return die(s);
  if (!activations.empty()) {
    if (activations != "f32" && activations != "f16" && activations != "bf16")
      return die(slide::core::invalid_argument("activations=" + activations + ": f32, f16 or bf16"));
    (*vit)->set_activation_dtype(activations == "f16" ? DType::kF16 : activations == "bf16" ? DType::kBF16 : DType::kF32);
  }
  auto images = Tensor::empty({N, 3, c.image_size, c.image_size}, DType::kF32, (*be)->allocator(), "images");
  auto features = Tensor::empty({N, c.feature_dim()}, DType::kF32, (*be)->allocator(), "features");
  if (!images.ok() || !features.ok()) return die(images.ok() ? features.status() : images.status());
  if (auto s = load_safetensors(argv[3], {{"images", &*images}}); !s.ok()) return die(s);
  const auto t0 = std::chrono::steady_clock::now();
  if (auto s = (*vit)->forward(*images, *features); !s.ok()) return die(s);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "golden_vit: %lld images in %.3f s\n", static_cast<long long>(N), secs);
  if (auto s = save_safetensors(argv[4], {{"features", &*features}}); !s.ok()) return die(s);
  return 0;
}
