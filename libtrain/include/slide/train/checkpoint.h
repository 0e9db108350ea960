// Checkpoints: safetensors files of named tensors, and a checkpoint directory that holds the
// model's weights and buffers, the optimizer's state and a JSON record of where training stood.
//
// safetensors (huggingface/safetensors, the format's README): an 8-byte little-endian header
// length N, N bytes of JSON {"name": {"dtype": "F32", "shape": [...], "data_offsets": [b, e]},
// "__metadata__": {...}}, then the tensors' bytes, little-endian, row-major. Names are
// torchvision's, so `torch.load`-free tools (safetensors.torch.load_file) read our weights into a
// torchvision model with load_state_dict.
//
// A checkpoint directory `<out>/checkpoints/epoch-E-step-S/` is written as
// `...partial` (files fsync'd) and renamed into place: a directory without `.partial` is
// complete.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "slide/train/layers.h"

namespace slide::train {

struct NamedTensor {
  std::string name;
  const Tensor* tensor;
};

// Writes `tensors` (f32, f64 or i32) as a safetensors file, atomically (write_file_atomic).
// Errors: kInvalidArgument (duplicate name, undefined tensor), the file's.
[[nodiscard]] Status save_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                                      const std::map<std::string, std::string>& metadata = {});

// Reads a safetensors file into the tensors named in `into` (each must exist in the file with the
// same shape and dtype; extra file entries are ignored). Errors: kNotFound, kDataLoss (malformed
// header, offsets outside the file), kInvalidArgument naming the first tensor that is missing or
// differs.
[[nodiscard]] Status load_safetensors(const std::string& path, const std::vector<NamedTensor>& into);

}  // namespace slide::train
