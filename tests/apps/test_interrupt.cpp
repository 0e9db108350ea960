// apps/interrupt.h: SIGINT and SIGTERM go to the signal thread, never to a thread at work. Each
// case runs in a forked child, so this process's own signal mask and handlers stay as they were.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "interrupt.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace apps_test_interrupt {

namespace {

using slide::apps::interrupt_flag;

// Runs `body` in a child whose stderr goes to a pipe; returns {wait status, what it wrote}.
template <typename Body>
std::pair<int, std::string> in_child(Body body) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    ::_exit(body());
  }
  ::close(fds[1]);
  std::string text;
  char buf[256];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) text.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return {status, text};
}

bool wait_for(const auto& condition) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

bool blocked_here(int sig) {
  sigset_t now;
  pthread_sigmask(SIG_BLOCK, nullptr, &now);
  return sigismember(&now, sig) == 1;
}

}  // namespace

TEST_CASE("interrupt: the first signal sets the flag and prints once, a second exits 130; workers never take them") {
  const auto [status, text] = in_child([] {
    slide::apps::install_interrupt_handlers("first\n");
    bool worker_blocks = false;
    std::thread([&] { worker_blocks = blocked_here(SIGINT) && blocked_here(SIGTERM); }).join();
    if (!worker_blocks || !blocked_here(SIGINT)) return 10;
    if (interrupt_flag().load()) return 11;
    ::kill(::getpid(), SIGINT);
    if (!wait_for([] { return interrupt_flag().load(); })) return 12;
    ::kill(::getpid(), SIGTERM);  // the second: _exit(130) from the signal thread
    std::this_thread::sleep_for(std::chrono::seconds(10));
    return 13;
  });
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == slide::apps::kExitInterrupted);
  CHECK(text == "first\n");
}

TEST_CASE("interrupt: count_interrupts_only counts signals and neither stops nor prints") {
  const auto [status, text] = in_child([] {
    slide::apps::install_interrupt_handlers("should not print\n");
    slide::apps::count_interrupts_only();
    for (int i = 0; i < 3; ++i) {
      ::kill(::getpid(), i == 2 ? SIGTERM : SIGINT);
      if (!wait_for([i] { return slide::apps::signal_count() == i + 1; })) return 20 + i;
    }
    if (slide::apps::last_signal() != SIGTERM) return 30;
    return interrupt_flag().load() ? 31 : 0;
  });
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(text.empty());
}

TEST_CASE("interrupt: a child started after reset_interrupt_signals_in_child has the default handling") {
  const auto [status, text] = in_child([] {
    slide::apps::install_interrupt_handlers("parent\n");
    const pid_t pid = ::fork();
    if (pid == 0) {
      slide::apps::reset_interrupt_signals_in_child();
      if (blocked_here(SIGINT) || blocked_here(SIGTERM)) ::_exit(40);
      ::raise(SIGTERM);  // default action: the child ends by the signal
      ::_exit(41);
    }
    int st = 0;
    if (::waitpid(pid, &st, 0) != pid) return 42;
    return WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM ? 0 : WIFEXITED(st) ? WEXITSTATUS(st) : 43;
  });
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(text.empty());
}

TEST_CASE("interrupt: SIGHUP interrupts like SIGINT, but a second SIGHUP never exits at once") {
  // A supervisor's death can deliver its PR_SET_PDEATHSIG (SIGHUP) twice: the run must still reach
  // its checkpoint. A SIGINT after it does exit at once.
  const auto [status, text] = in_child([] {
    slide::apps::install_interrupt_handlers("hup\n");
    if (!blocked_here(SIGHUP)) return 50;
    ::kill(::getpid(), SIGHUP);
    if (!wait_for([] { return interrupt_flag().load(); })) return 51;
    ::kill(::getpid(), SIGHUP);
    if (!wait_for([] { return slide::apps::signal_count() == 2; })) return 52;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // still here
    ::kill(::getpid(), SIGINT);
    std::this_thread::sleep_for(std::chrono::seconds(10));
    return 53;
  });
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == slide::apps::kExitInterrupted);
  CHECK(text == "hup\n");
}

TEST_CASE("interrupt: a process started with SIGHUP ignored (nohup) keeps ignoring it") {
  const auto [status, text] = in_child([] {
    ::signal(SIGHUP, SIG_IGN);
    slide::apps::install_interrupt_handlers("should not print\n");
    if (blocked_here(SIGHUP)) return 60;
    ::kill(::getpid(), SIGHUP);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    return interrupt_flag().load() || slide::apps::signal_count() != 0 ? 61 : 0;
  });
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(text.empty());
}

}  // namespace apps_test_interrupt
