// slide-train: trains a CNN classifier on slide-tile stores (DESIGN.md, "The engine").
//
// Exit codes: 0 ok, 1 failed, 2 usage or bad input (before any work starts), 130 interrupted
// (Ctrl-C: the current step finishes, a checkpoint is written; --resume continues exactly).
#include <CLI/CLI.hpp>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "slide/core/file.h"
#include "slide/core/log.h"
#include "slide/tile/image.h"
#include "slide/train/checkpoint.h"
#include "slide/train/trainer.h"

namespace {

namespace fs = std::filesystem;
using slide::core::Status;
using namespace slide::train;

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitInterrupted = 130;

std::atomic<bool> g_cancel{false};

void on_signal(int) {
  if (g_cancel.exchange(true)) _exit(kExitInterrupted);
  static const char kMsg[] = "\ninterrupt: finishing the current step, then writing a checkpoint\n";
  (void)!::write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
}

int fail(const Status& s) {
  slide::core::log_error(s.to_string());
  return s.code() == slide::core::StatusCode::kInvalidArgument || s.code() == slide::core::StatusCode::kNotFound
             ? kExitUsage
             : kExitFailed;
}

Result<std::unique_ptr<Sequential>> make_model(const std::string& name, int64_t classes, int64_t width, uint64_t seed) {
  if (name == "small") return make_small_cnn(cpu_allocator(), DType::kF32, 3, classes, width, seed);
  if (name == "resnet18") return make_resnet(cpu_allocator(), DType::kF32, 18, classes, seed);
  if (name == "resnet34") return make_resnet(cpu_allocator(), DType::kF32, 34, classes, seed);
  if (name == "resnet50") return make_resnet(cpu_allocator(), DType::kF32, 50, classes, seed);
  return slide::core::invalid_argument("model '" + name + "' is not one of small, resnet18, resnet34, resnet50");
}

struct Run {
  std::unique_ptr<Sequential> model;
  std::unique_ptr<Optimizer> opt;
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
};

std::vector<NamedTensor> named(const std::vector<Parameter*>& ps, const std::vector<Buffer*>& bs) {
  std::vector<NamedTensor> out;
  for (auto* p : ps) out.push_back({p->name, &p->value});
  for (auto* b : bs) out.push_back({b->name, &b->value});
  return out;
}

// The complete checkpoint directories ("epoch-E-step-S", no ".partial") in `dir`, oldest first.
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

// Writes <dir>/epoch-E-step-S via a .partial directory renamed into place; keeps the newest `keep`.
Status save_checkpoint(const std::string& dir, Run& run, const nlohmann::json& state, int keep) {
  const std::string name = "epoch-" + std::to_string(state["epoch"].get<long>()) + "-step-" +
                           std::to_string(state["step_in_epoch"].get<long>());
  const std::string partial = dir + "/" + name + ".partial", final_dir = dir + "/" + name;
  std::error_code ec;
  fs::remove_all(partial, ec);
  SLIDE_RETURN_IF_ERROR(slide::core::make_dirs(partial));
  SLIDE_RETURN_IF_ERROR(save_safetensors(partial + "/model.safetensors", named(run.params, run.buffers),
                                         {{"format", "pt"}}));
  std::vector<NamedTensor> opt_state;
  for (auto* b : run.opt->state()) opt_state.push_back({b->name, &b->value});
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

// curves.png: the learning curves, 640 x 360, epochs along x. Train loss (blue) and validation
// loss (orange) scaled to the largest loss; validation accuracy (green) and balanced accuracy
// (red) on 0..1. Light grid lines at tenths; no text (the numbers are in metrics.csv).
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

// metrics.jsonl and metrics.csv, rewritten whole (atomically) from the history.
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

// slide-train evaluate: a checkpoint's model over stores; per-tile and per-slide CSVs, metrics.
int run_evaluate(const std::string& checkpoint, const std::vector<std::string>& data, const std::string& labels_csv,
                 const std::string& out, int64_t batch, int threads, const std::string& backend) {
  auto text = slide::core::read_file(checkpoint + "/state.json");
  if (!text.ok()) return fail(text.status().with_context("--checkpoint (a checkpoints/epoch-E-step-S directory)"));
  nlohmann::json state = nlohmann::json::parse(*text, nullptr, false);
  if (state.is_discarded() || !state.contains("model") || !state.contains("classes"))
    return fail(slide::core::data_loss(checkpoint + "/state.json: not a slide-train checkpoint record"));
  const auto classes = state["classes"].get<std::vector<std::string>>();
  auto be = make_backend(backend);
  if (!be.ok()) return fail(be.status());
  auto ds = TileDataset::open(data, labels_csv);
  if (!ds.ok()) return fail(ds.status());
  if ((*ds)->class_names() != classes)
    return fail(slide::core::invalid_argument("the stores' classes (" + nlohmann::json((*ds)->class_names()).dump() +
                                              ") differ from the checkpoint's (" + state["classes"].dump() + ")"));
  auto model = make_model(state["model"].get<std::string>(), static_cast<int64_t>(classes.size()),
                          state.value("width", int64_t{16}), 0);
  if (!model.ok()) return fail(model.status());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*model)->collect("", &params, &buffers);
  if (auto s = load_safetensors(checkpoint + "/model.safetensors", named(params, buffers)); !s.ok()) return fail(s);
  std::vector<size_t> all((*ds)->tiles().size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  slide::core::ThreadPool pool(static_cast<size_t>(std::max(1, threads)));
  std::vector<float> probs;
  auto st = evaluate(**be, **model, **ds, all, batch, &pool, &probs);
  if (!st.ok()) return fail(st.status());
  if (auto s = slide::core::make_dirs(out); !s.ok()) return fail(s);

  const size_t k = classes.size();
  std::string tiles_csv = "slide_id,x_l0,y_l0,label", slides_csv = "slide_id,label,tiles";
  for (const auto& c : classes) tiles_csv += ",p_" + c, slides_csv += ",mean_p_" + c;
  tiles_csv += ",predicted\n";
  slides_csv += ",predicted_by_mean,predicted_by_majority\n";
  struct SlideAgg {
    int32_t label = 0;
    int64_t tiles = 0;
    std::vector<double> sum;
    std::vector<int64_t> votes;
  };
  std::vector<SlideAgg> slides((*ds)->slide_ids().size());
  for (size_t i = 0; i < all.size(); ++i) {
    const TileRef& ref = (*ds)->tiles()[i];
    slide::tile::TileHeader h;
    if (auto s = (*ds)->tile_header(i, &h); !s.ok()) return fail(s);
    const float* p = probs.data() + i * k;
    const auto pred = static_cast<size_t>(std::max_element(p, p + k) - p);
    std::string line = (*ds)->slide_ids()[ref.slide] + "," + std::to_string(h.x_l0) + "," + std::to_string(h.y_l0) +
                       "," + classes[static_cast<size_t>(ref.label)];
    for (size_t c = 0; c < k; ++c) line += "," + std::to_string(p[c]);
    tiles_csv += line + "," + classes[pred] + "\n";
    SlideAgg& a = slides[ref.slide];
    if (a.sum.empty()) a.sum.assign(k, 0.0), a.votes.assign(k, 0);
    a.label = ref.label;
    ++a.tiles;
    for (size_t c = 0; c < k; ++c) a.sum[c] += p[c];
    ++a.votes[pred];
  }
  for (size_t s = 0; s < slides.size(); ++s) {
    const SlideAgg& a = slides[s];
    if (a.tiles == 0) continue;
    std::string line = (*ds)->slide_ids()[s] + "," + classes[static_cast<size_t>(a.label)] + "," + std::to_string(a.tiles);
    for (size_t c = 0; c < k; ++c) line += "," + std::to_string(a.sum[c] / static_cast<double>(a.tiles));
    const auto by_mean = static_cast<size_t>(std::max_element(a.sum.begin(), a.sum.end()) - a.sum.begin());
    const auto by_vote = static_cast<size_t>(std::max_element(a.votes.begin(), a.votes.end()) - a.votes.begin());
    slides_csv += line + "," + classes[by_mean] + "," + classes[by_vote] + "\n";
  }
  const nlohmann::json metrics = {{"tiles", st->samples}, {"loss", st->loss}, {"accuracy", st->accuracy},
                                  {"balanced_accuracy", st->balanced_accuracy}, {"roc_auc", st->roc_auc},
                                  {"recall", st->recall}, {"classes", classes}, {"checkpoint", checkpoint}};
  for (auto [name, body] : {std::pair<std::string, std::string>{"/predictions.csv", tiles_csv},
                            {"/slides.csv", slides_csv}, {"/metrics.json", metrics.dump(2) + "\n"}})
    if (auto s = slide::core::write_file_atomic(out + name, body); !s.ok()) return fail(s);
  slide::core::log_info("evaluated", {{"tiles", st->samples}, {"accuracy", st->accuracy},
                                      {"balanced_accuracy", st->balanced_accuracy}, {"roc_auc", st->roc_auc}});
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  // From the start: a Ctrl-C during set-up then stops at the first step, with a checkpoint.
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  CLI::App app{"slide-train: train a CNN tile classifier on slide-tile stores, on the CPU (oneDNN); resumable"};
  app.set_version_flag("--version", std::string("slide-train ") + SLIDE_VERSION);
  app.set_config("--config", "", "Read options from a TOML/INI file (keys are the long option names)");
  std::vector<std::string> data, val_data;
  std::string model_name = "small", out, optimizer = "sgd", schedule = "cosine", backend = "cpu", budget;
  int epochs = 10, keep = 3, threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int64_t batch = 32, accumulate = 1, width = 16;
  double lr = 0.1, momentum = 0.9, weight_decay = 1e-4, warmup_epochs = 0, smoothing = 0, val_fraction = 0.2;
  uint64_t seed = 0;
  bool nesterov = false, resume = false, no_augment = false, quiet = false, log_json = false;
  app.require_subcommand(0, 1);
  app.add_option("--data", data, "Tile stores to train on (labelled: patch folders or a manifest with labels)")
      ->check(CLI::ExistingDirectory);
  std::string labels_csv;
  app.add_option("--labels", labels_csv, "CSV with slide_id,label columns: slide labels instead of the stores'")
      ->check(CLI::ExistingFile);
  app.add_option("--val-data", val_data, "Validation stores (default: --val-fraction of the slides, split by slide)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--out", out, "Output directory: checkpoints/, best.safetensors, metrics.jsonl, metrics.csv");
  auto* eval = app.add_subcommand("evaluate", "A checkpoint's metrics on stores, with per-tile and per-slide CSVs");
  std::string eval_ckpt, eval_out;
  std::vector<std::string> eval_data;
  eval->add_option("--checkpoint", eval_ckpt, "A checkpoints/epoch-E-step-S directory")->required()
      ->check(CLI::ExistingDirectory);
  eval->add_option("--data", eval_data, "Labelled tile stores")->required()->check(CLI::ExistingDirectory);
  eval->add_option("--out", eval_out, "Output directory: predictions.csv, slides.csv, metrics.json")->required();
  std::string eval_labels;
  eval->add_option("--labels", eval_labels, "CSV with slide_id,label columns")->check(CLI::ExistingFile);
  app.add_option("--model", model_name, "small | resnet18 | resnet34 | resnet50")->capture_default_str();
  app.add_option("--width", width, "Channels of the small CNN's first stage")->capture_default_str();
  app.add_option("--epochs", epochs, "Epochs")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch, "Samples per optimizer step")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--accumulate", accumulate, "Micro-batches per step (gradient accumulation)")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "Peak learning rate")->capture_default_str();
  app.add_option("--optimizer", optimizer, "sgd | adamw")->capture_default_str();
  app.add_option("--momentum", momentum, "SGD momentum")->capture_default_str();
  app.add_flag("--nesterov", nesterov, "Nesterov momentum");
  app.add_option("--weight-decay", weight_decay, "Weight decay (L2 for sgd, decoupled for adamw)")->capture_default_str();
  app.add_option("--schedule", schedule, "cosine | step | constant")->capture_default_str();
  app.add_option("--warmup-epochs", warmup_epochs, "Linear warm-up, in epochs")->capture_default_str();
  app.add_option("--label-smoothing", smoothing, "Label smoothing in [0, 1)")->capture_default_str();
  std::string cache = "auto";
  app.add_option("--cache", cache,
                 "ram: decode the dataset once and keep it in memory; none; auto: ram when it fits in half of the "
                 "memory budget left (or of the available memory)")
      ->capture_default_str();
  std::string class_weights = "none";
  app.add_option("--class-weights", class_weights,
                 "none | balanced (n / (classes x n_c) over the training tiles) | w1,w2,... (one per class)")
      ->capture_default_str();
  app.add_option("--val-fraction", val_fraction, "Fraction of slides held out for validation")->capture_default_str();
  app.add_option("--seed", seed, "Seed of initialisation, split and shuffling")->capture_default_str();
  app.add_option("--threads", threads, "Decode threads")->capture_default_str();
  app.add_option("--backend", backend, "cpu (oneDNN) | reference")->capture_default_str();
  app.add_option("--memory-budget", budget, "Host memory budget for tensors, e.g. 8G (exceeding it is an error)");
  app.add_option("--keep", keep, "Checkpoints to keep")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--resume", resume, "Continue from the newest checkpoint in --out");
  app.add_flag("--no-augment", no_augment, "No flips or rotations");
  app.add_flag("-q,--quiet", quiet, "Only warnings and errors");
  app.add_flag("--log-json", log_json, "Log records as JSON lines on stderr");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error is exit code 2 (CLI11 has its own numbers).
    return app.exit(e) == 0 ? kExitOk : kExitUsage;
  }
  slide::core::set_log_json(log_json);
  if (quiet) slide::core::set_log_level(slide::core::LogLevel::kWarn);
  if (eval->parsed()) return run_evaluate(eval_ckpt, eval_data, eval_labels, eval_out, batch, threads, backend);
  if (data.empty() || out.empty()) {
    std::fprintf(stderr, "slide-train: --data and --out are required (or use: slide-train evaluate ...)\n");
    return kExitUsage;
  }

  // Everything that can be wrong with the input is checked before training starts.
  if (!budget.empty()) {
    auto b = parse_bytes(budget);
    if (!b.ok()) return fail(b.status().with_context("--memory-budget"));
    cpu_allocator().set_budget_bytes(*b);
  }
  auto be = make_backend(backend);
  if (!be.ok()) return fail(be.status());
  std::vector<std::string> all = data;
  all.insert(all.end(), val_data.begin(), val_data.end());
  auto ds = TileDataset::open(all, labels_csv);
  if (!ds.ok()) return fail(ds.status());
  std::vector<size_t> train, val;
  if (val_data.empty()) {
    (*ds)->split_by_slide(val_fraction, seed, &train, &val);
  } else {
    for (size_t i = 0; i < (*ds)->tiles().size(); ++i)
      ((*ds)->tiles()[i].store < data.size() ? train : val).push_back(i);
  }
  if (train.empty()) return fail(slide::core::invalid_argument("no training tiles after the split"));
  const auto classes = static_cast<int64_t>((*ds)->class_names().size());
  if (classes < 2) return fail(slide::core::invalid_argument("the stores hold fewer than two classes"));

  Run run;
  auto model = make_model(model_name, classes, width, seed);
  if (!model.ok()) return fail(model.status());
  run.model = std::move(*model);
  run.model->collect("", &run.params, &run.buffers);
  OptimizerConfig oc;
  oc.name = optimizer;
  oc.momentum = momentum;
  oc.nesterov = nesterov;
  oc.weight_decay = weight_decay;
  auto opt = Optimizer::make(oc, run.params, cpu_allocator());
  if (!opt.ok()) return fail(opt.status());
  run.opt = std::move(*opt);
  const int64_t steps_per_epoch = (static_cast<int64_t>(train.size()) + batch - 1) / batch;
  Schedule sched;
  sched.kind = schedule;
  sched.base_lr = lr;
  sched.warmup_steps = static_cast<int64_t>(warmup_epochs * static_cast<double>(steps_per_epoch));
  sched.total_steps = steps_per_epoch * epochs;
  sched.step_size = std::max<int64_t>(1, sched.total_steps / 3);
  if (schedule != "cosine" && schedule != "step" && schedule != "constant")
    return fail(slide::core::invalid_argument("schedule '" + schedule + "' is not one of cosine, step, constant"));

  if (cache != "auto" && cache != "ram" && cache != "none")
    return fail(slide::core::invalid_argument("--cache '" + cache + "' is not one of auto, ram, none"));
  slide::core::ThreadPool pool(static_cast<size_t>(std::max(1, threads)));
  if (cache != "none") {
    const size_t budget_left = cpu_allocator().budget_bytes() == Allocator::kUnlimited
                                   ? static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE))
                                   : cpu_allocator().budget_bytes() - cpu_allocator().current_bytes();
    if (cache == "ram" || (*ds)->decoded_bytes() <= budget_left / 2) {
      if (auto s = (*ds)->cache_in_ram(&pool, cpu_allocator()); !s.ok()) {
        if (cache == "ram") return fail(s.with_context("--cache ram"));
        slide::core::log_warn("dataset not cached in RAM", {{"why", s.to_string()}});
      } else {
        slide::core::log_info("dataset cached in RAM", {{"bytes", static_cast<int64_t>((*ds)->decoded_bytes())}});
      }
    }
  }
  Tensor weights;
  if (class_weights == "balanced") {
    auto w = balanced_class_weights(**ds, train, cpu_allocator());
    if (!w.ok()) return fail(w.status());
    weights = *w;
  } else if (class_weights != "none") {
    auto w = Tensor::empty({classes}, DType::kF32, cpu_allocator(), "class weights");
    if (!w.ok()) return fail(w.status());
    std::stringstream in(class_weights);
    std::string item;
    int64_t i = 0;
    while (std::getline(in, item, ',')) {
      char* end = nullptr;
      const double v = std::strtod(item.c_str(), &end);
      if (i >= classes || end == item.c_str() || *end != '\0' || !(v >= 0))
        return fail(slide::core::invalid_argument("--class-weights '" + class_weights + "': give " +
                                                  std::to_string(classes) + " non-negative numbers, or balanced, or none"));
      w->data<float>()[i++] = static_cast<float>(v);
    }
    if (i != classes)
      return fail(slide::core::invalid_argument("--class-weights '" + class_weights + "': give " +
                                                std::to_string(classes) + " numbers (classes: " +
                                                nlohmann::json((*ds)->class_names()).dump() + ")"));
    weights = *w;
  }

  const std::string ckpt_dir = out + "/checkpoints";
  if (auto s = slide::core::make_dirs(ckpt_dir); !s.ok()) return fail(s);
  nlohmann::json state = {{"epoch", 0}, {"step_in_epoch", 0}, {"optimizer_steps", 0}, {"model", model_name},
                          {"width", width},
                          {"classes", (*ds)->class_names()}, {"history", nlohmann::json::array()},
                          {"best_val_balanced_accuracy", -1.0}};
  if (resume) {
    const std::vector<fs::path> checkpoints = list_checkpoints(ckpt_dir);
    const std::string latest = checkpoints.empty() ? "" : checkpoints.back().string();
    if (latest.empty()) return fail(slide::core::not_found("--resume: no complete checkpoint in " + ckpt_dir));
    auto text = slide::core::read_file(latest + "/state.json");
    if (!text.ok()) return fail(text.status());
    nlohmann::json saved = nlohmann::json::parse(*text, nullptr, false);
    if (saved.is_discarded() || saved.value("model", "") != model_name || saved["classes"] != state["classes"])
      return fail(slide::core::invalid_argument(latest + ": made with another model or class list"));
    if (auto s = load_safetensors(latest + "/model.safetensors", named(run.params, run.buffers)); !s.ok()) return fail(s);
    std::vector<NamedTensor> opt_state;
    for (auto* b : run.opt->state()) opt_state.push_back({b->name, &b->value});
    if (!opt_state.empty())
      if (auto s = load_safetensors(latest + "/optimizer.safetensors", opt_state); !s.ok()) return fail(s);
    state = saved;
    run.opt->set_steps(state["optimizer_steps"].get<int64_t>());
    slide::core::log_info("resumed", {{"checkpoint", latest}});
  }

  slide::core::log_info("training", {{"model", model_name}, {"train_tiles", static_cast<int64_t>(train.size())},
                                     {"val_tiles", static_cast<int64_t>(val.size())}, {"classes", classes},
                                     {"steps_per_epoch", steps_per_epoch}, {"backend", backend}});
  for (long epoch = state["epoch"].get<long>(); epoch < epochs; ++epoch) {
    TrainOptions to;
    to.batch_size = batch;
    to.accumulate = accumulate;
    to.label_smoothing = smoothing;
    to.class_weights = weights;
    to.augment = !no_augment;
    to.start_step = state["step_in_epoch"].get<int64_t>();
    to.cancel = &g_cancel;
    const double lr_now = sched.at(run.opt->steps());
    auto st = train_epoch(**be, *run.model, *run.opt, sched, **ds, train, to, seed * 7919 + static_cast<uint64_t>(epoch),
                          &pool);
    if (!st.ok()) return fail(st.status().with_context("epoch " + std::to_string(epoch)));
    state["optimizer_steps"] = run.opt->steps();
    if (!st->completed) {
      state["epoch"] = epoch;
      state["step_in_epoch"] = to.start_step + st->steps;
      if (auto s = save_checkpoint(ckpt_dir, run, state, keep); !s.ok()) return fail(s);
      slide::core::log_warn("interrupted; checkpoint written, continue with --resume",
                            {{"epoch", epoch}, {"step", state["step_in_epoch"].get<int64_t>()}});
      return kExitInterrupted;
    }
    EpochStats v;
    if (!val.empty()) {
      auto ev = evaluate(**be, *run.model, **ds, val, batch, &pool);
      if (!ev.ok()) return fail(ev.status().with_context("validation"));
      v = *ev;
    }
    // A resumed epoch's train figures cover only the steps run after the resume.
    state["history"].push_back({{"epoch", epoch + 1}, {"train_loss", st->loss}, {"train_accuracy", st->accuracy},
                                {"val_loss", v.loss}, {"val_accuracy", v.accuracy},
                                {"val_balanced_accuracy", v.balanced_accuracy}, {"val_roc_auc", v.roc_auc},
                                {"val_recall", v.recall}, {"lr", lr_now},
                                {"seconds", st->seconds + v.seconds}, {"images_per_s", st->samples / st->seconds}});
    state["epoch"] = epoch + 1;
    state["step_in_epoch"] = 0;
    if (auto s = write_metrics(out, state["history"]); !s.ok()) return fail(s);
    if (v.balanced_accuracy > state["best_val_balanced_accuracy"].get<double>()) {
      state["best_val_balanced_accuracy"] = v.balanced_accuracy;
      state["best_epoch"] = epoch + 1;
      if (auto s = save_safetensors(out + "/best.safetensors", named(run.params, run.buffers), {{"format", "pt"}}); !s.ok())
        return fail(s);
    }
    if (auto s = save_checkpoint(ckpt_dir, run, state, keep); !s.ok()) return fail(s);
    slide::core::log_info("epoch", {{"epoch", epoch + 1}, {"train_loss", st->loss}, {"train_accuracy", st->accuracy},
                                    {"val_accuracy", v.accuracy}, {"val_balanced_accuracy", v.balanced_accuracy},
                                    {"val_roc_auc", v.roc_auc},
                                    {"images_per_s", st->samples / st->seconds}});
  }
  std::fprintf(stderr, "peak tensor memory: %zu bytes\n", cpu_allocator().peak_bytes());
  return kExitOk;
}
