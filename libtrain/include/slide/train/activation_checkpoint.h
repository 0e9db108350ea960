// Activation checkpointing (gradient checkpointing): a segment of layers keeps only its input
// through the forward pass and recomputes its activations in backward (Chen et al., 2016,
// "Training Deep Nets with Sublinear Memory Cost"; PyTorch's torch.utils.checkpoint).
//
// Memory: the saved activations of a checkpointed model are the segments' inputs plus, during
// backward, one segment's activations at a time; the price is a second forward of every segment
// (about a third more arithmetic for a CNN whose backward costs twice its forward).
//
// Exactness: the recomputed forward sees the same input and parameters, so its activations and
// the gradients are those of the plain model (oneDNN's kernels are deterministic for a given
// shape and thread count). Batch norm's running statistics are updated once: the segment saves
// its buffers before the recompute and puts them back after it. A layer that draws random numbers
// in forward (Dropout) would draw again in the recompute: wrap no such layer (none of the models
// here has one in a segment).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "slide/train/layers.h"

namespace slide::train {

// A run of a parent Sequential's layers wrapped as one layer (activation checkpointing here,
// activation offload in offload.h). Parameter names are unchanged: the segment sits in its parent
// at the first layer's place and name, and its other layers' places hold pass-through
// placeholders (see wrap_segments).
class Segment : public Layer {
 public:
  // `names`: each layer's name in the parent Sequential; names[0] is the segment's own name there.
  Segment(std::vector<std::unique_ptr<Layer>> layers, std::vector<std::string> names);
  // `prefix` is the parent's prefix joined with names[0]; each layer gets the parent's prefix
  // joined with its own name, as if it were still in the parent.
  void collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) override;
  void release() override;
  // Forwarded to the layers: a recompute in backward then draws the same Dropout masks and meets
  // the other ranks' synchronised batch norms as the forward did.
  void set_rng_seed(uint64_t seed) override {
    for (auto& l : layers_) l->set_rng_seed(seed);
  }
  void set_batch_norm_sync(Communicator* comm) override {
    for (auto& l : layers_) l->set_batch_norm_sync(comm);
  }
  void set_input_gradient(bool needed) override { set_input_gradient_of(layers_, needed); }
  size_t layers() const { return layers_.size(); }
  // Gives the layers back, with their names in the parent (unwrap_segments); the segment is empty
  // afterwards.
  std::vector<std::unique_ptr<Layer>> take_layers(std::vector<std::string>* names);

 protected:
  // The layers' forward in order (on error: release(), the error naming the layer + `suffix`).
  Result<Tensor> run_forward(Backend& be, const Tensor& x, bool training, const char* suffix = "");
  // The layers' backward in reverse order, each layer released once done (on error: release()).
  Result<Tensor> run_backward(Backend& be, const Tensor& dy);

  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<std::string> names_;
  std::vector<Buffer*> buffers_;  // the layers' batch norm statistics
};

// Runs `layers` (in order) as one checkpointed segment.
class CheckpointedSegment final : public Segment {
 public:
  using Segment::Segment;
  // Training: runs the layers, then drops what they saved, keeping only x. Inference: runs them.
  Result<Tensor> forward(Backend& be, const Tensor& x, bool training) override;
  // Recomputes the segment's forward from the kept input (batch norm's running statistics put
  // back as they were), then runs the layers' backward. Errors: kFailedPrecondition without a
  // training forward; the layers' (kResourceExhausted for the recomputed activations).
  Result<Tensor> backward(Backend& be, const Tensor& dy) override;
  void release() override;

 private:
  Tensor x_;
  bool training_forward_ = false;
};

// Rewrites `model` in place, wrapping runs of its layers with `make` (which takes the layers and
// their names in the parent). `mode`:
// - "stage": every child that is itself a Sequential (ResNet's layer1..layer4) is one segment,
//   and so is each run of other children between them (ResNet's stem, conv1..maxpool; its head);
// - "block": every ResidualBlock (at any depth) is one segment;
// - "K" (an integer >= 1): the model's top-level children in consecutive groups of K;
// - "none": nothing.
// Returns the number of segments made. Errors: kInvalidArgument for another mode, or when the
// mode finds nothing to wrap ("stage" on a model without stages); `what` names the feature.
using SegmentFactory =
    std::function<std::unique_ptr<Layer>(std::vector<std::unique_ptr<Layer>>, std::vector<std::string>)>;
[[nodiscard]] Result<size_t> wrap_segments(Sequential& model, const std::string& mode, const std::string& what,
                                           const SegmentFactory& make);

// Undoes wrap_segments (any factory, any mode, at any depth): each segment's layers go back to
// their places in their parent, in place of the pass-through placeholders. Returns the number of
// segments removed. The memory-strategy planner (memory_strategy.h) wraps, plans and unwraps to
// weigh the strategies on one model. Call it between steps (no saved activations).
size_t unwrap_segments(Sequential& model);

// Rewrites `model` in place so that its activations are checkpointed: wrap_segments with
// CheckpointedSegment (the modes above). Parameter names and the computed function are unchanged
// (checkpoints stay interchangeable). Errors: as wrap_segments.
[[nodiscard]] Result<size_t> checkpoint_activations(Sequential& model, const std::string& mode);

}  // namespace slide::train
