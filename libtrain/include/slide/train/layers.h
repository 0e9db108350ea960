// Layers, written once against Backend& (DESIGN.md, "The engine"): each forward saves what its
// backward needs (documented per layer), each backward returns the input gradient and
// accumulates (+=) into its parameters' gradients, as the op list does. Parameter names follow
// torchvision ("conv1.weight", "bn1.running_mean") so checkpoints map one to one.
//
// Tensors come from the backend's allocator: an exceeded memory budget surfaces as
// kResourceExhausted from forward or backward, never as a crash. Not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "slide/train/backend.h"

namespace slide::train {

class Communicator;

// A trainable tensor and its gradient (same shape and dtype).
struct Parameter {
  std::string name;
  Tensor value;
  Tensor grad;
};

// A non-trainable state tensor saved in checkpoints (batch norm's running statistics).
struct Buffer {
  std::string name;
  Tensor value;
};

class Layer;

// Called by a container after one of its children's backward, with that child: the child's
// parameter gradients of this micro-batch are then complete. Data-parallel training starts a
// gradient bucket's all-reduce as soon as every gradient in it is (GradientBuckets::
// gradients_ready), overlapping communication with the rest of backward (PyTorch DDP's hooks).
// An error stops backward and is returned by it.
using BackwardHook = std::function<Status(Layer&)>;

class Layer {
 public:
  virtual ~Layer() = default;
  // y = f(x). `training` selects batch statistics (batch norm). Saves what backward needs.
  [[nodiscard]] virtual Result<Tensor> forward(Backend& be, const Tensor& x, bool training) = 0;
  // dx from dy (the gradient of the last forward's output); parameter gradients +=.
  // Errors: kFailedPrecondition when no training forward preceded it, and the backend's.
  [[nodiscard]] virtual Result<Tensor> backward(Backend& be, const Tensor& dy) = 0;
  // Appends this layer's parameters / buffers with `prefix` + their torchvision names.
  virtual void collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) {
    (void)prefix, (void)params, (void)buffers;
  }
  // Drops what forward saved (activations), so their memory returns to the allocator.
  virtual void release() {}
  // Seeds the random layers (Dropout) for the next training forward. The trainer calls it once
  // per micro-batch with a seed derived from (epoch seed, micro-batch position), so the masks
  // depend only on the data order and a resumed run draws the same masks as an uninterrupted one.
  virtual void set_rng_seed(uint64_t seed) { (void)seed; }
  // Batch norm layers take their training statistics over the samples of every rank of `comm`
  // (--sync-bn; dist/sync_batch_norm.h), or over this rank's batch (nullptr, the default).
  // Containers pass it to their layers.
  virtual void set_batch_norm_sync(Communicator* comm) { (void)comm; }
  // Containers call `hook` (null: none) after each child's backward, and pass it to their
  // containers. The hook must outlive the backward passes it is set for.
  virtual void set_backward_hook(const BackwardHook* hook) { (void)hook; }
  // Whether backward must return dx (default: yes). The trainer clears it on the model, whose
  // input is data, as autograd does for a tensor without requires_grad: the first convolution
  // then skips its backward-data pass (ResNet-18, batch 32, 224 px: 85 ms of a 3.5 s step).
  // A layer told so may return an undefined Tensor from backward. Containers pass it to their
  // first layer only.
  virtual void set_input_gradient(bool needed) { (void)needed; }
};

// A parameter's dotted name under `prefix` (torchvision's state_dict names: "layer1.0" + "conv1"
// -> "layer1.0.conv1"); an empty prefix or name is transparent.
std::string join_name(const std::string& prefix, const std::string& name);

// Deterministic initialisation (torchvision's): a seeded generator per model, drawn through
// slide/train/random.h. Or none (InitRng::none(), a model built without a seed): the layers'
// parameters then stay zero, for a model whose every parameter a weight file is about to
// overwrite (evaluate, predict, slide-embed), where a ResNet-50's 25 M normal draws would be
// wasted work.
class InitRng : public std::mt19937_64 {
 public:
  explicit InitRng(uint64_t seed) : std::mt19937_64(seed) {}
  // A model's: seeded, or none without a seed.
  static InitRng from(std::optional<uint64_t> seed) {
    InitRng rng(seed.value_or(0));
    rng.draws_ = seed.has_value();
    return rng;
  }
  static InitRng none() { return from(std::nullopt); }
  // Whether the layers draw their initial parameters (else they leave them zero).
  bool draws() const { return draws_; }

 private:
  bool draws_ = true;
};

// Conv2d(in, out, kernel, stride, pad, bias) with PyTorch's weight layout [out, in, k, k].
// Init: Kaiming normal, fan_out, gain sqrt(2) (torchvision ResNet); bias zero.
// Saves: x. With f16 / bf16 x and f32 weights (half-precision activations: Cast below), the
// convolution runs on a copy of the weights in x's type, made each forward (torch.autocast's cast
// of the weight) and saved for backward; the weight gradient is added to the f32 gradient.
class Conv2d final : public Layer {
 public:
  // Errors: those of Tensor::zeros (the budget), kInvalidArgument for a non-positive size.
  [[nodiscard]] static Result<std::unique_ptr<Conv2d>> make(Allocator& alloc, DType dtype, int64_t in, int64_t out,
                                                            int kernel, Conv2dParams p, bool bias, InitRng& rng);
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) override;
  void release() override { x_ = w_half_ = Tensor(); }
  Conv2dParams params() const { return p_; }  // stride and padding (read by the inference path)
  void set_input_gradient(bool needed) override { input_gradient_ = needed; }
  Parameter weight, bias;  // bias.value undefined when built without bias

 private:
  Conv2dParams p_;
  Tensor x_, w_half_;  // w_half_: the weights' half copy of a half-precision forward
  bool input_gradient_ = true;
};

class ReLU;

// BatchNorm2d(C, eps = 1e-5, momentum = 0.1): gamma 1, beta 0, running mean 0, var 1.
// Saves: x, the batch mean and 1/std (training); fused with the ReLU after it (fuse_relu), also
// its output y (the ReLU's mask). f16 / bf16 x keeps gamma, beta and the statistics in f32
// (PyTorch's cuDNN batch norm on half inputs).
class BatchNorm2d final : public Layer {
 public:
  [[nodiscard]] static Result<std::unique_ptr<BatchNorm2d>> make(Allocator& alloc, DType dtype, int64_t channels,
                                                                 double eps = 1e-5, double momentum = 0.1);
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) override;
  void release() override { x_ = y_ = mean_ = invstd_ = sync_stats_ = Tensor(); }
  void set_batch_norm_sync(Communicator* comm) override { sync_ = comm; }
  double eps() const { return eps_; }
  // Takes over `next`, the ReLU applied to this layer's output: this layer then computes
  // max(batch_norm(x), 0) and its backward (Backend::batch_norm_relu_forward_training / _backward:
  // one op where the backend fuses them, cuda; the two ops in turn elsewhere), and `next` passes
  // its input and gradient through unchanged. Values and gradients are the unfused pair's bit for
  // bit. Sequential::add fuses a ReLU added right after a BatchNorm2d.
  void fuse_relu(ReLU& next);
  bool relu_fused() const { return relu_; }
  Parameter weight, bias;        // gamma, beta
  Buffer running_mean, running_var;

 private:
  double eps_, momentum_;
  bool relu_ = false;
  Communicator* sync_ = nullptr;  // --sync-bn: statistics over every rank
  // --sync-bn: the last forward's all-reduced sums (f64 [C+1], the global count at C).
  Tensor x_, y_, mean_, invstd_, sync_stats_;
};

// ReLU. Saves: y (backward needs only the output). Once the BatchNorm2d before it has taken it
// over (BatchNorm2d::fuse_relu), forward returns x and backward dy, unchanged: the batch norm
// applies it.
class ReLU final : public Layer {
 public:
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void release() override { y_ = Tensor(); }
  bool fused() const { return fused_; }

 private:
  friend class BatchNorm2d;
  bool fused_ = false;
  Tensor y_;
};

// MaxPool2d(kernel, stride, pad). Saves: x.
class MaxPool2d final : public Layer {
 public:
  explicit MaxPool2d(Pool2dParams p) : p_(p) {}
  Pool2dParams params() const { return p_; }
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void release() override { x_ = Tensor(); }

 private:
  Pool2dParams p_;
  Tensor x_;
};

// Dropout(p) (Srivastava et al., 2014; PyTorch's nn.Dropout): in training each element is kept
// with probability 1 - p and scaled by 1 / (1 - p), else zeroed; in inference y = x. Row r of the
// mask (sample r of dim 0) is drawn from a generator seeded by set_rng_seed()'s seed + r and
// `salt` (one per Dropout in a model): with the trainer's seed (the micro-batch's first position
// in the epoch's order) a sample's mask does not depend on the micro-batch or rank split.
// Saves: the mask (training). Errors: the allocator's; kInvalidArgument for p outside [0, 1).
class Dropout final : public Layer {
 public:
  explicit Dropout(double p, uint64_t salt = 0) : p_(p), salt_(salt) {}
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void release() override { mask_ = Tensor(); }
  void set_rng_seed(uint64_t seed) override { seed_ = seed; }
  double p() const { return p_; }

 private:
  double p_;
  uint64_t salt_, seed_ = 0;
  Tensor mask_;
  bool identity_ = true;  // the last forward passed x through (inference, or p == 0)
};

// AdaptiveAvgPool2d(1) + flatten: [N,C,H,W] -> [N,C]. Saves: the input shape.
class GlobalAvgPool final : public Layer {
 public:
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;

 private:
  Shape in_shape_;
  Layout in_layout_ = Layout::kPlain;  // the input gradient is written in the input's layout
};

// Linear(in, out): weight [out, in], bias [out]; PyTorch's default init, U(-1/sqrt(in), 1/sqrt(in)).
// Saves: x. Half-precision x as Conv2d: half copies of the weights, gradients added in f32.
class Linear final : public Layer {
 public:
  [[nodiscard]] static Result<std::unique_ptr<Linear>> make(Allocator& alloc, DType dtype, int64_t in, int64_t out,
                                                            InitRng& rng);
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) override;
  void release() override { x_ = w_half_ = Tensor(); }
  Parameter weight, bias;

 private:
  Tensor x_, w_half_;  // w_half_: as Conv2d's
};

// Converts its input to `dtype` (Backend::cast), and its gradient back to the input's dtype: the
// boundaries of a region of half-precision activations (torch.autocast's casts at a model's input
// and output). A tensor already of `dtype` passes as it is. With `layout` kNhwc, a 4-D output is
// then made channels last (Backend::to_channels_last; PyTorch's channels_last memory format), and
// the gradient comes back plain. Saves: the input's dtype.
class Cast final : public Layer {
 public:
  explicit Cast(DType dtype, Layout layout = Layout::kPlain) : dtype_(dtype), layout_(layout) {}
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  // Told that no input gradient is needed (set_input_gradient_of passes it on to the layer after
  // it as well), backward returns an undefined tensor.
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void set_input_gradient(bool needed) override { input_gradient_ = needed; }
  DType dtype() const { return dtype_; }
  Layout layout() const { return layout_; }

 private:
  DType dtype_;
  Layout layout_;
  DType from_ = DType::kF32;
  bool input_gradient_ = true;
};

// Layer::set_input_gradient for a container's layers in order: the first layer, and past each
// Cast (whose input gradient is only its output's, cast) the one after it too, so that a model
// with casts at its ends still skips its first convolution's backward-data pass.
void set_input_gradient_of(const std::vector<std::unique_ptr<Layer>>& layers, bool needed);

// Layers applied in order; names are "<index>." unless given (torchvision's Sequential naming).
class Sequential final : public Layer {
 public:
  // Appends `layer`. A ReLU added right after a BatchNorm2d is fused into it
  // (BatchNorm2d::fuse_relu): the pair runs as one op where the backend fuses it.
  void add(std::unique_ptr<Layer> layer, std::string name = "");
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) override;
  void release() override;
  void set_rng_seed(uint64_t seed) override;
  void set_batch_norm_sync(Communicator* comm) override;
  void set_backward_hook(const BackwardHook* hook) override;
  void set_input_gradient(bool needed) override { set_input_gradient_of(layers_, needed); }
  size_t size() const { return layers_.size(); }
  // The i-th layer (i < size()) and its name, for the memory planner and activation checkpointing.
  Layer& at(size_t i) { return *layers_.at(i); }
  const std::string& name_at(size_t i) const { return names_.at(i); }
  // Puts `layer` in place of the i-th (same name) and returns the old one. An empty name is
  // transparent in parameter names (a wrapper's children keep theirs).
  std::unique_ptr<Layer> replace(size_t i, std::unique_ptr<Layer> layer);
  // Puts `layer` before the i-th (i <= size()), named `name` (which must be given and new). The
  // i-th must not be a ReLU fused into the batch norm before it (BatchNorm2d::fuse_relu): the
  // new layer would see the ReLU's output.
  void insert(size_t i, std::unique_ptr<Layer> layer, std::string name);

 private:
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<std::string> names_;
  const BackwardHook* backward_hook_ = nullptr;
};

// relu(main(x) + shortcut(x)), shortcut = downsample (1x1 conv with the block's stride + bn) when
// the shape changes, else identity: what ResNet's blocks share. Saves: what its layers save.
class ResidualBlock : public Layer {
 public:
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) override;
  void release() override;
  void set_rng_seed(uint64_t seed) override;
  void set_batch_norm_sync(Communicator* comm) override;
  // The main path and the downsample shortcut (null: identity), for the inference path (embed.h),
  // which folds and fuses them.
  Sequential& main_path() { return main_; }
  Sequential* downsample() { return down_.get(); }

 protected:
  Sequential main_;
  std::unique_ptr<Sequential> down_;  // null: identity shortcut
  ReLU out_relu_;
};

// ResNet's BasicBlock (He et al., 2016): main = conv1 3x3/stride, bn1, relu, conv2 3x3, bn2.
// Names as torchvision: conv1, bn1, conv2, bn2, downsample.0, downsample.1.
class BasicBlock final : public ResidualBlock {
 public:
  [[nodiscard]] static Result<std::unique_ptr<BasicBlock>> make(Allocator& alloc, DType dtype, int64_t in,
                                                                int64_t out, int stride, InitRng& rng);
};

// ResNet's Bottleneck, torchvision's v1.5 (stride on the 3x3): main = conv1 1x1, bn1, relu,
// conv2 3x3/stride, bn2, relu, conv3 1x1 (4 x width channels), bn3.
class Bottleneck final : public ResidualBlock {
 public:
  [[nodiscard]] static Result<std::unique_ptr<Bottleneck>> make(Allocator& alloc, DType dtype, int64_t in,
                                                                int64_t width, int stride, InitRng& rng);
};

// torchvision's resnet18 / resnet34 / resnet50 (He et al., 2016), same architecture and parameter
// names ("conv1.weight", "layer1.0.bn1.running_mean", "fc.bias"), `classes` outputs, initialised
// as torchvision does from `seed` (without one, the convolutions' and fc's parameters stay zero:
// InitRng::none). Any input size of at least 32 px. With `dropout` > 0, a Dropout named "dropout"
// (no parameters, so the names are unchanged) comes before fc. Errors: kInvalidArgument for
// another depth or a dropout outside [0, 1), the allocator's.
[[nodiscard]] Result<std::unique_ptr<Sequential>> make_resnet(Allocator& alloc, DType dtype, int depth,
                                                              int64_t classes, std::optional<uint64_t> seed,
                                                              double dropout = 0);

// Half-precision activations for training and inference (issue 11's mixed precision, as
// torch.autocast with GradScaler runs a CNN): puts Cast(dtype) first in `model` (named "cast_in")
// and Cast(f32) last ("cast_out"), so that the activations and their gradients between them are
// f16 / bf16 while the parameters, their gradients, the optimizer state and batch norm's
// statistics stay f32 (the master weights), and the logits reach the loss in f32. The backend must
// have the half-precision training ops (backend.h, "Half-precision storage": cuda, and the
// reference as the oracle); fp16 training needs dynamic loss scaling (loss_scaler.h). Parameter
// names are unchanged (the casts have none), so checkpoints move between f32 and half runs.
// With `layout` Layout::kNhwc the activations are also channels last between the casts (cast_in
// relays the images out; PyTorch's channels_last, the layout of cuDNN's tensor-core kernels, so
// that no convolution transposes its operands): the backend must have it (backend.h, "Channels
// last in training": cuda, and the reference emulating it).
// Errors: kInvalidArgument for a dtype other than f16 / bf16, a layout other than plain or kNhwc,
// or a model that has them already.
[[nodiscard]] Status enable_half_activations(Sequential& model, DType dtype, Layout layout = Layout::kPlain);
// Channels-last f32 activations (tf32 / fp32 training on cuda, where cuDNN's TF32 tensor-core
// convolutions are NHWC too): Cast(f32, kNhwc) first ("cast_in": the images relaid out, as
// enable_half_activations with kNhwc but without the cast) and Cast(f32) last ("cast_out"). Same
// backends, names and refusals as enable_half_activations' channels last. Errors:
// kInvalidArgument for a model that has casts at its ends already.
[[nodiscard]] Status enable_channels_last(Sequential& model);
// The layout of `model`'s activations: kNhwc after enable_half_activations(..., kNhwc) or
// enable_channels_last, else plain.
Layout activation_layout(Sequential& model);
// Whether `model` runs half-precision activations (its first layer is a Cast to f16 / bf16), and
// in which dtype; f32 when not.
DType half_activation_dtype(Sequential& model);

// Moves every parameter (value and gradient) and buffer of `model` to be's device: models are
// built and initialised on the host (make_resnet, make_small_cnn with cpu_allocator()), then
// moved once; the host copies are freed when nothing else holds them. Parameter and buffer
// pointers collected before stay valid (the tensors are replaced in place). Nothing to do on a
// host backend. Errors: those of to_device (kResourceExhausted past the device budget), naming
// the tensor; the model is then partly moved and should be discarded.
[[nodiscard]] Status move_to_device(Backend& be, Layer& model);

// A small CNN for tests and small patches: 3 x [conv3x3 -> bn -> relu -> maxpool 2], then global
// average pool and a linear classifier. Widths w, 2w, 4w. `seed` and `dropout` as in make_resnet.
[[nodiscard]] Result<std::unique_ptr<Sequential>> make_small_cnn(Allocator& alloc, DType dtype, int64_t in_channels,
                                                                 int64_t classes, int64_t width,
                                                                 std::optional<uint64_t> seed, double dropout = 0);

}  // namespace slide::train
