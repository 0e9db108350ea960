#include "slide/train/activation_checkpoint.h"

#include "running_stats_guard.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

namespace slide::train {

namespace {

using slide::core::failed_precondition;
using slide::core::invalid_argument;

// Holds the place (and name) of a layer that moved into a segment: passes values through.
class PassThrough final : public Layer {
 public:
  Result<Tensor> forward(Backend&, const Tensor& x, bool) override { return x; }
  Result<Tensor> backward(Backend&, const Tensor& dy) override { return dy; }
};


// Wraps every ResidualBlock found under `seq` (at any depth) in a one-layer segment.
size_t wrap_blocks(Sequential& seq, const SegmentFactory& make) {
  size_t made = 0;
  for (size_t i = 0; i < seq.size(); ++i) {
    Layer& l = seq.at(i);
    if (dynamic_cast<ResidualBlock*>(&l) != nullptr) {
      std::vector<std::unique_ptr<Layer>> one;
      one.push_back(seq.replace(i, nullptr));
      seq.replace(i, make(std::move(one), std::vector<std::string>{seq.name_at(i)}));
      ++made;
    } else if (auto* inner = dynamic_cast<Sequential*>(&l); inner != nullptr) {
      made += wrap_blocks(*inner, make);
    }
  }
  return made;
}

}  // namespace

Segment::Segment(std::vector<std::unique_ptr<Layer>> layers, std::vector<std::string> names)
    : layers_(std::move(layers)), names_(std::move(names)) {}

Result<Tensor> Segment::run_forward(Backend& be, const Tensor& x, bool training, const char* suffix) {
  Tensor h = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto r = layers_[i]->forward(be, h, training);
    if (!r.ok()) {
      release();
      return r.status().with_context("layer " + names_[i] + suffix);
    }
    h = std::move(*r);
  }
  return h;
}

Result<Tensor> Segment::run_backward(Backend& be, const Tensor& dy) {
  Tensor g = dy;
  for (size_t i = layers_.size(); i-- > 0;) {
    auto r = layers_[i]->backward(be, g);
    if (!r.ok()) {
      release();
      return r.status().with_context("layer " + names_[i] + " backward");
    }
    g = std::move(*r);
    layers_[i]->release();
  }
  return g;
}

void Segment::collect(const std::string& prefix, std::vector<Parameter*>* params, std::vector<Buffer*>* buffers) {
  // prefix = join_name(parent prefix, names_[0]): recover the parent's prefix.
  std::string parent;
  if (prefix.size() > names_[0].size()) parent = prefix.substr(0, prefix.size() - names_[0].size() - 1);
  buffers_.clear();
  for (size_t i = 0; i < layers_.size(); ++i) {
    std::vector<Buffer*> mine;
    layers_[i]->collect(join_name(parent, names_[i]), params, &mine);
    buffers_.insert(buffers_.end(), mine.begin(), mine.end());
    if (buffers != nullptr) buffers->insert(buffers->end(), mine.begin(), mine.end());
  }
}

void Segment::release() {
  for (auto& l : layers_) l->release();
}

std::vector<std::unique_ptr<Layer>> Segment::take_layers(std::vector<std::string>* names) {
  release();
  if (names != nullptr) *names = names_;
  names_.clear();
  buffers_.clear();
  return std::move(layers_);
}

Result<Tensor> CheckpointedSegment::forward(Backend& be, const Tensor& x, bool training) {
  SLIDE_ASSIGN_OR_RETURN(Tensor h, run_forward(be, x, training));
  if (training) {
    // Keep only the boundary: the layers' saved activations go back to the allocator now.
    for (auto& l : layers_) l->release();
    x_ = x;
  }
  training_forward_ = training;
  return h;
}

Result<Tensor> CheckpointedSegment::backward(Backend& be, const Tensor& dy) {
  if (!training_forward_ || !x_.defined())
    return failed_precondition("checkpointed segment: backward without a training forward");
  // Recompute. Batch norm's running statistics are updated into copies that are then dropped, so
  // they advance once per training forward, as without checkpointing.
  // (Put back when the guard goes away, also when a copy fails for the memory budget.)
  Tensor h = x_;
  Status failed;
  {
    detail::RunningStatsGuard guard(buffers_);
    failed = guard.swap_in_copies("running statistic (recompute)");
    for (size_t i = 0; i < layers_.size() && failed.ok(); ++i) {
      auto r = layers_[i]->forward(be, h, true);
      if (!r.ok()) failed = r.status().with_context("layer " + names_[i] + " (recompute)");
      else h = std::move(*r);
    }
  }
  h = Tensor();
  if (!failed.ok()) {
    release();
    return failed;
  }
  auto g = run_backward(be, dy);
  x_ = Tensor();
  training_forward_ = false;
  return g;
}

void CheckpointedSegment::release() {
  Segment::release();
  x_ = Tensor();
  training_forward_ = false;
}

Result<size_t> checkpoint_activations(Sequential& model, const std::string& mode) {
  return wrap_segments(model, mode, "activation checkpointing",
                       [](std::vector<std::unique_ptr<Layer>> layers, std::vector<std::string> names) {
                         return std::make_unique<CheckpointedSegment>(std::move(layers), std::move(names));
                       });
}

Result<size_t> wrap_segments(Sequential& model, const std::string& mode, const std::string& what,
                             const SegmentFactory& make) {
  size_t made = 0;
  if (mode == "none") return made;
  if (mode == "stage") {
    bool stages = false;
    for (size_t i = 0; i < model.size(); ++i) stages |= dynamic_cast<Sequential*>(&model.at(i)) != nullptr;
    for (size_t i = 0; stages && i < model.size();) {
      // A stage alone, or the run of plain layers up to the next stage (ResNet's stem: conv1, bn1,
      // relu, maxpool, whose activations are the model's largest; its head: avgpool, fc).
      size_t end = i + 1;
      if (dynamic_cast<Sequential*>(&model.at(i)) == nullptr)
        while (end < model.size() && dynamic_cast<Sequential*>(&model.at(end)) == nullptr) ++end;
      std::vector<std::unique_ptr<Layer>> group;
      std::vector<std::string> names;
      for (size_t j = i; j < end; ++j) {
        group.push_back(model.replace(j, std::make_unique<PassThrough>()));
        names.push_back(model.name_at(j));
      }
      model.replace(i, make(std::move(group), std::move(names)));
      ++made;
      i = end;
    }
  } else if (mode == "block") {
    made = wrap_blocks(model, make);
  } else {
    char* end = nullptr;
    const long k = std::strtol(mode.c_str(), &end, 10);
    if (mode.empty() || *end != '\0' || k < 1)
      return invalid_argument(what + " '" + mode + "' is not one of none, stage, block, or a layer count");
    for (size_t first = 0; first < model.size(); first += static_cast<size_t>(k)) {
      const size_t last = std::min(model.size(), first + static_cast<size_t>(k));
      std::vector<std::unique_ptr<Layer>> group;
      std::vector<std::string> names;
      for (size_t j = first; j < last; ++j) {
        group.push_back(model.replace(j, std::make_unique<PassThrough>()));
        names.push_back(model.name_at(j));
      }
      model.replace(first, make(std::move(group), std::move(names)));
      ++made;
    }
  }
  if (made == 0) return invalid_argument(what + " '" + mode + "': the model has nothing to wrap");
  model.collect("", nullptr, nullptr);  // the segments learn their batch norm buffers
  return made;
}

size_t unwrap_segments(Sequential& model) {
  size_t removed = 0;
  // Pass after pass over this level, outermost segments first: wrap_segments groups consecutive
  // layers, the segment at the first one's place and pass-throughs at the others', so a segment's
  // layers go back to its own places. A layer put back may itself be a segment wrapped earlier
  // (blocks checkpointed inside an offloaded group of top-level layers), whose places may lie in
  // the next outer group: it is unwrapped by the next pass, once every outer group is undone.
  for (bool again = true; again;) {
    again = false;
    for (size_t i = 0; i < model.size();) {
      auto* seg = dynamic_cast<Segment*>(&model.at(i));
      if (seg == nullptr) {
        ++i;
        continue;
      }
      std::vector<std::string> names;
      std::vector<std::unique_ptr<Layer>> layers = seg->take_layers(&names);
      const size_t n = layers.size();
      for (size_t j = 0; j < n; ++j) model.replace(i + j, std::move(layers[j]));
      ++removed;
      again = true;
      i += std::max<size_t>(1, n);
    }
  }
  for (size_t i = 0; i < model.size(); ++i)
    if (auto* inner = dynamic_cast<Sequential*>(&model.at(i)); inner != nullptr) removed += unwrap_segments(*inner);
  if (removed > 0) model.collect("", nullptr, nullptr);
  return removed;
}

}  // namespace slide::train
