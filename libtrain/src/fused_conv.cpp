// Backend::prepare_fused_conv2d and Backend::fused_conv2d_inference's defaults: the fused inference
// convolution composed from the op list (conv2d_forward, add, relu_forward). The reference backend
// runs these (they are the oracle of the fused versions); cpu (oneDNN post-ops) and cuda
// (cudnnConvolutionBiasActivationForward) override both. Also the defaults of the training pair
// batch norm + ReLU (Backend::batch_norm_relu_forward_training / _backward), composed from
// batch_norm_forward_training, relu_forward, relu_backward and batch_norm_backward: what the
// reference and cpu run; cuda overrides both.
#include <memory>

#include "op_checks.h"
#include "slide/train/backend.h"

namespace slide::train {

Result<std::shared_ptr<const FusedConvWeights>> Backend::prepare_fused_conv2d(const Tensor& w, const Tensor& b) {
  if (!w.defined() || w.rank() != 4)
    return slide::core::invalid_argument("prepare_fused_conv2d: w must be [K,C,R,S], is " +
                                         (w.defined() ? shape_string(w.shape()) : std::string("undefined")));
  SLIDE_ASSIGN_OR_RETURN(Tensor wd, to_device(*this, w, "fused convolution weights"));
  Tensor bd;
  if (b.defined()) {
    if (b.shape() != Shape{w.dim(0)})
      return slide::core::invalid_argument("prepare_fused_conv2d: b is " + shape_string(b.shape()) + ", expected [" +
                                           std::to_string(w.dim(0)) + "]");
    SLIDE_ASSIGN_OR_RETURN(bd, to_device(*this, b, "fused convolution bias"));
  } else {
    SLIDE_ASSIGN_OR_RETURN(Tensor zeros, Tensor::zeros({w.dim(0)}, w.dtype(), cpu_allocator(), "zero bias"));
    SLIDE_ASSIGN_OR_RETURN(bd, to_device(*this, zeros, "fused convolution bias"));
  }
  return std::shared_ptr<const FusedConvWeights>(std::make_shared<FusedConvWeights>(this, std::move(wd), std::move(bd)));
}

Status Backend::fused_conv2d_inference(const Tensor& x, const FusedConvWeights& w, Conv2dParams p, bool relu,
                                       const Tensor* residual, Tensor& y) {
  // The shapes and the aliasing; the composed ops check dtypes, layouts and devices themselves.
  SLIDE_RETURN_IF_ERROR(detail::validate_fused_conv2d_inference(this, x, w, p, residual, y,
                                                                detail::DTypes{true, true, true, device()})
                            .status());
  if (residual == nullptr) {
    SLIDE_RETURN_IF_ERROR(conv2d_forward(x, w.weight(), w.bias(), p, y));
  } else {
    // y may be *residual: the convolution goes to scratch, then y = conv + z (add allows y == b).
    SLIDE_ASSIGN_OR_RETURN(Tensor c, Tensor::empty(y.shape(), y.dtype(), allocator(), "fused convolution scratch"));
    SLIDE_RETURN_IF_ERROR(conv2d_forward(x, w.weight(), w.bias(), p, c));
    SLIDE_RETURN_IF_ERROR(add(c, *residual, y));
  }
  if (relu) SLIDE_RETURN_IF_ERROR(relu_forward(y, y));
  return slide::core::ok_status();
}

Status Backend::batch_norm_relu_forward_training(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                                                 double momentum, Tensor& running_mean, Tensor& running_var, Tensor& y,
                                                 Tensor& save_mean, Tensor& save_invstd) {
  SLIDE_RETURN_IF_ERROR(batch_norm_forward_training(x, gamma, beta, eps, momentum, running_mean, running_var, y,
                                                    save_mean, save_invstd));
  return relu_forward(y, y);
}

Status Backend::batch_norm_relu_backward(const Tensor& x, const Tensor& y, const Tensor& dy, const Tensor& gamma,
                                         const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx,
                                         Tensor& dgamma, Tensor& dbeta) {
  // The masked gradient in dx, then batch norm's backward in place on it (backend.h allows dx == dy):
  // no tensor beyond the two layers' (a scratch of dy's size here raised the peak of a small CNN's
  // step by one activation, dy being still held by the caller).
  SLIDE_RETURN_IF_ERROR(relu_backward(y, dy, dx));
  return batch_norm_backward(x, dx, gamma, save_mean, save_invstd, dx, dgamma, dbeta);
}

}  // namespace slide::train
