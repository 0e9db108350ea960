#include "slide/train/embed.h"


#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <dnnl.hpp>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "slide/core/file.h"
#include "slide/core/log.h"
#include "slide/core/progress.h"
#include "slide/core/thread_pool.h"
#include "slide/tile/image.h"
#include "slide/tile/store.h"
#include "slide/core/csv.h"
#include "slide/core/hash.h"
#include "slide/train/checkpoint.h"
#include "slide/train/dataset.h"
#include "slide/train/resample.h"
#include "slide/train/vit.h"

namespace slide::train {

namespace {

using dnnl::memory;
using slide::core::invalid_argument;
using slide::core::ok_status;
using tag = memory::format_tag;
using dt = memory::data_type;

// ------------------------------------------------------------------------------------------------
// The model as a list of inference nodes, weights folded.

struct ConvSpec {
  int64_t K = 0, C = 0, R = 0, S = 0;
  int stride = 1, pad = 0;
  bool relu = false;
  std::vector<float> w;  // K x C x R x S (oihw), batch norm folded in
  std::vector<float> b;  // K
};

struct Node {
  enum Kind { kConv, kMaxPool, kBlock, kGap, kLinear } kind = kConv;
  ConvSpec conv;                 // kConv
  Pool2dParams pool;             // kMaxPool
  std::vector<ConvSpec> main;    // kBlock: the main path; the last conv gets sum + relu post-ops
  std::vector<ConvSpec> down;    // kBlock: the downsample conv (empty: identity shortcut)
  std::vector<float> lw, lb;     // kLinear: O x I, O
  int64_t lin_in = 0, lin_out = 0;
};

std::vector<float> to_vector(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::kF64) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(t.data<double>()[i]);
  } else {
    std::memcpy(v.data(), t.data<float>(), v.size() * sizeof(float));
  }
  return v;
}

ConvSpec conv_spec(const Conv2d& c) {
  ConvSpec s;
  const Shape& ws = c.weight.value.shape();
  s.K = ws[0], s.C = ws[1], s.R = ws[2], s.S = ws[3];
  s.stride = c.params().stride;
  s.pad = c.params().pad;
  s.w = to_vector(c.weight.value);
  s.b = c.bias.value.defined() ? to_vector(c.bias.value) : std::vector<float>(static_cast<size_t>(s.K), 0.f);
  return s;
}

// Inference batch norm after a convolution is an affine map per output channel: fold it into the
// convolution's weights and bias (in double, then rounded once).
void fold_bn(ConvSpec* s, const BatchNorm2d& bn) {
  const std::vector<float> g = to_vector(bn.weight.value), beta = to_vector(bn.bias.value),
                           mean = to_vector(bn.running_mean.value), var = to_vector(bn.running_var.value);
  const int64_t per_k = s->C * s->R * s->S;
  for (int64_t k = 0; k < s->K; ++k) {
    const double scale = static_cast<double>(g[k]) / std::sqrt(static_cast<double>(var[k]) + bn.eps());
    for (int64_t i = 0; i < per_k; ++i) {
      float& w = s->w[static_cast<size_t>(k * per_k + i)];
      w = static_cast<float>(static_cast<double>(w) * scale);
    }
    s->b[k] = static_cast<float>(beta[k] + (static_cast<double>(s->b[k]) - mean[k]) * scale);
  }
}

// Conv (+ BN) (+ ReLU) runs of a flat layer list. `layers` may hold nothing else.
Result<std::vector<ConvSpec>> conv_chain(Sequential& seq, const std::string& where) {
  std::vector<ConvSpec> out;
  for (size_t i = 0; i < seq.size(); ++i) {
    Layer& l = seq.at(i);
    if (auto* c = dynamic_cast<Conv2d*>(&l)) {
      out.push_back(conv_spec(*c));
    } else if (auto* bn = dynamic_cast<BatchNorm2d*>(&l); bn != nullptr && !out.empty()) {
      fold_bn(&out.back(), *bn);
    } else if (dynamic_cast<ReLU*>(&l) != nullptr && !out.empty()) {
      out.back().relu = true;
    } else {
      return slide::core::unimplemented(where + "." + seq.name_at(i) + ": layer kind not supported by the inference path");
    }
  }
  return out;
}

Status flatten(Layer& layer, const std::string& where, std::vector<Node>* nodes, int64_t* channels);

// Children [0, end) of `seq`: a convolution takes a following batch norm and ReLU with it.
Status flatten_children(Sequential* seq, size_t end, const std::string& where, std::vector<Node>* nodes,
                        int64_t* channels) {
  {
    for (size_t i = 0; i < end; ++i) {
      Layer& l = seq->at(i);
      const std::string name = where.empty() ? seq->name_at(i) : where + "." + seq->name_at(i);
      if (auto* c = dynamic_cast<Conv2d*>(&l)) {
        Node n;
        n.kind = Node::kConv;
        n.conv = conv_spec(*c);
        if (i + 1 < end) {
          if (auto* bn = dynamic_cast<BatchNorm2d*>(&seq->at(i + 1))) {
            fold_bn(&n.conv, *bn);
            ++i;
          }
        }
        if (i + 1 < end && dynamic_cast<ReLU*>(&seq->at(i + 1)) != nullptr) {
          n.conv.relu = true;
          ++i;
        }
        *channels = n.conv.K;
        nodes->push_back(std::move(n));
      } else {
        SLIDE_RETURN_IF_ERROR(flatten(l, name, nodes, channels));
      }
    }
    return ok_status();
  }
}

Status flatten(Layer& layer, const std::string& where, std::vector<Node>* nodes, int64_t* channels) {
  if (auto* seq = dynamic_cast<Sequential*>(&layer)) return flatten_children(seq, seq->size(), where, nodes, channels);
  if (auto* c = dynamic_cast<Conv2d*>(&layer)) {
    Node n;
    n.kind = Node::kConv;
    n.conv = conv_spec(*c);
    *channels = n.conv.K;
    nodes->push_back(std::move(n));
    return ok_status();
  }
  if (auto* block = dynamic_cast<ResidualBlock*>(&layer)) {
    Node n;
    n.kind = Node::kBlock;
    SLIDE_ASSIGN_OR_RETURN(n.main, conv_chain(block->main_path(), where));
    if (n.main.empty()) return slide::core::unimplemented(where + ": residual block without convolutions");
    n.main.back().relu = true;  // the block's output ReLU, after the sum
    if (Sequential* d = block->downsample()) {
      SLIDE_ASSIGN_OR_RETURN(n.down, conv_chain(*d, where + ".downsample"));
      if (n.down.size() != 1) return slide::core::unimplemented(where + ".downsample: expected one convolution");
    }
    *channels = n.main.back().K;
    nodes->push_back(std::move(n));
    return ok_status();
  }
  if (auto* mp = dynamic_cast<MaxPool2d*>(&layer)) {
    Node n;
    n.kind = Node::kMaxPool;
    n.pool = mp->params();
    nodes->push_back(n);
    return ok_status();
  }
  if (dynamic_cast<GlobalAvgPool*>(&layer) != nullptr) {
    Node n;
    n.kind = Node::kGap;
    nodes->push_back(n);
    return ok_status();
  }
  if (auto* lin = dynamic_cast<Linear*>(&layer)) {
    Node n;
    n.kind = Node::kLinear;
    n.lw = to_vector(lin->weight.value);
    n.lb = to_vector(lin->bias.value);
    n.lin_out = lin->weight.value.dim(0);
    n.lin_in = lin->weight.value.dim(1);
    *channels = n.lin_out;
    nodes->push_back(std::move(n));
    return ok_status();
  }
  return slide::core::unimplemented(where + ": layer kind not supported by the inference path");
}

// ------------------------------------------------------------------------------------------------
// Execution on oneDNN.

// An activation: its oneDNN layout and its bytes (from the caching CPU allocator, so the same
// shapes batch after batch reuse the same blocks and peak memory is the live set).
struct Act {
  memory::desc md;
  Tensor buf;     // undefined when `ext` is used
  void* ext = nullptr;
  void* ptr() const { return ext != nullptr ? ext : buf.raw(); }
};

Result<Act> new_act(const memory::desc& md) {
  Act a;
  a.md = md;
  SLIDE_ASSIGN_OR_RETURN(a.buf, Tensor::empty({static_cast<int64_t>(md.get_size())}, DType::kU8, cpu_allocator(),
                                              "embedding activation"));
  return a;
}

int64_t out_extent(int64_t in, int64_t k, int stride, int pad) { return (in + 2 * pad - k) / stride + 1; }
int64_t pad_right(int64_t in, int64_t out, int64_t k, int stride, int pad) { return (out - 1) * stride + k - in - pad; }

using Step = std::function<Status(Act&)>;  // transforms the activation in place (replacing it)

}  // namespace

struct FeatureExtractor::Impl {
  std::vector<Node> nodes;
  std::string layer;
  int64_t feature_dim = 0;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::vector<Step>> plans;  // by (N, H, W)
  std::map<const ConvSpec*, std::vector<std::pair<memory::desc, Tensor>>> weight_cache;
  std::map<const ConvSpec*, Tensor> biases;

  Tensor bias_tensor(const ConvSpec& s) {
    Tensor& b = biases[&s];
    if (!b.defined()) {
      auto t = Tensor::empty({s.K}, DType::kF32, cpu_allocator(), "embedding bias");
      if (!t.ok()) return Tensor();
      b = *t;
      std::memcpy(b.raw(), s.b.data(), s.b.size() * sizeof(float));
    }
    return b;
  }

  memory mem(const Act& a) { return memory(a.md, eng, a.ptr()); }

  // Reorders `a` into layout `md` when it differs.
  Status ensure(Act& a, const memory::desc& md) {
    if (a.md == md) return ok_status();
    SLIDE_ASSIGN_OR_RETURN(Act b, new_act(md));
    memory src = mem(a), dst = mem(b);
    dnnl::reorder(src, dst).execute(strm, src, dst);
    a = std::move(b);
    return ok_status();
  }

  // A compiled convolution: primitive, its weights in the layout it wants, its bias.
  struct ConvExec {
    dnnl::convolution_forward::primitive_desc pd;
    dnnl::convolution_forward prim;
    Tensor weights, bias;
  };

  Result<std::shared_ptr<ConvExec>> compile_conv(const ConvSpec& s, int64_t N, int64_t* H, int64_t* W, bool sum) {
    const int64_t P = out_extent(*H, s.R, s.stride, s.pad), Q = out_extent(*W, s.S, s.stride, s.pad);
    if (P < 1 || Q < 1) return invalid_argument("input too small for the cut: a convolution's output would be empty");
    auto any = [](memory::dims d) { return memory::desc(d, dt::f32, tag::any); };
    dnnl::convolution_forward::desc desc(
        dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct, any({N, s.C, *H, *W}),
        any({s.K, s.C, s.R, s.S}), memory::desc({s.K}, dt::f32, tag::x), any({N, s.K, P, Q}), {s.stride, s.stride},
        {s.pad, s.pad}, {pad_right(*H, P, s.R, s.stride, s.pad), pad_right(*W, Q, s.S, s.stride, s.pad)});
    dnnl::post_ops po;
    if (sum) po.append_sum(1.f);
    if (s.relu) po.append_eltwise(1.f, dnnl::algorithm::eltwise_relu, 0.f, 0.f);
    dnnl::primitive_attr attr;
    attr.set_post_ops(po);
    auto e = std::make_shared<ConvExec>();
    e->pd = dnnl::convolution_forward::primitive_desc(desc, attr, eng);
    e->prim = dnnl::convolution_forward(e->pd);
    // The weights in the layout this primitive wants, shared by every plan (batch size) that wants
    // the same layout: one reordered copy per convolution, not one per batch size.
    auto& cached = weight_cache[&s];
    for (const auto& [md, t] : cached) {
      if (md == e->pd.weights_desc()) e->weights = t;
    }
    if (!e->weights.defined()) {
      SLIDE_ASSIGN_OR_RETURN(e->weights, Tensor::empty({static_cast<int64_t>(e->pd.weights_desc().get_size())},
                                                       DType::kU8, cpu_allocator(), "embedding weights"));
      memory plain({{s.K, s.C, s.R, s.S}, dt::f32, tag::oihw}, eng, const_cast<float*>(s.w.data()));
      memory blocked(e->pd.weights_desc(), eng, e->weights.raw());
      dnnl::reorder(plain, blocked).execute(strm, plain, blocked);
      strm.wait();
      cached.emplace_back(e->pd.weights_desc(), e->weights);
    }
    e->bias = bias_tensor(s);
    if (!e->bias.defined()) return slide::core::resource_exhausted("no memory for a convolution's bias");
    *H = P, *W = Q;
    return e;
  }

  // Runs a compiled convolution on `x`; the output goes to a new activation, or into *sum_dst
  // (which must already be in the primitive's dst layout) when the conv has a sum post-op.
  Status run_conv(ConvExec& e, Act x, Act* out, Act* sum_dst) {
    SLIDE_RETURN_IF_ERROR(ensure(x, e.pd.src_desc()));
    Act y;
    if (sum_dst != nullptr) {
      y = *sum_dst;
    } else {
      SLIDE_ASSIGN_OR_RETURN(y, new_act(e.pd.dst_desc()));
    }
    e.prim.execute(strm, {{DNNL_ARG_SRC, mem(x)},
                          {DNNL_ARG_WEIGHTS, memory(e.pd.weights_desc(), eng, e.weights.raw())},
                          {DNNL_ARG_BIAS, memory(e.pd.bias_desc(), eng, e.bias.raw())},
                          {DNNL_ARG_DST, mem(y)}});
    *out = std::move(y);
    return ok_status();
  }

  Result<std::vector<Step>> compile(int64_t N, int64_t H, int64_t W) {
    std::vector<Step> steps;
    int64_t C = 3;
    bool flat = false;  // [N, C] after pooling
    for (const Node& n : nodes) {
      switch (n.kind) {
        case Node::kConv: {
          SLIDE_ASSIGN_OR_RETURN(auto e, compile_conv(n.conv, N, &H, &W, false));
          C = n.conv.K;
          steps.push_back([this, e](Act& a) { return run_conv(*e, a, &a, nullptr); });
          break;
        }
        case Node::kBlock: {
          int64_t h = H, w = W;
          std::shared_ptr<ConvExec> down;
          if (!n.down.empty()) {
            int64_t dh = H, dw = W;
            SLIDE_ASSIGN_OR_RETURN(down, compile_conv(n.down[0], N, &dh, &dw, false));
          }
          std::vector<std::shared_ptr<ConvExec>> main;
          for (size_t i = 0; i < n.main.size(); ++i) {
            SLIDE_ASSIGN_OR_RETURN(auto e, compile_conv(n.main[i], N, &h, &w, i + 1 == n.main.size()));
            main.push_back(e);
          }
          H = h, W = w, C = n.main.back().K;
          steps.push_back([this, down, main](Act& x) -> Status {
            Act z = x;  // the shortcut: x itself (written in place by the last conv) or downsample(x)
            if (down) SLIDE_RETURN_IF_ERROR(run_conv(*down, x, &z, nullptr));
            Act h = x;
            for (size_t i = 0; i + 1 < main.size(); ++i) SLIDE_RETURN_IF_ERROR(run_conv(*main[i], h, &h, nullptr));
            x = Act();  // no longer needed: frees it unless z is x
            SLIDE_RETURN_IF_ERROR(ensure(z, main.back()->pd.dst_desc()));
            return run_conv(*main.back(), h, &x, &z);
          });
          break;
        }
        case Node::kMaxPool: {
          const Pool2dParams p = n.pool;
          const int64_t P = out_extent(H, p.kernel, p.stride, p.pad), Q = out_extent(W, p.kernel, p.stride, p.pad);
          if (P < 1 || Q < 1) return invalid_argument("input too small for the cut: a pooling output would be empty");
          // The source layout is the producer's; compiled lazily for it (known only after the
          // previous convolution's primitive chose it), then cached in the closure.
          auto pd = std::make_shared<std::optional<dnnl::pooling_forward::primitive_desc>>();
          const memory::dims src_d{N, C, H, W}, dst_d{N, C, P, Q};
          const memory::dims pr{pad_right(H, P, p.kernel, p.stride, p.pad), pad_right(W, Q, p.kernel, p.stride, p.pad)};
          steps.push_back([this, pd, src_d, dst_d, pr, p](Act& a) -> Status {
            if (!pd->has_value() || (*pd)->src_desc() != a.md) {
              dnnl::pooling_forward::desc desc(dnnl::prop_kind::forward_inference, dnnl::algorithm::pooling_max, a.md,
                                               memory::desc(dst_d, dt::f32, tag::any), {p.stride, p.stride},
                                               {p.kernel, p.kernel}, {p.pad, p.pad}, pr);
              *pd = dnnl::pooling_forward::primitive_desc(desc, eng);
            }
            SLIDE_ASSIGN_OR_RETURN(Act y, new_act((*pd)->dst_desc()));
            dnnl::pooling_forward(**pd).execute(strm, {{DNNL_ARG_SRC, mem(a)}, {DNNL_ARG_DST, mem(y)}});
            a = std::move(y);
            return ok_status();
          });
          H = P, W = Q;
          break;
        }
        case Node::kGap: {
          if (flat) break;
          steps.push_back(gap_step(N, C, H, W));
          flat = true;
          break;
        }
        case Node::kLinear: {
          if (!flat) return invalid_argument("a Linear layer before pooling is not supported");
          const int64_t I = n.lin_in, O = n.lin_out;
          if (I != C) return invalid_argument("Linear input width differs from the features");
          dnnl::inner_product_forward::desc desc(dnnl::prop_kind::forward_inference, memory::desc({N, I}, dt::f32, tag::nc),
                                                 memory::desc({O, I}, dt::f32, tag::oi), memory::desc({O}, dt::f32, tag::x),
                                                 memory::desc({N, O}, dt::f32, tag::nc));
          auto pd = std::make_shared<dnnl::inner_product_forward::primitive_desc>(desc, eng);
          const Node* node = &n;
          steps.push_back([this, pd, node, N, I, O](Act& a) -> Status {
            Act src = a;
            src.md = memory::desc({N, I}, dt::f32, tag::nc);
            SLIDE_ASSIGN_OR_RETURN(Act y, new_act(pd->dst_desc()));
            dnnl::inner_product_forward(*pd).execute(
                strm, {{DNNL_ARG_SRC, mem(src)},
                       {DNNL_ARG_WEIGHTS, memory(pd->weights_desc(), eng, const_cast<float*>(node->lw.data()))},
                       {DNNL_ARG_BIAS, memory(pd->bias_desc(), eng, const_cast<float*>(node->lb.data()))},
                       {DNNL_ARG_DST, mem(y)}});
            a = std::move(y);
            a.md = memory::desc({N, O, 1, 1}, dt::f32, tag::nchw);
            return ok_status();
          });
          C = O;
          break;
        }
      }
    }
    if (!flat) steps.push_back(gap_step(N, C, H, W));
    return steps;
  }

  // Global average pooling to a plain [N, C, 1, 1] (= [N, C]) activation.
  Step gap_step(int64_t N, int64_t C, int64_t H, int64_t W) {
    auto pd = std::make_shared<std::optional<dnnl::pooling_forward::primitive_desc>>();
    return [this, pd, N, C, H, W](Act& a) -> Status {
      if (!pd->has_value() || (*pd)->src_desc() != a.md) {
        dnnl::pooling_forward::desc desc(dnnl::prop_kind::forward_inference,
                                         dnnl::algorithm::pooling_avg_exclude_padding, a.md,
                                         memory::desc({N, C, 1, 1}, dt::f32, tag::any), {1, 1}, {H, W}, {0, 0}, {0, 0});
        *pd = dnnl::pooling_forward::primitive_desc(desc, eng);
      }
      SLIDE_ASSIGN_OR_RETURN(Act y, new_act((*pd)->dst_desc()));
      dnnl::pooling_forward(**pd).execute(strm, {{DNNL_ARG_SRC, mem(a)}, {DNNL_ARG_DST, mem(y)}});
      a = std::move(y);
      return ensure(a, memory::desc({N, C, 1, 1}, dt::f32, tag::nchw));
    };
  }
};

FeatureExtractor::FeatureExtractor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FeatureExtractor::~FeatureExtractor() = default;
int64_t FeatureExtractor::feature_dim() const { return impl_->feature_dim; }
const std::string& FeatureExtractor::layer() const { return impl_->layer; }

Result<std::unique_ptr<EngineEncoder>> EngineEncoder::create(std::unique_ptr<Sequential> model,
                                                             const std::string& layer, std::unique_ptr<Backend> be) {
  if (model == nullptr || be == nullptr) return invalid_argument("EngineEncoder: no model or no backend");
  auto enc = std::unique_ptr<EngineEncoder>(new EngineEncoder());
  SLIDE_ASSIGN_OR_RETURN(enc->cut_, find_cut(*model, layer));
  SLIDE_RETURN_IF_ERROR(move_to_device(*be, *model));
  enc->layer_ = layer;
  enc->model_ = std::move(model);
  enc->be_ = std::move(be);
  // The feature width: one forward of a small zero image (the width does not depend on the size).
  SLIDE_ASSIGN_OR_RETURN(Tensor probe, Tensor::zeros({1, 3, 64, 64}, DType::kF32, enc->be_->allocator(), "probe image"));
  SLIDE_ASSIGN_OR_RETURN(Tensor f, engine_features(*enc->be_, *enc->model_, enc->cut_, probe));
  enc->dim_ = f.dim(1);
  enc->model_->release();
  return enc;
}

Status EngineEncoder::extract(const float* images, int64_t n, int64_t h, int64_t w, float* features) {
  if (n < 1 || h < 1 || w < 1)
    return invalid_argument("engine encoder: " + std::to_string(n) + " images of " + std::to_string(h) + "x" +
                            std::to_string(w) + " px");
  SLIDE_ASSIGN_OR_RETURN(Tensor host, Tensor::empty({n, 3, h, w}, DType::kF32, cpu_allocator(), "images (host)"));
  std::memcpy(host.raw(), images, host.bytes());
  SLIDE_ASSIGN_OR_RETURN(Tensor x, to_device(*be_, host, "images"));
  SLIDE_ASSIGN_OR_RETURN(Tensor f, engine_features(*be_, *model_, cut_, x));
  model_->release();
  if (f.rank() != 2 || f.dim(0) != n || f.dim(1) != dim_)
    return invalid_argument("engine encoder: layer " + layer_ + " gave features of shape " + shape_string(f.shape()) +
                            " for " + std::to_string(n) + " images, expected [" + std::to_string(n) + ", " +
                            std::to_string(dim_) + "]");
  SLIDE_ASSIGN_OR_RETURN(Tensor out, to_host(*be_, f, "features (host)"));
  std::memcpy(features, out.raw(), out.bytes());
  return ok_status();
}

std::vector<std::string> cut_points(Sequential& model) {
  std::vector<std::string> out;
  for (size_t i = 0; i < model.size(); ++i) {
    if (dynamic_cast<GlobalAvgPool*>(&model.at(i)) != nullptr && model.name_at(i) != "avgpool") out.push_back("avgpool");
    out.push_back(model.name_at(i));
  }
  return out;
}

std::string default_layer(const std::string& model) { return model == "resnet50" ? "layer3" : "avgpool"; }

Result<size_t> find_cut(Sequential& model, const std::string& layer) {
  for (size_t i = 0; i < model.size(); ++i) {
    if (model.name_at(i) == layer) return i;
  }
  if (layer == "avgpool") {
    for (size_t i = 0; i < model.size(); ++i) {
      if (dynamic_cast<GlobalAvgPool*>(&model.at(i)) != nullptr) return i;
    }
  }
  std::string names;
  for (const auto& n : cut_points(model)) names += (names.empty() ? "" : ", ") + n;
  return invalid_argument("--layer '" + layer + "' is not a layer of the model (one of: " + names + ")");
}

Result<Tensor> engine_features(Backend& be, Sequential& model, size_t cut, const Tensor& images) {
  if (cut >= model.size()) return invalid_argument("cut " + std::to_string(cut) + " beyond the model");
  Tensor h = images;
  for (size_t i = 0; i <= cut; ++i) {
    auto r = model.at(i).forward(be, h, false);
    if (!r.ok()) return r.status().with_context("layer " + model.name_at(i));
    h = std::move(*r);
  }
  if (h.rank() == 4) {
    SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty({h.dim(0), h.dim(1)}, h.dtype(), be.allocator(), "pooled features"));
    SLIDE_RETURN_IF_ERROR(be.global_avg_pool_forward(h, y));
    h = y;
  }
  return h;
}

Result<std::unique_ptr<FeatureExtractor>> FeatureExtractor::create(Sequential& model, const std::string& layer) {
  SLIDE_ASSIGN_OR_RETURN(size_t cut, find_cut(model, layer));
  auto impl = std::make_unique<Impl>();
  impl->layer = layer;
  int64_t channels = 3;
  SLIDE_RETURN_IF_ERROR(flatten_children(&model, cut + 1, "", &impl->nodes, &channels));
  for (size_t i = 0; i + 1 < impl->nodes.size(); ++i) {
    if (impl->nodes[i].kind == Node::kLinear) return slide::core::unimplemented("a Linear layer is supported only last");
  }
  impl->feature_dim = channels;
  return std::unique_ptr<FeatureExtractor>(new FeatureExtractor(std::move(impl)));
}

Result<Tensor> FeatureExtractor::forward(const Tensor& images, Allocator& alloc) {
  if (images.rank() != 4 || images.dim(1) != 3 || images.dtype() != DType::kF32 || images.device() != Device::kCpu)
    return invalid_argument("fused forward: images of shape " + shape_string(images.shape()) +
                            ", expected [N, 3, H, W] f32 in host memory");
  SLIDE_ASSIGN_OR_RETURN(Tensor out, Tensor::empty({images.dim(0), impl_->feature_dim}, DType::kF32, alloc,
                                                   impl_->layer == "fc" ? "logits" : "features"));
  SLIDE_RETURN_IF_ERROR(extract(images.data<float>(), images.dim(0), images.dim(2), images.dim(3), out.data<float>()));
  return out;
}

Status FeatureExtractor::extract(const float* images, int64_t n, int64_t h, int64_t w, float* features) {
  if (n < 1 || h < 1 || w < 1) return invalid_argument("extract: empty batch");
  Impl& m = *impl_;
  try {
    const auto key = std::make_tuple(n, h, w);
    auto it = m.plans.find(key);
    if (it == m.plans.end()) {
      if (m.plans.size() >= 8) m.plans.clear();  // tail batches of many sizes: keep the cache small
      SLIDE_ASSIGN_OR_RETURN(auto steps, m.compile(n, h, w));
      it = m.plans.emplace(key, std::move(steps)).first;
    }
    Act a;
    a.md = memory::desc({n, 3, h, w}, dt::f32, tag::nchw);
    a.ext = const_cast<float*>(images);  // read only: the first step writes a new activation
    for (Step& s : it->second) SLIDE_RETURN_IF_ERROR(s(a));
    m.strm.wait();
    std::memcpy(features, a.ptr(), static_cast<size_t>(n * m.feature_dim) * sizeof(float));
    return ok_status();
  } catch (const dnnl::error& e) {
    return slide::core::internal_error(std::string("oneDNN: ") + e.what());
  } catch (const std::bad_alloc&) {
    return slide::core::resource_exhausted("out of memory embedding a batch of " + std::to_string(n) + " tiles");
  }
}

// ------------------------------------------------------------------------------------------------
// Weights


Result<EmbedModel> load_embed_model(const std::string& weights, const std::string& model, const std::string& layer) {
  std::error_code ec;
  EmbedModel out;
  int64_t classes = 1000, width = 16;
  if (std::filesystem::is_directory(weights, ec)) {
    SLIDE_ASSIGN_OR_RETURN(std::string text, slide::core::read_file(weights + "/state.json"));
    auto state = nlohmann::json::parse(text, nullptr, false);
    if (state.is_discarded() || !state.contains("model") || !state["model"].is_string() || !state.contains("classes"))
      return slide::core::data_loss(weights + "/state.json: not a slide-train checkpoint record");
    out.model = state["model"].get<std::string>();
    if (!model.empty() && model != out.model)
      return invalid_argument("--model " + model + " but the checkpoint " + weights + " holds a " + out.model);
    classes = static_cast<int64_t>(state["classes"].size());
    width = state.value("width", int64_t{16});
    out.weights_path = weights + "/model.safetensors";
  } else {
    if (!std::filesystem::exists(weights, ec)) return slide::core::not_found("--weights " + weights + ": no such file");
    if (model.empty()) return invalid_argument("--model is needed with a safetensors file (resnet18, resnet34, resnet50)");
    out.model = model;
    out.weights_path = weights;
    SLIDE_ASSIGN_OR_RETURN(const auto shapes, read_safetensors_shapes(weights));
    const auto fc = shapes.find("fc.weight");
    if (fc != shapes.end() && fc->second.size() == 2) classes = fc->second[0];
  }
  Result<std::unique_ptr<Sequential>> net = invalid_argument("model '" + out.model +
                                                             "' is not one of resnet18, resnet34, resnet50, small (or a ViT: " +
                                                             vit_preset_list() + ")");
  if (out.model == "small") net = make_small_cnn(cpu_allocator(), DType::kF32, 3, classes, width, 0);
  if (out.model == "resnet18") net = make_resnet(cpu_allocator(), DType::kF32, 18, classes, 0);
  if (out.model == "resnet34") net = make_resnet(cpu_allocator(), DType::kF32, 34, classes, 0);
  if (out.model == "resnet50") net = make_resnet(cpu_allocator(), DType::kF32, 50, classes, 0);
  if (!net.ok()) return net.status();
  out.net = std::move(*net);
  out.layer = layer.empty() ? default_layer(out.model) : layer;
  SLIDE_ASSIGN_OR_RETURN(size_t cut, find_cut(*out.net, out.layer));
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  for (size_t i = 0; i <= cut; ++i) out.net->at(i).collect(out.net->name_at(i), &params, &buffers);
  std::vector<NamedTensor> named;
  for (Parameter* p : params) named.push_back({p->name, &p->value});
  for (Buffer* b : buffers) named.push_back({b->name, &b->value});
  SLIDE_RETURN_IF_ERROR_CTX(load_safetensors(out.weights_path, named), "weights " + out.weights_path);
  SLIDE_ASSIGN_OR_RETURN(out.weights_sha256, slide::core::sha256_file(out.weights_path));
  return out;
}

// ------------------------------------------------------------------------------------------------
// Stores -> bags

int EmbedSummary::failed() const {
  int n = 0;
  for (const auto& s : slides) n += s.status.ok() || s.status.code() == slide::core::StatusCode::kCancelled ? 0 : 1;
  return n;
}

namespace {

struct SlideJob {
  size_t store = 0;
  slide::tile::SlideRecord record;
};

// Decodes tile `index` of `store` (S x S px) into `dst` (3 x E x E, normalised) and its
// coordinates. With a stain target (method not kNone) the decoded 8-bit tile is first
// stain-normalised in place (stain.h). With a resizer (S != E: the encoder's input size) the
// 8-bit tile is then resized to E x E as PIL's Image.resize(BICUBIC) (resample.h), on the calling
// decode thread.
Status decode_into(const slide::tile::StoreReader& store, const std::string& store_dir, uint64_t index, int64_t S,
                   const StainTarget& stain, const BicubicResizer* resizer, const float (*lut)[256], float* dst,
                   int64_t* xy) {
  slide::tile::TileHeader hdr;
  std::vector<uint8_t> payload;
  const std::string where = "store " + store_dir + ": tile " + std::to_string(index);
  SLIDE_RETURN_IF_ERROR_CTX(store.read_tile(index, &hdr, &payload), where);
  slide::tile::RgbImage img;
  if (hdr.encoding == slide::tile::TileEncoding::kJpeg) {
    SLIDE_ASSIGN_OR_RETURN_CTX(img, slide::tile::decode_jpeg(payload), where);
  } else {
    img.width = hdr.width, img.height = hdr.height, img.pixels = std::move(payload);
    if (img.pixels.size() != static_cast<size_t>(3 * img.width * img.height))
      return slide::core::data_loss(where + ": raw payload size does not match its width and height");
  }
  if (img.width != S || img.height != S)
    return slide::core::data_loss(where + " is " + std::to_string(img.width) + "x" + std::to_string(img.height) +
                                  ", not " + std::to_string(S) + "x" + std::to_string(S));
  if (stain.method != StainMethod::kNone)
    SLIDE_RETURN_IF_ERROR_CTX(normalise_stain(stain, img.pixels.data(), img.width, img.height), where);
  const uint8_t* px = img.pixels.data();
  int64_t E = S;
  if (resizer != nullptr) {
    thread_local std::vector<uint8_t> resized, scratch;  // per decode thread, reused across tiles
    E = resizer->out_w();
    resized.resize(static_cast<size_t>(3 * E * E));
    resizer->resize(px, resized.data(), scratch);
    px = resized.data();
  }
  const int64_t plane = E * E;
  for (int64_t i = 0; i < plane; ++i) {
    dst[i] = lut[0][px[3 * i]];
    dst[plane + i] = lut[1][px[3 * i + 1]];
    dst[2 * plane + i] = lut[2][px[3 * i + 2]];
  }
  xy[0] = hdr.x_l0;
  xy[1] = hdr.y_l0;
  return ok_status();
}

}  // namespace

const float* TileEncoder::mean() const { return kImageNetMean; }
const float* TileEncoder::std() const { return kImageNetStd; }

Result<EmbedSummary> embed_stores(TileEncoder& extractor, const EmbedModel& model, const EmbedOptions& opt) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  if (opt.stores.empty()) return invalid_argument("no tile stores given");
  if (opt.batch < 1) return invalid_argument("--batch-size must be at least 1");
  {
    // An invalid target fails the run here, not every tile.
    uint8_t probe[3] = {128, 128, 128};
    SLIDE_RETURN_IF_ERROR_CTX(normalise_stain(opt.stain, probe, 1, 1), "stain normalisation");
  }
  const std::string stain_json =
      opt.stain.method != StainMethod::kNone ? stain_target_to_json(opt.stain) : std::string();
  std::vector<std::unique_ptr<slide::tile::StoreReader>> stores;
  // Tiles of another size than the encoder's input are resized to it on the decode threads, as
  // the encoders' own transforms do (PIL's bicubic, antialiased: resample.h); one resizer (its
  // weights precomputed) per tile size, shared by the threads.
  const int64_t need = extractor.input_size();
  std::map<int64_t, std::unique_ptr<const BicubicResizer>> resizers;
  for (const auto& dir : opt.stores) {
    SLIDE_ASSIGN_OR_RETURN_CTX(auto r, slide::tile::StoreReader::open(dir), "store " + dir);
    const int64_t have = r->meta().tile_size_px;
    if (need > 0 && have != need) {
      if (resizers.count(have) == 0) {
        SLIDE_ASSIGN_OR_RETURN_CTX(BicubicResizer rs, BicubicResizer::create(have, have, need, need), "store " + dir);
        resizers.emplace(have, std::make_unique<const BicubicResizer>(std::move(rs)));
      }
      slide::core::log_info("tiles of " + std::to_string(have) + " px are resized to " + std::to_string(need) +
                                " px (bicubic, antialiased, as the encoder's transform)",
                            {{"store", dir}});
    }
    stores.push_back(std::move(r));
  }
  auto resizer_for = [&](int64_t tile_px) -> const BicubicResizer* {
    auto it = resizers.find(tile_px);
    return it == resizers.end() ? nullptr : it->second.get();
  };
  // The slides to embed, and their bag names (which must not collide).
  const std::set<std::string> wanted(opt.slide_ids.begin(), opt.slide_ids.end());
  std::set<std::string> found;
  std::map<std::string, std::string> bag_owner;  // file name -> slide id
  std::vector<SlideJob> jobs;
  for (size_t s = 0; s < stores.size(); ++s) {
    for (const auto& rec : stores[s]->slides()) {
      if (!wanted.empty() && wanted.count(rec.slide_id) == 0) continue;
      found.insert(rec.slide_id);
      const std::string file = slide::cache::bag_file_name(rec.slide_id);
      auto [it, fresh] = bag_owner.emplace(file, rec.slide_id);
      if (!fresh)
        return invalid_argument("slides '" + it->second + "' and '" + rec.slide_id + "' (store " + opt.stores[s] +
                                ") would both be written to " + file + ": slide ids must be unique across the stores");
      jobs.push_back({s, rec});
    }
  }
  for (const auto& id : wanted) {
    if (found.count(id) == 0) return invalid_argument("slide '" + id + "' is in none of the stores");
  }
  if (opt.layout != "flat" && opt.layout != "clam")
    return invalid_argument("layout '" + opt.layout + "' is not one of flat, clam");
  const bool clam = opt.layout == "clam";
  const std::string bag_dir = clam ? opt.out_dir + "/h5_files" : opt.out_dir;  // CLAM's DATA_DIR/h5_files
  SLIDE_RETURN_IF_ERROR_CTX(slide::core::make_dirs(bag_dir), "--out");
  // A slide's bag: <bag dir>/<bag_file_name(id)>, or a complete bag of an earlier version under the
  // legacy name when it holds this slide (its slide_id attribute), so that a rerun skips it.
  auto bag_path_of = [&](const std::string& slide_id) {
    const std::string path = bag_dir + "/" + slide::cache::bag_file_name(slide_id);
    const std::string legacy = bag_dir + "/" + slide::cache::legacy_bag_file_name(slide_id);
    std::error_code ec;
    if (legacy == path || std::filesystem::exists(path, ec) || !std::filesystem::exists(legacy, ec)) return path;
    auto r = slide::cache::BagReader::open(legacy);
    return r.ok() && (*r)->info().attributes.slide_id == slide_id ? legacy : path;
  };

  // torchvision's normalisation as a lookup table per channel: (v / 255 - mean) / std.
  float lut[3][256];
  for (int c = 0; c < 3; ++c)
    for (int v = 0; v < 256; ++v)
      lut[c][v] = (static_cast<float>(v) / 255.f - extractor.mean()[c]) / extractor.std()[c];

  EmbedSummary summary;
  int64_t total_tiles = 0;
  for (const auto& j : jobs) {
    // Complete bags are skipped without work: they are not in the progress total (tiles/s).
    std::error_code ec;
    if (!std::filesystem::exists(bag_path_of(j.record.slide_id), ec)) {
      total_tiles += static_cast<int64_t>(j.record.tile_count);
    }
  }
  slide::core::Progress progress("embedding", total_tiles, "tiles/s", opt.progress);
  slide::core::ThreadPool pool(static_cast<size_t>(std::max(1, opt.decode_threads)));
  const int64_t D = extractor.feature_dim();
  std::vector<float> features;

  // Pass 1: complete bags (checked), zero-tile slides; the rest is embedded in pass 2.
  std::vector<SlideOutcome> outcomes(jobs.size());
  std::vector<size_t> todo;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const SlideJob& job = jobs[j];
    const slide::tile::SlideRecord& rec = job.record;
    SlideOutcome& o = outcomes[j];
    o.store = opt.stores[job.store];
    o.slide_id = rec.slide_id;
    o.bag_path = bag_path_of(rec.slide_id);
    std::error_code ec;
    if (std::filesystem::exists(o.bag_path, ec)) {
      // Complete by construction; reused only when made the same way.
      auto existing = slide::cache::BagReader::open(o.bag_path);
      if (!existing.ok()) {
        o.status = existing.status().with_context("existing bag (remove it to redo the slide)");
      } else {
        const auto& info = (*existing)->info();
        const auto& a = info.attributes;
        const int64_t tile_px = stores[job.store]->meta().tile_size_px;
        const int32_t want_input = resizer_for(tile_px) != nullptr ? static_cast<int32_t>(need) : 0;
        const int32_t had_input = a.encoder_input_px;
        if (a.model != model.model || a.layer != extractor.layer() || a.weights_sha256 != model.weights_sha256 ||
            info.dtype != opt.bag.dtype || info.feature_dim != D || had_input != want_input ||
            a.stain_normalization != stain_json) {
          auto input = [](int32_t px) { return px > 0 ? ", tiles resized to " + std::to_string(px) + " px" : std::string(); };
          // Named only when one side has it (the message stays as it was for runs without).
          const bool any_stain = !a.stain_normalization.empty() || !stain_json.empty();
          auto stain = [any_stain](const std::string& j) {
            return any_stain ? ", stain normalisation " + (j.empty() ? std::string("none") : j) : std::string();
          };
          o.status = slide::core::failed_precondition(
              "bag " + o.bag_path + " exists but was made with model " + a.model + ", layer " + a.layer + ", " +
              slide::cache::feature_dtype_name(info.dtype) + ", weights " + a.weights_sha256.substr(0, 12) +
              input(had_input) + stain(a.stain_normalization) + " (this run: " + model.model + ", layer " +
              extractor.layer() + input(want_input) + stain(stain_json) + "): remove it or write to another --out");
        } else {
          o.skipped = true;
          o.tiles = info.num_tiles;
        }
      }
      if (!o.status.ok()) slide::core::log_error(o.status.message(), {{"slide", rec.slide_id}});
    } else if (rec.tile_count == 0) {
      slide::core::log_warn("slide has no tiles: no bag written", {{"slide", rec.slide_id}, {"store", o.store}});
    } else {
      todo.push_back(j);
    }
  }

  // Pass 2: the tiles of every slide to do, in order, in batches that may span slides (a store of
  // small slides or of patches still runs full batches), decoded one batch ahead of the forward
  // pass. Each slide's bag is created when its first tile is queued and committed after its last
  // row; a tile that fails fails its slide alone (its bag is discarded, its other rows dropped).
  struct Open {
    std::unique_ptr<slide::cache::BagWriter> writer;
    int64_t appended = 0;
    bool failed = false;
    clock::time_point start;
  };
  std::map<size_t, Open> open;  // by job index
  auto fail_slide = [&](size_t j, const Status& s) {
    Open& op = open[j];
    if (op.failed) return;
    op.failed = true;
    if (op.writer) op.writer->discard();
    op.writer.reset();
    outcomes[j].status = s;
    outcomes[j].tiles = 0;
    slide::core::log_error(s.to_string(), {{"slide", outcomes[j].slide_id}, {"store", outcomes[j].store}});
  };
  // A bag write that runs out of space (disk full, quota, file size limit) stops the run: every
  // later bag would fail the same way.
  Status out_of_space;
  auto note_space = [&](const Status& s) {
    if (s.code() == slide::core::StatusCode::kResourceExhausted && out_of_space.ok()) out_of_space = s;
  };
  auto start_slide = [&](size_t j) {
    const SlideJob& job = jobs[j];
    const slide::tile::SlideRecord& rec = job.record;
    const int64_t S = stores[job.store]->meta().tile_size_px;
    slide::cache::BagAttributes attrs;
    attrs.slide_id = rec.slide_id;
    attrs.label = rec.label;
    attrs.tile_size_px = static_cast<int32_t>(S);
    attrs.mpp_um = rec.tile_mpp_um;
    attrs.tile_size_l0_px = slide::tile::tile_size_level0_px(rec, S);
    // /coords: CLAM's patch_level and patch_size (the tile's side at the level read) with --layout
    // clam, TRIDENT's otherwise; TRIDENT's magnifications (10 / mpp: 0.25 um/px is 40x) and size.
    if (clam) {
      attrs.patch_level = rec.level;
      attrs.patch_size = static_cast<int32_t>(std::lround(attrs.tile_size_l0_px / std::max(1.0, rec.downsample)));
    }
    if (rec.source_mpp_um > 0) attrs.level0_magnification = static_cast<int32_t>(std::lround(10.0 / rec.source_mpp_um));
    if (rec.tile_mpp_um > 0) attrs.target_magnification = static_cast<int32_t>(std::lround(10.0 / rec.tile_mpp_um));
    attrs.level0_width = rec.width_l0, attrs.level0_height = rec.height_l0;
    attrs.model = model.model;
    attrs.layer = extractor.layer();
    attrs.weights_sha256 = model.weights_sha256;
    attrs.tool_version = opt.tool_version;
    // Tiles resized to the encoder's input: recorded beside tile_size_px (the stored tiles' side).
    if (resizer_for(S) != nullptr) attrs.encoder_input_px = static_cast<int32_t>(need);
    attrs.stain_normalization = stain_json;
    Open& op = open[j];
    op.start = clock::now();
    // Chunks no larger than the bag: a 20-tile bag is not padded to a 256-row chunk on disk.
    slide::cache::BagWriterOptions bag_options = opt.bag;
    bag_options.chunk_rows = std::clamp<int64_t>(static_cast<int64_t>(rec.tile_count), 1, opt.bag.chunk_rows);
    auto w = slide::cache::BagWriter::create(outcomes[j].bag_path, D, attrs, bag_options);
    if (!w.ok()) {
      note_space(w.status());
      return fail_slide(j, w.status());
    }
    op.writer = std::move(*w);
  };

  struct Item {
    size_t job;
    int64_t tile;  // offset in the slide
  };
  struct Batch {
    int64_t n = 0, S = 0, E = 0;  // tiles, their stored side, the side of `images` (the encoder's)
    std::vector<Item> items;
    std::vector<float> images;
    std::vector<int64_t> coords;
    std::vector<std::future<Status>> pending;
    std::vector<Status> statuses;
    void wait() {
      statuses.clear();
      for (auto& f : pending) statuses.push_back(f.get());
      pending.clear();
    }
  };
  Batch bufs[2];
  struct Drain {  // every decode task finishes before the buffers go away, whatever happens
    Batch* b;
    ~Drain() {
      b[0].wait();
      b[1].wait();
    }
  } drain{bufs};
  size_t cur_slide = 0;  // cursor into todo
  int64_t cur_tile = 0;
  // Fills `b` with up to opt.batch tiles of one tile size from the cursor and queues their decode.
  auto launch = [&](Batch& b) {
    b.items.clear();
    b.n = 0;
    b.S = 0;
    while (cur_slide < todo.size() && static_cast<int64_t>(b.items.size()) < opt.batch) {
      const size_t j = todo[cur_slide];
      const int64_t S = stores[jobs[j].store]->meta().tile_size_px;
      if (b.S != 0 && S != b.S) break;  // one tile size per batch
      if (cur_tile == 0) start_slide(j);
      if (open[j].failed) {
        ++cur_slide, cur_tile = 0;
        continue;
      }
      b.S = S;
      const int64_t take = std::min(opt.batch - static_cast<int64_t>(b.items.size()),
                                    static_cast<int64_t>(jobs[j].record.tile_count) - cur_tile);
      for (int64_t i = 0; i < take; ++i) b.items.push_back({j, cur_tile + i});
      cur_tile += take;
      if (cur_tile == static_cast<int64_t>(jobs[j].record.tile_count)) ++cur_slide, cur_tile = 0;
    }
    b.n = static_cast<int64_t>(b.items.size());
    const int64_t S = b.S;
    const BicubicResizer* resizer = resizer_for(S);
    const int64_t E = resizer != nullptr ? resizer->out_w() : S;
    b.E = E;
    b.images.resize(static_cast<size_t>(b.n * 3 * E * E));
    b.coords.resize(static_cast<size_t>(b.n * 2));
    for (int64_t i = 0; i < b.n; ++i) {
      const SlideJob& job = jobs[b.items[i].job];
      const slide::tile::StoreReader* store = stores[job.store].get();
      const std::string* dir = &opt.stores[job.store];
      const uint64_t index = job.record.first_tile_index + static_cast<uint64_t>(b.items[i].tile);
      float* dst = b.images.data() + i * 3 * E * E;
      int64_t* xy = b.coords.data() + 2 * i;
      b.pending.push_back(pool.submit(
          [store, dir, index, S, &opt, resizer, &lut, dst, xy] {
            return decode_into(*store, *dir, index, S, opt.stain, resizer, lut, dst, xy);
          }));
    }
  };

  int which = 0;
  launch(bufs[0]);
  while (bufs[which].n > 0) {
    Batch& b = bufs[which];
    b.wait();
    launch(bufs[1 - which]);  // decode the next batch while this one computes
    for (int64_t i = 0; i < b.n; ++i) {
      if (!b.statuses[i].ok()) fail_slide(b.items[i].job, b.statuses[i]);
    }
    features.resize(static_cast<size_t>(b.n * D));
    Status st = extractor.extract(b.images.data(), b.n, b.E, b.E, features.data());
    if (!st.ok()) {
      for (const Item& it : b.items) fail_slide(it.job, st);
    }
    // Append each slide's run of rows; commit the slides whose last row this was.
    for (int64_t i = 0; i < b.n;) {
      const size_t j = b.items[i].job;
      int64_t k = i;
      while (k < b.n && b.items[k].job == j) ++k;
      Open& op = open[j];
      if (!op.failed) {
        Status s = op.writer->append(k - i, std::span<const float>(features.data() + i * D, static_cast<size_t>((k - i) * D)),
                                     std::span<const int64_t>(b.coords.data() + 2 * i, static_cast<size_t>((k - i) * 2)));
        if (s.ok()) {
          op.appended += k - i;
          if (op.appended == static_cast<int64_t>(jobs[j].record.tile_count)) s = op.writer->commit();
        }
        if (!s.ok()) {
          note_space(s);
          fail_slide(j, s);
        } else if (op.appended == static_cast<int64_t>(jobs[j].record.tile_count)) {
          outcomes[j].tiles = op.appended;
          outcomes[j].seconds = std::chrono::duration<double>(clock::now() - op.start).count();
          summary.tiles_embedded += op.appended;
          slide::core::log_debug("bag written",
                                 {{"slide", outcomes[j].slide_id}, {"tiles", op.appended}, {"path", outcomes[j].bag_path}});
          open.erase(j);
        }
      }
      i = k;
    }
    progress.add(b.n);
    if (!out_of_space.ok()) break;
    if (opt.cancel != nullptr && opt.cancel->load()) {
      summary.interrupted = true;
      break;
    }
    which = 1 - which;
  }
  // Bags still open (interrupted, or failed) are discarded; an interrupted slide is not a failure.
  for (auto& [j, op] : open) {
    if (op.writer) op.writer->discard();
    if (summary.interrupted && !op.failed) {
      outcomes[j].status = slide::core::cancelled("interrupted: bag discarded");
      outcomes[j].tiles = 0;
    }
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    // Slides never reached after an interruption are left out of the summary.
    const bool reached = outcomes[j].skipped || !outcomes[j].status.ok() || outcomes[j].tiles > 0 ||
                         jobs[j].record.tile_count == 0;
    if (reached) summary.slides.push_back(outcomes[j]);
  }
  progress.finish();

  std::vector<slide::core::Status> bad;
  SLIDE_ASSIGN_OR_RETURN(auto bags, slide::cache::list_bags(bag_dir, true, &bad));
  for (const auto& s : bad) slide::core::log_warn("not a readable bag, left out of bags.csv: " + s.message());
  Status manifest = slide::cache::write_manifest(bag_dir, bags);
  if (manifest.ok() && clam) {
    // CLAM's dataset CSV (case_id, slide_id, label), its slide_id the bag's file stem.
    std::string csv = "case_id,slide_id,label\n";
    for (const auto& b : bags)
      csv += slide::core::csv_quote(b.attributes.slide_id) + "," +
             slide::core::csv_quote(std::filesystem::path(b.path).stem().string()) + "," +
             slide::core::csv_quote(b.attributes.label) + "\n";
    manifest = slide::core::write_file_atomic(opt.out_dir + "/dataset.csv", csv);
  }
  if (!out_of_space.ok()) {
    if (!manifest.ok()) slide::core::log_warn("bags.csv not written: " + manifest.to_string());
    return out_of_space.with_context("stopped: no space left for bags in " + opt.out_dir +
                                     " (complete bags are kept; free space and rerun to finish)");
  }
  SLIDE_RETURN_IF_ERROR_CTX(manifest, "bags.csv");
  summary.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return summary;
}

}  // namespace slide::train
