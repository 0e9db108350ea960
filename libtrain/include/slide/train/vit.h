// Vision Transformers for embedding tiles: the encoders of pathology foundation models (UNI,
// Virchow, Prov-GigaPath, CONCH, H-optimus) are timm VisionTransformers, and their weights are
// published under timm's parameter names. This model runs the same computation on the op list
// (backend.h), so it runs on every backend, and loads those names from safetensors.
//
// The computation (timm.models.vision_transformer.VisionTransformer.forward_features, then its
// pooling; Dosovitskiy et al., 2021), for images [N, 3, S, S] normalised as the encoder expects:
//   patches = conv(images, patch_embed.proj, stride P)         -> [N, G*G, D], G = S / P
//   tokens  = [cls_token?, reg_token x R, patches]              (T = prefix + G*G tokens)
//   tokens += pos_embed (over all tokens; or over the patches only with no_embed_class)
//   per block i: x += ls1 * attn(norm1(x));  x += ls2 * mlp(norm2(x))
//     attn: qkv = x W_qkv^T + b -> heads H of width Dh = D / H; softmax(q k^T / sqrt(Dh)) v;
//           heads concatenated, then proj;  mlp: fc2(GELU(fc1(x))) (exact GELU), or with
//           swiglu (timm GluMlp as SwiGLUPacked: Shazeer, 2020): [a, b] = fc1(x) split in halves,
//           fc2(SiLU(a) * b), SiLU(a) = a sigmoid(a)
//     ls1/ls2 are layer scale (Touvron et al., 2021: a per-channel gamma) when configured
//   x = norm(x) (unless fc_norm); features = pool(x):
//     kToken         x[:, 0]                                   (UNI, ViT-B/16)
//     kMean          mean of the patch tokens (then fc_norm when configured)
//     kTokenAndMean  [x[:, 0], mean of the patch tokens]       (Virchow: 2 D features)
//     kAttentional   CoCa's contrastive attentional pooler (Yu et al., "CoCa: Contrastive
//                    Captioners are Image-Text Foundation Models", 2022), as CONCH's vision tower
//                    runs it (MahmoodLab/CONCH conch/open_clip_custom: vision_tower.py
//                    VisualModel.forward_no_head, transformer.py AttentionalPooler): one learned
//                    query [1, E] cross-attends to every token of x (all T, prefix included):
//                      k_in = LN_k(x) [T, D];  q = LN_q(query) [1, E]
//                      torch.nn.MultiheadAttention(E, H', kdim=D, vdim=D):
//                        Q = q W_q^T + b_q, K = k_in W_k^T + b_k, V = k_in W_v^T + b_v (E wide,
//                        split into H' heads of E / H' in order), per head
//                        softmax(Q_h K_h^T / sqrt(E / H')) V_h, heads concatenated, out_proj
//                      features = LN_contrast(that) [E]   (CONCH: E 512, H' 8; eps 1e-5, torch's
//                    LayerNorm default). This is CONCH's encode_image(proj_contrast=False,
//                    normalize=False), the tile features TRIDENT's conch_v1 uses (without the
//                    final contrastive projection and L2 normalisation).
// LayerNorm eps is norm_eps (timm's ViTs use 1e-6).
//
// Parameter names (timm): cls_token [1,1,D], reg_token [1,R,D], pos_embed [1,T or G*G,D],
// patch_embed.proj.weight [D,3,P,P] and .bias, blocks.{i}.norm1.{weight,bias},
// blocks.{i}.attn.qkv.{weight [3D,D], bias}, blocks.{i}.attn.proj.{weight,bias},
// blocks.{i}.ls1.gamma [D] (layer scale), blocks.{i}.norm2.*, blocks.{i}.mlp.fc1.{weight [M,D],
// bias}, blocks.{i}.mlp.fc2.{weight [D,M], bias}, blocks.{i}.ls2.gamma, norm.{weight,bias} (or
// fc_norm.{weight,bias}). Extra entries in a weight file (a classifier head) are ignored.
// Weights in open_clip's CoCa layout (CONCH's checkpoint, converted to safetensors) carry the
// trunk under "visual.trunk." (name_prefix) and the pooler as visual.attn_pool_contrast.{query
// [1,E], attn.q_proj_weight [E,E], attn.k_proj_weight [E,D], attn.v_proj_weight [E,D],
// attn.in_proj_bias [3E], attn.out_proj.weight [E,E], attn.out_proj.bias [E], ln_q.{weight,bias}
// [E], ln_k.{weight,bias} [D]} and visual.ln_contrast.{weight,bias} [E]; the text tower and the
// captioning pooler in the same file are ignored.
//
// Another input size (slide-embed --image-size S): the positional embedding's grid part is
// resampled at load from the weight file's grid g0 to S / P (resample_pos_embed below, as timm's
// resample_abs_pos_embed), the prefix tokens' rows kept. Tiles of another size are resized to the
// encoder's input by embed_stores (resample.h: PIL's bicubic, as the encoders' transforms).
//
// Not yet: training (the ops' backward passes beyond GELU).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "slide/train/backend.h"
#include "slide/train/checkpoint.h"
#include "slide/train/embed.h"

namespace slide::train {

enum class VitPool { kToken, kMean, kTokenAndMean, kAttentional };

struct VitConfig {
  int image_size = 224;
  int patch_size = 16;
  int width = 768;  // D
  int depth = 12;
  int heads = 12;
  int mlp_hidden = 3072;  // M (timm: width * mlp_ratio): fc2's input width
  bool swiglu = false;    // timm's SwiGLUPacked MLP: fc1 [2M, D], SiLU(first half) * second half
  bool class_token = true;
  int reg_tokens = 0;
  bool no_embed_class = false;  // pos_embed covers the patch tokens only
  bool layer_scale = false;
  bool fc_norm = false;  // LayerNorm after mean pooling instead of before it (timm global_pool='avg')
  double norm_eps = 1e-6;
  VitPool pool = VitPool::kToken;
  // kAttentional: the pooler's width E (its query's), heads and LayerNorm eps.
  int pool_dim = 0;
  int pool_heads = 8;
  double pool_eps = 1e-5;
  // Prepended to every trunk parameter's timm name ("visual.trunk." for open_clip/CONCH files);
  // the pooler's names are (name_prefix without its last "trunk." part) + "attn_pool_contrast." /
  // "ln_contrast.".
  std::string name_prefix;
  // The weight file's image size (its pos_embed grid x patch size) when it differs from
  // image_size: load() then resamples pos_embed from that grid (resample_pos_embed). 0: the same.
  int source_image_size = 0;

  int64_t grid() const { return image_size / patch_size; }
  int64_t source_grid() const { return (source_image_size > 0 ? source_image_size : image_size) / patch_size; }
  // Rows of pos_embed before its grid part: the prefix tokens, unless no_embed_class.
  int64_t pos_prefix() const { return no_embed_class ? 0 : prefix_tokens(); }
  int64_t prefix_tokens() const { return (class_token ? 1 : 0) + reg_tokens; }
  int64_t tokens() const { return prefix_tokens() + grid() * grid(); }
  int64_t feature_dim() const {
    return pool == VitPool::kTokenAndMean ? 2 * int64_t{width} : pool == VitPool::kAttentional ? pool_dim : width;
  }
  // The pooler's parameter-name prefix ("visual." for name_prefix "visual.trunk.").
  std::string pool_prefix() const;
};

class VisionTransformer {
 public:
  // Parameters allocated on `be`'s device, zeroed. Errors: kInvalidArgument for an inconsistent
  // configuration (image size not a multiple of the patch size, width not a multiple of the
  // heads, a pooling that needs a class token without one, ...); the allocator's.
  [[nodiscard]] static Result<std::unique_ptr<VisionTransformer>> create(Backend& be, const VitConfig& config);

  // Reads every parameter from a safetensors file with timm's names (F32). With a
  // source_image_size, pos_embed is read at the file's grid ([1, pos_prefix + g0^2, D]) and
  // resampled to this model's grid (resample_pos_embed) on the host before it is uploaded.
  // Errors: those of load_safetensors naming the file and the first missing or misshapen tensor,
  // kDataLoss for a non-finite value (naming the tensor).
  [[nodiscard]] Status load(const std::string& path);

  // features [N, feature_dim()] (overwritten) of images [N, 3, image_size, image_size], both on
  // the backend's device, f32. Errors: kInvalidArgument for other shapes; the backend's.
  //
  // Precision: the trunk's blocks keep their activations (the normalised tokens, qkv, attention,
  // the MLP) and their linear layers' weights in activation_dtype(). In f16 / bf16 (backend.h,
  // "Half-precision storage"), as torch.autocast runs a timm ViT: the residual stream (patch
  // embedding, tokens, the sums after each branch), layer norm's statistics and parameters, the
  // final norm and the pooling stay f32; each layer norm writes its output in the half type, and
  // each branch (attention, MLP) is added into the f32 stream, scaled by layer scale in f32 (a
  // half branch times timm's f32 gamma promotes to f32 under autocast). The half
  // copies of the weights are made once, on the first such forward after load().
  [[nodiscard]] Status forward(const Tensor& images, Tensor& features);

  // The dtype of the trunk's activations and matrix weights: the backend's activation_dtype() (f16
  // / bf16 on cuda under --precision fp16 / bf16, else f32) unless set_activation_dtype chose one
  // (kF32, kF16 or kBF16: tests run the half-precision path on the reference backend).
  DType activation_dtype() const { return act_override_ ? *act_override_ : be_.activation_dtype(); }
  void set_activation_dtype(DType dtype) { act_override_ = dtype; }

  const VitConfig& config() const { return config_; }
  // Every parameter with its timm name (for loading and tests).
  std::vector<NamedTensor> named_parameters() const;

 private:
  struct Block {
    Tensor norm1_w, norm1_b, qkv_w, qkv_b, proj_w, proj_b, ls1, norm2_w, norm2_b, fc1_w, fc1_b, fc2_w, fc2_b, ls2;
  };
  VisionTransformer(Backend& be, VitConfig config) : be_(be), config_(std::move(config)) {}
  Status layer_scale(const Tensor& gamma, Tensor& x2d, int64_t n_images);
  // x += branch, times layer scale's rows `ls_rows` (f32 [T, D]) first when not null. A half
  // branch is scaled as torch.autocast scales it (timm's LayerScale: a half tensor times an f32
  // gamma promotes to f32): widened into `scratch32` (f32, the branch's shape), multiplied there,
  // then added into the f32 stream.
  Status add_branch(const Tensor* ls_rows, Tensor& branch, Tensor& scratch32, int64_t n_images, Tensor& x);
  // kAttentional pooling of the final tokens x [N*T, D] into features [N, E].
  Status attentional_pool(const Tensor& x, int64_t n_images, Tensor& features);
  struct AttnPool {
    Tensor query, q_w, k_w, v_w, in_b, out_w, out_b, ln_q_w, ln_q_b, ln_k_w, ln_k_b, ln_w, ln_b;
  };

  // The blocks' linear weights and biases in the half type `half_dtype_` (kF32: none made yet),
  // cast from the f32 parameters (prepare_half). Layer scale keeps its f32 rows (add_branch).
  struct HalfBlock {
    Tensor qkv_w, qkv_b, proj_w, proj_b, fc1_w, fc1_b, fc2_w, fc2_b;
  };
  Status prepare_half(DType half);

  Backend& be_;
  VitConfig config_;
  std::optional<DType> act_override_;  // none: the backend's activation_dtype()
  DType half_dtype_ = DType::kF32;
  std::vector<HalfBlock> half_blocks_;
  Tensor cls_token_, reg_token_, pos_embed_, patch_w_, patch_b_, norm_w_, norm_b_;
  std::vector<Block> blocks_;
  AttnPool attn_pool_;
  std::vector<std::pair<std::string, Tensor*>> names_;
  std::vector<Tensor> ls_rows_;  // each layer scale gamma repeated over the T tokens: [T, D]
};

// The configuration of a timm-named weight file, read from its tensor shapes: width (cls_token or
// pos_embed), patch size (patch_embed.proj.weight), depth (the blocks.N present), MLP width
// (mlp.fc2.weight's input), SwiGLU (fc1 twice as wide as fc2's input), register tokens (reg_token), layer scale (ls1.gamma), class token, fc_norm
// (fc_norm.weight instead of norm.weight), and the image size from pos_embed's length (with or
// without the prefix tokens, whichever is a square grid: no_embed_class). The head count cannot
// be read from shapes: `heads` > 0 gives it, else default_vit_heads(width) (VisionTransformer::create
// checks that it divides the width). `path` names
// the file in errors. With `pool` kAttentional, the pooler's width comes from its query
// ("<pool_prefix>attn_pool_contrast.query" [1, E]: one query, the contrastive pooler) and its heads
// from `pool_heads`. Names are read with `name_prefix` before the timm names (the caller detects
// open_clip's "visual.trunk."). Errors: kInvalidArgument naming the tensor that is missing or does
// not fit a ViT (or a pooler with another number of queries).
// The head count of the published ViTs of a width, as timm builds them: 16 for 1280 (ViT-H/14,
// heads of 80) and 1664 (ViT-G/14, heads of 104), else width / 64 (heads of 64: ViT-S, B, L, g).
int default_vit_heads(int width);
[[nodiscard]] Result<VitConfig> infer_vit_config(const std::map<std::string, Shape>& shapes, int heads, VitPool pool,
                                                 const std::string& path, const std::string& name_prefix = "",
                                                 int pool_heads = 8);

// timm's resample_abs_pos_embed (timm/layers/pos_embed.py, timm 0.9 / 1.0), which timm's
// checkpoint_filter_fn applies when a ViT is built at another img_size than its weights: the
// first `prefix` rows (class and register tokens; 0 with no_embed_class) are kept; the grid rows
// [old_grid^2, D] are reshaped to [1, D, old_grid, old_grid], resized with
// F.interpolate(size=(new_grid, new_grid), mode='bicubic', antialias=True, align_corners=False)
// (resize_planes_bicubic_aa, resample.h: PyTorch's antialiased bicubic, a = -0.5, for upsampling
// and downsampling alike), and flattened back to [new_grid^2, D] tokens.
// src: [prefix + old_grid^2, D] f32 host memory; dst: [prefix + new_grid^2, D], overwritten.
// Equal grids copy. Errors: kInvalidArgument for a grid < 1 or D < 1.
[[nodiscard]] Status resample_pos_embed(const float* src, int64_t prefix, int64_t old_grid, int64_t new_grid, int64_t D,
                                        float* dst);

// A Vision Transformer as slide-embed's tile encoder, on any backend (cpu by default; cuda where
// built: tiles are uploaded per batch and features downloaded).
//
// Presets (the architecture is read from the weights; a preset checks it and sets the pooling and
// normalisation the encoder was trained with):
//   "vit"      any timm ViT; class-token pooling unless `pool` says otherwise; ImageNet mean/std.
//   "vit-b16"  ViT-B/16 (width 768, depth 12; Dosovitskiy et al. 2021; torchvision's vit_b_16
//              normalises with ImageNet's mean/std).
//   "vit-l16"  ViT-L/16 (width 1024, depth 24), as vit-b16.
//   "uni"      UNI (Chen et al., Nature Medicine 2024): ViT-L/16 at 224 px with layer scale
//              (timm vit_large_patch16_224, init_values=1e-5), class-token features (1024-d),
//              ImageNet mean/std (its model card's transform).
//   "uni2-h"   UNI2-h (MahmoodLab's model card): ViT-g/14 at 224 px (width 1536, depth 24, 24
//              heads), SwiGLU MLP, layer scale, 8 register tokens, class-token features (1536-d).
//   "virchow2" Virchow2 (Zimmermann et al., 2024; Paige's model card): ViT-H/14 at 224 px (width
//              1280, depth 32, 16 heads), SwiGLU MLP, layer scale, 4 register tokens; features are
//              the class token and the mean of the patch tokens, concatenated (2560-d).
//   "gigapath" Prov-GigaPath's tile encoder (Xu et al., Nature 2024; the Hugging Face config.json
//              of prov-gigapath/prov-gigapath): timm vit_giant_patch14_dinov2 (timm's
//              vision_transformer.py: width 1536, depth 40, 24 heads, init_values 1e-5 = layer
//              scale, mlp_ratio 2.66667 * 2 with mlp_layer SwiGLUPacked and SiLU) with the config's
//              model_args img_size 224, patch_size 16, mlp_ratio 5.33334 (fc1 8192 = 2 x 4096
//              outputs), num_classes 0, global_pool token: class-token features (1536-d), no
//              register tokens, pos_embed over the class token too (197 rows). ImageNet mean/std
//              (its model card's transform: Resize(256, bicubic), CenterCrop(224), Normalize).
//   "hoptimus0" H-optimus-0 (Bioptimus; the Hugging Face config.json of bioptimus/H-optimus-0):
//              timm vit_giant_patch14_reg4_dinov2 (patch 14, width 1536, depth 40, 24 heads,
//              layer scale, SwiGLUPacked MLP with mlp_ratio 5.33334, 4 register tokens,
//              no_embed_class) with model_args img_size 224 (a 16 x 16 grid), num_classes 0,
//              global_pool token: class-token features (1536-d). Its own normalisation (the
//              config's pretrained_cfg and the model card): mean (0.707223, 0.578729, 0.703617),
//              std (0.211883, 0.230117, 0.177517).
// UNI, UNI2-h, Virchow2 and vit-b16/l16 take ImageNet's mean and std (their model cards'
// transforms). None of these presets has been run here on its published (gated) weights: each is
// checked on random weights of its shape against a PyTorch transcription of timm's forward
// (tests/e2e/test_vit.py), the giant ones (gigapath, hoptimus0: 1.1 G parameters) by their shape
// check only (tests/libtrain/test_resample.cpp, with infer_vit_config's shapes).
//   "conch-vit-b" CONCH's vision tower (Lu et al., Nature Medicine 2024; MahmoodLab/CONCH,
//              model_configs/conch_ViT-B-16.json and coca_model.py _build_vision_tower): timm
//              VisionTransformer ViT-B/16 (width 768, depth 12, 12 heads, GELU MLP) at image_size
//              448 (a 28 x 28 grid, pos_embed over the class token too), then the contrastive
//              attentional pooler (kAttentional above: E 512, attn_pooler_heads 8) and
//              ln_contrast: 512-d features, as encode_image(proj_contrast=False,
//              normalize=False). Its weights are open_clip-named (visual.trunk.*,
//              visual.attn_pool_contrast.*, visual.ln_contrast.*: the checkpoint's own names,
//              converted to safetensors). OpenAI CLIP's mean (0.48145466, 0.4578275, 0.40821073)
//              and std (0.26862954, 0.26130258, 0.27577711) (CONCH's constants.py
//              OPENAI_DATASET_MEAN/STD, which its factory sets as the model's transform).
// `pool`: "" (the preset's), "token", "mean", "token+mean", "attention" (the attentional pooler;
// the file must hold it).
// `image_size`: 0 runs the encoder at the weight file's size; S (a multiple of the patch size)
// runs it at S px with the positional embedding resampled from the file's grid to S / P (timm's
// resample_abs_pos_embed, above), as timm.create_model(..., img_size=S) does with the weights.
class VitEncoder final : public TileEncoder {
 public:
  // Errors: kInvalidArgument (unknown preset or pooling, a file that is not that preset's
  // architecture, naming what differs), those of infer_vit_config and VisionTransformer::load.
  // The ViT runs on `be` (any backend; the encoder keeps it).
  // kInvalidArgument also for an image_size that is not a positive multiple of the patch size.
  [[nodiscard]] static Result<std::unique_ptr<VitEncoder>> load(const std::string& weights, const std::string& preset,
                                                                int heads, const std::string& pool,
                                                                std::unique_ptr<Backend> be, int image_size = 0);
  int64_t feature_dim() const override { return vit_->config().feature_dim(); }
  const std::string& layer() const override { return layer_; }
  int64_t input_size() const override { return vit_->config().image_size; }
  // The preset's normalisation of [0, 1] RGB (ImageNet's but for hoptimus0).
  const float* mean() const override { return mean_; }
  const float* std() const override { return std_; }
  [[nodiscard]] Status extract(const float* images, int64_t n, int64_t h, int64_t w, float* features) override;
  void release_cached_memory() override { be_->allocator().trim_cache(); }
  const VitConfig& config() const { return vit_->config(); }

 private:
  VitEncoder() = default;
  std::unique_ptr<Backend> be_;
  std::unique_ptr<VisionTransformer> vit_;
  std::string layer_;
  float mean_[3] = {0.485f, 0.456f, 0.406f};
  float std_[3] = {0.229f, 0.224f, 0.225f};
};

// True for the model names VitEncoder::load takes.
bool is_vit_preset(const std::string& model);
// Those names, comma-separated, for help texts and errors: "vit, vit-b16, ..., hoptimus0".
const std::string& vit_preset_list();

// The per-channel normalisation of [0, 1] RGB a preset's encoder was trained with,
// (v - mean) / std: H-optimus-0's own for "hoptimus0" and OpenAI CLIP's for "conch-vit-b" (vit.h's
// preset list cites them), ImageNet's (0.485, 0.456, 0.406) / (0.229, 0.224, 0.225) for every other
// name ("vit" included).
struct VitNormalisation {
  float mean[3], std[3];
};
VitNormalisation vit_preset_normalisation(const std::string& preset);

// The architecture a preset requires of a weight file's configuration (from infer_vit_config):
// OK for "vit" (anything) and a matching file; else kInvalidArgument "<path> is a ViT of width W,
// depth D, patch P, ...; <preset> is width ..." naming what the preset is. Errors also:
// kInvalidArgument for an unknown preset. (VitEncoder::load calls it; exposed for the tests of
// the giant presets, whose full-size files are gigabytes.)
[[nodiscard]] Status check_vit_preset(const VitConfig& file_config, const std::string& preset, const std::string& path);

}  // namespace slide::train
