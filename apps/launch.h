// `slide-train --gpus N`: one machine, N ranks, no MPI on the user's side (torchrun's
// --nproc-per-node). The launcher is the process the user started; it starts N copies of
// slide-train (the same arguments, without --gpus) and supervises them:
//
// - Wiring. Before starting them it makes N-1 connected Unix stream socket pairs, rank 0 holding
//   one end of each and rank r the other end of pair r; the children find their rank, the world
//   size and their sockets in SLIDE_LAUNCH_* (communicator.h, launched_rank()), and their GPU in
//   SLIDE_LAUNCH_LOCAL_RANK (device_select.h). Host backends train over those sockets (the
//   "socket" communicator); with --backend cuda the ranks use NCCL, its unique id sent over them.
// - Threads. Unless OMP_NUM_THREADS is set, each child gets the machine's cores divided by N.
// - Signals. The children run in their own process group, so a Ctrl-C at the terminal reaches
//   only the launcher, which passes each SIGINT/SIGTERM/SIGHUP it gets on to every child once: the
//   first makes the ranks agree to stop after the current step and write a checkpoint (exit 130), a
//   second SIGINT or SIGTERM stops them at once, as for one process. If the launcher itself is
//   killed, the kernel sends each child SIGHUP (PR_SET_PDEATHSIG; SIGHUP because the kernel may
//   send it twice, and a second SIGHUP does not cut the checkpoint short, interrupt.h).
// - Failure. When a child exits with a non-zero code or is killed by a signal (and no stop was
//   asked for), the launcher names it ("rank R (pid P) exited with code C" or "was killed by
//   SIGKILL"), sends the others SIGTERM, and SIGKILLs whatever is left after `stop_timeout_s`. Its
//   own exit code is the failed rank's (128 + the signal's number for a signal), and its last
//   line names that rank.
#pragma once

#include <string>
#include <vector>

namespace slide::apps {

struct LaunchOptions {
  int ranks = 1;                  // N >= 1
  std::string exe;                // the program each child runs (/proc/self/exe)
  std::vector<std::string> args;  // its arguments, argv[1..], --gpus removed
  double stop_timeout_s = 300;    // after a failure, SIGKILL the ranks still running after this
  int threads_per_rank = 0;       // OMP_NUM_THREADS for each child when the user set none (0: leave it)
};

// Runs the N ranks to completion and returns the exit code described above (0 when every rank
// exited 0; 130 when an interrupt stopped them; 1 when a child could not be started, naming why).
// It forks; a child calls only async-signal-safe functions before exec, so the caller may have
// other threads (interrupt.h's signal thread).
int run_launcher(const LaunchOptions& o);

// argv[1..] without `--gpus N` / `--gpus=N` (every occurrence), for the children.
std::vector<std::string> args_without_gpus(int argc, char** argv);

}  // namespace slide::apps
