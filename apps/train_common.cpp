// Checkpoint files, metrics and learning curves of slide-train, shared by tile training
// (slide_train_main.cpp) and MIL training (slide_train_mil.cpp). Moved from slide_train_main.cpp.
#include "train_common.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "slide/core/file.h"
#include "slide/core/log.h"
#include "slide/tile/image.h"

namespace slide::apps {

namespace fs = std::filesystem;
using slide::core::Status;
using namespace slide::train;

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
    if (std::sscanf(n.c_str(), "epoch-%ld-step-%ld", &ep, &st) == 2 && n.find(".partial") == std::string::npos)
      found.push_back({{ep, st}, e.path()});
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

Status save_checkpoint(const std::string& dir, const std::vector<Parameter*>& params,
                       const std::vector<Buffer*>& buffers, Optimizer& opt, const nlohmann::json& state, int keep) {
  const std::string name = "epoch-" + std::to_string(state["epoch"].get<long>()) + "-step-" +
                           std::to_string(state["step_in_epoch"].get<long>());
  const std::string partial = dir + "/" + name + ".partial", final_dir = dir + "/" + name;
  std::error_code ec;
  fs::remove_all(partial, ec);
  SLIDE_RETURN_IF_ERROR(slide::core::make_dirs(partial));
  SLIDE_RETURN_IF_ERROR(save_safetensors(partial + "/model.safetensors", named(params, buffers),
                                         {{"format", "pt"}}));
  std::vector<NamedTensor> opt_state;
  for (auto* b : opt.state()) opt_state.push_back({b->name, &b->value});
  if (!opt_state.empty()) SLIDE_RETURN_IF_ERROR(save_safetensors(partial + "/optimizer.safetensors", opt_state));
  SLIDE_RETURN_IF_ERROR(slide::core::write_file_atomic(partial + "/state.json", state.dump(2)));
  fs::remove_all(final_dir, ec);
  fs::rename(partial, final_dir, ec);
  if (ec) return slide::core::errno_status(ec.value(), "rename " + partial + " to " + final_dir);
  // Keep the newest `keep` checkpoints.
  const std::vector<fs::path> all = list_checkpoints(dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) fs::remove_all(all[i], ec);
  return slide::core::ok_status();
}

Status write_curves_png(const std::string& out, const nlohmann::json& history) {
  constexpr int64_t W = 640, H = 360, M = 20;
  slide::tile::RgbImage img(W, H, 255);
  auto put = [&](int64_t x, int64_t y, const uint8_t c[3]) {
    if (x < 0 || y < 0 || x >= W || y >= H) return;
    uint8_t* p = img.row(y) + 3 * x;
    p[0] = c[0], p[1] = c[1], p[2] = c[2];
  };
  const uint8_t grid[3] = {225, 225, 225}, axis[3] = {0, 0, 0};
  for (int k = 0; k <= 10; ++k)
    for (int64_t x = M; x < W - M; ++x) put(x, H - M - (H - 2 * M) * k / 10, k == 0 ? axis : grid);
  for (int64_t y = M; y < H - M; ++y) put(M, y, axis);
  const size_t n = history.size();
  if (n == 0) return slide::core::ok_status();
  double max_loss = 1e-12;
  for (const auto& h : history)
    max_loss = std::max({max_loss, h["train_loss"].get<double>(), h["val_loss"].get<double>()});
  auto px = [&](size_t i) { return M + (n == 1 ? 0 : (W - 2 * M) * static_cast<int64_t>(i) / static_cast<int64_t>(n - 1)); };
  auto py = [&](double v) { return H - M - static_cast<int64_t>(std::lround(std::clamp(v, 0.0, 1.0) * (H - 2 * M))); };
  auto line = [&](const char* key, double scale, const uint8_t c[3]) {
    for (size_t i = 0; i < n; ++i) {
      const int64_t x0 = px(i), y0 = py(history[i][key].get<double>() / scale);
      for (int64_t dy = -2; dy <= 2; ++dy)
        for (int64_t dx = -2; dx <= 2; ++dx) put(x0 + dx, y0 + dy, c);  // a dot per epoch
      if (i + 1 == n) break;
      const int64_t x1 = px(i + 1), y1 = py(history[i + 1][key].get<double>() / scale);
      const int64_t steps = std::max<int64_t>({1, std::abs(x1 - x0), std::abs(y1 - y0)});
      for (int64_t t = 0; t <= steps; ++t) put(x0 + (x1 - x0) * t / steps, y0 + (y1 - y0) * t / steps, c);
    }
  };
  const uint8_t blue[3] = {31, 119, 180}, orange[3] = {255, 127, 14}, green[3] = {44, 160, 44}, red[3] = {214, 39, 40};
  line("train_loss", max_loss, blue);
  line("val_loss", max_loss, orange);
  line("val_accuracy", 1.0, green);
  line("val_balanced_accuracy", 1.0, red);
  SLIDE_ASSIGN_OR_RETURN(std::vector<uint8_t> png, slide::tile::encode_png(img));
  return slide::core::write_file_atomic(out + "/curves.png", png);
}

Status write_metrics(const std::string& out, const nlohmann::json& history) {
  std::string jsonl, csv = "epoch,train_loss,train_accuracy,val_loss,val_accuracy,val_balanced_accuracy,val_roc_auc,lr,seconds\n";
  for (const auto& h : history) {
    jsonl += h.dump() + "\n";
    char line[256];
    std::snprintf(line, sizeof line, "%ld,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6g,%.3f\n", h["epoch"].get<long>(),
                  h["train_loss"].get<double>(), h["train_accuracy"].get<double>(), h["val_loss"].get<double>(),
                  h["val_accuracy"].get<double>(), h["val_balanced_accuracy"].get<double>(),
                  h["val_roc_auc"].get<double>(), h["lr"].get<double>(), h["seconds"].get<double>());
    csv += line;
  }
  SLIDE_RETURN_IF_ERROR(slide::core::write_file_atomic(out + "/metrics.jsonl", jsonl));
  SLIDE_RETURN_IF_ERROR(slide::core::write_file_atomic(out + "/metrics.csv", csv));
  return write_curves_png(out, history);
}

slide::core::Status check_resume_config(const std::string& checkpoint, const nlohmann::json& saved,
                                        const nlohmann::json& config, long epochs) {
  if (saved.contains("config")) {
    const nlohmann::json& was = saved["config"];
    std::string diffs;
    for (const auto& [key, value] : config.items())
      if (!was.contains(key) || was[key] != value)
        diffs += " --" + key + " " + (was.contains(key) ? was[key].dump() : "(unset)") + " -> " + value.dump() + ";";
    if (!diffs.empty())
      return slide::core::invalid_argument("--resume: " + checkpoint + " was made with other options:" + diffs +
                                           " rerun with the original options, or use a new --out");
  }
  if (saved.value("epochs", epochs) != epochs)
    slide::core::log_warn("--resume with another --epochs: the schedule's length changes",
                          {{"was", saved.value("epochs", epochs)}, {"now", epochs}});
  return slide::core::ok_status();
}

bool record_best_epoch(nlohmann::json* state, const slide::train::EpochStats& val, const std::string& metric,
                       long epoch) {
  const double score = metric == "loss" ? -val.loss
                       : metric == "accuracy" ? val.accuracy
                       : metric == "roc_auc" ? val.roc_auc
                                             : val.balanced_accuracy;
  (*state)["best_val_balanced_accuracy"] = std::max(state->value("best_val_balanced_accuracy", -1.0), val.balanced_accuracy);
  if (state->contains("best_score") && score <= (*state)["best_score"].get<double>()) return false;
  (*state)["best_score"] = score;
  (*state)["best_metric"] = "val_" + metric;
  (*state)["best_epoch"] = epoch;
  return true;
}

}  // namespace slide::apps
