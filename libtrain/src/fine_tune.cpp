#include "slide/train/fine_tune.h"

#include <map>
#include <set>

#include "slide/train/checkpoint.h"

namespace slide::train {

namespace {

// "fc.weight" is under head "fc"; "fc2.weight" is not.
bool under(const std::string& name, const std::string& head) {
  return !head.empty() && name.size() > head.size() && name.compare(0, head.size(), head) == 0 &&
         name[head.size()] == '.';
}

}  // namespace

Result<InitReport> load_initial_weights(const std::string& path, const std::vector<Parameter*>& params,
                                        const std::vector<Buffer*>& buffers, const std::string& head) {
  SLIDE_ASSIGN_OR_RETURN(const auto shapes, read_safetensors_shapes(path));
  std::vector<std::pair<std::string, Tensor*>> model;
  for (Parameter* p : params) model.emplace_back(p->name, &p->value);
  for (Buffer* b : buffers) model.emplace_back(b->name, &b->value);
  InitReport report;
  std::vector<NamedTensor> into;
  std::set<std::string> names;
  for (auto& [name, tensor] : model) {
    names.insert(name);
    const auto it = shapes.find(name);
    const bool same = it != shapes.end() && it->second == tensor->shape();
    if (same) {
      into.push_back({name, tensor});
      report.loaded.push_back(name);
    } else if (under(name, head)) {
      report.kept.push_back(name);
    } else {
      return slide::core::invalid_argument(
          "--init " + path + ": " +
          (it == shapes.end() ? "has no tensor '" + name + "'"
                              : "'" + name + "' is " + shape_string(it->second) + ", the model's is " +
                                    shape_string(tensor->shape())) +
          " (is it the same architecture? the file must hold torchvision-named weights of this --model)");
    }
  }
  // A file tensor the model lacks is ignored when it belongs to no layer of the model (another
  // head, a projection) or is PyTorch's num_batches_tracked; under one of the model's layers it
  // means another architecture (resnet34's layer1.2 in a resnet18), which is refused.
  std::set<std::string> children;
  for (const std::string& name : names) children.insert(name.substr(0, name.find('.')));
  const std::string counter = ".num_batches_tracked";
  for (const auto& [name, shape] : shapes) {
    if (names.count(name) != 0) continue;
    const bool counter_tensor = name.size() > counter.size() &&
                                name.compare(name.size() - counter.size(), counter.size(), counter) == 0;
    if (!counter_tensor && !under(name, head) && children.count(name.substr(0, name.find('.'))) != 0)
      return slide::core::invalid_argument("--init " + path + ": has '" + name +
                                           "', which this model lacks (weights of a deeper or other model? the "
                                           "file must hold torchvision-named weights of this --model)");
    report.ignored.push_back(name);
  }
  SLIDE_RETURN_IF_ERROR(load_safetensors(path, into).with_context("--init"));
  return report;
}

Result<std::vector<ParameterOptions>> fine_tune_options(Sequential& model, const std::vector<Parameter*>& params,
                                                        const std::string& freeze_until, const std::string& head,
                                                        double backbone_lr_scale) {
  std::vector<ParameterOptions> out(params.size());
  std::set<std::string> frozen_children;
  if (!freeze_until.empty()) {
    std::string names;
    bool found = false;
    for (size_t i = 0; i < model.size() && !found; ++i) {
      frozen_children.insert(model.name_at(i));
      found = model.name_at(i) == freeze_until;
    }
    for (size_t i = 0; i < model.size(); ++i) names += (i ? ", " : "") + model.name_at(i);
    if (!found)
      return slide::core::invalid_argument("--freeze " + freeze_until + ": not one of the model's layers (" + names +
                                           ")");
    if (frozen_children.count(head) != 0)
      return slide::core::invalid_argument("--freeze " + freeze_until + " would freeze the classifier '" + head +
                                           "' too: nothing would train");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i]->name;
    const std::string child = name.substr(0, name.find('.'));
    out[i].frozen = frozen_children.count(child) != 0;
    out[i].lr_scale = under(name, head) ? 1.0 : backbone_lr_scale;
  }
  return out;
}

}  // namespace slide::train
