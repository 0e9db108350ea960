// The inference graph of a CNN cut at a layer: what `slide-train evaluate`'s fused path and
// slide-embed's CNN encoders run, on any backend, through the op list (backend.h).
//
// Built once from a model (children 0..cut of a Sequential): each convolution takes the batch
// norm after it, folded into its weights and bias (Ioffe & Szegedy 2015's inference transform,
// w' = w g / sqrt(v + eps), b' = beta + (b - mean) g / sqrt(v + eps), computed in double and
// rounded once), and the ReLU after it; a ResNet block's last convolution takes the residual add
// and the block's ReLU. The nodes are then:
//   conv   Backend::fused_conv2d_inference (cpu: oneDNN post-ops; cuda: cuDNN's fused
//          convolution-bias-activation; reference: conv2d_forward + add + relu_forward),
//   block  its main path's fused convolutions, the last one writing over the shortcut (the block's
//          input, or its downsample convolution's output) in place,
//   max pooling, global average pooling, and a final Linear (the logits, for a cut at "fc"),
// and a 4-D output is pooled (global average) into one D-vector per image. On cpu the
// activations stay in oneDNN's blocked layouts from the first convolution to the pooling.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "slide/core/status.h"
#include "slide/train/backend.h"
#include "slide/train/layers.h"

namespace slide::train {

class InferenceGraph {
 public:
  // Folds children 0..cut of `model` (host copies of the weights: the model may be destroyed
  // afterwards). Supported: Conv2d (+ BatchNorm2d, + ReLU), MaxPool2d, ResNet blocks (BasicBlock,
  // Bottleneck; a downsample of one convolution + batch norm), GlobalAvgPool, Linear (only last).
  // The model's weights must be in host memory, f32 or f64. Errors: kInvalidArgument (cut beyond
  // the model), kUnimplemented naming a layer kind the graph does not have.
  [[nodiscard]] static Result<InferenceGraph> build(Sequential& model, size_t cut);

  InferenceGraph(InferenceGraph&&) noexcept;
  InferenceGraph& operator=(InferenceGraph&&) noexcept;
  ~InferenceGraph();

  // D: the output width (channels of the cut, or the Linear's outputs).
  int64_t feature_dim() const;
  // The number of nodes (a ResNet block is one node), for logs and tests.
  size_t size() const;

  // Prepares every weight for `be` (prepare_fused_conv2d; the Linear's uploaded), once: run() then
  // needs that same backend. Preparing again (for another backend) replaces the prepared weights.
  // The host copies are kept (another prepare may follow). Errors: the backend's.
  [[nodiscard]] Status prepare(Backend& be);

  // images [N,3,H,W] f32, plain, on be's device (normalised as the model was trained) ->
  // [N,D] f32 on be's device, from be.allocator(). Errors: kFailedPrecondition (not prepared for
  // `be`), kInvalidArgument (not [N,3,H,W], N < 1, an input too small for the cut: an op's
  // message naming the node), the backend's (kResourceExhausted past its budget).
  // The activations between the nodes are in activation_dtype(be): with f16 / bf16 (backend.h,
  // "Half-precision storage"; cuda under --precision fp16 / bf16) the images are cast to it first,
  // each fused convolution (its weights kept f32 by the graph, converted by the backend) and max
  // pooling reads and writes it (in the layout the backend chooses: cuda channels last), and the
  // activations are made plain and cast back to f32 before the global average pooling, so the
  // features and a final Linear are f32.
  [[nodiscard]] Result<Tensor> run(Backend& be, const Tensor& images) const;

  // The activations' dtype on `be`: its activation_dtype() unless set_activation_dtype chose one
  // (kF32, kF16, kBF16: tests run the half-precision graph on the reference backend).
  DType activation_dtype(const Backend& be) const { return act_override_ ? *act_override_ : be.activation_dtype(); }
  void set_activation_dtype(DType dtype) { act_override_ = dtype; }

  struct Node;

 private:
  InferenceGraph();
  std::vector<Node> nodes_;
  int64_t feature_dim_ = 0;
  const Backend* prepared_for_ = nullptr;
  std::optional<DType> act_override_;
};

}  // namespace slide::train
