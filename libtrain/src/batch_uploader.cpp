#include "batch_uploader.h"

#include <utility>

namespace slide::train {

BatchUploader::BatchUploader(Backend& be, std::unique_ptr<CopyEngine> engine) : be_(be), engine_(std::move(engine)) {}

BatchUploader::~BatchUploader() {
  // No caller to report to: a failed copy was reported by ready() or upload() already.
  for (auto& s : slots_) (void)settle(*s);
}

Allocator& BatchUploader::host_allocator() {
  Allocator* pinned = engine_->host_allocator();
  return pinned != nullptr ? *pinned : cpu_allocator();
}

Status BatchUploader::settle(Slot& s) {
  Status first = slide::core::ok_status();
  for (uint64_t t : s.tickets) {
    Status w = engine_->wait(t);
    if (first.ok() && !w.ok()) first = w;
  }
  s.tickets.clear();
  s.host_images = s.host_labels = Tensor();
  return first;
}

Result<BatchUploader::Uploaded> BatchUploader::upload(const Tensor& images, const Tensor& labels) {
  int id = -1;
  Slot* s = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < slots_.size() && s == nullptr; ++i)
      if (!slots_[i]->in_use) s = slots_[i].get(), id = static_cast<int>(i);
    if (s == nullptr) {
      slots_.push_back(std::make_unique<Slot>());
      s = slots_.back().get();
      id = static_cast<int>(slots_.size() - 1);
    }
    s->in_use = true;
  }
  // The slot is this call's alone until the lease is made; on an error it is free again (its
  // buffers' next copy is ordered as their state says).
  Status st = [&]() -> Status {
    SLIDE_RETURN_IF_ERROR(settle(*s));  // the slot's last copies (long done, normally)
    auto grow = [&](Tensor& buf, const Tensor& host, const char* what) -> Status {
      if (buf.defined() && buf.numel() >= host.numel() && buf.dtype() == host.dtype()) return slide::core::ok_status();
      buf = Tensor();  // (its last copy was waited for above; its readers are before any later op)
      SLIDE_ASSIGN_OR_RETURN(buf, Tensor::empty({host.numel()}, host.dtype(), be_.allocator(), what));
      s->fresh = true;
      return slide::core::ok_status();
    };
    SLIDE_RETURN_IF_ERROR(grow(s->images, images, "input images (device)"));
    SLIDE_RETURN_IF_ERROR(grow(s->labels, labels, "input labels (device)"));
    return slide::core::ok_status();
  }();
  if (!st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    s->in_use = false;
    return st;
  }
  Uploaded out;
  out.slot = id;
  // From here the lease frees the slot, on the error paths too.
  out.lease = std::shared_ptr<void>(static_cast<void*>(s), [this, id](void*) { release(id); });
  SLIDE_ASSIGN_OR_RETURN(out.images, s->images.view(0, images.shape()));
  SLIDE_ASSIGN_OR_RETURN(out.labels, s->labels.view(0, labels.shape()));
  const DeviceFence* after = nullptr;  // after everything queued: fresh buffers, or no fence
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!s->fresh) after = s->released.get();
  }
  s->host_images = images;
  s->host_labels = labels;
  for (auto [src, dst] : {std::pair{&images, &out.images}, {&labels, &out.labels}}) {
    SLIDE_ASSIGN_OR_RETURN(const uint64_t t, engine_->start_after(be_, after, *src, *dst, CopyDirection::kToDevice));
    s->tickets.push_back(t);
  }
  s->fresh = false;
  return out;
}

Status BatchUploader::ready(const Uploaded& batch) {
  if (batch.slot < 0) return slide::core::ok_status();
  std::vector<uint64_t> tickets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tickets = slots_[static_cast<size_t>(batch.slot)]->tickets;
  }
  for (uint64_t t : tickets) SLIDE_RETURN_IF_ERROR(engine_->order_ops_after(be_, t));
  return slide::core::ok_status();
}

void BatchUploader::release(int slot) {
  // The ops queued so far include every op that read the batch: its slot's next copy waits for
  // them. Without a fence (a host backend, or a failure), that copy waits for everything queued.
  auto fence = be_.fence();
  std::lock_guard<std::mutex> lock(mu_);
  Slot& s = *slots_[static_cast<size_t>(slot)];
  s.released = fence.ok() ? std::move(*fence) : nullptr;
  if (s.released == nullptr) s.fresh = true;
  s.in_use = false;
}

Status BatchUploader::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  Status first = slide::core::ok_status();
  for (auto& s : slots_) {
    if (s->in_use) continue;
    Status w = settle(*s);
    if (first.ok() && !w.ok()) first = w;
    s->images = s->labels = Tensor();
    s->released.reset();
    s->fresh = true;
  }
  return first;
}

size_t BatchUploader::slot_count() {
  std::lock_guard<std::mutex> lock(mu_);
  return slots_.size();
}

}  // namespace slide::train
