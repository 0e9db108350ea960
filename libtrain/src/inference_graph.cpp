// InferenceGraph (inference_graph.h): a CNN folded into fused-convolution, pooling and linear
// nodes, run through the op list on any backend.
#include "slide/train/inference_graph.h"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

namespace slide::train {

namespace {

using slide::core::invalid_argument;
using slide::core::ok_status;

// The weights of one fused convolution, folded on the host, and their prepared form (on a host
// backend the prepared weights share w's and b's storage: one copy).
struct ConvNode {
  std::string name;  // the model's path to the convolution ("layer1.0.conv2"), for errors
  Conv2dParams p;
  bool relu = false;
  Tensor w;  // [K, C, R, S] f32 in host memory, batch norm folded in
  Tensor b;  // [K]
  int64_t K = 0, C = 0, R = 0, S = 0;
  std::shared_ptr<const FusedConvWeights> prepared;
};

Status host_f32_or_f64(const Tensor& t, const std::string& what) {
  if (!t.defined()) return ok_status();
  if (t.device() != Device::kCpu || t.layout() != Layout::kPlain ||
      (t.dtype() != DType::kF32 && t.dtype() != DType::kF64))
    return invalid_argument("inference graph: " + what + " must be a plain f32 or f64 tensor in host memory, is " +
                            dtype_name(t.dtype()) + " on " + device_name(t.device()));
  return ok_status();
}

// An f32 copy in host memory of t (f32, or f64 rounded), which host_f32_or_f64 accepted.
Result<Tensor> f32_copy(const Tensor& t, const char* what) {
  SLIDE_ASSIGN_OR_RETURN(Tensor out, Tensor::empty(t.shape(), DType::kF32, cpu_allocator(), what));
  float* o = out.data<float>();
  if (t.dtype() == DType::kF64) {
    for (int64_t i = 0; i < t.numel(); ++i) o[i] = static_cast<float>(t.data<double>()[i]);
  } else {
    std::memcpy(o, t.data<float>(), t.bytes());
  }
  return out;
}

Result<ConvNode> conv_node(const Conv2d& c, const std::string& name) {
  SLIDE_RETURN_IF_ERROR(host_f32_or_f64(c.weight.value, name + ".weight"));
  SLIDE_RETURN_IF_ERROR(host_f32_or_f64(c.bias.value, name + ".bias"));
  ConvNode n;
  n.name = name;
  const Shape& ws = c.weight.value.shape();
  n.K = ws[0], n.C = ws[1], n.R = ws[2], n.S = ws[3];
  n.p = c.params();
  SLIDE_ASSIGN_OR_RETURN(n.w, f32_copy(c.weight.value, "inference convolution weights"));
  if (c.bias.value.defined()) {
    SLIDE_ASSIGN_OR_RETURN(n.b, f32_copy(c.bias.value, "inference convolution bias"));
  } else {
    SLIDE_ASSIGN_OR_RETURN(n.b, Tensor::zeros({n.K}, DType::kF32, cpu_allocator(), "inference convolution bias"));
  }
  return n;
}

// Inference batch norm after a convolution is an affine map per output channel: fold it into the
// convolution's weights and bias (in double, then rounded once).
Status fold_bn(ConvNode* s, const BatchNorm2d& bn, const std::string& name) {
  for (const Tensor* t : {&bn.weight.value, &bn.bias.value, &bn.running_mean.value, &bn.running_var.value})
    SLIDE_RETURN_IF_ERROR(host_f32_or_f64(*t, name));
  if (bn.weight.value.numel() != s->K)
    return invalid_argument("inference graph: " + name + " has " + std::to_string(bn.weight.value.numel()) +
                            " channels after a convolution of " + std::to_string(s->K));
  SLIDE_ASSIGN_OR_RETURN(const Tensor g, f32_copy(bn.weight.value, "batch norm weight"));
  SLIDE_ASSIGN_OR_RETURN(const Tensor beta, f32_copy(bn.bias.value, "batch norm bias"));
  SLIDE_ASSIGN_OR_RETURN(const Tensor mean, f32_copy(bn.running_mean.value, "batch norm mean"));
  SLIDE_ASSIGN_OR_RETURN(const Tensor var, f32_copy(bn.running_var.value, "batch norm variance"));
  float* w = s->w.data<float>();
  float* b = s->b.data<float>();
  const int64_t per_k = s->C * s->R * s->S;
  for (int64_t k = 0; k < s->K; ++k) {
    const double scale =
        static_cast<double>(g.data<float>()[k]) / std::sqrt(static_cast<double>(var.data<float>()[k]) + bn.eps());
    for (int64_t i = k * per_k; i < (k + 1) * per_k; ++i) w[i] = static_cast<float>(static_cast<double>(w[i]) * scale);
    b[k] = static_cast<float>(beta.data<float>()[k] + (static_cast<double>(b[k]) - mean.data<float>()[k]) * scale);
  }
  return ok_status();
}

std::string join(const std::string& where, const std::string& name) { return where.empty() ? name : where + "." + name; }

}  // namespace

struct InferenceGraph::Node {
  enum Kind { kConv, kMaxPool, kBlock, kGap, kLinear } kind = kConv;
  std::string name;
  ConvNode conv;               // kConv
  Pool2dParams pool;           // kMaxPool
  std::vector<ConvNode> main;  // kBlock: the main path; the last takes the residual add and ReLU
  std::vector<ConvNode> down;  // kBlock: the downsample convolution (empty: identity shortcut)
  Tensor lw, lb;               // kLinear: O x I and O, host copies
  Tensor lw_dev, lb_dev;       // kLinear: on the prepared backend's device
};

namespace {

using Node = InferenceGraph::Node;

// Conv (+ BN) (+ ReLU) runs of a flat layer list (a block's main path or downsample).
Result<std::vector<ConvNode>> conv_chain(Sequential& seq, const std::string& where) {
  std::vector<ConvNode> out;
  for (size_t i = 0; i < seq.size(); ++i) {
    Layer& l = seq.at(i);
    const std::string name = join(where, seq.name_at(i));
    if (auto* c = dynamic_cast<Conv2d*>(&l)) {
      SLIDE_ASSIGN_OR_RETURN(ConvNode n, conv_node(*c, name));
      out.push_back(std::move(n));
    } else if (auto* bn = dynamic_cast<BatchNorm2d*>(&l); bn != nullptr && !out.empty()) {
      SLIDE_RETURN_IF_ERROR(fold_bn(&out.back(), *bn, name));
    } else if (dynamic_cast<ReLU*>(&l) != nullptr && !out.empty()) {
      out.back().relu = true;
    } else {
      return slide::core::unimplemented(name + ": layer kind not supported by the inference graph");
    }
  }
  return out;
}

Status flatten(Layer& layer, const std::string& where, std::vector<Node>* nodes, int64_t* channels);

// Children [0, end) of `seq`: a convolution takes a following batch norm and ReLU with it.
Status flatten_children(Sequential* seq, size_t end, const std::string& where, std::vector<Node>* nodes,
                        int64_t* channels) {
  for (size_t i = 0; i < end; ++i) {
    Layer& l = seq->at(i);
    const std::string name = join(where, seq->name_at(i));
    if (auto* c = dynamic_cast<Conv2d*>(&l)) {
      Node n;
      n.kind = Node::kConv;
      n.name = name;
      SLIDE_ASSIGN_OR_RETURN(n.conv, conv_node(*c, name));
      if (i + 1 < end) {
        if (auto* bn = dynamic_cast<BatchNorm2d*>(&seq->at(i + 1))) {
          SLIDE_RETURN_IF_ERROR(fold_bn(&n.conv, *bn, join(where, seq->name_at(i + 1))));
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

Status flatten(Layer& layer, const std::string& where, std::vector<Node>* nodes, int64_t* channels) {
  if (auto* seq = dynamic_cast<Sequential*>(&layer)) return flatten_children(seq, seq->size(), where, nodes, channels);
  Node n;
  n.name = where;
  if (auto* c = dynamic_cast<Conv2d*>(&layer)) {
    n.kind = Node::kConv;
    SLIDE_ASSIGN_OR_RETURN(n.conv, conv_node(*c, where));
    *channels = n.conv.K;
  } else if (auto* block = dynamic_cast<ResidualBlock*>(&layer)) {
    n.kind = Node::kBlock;
    SLIDE_ASSIGN_OR_RETURN(n.main, conv_chain(block->main_path(), where));
    if (n.main.empty()) return slide::core::unimplemented(where + ": residual block without convolutions");
    n.main.back().relu = true;  // the block's output ReLU, after the sum
    if (Sequential* d = block->downsample()) {
      SLIDE_ASSIGN_OR_RETURN(n.down, conv_chain(*d, join(where, "downsample")));
      if (n.down.size() != 1 || n.down[0].relu)
        return slide::core::unimplemented(where + ".downsample: expected one convolution (+ batch norm)");
    }
    *channels = n.main.back().K;
  } else if (auto* mp = dynamic_cast<MaxPool2d*>(&layer)) {
    n.kind = Node::kMaxPool;
    n.pool = mp->params();
  } else if (dynamic_cast<GlobalAvgPool*>(&layer) != nullptr) {
    n.kind = Node::kGap;
  } else if (auto* lin = dynamic_cast<Linear*>(&layer)) {
    n.kind = Node::kLinear;
    SLIDE_RETURN_IF_ERROR(host_f32_or_f64(lin->weight.value, where + ".weight"));
    SLIDE_RETURN_IF_ERROR(host_f32_or_f64(lin->bias.value, where + ".bias"));
    SLIDE_ASSIGN_OR_RETURN(n.lw, f32_copy(lin->weight.value, "inference linear weights"));
    if (lin->bias.value.defined()) {
      SLIDE_ASSIGN_OR_RETURN(n.lb, f32_copy(lin->bias.value, "inference linear bias"));
    }
    *channels = n.lw.dim(0);
  } else {
    return slide::core::unimplemented(where + ": layer kind not supported by the inference graph");
  }
  nodes->push_back(std::move(n));
  return ok_status();
}

Status prepare_conv(Backend& be, ConvNode* c) {
  auto prepared = be.prepare_fused_conv2d(c->w, c->b);
  if (!prepared.ok()) return prepared.status().with_context(c->name);
  c->prepared = std::move(*prepared);
  return ok_status();
}

// y = the fused convolution of x (a new activation of x's dtype from the backend's allocator).
Result<Tensor> run_conv(Backend& be, const ConvNode& c, const Tensor& x) {
  if (x.rank() != 4) return invalid_argument(c.name + ": input " + shape_string(x.shape()) + " is not [N,C,H,W]");
  const int64_t P = conv_out_extent(x.dim(2), c.R, c.p.stride, c.p.pad);
  const int64_t Q = conv_out_extent(x.dim(3), c.S, c.p.stride, c.p.pad);
  if (P < 1 || Q < 1)
    return invalid_argument(c.name + ": input " + shape_string(x.shape()) + " is too small for the cut (a " +
                            std::to_string(c.R) + "x" + std::to_string(c.S) + " convolution's output would be empty)");
  SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty({x.dim(0), c.K, P, Q}, x.dtype(), be.allocator(), "activation"));
  SLIDE_RETURN_IF_ERROR_CTX(be.fused_conv2d_inference(x, *c.prepared, c.p, c.relu, nullptr, y), c.name);
  return y;
}

}  // namespace

InferenceGraph::InferenceGraph() = default;
InferenceGraph::InferenceGraph(InferenceGraph&&) noexcept = default;
InferenceGraph& InferenceGraph::operator=(InferenceGraph&&) noexcept = default;
InferenceGraph::~InferenceGraph() = default;

int64_t InferenceGraph::feature_dim() const { return feature_dim_; }
size_t InferenceGraph::size() const { return nodes_.size(); }

Result<InferenceGraph> InferenceGraph::build(Sequential& model, size_t cut) {
  if (cut >= model.size())
    return invalid_argument("inference graph: cut " + std::to_string(cut) + " beyond the model's " +
                            std::to_string(model.size()) + " children");
  InferenceGraph g;
  int64_t channels = 3;
  SLIDE_RETURN_IF_ERROR(flatten_children(&model, cut + 1, "", &g.nodes_, &channels));
  for (size_t i = 0; i + 1 < g.nodes_.size(); ++i) {
    if (g.nodes_[i].kind == Node::kLinear)
      return slide::core::unimplemented(g.nodes_[i].name + ": a Linear layer is supported only last");
  }
  g.feature_dim_ = channels;
  return g;
}

Status InferenceGraph::prepare(Backend& be) {
  prepared_for_ = nullptr;
  for (Node& n : nodes_) {
    switch (n.kind) {
      case Node::kConv:
        SLIDE_RETURN_IF_ERROR(prepare_conv(be, &n.conv));
        break;
      case Node::kBlock:
        for (ConvNode& c : n.main) SLIDE_RETURN_IF_ERROR(prepare_conv(be, &c));
        for (ConvNode& c : n.down) SLIDE_RETURN_IF_ERROR(prepare_conv(be, &c));
        break;
      case Node::kLinear: {
        SLIDE_ASSIGN_OR_RETURN(n.lw_dev, to_device(be, n.lw, n.name + ".weight"));
        SLIDE_ASSIGN_OR_RETURN(n.lb_dev, to_device(be, n.lb, n.name + ".bias"));
        break;
      }
      case Node::kMaxPool:
      case Node::kGap:
        break;
    }
  }
  prepared_for_ = &be;
  return ok_status();
}

Result<Tensor> InferenceGraph::run(Backend& be, const Tensor& images) const {
  if (prepared_for_ != &be)
    return slide::core::failed_precondition("inference graph: not prepared for the " + be.name() + " backend");
  if (images.rank() != 4 || images.dim(1) != 3 || images.dim(0) < 1 || images.dtype() != DType::kF32)
    return invalid_argument("inference graph: images " + shape_string(images.shape()) + " " +
                            dtype_name(images.dtype()) + ", expected [N, 3, H, W] f32 with N >= 1");
  const int64_t N = images.dim(0);
  const DType act = activation_dtype(be);
  if (act != DType::kF32 && act != DType::kF16 && act != DType::kBF16)
    return invalid_argument(std::string("inference graph: activations in ") + dtype_name(act) + " (f32, f16 or bf16)");
  Tensor a = images;
  if (act != DType::kF32) {
    SLIDE_ASSIGN_OR_RETURN(a, Tensor::empty(images.shape(), act, be.allocator(), "images in half precision"));
    SLIDE_RETURN_IF_ERROR(be.cast(images, a));
  }
  // Half-precision activations back to f32 (before pooling: the features are f32), plain first (a
  // backend may keep them channels last: cuda).
  auto to_f32 = [&](Tensor& t) -> Status {
    if (t.dtype() == DType::kF32) return ok_status();
    SLIDE_ASSIGN_OR_RETURN(const Tensor plain, be.to_plain(t));
    SLIDE_ASSIGN_OR_RETURN(Tensor wide, Tensor::empty(t.shape(), DType::kF32, be.allocator(), "activation in f32"));
    SLIDE_RETURN_IF_ERROR(be.cast(plain, wide));
    t = std::move(wide);
    return ok_status();
  };
  bool flat = false;  // [N, C] after pooling
  for (const Node& n : nodes_) {
    switch (n.kind) {
      case Node::kConv: {
        SLIDE_ASSIGN_OR_RETURN(a, run_conv(be, n.conv, a));
        break;
      }
      case Node::kBlock: {
        // The shortcut: the block's input itself (overwritten in place by the last convolution,
        // which frees nothing extra) or its downsample convolution's output.
        Tensor z = a;
        if (!n.down.empty()) {
          SLIDE_ASSIGN_OR_RETURN(z, run_conv(be, n.down[0], a));
        }
        Tensor h = a;
        for (size_t i = 0; i + 1 < n.main.size(); ++i) {
          SLIDE_ASSIGN_OR_RETURN(h, run_conv(be, n.main[i], h));
        }
        a = Tensor();  // the input is no longer needed (unless it is the shortcut)
        const ConvNode& last = n.main.back();
        if (h.rank() != 4 || z.rank() != 4 ||
            conv_out_extent(h.dim(2), last.R, last.p.stride, last.p.pad) != z.dim(2) ||
            conv_out_extent(h.dim(3), last.S, last.p.stride, last.p.pad) != z.dim(3) || z.dim(1) != last.K)
          return invalid_argument(last.name + ": the main path's output does not match the shortcut " +
                                  shape_string(z.shape()) + " (input too small for the cut?)");
        SLIDE_RETURN_IF_ERROR_CTX(be.fused_conv2d_inference(h, *last.prepared, last.p, true, &z, z), last.name);
        a = std::move(z);
        break;
      }
      case Node::kMaxPool: {
        if (a.rank() != 4) return invalid_argument(n.name + ": input is not [N,C,H,W]");
        const int64_t P = conv_out_extent(a.dim(2), n.pool.kernel, n.pool.stride, n.pool.pad);
        const int64_t Q = conv_out_extent(a.dim(3), n.pool.kernel, n.pool.stride, n.pool.pad);
        if (P < 1 || Q < 1)
          return invalid_argument(n.name + ": input " + shape_string(a.shape()) +
                                  " is too small for the cut (the pooling's output would be empty)");
        SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty({N, a.dim(1), P, Q}, a.dtype(), be.allocator(), "activation"));
        SLIDE_RETURN_IF_ERROR_CTX(be.max_pool2d_forward(a, n.pool, y), n.name);
        a = std::move(y);
        break;
      }
      case Node::kGap: {
        if (flat) break;
        SLIDE_RETURN_IF_ERROR(to_f32(a));
        SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty({N, a.dim(1)}, DType::kF32, be.allocator(), "pooled features"));
        SLIDE_RETURN_IF_ERROR_CTX(be.global_avg_pool_forward(a, y), n.name);
        a = std::move(y);
        flat = true;
        break;
      }
      case Node::kLinear: {
        if (!flat) return invalid_argument(n.name + ": a Linear layer before pooling is not supported");
        const int64_t O = n.lw.dim(0), I = n.lw.dim(1);
        if (a.dim(1) != I)
          return invalid_argument(n.name + ": input width " + std::to_string(a.dim(1)) + " differs from its " +
                                  std::to_string(I));
        SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty({N, O}, DType::kF32, be.allocator(), "logits"));
        SLIDE_RETURN_IF_ERROR_CTX(be.linear_forward(a, n.lw_dev, n.lb_dev, y), n.name);
        a = std::move(y);
        break;
      }
    }
  }
  if (!flat) {
    SLIDE_RETURN_IF_ERROR(to_f32(a));
    SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty({N, a.dim(1)}, DType::kF32, be.allocator(), "pooled features"));
    SLIDE_RETURN_IF_ERROR_CTX(be.global_avg_pool_forward(a, y), "global average pooling");
    a = std::move(y);
  }
  return a;
}

}  // namespace slide::train
