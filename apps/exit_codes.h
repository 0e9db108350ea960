// The command-line tools' exit codes (each tool's header comment says which it uses): 0 ok,
// 1 failed, 2 usage or bad input before any work started, 3 some inputs failed (the others were
// done), 130 interrupted (128 + SIGINT, as a shell reports Ctrl-C).
#pragma once

namespace slide::apps {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitSomeFailed = 3;
inline constexpr int kExitInterrupted = 130;

}  // namespace slide::apps
