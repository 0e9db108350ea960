// Resampling (resample.h) and the ViT's positional-embedding resampling and presets (vit.h):
// Keys' kernel at known points, the per-axis weights, the 8-bit resizer on a real tile against a
// direct floating-point evaluation of the same formula, the float resizer against values printed
// by PyTorch 1.13's F.interpolate(mode='bicubic', antialias=True), and the giant presets'
// architecture checks through infer_vit_config's shape maps (their full-size weight files are
// 4.5 GB, too large to write in a test).
//
// The comparison against PIL and PyTorch themselves on real tiles is tests/e2e/test_vit.py
// (TestResample), which drives the test case "resample: jobs from the e2e test" below (suite
// resample_io, excluded from the plain run) with SLIDE_RESAMPLE_JOB naming a job file.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "slide/core/file.h"
#include "slide/tile/image.h"
#include "slide/train/resample.h"
#include "slide/train/vit.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_resample {

using namespace slide::train;

namespace {

// A real H&E tile: the first LC25000 patch of sample_data (224 x 224 JPEG), decoded.
slide::tile::RgbImage real_tile() {
  const std::string dir = std::string(SLIDE_SAMPLE_DIR) + "/patches/lc25000-lung-subset/lung_aca";
  std::vector<std::string> paths;
  for (const auto& e : std::filesystem::directory_iterator(dir)) paths.push_back(e.path().string());
  REQUIRE(!paths.empty());
  std::sort(paths.begin(), paths.end());
  auto bytes = slide::core::read_file(paths.front());
  REQUIRE(bytes.ok());
  auto img = slide::tile::decode_jpeg(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size()));
  REQUIRE(img.ok());
  return std::move(*img);
}

// The resize formula of resample.h evaluated directly in double (no fixed point, no precomputed
// tables), each pass rounded to the nearest 8-bit value and clipped: the oracle for BicubicResizer.
std::vector<uint8_t> direct_resize(const std::vector<uint8_t>& in, int64_t iw, int64_t ih, int64_t ow, int64_t oh) {
  auto pass = [](const std::vector<uint8_t>& src, int64_t n_in, int64_t n_out, int64_t lines, bool horizontal,
                 int64_t width) {
    // horizontal: src is lines x n_in (x3); vertical: src is n_in x width (x3).
    std::vector<uint8_t> dst(static_cast<size_t>((horizontal ? lines * n_out : n_out * width) * 3));
    const double scale = static_cast<double>(n_in) / n_out, fs = std::max(scale, 1.0), support = 2 * fs;
    for (int64_t o = 0; o < n_out; ++o) {
      const double c = (o + 0.5) * scale;
      const int64_t lo = std::max<int64_t>(static_cast<int64_t>(c - support + 0.5), 0);
      const int64_t hi = std::min<int64_t>(static_cast<int64_t>(c + support + 0.5), n_in);
      std::vector<double> w;
      double total = 0;
      for (int64_t j = lo; j < hi; ++j) total += w.emplace_back(cubic_kernel((j - c + 0.5) / fs, -0.5));
      const int64_t other = horizontal ? lines : width;
      for (int64_t l = 0; l < other; ++l)
        for (int ch = 0; ch < 3; ++ch) {
          double s = 0;
          for (int64_t j = lo; j < hi; ++j) {
            const size_t at = horizontal ? static_cast<size_t>((l * n_in + j) * 3 + ch)
                                         : static_cast<size_t>((j * width + l) * 3 + ch);
            s += w[static_cast<size_t>(j - lo)] / total * src[at];
          }
          const double v = std::min(255.0, std::max(0.0, std::floor(s + 0.5)));
          const size_t out_at = horizontal ? static_cast<size_t>((l * n_out + o) * 3 + ch)
                                           : static_cast<size_t>((o * width + l) * 3 + ch);
          dst[out_at] = static_cast<uint8_t>(v);
        }
    }
    return dst;
  };
  std::vector<uint8_t> mid = iw == ow ? in : pass(in, iw, ow, ih, true, 0);
  return ih == oh ? mid : pass(mid, ih, oh, 0, false, ow);
}

}  // namespace

TEST_CASE("cubic_kernel: Keys' kernel at known points (a = -0.5, Pillow's bicubic_filter; a = -0.75, PyTorch's)") {
  CHECK(cubic_kernel(0.0, -0.5) == 1.0);
  CHECK(cubic_kernel(1.0, -0.5) == doctest::Approx(0.0));
  CHECK(cubic_kernel(2.0, -0.5) == 0.0);
  CHECK(cubic_kernel(0.5, -0.5) == doctest::Approx(0.5625));    // (1.5 * 0.5 - 2.5) * 0.25 + 1
  CHECK(cubic_kernel(-1.5, -0.5) == doctest::Approx(-0.0625));  // ((-3.5 * 1.5 + 8) * 1.5 - 4) * -0.5
  CHECK(cubic_kernel(0.5, -0.75) == doctest::Approx(0.59375));
}

TEST_CASE("antialiased_cubic_axis: weights sum to 1, identity at equal sizes, support widened when downsampling") {
  auto same = antialiased_cubic_axis(7, 7);
  OK(same);
  for (int64_t i = 0; i < 7; ++i) {
    const double* w = same->weights.data() + i * same->taps;
    for (int64_t j = 0; j < same->count[i]; ++j)
      CHECK(w[j] == doctest::Approx(same->first[i] + j == i ? 1.0 : 0.0));
  }
  for (auto [in, out] : {std::pair<int64_t, int64_t>{256, 224}, {150, 224}, {224, 150}, {14, 16}, {16, 10}}) {
    auto ax = antialiased_cubic_axis(in, out);
    OK(ax);
    CHECK(ax->taps == static_cast<int64_t>(std::ceil(2.0 * std::max(1.0, double(in) / out))) * 2 + 1);
    for (int64_t i = 0; i < out; ++i) {
      double s = 0;
      int64_t fixed = 0;
      for (int64_t j = 0; j < ax->taps; ++j) s += ax->weights[i * ax->taps + j], fixed += ax->fixed[i * ax->taps + j];
      CHECK(s == doctest::Approx(1.0));
      CHECK(std::llabs(fixed - (int64_t{1} << 22)) <= ax->taps);  // rounded per weight
      CHECK(ax->first[i] >= 0);
      CHECK(ax->first[i] + ax->count[i] <= in);
    }
  }
  auto bad = antialiased_cubic_axis(0, 5);
  CHECK(bad.status().code() == slide::core::StatusCode::kInvalidArgument);
}

TEST_CASE("BicubicResizer: a real tile, down (224 -> 150) and up (224 -> 256), equals the direct formula within 1 level") {
  const auto img = real_tile();
  REQUIRE(img.width == 224);
  REQUIRE(img.height == 224);
  std::vector<uint8_t> scratch;
  for (int64_t out : {150, 256, 224}) {
    auto r = BicubicResizer::create(224, 224, out, out);
    OK(r);
    std::vector<uint8_t> got(static_cast<size_t>(out * out * 3));
    r->resize(img.pixels.data(), got.data(), scratch);
    const auto want = direct_resize(img.pixels, 224, 224, out, out);
    int worst = 0;
    int64_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const int d = std::abs(int{got[i]} - int{want[i]});
      worst = std::max(worst, d);
      differ += d > 0;
    }
    MESSAGE("224 -> " << out << ": max difference " << worst << " level(s), " << differ << " of " << got.size()
                      << " values differ");
    CHECK(worst <= 1);
    if (out == 224) CHECK(got == img.pixels);  // equal sizes: a copy
  }
  // A constant image stays constant (weights sum to 1 in fixed point, rounding included).
  std::vector<uint8_t> flat(100 * 100 * 3, 200), out(37 * 37 * 3);
  auto r = BicubicResizer::create(100, 100, 37, 37);
  OK(r);
  r->resize(flat.data(), out.data(), scratch);
  for (uint8_t v : out) REQUIRE(v == 200);
}

TEST_CASE("resize_planes_bicubic_aa equals PyTorch 1.13's F.interpolate(bicubic, antialias=True), up and down") {
  // x = torch.arange(16, dtype=torch.float32).reshape(1, 1, 4, 4) ** 1.5, then
  // F.interpolate(x, size=(5, 5) / (3, 3), mode='bicubic', antialias=True, align_corners=False).
  std::vector<float> x(16);
  for (int i = 0; i < 16; ++i) x[static_cast<size_t>(i)] = std::pow(static_cast<float>(i), 1.5f);
  const float up_row0[5] = {-0.3853403627872467f, 0.18024355173110962f, 1.3497532606124878f, 3.0868139266967773f,
                            4.719354152679443f};
  const float up_row4[5] = {42.15761947631836f, 45.836971282958984f, 50.48143005371094f, 55.29025650024414f,
                            59.27861022949219f};
  const float down[9] = {1.3789129257202148f,  3.659976005554199f,  6.926900386810303f,
                         15.638299942016602f,  20.778831481933594f, 26.36599349975586f,
                         38.689022064208984f,  45.528621673583984f, 52.71335220336914f};
  std::vector<float> up(25), dn(9);
  OK(resize_planes_bicubic_aa(x.data(), 1, 4, 4, 5, 5, up.data()));
  OK(resize_planes_bicubic_aa(x.data(), 1, 4, 4, 3, 3, dn.data()));
  for (int i = 0; i < 5; ++i) {
    CHECK(up[static_cast<size_t>(i)] == doctest::Approx(up_row0[i]).epsilon(1e-5));
    CHECK(up[static_cast<size_t>(20 + i)] == doctest::Approx(up_row4[i]).epsilon(1e-5));
  }
  for (int i = 0; i < 9; ++i) CHECK(dn[static_cast<size_t>(i)] == doctest::Approx(down[i]).epsilon(1e-5));
}

TEST_CASE("resample_pos_embed: prefix rows kept, equal grids copied, a constant grid stays constant") {
  const int64_t D = 3, prefix = 2, g0 = 4, g1 = 6;
  std::vector<float> src(static_cast<size_t>((prefix + g0 * g0) * D)), dst(static_cast<size_t>((prefix + g1 * g1) * D));
  for (size_t i = 0; i < src.size(); ++i) src[i] = i < static_cast<size_t>(prefix * D) ? 100.0f + i : 0.5f;
  OK(resample_pos_embed(src.data(), prefix, g0, g1, D, dst.data()));
  for (int64_t i = 0; i < prefix * D; ++i) CHECK(dst[static_cast<size_t>(i)] == src[static_cast<size_t>(i)]);
  for (int64_t i = prefix * D; i < static_cast<int64_t>(dst.size()); ++i)
    CHECK(dst[static_cast<size_t>(i)] == doctest::Approx(0.5));
  std::vector<float> same(src.size());
  OK(resample_pos_embed(src.data(), prefix, g0, g0, D, same.data()));
  CHECK(same == src);
  CHECK(resample_pos_embed(src.data(), prefix, 0, g1, D, dst.data()).code() == slide::core::StatusCode::kInvalidArgument);
}

namespace {

// The tensor shapes of a timm ViT-g weight file (timm's vision_transformer.py, VisionTransformer's
// parameters) for the giant presets: width 1536, SwiGLUPacked fc1 [8192, 1536], fc2 [1536, 4096].
std::map<std::string, Shape> giant_shapes(int depth, int patch, int grid, int reg, bool no_embed_class) {
  const int64_t D = 1536;
  std::map<std::string, Shape> s;
  s["cls_token"] = {1, 1, D};
  if (reg > 0) s["reg_token"] = {1, reg, D};
  s["pos_embed"] = {1, grid * grid + (no_embed_class ? 0 : 1 + reg), D};
  s["patch_embed.proj.weight"] = {D, 3, patch, patch};
  s["patch_embed.proj.bias"] = {D};
  for (int i = 0; i < depth; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    s[b + "attn.qkv.weight"] = {3 * D, D};
    s[b + "ls1.gamma"] = {D};
    s[b + "mlp.fc1.weight"] = {8192, D};
    s[b + "mlp.fc2.weight"] = {D, 4096};
  }
  s["norm.weight"] = {D};
  return s;
}

}  // namespace

TEST_CASE("the head count of a timm file without --heads is timm's for its width: ViT-H and ViT-G have 16") {
  CHECK(default_vit_heads(384) == 6);
  CHECK(default_vit_heads(768) == 12);
  CHECK(default_vit_heads(1024) == 16);
  CHECK(default_vit_heads(1280) == 16);  // vit_huge_patch14: 16 heads of 80, not 20 of 64
  CHECK(default_vit_heads(1536) == 24);
  CHECK(default_vit_heads(1664) == 16);  // vit_gigantic_patch14: 16 heads of 104
  std::map<std::string, Shape> huge;
  const int64_t D = 1280;
  huge["cls_token"] = {1, 1, D};
  huge["pos_embed"] = {1, 16 * 16 + 1, D};
  huge["patch_embed.proj.weight"] = {D, 3, 14, 14};
  huge["blocks.0.attn.qkv.weight"] = {3 * D, D};
  huge["blocks.0.mlp.fc1.weight"] = {5120, D};
  huge["blocks.0.mlp.fc2.weight"] = {D, 5120};
  huge["norm.weight"] = {D};
  auto c = infer_vit_config(huge, 0, VitPool::kToken, "vit_huge.safetensors");
  OK(c);
  CHECK(c->heads == 16);
  auto given = infer_vit_config(huge, 20, VitPool::kToken, "vit_huge.safetensors");
  OK(given);
  CHECK(given->heads == 20);  // --heads wins
}

TEST_CASE("gigapath and hoptimus0: the published architectures pass their preset's check; others are refused, named") {
  // prov-gigapath/prov-gigapath: vit_giant_patch14_dinov2 with patch 16 at 224 px (14 x 14 grid).
  auto giga = infer_vit_config(giant_shapes(40, 16, 14, 0, false), 24, VitPool::kToken, "gigapath.safetensors");
  OK(giga);
  CHECK(giga->image_size == 224);
  CHECK(giga->swiglu);
  CHECK(giga->mlp_hidden == 4096);
  CHECK(giga->layer_scale);
  CHECK(giga->feature_dim() == 1536);
  OK(check_vit_preset(*giga, "gigapath", "gigapath.safetensors"));
  // bioptimus/H-optimus-0: vit_giant_patch14_reg4_dinov2 at 224 px (16 x 16 grid, no_embed_class).
  auto hopt = infer_vit_config(giant_shapes(40, 14, 16, 4, true), 24, VitPool::kToken, "h0.safetensors");
  OK(hopt);
  CHECK(hopt->image_size == 224);
  CHECK(hopt->no_embed_class);
  CHECK(hopt->reg_tokens == 4);
  CHECK(hopt->feature_dim() == 1536);
  OK(check_vit_preset(*hopt, "hoptimus0", "h0.safetensors"));
  // Each refuses the other, and a file one block short, naming the file and what the preset is.
  auto s = check_vit_preset(*hopt, "gigapath", "h0.safetensors");
  CHECK(s.code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(s.message().find("h0.safetensors is a ViT of width 1536, depth 40, patch 14") != std::string::npos);
  CHECK(s.message().find("gigapath is width 1536, depth 40, patch 16") != std::string::npos);
  auto short_h0 = infer_vit_config(giant_shapes(39, 14, 16, 4, true), 24, VitPool::kToken, "h0.safetensors");
  OK(short_h0);
  s = check_vit_preset(*short_h0, "hoptimus0", "h0.safetensors");
  CHECK(s.message().find("depth 39") != std::string::npos);
  CHECK(s.message().find("hoptimus0 is width 1536, depth 40, patch 14, layer scale, SwiGLU, 4 register tokens, MLP "
                         "width 4096, pos_embed over the patches only") != std::string::npos);
  // H-optimus-0 with pos_embed over every token is not the published file.
  auto embed_all = infer_vit_config(giant_shapes(40, 14, 16, 4, false), 24, VitPool::kToken, "h0.safetensors");
  OK(embed_all);
  CHECK(!check_vit_preset(*embed_all, "hoptimus0", "h0.safetensors").ok());
  CHECK(check_vit_preset(*giga, "conch-vit-b", "x").code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(is_vit_preset("gigapath"));
  CHECK(is_vit_preset("hoptimus0"));
  CHECK(!is_vit_preset("ctranspath"));
  CHECK(vit_preset_list().find("gigapath, hoptimus0") != std::string::npos);
}

namespace {

// CONCH's checkpoint as open_clip names it (MahmoodLab/CONCH conch_ViT-B-16.json: a timm ViT-B/16
// at 448 px under visual.trunk., the contrastive pooler 512 wide), with a text tower entry.
std::map<std::string, Shape> conch_shapes(int64_t pool_dim, int64_t queries) {
  const int64_t D = 768;
  std::map<std::string, Shape> s;
  const std::string t = "visual.trunk.";
  s[t + "cls_token"] = {1, 1, D};
  s[t + "pos_embed"] = {1, 1 + 28 * 28, D};
  s[t + "patch_embed.proj.weight"] = {D, 3, 16, 16};
  for (int i = 0; i < 12; ++i) {
    const std::string b = t + "blocks." + std::to_string(i) + ".";
    s[b + "attn.qkv.weight"] = {3 * D, D};
    s[b + "mlp.fc1.weight"] = {3072, D};
    s[b + "mlp.fc2.weight"] = {D, 3072};
  }
  s[t + "norm.weight"] = {D};
  s["visual.attn_pool_contrast.query"] = {queries, pool_dim};
  s["visual.attn_pool_caption.query"] = {256, 768};
  s["text.token_embedding.weight"] = {32007, 768};
  return s;
}

}  // namespace

TEST_CASE("conch-vit-b: CONCH's open_clip layout passes its preset; the pooler is read from the file") {
  auto c = infer_vit_config(conch_shapes(512, 1), 12, VitPool::kAttentional, "conch.safetensors", "visual.trunk.", 8);
  OK(c);
  CHECK(c->image_size == 448);
  CHECK(c->name_prefix == "visual.trunk.");
  CHECK(c->pool_prefix() == "visual.");
  CHECK(c->pool_dim == 512);
  CHECK(c->pool_heads == 8);
  CHECK(c->feature_dim() == 512);
  CHECK(c->tokens() == 785);
  OK(check_vit_preset(*c, "conch-vit-b", "conch.safetensors"));
  CHECK(is_vit_preset("conch-vit-b"));
  // Another pooler width, or the captioning pooler's 256 queries, are not CONCH's contrastive one.
  auto wide = infer_vit_config(conch_shapes(768, 1), 12, VitPool::kAttentional, "w.safetensors", "visual.trunk.", 8);
  OK(wide);
  auto s = check_vit_preset(*wide, "conch-vit-b", "w.safetensors");
  CHECK(s.message().find("w.safetensors's attentional pooler is 768 wide; conch-vit-b's is 512") != std::string::npos);
  auto many = infer_vit_config(conch_shapes(512, 4), 12, VitPool::kAttentional, "q.safetensors", "visual.trunk.", 8);
  REQUIRE(!many.ok());
  CHECK(many.status().message().find("visual.attn_pool_contrast.query is [4, 512]") != std::string::npos);
  // Attentional pooling of a file without the pooler names what is missing.
  auto none = infer_vit_config(giant_shapes(40, 16, 14, 0, false), 24, VitPool::kAttentional, "g.safetensors");
  REQUIRE(!none.ok());
  CHECK(none.status().message().find("attn_pool_contrast.query") != std::string::npos);
  // The trunk alone (class token) is a ViT-B/16 at 448: vit-b16's shape with another image size.
  auto token = infer_vit_config(conch_shapes(512, 1), 12, VitPool::kToken, "conch.safetensors", "visual.trunk.");
  OK(token);
  CHECK(token->feature_dim() == 768);
  OK(check_vit_preset(*token, "vit-b16", "conch.safetensors"));
  // OpenAI CLIP's normalisation (CONCH's constants.py).
  const VitNormalisation n = vit_preset_normalisation("conch-vit-b");
  CHECK(n.mean[0] == doctest::Approx(0.48145466));
  CHECK(n.std[2] == doctest::Approx(0.27577711));
}

TEST_CASE("vit_preset_normalisation: H-optimus-0's and CONCH's own mean and std, ImageNet's for the others") {
  const VitNormalisation h0 = vit_preset_normalisation("hoptimus0");
  CHECK(h0.mean[0] == doctest::Approx(0.707223));
  CHECK(h0.mean[2] == doctest::Approx(0.703617));
  CHECK(h0.std[1] == doctest::Approx(0.230117));
  for (const char* p : {"vit", "uni", "gigapath", "virchow2"}) {
    const VitNormalisation n = vit_preset_normalisation(p);
    CHECK(n.mean[0] == doctest::Approx(0.485));
    CHECK(n.std[2] == doctest::Approx(0.225));
  }
}

// Driven by tests/e2e/test_vit.py (TestResample): SLIDE_RESAMPLE_JOB names a text file of jobs,
// one per line, on raw little-endian files the test wrote:
//   rgb IN W H OUT_W OUT_H OUT        8-bit RGB, BicubicResizer
//   pos IN PREFIX G0 G1 D OUT          f32 [PREFIX + G0^2, D], resample_pos_embed
// Without SLIDE_RESAMPLE_JOB it does nothing.
TEST_CASE("resample: jobs from the e2e test" * doctest::test_suite("resample_io")) {
  const char* job = std::getenv("SLIDE_RESAMPLE_JOB");
  if (job == nullptr) return;
  std::ifstream lines(job);
  REQUIRE(lines.good());
  std::string line;
  auto read_bytes = [](const std::string& path) {
    auto b = slide::core::read_file(path);
    REQUIRE(b.ok());
    return *b;
  };
  auto write_bytes = [](const std::string& path, const void* data, size_t n) {
    std::ofstream out(path, std::ios::binary);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    REQUIRE(out.good());
  };
  while (std::getline(lines, line)) {
    std::istringstream f(line);
    std::string kind, in, out;
    f >> kind >> in;
    if (kind == "rgb") {
      int64_t w = 0, h = 0, ow = 0, oh = 0;
      f >> w >> h >> ow >> oh >> out;
      const std::string bytes = read_bytes(in);
      REQUIRE(static_cast<int64_t>(bytes.size()) == w * h * 3);
      auto r = BicubicResizer::create(w, h, ow, oh);
      OK(r);
      std::vector<uint8_t> dst(static_cast<size_t>(ow * oh * 3)), scratch;
      r->resize(reinterpret_cast<const uint8_t*>(bytes.data()), dst.data(), scratch);
      write_bytes(out, dst.data(), dst.size());
    } else if (kind == "pos") {
      int64_t prefix = 0, g0 = 0, g1 = 0, D = 0;
      f >> prefix >> g0 >> g1 >> D >> out;
      const std::string bytes = read_bytes(in);
      REQUIRE(static_cast<int64_t>(bytes.size()) == (prefix + g0 * g0) * D * 4);
      std::vector<float> src(static_cast<size_t>((prefix + g0 * g0) * D)), dst(static_cast<size_t>((prefix + g1 * g1) * D));
      std::memcpy(src.data(), bytes.data(), bytes.size());
      OK(resample_pos_embed(src.data(), prefix, g0, g1, D, dst.data()));
      write_bytes(out, dst.data(), dst.size() * sizeof(float));
    } else if (!kind.empty()) {
      FAIL("unknown job " << kind);
    }
  }
}

}  // namespace libtrain_test_resample
