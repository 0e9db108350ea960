#include "launch.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "exit_codes.h"
#include "interrupt.h"
#include "slide/core/log.h"
#include "slide/train/communicator.h"

extern char** environ;

namespace slide::apps {

namespace {


std::string signal_text(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// A rank's exit code as a shell reports it: its own, or 128 + the signal that killed it.
int exit_code_of(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

struct Child {
  pid_t pid = -1;
  bool running = false;
  int status = 0;  // waitpid's, once it has ended
};

}  // namespace

std::vector<std::string> args_without_gpus(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--gpus") {
      ++i;  // and its value
      continue;
    }
    if (a.rfind("--gpus=", 0) == 0) continue;
    out.push_back(a);
  }
  return out;
}

int run_launcher(const LaunchOptions& o) {
  const int n = o.ranks;
  // The wiring: pair r-1 joins rank 0 (end [0]) and rank r (end [1]). Close-on-exec everywhere;
  // each child clears the flag on its own ends after fork.
  std::vector<int> ends0, ends1;
  for (int r = 1; r < n; ++r) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      slide::core::log_error(std::string("slide-train --gpus: socketpair: ") + std::strerror(errno));
      return kExitFailed;
    }
    ends0.push_back(sv[0]), ends1.push_back(sv[1]);
  }
  // Everything a child needs, prepared before fork (the child only calls async-signal-safe
  // functions between fork and exec).
  std::vector<std::vector<std::string>> envs(static_cast<size_t>(n));
  std::vector<std::vector<int>> keep(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    std::vector<std::string>& env = envs[static_cast<size_t>(r)];
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      const std::string key = kv.substr(0, kv.find('='));
      if (key.rfind("SLIDE_LAUNCH_", 0) == 0) continue;
      env.push_back(kv);
    }
    keep[static_cast<size_t>(r)] = r == 0 ? ends0 : std::vector<int>{ends1[static_cast<size_t>(r - 1)]};
    std::string fds;
    for (int fd : keep[static_cast<size_t>(r)]) fds += (fds.empty() ? "" : ",") + std::to_string(fd);
    env.push_back(std::string(slide::train::kLaunchRankEnv) + "=" + std::to_string(r));
    env.push_back(std::string(slide::train::kLaunchLocalRankEnv) + "=" + std::to_string(r));
    env.push_back(std::string(slide::train::kLaunchWorldSizeEnv) + "=" + std::to_string(n));
    env.push_back(std::string(slide::train::kLaunchFdsEnv) + "=" + fds);
    if (o.threads_per_rank > 0 && std::getenv("OMP_NUM_THREADS") == nullptr)
      env.push_back("OMP_NUM_THREADS=" + std::to_string(o.threads_per_rank));
  }
  std::vector<std::string> args{o.exe};
  args.insert(args.end(), o.args.begin(), o.args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  // Signals are counted, not acted on, from here: the loop below passes them on.
  count_interrupts_only();

  const pid_t launcher = ::getpid();
  std::vector<Child> children(static_cast<size_t>(n));
  int started = 0;
  for (int r = 0; r < n; ++r) {
    std::vector<char*> envp;
    for (auto& e : envs[static_cast<size_t>(r)]) envp.push_back(e.data());
    envp.push_back(nullptr);
    const std::vector<int>& mine = keep[static_cast<size_t>(r)];
    const pid_t pid = ::fork();
    if (pid == 0) {
      // The rank: supervised (interrupt.h), its sockets kept open across exec.
      prepare_supervised_child(launcher);
      for (int fd : mine) ::fcntl(fd, F_SETFD, 0);
      ::execve(o.exe.c_str(), argv.data(), envp.data());
      const char msg[] = "slide-train --gpus: cannot start a rank (execve failed)\n";
      (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
      ::_exit(127);
    }
    if (pid < 0) {
      slide::core::log_error(std::string("slide-train --gpus: fork: ") + std::strerror(errno));
      break;
    }
    ::setpgid(pid, pid);  // also here: no race with a signal passed on before the child ran setpgid
    children[static_cast<size_t>(r)] = {pid, true, 0};
    ++started;
    slide::core::log_info("rank started", {{"rank", static_cast<int64_t>(r)}, {"pid", static_cast<int64_t>(pid)},
                                           {"world_size", static_cast<int64_t>(n)}});
  }
  // The launcher keeps no socket: a rank's peers see its end close when it exits.
  for (int fd : ends0) ::close(fd);
  for (int fd : ends1) ::close(fd);

  using Clock = std::chrono::steady_clock;
  int forwarded = 0;  // signals passed on so far
  struct Failure {
    int rank;
    int status;
    Clock::time_point when;
  };
  std::vector<Failure> failures;  // ranks that ended badly while no stop had been asked for by a signal
  Clock::time_point kill_at = Clock::time_point::max();
  const auto stop_others = [&](int sig) {
    for (const Child& c : children)
      if (c.running) ::kill(c.pid, sig);
  };
  const auto stop_timeout = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.stop_timeout_s));
  if (started < n) {  // a rank could not be started: stop those that were
    stop_others(SIGTERM);
    kill_at = Clock::now() + stop_timeout;
  }
  for (int left = started; left > 0;) {
    while (forwarded < signal_count()) {
      ++forwarded;
      stop_others(last_signal());
    }
    if (Clock::now() >= kill_at) {
      slide::core::log_error("slide-train --gpus: ranks still running " + std::to_string(o.stop_timeout_s) +
                             " s after the first failure: killing them");
      stop_others(SIGKILL);
      kill_at = Clock::time_point::max();
    }
    // Every rank that has ended by now, taken together: a rank killed by a signal makes its peers
    // exit with an error within milliseconds (their sockets close), and the polls are 20 ms apart,
    // so the killed rank and its peers are often reaped in the same poll; waitpid returns them
    // oldest child first, i.e. rank 0 first. The signalled ones are taken first, so that the first
    // failure logged (the one "stopping the other ranks") is the cause, not its echo.
    std::vector<std::pair<pid_t, int>> ended;
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid > 0) {
        ended.emplace_back(pid, status);
        continue;
      }
      if (pid < 0 && errno != EINTR && errno != ECHILD) {
        slide::core::log_error(std::string("slide-train --gpus: waitpid: ") + std::strerror(errno));
        stop_others(SIGKILL);
        return kExitFailed;
      }
      break;
    }
    if (ended.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    std::stable_partition(ended.begin(), ended.end(), [](const auto& e) { return WIFSIGNALED(e.second); });
    for (const auto& [pid, status] : ended) {
      for (size_t r = 0; r < children.size(); ++r) {
        Child& c = children[r];
        if (c.pid != pid || !c.running) continue;
        c.running = false, c.status = status;
        --left;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (ok || forwarded > 0) break;
        slide::core::log_error("slide-train --gpus: rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                               ") " +
                               (WIFSIGNALED(status) ? "was killed by " + signal_text(WTERMSIG(status))
                                                    : "exited with code " + std::to_string(WEXITSTATUS(status))) +
                               (failures.empty() ? "; stopping the other ranks" : ""));
        failures.push_back({static_cast<int>(r), status, Clock::now()});
        if (failures.size() == 1) {
          stop_others(SIGTERM);
          kill_at = Clock::now() + stop_timeout;
        }
        break;
      }
    }
  }
  if (started < n) return kExitFailed;
  if (!failures.empty()) {
    // The rank to blame: a rank's failure makes its peers fail too (their sockets close), a few
    // milliseconds later. Of the failures within a second of the first, a rank killed by a signal
    // is the cause (its peers exit with an error); else the first that ended.
    const Failure* blamed = &failures.front();
    for (const Failure& f : failures)
      if (f.when - failures.front().when <= std::chrono::seconds(1) && WIFSIGNALED(f.status) &&
          !WIFSIGNALED(blamed->status))
        blamed = &f;
    const int code = exit_code_of(blamed->status);
    slide::core::log_error("slide-train --gpus: rank " + std::to_string(blamed->rank) + " failed (" +
                           (WIFSIGNALED(blamed->status) ? "killed by " + signal_text(WTERMSIG(blamed->status))
                                                        : "exit code " + std::to_string(code)) +
                           "); the other ranks were stopped");
    return code;
  }
  // No rank failed on its own: the worst exit code of them (0 when all are 0; 130 after Ctrl-C).
  int code = 0;
  for (const Child& c : children) {
    const int k = exit_code_of(c.status);
    if (k != 0 && (code == 0 || code == kExitInterrupted)) code = k;
  }
  return code;
}

}  // namespace slide::apps
