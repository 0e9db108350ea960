// Checkpoint files, metrics and learning curves of slide-train, shared by tile training
// (slide_train_main.cpp) and MIL training (slide_train_mil.cpp). Moved from slide_train_main.cpp.
#include "train_common.h"

#include <fcntl.h>  // AT_FDCWD; renameat2 and RENAME_EXCHANGE are in <cstdio> (glibc >= 2.28)

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <tuple>
#include <utility>

#include "cli_checks.h"
#include "report.h"
#include "slide/core/file.h"
#include "slide/train/model_registry.h"
#include "slide/core/file_name.h"
#include "slide/core/hash.h"
#include "slide/core/log.h"
#include "slide/tile/figure.h"
#include "slide/tile/image.h"

namespace slide::apps {

namespace fs = std::filesystem;
using slide::core::Status;
using namespace slide::train;

namespace {

// One numeric option's rule: [lo, hi] with either end open, finite, or an integer.
struct NumberRule {
  double lo, hi;
  bool lo_open, hi_open, integer;
  const char* says;  // the rule in words, for the message
};

const std::map<std::string, NumberRule>& number_rules() {
  constexpr double kInf = HUGE_VAL;
  static const std::map<std::string, NumberRule> rules = {
      {"lr", {0, kInf, false, true, false, "a finite number >= 0"}},
      {"weight-decay", {0, kInf, false, true, false, "a finite number >= 0"}},
      {"warmup-epochs", {0, kInf, false, true, false, "a finite number >= 0"}},
      {"momentum", {0, 1, false, true, false, "in [0, 1)"}},
      {"label-smoothing", {0, 1, false, true, false, "in [0, 1)"}},
      {"val-fraction", {0, 1, false, true, false, "in [0, 1)"}},
      {"test-fraction", {0, 1, false, true, false, "in [0, 1)"}},
      {"lr-backbone", {0, kInf, false, true, false, "a finite number >= 0"}},
      {"dropout", {0, 0.95, false, false, false, "in [0, 0.95]"}},
      {"mil-dropout", {0, 0.99, false, false, false, "in [0, 0.99]"}},
      {"random-resized-crop", {0.01, 1, false, false, false, "in [0.01, 1]"}},
      {"stain-augment", {0, 0.5, false, false, false, "in [0, 0.5]"}},
      // At most 1e9 s (31 years): the deadlines are steady_clock nanoseconds in 64 bits, which a
      // "never" such as 1e10 s overflows (every collective then failed at once).
      {"dist-timeout", {0, 1e9, true, false, false, "in (0, 1e9] seconds"}},
      {"epochs", {1, kInf, false, true, true, "an integer >= 1"}},
  };
  return rules;
}

}  // namespace

std::string check_number_option(const std::string& option, const std::string& value) {
  const auto it = number_rules().find(option);
  if (it == number_rules().end()) return "";
  const NumberRule& r = it->second;
  double v = 0;
  const bool in_range = finite_number(value, &v) && (r.lo_open ? v > r.lo : v >= r.lo) &&
                        (r.hi_open ? v < r.hi : v <= r.hi) && (!r.integer || v == std::floor(v));
  if (in_range) return "";
  return "--" + option + " " + value + ": must be " + r.says;
}

CLI::Validator number_option(const std::string& option) {
  return CLI::Validator(
      [option](std::string& value) {
        const std::string why = check_number_option(option, value);
        return why.empty() ? why : why.substr(option.size() + 3);  // CLI11 names the option itself
      },
      number_rules().count(option) ? number_rules().at(option).says : "", "number_option");
}

namespace {

constexpr const char* kRunFiles[] = {"metrics.jsonl", "metrics.csv", "curves.png", "report.html", "best.safetensors"};
constexpr const char* kRunDirs[] = {"checkpoints", "attention", "test"};

}  // namespace

std::vector<std::string> earlier_run_files(const std::string& out) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const char* d : kRunDirs)
    if (fs::is_directory(out + "/" + d, ec) && !fs::is_empty(out + "/" + d, ec)) found.push_back(std::string(d) + "/");
  for (const char* f : kRunFiles)
    if (fs::exists(out + "/" + f, ec)) found.push_back(f);
  return found;
}

slide::core::Result<std::unique_ptr<slide::core::DirLock>> claim_out_dir(const std::string& out, bool resume,
                                                                         bool overwrite) {
  if (resume && overwrite)
    return slide::core::invalid_argument("--resume continues the run in " + out + ", --overwrite replaces it: give one");
  SLIDE_ASSIGN_OR_RETURN(auto lock, slide::core::DirLock::acquire(out, "output directory"));
  const std::vector<std::string> files = earlier_run_files(out);
  if (!files.empty() && !resume && !overwrite) {
    std::string list;
    for (const auto& f : files) list += (list.empty() ? "" : ", ") + f;
    return slide::core::invalid_argument("--out " + out + " holds an earlier run (" + list +
                                         "): continue it with --resume, replace it with --overwrite, or use a new --out");
  }
  return lock;
}

slide::core::Result<std::unique_ptr<slide::core::DirLock>> claim_eval_dir(const std::string& out, bool overwrite) {
  SLIDE_ASSIGN_OR_RETURN(auto lock, slide::core::DirLock::acquire(out, "output directory"));
  std::string list;
  std::error_code ec;
  for (const char* f : {"predictions.csv", "slides.csv", "metrics.json", "predictions", "heatmaps"})
    if (fs::exists(out + "/" + f, ec)) list += (list.empty() ? "" : ", ") + std::string(f);
  if (!list.empty() && !overwrite)
    return slide::core::invalid_argument("--out " + out + " holds an earlier evaluation (" + list +
                                         "): replace it with --overwrite, or use a new --out");
  return lock;
}

void warn_classes_missing_from_split(const std::vector<std::string>& class_names, const std::vector<size_t>& train,
                                     const std::vector<size_t>& val, const std::function<int32_t(size_t)>& label_of,
                                     const std::string& unit, uint64_t seed) {
  const auto classes = static_cast<int32_t>(class_names.size());
  for (const auto& [side, indices] : {std::pair<const char*, const std::vector<size_t>*>{"training", &train},
                                      {"validation", &val}}) {
    if (indices->empty()) continue;
    std::vector<int64_t> per_class(class_names.size(), 0);
    for (size_t i : *indices) {
      const int32_t label = label_of(i);
      if (label >= 0 && label < classes) ++per_class[static_cast<size_t>(label)];
    }
    for (size_t c = 0; c < class_names.size(); ++c)
      if (per_class[c] == 0)
        slide::core::log_warn(std::string("a class has no ") + side + " " + unit + " after the split",
                              {{"class", class_names[c]}, {"seed", seed}});
  }
}

slide::core::Result<std::unique_ptr<slide::train::Sequential>> make_tile_model(const std::string& name,
                                                                             int64_t classes, int64_t width,
                                                                             std::optional<uint64_t> seed,
                                                                             double dropout) {
  return slide::train::make_cnn(name, classes, width, seed, dropout);  // the families: model_registry.h
}

nlohmann::json metric_or_null(double value) { return value < 0 ? nlohmann::json(nullptr) : nlohmann::json(value); }

nlohmann::json metrics_or_null(const std::vector<double>& values) {
  nlohmann::json out = nlohmann::json::array();
  for (double v : values) out.push_back(metric_or_null(v));
  return out;
}

std::string probability_text(float p) {
  p = std::clamp(p, 0.0f, 1.0f);
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, p);
  return std::string(buf, r.ptr);
}

slide::core::Status skip_undrawable_heatmap(const slide::core::Status& error, const std::string& slide_id,
                                            const char* warning) {
  if (error.code() != slide::core::StatusCode::kInvalidArgument) return error;
  slide::core::log_warn(warning, {{"slide", slide_id}, {"why", error.message()}});
  return slide::core::ok_status();
}

Status remove_earlier_run(const std::string& out) {
  std::vector<std::string> paths;
  for (const char* d : kRunDirs) paths.push_back(out + "/" + d);
  for (const char* f : kRunFiles) paths.push_back(out + "/" + f);
  for (const std::string& p : paths) {
    std::error_code ec;
    fs::remove_all(p, ec);
    if (ec) return slide::core::errno_status(ec.value(), "--overwrite: remove " + p);
  }
  return slide::core::ok_status();
}

namespace {

// validate_run_state's checks, each naming the field.
class StateCheck {
 public:
  explicit StateCheck(const std::string& file) : file_(file) {}
  const Status& status() const { return status_; }

  // `j[key]` (reported as `name`) is an integer >= min; absent is an error unless optional.
  void integer(const nlohmann::json& j, const std::string& key, const std::string& name, int64_t min,
               bool optional = false) {
    if (!status_.ok() || (optional && !j.contains(key))) return;
    const nlohmann::json* v = j.contains(key) ? &j[key] : nullptr;
    if (v == nullptr || !v->is_number_integer() || v->get<int64_t>() < min)
      fail(name, v, "an integer >= " + std::to_string(min));
  }
  // `nullable`: null (an undefined metric) is allowed too.
  void number(const nlohmann::json& j, const std::string& key, const std::string& name, bool optional = false,
              bool nullable = false) {
    if (!status_.ok() || (optional && !j.contains(key))) return;
    const nlohmann::json* v = j.contains(key) ? &j[key] : nullptr;
    if (v == nullptr || !(v->is_number() || (nullable && v->is_null()))) fail(name, v, nullable ? "a number or null" : "a number");
  }
  void string(const nlohmann::json& j, const std::string& key, const std::string& name, bool optional = false) {
    if (!status_.ok() || (optional && !j.contains(key))) return;
    const nlohmann::json* v = j.contains(key) ? &j[key] : nullptr;
    if (v == nullptr || !v->is_string()) fail(name, v, "a string");
  }
  // Present (unless optional) and an object (`object`) or an array; returns whether it is there and is.
  bool kind(const nlohmann::json& j, const std::string& key, const std::string& name, bool object,
            bool optional = false) {
    if (!status_.ok()) return false;
    if (optional && !j.contains(key)) return false;
    const nlohmann::json* v = j.contains(key) ? &j[key] : nullptr;
    if (v == nullptr || (object ? !v->is_object() : !v->is_array())) {
      fail(name, v, object ? "an object" : "an array");
      return false;
    }
    return true;
  }
  void fail(const std::string& name, const nlohmann::json* v, const std::string& expected) {
    std::string was = v == nullptr ? "missing" : "is " + v->dump();
    // Cut at a UTF-8 character boundary: the message goes into JSON (logs, results.json).
    if (was.size() > 80) was = slide::core::utf8_prefix(was, 80) + "...";
    status_ = slide::core::data_loss(file_ + ": field '" + name + "' " + was + ", expected " + expected +
                                     " (not a slide-train checkpoint record, or a damaged one)");
  }

 private:
  const std::string& file_;
  Status status_;
};

}  // namespace

Status validate_run_state(const std::string& file, const nlohmann::json& s) {
  if (!s.is_object()) return slide::core::data_loss(file + ": not a JSON object (not a slide-train checkpoint record)");
  StateCheck c(file);
  c.integer(s, "epoch", "epoch", 0);
  c.integer(s, "step_in_epoch", "step_in_epoch", 0);
  c.integer(s, "optimizer_steps", "optimizer_steps", 0);
  c.integer(s, "epochs", "epochs", 1);
  c.string(s, "model", "model");
  if (c.kind(s, "classes", "classes", false)) {
    if (s["classes"].size() < 2) c.fail("classes", &s["classes"], "an array of at least two class names");
    for (const auto& name : s["classes"])
      if (c.status().ok() && !name.is_string()) c.fail("classes", &s["classes"], "an array of strings");
  }
  if (c.kind(s, "history", "history", false)) {
    const nlohmann::json& h = s["history"];
    if (c.status().ok() && s["epoch"].is_number_integer() && h.size() != s["epoch"].get<uint64_t>())
      c.fail("history", &h, "one record per completed epoch (" + std::to_string(s["epoch"].get<int64_t>()) + ")");
    for (size_t i = 0; i < h.size() && c.status().ok(); ++i) {
      const std::string at = "history[" + std::to_string(i) + "]";
      if (!h[i].is_object()) {
        c.fail(at, &h[i], "an object");
        break;
      }
      c.integer(h[i], "epoch", at + ".epoch", 1);
      for (const char* key : {"train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_balanced_accuracy",
                              "val_roc_auc", "lr", "seconds"})
        // Validation metrics may be null (undefined, or not finite: JSON has no NaN).
        c.number(h[i], key, at + "." + key, false, std::string(key).rfind("val_", 0) == 0);
    }
  }
  c.number(s, "best_val_balanced_accuracy", "best_val_balanced_accuracy", true);
  c.number(s, "best_score", "best_score", true);
  c.string(s, "best_metric", "best_metric", true);
  c.integer(s, "best_epoch", "best_epoch", 1, true);
  c.kind(s, "config", "config", true, true);
  // The labels it was trained on (labels_record; optional: not in records from before it).
  if (c.kind(s, "labels", "labels", true, true)) {
    c.string(s["labels"], "sha256", "labels.sha256");
    if (c.kind(s["labels"], "per_class", "labels.per_class", true))
      for (const auto& [name, n] : s["labels"]["per_class"].items())
        c.integer(s["labels"]["per_class"], name, "labels.per_class." + name, 0);
  }
  // How the steps fit the memory budget (slide_train_memory.h's MemoryDecision); optional.
  if (c.kind(s, "memory", "memory", true, true)) {
    const nlohmann::json& m = s["memory"];
    c.string(m, "strategy", "memory.strategy");
    c.string(m, "segments", "memory.segments");
    c.integer(m, "accumulate", "memory.accumulate", 1);
    c.integer(m, "ranks", "memory.ranks", 1);
    if (c.status().ok() && m["strategy"] != "micro-batch" && m["strategy"] != "checkpoint" &&
        m["strategy"] != "offload" && m["strategy"] != "checkpoint+offload")
      c.fail("memory.strategy", &m["strategy"], "micro-batch, checkpoint, offload or checkpoint+offload");
  }
  // --precision fp16's loss scaler (loss_scaler.h): its scale (finite, > 0) and growth tracker.
  if (c.kind(s, "loss_scaler", "loss_scaler", true, true)) {
    const nlohmann::json& l = s["loss_scaler"];
    c.number(l, "scale", "loss_scaler.scale");
    c.integer(l, "growth_tracker", "loss_scaler.growth_tracker", 0);
    if (c.status().ok() && !(l["scale"].get<double>() > 0 && std::isfinite(l["scale"].get<double>())))
      c.fail("loss_scaler.scale", &l["scale"], "a finite number > 0");
  }
  if (c.status().ok() && s["model"] == "abmil") {
    if (c.kind(s, "mil", "mil", true)) {
      for (const char* key : {"in_features", "hidden", "attention"}) c.integer(s["mil"], key, std::string("mil.") + key, 1);
      c.number(s["mil"], "dropout", "mil.dropout");
    }
    // The encoder of the bags it was trained on (optional: not in records from before it).
    if (c.kind(s, "encoder", "encoder", true, true))
      for (const char* key : {"model", "layer", "weights_sha256"})
        c.string(s["encoder"], key, std::string("encoder.") + key);
  } else {
    c.integer(s, "width", "width", 1, true);
    c.number(s, "dropout", "dropout", true);
  }
  return c.status();
}

slide::core::Result<CheckpointRecord> open_checkpoint_record(const std::string& path) {
  CheckpointRecord r;
  std::error_code ec;
  const fs::path file(path);
  const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
  if (fs::is_directory(path, ec)) {
    r.weights = path + "/model.safetensors", r.state_file = path + "/state.json";
  } else if (fs::exists(dir / "state.json", ec)) {
    r.weights = path, r.state_file = (dir / "state.json").string();
  } else if (const auto checkpoints = list_checkpoints((dir / "checkpoints").string()); !checkpoints.empty()) {
    r.weights = path, r.state_file = (checkpoints.back() / "state.json").string();
  } else {
    return slide::core::invalid_argument(
        "--checkpoint " + path +
        ": a weights file needs its model's description: give a checkpoints/epoch-E-step-S directory, its "
        "model.safetensors, or a run's best.safetensors (next to the run's checkpoints/)");
  }
  SLIDE_ASSIGN_OR_RETURN_CTX(const std::string text, slide::core::read_file(r.state_file),
                             "the checkpoint's record (a checkpoints/epoch-E-step-S directory holds it)");
  r.state = nlohmann::json::parse(text, nullptr, false);
  if (r.state.is_discarded())
    return slide::core::data_loss(r.state_file + ": not JSON (not a slide-train checkpoint record)");
  SLIDE_RETURN_IF_ERROR(validate_run_state(r.state_file, r.state));
  return r;
}

std::vector<NamedTensor> named(const std::vector<Parameter*>& ps, const std::vector<Buffer*>& bs) {
  std::vector<NamedTensor> out;
  for (auto* p : ps) out.push_back({p->name, &p->value});
  for (auto* b : bs) out.push_back({b->name, &b->value});
  return out;
}

std::vector<fs::path> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<std::pair<long, long>, fs::path>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    long ep = 0, st = 0;
    const std::string n = e.path().filename().string();
    // Exactly "epoch-E-step-S" (E, S decimal; the name rebuilt from them must be the name): not
    // "*.partial", nor any other name that merely starts so.
    if (std::sscanf(n.c_str(), "epoch-%ld-step-%ld", &ep, &st) != 2) continue;
    const std::string name = "epoch-" + std::to_string(ep) + "-step-" + std::to_string(st);
    // "<name>.old" without "<name>": save_checkpoint's fallback was stopped between its two renames,
    // and the old copy is the complete one.
    const bool aside = n == name + ".old" && !fs::exists(fs::path(dir) / name, ec);
    if (n == name || aside) found.push_back({{ep, st}, e.path()});
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

Status save_checkpoint(const std::string& dir, const std::vector<Parameter*>& params,
                       const std::vector<Buffer*>& buffers, Optimizer& opt, const nlohmann::json& state, int keep,
                       Backend* device) {
  const std::string name = "epoch-" + std::to_string(state["epoch"].get<long>()) + "-step-" +
                           std::to_string(state["step_in_epoch"].get<long>());
  const std::string partial = dir + "/" + name + ".partial", final_dir = dir + "/" + name;
  std::error_code ec;
  fs::remove_all(partial, ec);
  const auto write_files = [&]() -> Status {
    SLIDE_RETURN_IF_ERROR(slide::core::make_dirs(partial));
    SLIDE_RETURN_IF_ERROR(save_safetensors(partial + "/model.safetensors", named(params, buffers),
                                           {{"format", "pt"}}, device));
    std::vector<NamedTensor> opt_state;
    for (auto* b : opt.state()) opt_state.push_back({b->name, &b->value});
    if (!opt_state.empty())
      SLIDE_RETURN_IF_ERROR(save_safetensors(partial + "/optimizer.safetensors", opt_state, {}, device));
    return slide::core::write_file_atomic(partial + "/state.json", state.dump(2));
  };
  if (Status s = write_files(); !s.ok()) {
    // A full disk (or any write error): the unfinished checkpoint goes, giving its space back; the
    // complete ones stay, and --resume starts from the newest.
    fs::remove_all(partial, ec);
    const std::vector<fs::path> kept = list_checkpoints(dir);
    return s.with_context("checkpoint " + final_dir + " not written (" +
                          (kept.empty() ? std::string("no complete checkpoint yet")
                                        : "the newest complete one, " + kept.back().filename().string() +
                                              ", is kept; free space and rerun with --resume") +
                          ")");
  }
  // The same name again (an interrupt with no step done since --resume): the complete copy is
  // exchanged with the new one in one step (renameat2 RENAME_EXCHANGE), so a second Ctrl-C or a
  // SIGKILL never leaves the name without a complete checkpoint. Where the file system cannot
  // exchange, the old one is renamed aside to "<name>.old" first (list_checkpoints takes it when
  // "<name>" is missing).
  std::string aside;  // the old copy while the new one is renamed in (the fallback only)
  bool exchanged = false;
  if (fs::exists(final_dir, ec)) {
    exchanged = ::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0;
    if (exchanged) {
      fs::remove_all(partial, ec);  // now the old checkpoint
    } else {
      aside = final_dir + ".old";
      fs::remove_all(aside, ec);
      fs::rename(final_dir, aside, ec);
      if (ec) return slide::core::errno_status(ec.value(), "rename " + final_dir + " to " + aside);
    }
  }
  if (!exchanged) {  // the new checkpoint is renamed in
    fs::rename(partial, final_dir, ec);
    if (ec) {
      const Status s = slide::core::errno_status(ec.value(), "rename " + partial + " to " + final_dir);
      if (!aside.empty()) fs::rename(aside, final_dir, ec);  // the complete copy back under its name
      return s;
    }
    if (!aside.empty()) fs::remove_all(aside, ec);
  }
  // Keep the newest `keep` checkpoints.
  const std::vector<fs::path> all = list_checkpoints(dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) fs::remove_all(all[i], ec);
  return slide::core::ok_status();
}

Status write_curves_png(const std::string& out, const nlohmann::json& history) {
  // Two panels drawn with cairo (slide/tile/figure.h): losses, and validation accuracies.
  const uint8_t blue[3] = {31, 119, 180}, orange[3] = {255, 127, 14}, green[3] = {44, 160, 44}, red[3] = {214, 39, 40};
  auto series = [&](const char* name, const char* key, const uint8_t rgb[3]) {
    slide::tile::Series s;
    s.name = name;
    std::copy(rgb, rgb + 3, s.rgb);
    for (const auto& h : history) {
      s.x.push_back(h["epoch"].get<double>());
      s.y.push_back(h.contains(key) && h[key].is_number() ? h[key].get<double>() : NAN);
    }
    return s;
  };
  slide::tile::Panel loss{"Loss", "epoch", "cross-entropy", {series("train", "train_loss", blue),
                                                              series("validation", "val_loss", orange)}};
  slide::tile::Panel acc{"Validation accuracy", "epoch", "fraction correct",
                         {series("accuracy", "val_accuracy", green), series("balanced accuracy", "val_balanced_accuracy", red)}};
  acc.y_min = 0, acc.y_max = 1;
  SLIDE_ASSIGN_OR_RETURN(slide::tile::RgbImage img,
                         slide::tile::draw_line_charts("Training curves (" + std::to_string(history.size()) + " epochs)",
                                                       {loss, acc}));
  SLIDE_ASSIGN_OR_RETURN(std::vector<uint8_t> png, slide::tile::encode_png(img));
  return slide::core::write_file_atomic(out + "/curves.png", png);
}

Status write_metrics(const std::string& out, const nlohmann::json& history) {
  std::string jsonl, csv = "epoch,train_loss,train_accuracy,val_loss,val_accuracy,val_balanced_accuracy,val_roc_auc,lr,seconds\n";
  for (const auto& h : history) {
    jsonl += h.dump() + "\n";
    // A value that is not a finite number (null: undefined, or NaN / inf, which JSON writes as
    // null) is an empty cell; so is a negative (undefined) ROC AUC.
    auto value = [&](const char* key, const char* format, bool signed_ok = true) {
      char cell[64] = "";
      if (h.contains(key) && h[key].is_number()) {
        const double v = h[key].get<double>();
        if (std::isfinite(v) && (signed_ok || v >= 0)) std::snprintf(cell, sizeof cell, format, v);
      }
      return std::string(cell);
    };
    csv += std::to_string(h["epoch"].get<long>()) + "," + value("train_loss", "%.6f") + "," +
           value("train_accuracy", "%.6f") + "," + value("val_loss", "%.6f") + "," + value("val_accuracy", "%.6f") +
           "," + value("val_balanced_accuracy", "%.6f") + "," + value("val_roc_auc", "%.6f", false) + "," +
           value("lr", "%.6g") + "," + value("seconds", "%.3f") + "\n";
  }
  SLIDE_RETURN_IF_ERROR(slide::core::write_file_atomic(out + "/metrics.jsonl", jsonl));
  SLIDE_RETURN_IF_ERROR(slide::core::write_file_atomic(out + "/metrics.csv", csv));
  return write_curves_png(out, history);
}

namespace {

std::string fixed(double v, int digits) {
  if (!std::isfinite(v)) return "n/a";
  const char* formats[] = {"%.0f", "%.1f", "%.2f", "%.3f", "%.4f", "%.5f", "%.6f"};
  return format_number(v, formats[std::clamp(digits, 0, 6)]);
}

// A history value as a table cell: numbers to `digits` places, null as "n/a".
std::string cell(const nlohmann::json& h, const char* key, int digits) {
  if (!h.contains(key) || !h[key].is_number()) return "n/a";
  return fixed(h[key].get<double>(), digits);
}

std::string text_of(const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

std::string bytes_text(size_t bytes) {
  return std::to_string(bytes) + " bytes (" + format_number(static_cast<double>(bytes) / (1024.0 * 1024.0), "%.1f") +
         " MiB)";
}

}  // namespace

void add_confusion_tables(HtmlReport& r, const std::vector<std::string>& classes, const std::vector<int64_t>& m) {
  const size_t C = classes.size();
  if (C == 0 || m.size() != C * C) return;
  r.paragraph("Recall: the fraction of a class's samples predicted as it; precision: the fraction of the samples "
              "predicted as a class that are it.");
  std::vector<std::vector<std::string>> per_class, matrix;
  for (size_t t = 0; t < C; ++t) {
    int64_t row = 0, col = 0;
    for (size_t k = 0; k < C; ++k) row += m[t * C + k], col += m[k * C + t];
    const int64_t diag = m[t * C + t];
    per_class.push_back({classes[t], std::to_string(row),
                         row > 0 ? fixed(static_cast<double>(diag) / static_cast<double>(row), 4) : "n/a",
                         col > 0 ? fixed(static_cast<double>(diag) / static_cast<double>(col), 4) : "n/a",
                         std::to_string(col)});
    std::vector<std::string> line{classes[t]};
    for (size_t k = 0; k < C; ++k) line.push_back(std::to_string(m[t * C + k]));
    matrix.push_back(std::move(line));
  }
  r.table({"class", "samples", "recall", "precision", "predicted as it"}, per_class, "classes", true);
  std::vector<std::string> header{"true \\ predicted"};
  header.insert(header.end(), classes.begin(), classes.end());
  r.heading("Confusion matrix");
  r.table(header, matrix, "confusion", true);
}

nlohmann::json confusion_rows(const std::vector<int64_t>& m, size_t classes) {
  nlohmann::json rows = nlohmann::json::array();
  if (classes == 0 || m.size() != classes * classes) return rows;
  for (size_t t = 0; t < classes; ++t)
    rows.push_back(std::vector<int64_t>(m.begin() + static_cast<long>(t * classes),
                                        m.begin() + static_cast<long>((t + 1) * classes)));
  return rows;
}

Status write_eval_report(const std::string& out, const nlohmann::json& metrics, const std::vector<std::string>& classes,
                         const std::vector<int64_t>& confusion) {
  HtmlReport r("slide-train evaluate: " + fs::path(out).filename().string());
  std::vector<std::pair<std::string, std::string>> rows = {{"output", out}, {"written", utc_now_text()}};
  for (const auto& [k, v] : metrics.items())
    if (!v.is_array() && !v.is_object()) rows.push_back({k, v.is_number_float() ? fixed(v.get<double>(), 4) : text_of(v)});
  r.heading("Metrics");
  r.key_values(rows, "metrics");
  r.heading("By class");
  add_confusion_tables(r, classes, confusion);
  return slide::core::write_file_atomic(out + "/report.html", r.html());
}

Status write_train_report(const std::string& out, const nlohmann::json& state, size_t peak_bytes,
                          const std::string& device) {
  const auto classes = state.value("classes", std::vector<std::string>{});
  const nlohmann::json& history = state["history"];
  HtmlReport r("slide-train report: " + fs::path(out).filename().string());
  std::string class_list;
  for (const auto& c : classes) class_list += (class_list.empty() ? "" : ", ") + c;
  std::vector<std::pair<std::string, std::string>> run = {
      {"output", out},
      {"written", utc_now_text()},
      {"model", state.contains("model") ? text_of(state["model"]) : "n/a"},
      {"classes", class_list},
      {"epochs done", std::to_string(history.size()) + " of " + (state.contains("epochs") ? text_of(state["epochs"]) : "?")}};
  if (state.contains("best_epoch"))
    run.push_back({"best epoch", text_of(state["best_epoch"]) + " (by " + state.value("best_metric", std::string("val_balanced_accuracy")) + ")"});
  r.heading("Run");
  r.key_values(run, "run");

  r.heading("Training curves");
  SLIDE_ASSIGN_OR_RETURN(const std::string curves, slide::core::read_file(out + "/curves.png"));
  r.png(curves, "training curves: loss, and validation accuracy by epoch");

  r.heading("Epochs");
  std::vector<std::vector<std::string>> rows;
  for (const auto& h : history)
    rows.push_back({text_of(h["epoch"]), cell(h, "train_loss", 4), cell(h, "train_accuracy", 4), cell(h, "val_loss", 4),
                    cell(h, "val_accuracy", 4), cell(h, "val_balanced_accuracy", 4), cell(h, "val_roc_auc", 4),
                    cell(h, "lr", 6), cell(h, "seconds", 1)});
  r.table({"epoch", "train loss", "train accuracy", "val loss", "val accuracy", "val balanced accuracy", "val ROC AUC",
           "learning rate", "seconds"},
          rows, "epochs");

  // The last epoch with a validation confusion matrix.
  const nlohmann::json* last = nullptr;
  const size_t C = classes.size();
  for (const auto& h : history)
    if (h.contains("val_confusion") && h["val_confusion"].is_array() && h["val_confusion"].size() == C * C && C > 0)
      last = &h;
  r.heading("Validation by class");
  if (last == nullptr) {
    r.paragraph("No validation set (or no epoch finished yet).");
  } else {
    r.paragraph("Epoch " + text_of((*last)["epoch"]) + ".");
    add_confusion_tables(r, classes, (*last)["val_confusion"].get<std::vector<int64_t>>());
  }

  r.heading("Options (state.json's config: what --resume holds fixed)");
  std::vector<std::pair<std::string, std::string>> options;
  if (state.contains("config"))
    for (const auto& [k, v] : state["config"].items()) options.push_back({k, text_of(v)});
  r.key_values(options, "options");

  r.heading("Memory");
  std::vector<std::pair<std::string, std::string>> memory;
  if (state.contains("memory"))
    for (const auto& [k, v] : state["memory"].items()) memory.push_back({k, text_of(v)});
  memory.push_back({"peak tensor memory (" + device + ", this process)", bytes_text(peak_bytes)});
  r.key_values(memory, "memory");
  return slide::core::write_file_atomic(out + "/report.html", r.html());
}

slide::core::Status check_resume_config(const std::string& checkpoint, const nlohmann::json& saved,
                                        const nlohmann::json& config, long epochs) {
  if (saved.contains("config")) {
    const nlohmann::json& was = saved["config"];
    std::string diffs;
    for (const auto& [key, value] : config.items()) {
      if (!was.contains(key) && (key == "activations" || key == "sync_bn")) {
        slide::core::log_warn("--resume: the checkpoint does not record --" + key +
                                  " (made before it was recorded); resumed with this run's",
                              {{"checkpoint", checkpoint}, {key, value.dump()}});
        continue;
      }
      if (!was.contains(key) || was[key] != value)
        diffs += " --" + key + " " + (was.contains(key) ? was[key].dump() : "(unset)") + " -> " + value.dump() + ";";
    }
    // An option the run was made with and this one lacks (--freeze, --stain-normalize, ...) changes
    // its math as much; --init only chose the first step's weights, which the checkpoint replaces.
    for (const auto& [key, value] : was.items())
      if (!config.contains(key) && key != "init") diffs += " --" + key + " " + value.dump() + " -> (unset);";
    if (!diffs.empty())
      return slide::core::invalid_argument("--resume: " + checkpoint + " was made with other options:" + diffs +
                                           " rerun with the original options, or use a new --out");
  }
  if (saved.value("epochs", epochs) != epochs)
    slide::core::log_warn("--resume with another --epochs: the schedule's length changes",
                          {{"was", saved.value("epochs", epochs)}, {"now", epochs}});
  return slide::core::ok_status();
}

slide::core::Status check_resume_step(const std::string& checkpoint, const nlohmann::json& saved,
                                     int64_t steps_per_epoch) {
  const int64_t step = saved.value("step_in_epoch", int64_t{0});
  if (step > 0 && step >= steps_per_epoch)
    return slide::core::data_loss(checkpoint + "/state.json: step_in_epoch " + std::to_string(step) +
                                  " is past the epoch's " + std::to_string(steps_per_epoch) +
                                  " steps (an interrupt is taken before a step)");
  return slide::core::ok_status();
}

slide::core::Result<nlohmann::json> split_record(std::vector<std::pair<std::string, std::string>> split) {
  std::sort(split.begin(), split.end(), [](const auto& a, const auto& b) {
    return std::tie(a.second, a.first) < std::tie(b.second, b.first);
  });
  std::string lines;
  nlohmann::json record = {{"train", 0}, {"val", 0}, {"test", 0}};
  for (const auto& [id, part] : split) {
    lines += part + "\t" + id + "\n";
    record[part] = record.value(part, 0) + 1;
  }
  SLIDE_ASSIGN_OR_RETURN(record["sha256"], slide::core::sha256_bytes(lines));
  return record;
}

namespace {

// What check_resume_split and check_resume_labels share: a checkpoint without saved[key] (made
// before the record existed) passes with a warning; one whose record equals `record` passes; any
// other gets `refusal(saved[key])`. The saved record may be anything (a hand-edited or damaged
// state.json; validate_run_state checks its types, not its counts), which `refusal` reads
// without assuming.
slide::core::Status check_resume_record(const std::string& checkpoint, const nlohmann::json& saved, const char* key,
                                        const char* what, const nlohmann::json& record,
                                        const std::function<slide::core::Status(const nlohmann::json&)>& refusal) {
  if (!saved.contains(key)) {
    slide::core::log_warn(std::string("--resume: the checkpoint does not record its ") + what +
                              " (made before the record existed); not checked",
                          {{"checkpoint", checkpoint}});
    return slide::core::ok_status();
  }
  if (saved[key] == record) return slide::core::ok_status();
  return refusal(saved[key]);
}

}  // namespace

slide::core::Status check_resume_split(const std::string& checkpoint, const nlohmann::json& saved,
                                       const nlohmann::json& record) {
  auto counts = [](const nlohmann::json& r) {
    auto count = [&r](const char* k) {
      return r.is_object() && r.contains(k) && r[k].is_number_integer() ? std::to_string(r[k].get<int64_t>())
                                                                          : std::string("?");
    };
    return count("train") + " train / " + count("val") + " validation / " + count("test") + " test";
  };
  return check_resume_record(checkpoint, saved, "split", "data split", record, [&](const nlohmann::json& was) {
    return slide::core::invalid_argument(
        "--resume: " + checkpoint + " was made on another split of the data (" + counts(was) + " slides then, " +
        counts(record) + " now" + (counts(was) == counts(record) ? ", other slides" : "") +
        "): stores, bags or labels were added, removed or changed; resumed, the run would validate on slides it "
        "trained on. Rerun with the run's data, or use a new --out");
  });
}

slide::core::Result<nlohmann::json> labels_record(const std::map<std::pair<std::string, std::string>, int64_t>& counts) {
  std::string lines;
  nlohmann::json per_class = nlohmann::json::object();
  for (const auto& [key, n] : counts) {
    lines += key.first + "\t" + key.second + "\t" + std::to_string(n) + "\n";
    per_class[key.second] = per_class.value(key.second, int64_t{0}) + n;
  }
  nlohmann::json record = {{"per_class", per_class}};
  SLIDE_ASSIGN_OR_RETURN(record["sha256"], slide::core::sha256_bytes(lines));
  return record;
}

slide::core::Status check_resume_labels(const std::string& checkpoint, const nlohmann::json& saved,
                                        const nlohmann::json& record) {
  auto counts = [](const nlohmann::json& r) {
    if (!r.is_object() || !r.contains("per_class") || !r["per_class"].is_object()) return std::string("?");
    std::string out;
    for (const auto& [name, n] : r["per_class"].items())
      out += (out.empty() ? "" : ", ") + name + " " + (n.is_number_integer() ? std::to_string(n.get<int64_t>()) : "?");
    return out;
  };
  return check_resume_record(checkpoint, saved, "labels", "labels", record, [&](const nlohmann::json& was) {
    return slide::core::invalid_argument(
        "--resume: " + checkpoint + " was made with other labels (per class then: " + counts(was) + "; now: " +
        counts(record) + (counts(was) == counts(record) ? "; the same counts, on other slides" : "") +
        "): the labels CSV or the stores' labels changed; resumed, the run would train the checkpoint's weights "
        "towards other targets. Rerun with the run's labels, or use a new --out");
  });
}

bool record_best_epoch(nlohmann::json* state, const slide::train::EpochStats& val, const std::string& metric,
                       long epoch, bool validated) {
  (*state)["best_val_balanced_accuracy"] = std::max(state->value("best_val_balanced_accuracy", -1.0), val.balanced_accuracy);
  if (!validated) {
    (*state)["best_score"] = 0.0;
    (*state)["best_metric"] = "last_epoch";
    (*state)["best_epoch"] = epoch;
    return true;
  }
  const double score = metric == "loss" ? -val.loss
                       : metric == "accuracy" ? val.accuracy
                       : metric == "roc_auc" ? val.roc_auc
                                             : val.balanced_accuracy;
  // An undefined (a ROC AUC of -1: one class validated) or non-finite score (NaN compares false)
  // never becomes the best.
  if (!std::isfinite(score) || (metric == "roc_auc" && score < 0)) return false;
  if (state->contains("best_score") && score <= (*state)["best_score"].get<double>()) return false;
  (*state)["best_score"] = score;
  (*state)["best_metric"] = "val_" + metric;
  (*state)["best_epoch"] = epoch;
  return true;
}

}  // namespace slide::apps
