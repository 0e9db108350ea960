// Fine-tuning (slide-train --init, --freeze, --lr-backbone): a model started from pretrained
// weights (torchvision-named safetensors: ImageNet weights converted by
// scripts/convert_torchvision_weights.py, a slidestream checkpoint, a pathology checkpoint), with
// its classifier head replaced when the class count differs, some leading layers frozen and the
// pretrained layers at a smaller learning rate (PyTorch's usual recipe: parameter groups with
// their own lr, requires_grad=False for frozen layers).
#pragma once

#include <string>
#include <vector>

#include "slide/train/layers.h"
#include "slide/train/optimizer.h"

namespace slide::train {

// What load_initial_weights did, by tensor name.
struct InitReport {
  std::vector<std::string> loaded;    // read from the file
  std::vector<std::string> kept;      // the classifier head's, left as initialised (shape differs or absent)
  std::vector<std::string> ignored;   // in the file, not in the model (e.g. num_batches_tracked)
};

// Reads every parameter and buffer of a model (`params`, `buffers`: collect()'s, torchvision
// names) from the safetensors file `path`. Tensors under `head` (e.g. "fc": "fc.weight",
// "fc.bias") whose shape differs in the file, or that the file lacks, keep their initial values
// (a new classifier for another class count); every other model tensor must be in the file with
// its shape. A file tensor the model lacks is ignored (InitReport::ignored) when it is a
// num_batches_tracked counter or belongs to none of the model's top-level layers (another head);
// under one of them it means another architecture and is refused. Host tensors (load before moving
// the model to a device). Errors: kInvalidArgument naming the file and the first model tensor
// missing or of another shape, or the first file tensor of a model layer the model lacks ("is it
// the same architecture?"), and those of load_safetensors (kNotFound, kDataLoss for a malformed file or a
// non-finite value).
[[nodiscard]] Result<InitReport> load_initial_weights(const std::string& path, const std::vector<Parameter*>& params,
                                                      const std::vector<Buffer*>& buffers, const std::string& head);

// Per-parameter optimizer options for `params` (collect()'s order, names relative to `model`):
// parameters of `model`'s top-level children up to and including the one named `freeze_until`
// ("" freezes none) are frozen; every parameter outside `head` gets lr_scale `backbone_lr_scale`
// (the head keeps 1). Errors: kInvalidArgument when `freeze_until` is not one of the model's
// top-level names (listing them), or names the head itself (nothing would train).
[[nodiscard]] Result<std::vector<ParameterOptions>> fine_tune_options(Sequential& model,
                                                                      const std::vector<Parameter*>& params,
                                                                      const std::string& freeze_until,
                                                                      const std::string& head,
                                                                      double backbone_lr_scale);

}  // namespace slide::train
