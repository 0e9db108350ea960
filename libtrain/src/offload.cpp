#include "slide/train/offload.h"

#include <utility>

namespace slide::train {

OffloadedSegment::OffloadedSegment(std::vector<std::unique_ptr<Layer>> layers, std::vector<std::string> names,
                                   Allocator& host)
    : Segment(std::move(layers), std::move(names)), host_(&host) {}

Result<Tensor> OffloadedSegment::forward(Backend& be, const Tensor& x, bool training) {
  moved_.clear();  // host copies of a forward that had no backward (an evaluation, a failed step)
  training_forward_ = false;
  if (!training) return run_forward(be, x, false);
  std::vector<Tensor::WeakStorage> made;
  std::vector<Tensor::WeakStorage>* outer = Tensor::set_storage_capture(&made);
  auto r = run_forward(be, x, true);
  Tensor::set_storage_capture(outer);
  if (!r.ok()) return r;
  const Tensor y = std::move(*r);
  for (const Tensor::WeakStorage& w : made) {
    Tensor s = w.lock();
    if (!s.defined() || s.storage_evicted() || s.shares_storage(y) || s.shares_storage(x)) continue;
    auto host = Tensor::empty(s.shape(), DType::kU8, *host_, "offloaded activation");
    Status st = host.ok() ? be.download(s, *host) : host.status();
    if (!st.ok()) {
      release();
      return st.with_context("activation offload of layer " + names_[0]);
    }
    s.evict_storage();
    moved_.push_back({std::move(s), std::move(*host)});
  }
  training_forward_ = true;
  return y;
}

Result<Tensor> OffloadedSegment::backward(Backend& be, const Tensor& dy) {
  if (!training_forward_) return slide::core::failed_precondition("offloaded segment: backward without a training forward");
  for (Moved& m : moved_) {
    Status st = m.device.restore_storage("activation brought back from host memory");
    if (st.ok()) st = be.upload(m.host, m.device);
    if (!st.ok()) {
      release();
      return st.with_context("activation offload of layer " + names_[0] + " (bringing it back)");
    }
    m.host = Tensor();
  }
  moved_.clear();
  training_forward_ = false;
  return run_backward(be, dy);
}

void OffloadedSegment::release() {
  Segment::release();
  moved_.clear();
  training_forward_ = false;
}

size_t OffloadedSegment::offloaded_bytes() const {
  size_t n = 0;
  for (const Moved& m : moved_) n += m.host.bytes();
  return n;
}

Result<size_t> offload_activations(Sequential& model, const std::string& mode, Allocator& host) {
  return wrap_segments(model, mode, "activation offload",
                       [&host](std::vector<std::unique_ptr<Layer>> layers, std::vector<std::string> names) {
                         return std::make_unique<OffloadedSegment>(std::move(layers), std::move(names), host);
                       });
}

}  // namespace slide::train
