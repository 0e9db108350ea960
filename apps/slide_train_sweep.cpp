#include "slide_train_sweep.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "cli_checks.h"
#include "exit_codes.h"
#include "interrupt.h"
#include "train_common.h"
#include "slide/core/dir_lock.h"
#include "slide/core/file.h"
#include "slide/core/file_name.h"
#include "slide/core/log.h"
#include "sweep_grid.h"
#include "train_common.h"

namespace slide::apps {

namespace {

namespace fs = std::filesystem;
using slide::core::Result;
using slide::core::Status;


std::string trial_id(size_t i) {
  std::string n = std::to_string(i);
  return "t" + std::string(n.size() < 3 ? 3 - n.size() : 0, '0') + n;
}

// The trial's last error line from its log ("[hh:mm:ss] error ..."), or "".
std::string last_error(const std::string& log_path) {
  std::ifstream f(log_path);
  std::string line, last;
  while (std::getline(f, line))
    if (line.find("] error ") != std::string::npos) last = line.substr(line.find("] error ") + 8);
  if (last.size() > 400) last = slide::core::utf8_prefix(last, 400) + "...";  // valid UTF-8 for result.json
  return last;
}

// The best validation balanced accuracy over the trial's epochs (metrics.jsonl), or -1.
double best_metric(const std::string& dir) {
  std::ifstream f(dir + "/metrics.jsonl");
  std::string line;
  double best = -1;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("val_balanced_accuracy") && j["val_balanced_accuracy"].is_number())
      best = std::max(best, j["val_balanced_accuracy"].get<double>());
  }
  return best;
}

// Whether a trial's run holds a checkpoint --resume would take (list_checkpoints' names).
bool has_checkpoint(const std::string& dir) { return !slide::apps::list_checkpoints(dir + "/checkpoints").empty(); }

std::string signal_name(int sig) {
  const char* n = sigabbrev_np(sig);
  return n != nullptr ? std::string("SIG") + n : std::to_string(sig);
}

// results.json and results.csv from every trial's record.
Status write_results(const std::string& out, const std::vector<Trial>& trials, const std::vector<nlohmann::json>& records) {
  nlohmann::json all = nlohmann::json::array();
  std::string best;
  double best_value = -2;
  std::vector<std::string> keys;
  for (const Trial& t : trials)
    for (const auto& [k, v] : t)
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  std::string csv = "trial";
  for (const auto& k : keys) csv += "," + k;
  csv += ",status,reason,best_val_balanced_accuracy,seconds\n";
  auto cell = [](std::string s) {
    if (s.find_first_of(",\"\n") == std::string::npos) return s;
    std::string q = "\"";
    for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c == '\n' ? ' ' : c);
    return q + "\"";
  };
  for (size_t i = 0; i < trials.size(); ++i) {
    const nlohmann::json& r = records[i];
    all.push_back(r);
    std::map<std::string, std::string> opts(trials[i].begin(), trials[i].end());
    csv += trial_id(i);
    for (const auto& k : keys) csv += "," + cell(opts.count(k) ? opts[k] : "");
    csv += "," + r.value("status", "pending") + "," + cell(r.value("reason", "")) + "," +
           std::to_string(r.value("best_val_balanced_accuracy", -1.0)) + "," + std::to_string(r.value("seconds", 0.0)) + "\n";
    if (r.value("status", "") == "ok" && r.value("best_val_balanced_accuracy", -1.0) > best_value)
      best_value = r["best_val_balanced_accuracy"].get<double>(), best = trial_id(i);
  }
  const nlohmann::json doc = {{"trials", all}, {"best", best.empty() ? nlohmann::json() : nlohmann::json(best)},
                              {"metric", "best_val_balanced_accuracy"}};
  SLIDE_RETURN_IF_ERROR(slide::core::write_file_atomic(out + "/results.json", doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n"));
  return slide::core::write_file_atomic(out + "/results.csv", csv);
}

}  // namespace

CLI::App* add_sweep_command(CLI::App& app, SweepOptions* o) {
  auto* sweep = app.add_subcommand("sweep", "Hyper-parameter trials, each its own slide-train process: "
                                            "slide-train sweep --grid G --out DIR -- COMMON OPTIONS");
  sweep->add_option("--grid", o->grid, "Trials: a TOML file of 'option = [values]' (their product) or a CSV of rows")
      ->required()->check(CLI::ExistingFile);
  sweep->add_option("--out", o->out, "Sweep directory: trials/tNNN/, results.json, results.csv")->required();
  sweep->add_option("--parallel", o->parallel, "Trials at once")->capture_default_str()->check(slide::apps::positive_number());
  sweep->add_option("--devices", o->devices_text,
                    "GPUs to spread the trials over (e.g. 0,1,2,3 with --parallel 4): each trial started gets "
                    "--device D, D the listed GPU running fewest trials (a GPU listed twice takes two); without it "
                    "every trial uses its own --device or the default GPU")
      ->type_name("LIST");
  sweep->add_option("--trial-memory-budget", o->trial_memory_budget,
                    "--memory-budget of every trial that does not set its own (e.g. 2G)");
  sweep->add_option("common", o->common, "slide-train options for every trial, after --");
  return sweep;
}

namespace {

int run_trials(const SweepOptions& o, const std::vector<Trial>* trials, const std::string& self,
               const std::atomic<bool>* cancel);

}  // namespace

int run_sweep(const SweepOptions& options, const std::string& self, const std::atomic<bool>* cancel) {
  SweepOptions o = options;
  if (!o.devices_text.empty()) {  // "0,1,2,3"
    std::stringstream in(o.devices_text);
    for (std::string item; std::getline(in, item, ',');) {
      int d = -1;
      const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), d);
      if (ec != std::errc() || end != item.data() + item.size() || d < 0) {
        slide::core::log_error("sweep: --devices " + o.devices_text + ": '" + item +
                               "' is not a GPU number (a comma-separated list such as 0,1,2,3)");
        return kExitUsage;
      }
      o.devices.push_back(d);
    }
  }
  auto text = slide::core::read_file(o.grid);
  if (!text.ok()) {
    slide::core::log_error(text.status().to_string());
    return kExitUsage;
  }
  const bool csv = o.grid.size() > 4 && o.grid.substr(o.grid.size() - 4) == ".csv";
  auto trials = csv ? read_csv_grid(o.grid, *text) : read_toml_grid(o.grid, *text);
  if (!trials.ok()) {
    slide::core::log_error(trials.status().to_string());
    return kExitUsage;
  }
  for (const Trial& t : *trials)
    for (const auto& [k, v] : t)
      if (k == "out" || k == "resume" || k == "overwrite") {
        slide::core::log_error(o.grid + ": --" + k + " is the sweep's to set");
        return kExitUsage;
      }
  // Values out of range (--lr nan, --momentum 5) are refused before any trial starts, as a
  // trial's own command line would refuse them.
  for (size_t i = 0; i < trials->size(); ++i)
    for (const auto& [k, v] : (*trials)[i])
      if (const std::string why = check_number_option(k, v); !why.empty()) {
        slide::core::log_error(o.grid + ": trial " + trial_id(i) + ": " + why);
        return kExitUsage;
      }
  return run_trials(o, &*trials, self, cancel);
}

namespace {

// The sweep's trials, each its own slide-train process (the grid already read and checked).
int run_trials(const SweepOptions& o, const std::vector<Trial>* trials, const std::string& self,
               const std::atomic<bool>* cancel) {
  for (size_t i = 0; i < o.common.size(); ++i) {
    const std::string& a = o.common[i];
    if (a.rfind("--", 0) != 0) continue;
    const auto eq = a.find('=');
    const std::string key = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    if (key == "out" || key == "resume" || key == "overwrite") {
      slide::core::log_error("sweep: --" + key + " is the sweep's to set, not an option for every trial");
      return kExitUsage;
    }
    // An option given twice would fail every trial (slide-train refuses a repeated option): one
    // the grid sets per trial, or --memory-budget beside --trial-memory-budget.
    for (const Trial& t : *trials)
      for (const auto& kv : t)
        if (kv.first == key) {
          slide::core::log_error("sweep: --" + key + " is both a common option and a grid option; give it in one place");
          return kExitUsage;
        }
    if (key == "device" && !o.devices.empty()) {
      slide::core::log_error("sweep: --device among the common options and --devices: give one");
      return kExitUsage;
    }
    if (key == "memory-budget" && !o.trial_memory_budget.empty()) {
      slide::core::log_error("sweep: --memory-budget among the common options and --trial-memory-budget: give one");
      return kExitUsage;
    }
    const bool has_value = eq != std::string::npos || i + 1 < o.common.size();
    const std::string value = eq != std::string::npos ? a.substr(eq + 1) : has_value ? o.common[i + 1] : "";
    if (const std::string why = check_number_option(key, value); has_value && !why.empty()) {
      slide::core::log_error("sweep: " + why);
      return kExitUsage;
    }
  }
  if (!o.devices.empty())
    for (const Trial& t : *trials)
      for (const auto& kv : t)
        if (kv.first == "device") {
          slide::core::log_error("sweep: the grid sets --device and --devices assigns it: give one");
          return kExitUsage;
        }
  // One sweep per --out; each trial's slide-train locks its own trials/tNNN, so the sweep and
  // its trials never wait on each other.
  auto out_lock = slide::core::DirLock::acquire(o.out, "sweep directory");
  if (!out_lock.ok()) {
    slide::core::log_error(out_lock.status().to_string());
    return kExitFailed;
  }
  if (auto s = slide::core::make_dirs(o.out + "/trials"); !s.ok()) {
    slide::core::log_error(s.to_string());
    return kExitFailed;
  }
  const size_t n = trials->size();
  // Trial i's options as given to its slide-train (the common options, then the grid's, then the
  // trial memory budget), without --out, --resume and --overwrite: what its result.json records.
  auto trial_args = [&](size_t i) {
    std::vector<std::string> args(o.common.begin(), o.common.end());
    bool own_budget = false;
    for (const auto& [k, v] : (*trials)[i]) {
      if (v == "false") continue;
      args.push_back("--" + k);
      if (v != "true") args.push_back(v);
      own_budget |= k == "memory-budget";
    }
    if (!own_budget && !o.trial_memory_budget.empty()) args.insert(args.end(), {"--memory-budget", o.trial_memory_budget});
    return args;
  };
  std::vector<nlohmann::json> records(n);
  std::vector<size_t> todo;
  std::set<size_t> start_over;  // unfinished trials that ran with other options
  for (size_t i = 0; i < n; ++i) {
    const std::string dir = o.out + "/trials/" + trial_id(i);
    auto prev = slide::core::read_file(dir + "/result.json");
    if (prev.ok()) records[i] = nlohmann::json::parse(*prev, nullptr, false);
    if (!records[i].is_object()) records[i] = nlohmann::json::object();
    // A finished trial is kept only when it ran with this trial's options: another grid or other
    // common options (another --folds) would report its numbers against settings it never ran. An
    // unfinished one with other options starts again (--overwrite), not from their checkpoint.
    const bool other_args = records[i].contains("args") && records[i]["args"] != nlohmann::json(trial_args(i));
    if (other_args && records[i].value("status", "") != "ok") {
      start_over.insert(i);
    } else if (other_args) {
      std::string was, now;
      for (const auto& a : records[i]["args"]) was += (was.empty() ? "" : " ") + (a.is_string() ? a.get<std::string>() : a.dump());
      for (const auto& a : trial_args(i)) now += (now.empty() ? "" : " ") + a;
      slide::core::log_error("sweep: " + dir + " ran with other options ('" + was + "'; this sweep gives it '" + now +
                             "'): the grid or the common options changed; use a new --out");
      return kExitUsage;
    }
    if (records[i].value("status", "") == "ok") continue;
    records[i] = {{"trial", trial_id(i)}, {"status", "pending"}};
    todo.push_back(i);
  }
  slide::core::log_info("sweep", {{"trials", static_cast<int64_t>(n)}, {"to_run", static_cast<int64_t>(todo.size())},
                                  {"already_done", static_cast<int64_t>(n - todo.size())}, {"parallel", o.parallel}});
  struct Running {
    size_t trial;
    std::chrono::steady_clock::time_point t0;
    int device_slot;  // its GPU's index in --devices, or -1
  };
  std::map<pid_t, Running> running;
  std::vector<int> device_use(o.devices.size(), 0);  // running trials per --devices entry
  size_t next = 0;
  bool interrupted = false;
  // Signals are counted, not acted on, from here: the loop passes each on to the running trials
  // (the first: they checkpoint and exit 130; a second: they stop at once).
  count_interrupts_only();
  int forwarded = 0;
  auto launch = [&](size_t i) -> Status {
    const std::string dir = o.out + "/trials/" + trial_id(i);
    SLIDE_RETURN_IF_ERROR(slide::core::make_dirs(dir));
    std::vector<std::string> args{self};
    for (auto& a : trial_args(i)) args.push_back(std::move(a));
    args.insert(args.end(), {"--out", dir});
    // A trial that left a checkpoint continues; one that failed before its first checkpoint (its
    // metrics may be there) starts again, replacing what it left.
    if (has_checkpoint(dir) && !start_over.count(i)) args.push_back("--resume");
    else if (!earlier_run_files(dir).empty()) args.push_back("--overwrite");
    // A GPU from --devices: the listed one running fewest trials.
    int slot = -1;
    if (!o.devices.empty()) {
      slot = 0;
      for (size_t d = 1; d < o.devices.size(); ++d)
        if (device_use[d] < device_use[static_cast<size_t>(slot)]) slot = static_cast<int>(d);
      args.insert(args.end(), {"--device", std::to_string(o.devices[static_cast<size_t>(slot)])});
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string log = dir + "/log.txt";
    const int log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0) return slide::core::errno_status(errno, "open " + log);
    const pid_t sweep_pid = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      // The trial: supervised (interrupt.h: it checkpoints and stops when the sweep dies), stdout
      // and stderr to log.txt. Only async-signal-safe calls between fork and exec.
      prepare_supervised_child(sweep_pid);
      if (::dup2(log_fd, STDOUT_FILENO) < 0 || ::dup2(log_fd, STDERR_FILENO) < 0) ::_exit(127);
      ::execv(self.c_str(), argv.data());
      const char msg[] = "slide-train sweep: cannot start the trial (execv failed)\n";
      (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
      ::_exit(127);
    }
    const int fork_errno = errno;
    ::close(log_fd);
    if (pid < 0) return slide::core::errno_status(fork_errno, "start trial " + trial_id(i) + " (" + self + ")");
    ::setpgid(pid, pid);  // also here: no race with a signal passed on before the child ran setpgid
    // Tracked from here on, whatever follows: the trial runs (it counts against --parallel and its
    // GPU, gets the signals passed on, and its end is recorded).
    running[pid] = {i, std::chrono::steady_clock::now(), slot};
    if (slot >= 0) ++device_use[static_cast<size_t>(slot)];
    records[i]["status"] = "running";
    if (auto s = slide::core::write_file_atomic(dir + "/pid", std::to_string(pid) + "\n"); !s.ok())
      slide::core::log_warn("sweep: cannot write the trial's pid file (the trial runs on)", {{"error", s.to_string()}});
    std::string line;
    for (size_t k = 1; k < args.size(); ++k) line += (k > 1 ? " " : "") + args[k];
    slide::core::log_info("trial started", {{"trial", trial_id(i)}, {"pid", static_cast<int64_t>(pid)}, {"args", line}});
    return slide::core::ok_status();
  };
  while (true) {
    if (!interrupted && ((cancel != nullptr && cancel->load()) || signal_count() > 0)) {
      interrupted = true;
      slide::core::log_warn("sweep: interrupted: the running trials checkpoint and stop (a second Ctrl-C stops them at "
                            "once); rerun the sweep to finish",
                            {{"running", static_cast<int64_t>(running.size())}});
      if (signal_count() == 0)  // cancelled without a signal: pass on one SIGINT
        for (const auto& [pid, r] : running) ::kill(pid, SIGINT);
    }
    while (forwarded < signal_count()) {
      ++forwarded;
      for (const auto& [pid, r] : running) ::kill(pid, last_signal());
    }
    while (!interrupted && next < todo.size() && running.size() < static_cast<size_t>(o.parallel)) {
      if (auto s = launch(todo[next++]); !s.ok()) {
        slide::core::log_error(s.to_string());
        records[todo[next - 1]]["status"] = "failed";
        records[todo[next - 1]]["reason"] = s.to_string();
      }
    }
    if (running.empty()) break;
    int status = 0;
    // Polled, so that a signal is passed on at once (the signals are blocked in this thread: a
    // blocking waitpid would not return for one).
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR) {
      slide::core::log_error(std::string("waitpid: ") + std::strerror(errno));
      return kExitFailed;
    }
    if (pid <= 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    auto it = running.find(pid);
    if (it == running.end()) continue;
    const size_t i = it->second.trial;
    if (it->second.device_slot >= 0) --device_use[static_cast<size_t>(it->second.device_slot)];
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - it->second.t0).count();
    running.erase(it);
    const std::string dir = o.out + "/trials/" + trial_id(i);
    nlohmann::json& r = records[i];
    r["trial"] = trial_id(i);
    r["args"] = trial_args(i);
    r["options"] = nlohmann::json::object();
    for (const auto& [k, v] : (*trials)[i]) r["options"][k] = v;
    r["seconds"] = seconds;
    r["best_val_balanced_accuracy"] = best_metric(dir);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      r["status"] = "ok";
      r["reason"] = "";
    } else {
      r["status"] = "failed";
      const std::string err = last_error(dir + "/log.txt");
      if (WIFSIGNALED(status)) {
        r["reason"] = "killed by signal " + signal_name(WTERMSIG(status));
      } else if (WEXITSTATUS(status) == kExitInterrupted) {
        r["reason"] = "interrupted (exit 130): rerun the sweep to finish it";
      } else {
        r["reason"] = (err.find("RESOURCE_EXHAUSTED") != std::string::npos ? "out of memory: " : "exit code " +
                       std::to_string(WEXITSTATUS(status)) + ": ") + err;
      }
    }
    if (auto s = slide::core::write_file_atomic(dir + "/result.json", r.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n"); !s.ok())
      slide::core::log_error(s.to_string());
    std::error_code ec;
    fs::remove(dir + "/pid", ec);
    (r["status"] == "ok" ? slide::core::log_info : slide::core::log_warn)(
        "trial ended", {{"trial", trial_id(i)}, {"status", r["status"].get<std::string>()},
                        {"reason", r["reason"].get<std::string>()},
                        {"best_val_balanced_accuracy", r["best_val_balanced_accuracy"].get<double>()}});
    if (auto s = write_results(o.out, *trials, records); !s.ok()) {
      slide::core::log_error(s.to_string());
      return kExitFailed;
    }
  }
  if (auto s = write_results(o.out, *trials, records); !s.ok()) {
    slide::core::log_error(s.to_string());
    return kExitFailed;
  }
  size_t ok = 0;
  for (const auto& r : records) ok += r.value("status", "") == "ok";
  auto doc = slide::core::read_file(o.out + "/results.json");
  const nlohmann::json results = doc.ok() ? nlohmann::json::parse(*doc, nullptr, false) : nlohmann::json();
  slide::core::log_info("sweep finished", {{"ok", static_cast<int64_t>(ok)}, {"failed", static_cast<int64_t>(n - ok)},
                                           {"best", results.is_object() && results["best"].is_string()
                                                        ? results["best"].get<std::string>()
                                                        : std::string("none")}});
  if (interrupted) return kExitInterrupted;
  return ok == n ? kExitOk : kExitSomeFailed;
}

}  // namespace

int run_cross_validation(const CrossValidationOptions& cv, const std::string& self, const std::atomic<bool>* cancel) {
  SweepOptions o;
  o.out = cv.out;
  o.parallel = cv.parallel;
  o.common = cv.common;
  o.common.insert(o.common.end(), {"--folds", std::to_string(cv.folds)});
  std::vector<Trial> trials;
  for (int k = 0; k < cv.folds; ++k) trials.push_back({{"fold", std::to_string(k)}});
  const int code = run_trials(o, &trials, self, cancel);
  // Only a sweep that ran (every fold, or some failed) summarises: not one refused, interrupted, or
  // stopped by another sweep holding --out (whose results.json is not this run's to write).
  if (code != kExitOk && code != kExitSomeFailed) return code;
  // Per fold: the validation metrics of its best epoch (by validation balanced accuracy, the
  // epoch its best.safetensors holds by default); then their mean and sample standard deviation.
  // Only the folds whose trial finished ("ok" in results.json, which run_trials wrote) count: a fold
  // that failed or was stopped part way has a metrics.jsonl of its first epochs only.
  auto doc = slide::core::read_file(cv.out + "/results.json");
  nlohmann::json results = doc.ok() ? nlohmann::json::parse(*doc, nullptr, false) : nlohmann::json::object();
  if (!results.is_object()) results = nlohmann::json::object();
  auto fold_status = [&](int k) -> std::string {
    if (!results.contains("trials") || !results["trials"].is_array() || results["trials"].size() <= static_cast<size_t>(k))
      return "unknown";
    const nlohmann::json& t = results["trials"][static_cast<size_t>(k)];
    return t.is_object() && t.contains("status") && t["status"].is_string() ? t["status"].get<std::string>() : "unknown";
  };
  nlohmann::json per_fold = nlohmann::json::array();
  std::map<std::string, std::vector<double>> values;
  const char* keys[] = {"val_balanced_accuracy", "val_accuracy", "val_roc_auc", "val_loss"};
  for (int k = 0; k < cv.folds; ++k) {
    const std::string status = fold_status(k);
    if (status != "ok") {
      per_fold.push_back({{"fold", k}, {"trial", trial_id(static_cast<size_t>(k))}, {"status", status}});
      continue;
    }
    std::ifstream f(cv.out + "/trials/" + trial_id(static_cast<size_t>(k)) + "/metrics.jsonl");
    std::string line;
    nlohmann::json best;
    while (std::getline(f, line)) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.contains("val_balanced_accuracy") || !j["val_balanced_accuracy"].is_number()) continue;
      if (!best.is_object() || j["val_balanced_accuracy"].get<double>() > best["val_balanced_accuracy"].get<double>())
        best = j;
    }
    nlohmann::json row = {{"fold", k}, {"trial", trial_id(static_cast<size_t>(k))}, {"status", status}};
    if (best.is_object()) {
      row["epoch"] = best["epoch"];
      for (const char* key : keys) {
        row[key] = best.contains(key) ? best[key] : nlohmann::json(nullptr);
        if (row[key].is_number()) values[key].push_back(row[key].get<double>());
      }
    }
    per_fold.push_back(row);
  }
  nlohmann::json mean = nlohmann::json::object(), sd = nlohmann::json::object();
  for (const char* key : keys) {
    const auto& v = values[key];
    if (v.empty()) {
      mean[key] = nullptr, sd[key] = nullptr;
      continue;
    }
    double m = 0;
    for (double x : v) m += x;
    m /= static_cast<double>(v.size());
    double ss = 0;
    for (double x : v) ss += (x - m) * (x - m);
    mean[key] = m;
    sd[key] = v.size() > 1 ? nlohmann::json(std::sqrt(ss / static_cast<double>(v.size() - 1))) : nlohmann::json(nullptr);
  }
  results["cross_validation"] = {{"folds", cv.folds},
                                 {"complete_folds", static_cast<int64_t>(values["val_balanced_accuracy"].size())},
                                 {"split", "by patient when the labels CSV has a patient (or case_id) column, else by slide"},
                                 {"per_fold", per_fold}, {"mean", mean}, {"sd", sd}};
  if (auto s = slide::core::write_file_atomic(cv.out + "/results.json", results.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n"); !s.ok()) {
    slide::core::log_error(s.to_string());
    return kExitFailed;
  }
  slide::core::log_info("cross-validation", {{"folds", cv.folds},
                                             {"mean_val_balanced_accuracy", mean["val_balanced_accuracy"].is_number()
                                                                               ? mean["val_balanced_accuracy"].get<double>()
                                                                               : -1.0},
                                             {"sd", sd["val_balanced_accuracy"].is_number()
                                                        ? sd["val_balanced_accuracy"].get<double>()
                                                        : -1.0}});
  return code;
}

}  // namespace slide::apps
