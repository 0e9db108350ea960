// slide-train --features: attention MIL (ABMIL) on HDF5 feature bags (libtrain/mil.h), with the
// checkpoint, metrics and resume layout of tile training (train_common.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace slide::apps {

// What MIL training takes from slide-train's command line: the options it shares with tile
// training, and its own (registered by add_mil_options).
struct MilOptions {
  // Shared with tile training (slide_train_main.cpp fills them from its own options).
  std::string labels_csv, out, optimizer = "adamw", schedule = "cosine", backend = "cpu", budget, cache = "auto",
                          class_weights = "none";
  std::string best_metric = "balanced_accuracy";  // --best-metric: picks best.safetensors
  int epochs = 10, keep = 3;
  int64_t batch = 1;
  double lr = 2e-4, momentum = 0.9, weight_decay = 1e-5, warmup_epochs = 0, label_smoothing = 0, val_fraction = 0.2;
  uint64_t seed = 0;
  bool nesterov = false, resume = false, overwrite = false, stratify = false;
  // Registered by add_mil_options.
  std::vector<std::string> features;  // bag directories (slide-embed output)
  int64_t hidden = 512, attention = 256;
  double dropout = 0;
  int prefetch = 2;
  std::string attention_dir;  // default <out>/attention
  bool no_attention = false;
  std::vector<std::string> slide_stores;  // tile stores whose slide records locate the slides (heatmaps)
};

// Adds --features, --mil-hidden, --mil-attention, --mil-dropout, --prefetch, --attention-dir,
// --no-attention, --slide-stores.
void add_mil_options(CLI::App& app, MilOptions* options);

// Runs MIL training (and writes the attention outputs at the end). The options it shares with
// tile training are read from `app` (slide-train's parsed command line) where given, else
// MilOptions' defaults (CLAM's: AdamW, lr 2e-4, weight decay 1e-5, one bag per step); tile-only
// options (--data, --val-data, --model, --width, --accumulate, augmentation, --dist, ...) are a
// usage error; --dropout is --mil-dropout's synonym. --out is locked for the run and an earlier
// run there refused unless --resume or --overwrite (train_common.h, claim_out_dir). Returns the
// process exit code: 0 ok, 1 failed (another process writing --out included), 2 usage or bad
// input (checked before any work; an earlier run in --out), 130 interrupted (a checkpoint is
// written first; --resume continues exactly).
int run_mil_training(const CLI::App& app, MilOptions options, const std::atomic<bool>* cancel);

// slide-train evaluate|predict --features BAGS... --checkpoint CK --out DIR: an attention-MIL
// checkpoint over bags (labels from the bags or --labels, matched to the checkpoint's classes by
// name; predict needs none).
struct MilEvaluateOptions {
  std::vector<std::string> features;
  std::vector<std::string> slide_stores;
  int prefetch = 2;
};
// Adds --features and --slide-stores to the evaluate or predict subcommand and makes its --data
// optional (one of the two).
void add_mil_evaluate_options(CLI::App& evaluate, MilEvaluateOptions* options);
// Writes OUT/predictions.csv (per bag: label, probabilities, prediction), OUT/<bag>.h5 (its
// attention) and OUT/<bag>.png (heatmap), OUT/metrics.json (loss, accuracy, balanced accuracy,
// ROC AUC, recall). `checkpoint`: as train_common.h's open_checkpoint_record takes it (a
// checkpoint directory, its model.safetensors, or a run's best.safetensors). With `predict`
// (slide-train predict --features: new slides), bags need no label: an unlabelled bag's label
// column and attribute are empty, and metrics.json is written only when every bag has a label.
// Takes OUT's writer lock and refuses an earlier evaluation there unless `overwrite`
// (train_common.h, claim_eval_dir). Returns the exit code: 0 ok, 1 failed (another process
// writing OUT included), 2 bad input.
int run_mil_evaluate(const std::string& checkpoint, const MilEvaluateOptions& options, const std::string& labels_csv,
                     const std::string& out, const std::string& backend, bool overwrite, bool predict = false);

}  // namespace slide::apps
