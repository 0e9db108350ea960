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
// Tensors on a device are downloaded through `device` (the backend they live on; nullptr when all
// are host tensors). Errors: kInvalidArgument (duplicate name, undefined tensor, a device tensor
// without its backend), the download's, the file's.
[[nodiscard]] Status save_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                                      const std::map<std::string, std::string>& metadata = {},
                                      Backend* device = nullptr);

// Reads a safetensors file into the tensors named in `into` (each must exist in the file with the
// same shape and dtype; extra file entries are ignored). Every f32 / f64 value read must be
// finite. Errors: kNotFound, kDataLoss (malformed header, offsets outside the file; a NaN or inf
// value, naming the file, the tensor and the element: that tensor is zeroed), kInvalidArgument
// naming the first tensor that is missing or differs. Tensors on a device are read into a host
// copy, checked, then uploaded through `device` (their backend; nullptr for host tensors only).
[[nodiscard]] Status load_safetensors(const std::string& path, const std::vector<NamedTensor>& into,
                                      Backend* device = nullptr);

// The tensor names and shapes of a safetensors file, from its header only (the data is not read:
// a foundation model's weights are gigabytes). Errors: kNotFound, kDataLoss (a header length past
// the end of the file or over 100 MB, a header that is not the format's JSON).
[[nodiscard]] Result<std::map<std::string, Shape>> read_safetensors_shapes(const std::string& path);

}  // namespace slide::train
