#include "slide/train/data_parallel.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace slide::train {

Result<std::unique_ptr<GradientBuckets>> GradientBuckets::make(const std::vector<Parameter*>& params,
                                                               Allocator& alloc, size_t bucket_bytes, Backend* device) {
  if (bucket_bytes < sizeof(float)) return slide::core::invalid_argument("gradient bucket of " + std::to_string(bucket_bytes) + " bytes");
  if (alloc.device() != Device::kCpu && (device == nullptr || device->device() != alloc.device()))
    return slide::core::invalid_argument(std::string("gradient buckets on ") + device_name(alloc.device()) +
                                         " need the backend of that device");
  auto g = std::unique_ptr<GradientBuckets>(new GradientBuckets());
  if (alloc.device() != Device::kCpu) g->device_ = device;
  const auto cap = static_cast<int64_t>(bucket_bytes / sizeof(float));
  int64_t offset = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    Parameter* p = *it;
    if (p->grad.dtype() != DType::kF32 || p->grad.device() != alloc.device())
      return slide::core::invalid_argument("gradient of " + p->name + ": data-parallel training takes f32 gradients on " +
                                           device_name(alloc.device()) + ", got " + dtype_name(p->grad.dtype()) +
                                           " on " + device_name(p->grad.device()));
    const int64_t n = p->grad.numel();
    if (g->buckets_.empty() || (g->buckets_.back().count > 0 && g->buckets_.back().count + n > cap))
      g->buckets_.push_back({offset, 0, {}});
    g->buckets_.back().params.push_back(p);
    g->buckets_.back().count += n;
    offset += n;
  }
  if (g->buckets_.empty()) g->buckets_.push_back({0, 0, {}});
  g->buckets_.back().count += 1;  // the stop flag
  SLIDE_ASSIGN_OR_RETURN(g->flat_, Tensor::zeros({offset + 1}, DType::kF32, alloc, "flat gradient buffer"));
  // From here on each gradient lives in the flat buffer: its tensor becomes a view of its slice
  // (its values copied over), so the all-reduce runs in place, without copies in or out, and the
  // separate gradient tensors are freed (llm.c's one gradient allocation).
  for (size_t b = 0; b < g->buckets_.size(); ++b) {
    const Bucket& bk = g->buckets_[b];
    int64_t at = bk.offset;
    for (Parameter* p : bk.params) {
      g->index_.emplace(p, std::make_pair(b, g->index_.size()));
      SLIDE_ASSIGN_OR_RETURN(Tensor v, g->flat_.view(at, p->grad.shape()));
      SLIDE_RETURN_IF_ERROR(v.copy_from(p->grad));  // on the gradients' device
      p->grad = std::move(v);
      at += p->grad.numel();
    }
  }
  return g;
}

Status GradientBuckets::start_step(Communicator& comm, bool stop_requested) {
  if (comm_ != nullptr) return slide::core::failed_precondition("gradient buckets: a step is already started");
  const auto t0 = std::chrono::steady_clock::now();
  comm_ = &comm;
  // Where the all-reduce runs: flat_ itself (host gradients; or device gradients and a
  // communicator of that device, NCCL), else a host copy (device gradients, MPI), made whole in
  // finish_step (no overlap then).
  staged_ = device_ != nullptr && comm.device() != flat_.device();
  if (staged_ && !staging_.defined()) {
    SLIDE_ASSIGN_OR_RETURN(staging_, Tensor::empty(flat_.shape(), DType::kF32, cpu_allocator(),
                                                   "flat gradient buffer (host staging)"));
  }
  stop_requested_ = stop_requested;
  if (!staged_) SLIDE_RETURN_IF_ERROR(write_stop_flag());  // staged: after finish_step's download
  done_.assign(index_.size(), false);
  remaining_.clear();
  for (const Bucket& bk : buckets_) remaining_.push_back(static_cast<int64_t>(bk.params.size()));
  next_ = 0;
  work_.clear();
  timeline_.clear();
  noted_done_.clear();
  step_t0_ = t0;
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return slide::core::ok_status();
}

const char* GradientBuckets::timeline_kind_name(TimelineEvent::Kind k) {
  switch (k) {
    case TimelineEvent::Kind::kLayerDone: return "layer_done";
    case TimelineEvent::Kind::kBucketStart: return "bucket_start";
    case TimelineEvent::Kind::kBucketDone: return "bucket_done";
    case TimelineEvent::Kind::kWaitStart: return "wait_start";
    case TimelineEvent::Kind::kStepEnd: return "step_end";
  }
  return "?";
}

void GradientBuckets::note(TimelineEvent::Kind kind, int64_t bucket, std::string name) {
  if (!record_) return;
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_t0_).count();
  timeline_.push_back({t, kind, bucket, std::move(name)});
}

void GradientBuckets::note_done(size_t bucket) {
  if (!record_) return;
  if (noted_done_.size() < work_.size()) noted_done_.resize(work_.size(), false);
  if (noted_done_[bucket]) return;
  noted_done_[bucket] = true;
  note(TimelineEvent::Kind::kBucketDone, static_cast<int64_t>(bucket));
}

void GradientBuckets::note_completed() {
  if (!record_) return;
  for (size_t k = 0; k < work_.size(); ++k)
    if (work_[k]->completed()) note_done(k);
}

Tensor& GradientBuckets::reduced() { return staged_ ? staging_ : flat_; }

Status GradientBuckets::write_stop_flag() {
  Tensor& buf = reduced();
  const int64_t last = buf.numel() - 1;
  const float v = stop_requested_ ? 1.0f : 0.0f;
  if (buf.device() == Device::kCpu) {
    buf.data<float>()[last] = v;
    return slide::core::ok_status();
  }
  // Into the device buffer, ordered before the collectives (each launch synchronises the backend).
  SLIDE_ASSIGN_OR_RETURN(Tensor flag, Tensor::empty({1}, DType::kF32, cpu_allocator(), "stop flag"));
  flag.data<float>()[0] = v;
  SLIDE_ASSIGN_OR_RETURN(Tensor slot, buf.view(last, {1}));
  return device_->upload(flag, slot);
}

Result<float> GradientBuckets::read_stop_flag() {
  Tensor& buf = reduced();
  const int64_t last = buf.numel() - 1;
  if (buf.device() == Device::kCpu) return buf.data<float>()[last];
  SLIDE_ASSIGN_OR_RETURN(Tensor slot, buf.view(last, {1}));
  SLIDE_ASSIGN_OR_RETURN(Tensor flag, to_host(*device_, slot, "stop flag"));
  return flag.data<float>()[0];
}

Status GradientBuckets::launch(size_t b) {
  const Bucket& bk = buckets_[b];
  // The gradients are views of flat_ (make()); one that was replaced since would be summed
  // wrongly in silence, so it is an error.
  for (Parameter* p : bk.params)
    if (!p->grad.shares_storage(flat_))
      return slide::core::failed_precondition("gradient of " + p->name +
                                              " was replaced after the gradient buckets were made");
  // Device gradients: the communicator runs on its own stream, after everything the backend
  // queued (backward up to here): ordered on the device behind a fence where the communicator can
  // (NCCL: an event its stream waits for, so the host goes on queueing backward), else by waiting
  // for the backend here.
  if (device_ != nullptr && !staged_) {
    SLIDE_ASSIGN_OR_RETURN(std::unique_ptr<DeviceFence> fence, device_->fence());
    bool ordered = false;
    if (fence) {
      SLIDE_ASSIGN_OR_RETURN(ordered, comm_->start_after(*fence));
    }
    if (!ordered) SLIDE_RETURN_IF_ERROR(device_->synchronize());
  }
  // The communicator's buffer: a host pointer, or a device one that only the communicator reads.
  float* flat = reduced().ptr<float>();
  SLIDE_ASSIGN_OR_RETURN(auto w, comm_->all_reduce_async(flat + bk.offset, bk.count, DType::kF32, ReduceOp::kSum,
                                                         "all-reduce of gradient bucket " + std::to_string(b + 1) +
                                                             " of " + std::to_string(buckets_.size()) + " (" +
                                                             std::to_string(bk.count) + " floats)"));
  work_.push_back(std::move(w));
  note(TimelineEvent::Kind::kBucketStart, static_cast<int64_t>(b));
  return slide::core::ok_status();
}

Status GradientBuckets::gradients_ready(const std::vector<Parameter*>& params) {
  if (comm_ == nullptr || staged_) return slide::core::ok_status();  // no step started, or no overlap
  const auto t0 = std::chrono::steady_clock::now();
  const Parameter* first_new = nullptr;
  for (const Parameter* p : params) {
    const auto it = index_.find(p);
    if (it == index_.end() || done_[it->second.second]) continue;  // not ours, or already counted
    done_[it->second.second] = true;
    --remaining_[it->second.first];
    if (first_new == nullptr) first_new = p;
  }
  if (first_new != nullptr) note(TimelineEvent::Kind::kLayerDone, -1, first_new->name);
  // In bucket order, so that every rank starts the same collectives in the same order.
  while (next_ < buckets_.size() && remaining_[next_] == 0) {
    SLIDE_RETURN_IF_ERROR(launch(next_));
    ++next_;
  }
  for (auto& w : work_) SLIDE_RETURN_IF_ERROR(w->progress());
  note_completed();
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return slide::core::ok_status();
}

Result<bool> GradientBuckets::finish_step() {
  if (comm_ == nullptr) return slide::core::failed_precondition("gradient buckets: finish_step without start_step");
  const auto t0 = std::chrono::steady_clock::now();
  // The step ends here, whatever happens below (an error leaves the gradients undefined).
  struct EndStep {
    GradientBuckets* g;
    ~EndStep() {
      g->comm_ = nullptr;
      g->work_.clear();
    }
  } end_step{this};
  note(TimelineEvent::Kind::kWaitStart, -1);
  if (staged_) {
    SLIDE_RETURN_IF_ERROR(device_->download(flat_, staging_));
    SLIDE_RETURN_IF_ERROR(write_stop_flag());
  }
  Status st;
  for (; next_ < buckets_.size() && st.ok(); ++next_) st = launch(next_);
  note_completed();
  for (size_t k = 0; k < work_.size() && st.ok(); ++k) {
    st = work_[k]->wait();
    if (st.ok()) note_done(k);  // if no progress call saw it complete before
  }
  SLIDE_RETURN_IF_ERROR(st);
  if (staged_) SLIDE_RETURN_IF_ERROR(device_->upload(staging_, flat_));
  SLIDE_ASSIGN_OR_RETURN(const float stop, read_stop_flag());
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  note(TimelineEvent::Kind::kStepEnd, -1);
  return stop > 0.5f;
}

Result<bool> GradientBuckets::all_reduce(Communicator& comm, bool stop_requested) {
  SLIDE_RETURN_IF_ERROR(start_step(comm, stop_requested));
  return finish_step();
}

Status all_reduce_tallies(Communicator& comm, double* loss_sum, int64_t* correct, std::vector<int64_t>* seen,
                          std::vector<int64_t>* right) {
  std::vector<double> v{*loss_sum, static_cast<double>(*correct)};
  for (int64_t x : *seen) v.push_back(static_cast<double>(x));
  for (int64_t x : *right) v.push_back(static_cast<double>(x));
  SLIDE_RETURN_IF_ERROR(comm.all_reduce(v.data(), static_cast<int64_t>(v.size()), DType::kF64, ReduceOp::kSum,
                                        "all-reduce of the epoch's training statistics"));
  *loss_sum = v[0];
  *correct = static_cast<int64_t>(v[1]);
  const size_t k = seen->size();
  for (size_t i = 0; i < k; ++i) (*seen)[i] = static_cast<int64_t>(v[2 + i]), (*right)[i] = static_cast<int64_t>(v[2 + k + i]);
  return slide::core::ok_status();
}

Status broadcast_tensors(Communicator& comm, const std::vector<Tensor*>& tensors, int root, const std::string& what,
                         size_t chunk_bytes, Backend* device) {
  if (comm.world_size() == 1) return slide::core::ok_status();
  // Device tensors: host copies (the root's downloaded) broadcast like host tensors, then uploaded.
  std::vector<Tensor> host_copies;
  std::vector<Tensor*> host(tensors.begin(), tensors.end());
  std::vector<size_t> on_device;
  for (size_t k = 0; k < tensors.size(); ++k) {
    if (tensors[k]->device() == Device::kCpu) continue;
    SLIDE_RETURN_IF_ERROR(check_transfer_backend(*tensors[k], device, what + ": tensor " + std::to_string(k)));
    on_device.push_back(k);
  }
  if (!on_device.empty()) {
    host_copies.reserve(on_device.size());
    for (size_t k : on_device) {
      if (comm.rank() == root) {
        SLIDE_ASSIGN_OR_RETURN(Tensor h, to_host(*device, *tensors[k], what + " (host copy)"));
        host_copies.push_back(std::move(h));
      } else {
        SLIDE_ASSIGN_OR_RETURN(Tensor h, Tensor::empty(tensors[k]->shape(), tensors[k]->dtype(), cpu_allocator(),
                                                       what + " (host copy)"));
        host_copies.push_back(std::move(h));
      }
      host[k] = &host_copies.back();
    }
    SLIDE_RETURN_IF_ERROR(broadcast_tensors(comm, host, root, what, chunk_bytes, nullptr));
    if (comm.rank() != root)
      for (size_t i = 0; i < on_device.size(); ++i)
        SLIDE_RETURN_IF_ERROR(device->upload(host_copies[i], *tensors[on_device[i]]));
    return slide::core::ok_status();
  }
  chunk_bytes = std::max<size_t>(chunk_bytes, 1);
  std::vector<char> buf;
  size_t i = 0;
  while (i < tensors.size()) {
    // Tensors [i, j) fit in one chunk (a larger tensor goes alone).
    size_t j = i, bytes = 0;
    while (j < tensors.size() && (j == i || bytes + tensors[j]->bytes() <= chunk_bytes)) bytes += tensors[j++]->bytes();
    buf.resize(bytes);
    size_t at = 0;
    if (comm.rank() == root)
      for (size_t k = i; k < j; ++k) std::memcpy(buf.data() + at, tensors[k]->raw(), tensors[k]->bytes()), at += tensors[k]->bytes();
    SLIDE_RETURN_IF_ERROR(comm.broadcast(buf.data(), bytes, root, what));
    at = 0;
    if (comm.rank() != root)
      for (size_t k = i; k < j; ++k) std::memcpy(tensors[k]->raw(), buf.data() + at, tensors[k]->bytes()), at += tensors[k]->bytes();
    i = j;
  }
  return slide::core::ok_status();
}

Status broadcast_string(Communicator& comm, std::string* text, int root, const std::string& what) {
  if (comm.world_size() == 1) return slide::core::ok_status();
  uint64_t n = text->size();
  SLIDE_RETURN_IF_ERROR(comm.broadcast(&n, sizeof n, root, what + " (length)"));
  text->resize(n);
  return comm.broadcast(text->data(), n, root, what);
}

Result<EpochStats> evaluate_data_parallel(Backend& be, Layer& model, const TileDataset& data,
                                          const std::vector<size_t>& positions, int64_t batch_size,
                                          slide::core::ThreadPool* pool, Communicator& comm,
                                          std::vector<float>* probs_out) {
  if (comm.world_size() == 1) return evaluate(be, model, data, positions, batch_size, pool, probs_out);
  const auto t0 = std::chrono::steady_clock::now();
  const ShardRange mine = shard_range(positions.size(), comm.rank(), comm.world_size());
  const std::vector<size_t> part(positions.begin() + static_cast<long>(mine.begin),
                                 positions.begin() + static_cast<long>(mine.end));
  EpochStats local;
  std::vector<float> part_probs;
  if (!part.empty()) {
    SLIDE_ASSIGN_OR_RETURN(local, evaluate(be, model, data, part, batch_size, pool, &part_probs));
  }
  const size_t classes = data.class_names().size();
  std::vector<float> probs(positions.size() * classes, 0.0f);
  std::copy(part_probs.begin(), part_probs.end(), probs.begin() + static_cast<long>(mine.begin * classes));
  SLIDE_RETURN_IF_ERROR(comm.all_reduce(probs.data(), static_cast<int64_t>(probs.size()), DType::kF32, ReduceOp::kSum,
                                        "all-gather of validation probabilities"));
  double loss_sum = local.loss * static_cast<double>(local.samples);
  SLIDE_RETURN_IF_ERROR(comm.all_reduce(&loss_sum, 1, DType::kF64, ReduceOp::kSum, "all-reduce of validation loss"));

  // The metrics of the whole set, as evaluate() computes them, from the gathered probabilities.
  EpochStats st;
  st.samples = static_cast<int64_t>(positions.size());
  st.steps = local.steps;
  std::vector<int32_t> labels(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) labels[i] = data.tiles()[positions[i]].label;
  // The counts per class from the confusion matrix: seen = its row sums, right = its diagonal.
  st.confusion = confusion_matrix(probs, labels, static_cast<int64_t>(classes));
  std::vector<int64_t> seen(classes, 0), right(classes, 0);
  int64_t correct = 0;
  for (size_t t = 0; t < classes; ++t) {
    for (size_t k = 0; k < classes; ++k) seen[t] += st.confusion[t * classes + k];
    right[t] = st.confusion[t * classes + t];
    correct += right[t];
  }
  const double n = static_cast<double>(st.samples);
  st.loss = st.samples ? loss_sum / n : 0;
  st.accuracy = st.samples ? static_cast<double>(correct) / n : 0;
  st.recall.assign(classes, -1.0);
  double sum = 0;
  int present = 0;
  for (size_t k = 0; k < classes; ++k) {
    if (seen[k] == 0) continue;
    st.recall[k] = static_cast<double>(right[k]) / static_cast<double>(seen[k]);
    sum += st.recall[k];
    ++present;
  }
  st.balanced_accuracy = present ? sum / present : 0.0;
  st.roc_auc = macro_roc_auc(probs, labels, static_cast<int64_t>(classes));
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (probs_out != nullptr) *probs_out = std::move(probs);
  return st;
}

}  // namespace slide::train
