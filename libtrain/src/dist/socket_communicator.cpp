// The socket communicator: the ranks `slide-train --gpus N` starts on one machine (apps/launch.h),
// joined by the Unix-domain stream sockets the launcher made before it started them, without MPI.
// On host backends it is the ranks' communicator; on GPUs it is NCCL's bootstrap (the unique id
// travels over it, as it does over MPI under mpirun).
//
// The topology is a star through rank 0: rank 0 holds one socket to each other rank, every other
// rank one socket to rank 0. An all-reduce sends every rank's buffer to rank 0, which adds them in
// rank order (((x0 + x1) + x2) + ...: the order --accumulate sums micro-batches on one rank),
// scales a mean by 1/P as the MPI communicator does, and sends the one result back, so every rank
// holds the same bits. A broadcast from rank q goes q -> 0 -> the others; all_gather and barrier
// go through rank 0 the same way. Every message starts with a header (kind, sequence number,
// length): ranks that called different collectives get an error saying so instead of reading each
// other's bytes as data.
//
// Every socket is non-blocking and every read and write waits in poll(2) for at most what is left
// of the collective's deadline: a stopped peer gives kDeadlineExceeded naming this rank, the step
// and the collective; a dead peer (its socket closed: EOF, EPIPE, ECONNRESET) an error at once,
// naming the peer. Writes use MSG_NOSIGNAL, so a dead peer never raises SIGPIPE.
//
// Collectives complete before all_reduce_async returns (no overlap with backward on this
// transport: it is for CPU ranks on one machine and for bootstrapping NCCL, which overlaps).
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <vector>

#include "dist/communicators.h"

namespace slide::train::dist {

namespace {

using Clock = std::chrono::steady_clock;

enum class Kind : uint32_t { kAllReduce = 1, kBroadcast = 2, kBarrier = 3, kAllGather = 4 };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllReduce: return "an all-reduce";
    case Kind::kBroadcast: return "a broadcast";
    case Kind::kBarrier: return "a barrier";
    case Kind::kAllGather: return "an all-gather";
  }
  return "an unknown collective";
}

constexpr uint32_t kMagic = 0x534c4443;  // "SLDC"

struct Header {
  uint32_t magic = kMagic;
  uint32_t kind = 0;
  uint64_t sequence = 0;  // the collective's number on this communicator, from 1
  uint64_t bytes = 0;     // the payload that follows
};
static_assert(sizeof(Header) == 24);

class SocketCommunicator final : public Communicator {
 public:
  SocketCommunicator(int rank, int world, std::vector<int> fds, double timeout_s)
      : Communicator(timeout_s), rank_(rank), world_(world), fds_(std::move(fds)) {}

  ~SocketCommunicator() override {
    for (int fd : fds_) ::close(fd);
  }

  std::string name() const override { return "socket"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int local_rank() const override { return rank_; }  // one machine: the rank is the node-local rank
  Device device() const override { return Device::kCpu; }

  Status all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    if (count < 0) return slide::core::invalid_argument(what + ": negative count");
    if (dtype != DType::kF32 && dtype != DType::kF64 && dtype != DType::kI32)
      return slide::core::invalid_argument(what + ": all-reduce of " + dtype_name(dtype));
    if (dtype == DType::kI32 && op == ReduceOp::kAverage)
      return slide::core::invalid_argument(what + ": average of i32 values");
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
    const Op o = begin(Kind::kAllReduce, what);
    if (rank_ != 0) {
      SLIDE_RETURN_IF_ERROR(send(o, 0, data, bytes));
      return recv(o, 0, data, bytes);
    }
    scratch_.resize(bytes);
    for (int r = 1; r < world_; ++r) {
      SLIDE_RETURN_IF_ERROR(recv(o, r, scratch_.data(), bytes));
      add_into(data, scratch_.data(), count, dtype);
    }
    if (op == ReduceOp::kAverage) scale_to_mean(data, count, dtype, world_);
    for (int r = 1; r < world_; ++r) SLIDE_RETURN_IF_ERROR(send(o, r, data, bytes));
    return slide::core::ok_status();
  }

  Result<std::unique_ptr<CollectiveWork>> all_reduce_async(void* data, int64_t count, DType dtype, ReduceOp op,
                                                           const std::string& what) override {
    return dist::all_reduce_now(*this, data, count, dtype, op, what);
  }

  Status broadcast(void* data, size_t bytes, int root, const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    if (root < 0 || root >= world_)
      return slide::core::invalid_argument(what + ": broadcast from rank " + std::to_string(root) + " of " +
                                           std::to_string(world_));
    const Op o = begin(Kind::kBroadcast, what);
    if (rank_ != 0) {
      if (rank_ == root) return send(o, 0, data, bytes);
      return recv(o, 0, data, bytes);
    }
    if (root != 0) SLIDE_RETURN_IF_ERROR(recv(o, root, data, bytes));
    for (int r = 1; r < world_; ++r)
      if (r != root) SLIDE_RETURN_IF_ERROR(send(o, r, data, bytes));
    return slide::core::ok_status();
  }

  Status barrier(const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    const Op o = begin(Kind::kBarrier, what);
    if (rank_ != 0) {
      SLIDE_RETURN_IF_ERROR(send(o, 0, nullptr, 0));
      return recv(o, 0, nullptr, 0);
    }
    for (int r = 1; r < world_; ++r) SLIDE_RETURN_IF_ERROR(recv(o, r, nullptr, 0));
    for (int r = 1; r < world_; ++r) SLIDE_RETURN_IF_ERROR(send(o, r, nullptr, 0));
    return slide::core::ok_status();
  }

  Status all_gather(double value, std::vector<double>* out, const std::string& what) override {
    SLIDE_RETURN_IF_ERROR(usable(what));
    std::vector<double> all(static_cast<size_t>(world_));
    const size_t bytes = all.size() * sizeof(double);
    const Op o = begin(Kind::kAllGather, what);
    if (rank_ != 0) {
      SLIDE_RETURN_IF_ERROR(send(o, 0, &value, sizeof value));
      SLIDE_RETURN_IF_ERROR(recv(o, 0, all.data(), bytes));
    } else {
      all[0] = value;
      for (int r = 1; r < world_; ++r) SLIDE_RETURN_IF_ERROR(recv(o, r, &all[static_cast<size_t>(r)], sizeof(double)));
      for (int r = 1; r < world_; ++r) SLIDE_RETURN_IF_ERROR(send(o, r, all.data(), bytes));
    }
    *out = std::move(all);
    return slide::core::ok_status();
  }

  // A socket the peer closed polls as hung up, or readable with nothing to read (EOF). Between
  // collectives nothing is in flight, so data waiting there is not a loss (and is left in place).
  int lost_peer() override {
    for (size_t i = 0; i < fds_.size(); ++i) {
      pollfd p{fds_[i], static_cast<short>(POLLIN | POLLRDHUP), 0};
      if (::poll(&p, 1, 0) <= 0) continue;
      const int peer = rank_ == 0 ? static_cast<int>(i) + 1 : 0;
      if ((p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0) return peer;
      char c = 0;
      if ((p.revents & POLLIN) != 0) {
        const ssize_t n = ::recv(fds_[i], &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno == ECONNRESET)) return peer;
      }
    }
    return -1;
  }

  // The peers' next read or write on this rank's sockets ends at once (EOF); the app then exits
  // with `exit_code` and the launcher stops whoever is left (apps/launch.cpp).
  void abort_job(int) override {
    broken_ = true;
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
  }

 private:
  struct Op {
    Kind kind;
    uint64_t sequence;
    const std::string* what;
    Clock::time_point deadline;
  };

  Op begin(Kind kind, const std::string& what) {
    const auto timeout = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s()));
    return {kind, ++sequence_, &what, Clock::now() + timeout};
  }

  Status usable(const std::string& what) const { return broken_ ? broken_error(what) : slide::core::ok_status(); }

  int fd_of(int peer) const { return rank_ == 0 ? fds_[static_cast<size_t>(peer - 1)] : fds_[0]; }

  Status peer_gone(const Op& o, int peer, const std::string& how) {
    broken_ = true;
    return slide::core::unavailable(describe(*o.what) + ": rank " + std::to_string(peer) + " " + how +
                                    " (it has exited or was killed)");
  }

  // Waits until `fd` is ready for `events` or the deadline passes.
  Status wait_ready(const Op& o, int peer, short events) {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(o.deadline - Clock::now()).count();
      if (left <= 0) {
        broken_ = true;
        return Status(slide::core::StatusCode::kDeadlineExceeded, deadline_message(*o.what, peer));
      }
      pollfd p{fd_of(peer), events, 0};
      const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
      if (n < 0 && errno == EINTR) continue;  // a signal (Ctrl-C sets a flag): keep waiting
      if (n < 0) {
        broken_ = true;
        return slide::core::errno_status(errno, describe(*o.what) + ": poll");
      }
      if (n > 0) return slide::core::ok_status();  // readable, writable, or an error the I/O call reports
    }
  }

  Status write_all(const Op& o, int peer, const void* data, size_t bytes) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      SLIDE_RETURN_IF_ERROR(wait_ready(o, peer, POLLOUT));
      const ssize_t n = ::send(fd_of(peer), p, bytes, MSG_NOSIGNAL);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return peer_gone(o, peer, "closed its connection");
      if (n < 0) {
        broken_ = true;
        return slide::core::errno_status(errno, describe(*o.what) + ": send to rank " + std::to_string(peer));
      }
      p += n, bytes -= static_cast<size_t>(n);
    }
    return slide::core::ok_status();
  }

  Status read_all(const Op& o, int peer, void* data, size_t bytes) {
    char* p = static_cast<char*>(data);
    while (bytes > 0) {
      SLIDE_RETURN_IF_ERROR(wait_ready(o, peer, POLLIN));
      const ssize_t n = ::recv(fd_of(peer), p, bytes, 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return peer_gone(o, peer, "closed its connection");
      if (n < 0) {
        broken_ = true;
        return slide::core::errno_status(errno, describe(*o.what) + ": receive from rank " + std::to_string(peer));
      }
      p += n, bytes -= static_cast<size_t>(n);
    }
    return slide::core::ok_status();
  }

  Status send(const Op& o, int peer, const void* data, size_t bytes) {
    Header h;
    h.kind = static_cast<uint32_t>(o.kind), h.sequence = o.sequence, h.bytes = bytes;
    SLIDE_RETURN_IF_ERROR(write_all(o, peer, &h, sizeof h));
    return write_all(o, peer, data, bytes);
  }

  // Receives the header and checks that the peer is in the same collective, then the payload.
  Status recv(const Op& o, int peer, void* data, size_t bytes) {
    Header h;
    SLIDE_RETURN_IF_ERROR(read_all(o, peer, &h, sizeof h));
    if (h.magic != kMagic || h.kind != static_cast<uint32_t>(o.kind) || h.sequence != o.sequence || h.bytes != bytes) {
      broken_ = true;
      const std::string theirs = h.magic != kMagic ? std::string("bytes that are not a slidestream message")
                                                   : std::string(kind_name(static_cast<Kind>(h.kind))) + " of " +
                                                         std::to_string(h.bytes) + " bytes (collective #" +
                                                         std::to_string(h.sequence) + ")";
      return slide::core::internal_error(describe(*o.what) + ": rank " + std::to_string(peer) + " sent " + theirs +
                                         " where " + kind_name(o.kind) + " of " + std::to_string(bytes) +
                                         " bytes (collective #" + std::to_string(o.sequence) +
                                         ") was expected: the ranks called different collectives");
    }
    return read_all(o, peer, data, bytes);
  }

  int rank_, world_;
  std::vector<int> fds_;  // rank 0: to ranks 1 .. P-1 in order; others: to rank 0
  std::vector<char> scratch_;
  uint64_t sequence_ = 0;
  bool broken_ = false;
};

}  // namespace

}  // namespace slide::train::dist

namespace slide::train {

Result<std::unique_ptr<Communicator>> make_socket_communicator(int rank, int world_size, std::vector<int> fds,
                                                               double timeout_s) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    return slide::core::invalid_argument("rank " + std::to_string(rank) + " of " + std::to_string(world_size));
  const size_t want = rank == 0 ? static_cast<size_t>(world_size - 1) : 1;
  if (fds.size() != want)
    return slide::core::invalid_argument("rank " + std::to_string(rank) + " of " + std::to_string(world_size) +
                                         " needs " + std::to_string(want) + " socket(s), not " +
                                         std::to_string(fds.size()));
  for (int fd : fds) {
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
      return slide::core::errno_status(errno, "socket " + std::to_string(fd) + " of rank " + std::to_string(rank));
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);  // not passed on to what this rank starts (a sweep's trials)
  }
  return std::unique_ptr<Communicator>(std::make_unique<dist::SocketCommunicator>(rank, world_size, std::move(fds), timeout_s));
}

}  // namespace slide::train
