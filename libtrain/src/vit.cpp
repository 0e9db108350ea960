// VisionTransformer (vit.h): timm's ViT forward on the op list.
#include "slide/train/vit.h"

#include <cmath>
#include <cstring>
#include <string>

#include "slide/core/log.h"
#include "slide/train/resample.h"

namespace slide::train {

namespace {

using slide::core::invalid_argument;
using slide::core::ok_status;

// Copies `bytes` from src's element `src_at` to dst's element `dst_at` (f32), on the tensors'
// device (Allocator::copy_bytes).
Status copy_f32(Backend& be, const Tensor& src, int64_t src_at, Tensor& dst, int64_t dst_at, int64_t count) {
  if (count == 0) return ok_status();
  return be.allocator().copy_bytes(dst.ptr<float>() + dst_at, src.ptr<float>() + src_at,
                                   static_cast<size_t>(count) * sizeof(float));
}

}  // namespace

std::string VitConfig::pool_prefix() const {
  const std::string trunk = "trunk.";
  if (name_prefix.size() >= trunk.size() && name_prefix.compare(name_prefix.size() - trunk.size(), trunk.size(), trunk) == 0)
    return name_prefix.substr(0, name_prefix.size() - trunk.size());
  return name_prefix;
}

Result<std::unique_ptr<VisionTransformer>> VisionTransformer::create(Backend& be, const VitConfig& c) {
  if (c.patch_size < 1 || c.image_size < c.patch_size || c.image_size % c.patch_size != 0)
    return invalid_argument("ViT: image size " + std::to_string(c.image_size) + " is not a multiple of patch size " +
                            std::to_string(c.patch_size));
  if (c.width < 1 || c.heads < 1 || c.width % c.heads != 0)
    return invalid_argument("ViT: width " + std::to_string(c.width) + " is not a multiple of " +
                            std::to_string(c.heads) + " heads (without --heads: 16 for widths 1280 and 1664, else width / 64; give the count)");
  if (c.depth < 0 || c.mlp_hidden < 1 || c.reg_tokens < 0 || !(c.norm_eps > 0))
    return invalid_argument("ViT: depth, MLP width, register tokens or norm eps out of range");
  if (!c.class_token && c.pool != VitPool::kMean)
    return invalid_argument("ViT: class-token pooling without a class token");
  if (c.fc_norm && c.pool != VitPool::kMean) return invalid_argument("ViT: fc_norm applies to mean pooling only");
  if (c.pool == VitPool::kAttentional &&
      (c.pool_dim < 1 || c.pool_heads < 1 || c.pool_dim % c.pool_heads != 0 || !(c.pool_eps > 0)))
    return invalid_argument("ViT: attentional pooler width " + std::to_string(c.pool_dim) + " is not a multiple of " +
                            std::to_string(c.pool_heads) + " heads");
  auto vit = std::unique_ptr<VisionTransformer>(new VisionTransformer(be, c));
  const int64_t D = c.width, M = c.mlp_hidden, P = c.patch_size;
  Allocator& alloc = be.allocator();
  // Trunk parameters: their timm names after name_prefix; the pooler's are given whole.
  auto param_named = [&](Tensor* t, const std::string& name, const Shape& shape) -> Status {
    SLIDE_ASSIGN_OR_RETURN(*t, Tensor::zeros(shape, DType::kF32, alloc, name));
    vit->names_.push_back({name, t});
    return ok_status();
  };
  auto param = [&](Tensor* t, const std::string& name, const Shape& shape) {
    return param_named(t, c.name_prefix + name, shape);
  };
  vit->blocks_.resize(static_cast<size_t>(c.depth));  // before taking pointers into it
  if (c.class_token) SLIDE_RETURN_IF_ERROR(param(&vit->cls_token_, "cls_token", {1, 1, D}));
  if (c.reg_tokens > 0) SLIDE_RETURN_IF_ERROR(param(&vit->reg_token_, "reg_token", {1, c.reg_tokens, D}));
  if (c.source_image_size != 0 && (c.source_image_size < c.patch_size || c.source_image_size % c.patch_size != 0))
    return invalid_argument("ViT: the weights' image size " + std::to_string(c.source_image_size) +
                            " is not a multiple of patch size " + std::to_string(c.patch_size));
  const int64_t pos_len = c.no_embed_class ? c.grid() * c.grid() : c.tokens();
  SLIDE_RETURN_IF_ERROR(param(&vit->pos_embed_, "pos_embed", {1, pos_len, D}));
  SLIDE_RETURN_IF_ERROR(param(&vit->patch_w_, "patch_embed.proj.weight", {D, 3, P, P}));
  SLIDE_RETURN_IF_ERROR(param(&vit->patch_b_, "patch_embed.proj.bias", {D}));
  for (int i = 0; i < c.depth; ++i) {
    Block& b = vit->blocks_[static_cast<size_t>(i)];
    const std::string p = "blocks." + std::to_string(i) + ".";
    SLIDE_RETURN_IF_ERROR(param(&b.norm1_w, p + "norm1.weight", {D}));
    SLIDE_RETURN_IF_ERROR(param(&b.norm1_b, p + "norm1.bias", {D}));
    SLIDE_RETURN_IF_ERROR(param(&b.qkv_w, p + "attn.qkv.weight", {3 * D, D}));
    SLIDE_RETURN_IF_ERROR(param(&b.qkv_b, p + "attn.qkv.bias", {3 * D}));
    SLIDE_RETURN_IF_ERROR(param(&b.proj_w, p + "attn.proj.weight", {D, D}));
    SLIDE_RETURN_IF_ERROR(param(&b.proj_b, p + "attn.proj.bias", {D}));
    if (c.layer_scale) SLIDE_RETURN_IF_ERROR(param(&b.ls1, p + "ls1.gamma", {D}));
    SLIDE_RETURN_IF_ERROR(param(&b.norm2_w, p + "norm2.weight", {D}));
    SLIDE_RETURN_IF_ERROR(param(&b.norm2_b, p + "norm2.bias", {D}));
    const int64_t M1 = c.swiglu ? 2 * M : M;
    SLIDE_RETURN_IF_ERROR(param(&b.fc1_w, p + "mlp.fc1.weight", {M1, D}));
    SLIDE_RETURN_IF_ERROR(param(&b.fc1_b, p + "mlp.fc1.bias", {M1}));
    SLIDE_RETURN_IF_ERROR(param(&b.fc2_w, p + "mlp.fc2.weight", {D, M}));
    SLIDE_RETURN_IF_ERROR(param(&b.fc2_b, p + "mlp.fc2.bias", {D}));
    if (c.layer_scale) SLIDE_RETURN_IF_ERROR(param(&b.ls2, p + "ls2.gamma", {D}));
  }
  const std::string norm = c.fc_norm ? "fc_norm" : "norm";
  SLIDE_RETURN_IF_ERROR(param(&vit->norm_w_, norm + ".weight", {D}));
  SLIDE_RETURN_IF_ERROR(param(&vit->norm_b_, norm + ".bias", {D}));
  if (c.pool == VitPool::kAttentional) {
    const int64_t E = c.pool_dim;
    const std::string a = c.pool_prefix() + "attn_pool_contrast.", l = c.pool_prefix() + "ln_contrast.";
    AttnPool& ap = vit->attn_pool_;
    SLIDE_RETURN_IF_ERROR(param_named(&ap.query, a + "query", {1, E}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.q_w, a + "attn.q_proj_weight", {E, E}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.k_w, a + "attn.k_proj_weight", {E, D}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.v_w, a + "attn.v_proj_weight", {E, D}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.in_b, a + "attn.in_proj_bias", {3 * E}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.out_w, a + "attn.out_proj.weight", {E, E}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.out_b, a + "attn.out_proj.bias", {E}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.ln_q_w, a + "ln_q.weight", {E}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.ln_q_b, a + "ln_q.bias", {E}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.ln_k_w, a + "ln_k.weight", {D}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.ln_k_b, a + "ln_k.bias", {D}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.ln_w, l + "weight", {E}));
    SLIDE_RETURN_IF_ERROR(param_named(&ap.ln_b, l + "bias", {E}));
  }
  return vit;
}

std::vector<NamedTensor> VisionTransformer::named_parameters() const {
  std::vector<NamedTensor> out;
  for (const auto& [name, t] : names_) out.push_back({name, t});
  return out;
}

Status VisionTransformer::load(const std::string& path) {
  // New weights: what was derived from the old ones (half-precision copies, layer scale's rows) is
  // stale from here on, also should this load fail halfway.
  half_blocks_.clear();
  half_dtype_ = DType::kF32;
  ls_rows_.clear();
  const int64_t g0 = config_.source_grid(), g = config_.grid(), D = config_.width, prefix = config_.pos_prefix();
  if (g0 != g) {
    // pos_embed at the file's grid, resampled on the host to ours (timm's resample_abs_pos_embed),
    // then the other parameters as they are.
    SLIDE_ASSIGN_OR_RETURN(Tensor file_pos, Tensor::empty({1, prefix + g0 * g0, D}, DType::kF32, cpu_allocator(),
                                                          "pos_embed (weights' grid)"));
    SLIDE_RETURN_IF_ERROR(load_safetensors(path, {{config_.name_prefix + "pos_embed", &file_pos}}));
    SLIDE_ASSIGN_OR_RETURN(Tensor pos, Tensor::empty(pos_embed_.shape(), DType::kF32, cpu_allocator(), "pos_embed"));
    SLIDE_RETURN_IF_ERROR(resample_pos_embed(file_pos.ptr<float>(), prefix, g0, g, D, pos.ptr<float>()));
    if (be_.device() == Device::kCpu) std::memcpy(pos_embed_.raw(), pos.raw(), pos.bytes());
    else SLIDE_RETURN_IF_ERROR(be_.upload(pos, pos_embed_));
    slide::core::log_info("ViT positional embedding resampled (bicubic, antialiased, as timm's resample_abs_pos_embed)",
                          {{"from_grid", g0}, {"to_grid", g}, {"prefix_tokens", prefix}});
  }
  std::vector<std::pair<std::string, Tensor*>> names;
  for (const auto& nt : names_)
    if (g0 == g || nt.first != config_.name_prefix + "pos_embed") names.push_back(nt);
  if (be_.device() == Device::kCpu) {
    std::vector<NamedTensor> into;
    for (const auto& [name, t] : names) into.push_back({name, t});
    SLIDE_RETURN_IF_ERROR(load_safetensors(path, into));
  } else {
    // Read into host tensors, then upload (the loader writes host memory).
    std::vector<Tensor> host;
    host.reserve(names.size());
    std::vector<NamedTensor> into;
    for (const auto& [name, t] : names) {
      SLIDE_ASSIGN_OR_RETURN(Tensor h, Tensor::empty(t->shape(), DType::kF32, cpu_allocator(), name));
      host.push_back(std::move(h));
    }
    for (size_t i = 0; i < names.size(); ++i) into.push_back({names[i].first, &host[i]});
    SLIDE_RETURN_IF_ERROR(load_safetensors(path, into));
    for (size_t i = 0; i < names.size(); ++i) SLIDE_RETURN_IF_ERROR(be_.upload(host[i], *names[i].second));
  }
  // Layer scale's gamma repeated over the tokens, so that it is one element-wise product per image.
  if (config_.layer_scale) {
    const int64_t T = config_.tokens(), D = config_.width;
    for (const Block& b : blocks_)
      for (const Tensor* gamma : {&b.ls1, &b.ls2}) {
        SLIDE_ASSIGN_OR_RETURN(Tensor rows, Tensor::empty({T, D}, DType::kF32, be_.allocator(), "layer scale rows"));
        for (int64_t t = 0; t < T; ++t) SLIDE_RETURN_IF_ERROR(copy_f32(be_, *gamma, 0, rows, t * D, D));
        ls_rows_.push_back(std::move(rows));
      }
  }
  return ok_status();
}

Status VisionTransformer::layer_scale(const Tensor& rows, Tensor& x2d, int64_t n_images) {
  const int64_t T = config_.tokens(), D = config_.width;
  for (int64_t n = 0; n < n_images; ++n) {
    SLIDE_ASSIGN_OR_RETURN(Tensor xn, x2d.view(n * T * D, {T, D}));
    SLIDE_RETURN_IF_ERROR(be_.mul(xn, rows, xn));
  }
  return ok_status();
}

Status VisionTransformer::add_branch(const Tensor* ls_rows, Tensor& branch, Tensor& scratch32, int64_t n_images,
                                     Tensor& x) {
  if (ls_rows == nullptr) return be_.add(x, branch, x);
  if (branch.dtype() == DType::kF32) {
    SLIDE_RETURN_IF_ERROR(layer_scale(*ls_rows, branch, n_images));
    return be_.add(x, branch, x);
  }
  SLIDE_RETURN_IF_ERROR(be_.cast(branch, scratch32));
  SLIDE_RETURN_IF_ERROR(layer_scale(*ls_rows, scratch32, n_images));
  return be_.add(x, scratch32, x);
}

Status VisionTransformer::prepare_half(DType half) {
  if (half_dtype_ == half) return ok_status();
  half_blocks_.clear();
  half_dtype_ = DType::kF32;
  auto cast = [&](const Tensor& t, Tensor* out) -> Status {
    if (!t.defined()) return ok_status();
    SLIDE_ASSIGN_OR_RETURN(*out, Tensor::empty(t.shape(), half, be_.allocator(), "ViT weights in half precision"));
    return be_.cast(t, *out);
  };
  std::vector<HalfBlock> blocks(blocks_.size());
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& b = blocks_[i];
    HalfBlock& h = blocks[i];
    SLIDE_RETURN_IF_ERROR(cast(b.qkv_w, &h.qkv_w));
    SLIDE_RETURN_IF_ERROR(cast(b.qkv_b, &h.qkv_b));
    SLIDE_RETURN_IF_ERROR(cast(b.proj_w, &h.proj_w));
    SLIDE_RETURN_IF_ERROR(cast(b.proj_b, &h.proj_b));
    SLIDE_RETURN_IF_ERROR(cast(b.fc1_w, &h.fc1_w));
    SLIDE_RETURN_IF_ERROR(cast(b.fc1_b, &h.fc1_b));
    SLIDE_RETURN_IF_ERROR(cast(b.fc2_w, &h.fc2_w));
    SLIDE_RETURN_IF_ERROR(cast(b.fc2_b, &h.fc2_b));
  }
  half_blocks_ = std::move(blocks);
  half_dtype_ = half;
  return ok_status();
}

// Multi-head self-attention of h [N*T, D] (already normalised) into out [N*T, D], before proj.
Status VisionTransformer::forward(const Tensor& images, Tensor& features) {
  const VitConfig& c = config_;
  const int64_t S = c.image_size, P = c.patch_size, G = c.grid(), D = c.width, M = c.mlp_hidden, T = c.tokens(),
                R = c.prefix_tokens(), F = c.feature_dim();
  if (images.rank() != 4 || images.dim(1) != 3 || images.dim(2) != S || images.dim(3) != S)
    return invalid_argument("ViT: images are " + shape_string(images.shape()) + ", expected [N, 3, " +
                            std::to_string(S) + ", " + std::to_string(S) + "]");
  const int64_t N = images.dim(0);
  if (features.shape() != Shape{N, F})
    return invalid_argument("ViT: features are " + shape_string(features.shape()) + ", expected [" +
                            std::to_string(N) + ", " + std::to_string(F) + "]");
  if (c.layer_scale && ls_rows_.size() != 2 * blocks_.size())
    return slide::core::failed_precondition("ViT: load() the weights before forward()");
  Allocator& alloc = be_.allocator();
  auto empty = [&](const Shape& s, const char* what) { return Tensor::empty(s, DType::kF32, alloc, what); };
  // The blocks' activations: f32, or half precision with the residual stream x in f32 (vit.h).
  const DType act = activation_dtype();
  if (act != DType::kF32 && act != DType::kF16 && act != DType::kBF16)
    return invalid_argument(std::string("ViT: activations in ") + dtype_name(act) + " (f32, f16 or bf16)");
  const bool half = act != DType::kF32;
  if (half) SLIDE_RETURN_IF_ERROR(prepare_half(act));
  auto empty_act = [&](const Shape& s, const char* what) { return Tensor::empty(s, act, alloc, what); };

  // Patch embedding: [N, D, G, G] -> [N, G*G, D].
  SLIDE_ASSIGN_OR_RETURN(Tensor conv, empty({N, D, G, G}, "patch embedding"));
  SLIDE_RETURN_IF_ERROR(be_.conv2d_forward(images, patch_w_, patch_b_, Conv2dParams{static_cast<int>(P), 0}, conv));
  SLIDE_ASSIGN_OR_RETURN(Tensor conv_plain, be_.to_plain(conv));
  SLIDE_ASSIGN_OR_RETURN(Tensor conv3, conv_plain.reshape({N, D, G * G}));
  SLIDE_ASSIGN_OR_RETURN(Tensor patches, empty({N, G * G, D}, "patch tokens"));
  SLIDE_RETURN_IF_ERROR(be_.permute(conv3, {0, 2, 1}, patches));

  // Tokens [N, T, D]: class token, register tokens, patches; plus the positional embedding.
  SLIDE_ASSIGN_OR_RETURN(Tensor x, empty({N * T, D}, "tokens"));
  SLIDE_ASSIGN_OR_RETURN(Tensor pos, pos_embed_.reshape({pos_embed_.dim(1), D}));
  for (int64_t n = 0; n < N; ++n) {
    int64_t at = n * T * D;
    if (c.class_token) {
      SLIDE_RETURN_IF_ERROR(copy_f32(be_, cls_token_, 0, x, at, D));
      at += D;
    }
    if (c.reg_tokens > 0) {
      SLIDE_RETURN_IF_ERROR(copy_f32(be_, reg_token_, 0, x, at, c.reg_tokens * D));
      at += c.reg_tokens * D;
    }
    SLIDE_RETURN_IF_ERROR(copy_f32(be_, patches, n * G * G * D, x, at, G * G * D));
    const int64_t first = c.no_embed_class ? n * T * D + R * D : n * T * D;
    SLIDE_ASSIGN_OR_RETURN(Tensor span, x.view(first, pos.shape()));
    SLIDE_RETURN_IF_ERROR(be_.add(span, pos, span));
  }

  SLIDE_ASSIGN_OR_RETURN(Tensor h, empty_act({N * T, D}, "normalised tokens"));
  SLIDE_ASSIGN_OR_RETURN(Tensor qkv, empty_act({N * T, 3 * D}, "qkv"));
  SLIDE_ASSIGN_OR_RETURN(Tensor ctx, empty_act({N * T, D}, "attention context"));
  SLIDE_ASSIGN_OR_RETURN(Tensor branch, empty_act({N * T, D}, "residual branch"));
  // A half branch widened to f32 for layer scale (add_branch).
  Tensor branch32;
  if (half && c.layer_scale) {
    SLIDE_ASSIGN_OR_RETURN(branch32, empty({N * T, D}, "residual branch in f32 (layer scale)"));
  }
  SLIDE_ASSIGN_OR_RETURN(Tensor hidden, empty_act({N * T, c.swiglu ? 2 * M : M}, "MLP hidden"));
  // SwiGLU: fc1's output [N*T, 2, M] split into halves [2, N*T, M], then SiLU(a) * b.
  Tensor halves, swiglu_out, gate;
  if (c.swiglu) {
    SLIDE_ASSIGN_OR_RETURN(halves, empty_act({2, N * T, M}, "SwiGLU halves"));
    SLIDE_ASSIGN_OR_RETURN(gate, empty_act({N * T, M}, "SwiGLU gate"));
    SLIDE_ASSIGN_OR_RETURN(swiglu_out, empty_act({N * T, M}, "SwiGLU output"));
  }
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& b = blocks_[i];
    // The linear layers' weights and the layer-scale rows in the activations' dtype.
    const HalfBlock* hb = half ? &half_blocks_[i] : nullptr;
    const Tensor& qkv_w = hb ? hb->qkv_w : b.qkv_w;
    const Tensor& qkv_b = hb ? hb->qkv_b : b.qkv_b;
    const Tensor& proj_w = hb ? hb->proj_w : b.proj_w;
    const Tensor& proj_b = hb ? hb->proj_b : b.proj_b;
    const Tensor& fc1_w = hb ? hb->fc1_w : b.fc1_w;
    const Tensor& fc1_b = hb ? hb->fc1_b : b.fc1_b;
    const Tensor& fc2_w = hb ? hb->fc2_w : b.fc2_w;
    const Tensor& fc2_b = hb ? hb->fc2_b : b.fc2_b;
    SLIDE_RETURN_IF_ERROR(be_.layer_norm_forward(x, b.norm1_w, b.norm1_b, c.norm_eps, h));
    SLIDE_RETURN_IF_ERROR(be_.linear_forward(h, qkv_w, qkv_b, qkv));
    SLIDE_RETURN_IF_ERROR(be_.attention_forward(qkv, N, c.heads, 1.0 / std::sqrt(static_cast<double>(D / c.heads)), ctx));
    SLIDE_RETURN_IF_ERROR(be_.linear_forward(ctx, proj_w, proj_b, branch));
    SLIDE_RETURN_IF_ERROR(add_branch(c.layer_scale ? &ls_rows_[2 * i] : nullptr, branch, branch32, N, x));
    SLIDE_RETURN_IF_ERROR(be_.layer_norm_forward(x, b.norm2_w, b.norm2_b, c.norm_eps, h));
    if (c.swiglu) {
      SLIDE_RETURN_IF_ERROR(be_.linear_forward(h, fc1_w, fc1_b, hidden));
      SLIDE_ASSIGN_OR_RETURN(Tensor packed, hidden.reshape({N * T, 2, M}));
      SLIDE_RETURN_IF_ERROR(be_.permute(packed, {1, 0, 2}, halves));
      SLIDE_ASSIGN_OR_RETURN(Tensor a, halves.view(0, {N * T, M}));
      SLIDE_ASSIGN_OR_RETURN(Tensor bb, halves.view(N * T * M, {N * T, M}));
      SLIDE_RETURN_IF_ERROR(be_.sigmoid_forward(a, gate));
      SLIDE_RETURN_IF_ERROR(be_.mul(gate, a, gate));  // SiLU(a) = a sigmoid(a)
      SLIDE_RETURN_IF_ERROR(be_.mul(gate, bb, swiglu_out));
      SLIDE_RETURN_IF_ERROR(be_.linear_forward(swiglu_out, fc2_w, fc2_b, branch));
    } else {
      SLIDE_RETURN_IF_ERROR(be_.linear_gelu_forward(h, fc1_w, fc1_b, hidden));
      SLIDE_RETURN_IF_ERROR(be_.linear_forward(hidden, fc2_w, fc2_b, branch));
    }
    SLIDE_RETURN_IF_ERROR(add_branch(c.layer_scale ? &ls_rows_[2 * i + 1] : nullptr, branch, branch32, N, x));
  }
  if (!c.fc_norm) SLIDE_RETURN_IF_ERROR(be_.layer_norm_forward(x, norm_w_, norm_b_, c.norm_eps, x));

  // Pooling.
  if (c.pool == VitPool::kAttentional) return attentional_pool(x, N, features);
  Tensor mean;
  if (c.pool != VitPool::kToken) {
    const int64_t Np = G * G;
    SLIDE_ASSIGN_OR_RETURN(Tensor patch_rows, empty({N, Np, D}, "patch tokens for pooling"));
    for (int64_t n = 0; n < N; ++n) SLIDE_RETURN_IF_ERROR(copy_f32(be_, x, (n * T + R) * D, patch_rows, n * Np * D, Np * D));
    SLIDE_ASSIGN_OR_RETURN(Tensor by_channel, empty({N, D, Np, 1}, "patch tokens by channel"));
    SLIDE_ASSIGN_OR_RETURN(Tensor by_channel3, by_channel.reshape({N, D, Np}));
    SLIDE_RETURN_IF_ERROR(be_.permute(patch_rows, {0, 2, 1}, by_channel3));
    SLIDE_ASSIGN_OR_RETURN(mean, empty({N, D}, "mean of patch tokens"));
    SLIDE_RETURN_IF_ERROR(be_.global_avg_pool_forward(by_channel, mean));
    if (c.fc_norm) SLIDE_RETURN_IF_ERROR(be_.layer_norm_forward(mean, norm_w_, norm_b_, c.norm_eps, mean));
  }
  for (int64_t n = 0; n < N; ++n) {
    int64_t at = n * F;
    if (c.pool != VitPool::kMean) {
      SLIDE_RETURN_IF_ERROR(copy_f32(be_, x, n * T * D, features, at, D));
      at += D;
    }
    if (c.pool != VitPool::kToken) SLIDE_RETURN_IF_ERROR(copy_f32(be_, mean, n * D, features, at, D));
  }
  return ok_status();
}

Status VisionTransformer::attentional_pool(const Tensor& x, int64_t N, Tensor& features) {
  const VitConfig& c = config_;
  const int64_t T = c.tokens(), D = c.width, E = c.pool_dim, H = c.pool_heads, Dh = E / H;
  const AttnPool& ap = attn_pool_;
  Allocator& alloc = be_.allocator();
  auto empty = [&](const Shape& s, const char* what) { return Tensor::empty(s, DType::kF32, alloc, what); };
  // nn.MultiheadAttention's in_proj_bias is [b_q, b_k, b_v].
  SLIDE_ASSIGN_OR_RETURN(Tensor b_q, ap.in_b.view(0, {E}));
  SLIDE_ASSIGN_OR_RETURN(Tensor b_k, ap.in_b.view(E, {E}));
  SLIDE_ASSIGN_OR_RETURN(Tensor b_v, ap.in_b.view(2 * E, {E}));
  // The query: the same for every image (one learned query, no input).
  SLIDE_ASSIGN_OR_RETURN(Tensor q_norm, empty({1, E}, "pooler query (normalised)"));
  SLIDE_ASSIGN_OR_RETURN(Tensor q, empty({1, E}, "pooler query projected"));
  SLIDE_RETURN_IF_ERROR(be_.layer_norm_forward(ap.query, ap.ln_q_w, ap.ln_q_b, c.pool_eps, q_norm));
  SLIDE_RETURN_IF_ERROR(be_.linear_forward(q_norm, ap.q_w, b_q, q));
  // Keys and values of every token, heads split: [N*T, E] -> [N, H, T, Dh].
  SLIDE_ASSIGN_OR_RETURN(Tensor k_in, empty({N * T, D}, "pooler keys' input"));
  SLIDE_RETURN_IF_ERROR(be_.layer_norm_forward(x, ap.ln_k_w, ap.ln_k_b, c.pool_eps, k_in));
  SLIDE_ASSIGN_OR_RETURN(Tensor proj, empty({N * T, E}, "pooler key/value projection"));
  SLIDE_ASSIGN_OR_RETURN(Tensor keys, empty({N, H, T, Dh}, "pooler keys"));
  SLIDE_ASSIGN_OR_RETURN(Tensor values, empty({N, H, T, Dh}, "pooler values"));
  SLIDE_ASSIGN_OR_RETURN(Tensor proj4, proj.reshape({N, T, H, Dh}));
  SLIDE_RETURN_IF_ERROR(be_.linear_forward(k_in, ap.k_w, b_k, proj));
  SLIDE_RETURN_IF_ERROR(be_.permute(proj4, {0, 2, 1, 3}, keys));
  SLIDE_RETURN_IF_ERROR(be_.linear_forward(k_in, ap.v_w, b_v, proj));
  SLIDE_RETURN_IF_ERROR(be_.permute(proj4, {0, 2, 1, 3}, values));
  // Per image and head: softmax(q_h k_h^T / sqrt(Dh)) v_h, into the heads' columns of ctx [N, E].
  SLIDE_ASSIGN_OR_RETURN(Tensor scores, empty({1, T}, "pooler attention scores"));
  SLIDE_ASSIGN_OR_RETURN(Tensor ctx, empty({N, E}, "pooler context"));
  const double scale = 1.0 / std::sqrt(static_cast<double>(Dh));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      SLIDE_ASSIGN_OR_RETURN(Tensor q_h, q.view(h * Dh, {1, Dh}));
      SLIDE_ASSIGN_OR_RETURN(Tensor k_h, keys.view((n * H + h) * T * Dh, {T, Dh}));
      SLIDE_ASSIGN_OR_RETURN(Tensor v_h, values.view((n * H + h) * T * Dh, {T, Dh}));
      SLIDE_ASSIGN_OR_RETURN(Tensor out_h, ctx.view(n * E + h * Dh, {1, Dh}));
      SLIDE_RETURN_IF_ERROR(be_.matmul(q_h, false, k_h, true, scores));
      SLIDE_RETURN_IF_ERROR(be_.scale(scores, scale, scores));
      SLIDE_RETURN_IF_ERROR(be_.softmax_forward(scores, scores));
      SLIDE_RETURN_IF_ERROR(be_.matmul(scores, false, v_h, false, out_h));
    }
  // out_proj, then ln_contrast into the features.
  SLIDE_ASSIGN_OR_RETURN(Tensor pooled, empty({N, E}, "pooler output"));
  SLIDE_RETURN_IF_ERROR(be_.linear_forward(ctx, ap.out_w, ap.out_b, pooled));
  return be_.layer_norm_forward(pooled, ap.ln_w, ap.ln_b, c.pool_eps, features);
}

int default_vit_heads(int width) {
  // timm's vision_transformer.py: vit_huge_patch14_* (embed_dim 1280, num_heads 16: Virchow's
  // trunk) and vit_gigantic_patch14_* (1664, num_heads 16); every other published width has heads
  // of 64 (ViT-S 384 / 6, ViT-B 768 / 12, ViT-L 1024 / 16, ViT-g 1536 / 24).
  if (width == 1280 || width == 1664) return 16;
  return width / 64;
}

Result<VitConfig> infer_vit_config(const std::map<std::string, Shape>& shapes, int heads, VitPool pool,
                                   const std::string& path, const std::string& name_prefix, int pool_heads) {
  auto shape = [&](const std::string& name) -> const Shape* {
    auto it = shapes.find(name_prefix + name);
    return it == shapes.end() ? nullptr : &it->second;
  };
  auto bad = [&](const std::string& what) {
    return invalid_argument(path + ": not a timm Vision Transformer weight file: " + what);
  };
  VitConfig c;
  const Shape* pw = shape("patch_embed.proj.weight");
  if (pw == nullptr || pw->size() != 4 || (*pw)[1] != 3 || (*pw)[2] != (*pw)[3])
    return bad("patch_embed.proj.weight [D, 3, P, P] is missing or misshapen");
  c.width = static_cast<int>((*pw)[0]);
  c.patch_size = static_cast<int>((*pw)[2]);
  c.class_token = shape("cls_token") != nullptr;
  const Shape* reg = shape("reg_token");
  c.reg_tokens = reg != nullptr && reg->size() == 3 ? static_cast<int>((*reg)[1]) : 0;
  const Shape* pos = shape("pos_embed");
  if (pos == nullptr || pos->size() != 3 || (*pos)[2] != c.width) return bad("pos_embed [1, L, D] is missing or misshapen");
  auto square = [](int64_t v) {
    const auto r = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(v))));
    return r > 0 && r * r == v ? r : int64_t{0};
  };
  const int64_t L = (*pos)[1], prefix = (c.class_token ? 1 : 0) + c.reg_tokens;
  if (int64_t g = square(L - prefix); g > 0 && L > prefix) {
    c.no_embed_class = false;
    c.image_size = static_cast<int>(g * c.patch_size);
  } else if (int64_t g2 = square(L); g2 > 0) {
    c.no_embed_class = true;
    c.image_size = static_cast<int>(g2 * c.patch_size);
  } else {
    return bad("pos_embed's " + std::to_string(L) + " positions are not a square grid (plus " + std::to_string(prefix) +
               " prefix tokens)");
  }
  c.depth = 0;
  while (shape("blocks." + std::to_string(c.depth) + ".attn.qkv.weight") != nullptr) ++c.depth;
  if (c.depth == 0) return bad("no blocks.0.attn.qkv.weight");
  const Shape* fc1 = shape("blocks.0.mlp.fc1.weight");
  const Shape* fc2 = shape("blocks.0.mlp.fc2.weight");
  if (fc1 == nullptr || fc2 == nullptr || fc1->size() != 2 || fc2->size() != 2)
    return bad("blocks.0.mlp.fc1.weight / fc2.weight are missing or not matrices (a separate-gate SwiGLU, "
               "mlp.w12/w3, is not supported)");
  c.mlp_hidden = static_cast<int>((*fc2)[1]);
  if ((*fc1)[0] == 2 * (*fc2)[1]) c.swiglu = true;  // timm SwiGLUPacked: fc1 produces both halves
  else if ((*fc1)[0] != (*fc2)[1])
    return bad("blocks.0.mlp.fc1.weight's " + std::to_string((*fc1)[0]) + " outputs fit neither fc2's " +
               std::to_string((*fc2)[1]) + " inputs (GELU MLP) nor twice them (SwiGLU)");
  c.layer_scale = shape("blocks.0.ls1.gamma") != nullptr;
  c.fc_norm = shape("fc_norm.weight") != nullptr && shape("norm.weight") == nullptr;
  c.heads = heads > 0 ? heads : default_vit_heads(c.width);  // checked by VisionTransformer::create
  c.pool = pool;
  c.name_prefix = name_prefix;
  if (c.fc_norm && c.pool != VitPool::kMean) c.pool = VitPool::kMean;  // timm: fc_norm comes with avg pooling
  if (c.pool == VitPool::kAttentional) {
    const std::string query = c.pool_prefix() + "attn_pool_contrast.query";
    auto it = shapes.find(query);
    if (it == shapes.end())
      return invalid_argument(path + ": attentional pooling asks for " + query +
                              " (CoCa's contrastive pooler, as in CONCH's checkpoint), which the file lacks");
    if (it->second.size() != 2 || it->second[0] != 1)
      return invalid_argument(path + ": " + query + " is " + shape_string(it->second) +
                              "; the contrastive pooler has one query [1, E]");
    c.pool_dim = static_cast<int>(it->second[1]);
    c.pool_heads = pool_heads;
  }
  return c;
}

namespace {

// What each preset is (vit.h, with sources); "vit" takes what the file says. mlp 0 and
// no_embed_class -1: not checked.
struct VitPreset {
  int width, depth, patch, heads;
  bool layer_scale, swiglu;
  int reg_tokens;
  VitPool pool;
  int mlp;             // fc2's input width (the SwiGLU half for SwiGLU MLPs)
  int no_embed_class;  // 1: pos_embed over the patch tokens only; 0: over every token
  float mean[3], std[3];
  int pool_dim = 0, pool_heads = 0;  // the attentional pooler's width and heads (0: none)
};

constexpr float kIn1kMean[3] = {0.485f, 0.456f, 0.406f}, kIn1kStd[3] = {0.229f, 0.224f, 0.225f};

const std::map<std::string, VitPreset>& vit_presets() {
  auto with = [](VitPreset p, const float* mean, const float* sd) {
    for (int i = 0; i < 3; ++i) p.mean[i] = mean[i], p.std[i] = sd[i];
    return p;
  };
  // H-optimus-0's own normalisation (bioptimus/H-optimus-0 config.json pretrained_cfg, model card).
  constexpr float kHoptimusMean[3] = {0.707223f, 0.578729f, 0.703617f};
  constexpr float kHoptimusStd[3] = {0.211883f, 0.230117f, 0.177517f};
  // OpenAI CLIP's (CONCH's constants.py OPENAI_DATASET_MEAN / OPENAI_DATASET_STD).
  constexpr float kClipMean[3] = {0.48145466f, 0.4578275f, 0.40821073f};
  constexpr float kClipStd[3] = {0.26862954f, 0.26130258f, 0.27577711f};
  auto pooled = [](VitPreset p, int dim, int heads) {
    p.pool_dim = dim, p.pool_heads = heads;
    return p;
  };
  static const std::map<std::string, VitPreset> presets = {
      {"vit-b16", with({768, 12, 16, 12, false, false, 0, VitPool::kToken, 0, -1, {}, {}}, kIn1kMean, kIn1kStd)},
      {"vit-l16", with({1024, 24, 16, 16, false, false, 0, VitPool::kToken, 0, -1, {}, {}}, kIn1kMean, kIn1kStd)},
      {"uni", with({1024, 24, 16, 16, true, false, 0, VitPool::kToken, 0, -1, {}, {}}, kIn1kMean, kIn1kStd)},
      {"uni2-h", with({1536, 24, 14, 24, true, true, 8, VitPool::kToken, 0, -1, {}, {}}, kIn1kMean, kIn1kStd)},
      {"virchow2",
       with({1280, 32, 14, 16, true, true, 4, VitPool::kTokenAndMean, 0, -1, {}, {}}, kIn1kMean, kIn1kStd)},
      // timm vit_giant_patch14_dinov2 with prov-gigapath's model_args (patch 16, mlp_ratio 5.33334).
      {"gigapath", with({1536, 40, 16, 24, true, true, 0, VitPool::kToken, 4096, 0, {}, {}}, kIn1kMean, kIn1kStd)},
      // timm vit_giant_patch14_reg4_dinov2 (reg_tokens 4, no_embed_class) at img_size 224.
      {"hoptimus0",
       with({1536, 40, 14, 24, true, true, 4, VitPool::kToken, 4096, 1, {}, {}}, kHoptimusMean, kHoptimusStd)},
      // CONCH (conch_ViT-B-16.json): timm ViT-B/16 at 448 px, attentional pooler 512 wide, 8 heads.
      {"conch-vit-b",
       pooled(with({768, 12, 16, 12, false, false, 0, VitPool::kAttentional, 3072, 0, {}, {}}, kClipMean, kClipStd),
              512, 8)},
  };
  return presets;
}

}  // namespace

bool is_vit_preset(const std::string& model) { return model == "vit" || vit_presets().count(model) > 0; }

const std::string& vit_preset_list() {
  static const std::string list = "vit, vit-b16, vit-l16, uni, uni2-h, virchow2, gigapath, hoptimus0, conch-vit-b";
  return list;
}

VitNormalisation vit_preset_normalisation(const std::string& preset) {
  VitNormalisation n;
  const auto it = vit_presets().find(preset);
  for (int i = 0; i < 3; ++i) {
    n.mean[i] = it != vit_presets().end() ? it->second.mean[i] : kIn1kMean[i];
    n.std[i] = it != vit_presets().end() ? it->second.std[i] : kIn1kStd[i];
  }
  return n;
}

Status check_vit_preset(const VitConfig& c, const std::string& preset, const std::string& path) {
  if (!is_vit_preset(preset))
    return invalid_argument("unknown ViT preset '" + preset + "' (" + vit_preset_list() + ")");
  const auto it = vit_presets().find(preset);
  if (it == vit_presets().end()) return ok_status();  // "vit": any
  const VitPreset& w = it->second;
  auto describe = [](int width, int depth, int patch, bool ls, bool glu, int reg, int mlp, int nec) {
    std::string d = "width " + std::to_string(width) + ", depth " + std::to_string(depth) + ", patch " +
                    std::to_string(patch) + (ls ? ", layer scale" : ", no layer scale") +
                    (glu ? ", SwiGLU" : ", GELU MLP") + ", " + std::to_string(reg) + " register tokens";
    if (mlp > 0) d += ", MLP width " + std::to_string(mlp);
    if (nec >= 0) d += nec ? ", pos_embed over the patches only" : ", pos_embed over every token";
    return d;
  };
  const bool mlp_ok = w.mlp == 0 || c.mlp_hidden == w.mlp;
  const bool nec_ok = w.no_embed_class < 0 || c.no_embed_class == (w.no_embed_class == 1);
  if (c.width != w.width || c.depth != w.depth || c.patch_size != w.patch || c.layer_scale != w.layer_scale ||
      c.swiglu != w.swiglu || c.reg_tokens != w.reg_tokens || !mlp_ok || !nec_ok)
    return invalid_argument(path + " is a ViT of " +
                            describe(c.width, c.depth, c.patch_size, c.layer_scale, c.swiglu, c.reg_tokens,
                                     w.mlp > 0 ? c.mlp_hidden : 0, w.no_embed_class >= 0 ? int{c.no_embed_class} : -1) +
                            "; " + preset + " is " +
                            describe(w.width, w.depth, w.patch, w.layer_scale, w.swiglu, w.reg_tokens, w.mlp,
                                     w.no_embed_class) +
                            " (use --model vit for another ViT)");
  if (w.pool_dim > 0 && c.pool == VitPool::kAttentional && c.pool_dim != w.pool_dim)
    return invalid_argument(path + "'s attentional pooler is " + std::to_string(c.pool_dim) + " wide; " + preset +
                            "'s is " + std::to_string(w.pool_dim) + " (use --model vit for another ViT)");
  return ok_status();
}

Status resample_pos_embed(const float* src, int64_t prefix, int64_t old_grid, int64_t new_grid, int64_t D, float* dst) {
  if (old_grid < 1 || new_grid < 1 || D < 1 || prefix < 0)
    return invalid_argument("resample_pos_embed: grids " + std::to_string(old_grid) + " -> " + std::to_string(new_grid) +
                            ", width " + std::to_string(D) + ", prefix " + std::to_string(prefix));
  std::memcpy(dst, src, static_cast<size_t>(prefix * D) * sizeof(float));  // prefix tokens kept
  if (old_grid == new_grid) {
    std::memcpy(dst + prefix * D, src + prefix * D, static_cast<size_t>(old_grid * old_grid * D) * sizeof(float));
    return ok_status();
  }
  // Tokens [g0*g0, D] -> planes [D, g0, g0] (timm: reshape(1, g0, g0, D).permute(0, 3, 1, 2)).
  const int64_t n0 = old_grid * old_grid, n1 = new_grid * new_grid;
  std::vector<float> planes(static_cast<size_t>(D * n0)), resized(static_cast<size_t>(D * n1));
  for (int64_t t = 0; t < n0; ++t)
    for (int64_t d = 0; d < D; ++d) planes[static_cast<size_t>(d * n0 + t)] = src[(prefix + t) * D + d];
  SLIDE_RETURN_IF_ERROR(
      resize_planes_bicubic_aa(planes.data(), D, old_grid, old_grid, new_grid, new_grid, resized.data()));
  // Back to tokens [g*g, D] (permute(0, 2, 3, 1).reshape(1, -1, D)).
  for (int64_t t = 0; t < n1; ++t)
    for (int64_t d = 0; d < D; ++d) dst[(prefix + t) * D + d] = resized[static_cast<size_t>(d * n1 + t)];
  return ok_status();
}

Result<std::unique_ptr<VitEncoder>> VitEncoder::load(const std::string& weights, const std::string& preset, int heads,
                                                     const std::string& pool, std::unique_ptr<Backend> be,
                                                     int image_size) {
  if (be == nullptr) return invalid_argument("ViT encoder: no backend");
  if (!is_vit_preset(preset))
    return invalid_argument("unknown ViT preset '" + preset + "' (" + vit_preset_list() + ")");
  const auto preset_it = vit_presets().find(preset);
  VitPool p = preset_it != vit_presets().end() ? preset_it->second.pool : VitPool::kToken;
  if (pool == "token") p = VitPool::kToken;
  else if (pool == "mean") p = VitPool::kMean;
  else if (pool == "token+mean") p = VitPool::kTokenAndMean;
  else if (pool == "attention") p = VitPool::kAttentional;
  else if (!pool.empty()) return invalid_argument("--pool '" + pool + "': expected token, mean, token+mean or attention");
  if (heads <= 0 && preset_it != vit_presets().end()) heads = preset_it->second.heads;
  const int pool_heads =
      preset_it != vit_presets().end() && preset_it->second.pool_heads > 0 ? preset_it->second.pool_heads : 8;
  SLIDE_ASSIGN_OR_RETURN(auto shapes, read_safetensors_shapes(weights));
  // open_clip's CoCa layout (CONCH): the timm trunk under visual.trunk.
  const std::string prefix = shapes.count("visual.trunk.patch_embed.proj.weight") > 0 ? "visual.trunk." : "";
  SLIDE_ASSIGN_OR_RETURN(VitConfig c, infer_vit_config(shapes, heads, p, weights, prefix, pool_heads));
  SLIDE_RETURN_IF_ERROR(check_vit_preset(c, preset, weights));
  if (image_size < 0 || (image_size > 0 && (image_size < c.patch_size || image_size % c.patch_size != 0)))
    return invalid_argument("--image-size " + std::to_string(image_size) + " is not a multiple of the patch size " +
                            std::to_string(c.patch_size) + " of " + weights);
  if (image_size > 0 && image_size != c.image_size) {
    c.source_image_size = c.image_size;
    c.image_size = image_size;
  }
  auto enc = std::unique_ptr<VitEncoder>(new VitEncoder());
  const VitNormalisation norm = vit_preset_normalisation(preset);
  for (int i = 0; i < 3; ++i) enc->mean_[i] = norm.mean[i], enc->std_[i] = norm.std[i];
  enc->be_ = std::move(be);
  SLIDE_ASSIGN_OR_RETURN(enc->vit_, VisionTransformer::create(*enc->be_, c));
  SLIDE_RETURN_IF_ERROR(enc->vit_->load(weights));
  enc->layer_ = c.pool == VitPool::kToken          ? "token"
                : c.pool == VitPool::kMean         ? "mean"
                : c.pool == VitPool::kTokenAndMean ? "token+mean"
                                                   : "attention";
  return enc;
}

Status VitEncoder::extract(const float* images, int64_t n, int64_t h, int64_t w, float* features) {
  const int64_t S = vit_->config().image_size;
  if (n < 1 || h != S || w != S)
    return invalid_argument("ViT encoder: " + std::to_string(n) + " images of " + std::to_string(h) + "x" +
                            std::to_string(w) + " px; it takes " + std::to_string(S) + "x" + std::to_string(S));
  Allocator& alloc = be_->allocator();
  SLIDE_ASSIGN_OR_RETURN(Tensor x, Tensor::empty({n, 3, S, S}, DType::kF32, alloc, "ViT input"));
  SLIDE_ASSIGN_OR_RETURN(Tensor f, Tensor::empty({n, feature_dim()}, DType::kF32, alloc, "ViT features"));
  if (be_->device() == Device::kCpu) {
    std::memcpy(x.raw(), images, x.bytes());
    SLIDE_RETURN_IF_ERROR(vit_->forward(x, f));
    std::memcpy(features, f.raw(), f.bytes());
    return ok_status();
  }
  // A device backend: through host tensors and the backend's one door (upload / download).
  SLIDE_ASSIGN_OR_RETURN(Tensor xh, Tensor::empty(x.shape(), DType::kF32, cpu_allocator(), "ViT input (host)"));
  SLIDE_ASSIGN_OR_RETURN(Tensor fh, Tensor::empty(f.shape(), DType::kF32, cpu_allocator(), "ViT features (host)"));
  std::memcpy(xh.raw(), images, xh.bytes());
  SLIDE_RETURN_IF_ERROR(be_->upload(xh, x));
  SLIDE_RETURN_IF_ERROR(vit_->forward(x, f));
  SLIDE_RETURN_IF_ERROR(be_->download(f, fh));
  std::memcpy(features, fh.raw(), fh.bytes());
  return ok_status();
}

}  // namespace slide::train
