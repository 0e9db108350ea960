// Data parallelism over a Communicator (DESIGN.md, "Distributed"): each rank holds a replica of
// the model and takes a slice of every global batch (trainer.h, TrainOptions::comm).
//
// - Gradients are summed over the ranks through one flat buffer per rank, in buckets: one
//   all-reduce per bucket per step (GradientBuckets). Each rank weights its micro-batches by their
//   share of the GLOBAL step's samples, so the sum is the single-rank gradient of the same B
//   samples.
// - Parameters, buffers and optimizer state are broadcast from rank 0 at the start and after a
//   resume (broadcast_tensors), so every replica starts from the same bits.
// - Validation is split over the ranks and its metrics reduced (evaluate_data_parallel).
#pragma once

#include <cstddef>
#include <cstdint>
#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "slide/train/communicator.h"
#include "slide/train/layers.h"
#include "slide/train/trainer.h"

namespace slide::train {


class GradientBuckets {
 public:
  // Lays out the gradients of `params` (f32, host memory) in one flat buffer from `alloc`: in
  // reverse order of `params` (the order backward produces them, the order in which an
  // all-reduce overlapped with backward would start them, as PyTorch DDP), cut into buckets of at
  // most `bucket_bytes` (a larger parameter is a bucket of its own). One more element, at the end
  // of the last bucket, carries the ranks' stop requests. Each Parameter::grad then becomes a
  // view of its slice of the buffer (its values kept; Tensor::view), so backward accumulates
  // straight into the buffer and its own gradient tensor is freed. Gradients on a device (alloc's
  // device) need `device`, their backend: all_reduce waits for its queued work, and stages the
  // buffer through host memory when the communicator's buffers live elsewhere (MPI with GPU
  // gradients; NCCL reduces device buffers in place). Errors: kInvalidArgument (a gradient that is
  // not f32 or not on alloc's device, device gradients without their backend, bucket_bytes < 4),
  // the allocator's (kResourceExhausted).
  [[nodiscard]] static Result<std::unique_ptr<GradientBuckets>> make(const std::vector<Parameter*>& params,
                                                                     Allocator& alloc,
                                                                     size_t bucket_bytes = kDefaultBucketBytes,
                                                                     Backend* device = nullptr);

  // Sums every parameter gradient over the ranks of `comm`, in place in the flat buffer: every
  // bucket's all-reduce is started, then each is waited for (no copies; with device gradients and
  // a host communicator, one download of the buffer before and one upload after). Errors also:
  // kFailedPrecondition when a gradient tensor was replaced since make() (no longer a view).
  // `stop_requested` is this rank's wish to stop after this step; the result says whether any
  // rank has it, so that every rank stops after the same step. Errors: the communicator's
  // (kDeadlineExceeded naming rank, step and bucket); the gradients are then undefined.
  [[nodiscard]] Result<bool> all_reduce(Communicator& comm, bool stop_requested);

  // The same, overlapped with the backward pass of the step's last micro-batch (PyTorch DDP):
  // start_step arms the buckets; gradients_ready(params), called after each layer's backward with
  // its parameters (Layer::set_backward_hook), counts them as done (others than the buckets' are
  // ignored, each counted once) and starts, in bucket
  // order (every rank starts the same collectives in the same order), each bucket whose
  // gradients are all done, then lets the ones in flight progress (CollectiveWork::progress);
  // finish_step starts the rest, waits for every bucket, and says whether any rank asked to stop.
  // all_reduce(comm, stop) is start_step then finish_step. With device gradients staged through
  // host memory (a host communicator) nothing starts before finish_step. Errors: as all_reduce;
  // kFailedPrecondition for start_step twice or finish_step without start_step.
  [[nodiscard]] Status start_step(Communicator& comm, bool stop_requested);
  [[nodiscard]] Status gradients_ready(const std::vector<Parameter*>& params);
  [[nodiscard]] Result<bool> finish_step();
  // Whether the current step has started a collective: its gradients can no longer be redone
  // (out-of-memory recovery must not rerun the step).
  bool started_any() const { return comm_ != nullptr && !work_.empty(); }
  // Disarms a step that started no collective (before a rerun of the step).
  void cancel_step() {
    if (work_.empty()) comm_ = nullptr;
  }

  // The step timeline, for measuring what the overlap hides (slide-train --dist-timeline,
  // bench/two_hosts_bench.sh). With record_timeline(true), each step records, in seconds since its
  // start_step (before the last micro-batch's forward): every gradients_ready call that completed
  // a gradient of the buckets (a layer's backward done; `name`: its first parameter), every
  // bucket's start, the first call that saw the bucket's collective complete
  // (CollectiveWork::completed, else the end of its wait in finish_step), finish_step's start
  // (backward done) and end. timeline() holds the last step's, from start_step to finish_step.
  using TimelineEvent = AllReduceEvent;  // trainer.h
  void record_timeline(bool on) { record_ = on; }
  const std::vector<TimelineEvent>& timeline() const { return timeline_; }
  static const char* timeline_kind_name(TimelineEvent::Kind k);

  size_t bucket_count() const { return buckets_.size(); }
  int64_t elements() const { return flat_.numel(); }  // gradient elements + 1 (the stop flag)
  // Wall time the trainer spent in these calls (starting, progressing and waiting for the
  // collectives), total: the communication that backward did not hide.
  double seconds() const { return seconds_; }

 private:
  struct Bucket {
    int64_t offset = 0, count = 0;     // elements of flat_
    std::vector<Parameter*> params;    // in flat_ order
  };
  Tensor flat_;
  Backend* device_ = nullptr;  // flat_'s backend when flat_ is not a host tensor
  Tensor staging_;             // host copy of flat_ for a host communicator (made on first use)
  std::vector<Bucket> buckets_;
  std::unordered_map<const Parameter*, std::pair<size_t, size_t>> index_;  // -> (bucket, ordinal)
  // The step in progress (between start_step and finish_step).
  [[nodiscard]] Status launch(size_t bucket);
  // The buffer the communicator reduces (flat_, or staging_ when staged_), and the stop flag in
  // its last element, written and read on whichever device it lives.
  Tensor& reduced();
  [[nodiscard]] Status write_stop_flag();
  [[nodiscard]] Result<float> read_stop_flag();
  Communicator* comm_ = nullptr;
  bool staged_ = false, stop_requested_ = false;
  std::vector<bool> done_;          // per parameter ordinal: its gradient is complete
  std::vector<int64_t> remaining_;  // per bucket: parameters not yet complete
  size_t next_ = 0;                 // the next bucket to start
  std::vector<std::unique_ptr<CollectiveWork>> work_;
  double seconds_ = 0;
  // The timeline (record_timeline): the step's start, its events, and per started bucket whether
  // its completion is recorded.
  void note(TimelineEvent::Kind kind, int64_t bucket, std::string name = {});
  void note_done(size_t bucket);  // its completion, once
  void note_completed();          // note_done for every bucket whose work says it has completed
  bool record_ = false;
  std::chrono::steady_clock::time_point step_t0_;
  std::vector<TimelineEvent> timeline_;
  std::vector<bool> noted_done_;
};

// An epoch's tallies summed over the ranks, in place: the loss sum (sum over samples of the
// loss), the correct count and the per-class seen / right counts (all ranks: the same class
// count). One all-reduce of doubles (counts stay exact below 2^53). Errors: the communicator's.
[[nodiscard]] Status all_reduce_tallies(Communicator& comm, double* loss_sum, int64_t* correct,
                                        std::vector<int64_t>* seen, std::vector<int64_t>* right);

// Copies the tensors of rank `root` to every rank: packed into one flat host buffer of at most
// `chunk_bytes` at a time, one broadcast per chunk. Every rank must pass tensors of the same
// shapes and dtypes in the same order. Tensors on a device go through host copies (downloaded on
// the root, uploaded on the others) through `device`, their backend. Errors: kInvalidArgument for a
// device tensor without its backend; the communicator's; the transfers'.
[[nodiscard]] Status broadcast_tensors(Communicator& comm, const std::vector<Tensor*>& tensors, int root,
                                       const std::string& what, size_t chunk_bytes = size_t{64} << 20,
                                       Backend* device = nullptr);

// Copies rank `root`'s string to every rank (its length first). Errors: the communicator's.
[[nodiscard]] Status broadcast_string(Communicator& comm, std::string* text, int root, const std::string& what);

// evaluate() over `positions` split by shard_range over the ranks of `comm`: each rank scores its
// contiguous part, then the loss sum is all-reduced and the probabilities of every tile are
// gathered (an all-reduce of a zero-filled positions.size() x classes buffer), so every rank
// returns the metrics of the whole set, equal to a single-rank evaluate() of `positions` up to
// float summation order. With `probs_out`, all probabilities, in the order of `positions`.
// Errors: those of evaluate() and of the communicator.
[[nodiscard]] Result<EpochStats> evaluate_data_parallel(Backend& be, Layer& model, const TileDataset& data,
                                                        const std::vector<size_t>& positions, int64_t batch_size,
                                                        slide::core::ThreadPool* pool, Communicator& comm,
                                                        std::vector<float>* probs_out = nullptr);

}  // namespace slide::train
