// slide-train sweep: hyper-parameter trials, each a slide-train child process (DESIGN.md,
// "Memory: never die of OOM": every trial starts with all memory free, and one that crashes, is
// killed or runs out of memory is recorded as failed while the sweep goes on).
//
//   slide-train sweep --grid sweep.toml --out runs/sweep [--parallel 2] [--trial-memory-budget 2G]
//       -- --data lung --epochs 3            (one line; options common to every trial after --)
//
// The grid: a TOML subset, `option = value` or `option = [v1, v2, ...]` per line (option names
// without the leading dashes; strings quoted or bare; `true` is a flag, `false` leaves it out;
// '#' comments; [sections] are not read), whose lists span a cartesian product in file order; or
// a CSV (.csv) whose header names the options and whose rows are the trials (an empty cell leaves
// the option out).
//
// Layout of --out: trials/tNNN/ is trial NNN's --out (its checkpoints, metrics, log.txt with its
// stderr and stdout, pid while it runs, result.json when it ended); results.json and results.csv
// (every trial: id, options, status ok|failed, reason, best validation balanced accuracy, seconds;
// results.json names the best trial) are rewritten atomically whenever a trial ends.
//
// Resumable: a rerun with the same --out skips the trials whose result.json says ok and reruns
// the others (failed or never finished), with --resume when the trial left a complete checkpoint
// (else --overwrite when it left other files of a run). The sweep holds --out's writer lock
// (<out>/writer.lock) while it runs; each trial holds its own trials/tNNN/writer.lock. Option
// values out of range (train_common.h, check_number_option) in the grid or the common options are
// a usage error before any trial starts.
// GPUs: --devices 0,1,2,3 gives each trial it starts `--device D`, D the listed GPU that runs the
// fewest trials at that moment (with --parallel 4, one trial per GPU); --device in the grid or the
// common options beside it is a usage error. Without it every trial takes the same default GPU.
// Signals: each trial runs in its own process group, so a terminal's Ctrl-C reaches the sweep
// alone; the sweep passes every SIGINT, SIGTERM or SIGHUP it gets on to the running trials (the
// first: each checkpoints and exits 130; a second SIGINT or SIGTERM: they stop at once) and starts
// no more. A trial gets SIGHUP when the sweep dies (Linux PR_SET_PDEATHSIG), so none runs on
// unwatched.
// Exit codes: 0 every trial ok, 3 some failed, 2 usage (a bad grid), 1 the sweep itself failed,
// 130 interrupted (running trials were interrupted too; rerun to finish them).
#pragma once

#include <CLI/CLI.hpp>

#include <atomic>
#include <string>
#include <vector>

namespace slide::apps {

struct SweepOptions {
  std::string grid, out, trial_memory_budget;
  int parallel = 1;
  std::string devices_text;         // --devices as given ("0,1,2,3")
  std::vector<int> devices;         // its GPUs, which run_sweep reads from devices_text (empty: not assigned)
  std::vector<std::string> common;  // slide-train options given to every trial (after --)
};

// The `sweep` subcommand with its options.
CLI::App* add_sweep_command(CLI::App& app, SweepOptions* options);

// Runs the sweep with `self` (this slide-train's path) as every trial's program. Returns the exit
// code above. `cancel` set (by the caller; signals are handled as above) stops launching trials
// and sends each running one SIGINT.
int run_sweep(const SweepOptions& options, const std::string& self, const std::atomic<bool>* cancel);

// slide-train --folds K (without --fold): K-fold cross-validation as a sweep of K trials, trial k
// the run `self COMMON --folds K --fold k --out OUT/trials/tNNN` (one process per fold, resumable
// like a sweep). Afterwards results.json gains "cross_validation": per fold the validation metrics
// of its best epoch (by balanced accuracy), their mean and sample standard deviation. Exit codes
// as run_sweep's.
struct CrossValidationOptions {
  int folds = 0;
  std::string out;
  int parallel = 1;
  std::vector<std::string> common;  // every other option of the command line (not --out, --folds)
};
int run_cross_validation(const CrossValidationOptions& options, const std::string& self,
                         const std::atomic<bool>* cancel);

}  // namespace slide::apps
