// Loading a CNN backbone for embedding (a slide-train checkpoint or a torchvision-named
// safetensors file), its cut points, and the engine's own forward to a cut (the oracle of the
// inference graph's tests).
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "slide/core/file.h"
#include "slide/core/hash.h"
#include "slide/train/checkpoint.h"
#include "slide/train/embed.h"
#include "slide/train/model_registry.h"
#include "slide/train/vit.h"

namespace slide::train {

using slide::core::invalid_argument;

std::vector<std::string> cut_points(Sequential& model) {
  std::vector<std::string> out;
  for (size_t i = 0; i < model.size(); ++i) {
    if (dynamic_cast<GlobalAvgPool*>(&model.at(i)) != nullptr && model.name_at(i) != "avgpool") out.push_back("avgpool");
    out.push_back(model.name_at(i));
  }
  return out;
}

std::string default_layer(const std::string& model) {
  const CnnFamily* f = find_cnn_family(model);
  return f != nullptr ? f->default_cut : "avgpool";
}

Result<size_t> find_cut(Sequential& model, const std::string& layer) {
  for (size_t i = 0; i < model.size(); ++i) {
    if (model.name_at(i) == layer) return i;
  }
  if (layer == "avgpool") {
    for (size_t i = 0; i < model.size(); ++i) {
      if (dynamic_cast<GlobalAvgPool*>(&model.at(i)) != nullptr) return i;
    }
  }
  std::string names;
  for (const auto& n : cut_points(model)) names += (names.empty() ? "" : ", ") + n;
  return invalid_argument("--layer '" + layer + "' is not a layer of the model (one of: " + names + ")");
}

Result<Tensor> engine_features(Backend& be, Sequential& model, size_t cut, const Tensor& images) {
  if (cut >= model.size()) return invalid_argument("cut " + std::to_string(cut) + " beyond the model");
  Tensor h = images;
  for (size_t i = 0; i <= cut; ++i) {
    auto r = model.at(i).forward(be, h, false);
    if (!r.ok()) return r.status().with_context("layer " + model.name_at(i));
    h = std::move(*r);
  }
  if (h.rank() == 4) {
    SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty({h.dim(0), h.dim(1)}, h.dtype(), be.allocator(), "pooled features"));
    SLIDE_RETURN_IF_ERROR(be.global_avg_pool_forward(h, y));
    h = y;
  }
  return h;
}


Result<EmbedModel> load_embed_model(const std::string& weights, const std::string& model, const std::string& layer) {
  std::error_code ec;
  EmbedModel out;
  int64_t classes = 1000, width = 16;
  if (std::filesystem::is_directory(weights, ec)) {
    SLIDE_ASSIGN_OR_RETURN(std::string text, slide::core::read_file(weights + "/state.json"));
    auto state = nlohmann::json::parse(text, nullptr, false);
    if (state.is_discarded() || !state.contains("model") || !state["model"].is_string() || !state.contains("classes"))
      return slide::core::data_loss(weights + "/state.json: not a slide-train checkpoint record");
    out.model = state["model"].get<std::string>();
    if (!model.empty() && model != out.model)
      return invalid_argument("--model " + model + " but the checkpoint " + weights + " holds a " + out.model);
    classes = static_cast<int64_t>(state["classes"].size());
    width = state.value("width", int64_t{16});
    out.weights_path = weights + "/model.safetensors";
  } else {
    if (!std::filesystem::exists(weights, ec)) return slide::core::not_found("--weights " + weights + ": no such file");
    if (model.empty()) return invalid_argument("--model is needed with a safetensors file (" + cnn_family_names() + ")");
    out.model = model;
    out.weights_path = weights;
    SLIDE_ASSIGN_OR_RETURN(const auto shapes, read_safetensors_shapes(weights));
    const auto fc = shapes.find("fc.weight");
    if (fc != shapes.end() && fc->second.size() == 2) classes = fc->second[0];
  }
  Result<std::unique_ptr<Sequential>> net = invalid_argument("model '" + out.model + "' is not one of " +
                                                             cnn_family_names() + " (or a ViT: " + vit_preset_list() + ")");
  // Without an initialisation (InitRng::none): the layers up to the cut are loaded below (a
  // missing tensor is an error), those after it never run.
  if (find_cnn_family(out.model) != nullptr) net = make_cnn(out.model, classes, width, std::nullopt);
  if (!net.ok()) return net.status();
  out.net = std::move(*net);
  out.layer = layer.empty() ? default_layer(out.model) : layer;
  SLIDE_ASSIGN_OR_RETURN(size_t cut, find_cut(*out.net, out.layer));
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  for (size_t i = 0; i <= cut; ++i) out.net->at(i).collect(out.net->name_at(i), &params, &buffers);
  std::vector<NamedTensor> named;
  for (Parameter* p : params) named.push_back({p->name, &p->value});
  for (Buffer* b : buffers) named.push_back({b->name, &b->value});
  SLIDE_RETURN_IF_ERROR(load_safetensors(out.weights_path, named));  // its errors name the file
  SLIDE_ASSIGN_OR_RETURN(out.weights_sha256, slide::core::sha256_file(out.weights_path));
  return out;
}

}  // namespace slide::train
