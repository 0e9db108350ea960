// Checkpoint files, metrics and learning curves of slide-train, shared by tile training
// (slide_train_main.cpp) and MIL training on feature bags (slide_train_mil.cpp): one layout for
// both, `checkpoints/epoch-E-step-S/{model,optimizer}.safetensors,state.json`, metrics.jsonl,
// metrics.csv and curves.png.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "slide/core/status.h"
#include "slide/train/checkpoint.h"
#include "slide/train/optimizer.h"
#include "slide/train/trainer.h"

namespace slide::apps {

// The parameters, then the buffers, as named tensors for safetensors (pointers into them).
std::vector<slide::train::NamedTensor> named(const std::vector<slide::train::Parameter*>& ps,
                                             const std::vector<slide::train::Buffer*>& bs);

// The complete checkpoint directories ("epoch-E-step-S", no ".partial") in `dir`, oldest first.
std::vector<std::filesystem::path> list_checkpoints(const std::string& dir);

// best.safetensors' rule, for tile and bag training: epoch `epoch` (1-based) is the new best when
// its validation `metric` (balanced_accuracy | accuracy | roc_auc | loss: the lowest loss, else
// the highest value) beats every earlier epoch's. Records best_score, best_metric ("val_" +
// metric) and best_epoch in `state` when it does, and best_val_balanced_accuracy (read by sweeps)
// always. Returns whether this epoch is the new best.
bool record_best_epoch(nlohmann::json* state, const slide::train::EpochStats& val, const std::string& metric,
                       long epoch);

// --resume's check of the options that change the math of a run: `config` (this run's) against
// the "config" record of `saved` (the checkpoint's state.json). Errors: kInvalidArgument naming
// `checkpoint` and every difference ("--lr 0.1 -> 0.2;"). A checkpoint without the record (made
// before it existed) passes. Another `epochs` than saved["epochs"] is allowed, with a warning.
[[nodiscard]] slide::core::Status check_resume_config(const std::string& checkpoint, const nlohmann::json& saved,
                                                      const nlohmann::json& config, long epochs);

// Writes <dir>/epoch-E-step-S (E, S: state["epoch"], state["step_in_epoch"]): model.safetensors
// (parameters and buffers), optimizer.safetensors (the optimizer's state, when it has any) and
// state.json, in a .partial directory renamed into place; keeps the newest `keep`. Errors: those
// of writing the files and of the rename.
[[nodiscard]] slide::core::Status save_checkpoint(const std::string& dir,
                                                  const std::vector<slide::train::Parameter*>& params,
                                                  const std::vector<slide::train::Buffer*>& buffers,
                                                  slide::train::Optimizer& opt, const nlohmann::json& state, int keep);

// curves.png: the learning curves, 640 x 360, epochs along x. Train loss (blue) and validation
// loss (orange) scaled to the largest loss; validation accuracy (green) and balanced accuracy
// (red) on 0..1. Light grid lines at tenths; no text (the numbers are in metrics.csv).
[[nodiscard]] slide::core::Status write_curves_png(const std::string& out, const nlohmann::json& history);

// metrics.jsonl and metrics.csv, rewritten whole (atomically) from the history (per epoch:
// epoch, train_loss, train_accuracy, val_loss, val_accuracy, val_balanced_accuracy,
// val_roc_auc, lr, seconds), then curves.png.
[[nodiscard]] slide::core::Status write_metrics(const std::string& out, const nlohmann::json& history);

}  // namespace slide::apps
