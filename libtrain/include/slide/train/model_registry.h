// The CNN families the tools build by name (issue 18 item 3, model families as data): one table
// that slide-train (apps/train_common.cpp make_tile_model, for training, evaluate and predict),
// slide-embed (load_embed_model: the architecture of a weights file, the default --layer) and
// their messages read, instead of each keeping its own list of names. Vision Transformers have
// their own table of presets (vit.h), listed beside this one in messages. Adding a family is one
// row here (and its builder in layers.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "slide/core/status.h"
#include "slide/train/layers.h"

namespace slide::train {

struct CnnFamily {
  const char* name;         // "resnet50": --model's value, state.json's "model"
  const char* default_cut;  // slide-embed's default --layer ("layer3" for resnet50: CLAM's features)
  const char* description;  // one line, for messages and --help
  // Builds it on cpu_allocator() in f32 (then moved to a device by move_to_device): `classes`
  // outputs; `width` the first stage's channels (the small CNN; the ResNets ignore it); `seed`
  // its initialisation (none: the parameters a weight file will overwrite stay zero, InitRng);
  // `dropout` before the classifier (layers.h). Errors: the builder's.
  Result<std::unique_ptr<Sequential>> (*build)(int64_t classes, int64_t width, std::optional<uint64_t> seed,
                                               double dropout);
};

// The families, in the order messages list them: small, resnet18, resnet34, resnet50.
const std::vector<CnnFamily>& cnn_families();
// The family named `name`, or null.
const CnnFamily* find_cnn_family(const std::string& name);
// "small, resnet18, resnet34, resnet50".
std::string cnn_family_names();
// find_cnn_family(name)->build(...). Errors: kInvalidArgument naming `name` and listing the
// families (and the ViT presets, which are built elsewhere: vit.h), the builder's.
[[nodiscard]] Result<std::unique_ptr<Sequential>> make_cnn(const std::string& name, int64_t classes, int64_t width,
                                                           std::optional<uint64_t> seed, double dropout = 0);

}  // namespace slide::train
