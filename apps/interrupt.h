// Ctrl-C and SIGTERM for the command-line tools (only apps/ touch signals): the first signal sets
// the tool's cancel flag, which its library checks at safe points (a transaction, a step, a bag),
// and prints what the tool will do; a second one exits 130 at once. Either way nothing complete
// is lost: outputs are committed atomically (LMDB transactions, files renamed into place).
#pragma once

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace slide::apps {

constexpr int kExitInterruptedCode = 130;

namespace detail {
inline std::atomic<bool> g_interrupted{false};
inline const char* g_interrupt_message = "";

// Async-signal-safe: an atomic exchange, write(2) and _exit(2) only.
inline void on_interrupt(int) {
  if (g_interrupted.exchange(true)) _exit(kExitInterruptedCode);
  (void)!::write(STDERR_FILENO, g_interrupt_message, std::strlen(g_interrupt_message));
}
}  // namespace detail

// The flag the first signal sets (the libraries' `cancel`).
inline std::atomic<bool>& interrupt_flag() { return detail::g_interrupted; }

// Installs the handlers for SIGINT and SIGTERM; `message` (a string literal, printed as is on the
// first signal) says what happens next.
inline void install_interrupt_handlers(const char* message) {
  detail::g_interrupt_message = message;
  struct sigaction sa {};
  sa.sa_handler = detail::on_interrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

}  // namespace slide::apps
