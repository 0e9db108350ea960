// Ctrl-C, SIGTERM and SIGHUP for the command-line tools (only apps/ touch signals): the first
// signal sets the tool's cancel flag, which its library checks at safe points (a transaction, a
// step, a bag), and prints what the tool will do; a second SIGINT or SIGTERM exits 130 at once. Either way nothing complete
// is lost: outputs are committed atomically (LMDB transactions, files renamed into place).
//
// The signals are taken by one thread of their own (sigwait), never by a thread at work: the
// calling thread blocks them before it starts any other, and every thread started later inherits
// that mask. A signal handler interrupting a worker was a source of heap corruption: with
// handlers, a Ctrl-C in the middle of slide-train --features (bags read ahead on other threads,
// oneDNN's JIT kernels on the main one) crashed about 1 run in 15 with "corrupted size vs.
// prev_size" or "free(): invalid pointer" (stop 30, tests/e2e/test_slide_train_mil.py TestResume);
// with the signal thread, 0 of 150. The handler stays installed, with SA_RESTART, for a thread
// that has the signals unblocked (one a library started before install_interrupt_handlers).
#pragma once

#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "exit_codes.h"

namespace slide::apps {


namespace detail {
// Whether SIGHUP is taken: not when the process started with it ignored (nohup), which it keeps.
inline std::atomic<bool> g_take_sighup{true};
}  // namespace detail

// The signals this file takes: SIGINT, SIGTERM, and SIGHUP (a closed terminal, or a supervisor's
// death: the sweep's trials and the --gpus launcher's ranks get it through PR_SET_PDEATHSIG)
// unless the process started with SIGHUP ignored.
inline sigset_t interrupt_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  if (detail::g_take_sighup.load()) sigaddset(&set, SIGHUP);
  return set;
}

namespace detail {
inline std::atomic<bool> g_interrupted{false};
inline std::atomic<const char*> g_interrupt_message{""};
inline std::atomic<int> g_signal_count{0};
inline std::atomic<int> g_last_signal{SIGINT};
inline std::atomic<bool> g_count_only{false};
static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<int>::is_always_lock_free &&
              std::atomic<const char*>::is_always_lock_free);

// Async-signal-safe (lock-free atomics, write(2) and _exit(2) only): it also runs as a handler.
inline void on_interrupt(int sig) {
  g_last_signal.store(sig);
  g_signal_count.fetch_add(1);
  if (g_count_only.load()) return;
  // SIGHUP never stops at once: a supervisor's death can deliver its PR_SET_PDEATHSIG twice (the
  // child is reparented to another of the dying process's threads first, then to init, and each
  // reparenting sends it), and that must not cut the checkpoint short.
  if (g_interrupted.exchange(true)) {
    if (sig != SIGHUP) _exit(kExitInterrupted);
    return;
  }
  const char* message = g_interrupt_message.load();
  (void)!::write(STDERR_FILENO, message, std::strlen(message));
}

[[noreturn]] inline void signal_thread() {
  const sigset_t set = interrupt_signals();
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) == 0) on_interrupt(sig);
  }
}
}  // namespace detail

// The flag the first signal sets (the libraries' `cancel`).
inline std::atomic<bool>& interrupt_flag() { return detail::g_interrupted; }

// Takes SIGINT, SIGTERM and SIGHUP as described above; `message` (a string literal, printed as is on the
// first signal) says what happens next. Call it from the main thread before it starts any other
// (a later call only changes the message).
inline void install_interrupt_handlers(const char* message) {
  detail::g_interrupt_message.store(message);
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction old {};
    if (sigaction(SIGHUP, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) detail::g_take_sighup.store(false);
    struct sigaction sa {};
    sa.sa_handler = detail::on_interrupt;
    sa.sa_flags = SA_RESTART;
    sigfillset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    if (detail::g_take_sighup.load()) sigaction(SIGHUP, &sa, nullptr);
    const sigset_t set = interrupt_signals();
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    std::thread(detail::signal_thread).detach();
  });
}

// For a process that passes signals on (the --gpus launcher): from now on a signal is only
// counted (no flag, no message, no exit); signal_count() and last_signal() say what came.
inline void count_interrupts_only() {
  detail::g_count_only.store(true);
  install_interrupt_handlers("");
}
inline int signal_count() { return detail::g_signal_count.load(); }
inline int last_signal() { return detail::g_last_signal.load(); }

// For a child between fork and exec (async-signal-safe): default dispositions and the signals
// unblocked, so that the program it runs starts as a shell would start it.
inline void reset_interrupt_signals_in_child() {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGINT, &dfl, nullptr);
  ::sigaction(SIGTERM, &dfl, nullptr);
  ::sigaction(SIGHUP, &dfl, nullptr);
  sigset_t set = interrupt_signals();
  sigaddset(&set, SIGHUP);
  ::sigprocmask(SIG_UNBLOCK, &set, nullptr);
}

// For a supervised child (a --gpus rank, a sweep trial) between fork and exec, async-signal-safe:
// its own process group (a terminal's Ctrl-C reaches only the supervisor, which passes it on once;
// two would stop the child before its checkpoint), SIGHUP when the supervisor dies (Linux
// PR_SET_PDEATHSIG; SIGHUP because the kernel may send it twice, and a second SIGHUP does not
// cut the checkpoint short), and reset_interrupt_signals_in_child. Exits kExitFailed when the
// supervisor (`supervisor`, its pid taken before fork) died before the prctl.
inline void prepare_supervised_child(pid_t supervisor) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGHUP);
  if (::getppid() != supervisor) ::_exit(kExitFailed);
  reset_interrupt_signals_in_child();
}

}  // namespace slide::apps
