#include "slide/train/copy_engine.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace slide::train {

namespace {

using slide::core::invalid_argument;

}  // namespace

Status validate_copy(const Backend& be, const Tensor& src, const Tensor& dst, CopyDirection dir) {
  const Device from = dir == CopyDirection::kToHost ? be.device() : Device::kCpu;
  const Device to = dir == CopyDirection::kToHost ? Device::kCpu : be.device();
  if (!src.defined() || !dst.defined() || src.bytes() != dst.bytes())
    return invalid_argument("copy engine: source and destination differ in size (" + std::to_string(src.bytes()) +
                            " and " + std::to_string(dst.bytes()) + " bytes)");
  if (src.device() != from || dst.device() != to)
    return invalid_argument(std::string("copy engine: a copy ") +
                            (dir == CopyDirection::kToHost ? "to the host" : "to the device") + " from " +
                            device_name(src.device()) + " to " + device_name(dst.device()));
  return slide::core::ok_status();
}

namespace {

// The host-thread engine: jobs run in order on one thread.
class ThreadCopyEngine final : public CopyEngine {
 public:
  explicit ThreadCopyEngine(std::chrono::microseconds delay) : delay_(delay), worker_([this] { run(); }) {}
  ~ThreadCopyEngine() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  Result<uint64_t> start(Backend& be, const Tensor& src, Tensor& dst, CopyDirection dir) override {
    SLIDE_RETURN_IF_ERROR(validate_copy(be, src, dst, dir));
    if (be.device() == Device::kCuda)
      return invalid_argument("copy engine: the host-thread engine copies host memory; a cuda device has its own");
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t ticket = ++last_;
    jobs_.push_back({ticket, dst.raw(), src.raw(), src.bytes()});
    cv_.notify_all();
    return ticket;
  }

  Status wait(uint64_t ticket) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (ticket == 0 || ticket > last_) return invalid_argument("copy engine: no copy " + std::to_string(ticket));
    cv_.wait(lock, [&] { return done_ >= ticket; });
    return slide::core::ok_status();
  }

  bool asynchronous() const override { return true; }

 private:
  struct Job {
    uint64_t ticket;
    void* dst;
    const void* src;
    size_t bytes;
  };
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      const Job job = jobs_.front();
      jobs_.pop_front();
      lock.unlock();
      if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
      if (job.bytes > 0) std::memcpy(job.dst, job.src, job.bytes);
      lock.lock();
      done_ = job.ticket;  // in order: every earlier ticket is done too
      cv_.notify_all();
    }
  }

  const std::chrono::microseconds delay_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  uint64_t last_ = 0, done_ = 0;
  bool stop_ = false;
  std::thread worker_;  // last: started after the members it uses
};

}  // namespace

Result<uint64_t> SyncCopyEngine::start(Backend& be, const Tensor& src, Tensor& dst, CopyDirection dir) {
  SLIDE_RETURN_IF_ERROR(validate_copy(be, src, dst, dir));
  // (Backend::upload / download also want equal shapes and dtypes.)
  SLIDE_RETURN_IF_ERROR(dir == CopyDirection::kToHost ? be.download(src, dst) : be.upload(src, dst));
  return uint64_t{0};
}

Status SyncCopyEngine::wait(uint64_t) { return slide::core::ok_status(); }

std::unique_ptr<CopyEngine> make_thread_copy_engine(std::chrono::microseconds delay) {
  return std::make_unique<ThreadCopyEngine>(delay);
}

}  // namespace slide::train
