#include "slide/train/offload.h"

#include <utility>

#include "slide/train/copy_engine.h"

namespace slide::train {

// The segments of one model in forward order, the host allocator and the engine they share.
class OffloadSchedule {
 public:
  OffloadSchedule(Allocator& host, CopyEngine* engine) : host_(host), override_(engine) {}
  size_t add(OffloadedSegment* s) {
    segments_.push_back(s);
    return segments_.size() - 1;
  }
  void remove(size_t i) {
    if (i < segments_.size()) segments_[i] = nullptr;
  }
  // The segment before `i` in forward order (null for the first, or one already destroyed).
  OffloadedSegment* before(size_t i) const { return i > 0 ? segments_[i - 1] : nullptr; }
  bool last(size_t i) const { return i + 1 == segments_.size(); }
  CopyEngine& engine(Backend& be) {
    if (override_ != nullptr) return *override_;
    if (CopyEngine* e = be.copy_engine(); e != nullptr) return *e;
    return sync_;
  }
  Allocator& host(CopyEngine& e) { return e.host_allocator() != nullptr ? *e.host_allocator() : host_; }

 private:
  Allocator& host_;
  CopyEngine* override_;
  SyncCopyEngine sync_;
  std::vector<OffloadedSegment*> segments_;
};

OffloadedSegment::OffloadedSegment(std::vector<std::unique_ptr<Layer>> layers, std::vector<std::string> names,
                                   std::shared_ptr<OffloadSchedule> schedule)
    : Segment(std::move(layers), std::move(names)), schedule_(std::move(schedule)) {
  index_ = schedule_->add(this);
}

OffloadedSegment::~OffloadedSegment() {
  drain();
  schedule_->remove(index_);
}

void OffloadedSegment::drain() {
  if (where_ == Where::kLeaving || where_ == Where::kReturning)
    for (Moved& m : moved_)
      if (m.ticket != 0) (void)engine_->wait(m.ticket), m.ticket = 0;  // release: nothing to report to
}

Status OffloadedSegment::finish_leaving(bool free_device) {
  for (Moved& m : moved_) {
    const uint64_t t = std::exchange(m.ticket, 0);
    if (t != 0) SLIDE_RETURN_IF_ERROR(engine_->wait(t));
    if (free_device) m.device.evict_storage();
    else m.host = Tensor();
  }
  where_ = free_device ? Where::kOnHost : Where::kOnDevice;
  return slide::core::ok_status();
}

Status OffloadedSegment::start_returning(Backend& be, bool required) {
  for (size_t i = 0; i < moved_.size(); ++i) {
    Status st = moved_[i].device.restore_storage("activation brought back from host memory");
    if (!st.ok()) {
      // A prefetch past the budget waits for this segment's own backward, when the segment after
      // it has freed its activations: give back what was allocated.
      for (size_t j = 0; j < i; ++j) moved_[j].device.evict_storage();
      if (!required && st.code() == slide::core::StatusCode::kResourceExhausted) return slide::core::ok_status();
      return st;
    }
  }
  engine_ = &schedule_->engine(be);
  where_ = Where::kReturning;
  for (Moved& m : moved_) {
    auto t = engine_->start(be, m.host, m.device, CopyDirection::kToDevice);
    if (!t.ok()) return t.status();
    m.ticket = *t;
  }
  return slide::core::ok_status();
}

Status OffloadedSegment::finish_returning() {
  for (Moved& m : moved_) {
    const uint64_t t = std::exchange(m.ticket, 0);
    if (t != 0) SLIDE_RETURN_IF_ERROR(engine_->wait(t));
    m.host = Tensor();
  }
  where_ = Where::kOnDevice;
  return slide::core::ok_status();
}

Result<Tensor> OffloadedSegment::forward(Backend& be, const Tensor& x, bool training) {
  // A forward that had no backward (an evaluation, a failed step) leaves nothing behind.
  drain();
  moved_.clear();
  where_ = Where::kNone;
  if (!training) return run_forward(be, x, false);
  std::vector<Tensor::WeakStorage> made;
  std::vector<Tensor::WeakStorage>* outer = Tensor::set_storage_capture(&made);
  auto r = run_forward(be, x, true);
  Tensor::set_storage_capture(outer);
  if (!r.ok()) return r;
  const Tensor y = std::move(*r);
  auto fail = [&](const Status& st) {
    release();
    return st.with_context("activation offload of layer " + names_[0]);
  };
  // The previous segment's copies to the host ran while this one computed: free its device memory.
  if (OffloadedSegment* prev = schedule_->before(index_); prev != nullptr && prev->where_ == Where::kLeaving)
    if (Status st = prev->finish_leaving(true); !st.ok()) return fail(st);
  // The last segment's backward comes next: its activations stay.
  if (schedule_->last(index_)) {
    where_ = Where::kOnDevice;
    return y;
  }
  engine_ = &schedule_->engine(be);
  Allocator& host = schedule_->host(*engine_);
  where_ = Where::kLeaving;
  for (const Tensor::WeakStorage& w : made) {
    Tensor s = w.lock();
    if (!s.defined() || s.storage_evicted() || s.shares_storage(y) || s.shares_storage(x)) continue;
    auto h = Tensor::empty(s.shape(), DType::kU8, host, "offloaded activation");
    if (!h.ok()) return fail(h.status());
    moved_.push_back({std::move(s), std::move(*h), 0});
    auto t = engine_->start(be, moved_.back().device, moved_.back().host, CopyDirection::kToHost);
    if (!t.ok()) return fail(t.status());
    moved_.back().ticket = *t;
  }
  return y;
}

Result<Tensor> OffloadedSegment::backward(Backend& be, const Tensor& dy) {
  if (where_ == Where::kNone) return slide::core::failed_precondition("offloaded segment: backward without a training forward");
  auto fail = [&](const Status& st) {
    release();
    return st.with_context("activation offload of layer " + names_[0] + " (bringing it back)");
  };
  Status st;
  switch (where_) {
    case Where::kLeaving: st = finish_leaving(false); break;  // backward follows at once: keep it
    case Where::kOnHost:  // not prefetched (the first segment of a step's backward, or no room then)
      st = start_returning(be, true);
      if (st.ok()) st = finish_returning();
      break;
    case Where::kReturning: st = finish_returning(); break;
    default: break;
  }
  if (!st.ok()) return fail(st);
  // Bring the previous segment back while this one's backward runs.
  if (OffloadedSegment* prev = schedule_->before(index_); prev != nullptr && prev->where_ == Where::kOnHost)
    if (Status p = prev->start_returning(be, false); !p.ok()) {
      prev->release();
      return fail(p);
    }
  moved_.clear();
  where_ = Where::kNone;
  return run_backward(be, dy);
}

void OffloadedSegment::release() {
  Segment::release();
  drain();
  moved_.clear();
  where_ = Where::kNone;
}

size_t OffloadedSegment::offloaded_bytes() const {
  size_t n = 0;
  for (const Moved& m : moved_) n += m.host.bytes();
  return n;
}

Result<size_t> offload_activations(Sequential& model, const std::string& mode, Allocator& host, CopyEngine* engine) {
  auto schedule = std::make_shared<OffloadSchedule>(host, engine);
  return wrap_segments(model, mode, "activation offload",
                       [schedule](std::vector<std::unique_ptr<Layer>> layers, std::vector<std::string> names) {
                         return std::make_unique<OffloadedSegment>(std::move(layers), std::move(names), schedule);
                       });
}

}  // namespace slide::train
