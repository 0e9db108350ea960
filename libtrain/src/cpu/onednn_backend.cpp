// backend.h's op list on oneDNN 2.x primitives, f32 tensors, CPU engine. Under --precision bf16 on
// a CPU with bf16 instructions the products' operands are rounded to bf16 (operand_dt below).
//
// Layouts (tensor.h's Layout): convolutions are created with tag::any, so oneDNN picks its
// blocked layouts; a convolution writes its output straight into the output tensor in the
// layout it picked when that is nChw8c/nChw16c (C a multiple of the block) and labels the tensor
// so. Batch norm, ReLU, the residual add and max pooling then run on that layout and pass it on,
// so a ResNet's activations stay blocked from the first convolution to the global average
// pooling, forward and backward, with reorders only at the edges (the image, the weights, the
// last [N,C,7,7] activation). Inputs in any other layout are reordered into scratch.
//
// Primitive descriptors are cached by op and shapes (creating one costs more than running a
// small one). Not thread-safe: one backend per training thread, like a stream.
//
// Where the contract differs from oneDNN's own semantics, the difference is done here:
// - parameter gradients accumulate (+=): oneDNN writes dw/db, so they go to scratch first;
// - batch norm: oneDNN returns the batch's biased variance; save_invstd = 1 / sqrt(var + eps)
//   and the running statistics (with the unbiased variance, as PyTorch) are updated here;
// - max pooling backward needs the forward's workspace, which the op list does not carry, so
//   the forward is run again inside backward (correct, not free);
// - cross-entropy: logsoftmax is oneDNN's, the weighted, smoothed loss and its gradient are
//   plain loops over N x C.
#include "onednn_backend.h"

#include <any>
#include <cmath>
#include <cstring>
#include <dnnl.hpp>
#include <functional>
#include <initializer_list>
#include <string>
#include <unordered_map>
#include <vector>

#include "../cross_entropy.h"
#include "../op_checks.h"
#include "../reference/reference_backend.h"

namespace slide::train {

namespace {

using dnnl::memory;
using slide::core::ok_status;
using tag = memory::format_tag;
using dt = memory::data_type;

constexpr detail::DTypes kCpuTypes{true, false, true};  // f32; blocked layouts

memory::dims dims_of(const Shape& s) { return memory::dims(s.begin(), s.end()); }

// Whether oneDNN's effective ISA (the CPU's, capped by ONEDNN_MAX_CPU_ISA) includes `isa`:
// dnnl_cpu_isa_t values are feature bit masks, and an ISA includes another iff it has all its bits.
bool effective_isa_includes(dnnl_cpu_isa_t isa) {
  return (static_cast<int>(dnnl::get_effective_cpu_isa()) & isa) == isa;
}

// A double's bits, for a primitive cache key.
int64_t bits_of(double v) {
  int64_t b = 0;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

std::string key_of(const char* op, std::initializer_list<int64_t> v) {
  std::string k(op);
  for (int64_t x : v) k += "," + std::to_string(x);
  return k;
}

// Fused convolution weights on cpu: the plain f32 weights and their reorders into the layouts the
// primitives asked for (OneDnnBackend::fused_weights makes them on first use; not thread-safe,
// like the backend).
class CpuFusedConvWeights final : public FusedConvWeights {
 public:
  CpuFusedConvWeights(const Backend* owner, Tensor w, Tensor b) : FusedConvWeights(owner, std::move(w), std::move(b)) {}
  mutable std::vector<std::pair<memory::desc, Tensor>> reordered;
};

class OneDnnBackend final : public Backend {
 public:
  explicit OneDnnBackend(Allocator& alloc)
      : alloc_(alloc), eng_(dnnl::engine::kind::cpu, 0), strm_(eng_), loops_(make_reference_backend(alloc)) {}
  std::string name() const override { return "cpu"; }
  Device device() const override { return Device::kCpu; }
  Allocator& allocator() override { return alloc_; }

  // The primitives made for the previous precision are dropped: each is made again, with the new
  // fpmath mode, on its next use.
  Status set_math_precision(MathPrecision p) override {
    cache_.clear();
    bf16_operands_ = p == MathPrecision::kBf16 && cpu_has_bf16_instructions();
    return Backend::set_math_precision(p);
  }

  // A reordered plain copy of a blocked x (from the budgeted allocator), or x itself.
  Result<Tensor> to_plain(const Tensor& x) override {
    if (x.layout() == Layout::kPlain) return x;
    if (x.dtype() != DType::kF32) return slide::core::unimplemented("to_plain: cpu has f32 only");
    SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty(x.shape(), x.dtype(), alloc_, "plain copy"));
    SLIDE_RETURN_IF_ERROR(run("to_plain", [&] {
      memory src = mem(md_of(x), x), dst = mem(md_of(y), y);
      dnnl::reorder(src, dst).execute(strm_, src, dst);
    }));
    return y;
  }

  Status conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Conv2dParams p, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d, detail::validate_conv2d_forward(x, w, b, p, y, kCpuTypes));
    return run("conv2d_forward", [&] {
      auto& pd = conv_fwd_pd(d, p, b.defined(), operand_dt());
      const memory y_pd = out_mem(pd.dst_desc(), y);
      std::unordered_map<int, memory> args{{DNNL_ARG_SRC, to_pd(pd.src_desc(), mem(md_of(x), x))},
                                           {DNNL_ARG_WEIGHTS, to_pd(pd.weights_desc(), mem(md_of(w), w))},
                                           {DNNL_ARG_DST, y_pd}};
      if (b.defined()) args.emplace(DNNL_ARG_BIAS, mem(pd.bias_desc(), b));
      dnnl::convolution_forward(pd).execute(strm_, args);
      from_pd(y_pd, y);
    });
  }

  // The fused inference convolution: oneDNN's forward_inference convolution with the bias, a sum
  // post-op for the residual (dst holds z before the primitive runs) and an eltwise_relu post-op.
  // The weights are reordered into the layout each primitive wants once, kept in the prepared
  // weights (CpuFusedConvWeights), and shared by every batch size that wants the same layout.
  Result<std::shared_ptr<const FusedConvWeights>> prepare_fused_conv2d(const Tensor& w, const Tensor& b) override {
    SLIDE_ASSIGN_OR_RETURN(auto plain, Backend::prepare_fused_conv2d(w, b));
    if (plain->weight().dtype() != DType::kF32)
      return slide::core::unimplemented("prepare_fused_conv2d: cpu has f32 only");
    return std::shared_ptr<const FusedConvWeights>(
        std::make_shared<CpuFusedConvWeights>(this, plain->weight(), plain->bias()));
  }

  Status fused_conv2d_inference(const Tensor& x, const FusedConvWeights& w, Conv2dParams p, bool relu,
                                const Tensor* residual, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d,
                           detail::validate_fused_conv2d_inference(this, x, w, p, residual, y, kCpuTypes));
    const auto* prepared = dynamic_cast<const CpuFusedConvWeights*>(&w);
    if (prepared == nullptr) return slide::core::invalid_argument("fused_conv2d_inference: weights not prepared by cpu");
    return run("fused_conv2d_inference", [&] {
      const bool sum = residual != nullptr;
      auto& pd = cached_product<dnnl::convolution_forward::primitive_desc>(
          key_of("conv_fused", {d.N, d.C, d.H, d.W, d.K, d.R, d.S, p.stride, p.pad, sum, relu}), [&](dt op) {
            auto [src, wei, bmd, dst] = conv_mds(d, true, op, op, dt::f32, /*pin_blocked=*/true);
            dnnl::convolution_forward::desc desc(dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
                                                 src, wei, bmd, dst, {p.stride, p.stride}, {p.pad, p.pad}, pad_r(d, p));
            dnnl::post_ops po;
            if (sum) po.append_sum(1.f);
            if (relu) po.append_eltwise(1.f, dnnl::algorithm::eltwise_relu, 0.f, 0.f);
            dnnl::primitive_attr attr = product_attr();
            attr.set_post_ops(po);
            return dnnl::convolution_forward::primitive_desc(desc, attr, eng_);
          });
      memory dst;
      if (sum) {
        // The sum post-op adds to what dst holds: z must be there, in the primitive's dst layout.
        const memory::desc z_md = md_of(*residual);
        memory z = mem(z_md, *residual);
        const bool in_place = residual->raw() == y.raw();
        if (in_place && z_md == pd.dst_desc()) {
          dst = z;  // the block's shortcut becomes its output, no copy
        } else {
          if (in_place) {  // z would be overwritten by its own reorder: copy it aside first
            memory aside = scratch(z_md);
            dnnl::reorder(z, aside).execute(strm_, z, aside);
            z = aside;
          }
          dst = out_mem(pd.dst_desc(), y);
          dnnl::reorder(z, dst).execute(strm_, z, dst);
        }
      } else {
        dst = out_mem(pd.dst_desc(), y);
      }
      dnnl::convolution_forward(pd).execute(strm_, {{DNNL_ARG_SRC, to_pd(pd.src_desc(), mem(md_of(x), x))},
                                                    {DNNL_ARG_WEIGHTS, fused_weights(*prepared, pd.weights_desc())},
                                                    {DNNL_ARG_BIAS, mem(pd.bias_desc(), w.bias())},
                                                    {DNNL_ARG_DST, dst}});
      from_pd(dst, y);
    });
  }

  Status conv2d_backward_data(const Tensor& dy, const Tensor& w, Conv2dParams p, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d, detail::validate_conv2d_backward_data(dy, w, p, dx, kCpuTypes));
    return run("conv2d_backward_data", [&] {
      auto& pd = cached_product<dnnl::convolution_backward_data::primitive_desc>(
          conv_key("conv_bwd_data", d, p, false), [&](dt op) {
            auto [src, wei, bias, dst] = conv_mds(d, false, dt::f32, op, op);  // diff_src f32; w, diff_dst
            (void)bias;
            dnnl::convolution_backward_data::desc desc(dnnl::algorithm::convolution_direct, src, wei, dst,
                                                       {p.stride, p.stride}, {p.pad, p.pad}, pad_r(d, p));
            return dnnl::convolution_backward_data::primitive_desc(desc, product_attr(), eng_,
                                                                   conv_fwd_pd(d, p, false, op));
          });
      const memory dx_pd = out_mem(pd.diff_src_desc(), dx);
      dnnl::convolution_backward_data(pd).execute(strm_, {{DNNL_ARG_DIFF_DST, to_pd(pd.diff_dst_desc(), mem(md_of(dy), dy))},
                                                          {DNNL_ARG_WEIGHTS, to_pd(pd.weights_desc(), mem(md_of(w), w))},
                                                          {DNNL_ARG_DIFF_SRC, dx_pd}});
      from_pd(dx_pd, dx);
    });
  }

  Status conv2d_backward_weights(const Tensor& x, const Tensor& dy, Conv2dParams p, Tensor& dw, Tensor& db) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d,
                           detail::validate_conv2d_backward_weights(x, dy, p, dw, db, kCpuTypes));
    SLIDE_ASSIGN_OR_RETURN(Tensor dw_new, Tensor::empty(dw.shape(), DType::kF32, alloc_, "conv dw scratch"));
    Tensor db_new;
    if (db.defined()) {
      SLIDE_ASSIGN_OR_RETURN(db_new, Tensor::empty(db.shape(), DType::kF32, alloc_, "conv db scratch"));
    }
    SLIDE_RETURN_IF_ERROR(run("conv2d_backward_weights", [&] {
      const bool bias = db.defined();
      auto& pd = cached_product<dnnl::convolution_backward_weights::primitive_desc>(
          conv_key("conv_bwd_w", d, p, bias), [&](dt op) {
            auto [src, wei, bmd, dst] = conv_mds(d, bias, op, dt::f32, op);  // x, diff_dst; diff_w f32
            auto desc = bias ? dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src, wei,
                                                                        bmd, dst, {p.stride, p.stride}, {p.pad, p.pad},
                                                                        pad_r(d, p))
                             : dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src, wei,
                                                                        dst, {p.stride, p.stride}, {p.pad, p.pad},
                                                                        pad_r(d, p));
            return dnnl::convolution_backward_weights::primitive_desc(desc, product_attr(), eng_,
                                                                      conv_fwd_pd(d, p, bias, op));
          });
      const memory dw_pd = out_mem(pd.diff_weights_desc(), dw_new, false);
      std::unordered_map<int, memory> args{{DNNL_ARG_SRC, to_pd(pd.src_desc(), mem(md_of(x), x))},
                                           {DNNL_ARG_DIFF_DST, to_pd(pd.diff_dst_desc(), mem(md_of(dy), dy))},
                                           {DNNL_ARG_DIFF_WEIGHTS, dw_pd}};
      if (bias) args.emplace(DNNL_ARG_DIFF_BIAS, mem(pd.diff_bias_desc(), db_new));
      dnnl::convolution_backward_weights(pd).execute(strm_, args);
      from_pd(dw_pd, dw_new);
    }));
    accumulate(dw, dw_new);
    if (db.defined()) accumulate(db, db_new);
    return ok_status();
  }

  // Batch norm runs in x's layout (its jit kernels read nChw8c/nChw16c natively); y and dx get it.
  Status batch_norm_forward_training(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                                     double momentum, Tensor& running_mean, Tensor& running_var, Tensor& y,
                                     Tensor& save_mean, Tensor& save_invstd) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_training(x, gamma, beta, running_mean, running_var, y, save_mean,
                                                                save_invstd, kCpuTypes));
    SLIDE_ASSIGN_OR_RETURN(Tensor var, Tensor::empty({d.C}, DType::kF32, alloc_, "batch norm variance"));
    SLIDE_RETURN_IF_ERROR(y.set_layout(x.layout()));
    SLIDE_RETURN_IF_ERROR(run("batch_norm_forward_training", [&] {
      auto& pd = bn_fwd_pd(x, eps, true);
      dnnl::batch_normalization_forward(pd).execute(
          strm_, {{DNNL_ARG_SRC, mem(pd.src_desc(), x)}, {DNNL_ARG_DST, mem(pd.dst_desc(), y)},
                  {DNNL_ARG_SCALE, mem(chan_md(d.C), gamma)}, {DNNL_ARG_SHIFT, mem(chan_md(d.C), beta)},
                  {DNNL_ARG_MEAN, mem(pd.mean_desc(), save_mean)}, {DNNL_ARG_VARIANCE, mem(pd.variance_desc(), var)}});
    }));
    const double m = static_cast<double>(d.N * d.HW);
    float *rm = running_mean.data<float>(), *rv = running_var.data<float>(), *si = save_invstd.data<float>();
    const float *sm = save_mean.data<float>(), *vp = var.data<float>();
    for (int64_t c = 0; c < d.C; ++c) {
      si[c] = static_cast<float>(1.0 / std::sqrt(double(vp[c]) + eps));
      rm[c] = static_cast<float>((1 - momentum) * rm[c] + momentum * sm[c]);
      rv[c] = static_cast<float>((1 - momentum) * rv[c] + momentum * double(vp[c]) * m / (m - 1));
    }
    return ok_status();
  }

  Status batch_norm_forward_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      const Tensor& running_mean, const Tensor& running_var, double eps,
                                      Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d, detail::validate_batch_norm_inference(x, gamma, beta, running_mean,
                                                                                         running_var, y, kCpuTypes));
    SLIDE_RETURN_IF_ERROR(y.set_layout(x.layout()));
    return run("batch_norm_forward_inference", [&] {
      auto& pd = bn_fwd_pd(x, eps, false);
      dnnl::batch_normalization_forward(pd).execute(
          strm_, {{DNNL_ARG_SRC, mem(pd.src_desc(), x)}, {DNNL_ARG_DST, mem(pd.dst_desc(), y)},
                  {DNNL_ARG_SCALE, mem(chan_md(d.C), gamma)}, {DNNL_ARG_SHIFT, mem(chan_md(d.C), beta)},
                  {DNNL_ARG_MEAN, mem(pd.mean_desc(), running_mean)},
                  {DNNL_ARG_VARIANCE, mem(pd.variance_desc(), running_var)}});
    });
  }

  Status batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                             const Tensor& save_invstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_backward(x, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta,
                                                                kCpuTypes));
    // oneDNN wants the variance; the op list carries invstd (what cuDNN saves): var = invstd^-2 - eps.
    SLIDE_ASSIGN_OR_RETURN(Tensor var, Tensor::empty({d.C}, DType::kF32, alloc_, "batch norm variance"));
    SLIDE_ASSIGN_OR_RETURN(Tensor dg_new, Tensor::empty({d.C}, DType::kF32, alloc_, "batch norm dgamma scratch"));
    SLIDE_ASSIGN_OR_RETURN(Tensor db_new, Tensor::empty({d.C}, DType::kF32, alloc_, "batch norm dbeta scratch"));
    constexpr double kEps = 1e-5;  // any eps works: it is added back inside oneDNN
    for (int64_t c = 0; c < d.C; ++c) {
      const double is = save_invstd.data<float>()[c];
      var.data<float>()[c] = static_cast<float>(1.0 / (is * is) - kEps);
    }
    SLIDE_RETURN_IF_ERROR(dx.set_layout(x.layout()));
    SLIDE_RETURN_IF_ERROR(run("batch_norm_backward", [&] {
      auto& fwd = bn_fwd_pd(x, kEps, true);
      auto& pd = cached<dnnl::batch_normalization_backward::primitive_desc>(
          key_of("bn_bwd", {d.N, d.C, x.dim(2), x.dim(3), static_cast<int64_t>(x.layout())}), [&] {
            const auto md = md_of(x);
            dnnl::batch_normalization_backward::desc desc(dnnl::prop_kind::backward, md, md, static_cast<float>(kEps),
                                                          dnnl::normalization_flags::use_scale |
                                                              dnnl::normalization_flags::use_shift);
            return dnnl::batch_normalization_backward::primitive_desc(desc, eng_, fwd);
          });
      dnnl::batch_normalization_backward(pd).execute(
          strm_, {{DNNL_ARG_SRC, mem(pd.src_desc(), x)}, {DNNL_ARG_DIFF_DST, to_pd(pd.diff_dst_desc(), mem(md_of(dy), dy))},
                  {DNNL_ARG_MEAN, mem(pd.mean_desc(), save_mean)}, {DNNL_ARG_VARIANCE, mem(pd.variance_desc(), var)},
                  {DNNL_ARG_SCALE, mem(chan_md(d.C), gamma)},
                  // oneDNN 2.6 refuses to run (invalid arguments) without a SHIFT on backward, although
                  // no gradient depends on beta; gamma's buffer stands in, read-only.
                  {DNNL_ARG_SHIFT, mem(chan_md(d.C), gamma)}, {DNNL_ARG_DIFF_SRC, mem(pd.diff_src_desc(), dx)},
                  {DNNL_ARG_DIFF_SCALE, mem(chan_md(d.C), dg_new)}, {DNNL_ARG_DIFF_SHIFT, mem(chan_md(d.C), db_new)}});
    }));
    accumulate(dgamma, dg_new);
    accumulate(dbeta, db_new);
    return ok_status();
  }

  // Element-wise ops see their tensors as flat arrays: the output takes the first input's layout,
  // and a second input in another layout is reordered into it first.
  Status relu_forward(const Tensor& x, Tensor& y) override {
    return eltwise_forward("relu_forward", dnnl::algorithm::eltwise_relu_use_dst_for_bwd, x, y);
  }
  Status relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    return eltwise_backward("relu_backward", dnnl::algorithm::eltwise_relu_use_dst_for_bwd, y, dy, dx);
  }
  Status add(const Tensor& a, const Tensor& b, Tensor& y) override {
    return binary("add", dnnl::algorithm::binary_add, a, b, y);
  }
  Status mul(const Tensor& a, const Tensor& b, Tensor& y) override {
    return binary("mul", dnnl::algorithm::binary_mul, a, b, y);
  }

  // Max pooling runs in a blocked layout (blocked_layout): oneDNN 2.6 has only a scalar reference
  // kernel for nchw pooling, which took 0.24 s of a 3.5 s ResNet-18 training step (batch 32, 224 px,
  // 2 threads) against about 0.02 s for the jit kernel.
  Status max_pool2d_forward(const Tensor& x, Pool2dParams p, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::PoolDims d,
                           detail::validate_max_pool("max_pool2d_forward", x, p, &y, nullptr, nullptr, kCpuTypes));
    return run("max_pool2d_forward", [&] {
      auto& pd = pool_fwd_pd(d, p, dnnl::prop_kind::forward_inference);
      const memory y_pd = out_mem(pd.dst_desc(), y);
      dnnl::pooling_forward(pd).execute(strm_, {{DNNL_ARG_SRC, to_pd(pd.src_desc(), mem(md_of(x), x))}, {DNNL_ARG_DST, y_pd}});
      from_pd(y_pd, y);
    });
  }

  // The op list carries no workspace (the argmax positions), so backward runs the forward again
  // to get it: correct, and cheap next to the convolutions in the blocked layout.
  Status max_pool2d_backward(const Tensor& x, const Tensor& dy, Pool2dParams p, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::PoolDims d,
                           detail::validate_max_pool("max_pool2d_backward", x, p, nullptr, &dy, &dx, kCpuTypes));
    return run("max_pool2d_backward", [&] {
      auto& fwd = pool_fwd_pd(d, p, dnnl::prop_kind::forward_training);
      auto& pd = cached<dnnl::pooling_backward::primitive_desc>(pool_key("pool_bwd", d, p), [&] {
        const Layout l = blocked_layout(d.C);
        dnnl::pooling_backward::desc desc(dnnl::algorithm::pooling_max, md_in(x.shape(), l), md_in({d.N, d.C, d.P, d.Q}, l),
                                          {p.stride, p.stride}, {p.kernel, p.kernel}, {p.pad, p.pad}, pool_pad_r(d, p));
        return dnnl::pooling_backward::primitive_desc(desc, eng_, fwd);
      });
      const memory ws = scratch(fwd.workspace_desc());
      const size_t forward_scratch = scratch_.size();
      dnnl::pooling_forward(fwd).execute(strm_, {{DNNL_ARG_SRC, to_pd(fwd.src_desc(), mem(md_of(x), x))},
                                                 {DNNL_ARG_DST, scratch(fwd.dst_desc())},
                                                 {DNNL_ARG_WORKSPACE, ws}});
      strm_.wait();
      scratch_.resize(forward_scratch);  // the recomputed y (and a reordered x) go back before dy and dx
      const memory dx_pd = out_mem(pd.diff_src_desc(), dx);
      dnnl::pooling_backward(pd).execute(strm_, {{DNNL_ARG_DIFF_DST, to_pd(pd.diff_dst_desc(), mem(md_of(dy), dy))},
                                                 {DNNL_ARG_DIFF_SRC, dx_pd},
                                                 {DNNL_ARG_WORKSPACE, ws}});
      from_pd(dx_pd, dx);
    });
  }

  // Global average pooling runs plain: oneDNN 2.6 has only its reference kernel for blocked
  // global pooling (38 ms a ResNet-18 step, against 1 ms for nchw's and the [N,C,7,7] reorder).
  Status global_avg_pool_forward(const Tensor& x, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_global_avg_pool("global_avg_pool_forward", x, y, kCpuTypes));
    return run("global_avg_pool_forward", [&] {
      auto& pd = gap_fwd_pd(x.shape());
      dnnl::pooling_forward(pd).execute(strm_, {{DNNL_ARG_SRC, to_pd(pd.src_desc(), mem(md_of(x), x))},
                                                {DNNL_ARG_DST, mem(plain({d.N, d.C, 1, 1}, tag::nchw), y)}});
    });
  }

  Status global_avg_pool_backward(const Tensor& dy, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_global_avg_pool("global_avg_pool_backward", dx, dy, kCpuTypes));
    SLIDE_RETURN_IF_ERROR(dx.set_layout(Layout::kPlain));
    return run("global_avg_pool_backward", [&] {
      auto& fwd = gap_fwd_pd(dx.shape());
      auto& pd = cached<dnnl::pooling_backward::primitive_desc>(key_of("gap_bwd", {d.N, d.C, dx.dim(2), dx.dim(3)}), [&] {
        dnnl::pooling_backward::desc desc(dnnl::algorithm::pooling_avg_exclude_padding, plain(dx.shape(), tag::nchw),
                                          plain({d.N, d.C, 1, 1}, tag::nchw), {1, 1}, {dx.dim(2), dx.dim(3)}, {0, 0},
                                          {0, 0});
        return dnnl::pooling_backward::primitive_desc(desc, eng_, fwd);
      });
      dnnl::pooling_backward(pd).execute(strm_, {{DNNL_ARG_DIFF_DST, mem(plain({d.N, d.C, 1, 1}, tag::nchw), dy)},
                                                 {DNNL_ARG_DIFF_SRC, mem(pd.diff_src_desc(), dx)}});
    });
  }

  // Under bf16 operands a matmul primitive (y[N,O] = x[N,I] times w seen as [I,O], bias [1,O]):
  // oneDNN 2.6's brgemm bf16 matmul is about 8% faster than its bf16 inner product on a ViT's
  // shapes (N = 3152, I and O 768 to 3072). At f32 the inner product, as before.
  Status linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) override {
    return linear("linear_forward", x, w, b, false, y);
  }
  // The same primitive with an eltwise_gelu_erf post-op: GELU on the f32 outputs, in the primitive.
  Status linear_gelu_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) override {
    return linear("linear_gelu_forward", x, w, b, true, y);
  }

  Status linear_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d,
                           detail::validate_linear("linear_backward_data", dx, w, nullptr, dy, kCpuTypes));
    return run("linear_backward_data", [&] {
      auto& pd = cached_product<dnnl::inner_product_backward_data::primitive_desc>(
          key_of("ip_bwd_data", {d.N, d.I, d.O}), [&](dt op) {
            dnnl::inner_product_backward_data::desc desc(plain({d.N, d.I}, tag::nc), plain({d.O, d.I}, tag::oi, op),
                                                         plain({d.N, d.O}, tag::nc, op));
            return dnnl::inner_product_backward_data::primitive_desc(desc, product_attr(), eng_, ip_fwd_pd(d, false, op));
          });
      dnnl::inner_product_backward_data(pd).execute(
          strm_, {{DNNL_ARG_DIFF_DST, to_pd(pd.diff_dst_desc(), mem(plain({d.N, d.O}, tag::nc), dy))},
                  {DNNL_ARG_WEIGHTS, to_pd(pd.weights_desc(), mem(plain({d.O, d.I}, tag::oi), w))},
                  {DNNL_ARG_DIFF_SRC, mem(pd.diff_src_desc(), dx)}});
    });
  }

  Status linear_backward_weights(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d,
                           detail::validate_linear_backward_weights(x, dy, dw, db, kCpuTypes));
    SLIDE_ASSIGN_OR_RETURN(Tensor dw_new, Tensor::empty(dw.shape(), DType::kF32, alloc_, "linear dw scratch"));
    Tensor db_new;
    if (db.defined()) {
      SLIDE_ASSIGN_OR_RETURN(db_new, Tensor::empty(db.shape(), DType::kF32, alloc_, "linear db scratch"));
    }
    SLIDE_RETURN_IF_ERROR(run("linear_backward_weights", [&] {
      const bool bias = db.defined();
      auto& pd = cached_product<dnnl::inner_product_backward_weights::primitive_desc>(
          key_of("ip_bwd_w", {d.N, d.I, d.O, bias}), [&](dt op) {
            const auto src = plain({d.N, d.I}, tag::nc, op), wei = plain({d.O, d.I}, tag::oi),
                       dst = plain({d.N, d.O}, tag::nc, op);
            auto desc = bias ? dnnl::inner_product_backward_weights::desc(src, wei, plain({d.O}, tag::x), dst)
                             : dnnl::inner_product_backward_weights::desc(src, wei, dst);
            return dnnl::inner_product_backward_weights::primitive_desc(desc, product_attr(), eng_,
                                                                        ip_fwd_pd(d, bias, op));
          });
      std::unordered_map<int, memory> args{{DNNL_ARG_SRC, to_pd(pd.src_desc(), mem(plain({d.N, d.I}, tag::nc), x))},
                                           {DNNL_ARG_DIFF_DST, to_pd(pd.diff_dst_desc(), mem(plain({d.N, d.O}, tag::nc), dy))},
                                           {DNNL_ARG_DIFF_WEIGHTS, mem(pd.diff_weights_desc(), dw_new)}};
      if (bias) args.emplace(DNNL_ARG_DIFF_BIAS, mem(pd.diff_bias_desc(), db_new));
      dnnl::inner_product_backward_weights(pd).execute(strm_, args);
    }));
    accumulate(dw, dw_new);
    if (db.defined()) accumulate(db, db_new);
    return ok_status();
  }

  Status softmax_cross_entropy_forward(const Tensor& logits, const Tensor& labels, const Tensor& class_weights,
                                       double label_smoothing, Tensor& probs, double* loss) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d,
                           detail::validate_cross_entropy("softmax_cross_entropy_forward", logits, labels, class_weights,
                                                          label_smoothing, probs, kCpuTypes));
    // log-probabilities into probs, then exp in place after the loss has read them.
    SLIDE_RETURN_IF_ERROR(run("softmax_cross_entropy_forward", [&] {
      auto& pd = cached<dnnl::logsoftmax_forward::primitive_desc>(key_of("logsoftmax", {d.N, d.I}), [&] {
        dnnl::logsoftmax_forward::desc desc(dnnl::prop_kind::forward_inference, plain({d.N, d.I}, tag::nc), 1);
        return dnnl::logsoftmax_forward::primitive_desc(desc, eng_);
      });
      dnnl::logsoftmax_forward(pd).execute(strm_, {{DNNL_ARG_SRC, mem(pd.src_desc(), logits)},
                                                   {DNNL_ARG_DST, mem(pd.dst_desc(), probs)}});
    }));
    *loss = detail::nll_to_probs(probs.data<float>(), labels.data<int32_t>(),
                                 class_weights.defined() ? class_weights.data<float>() : nullptr, d.N, d.I,
                                 label_smoothing);
    return ok_status();
  }

  // The gradient is (probs - target) scaled per sample: a plain N x C loop, the reference's.
  Status softmax_cross_entropy_backward(const Tensor& probs, const Tensor& labels, const Tensor& class_weights,
                                        double label_smoothing, Tensor& dlogits) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_cross_entropy("softmax_cross_entropy_backward", probs, labels,
                                                         class_weights, label_smoothing, dlogits, kCpuTypes)
                              .status());
    return loops_->softmax_cross_entropy_backward(probs, labels, class_weights, label_smoothing, dlogits);
  }

  // oneDNN has no optimizer primitives; the updates are element-wise and memory-bound, so the
  // reference backend's loops serve (the same code, not a copy).
  Status sgd_update(Tensor& param, const Tensor& grad, Tensor& momentum_buf, double lr, double momentum,
                    double dampening, double weight_decay, bool nesterov, bool first_step) override {
    if (param.dtype() != DType::kF32) return slide::core::unimplemented("sgd_update: cpu has f32 only");
    return loops_->sgd_update(param, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, first_step);
  }
  Status adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr, double beta1, double beta2,
                      double eps, double weight_decay, int64_t step) override {
    if (param.dtype() != DType::kF32) return slide::core::unimplemented("adamw_update: cpu has f32 only");
    return loops_->adamw_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step);
  }

  // --- Attention MIL ops: oneDNN eltwise (tanh, logistic: the *_use_dst_for_bwd forms, so backward
  // needs only the output, as the op list says), softmax and matmul primitives ---
  // Vision Transformer ops on oneDNN's layer_normalization (inference, scale and shift: y may be
  // x, oneDNN normalises in place) and eltwise_gelu_erf primitives, and attention as batched
  // matmuls over strided views of qkv (measured: bench/embed_bench.sh, ViT-B/16 and ViT-L/16).
  Status layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_layer_norm(x, gamma, beta, eps, y, kCpuTypes));
    SLIDE_RETURN_IF_ERROR(plain_f32("layer_norm_forward", {&x, &gamma, &beta, &y}));
    return run("layer_norm_forward", [&] {
      const int64_t eps_bits = bits_of(eps);
      auto& pd = cached<dnnl::layer_normalization_forward::primitive_desc>(
          key_of("layer_norm_fwd", {d.N, d.I, eps_bits}), [&] {
            dnnl::layer_normalization_forward::desc desc(
                dnnl::prop_kind::forward_inference, plain({d.N, d.I}, tag::ab), static_cast<float>(eps),
                dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift);
            return dnnl::layer_normalization_forward::primitive_desc(desc, eng_);
          });
      dnnl::layer_normalization_forward(pd).execute(strm_, {{DNNL_ARG_SRC, mem(pd.src_desc(), x)},
                                                            {DNNL_ARG_SCALE, mem(chan_md(d.I), gamma)},
                                                            {DNNL_ARG_SHIFT, mem(chan_md(d.I), beta)},
                                                            {DNNL_ARG_DST, mem(pd.dst_desc(), y)}});
    });
  }
  Status gelu_forward(const Tensor& x, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(plain_f32("gelu_forward", {&x, &y}));
    return eltwise_forward("gelu_forward", dnnl::algorithm::eltwise_gelu_erf, x, y);
  }
  // Per sequence b: scores[H,T,T] = scale * Q K^T, one batched matmul over the H heads whose Q and
  // K^T are strided views into qkv (row stride 3C, head stride Dh: the permute of the default is
  // never made); softmax over the H*T rows; out_b[T, H, Dh] = scores V, written through a strided
  // view (row stride C) so the heads land concatenated per token. Under bf16 operands
  // (operand_dt), the views are into a bf16 copy of qkv (one reorder for the batch) and each
  // sequence's scores, softmax'd in f32, are rounded into a bf16 copy before the second product;
  // scores and out stay f32.
  Status attention_forward(const Tensor& qkv, int64_t batch, int64_t heads, double scale, Tensor& out) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::AttentionDims d,
                           detail::validate_attention(qkv, batch, heads, scale, out, kCpuTypes));
    SLIDE_RETURN_IF_ERROR(plain_f32("attention_forward", {&qkv, &out}));
    const int64_t T = d.T, H = d.H, Dh = d.Dh, C = H * Dh;
    SLIDE_ASSIGN_OR_RETURN(Tensor scores, Tensor::empty({H * T, T}, DType::kF32, alloc_, "attention scores"));
    return run("attention_forward", [&] {
      const dt op = operand_dt();
      const memory::desc q_md({H, T, Dh}, op, memory::dims{Dh, 3 * C, 1});
      const memory::desc kt_md({H, Dh, T}, op, memory::dims{Dh, 1, 3 * C});
      const memory::desc s_md({H, T, T}, dt::f32, tag::abc);
      const memory::desc s_op_md({H, T, T}, op, tag::abc);
      const memory::desc v_md({H, T, Dh}, op, memory::dims{Dh, 3 * C, 1});
      const memory::desc o_md({H, T, Dh}, dt::f32, memory::dims{Dh, C, 1});
      const int64_t scale_bits = bits_of(scale);
      const std::string suffix = op == dt::bf16 ? ",bf16" : "";
      // No fallback to f32 here: oneDNN's matmul has bf16 kernels wherever the ISA has bf16
      // instructions (operand_dt is bf16 only there), for any strides.
      auto& qk = cached<dnnl::matmul::primitive_desc>(key_of("attention_qk", {T, H, Dh, scale_bits}) + suffix, [&] {
        dnnl::primitive_attr attr = product_attr();
        attr.set_output_scales(0, {static_cast<float>(scale)});
        return dnnl::matmul::primitive_desc(dnnl::matmul::desc(q_md, kt_md, s_md), attr, eng_);
      });
      auto& sv = cached<dnnl::matmul::primitive_desc>(key_of("attention_sv", {T, H, Dh}) + suffix, [&] {
        return dnnl::matmul::primitive_desc(dnnl::matmul::desc(s_op_md, v_md, o_md), product_attr(), eng_);
      });
      auto& sm = softmax_fwd_pd(H * T, T);
      memory s_mem(s_md, eng_, scores.raw());
      const memory s_rows(sm.src_desc(), eng_, scores.raw());
      memory s_op = op == dt::f32 ? s_mem : scratch(s_op_md);
      const size_t esize = op == dt::f32 ? sizeof(float) : sizeof(uint16_t);
      char* base = static_cast<char*>(qkv.raw());
      if (op != dt::f32) {  // qkv rounded to the operands' type, once for the batch
        const memory::desc flat_f32({qkv.numel()}, dt::f32, tag::a);
        base = static_cast<char*>(to_pd(memory::desc({qkv.numel()}, op, tag::a), mem(flat_f32, qkv)).get_data_handle());
      }
      auto* dst = static_cast<float*>(out.raw());
      for (int64_t b = 0; b < d.B; ++b) {
        char* seq = base + static_cast<size_t>(b * T * 3 * C) * esize;
        dnnl::matmul(qk).execute(strm_, {{DNNL_ARG_SRC, memory(q_md, eng_, seq)},
                                         {DNNL_ARG_WEIGHTS, memory(kt_md, eng_, seq + C * esize)},
                                         {DNNL_ARG_DST, s_mem}});
        dnnl::softmax_forward(sm).execute(strm_, {{DNNL_ARG_SRC, s_rows}, {DNNL_ARG_DST, s_rows}});
        if (op != dt::f32) dnnl::reorder(s_mem, s_op).execute(strm_, s_mem, s_op);
        dnnl::matmul(sv).execute(strm_, {{DNNL_ARG_SRC, s_op},
                                         {DNNL_ARG_WEIGHTS, memory(v_md, eng_, seq + 2 * C * esize)},
                                         {DNNL_ARG_DST, memory(o_md, eng_, dst + b * T * C)}});
      }
    });
  }
  Status gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    SLIDE_RETURN_IF_ERROR(plain_f32("gelu_backward", {&x, &dy, &dx}));
    return loops_->gelu_backward(x, dy, dx);
  }
  Status cast(const Tensor& x, Tensor& y) override { return loops_->cast(x, y); }  // plain tensors only
  Status gather_augment(const Tensor& tiles, const Tensor& records, Tensor& images) override {
    return loops_->gather_augment(tiles, records, images);
  }
  // Synchronised batch norm's pieces: the reference's loops over plain tensors (the layer reads x
  // and dy through to_plain). Per-channel sums of a few KB between all-reduces; their time is the
  // loops', as the old host path's was.
  Status batch_norm_stats(const Tensor& x, Tensor& stats) override {
    SLIDE_RETURN_IF_ERROR(plain_f32("batch_norm_stats", {&x}));
    return loops_->batch_norm_stats(x, stats);
  }
  Status batch_norm_deviations(const Tensor& x, const Tensor& stats, Tensor& devs) override {
    SLIDE_RETURN_IF_ERROR(plain_f32("batch_norm_deviations", {&x}));
    return loops_->batch_norm_deviations(x, stats, devs);
  }
  Status batch_norm_forward_from_stats(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& stats,
                                       const Tensor& devs, double eps, double momentum, Tensor& running_mean,
                                       Tensor& running_var, Tensor& y, Tensor& save_mean,
                                       Tensor& save_invstd) override {
    SLIDE_RETURN_IF_ERROR(plain_f32("batch_norm_forward_from_stats", {&x, &y}));
    return loops_->batch_norm_forward_from_stats(x, gamma, beta, stats, devs, eps, momentum, running_mean, running_var,
                                                 y, save_mean, save_invstd);
  }
  Status batch_norm_backward_reduce(const Tensor& x, const Tensor& dy, const Tensor& save_mean,
                                    const Tensor& save_invstd, Tensor& sums, Tensor& dgamma, Tensor& dbeta) override {
    SLIDE_RETURN_IF_ERROR(plain_f32("batch_norm_backward_reduce", {&x, &dy}));
    return loops_->batch_norm_backward_reduce(x, dy, save_mean, save_invstd, sums, dgamma, dbeta);
  }
  Status batch_norm_backward_elemt(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                                   const Tensor& save_invstd, const Tensor& stats, const Tensor& sums,
                                   Tensor& dx) override {
    SLIDE_RETURN_IF_ERROR(plain_f32("batch_norm_backward_elemt", {&x, &dy, &dx}));
    return loops_->batch_norm_backward_elemt(x, dy, gamma, save_mean, save_invstd, stats, sums, dx);
  }
  Status sum_of_squares(const Tensor& x, double* out) override {
    SLIDE_RETURN_IF_ERROR(plain_f32("sum_of_squares", {&x}));
    return loops_->sum_of_squares(x, out);
  }
  Status scale(const Tensor& x, double alpha, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(plain_f32("scale", {&x, &y}));
    return loops_->scale(x, alpha, y);
  }
  Status permute(const Tensor& x, const std::vector<int>& perm, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(plain_f32("permute", {&x, &y}));
    return loops_->permute(x, perm, y);
  }

  Status tanh_forward(const Tensor& x, Tensor& y) override {
    return eltwise_forward("tanh_forward", dnnl::algorithm::eltwise_tanh_use_dst_for_bwd, x, y);
  }
  Status tanh_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    return eltwise_backward("tanh_backward", dnnl::algorithm::eltwise_tanh_use_dst_for_bwd, y, dy, dx);
  }
  Status sigmoid_forward(const Tensor& x, Tensor& y) override {
    return eltwise_forward("sigmoid_forward", dnnl::algorithm::eltwise_logistic_use_dst_for_bwd, x, y);
  }
  Status sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    return eltwise_backward("sigmoid_backward", dnnl::algorithm::eltwise_logistic_use_dst_for_bwd, y, dy, dx);
  }

  Status softmax_forward(const Tensor& x, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_rows("softmax_forward", x, y, nullptr, kCpuTypes));
    return run("softmax_forward", [&] {
      auto& pd = softmax_fwd_pd(d.N, d.I);
      dnnl::softmax_forward(pd).execute(strm_, {{DNNL_ARG_SRC, mem(pd.src_desc(), x)}, {DNNL_ARG_DST, mem(pd.dst_desc(), y)}});
    });
  }

  Status softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_rows("softmax_backward", y, dy, &dx, kCpuTypes));
    return run("softmax_backward", [&] {
      auto& pd = cached<dnnl::softmax_backward::primitive_desc>(key_of("softmax_bwd", {d.N, d.I}), [&] {
        dnnl::softmax_backward::desc desc(plain({d.N, d.I}, tag::nc), plain({d.N, d.I}, tag::nc), 1);
        return dnnl::softmax_backward::primitive_desc(desc, eng_, softmax_fwd_pd(d.N, d.I));
      });
      dnnl::softmax_backward(pd).execute(strm_, {{DNNL_ARG_DST, mem(pd.dst_desc(), y)},
                                                 {DNNL_ARG_DIFF_DST, mem(pd.diff_dst_desc(), dy)},
                                                 {DNNL_ARG_DIFF_SRC, mem(pd.diff_src_desc(), dx)}});
    });
  }

  // A transposed operand is the same storage described with the swapped (ba) layout: no copy.
  Status matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::MatmulDims d,
                           detail::validate_matmul(a, transpose_a, b, transpose_b, y, kCpuTypes));
    return run("matmul", [&] {
      const tag ta = transpose_a ? tag::ba : tag::ab, tb = transpose_b ? tag::ba : tag::ab;
      const auto y_md = plain({d.M, d.N}, tag::ab);
      auto& pd = cached_product<dnnl::matmul::primitive_desc>(
          key_of("matmul", {d.M, d.K, d.N, transpose_a, transpose_b}), [&](dt op) {
            return dnnl::matmul::primitive_desc(
                dnnl::matmul::desc(plain({d.M, d.K}, ta, op), plain({d.K, d.N}, tb, op), y_md), product_attr(), eng_);
          });
      dnnl::matmul(pd).execute(strm_, {{DNNL_ARG_SRC, to_pd(pd.src_desc(), mem(plain({d.M, d.K}, ta), a))},
                                       {DNNL_ARG_WEIGHTS, to_pd(pd.weights_desc(), mem(plain({d.K, d.N}, tb), b))},
                                       {DNNL_ARG_DST, mem(y_md, y)}});
    });
  }

 private:
  // linear_forward, and linear_gelu_forward when `gelu`.
  Status linear(const char* name, const Tensor& x, const Tensor& w, const Tensor& b, bool gelu, Tensor& y) {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_linear(name, x, w, &b, y, kCpuTypes));
    const bool bias = b.defined();
    if (operand_dt() == dt::bf16) {
      return run(name, [&] {
        auto& pd = cached_product<dnnl::matmul::primitive_desc>(key_of("linear_mm", {d.N, d.I, d.O, bias, gelu}), [&](dt op) {
          const auto src = plain({d.N, d.I}, tag::ab, op), wei = plain({d.I, d.O}, tag::any, op),
                     dst = plain({d.N, d.O}, tag::ab);
          return dnnl::matmul::primitive_desc(bias ? dnnl::matmul::desc(src, wei, plain({1, d.O}, tag::ab), dst)
                                                   : dnnl::matmul::desc(src, wei, dst),
                                              product_attr(gelu), eng_);
        });
        std::unordered_map<int, memory> args{
            {DNNL_ARG_SRC, to_pd(pd.src_desc(), mem(plain({d.N, d.I}, tag::ab), x))},
            {DNNL_ARG_WEIGHTS, to_pd(pd.weights_desc(), mem(plain({d.I, d.O}, tag::ba), w))},  // w [O,I] as [I,O]
            {DNNL_ARG_DST, mem(plain({d.N, d.O}, tag::ab), y)}};
        if (bias) args.emplace(DNNL_ARG_BIAS, mem(plain({1, d.O}, tag::ab), b));
        dnnl::matmul(pd).execute(strm_, args);
      });
    }
    return run(name, [&] {
      auto& pd = ip_fwd_pd(d, bias, dt::f32, gelu);
      std::unordered_map<int, memory> args{{DNNL_ARG_SRC, to_pd(pd.src_desc(), mem(plain({d.N, d.I}, tag::nc), x))},
                                           {DNNL_ARG_WEIGHTS, to_pd(pd.weights_desc(), mem(plain({d.O, d.I}, tag::oi), w))},
                                           {DNNL_ARG_DST, mem(pd.dst_desc(), y)}};
      if (bias) args.emplace(DNNL_ARG_BIAS, mem(pd.bias_desc(), b));
      dnnl::inner_product_forward(pd).execute(strm_, args);
    });
  }

  Status eltwise_forward(const char* op, dnnl::algorithm alg, const Tensor& x, Tensor& y) {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape(op, x, y, nullptr, kCpuTypes));
    return run(op, [&] {
      auto& pd = eltwise_fwd_pd(alg, x.numel());
      const memory src = mem(pd.src_desc(), x);
      (void)y.set_layout(x.layout());  // same shape as x: cannot fail
      dnnl::eltwise_forward(pd).execute(strm_, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, mem(pd.dst_desc(), y)}});
    });
  }
  Status eltwise_backward(const char* op, dnnl::algorithm alg, const Tensor& y, const Tensor& dy, Tensor& dx) {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape(op, y, dy, &dx, kCpuTypes));
    return run(op, [&] {
      auto& pd = cached<dnnl::eltwise_backward::primitive_desc>(key_of(op, {y.numel()}), [&] {
        dnnl::eltwise_backward::desc desc(alg, flat(y), flat(y), 0.f);
        return dnnl::eltwise_backward::primitive_desc(desc, eng_, eltwise_fwd_pd(alg, y.numel()));
      });
      const memory g = flat_in(dy, y.layout());
      (void)dx.set_layout(y.layout());
      dnnl::eltwise_backward(pd).execute(strm_, {{DNNL_ARG_DST, mem(flat(y), y)},
                                                 {DNNL_ARG_DIFF_DST, g},
                                                 {DNNL_ARG_DIFF_SRC, mem(flat(dx), dx)}});
    });
  }
  Status binary(const char* op, dnnl::algorithm alg, const Tensor& a, const Tensor& b, Tensor& y) {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape(op, a, b, &y, kCpuTypes));
    return run(op, [&] {
      auto& pd = cached<dnnl::binary::primitive_desc>(key_of(op, {a.numel()}), [&] {
        dnnl::binary::desc desc(alg, flat(a), flat(b), flat(y));
        return dnnl::binary::primitive_desc(desc, eng_);
      });
      const memory bm = flat_in(b, a.layout());
      (void)y.set_layout(a.layout());
      dnnl::binary(pd).execute(strm_, {{DNNL_ARG_SRC_0, mem(flat(a), a)}, {DNNL_ARG_SRC_1, bm}, {DNNL_ARG_DST, mem(flat(y), y)}});
    });
  }
  dnnl::eltwise_forward::primitive_desc& eltwise_fwd_pd(dnnl::algorithm alg, int64_t n) {
    return cached<dnnl::eltwise_forward::primitive_desc>(key_of("eltwise_fwd", {static_cast<int64_t>(alg), n}), [&] {
      dnnl::eltwise_forward::desc desc(dnnl::prop_kind::forward_training, alg,
                                       memory::desc({n}, dt::f32, tag::a), 0.f, 0.f);
      return dnnl::eltwise_forward::primitive_desc(desc, eng_);
    });
  }
  dnnl::softmax_forward::primitive_desc& softmax_fwd_pd(int64_t rows, int64_t cols) {
    return cached<dnnl::softmax_forward::primitive_desc>(key_of("softmax_fwd", {rows, cols}), [&] {
      dnnl::softmax_forward::desc desc(dnnl::prop_kind::forward_training, plain({rows, cols}, tag::nc), 1);
      return dnnl::softmax_forward::primitive_desc(desc, eng_);
    });
  }

 private:
  // Runs body on the stream and waits; a dnnl::error becomes a Status naming the op.
  Status run(const char* op, const std::function<void()>& body) {
    struct ClearScratch {
      std::vector<Tensor>& s;
      ~ClearScratch() { s.clear(); }
    } clear{scratch_};
    // Descriptors are cached by shape; shapes that vary without end (MIL bags of N tiles each)
    // would grow the cache without bound, so past kMaxCachedPrimitives it starts over.
    if (cache_.size() > kMaxCachedPrimitives) cache_.clear();
    try {
      body();
      strm_.wait();
    } catch (const dnnl::error& e) {
      if (e.status == dnnl_unimplemented)
        return slide::core::unimplemented(std::string(op) + ": oneDNN has no implementation: " + e.what());
      if (e.status == dnnl_out_of_memory) return slide::core::resource_exhausted(std::string(op) + ": oneDNN: " + e.what());
      return slide::core::internal_error(std::string(op) + ": oneDNN: " + e.what());
    } catch (const std::bad_alloc&) {
      return slide::core::resource_exhausted(std::string(op) + ": out of memory (or over the memory budget) for scratch");
    }
    return ok_status();
  }

  template <typename PD, typename Make>
  PD& cached(const std::string& key, Make make) {
    auto it = cache_.find(key);
    if (it == cache_.end()) it = cache_.emplace(key, std::any(make())).first;
    return *std::any_cast<PD>(&it->second);
  }

  // The element type of the products' operands (convolutions, inner products, matmuls): bf16
  // under MathPrecision::kBf16 on a CPU with bf16 instructions (cpu_has_bf16_instructions), else
  // f32. The operands are rounded by oneDNN's reorders into scratch (to nearest, ties to even, as
  // kernels/formulas.h round_to_bf16); the products accumulate in f32 and their outputs are f32.
  // oneDNN 2.6's fpmath_mode (product_attr) lets an implementation do this itself, but none of
  // 2.6's does: under fpmath bf16 its f32 convolutions and matmuls stay f32 (ONEDNN_VERBOSE).
  dt operand_dt() const { return bf16_operands_ ? dt::bf16 : dt::f32; }

  // A product primitive's descriptor made by make(op) with operands of type `op`, cached under key
  // and op; where oneDNN has no bf16 implementation for the shape (make throws), the f32 one
  // (which the contract allows: more accurate), cached under both.
  template <typename PD, typename Make>
  PD& cached_typed(const std::string& key, dt op, Make make) {
    if (op == dt::f32) return cached<PD>(key, [&] { return make(dt::f32); });
    return cached<PD>(key + ",bf16", [&]() -> PD {
      try {
        return make(dt::bf16);
      } catch (const dnnl::error&) {  // no bf16 implementation for this shape: f32
      }
      return cached_typed<PD>(key, dt::f32, make);
    });
  }
  // The same at this backend's operand type (operand_dt).
  template <typename PD, typename Make>
  PD& cached_product(const std::string& key, Make make) {
    return cached_typed<PD>(key, operand_dt(), make);
  }

  memory::desc plain(const Shape& s, tag t, dt type = dt::f32) const { return memory::desc(dims_of(s), type, t); }
  memory::desc flat(const Tensor& t) const { return memory::desc({t.numel()}, dt::f32, tag::a); }
  memory::desc chan_md(int64_t c) const { return memory::desc({c}, dt::f32, tag::a); }
  // The descriptor of an f32 tensor of shape s in layout l (plain: row-major over its rank).
  memory::desc md_in(const Shape& s, Layout l) const {
    if (l == Layout::kNChw8c) return plain(s, tag::nChw8c);
    if (l == Layout::kNChw16c) return plain(s, tag::nChw16c);
    if (l == Layout::kNhwc) return plain(s, tag::nhwc);  // (cuda produces it; never reaches cpu)
    static const tag row_major[] = {tag::undef, tag::a, tag::ab, tag::abc, tag::abcd, tag::abcde};
    return plain(s, s.size() < 6 ? row_major[s.size()] : tag::undef);
  }
  memory::desc md_of(const Tensor& t) const { return md_in(t.shape(), t.layout()); }
  // A oneDNN view of a tensor's storage (no copy).
  memory mem(const memory::desc& md, const Tensor& t) const { return memory(md, eng_, t.raw()); }
  // t's elements in layout l, seen flat (for element-wise ops): t itself, or a reordered copy.
  memory flat_in(const Tensor& t, Layout l) {
    if (t.layout() == l) return mem(flat(t), t);
    const memory m = to_pd(md_in(t.shape(), l), mem(md_of(t), t));
    return memory(flat(t), eng_, m.get_data_handle());
  }

  // Right padding that makes oneDNN's output extent equal to PyTorch's floor-mode one.
  static memory::dims pad_r(const detail::ConvDims& d, Conv2dParams p) {
    return {(d.P - 1) * p.stride + d.R - d.H - p.pad, (d.Q - 1) * p.stride + d.S - d.W - p.pad};
  }
  static memory::dims pool_pad_r(const detail::PoolDims& d, Pool2dParams p) {
    return {(d.P - 1) * p.stride + p.kernel - d.H - p.pad, (d.Q - 1) * p.stride + p.kernel - d.W - p.pad};
  }
  static std::string conv_key(const char* op, const detail::ConvDims& d, Conv2dParams p, bool bias) {
    return key_of(op, {d.N, d.C, d.H, d.W, d.K, d.R, d.S, p.stride, p.pad, bias});
  }
  static std::string pool_key(const char* op, const detail::PoolDims& d, Pool2dParams p) {
    return key_of(op, {d.N, d.C, d.H, d.W, p.kernel, p.stride, p.pad});
  }

  struct ConvMds {
    memory::desc src, wei, bias, dst;
  };
  // A convolution's descriptors with oneDNN's free choice of layouts (tag::any): its blocked
  // layouts (nChw8c/nChw16c, OIhw8i8o, ...), whose direct jit kernels beat im2col + gemm on nchw.
  // The element types: src_t for x (or dx), wei_t for w (or dw), dst_t for y (or dy): f32, or bf16
  // for a product's operands (operand_dt).
  // `pin_blocked` (the inference convolutions): when both channel counts are multiples of the CPU's
  // vector width, src and dst are asked for that blocked layout (nChw16c on AVX-512, nChw8c on
  // AVX2), the one the activations around them are in. Left free, oneDNN 2.6's brgemm convolutions
  // choose nhwc for forward_inference on AVX-512 CPUs, which a tensor cannot carry, and each
  // convolution of slide-embed's graph was then bracketed by two reorders (40% of a ResNet-50
  // layer3 batch on an AVX-512 host; bench/embed_bench.sh). Training's convolutions stay free:
  // pinning one side only (8 channels in, 16 out) sent oneDNN to its reference kernel.
  ConvMds conv_mds(const detail::ConvDims& d, bool bias, dt src_t, dt wei_t, dt dst_t, bool pin_blocked = false) const {
    const int64_t block = avx512() ? 16 : 8;
    const bool pin = pin_blocked && d.C % block == 0 && d.K % block == 0;
    const tag image = pin ? (block == 16 ? tag::nChw16c : tag::nChw8c) : tag::any;
    return {plain({d.N, d.C, d.H, d.W}, image, src_t), plain({d.K, d.C, d.R, d.S}, tag::any, wei_t),
            bias ? plain({d.K}, tag::x) : memory::desc(), plain({d.N, d.K, d.P, d.Q}, image, dst_t)};
  }

  // Scratch for a reordered copy, from the (caching, budgeted) allocator; lives until run() ends.
  memory scratch(const memory::desc& md) {
    auto t = Tensor::empty({static_cast<int64_t>(md.get_size())}, DType::kU8, alloc_, "reorder scratch");  // get_size(): bytes
    if (!t.ok()) throw std::bad_alloc();
    scratch_.push_back(*t);
    return memory(md, eng_, t->raw());
  }
  // `have` in the layout a primitive wants: itself, or a reordered copy.
  memory to_pd(const memory::desc& want, memory have) {
    if (want == have.get_desc()) return have;
    memory m = scratch(want);
    dnnl::reorder(have, m).execute(strm_, have, m);
    return m;
  }
  // Where a primitive writes output t, `want` being the layout it writes: t's own storage when t
  // can carry that layout (plain, or an image layout of tensor.h's Layout when `relabel`; t's
  // layout is set to it), else scratch, which from_pd then reorders into t (plain). Parameter
  // gradients pass relabel = false: they stay plain.
  memory out_mem(const memory::desc& want, Tensor& t, bool relabel = true) {
    const bool image = relabel && t.rank() == 4;  // only [N,C,H,W] may take a blocked layout
    for (Layout l : {Layout::kPlain, Layout::kNChw8c, Layout::kNChw16c}) {
      if (l != Layout::kPlain && !image) break;
      if (want == md_in(t.shape(), l) && t.set_layout(l).ok()) return mem(want, t);
    }
    (void)t.set_layout(Layout::kPlain);
    return scratch(want);
  }
  void from_pd(memory got, Tensor& t) {
    if (got.get_data_handle() == t.raw()) return;
    memory dst = mem(md_of(t), t);
    dnnl::reorder(got, dst).execute(strm_, got, dst);
  }

  // A prepared convolution's weights in layout `want`: the plain ones, or a reorder made once and
  // kept in `w` (from the allocator; bad_alloc when it refuses, which run() reports).
  memory fused_weights(const CpuFusedConvWeights& w, const memory::desc& want) {
    memory plain_w = mem(md_of(w.weight()), w.weight());
    if (want == plain_w.get_desc()) return plain_w;
    for (const auto& [md, t] : w.reordered)
      if (md == want) return mem(want, t);
    auto t = Tensor::empty({static_cast<int64_t>(want.get_size())}, DType::kU8, alloc_,
                           "fused convolution weights (reordered)");
    if (!t.ok()) throw std::bad_alloc();
    memory m = mem(want, *t);
    dnnl::reorder(plain_w, m).execute(strm_, plain_w, m);
    w.reordered.emplace_back(want, *t);
    return m;
  }

  // The attribute of every primitive with products (convolutions, inner products, matmuls): the
  // fpmath mode of the math precision (backend.h). oneDNN 2.6 has bf16 and f16 modes, no tf32:
  // kTf32 stays strict f32, which the contract allows (more accurate). Under bf16 (f16), oneDNN
  // uses bf16 (f16) instructions where the CPU has them (AVX512_BF16 or AMX; AVX512_FP16) and f32
  // where it has not.
  // With `gelu`, an eltwise_gelu_erf post-op: the exact GELU on the product's f32 outputs
  // (linear_gelu_forward).
  dnnl::primitive_attr product_attr(bool gelu = false) const {
    dnnl::primitive_attr attr;
    if (gelu) {
      dnnl::post_ops po;
      po.append_eltwise(1.f, dnnl::algorithm::eltwise_gelu_erf, 0.f, 0.f);
      attr.set_post_ops(po);
    }
    attr.set_fpmath_mode(math_precision_ == MathPrecision::kBf16   ? dnnl::fpmath_mode::bf16
                         : math_precision_ == MathPrecision::kFp16 ? dnnl::fpmath_mode::f16
                                                                   : dnnl::fpmath_mode::strict);
    return attr;
  }

  // The training convolution's forward descriptor with operands of type `op` (x and w; y f32; the
  // f32 one where oneDNN has no bf16 implementation: cached_typed), also the hint of its backward
  // descriptors.
  dnnl::convolution_forward::primitive_desc& conv_fwd_pd(const detail::ConvDims& d, Conv2dParams p, bool bias, dt op) {
    return cached_typed<dnnl::convolution_forward::primitive_desc>(conv_key("conv_fwd", d, p, bias), op, [&](dt t) {
      auto [src, wei, bmd, dst] = conv_mds(d, bias, t, t, dt::f32);
      auto desc = bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training,
                                                         dnnl::algorithm::convolution_direct, src, wei, bmd, dst,
                                                         {p.stride, p.stride}, {p.pad, p.pad}, pad_r(d, p))
                       : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training,
                                                         dnnl::algorithm::convolution_direct, src, wei, dst,
                                                         {p.stride, p.stride}, {p.pad, p.pad}, pad_r(d, p));
      return dnnl::convolution_forward::primitive_desc(desc, product_attr(), eng_);
    });
  }

  dnnl::batch_normalization_forward::primitive_desc& bn_fwd_pd(const Tensor& x, double eps, bool training) {
    const Shape& s = x.shape();
    return cached<dnnl::batch_normalization_forward::primitive_desc>(
        key_of(training ? "bn_fwd_train" : "bn_fwd_inf",
               {s[0], s[1], s[2], s[3], static_cast<int64_t>(eps * 1e12), static_cast<int64_t>(x.layout())}),
        [&] {
          auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
          if (!training) flags = flags | dnnl::normalization_flags::use_global_stats;
          dnnl::batch_normalization_forward::desc desc(
              training ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference, md_of(x),
              static_cast<float>(eps), flags);
          return dnnl::batch_normalization_forward::primitive_desc(desc, eng_);
        });
  }

  dnnl::pooling_forward::primitive_desc& pool_fwd_pd(const detail::PoolDims& d, Pool2dParams p, dnnl::prop_kind kind) {
    const bool training = kind == dnnl::prop_kind::forward_training;
    return cached<dnnl::pooling_forward::primitive_desc>(pool_key(training ? "pool_fwd_train" : "pool_fwd_inf", d, p), [&] {
      const Layout l = blocked_layout(d.C);
      dnnl::pooling_forward::desc desc(kind, dnnl::algorithm::pooling_max, md_in({d.N, d.C, d.H, d.W}, l),
                                       md_in({d.N, d.C, d.P, d.Q}, l), {p.stride, p.stride}, {p.kernel, p.kernel},
                                       {p.pad, p.pad}, pool_pad_r(d, p));
      return dnnl::pooling_forward::primitive_desc(desc, eng_);
    });
  }

  // The channel-blocked layout of oneDNN's jit kernels for `channels`: nChw16c on AVX-512 CPUs,
  // nChw8c on AVX2 ones, plain when channels is not a multiple of the block.
  static bool avx512() {
    static const bool has = effective_isa_includes(dnnl_cpu_isa_avx512_core);
    return has;
  }
  static Layout blocked_layout(int64_t channels) {
    if (avx512() && channels % 16 == 0) return Layout::kNChw16c;
    if (channels % 8 == 0) return Layout::kNChw8c;
    return Layout::kPlain;
  }

  dnnl::pooling_forward::primitive_desc& gap_fwd_pd(const Shape& s) {
    return cached<dnnl::pooling_forward::primitive_desc>(key_of("gap_fwd", {s[0], s[1], s[2], s[3]}), [&] {
      dnnl::pooling_forward::desc desc(dnnl::prop_kind::forward_training, dnnl::algorithm::pooling_avg_exclude_padding,
                                       plain(s, tag::nchw), plain({s[0], s[1], 1, 1}, tag::nchw), {1, 1}, {s[2], s[3]},
                                       {0, 0}, {0, 0});
      return dnnl::pooling_forward::primitive_desc(desc, eng_);
    });
  }

  // The inner product's forward descriptor with operands of type `op` (x and w; y f32; the
  // weights' layout oneDNN's choice under bf16; the f32 one where oneDNN has no bf16
  // implementation: cached_typed), with GELU on its outputs when `gelu` (product_attr). Without
  // GELU also the hint of its backward descriptors.
  dnnl::inner_product_forward::primitive_desc& ip_fwd_pd(const detail::LinearDims& d, bool bias, dt op,
                                                         bool gelu = false) {
    const std::string key = key_of(gelu ? "ip_fwd_gelu" : "ip_fwd", {d.N, d.I, d.O, bias});
    return cached_typed<dnnl::inner_product_forward::primitive_desc>(key, op, [&](dt t) {
      const auto src = plain({d.N, d.I}, tag::nc, t), wei = plain({d.O, d.I}, t == dt::f32 ? tag::oi : tag::any, t),
                 dst = plain({d.N, d.O}, tag::nc);
      auto desc = bias ? dnnl::inner_product_forward::desc(dnnl::prop_kind::forward_training, src, wei,
                                                           plain({d.O}, tag::x), dst)
                       : dnnl::inner_product_forward::desc(dnnl::prop_kind::forward_training, src, wei, dst);
      return dnnl::inner_product_forward::primitive_desc(desc, product_attr(gelu), eng_);
    });
  }

  // dst += src, element-wise (the op list's accumulate-into-parameter-gradient rule).
  static void accumulate(Tensor& dst, const Tensor& src) {
    float* d = dst.data<float>();
    const float* s = src.data<float>();
    for (int64_t i = 0; i < dst.numel(); ++i) d[i] += s[i];
  }

  Allocator& alloc_;
  dnnl::engine eng_;
  dnnl::stream strm_;
  std::unordered_map<std::string, std::any> cache_;
  static constexpr size_t kMaxCachedPrimitives = 512;
  std::unique_ptr<Backend> loops_;  // the reference backend, for ops oneDNN does not have
  bool bf16_operands_ = false;      // operand_dt() is bf16

  // The cpu backend is f32 and the reference loops read plain tensors only: say so in the op's
  // name rather than the reference's.
  static Status plain_f32(const char* op, std::initializer_list<const Tensor*> ts) {
    for (const Tensor* t : ts) {
      if (t->defined() && t->dtype() != DType::kF32)
        return slide::core::unimplemented(std::string(op) + ": cpu has f32 only");
      if (t->defined() && t->layout() != Layout::kPlain)
        return slide::core::invalid_argument(std::string(op) + ": a tensor in the " + layout_name(t->layout()) +
                                             " layout (Backend::to_plain first)");
    }
    return ok_status();
  }
  std::vector<Tensor> scratch_;     // reorder scratch of the op in flight
};

}  // namespace

std::unique_ptr<Backend> make_onednn_backend(Allocator& alloc) { return std::make_unique<OneDnnBackend>(alloc); }

bool cpu_has_bf16_instructions() {
  // avx512_core_bf16 is AVX512_BF16; the AMX ISAs above it include it. ONEDNN_MAX_CPU_ISA caps the
  // effective ISA (a test turns the bf16 instructions off with it).
  static const bool has = effective_isa_includes(dnnl_cpu_isa_avx512_core_bf16);
  return has;
}

}  // namespace slide::train
