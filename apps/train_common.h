// Checkpoint files, metrics and learning curves of slide-train, shared by tile training
// (slide_train_main.cpp) and MIL training on feature bags (slide_train_mil.cpp): one layout for
// both, `checkpoints/epoch-E-step-S/{model,optimizer}.safetensors,state.json`, metrics.jsonl,
// metrics.csv and curves.png.
#pragma once

#include <CLI/CLI.hpp>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "report.h"
#include "slide/core/dir_lock.h"
#include "slide/core/status.h"
#include "slide/train/checkpoint.h"
#include "slide/train/layers.h"
#include "slide/train/optimizer.h"
#include "slide/train/trainer.h"

namespace slide::apps {

// --- Numeric options --------------------------------------------------------------------------
// The ranges of slide-train's real-valued options, as PyTorch's optimizers and layers check them
// (torch.optim.SGD / AdamW: lr >= 0, momentum >= 0, weight_decay >= 0; we also require finite
// values and momentum < 1, where SGD's buffer stops decaying): lr, weight-decay, warmup-epochs
// finite >= 0; momentum, label-smoothing, val-fraction in [0, 1); dropout in [0, 0.95];
// mil-dropout in [0, 0.99]; random-resized-crop in [0.01, 1]; dist-timeout finite > 0; epochs an
// integer >= 1. NaN and inf are never in range.
//
// check_number_option(option, value): `option` is the long name without dashes ("lr"), `value`
// the text given. Returns "" when the value is in range or the option is not one of those above,
// else the reason ("--lr nan: must be a finite number >= 0"). Used by the command line and by the
// sweep's grid check (every trial's values before any trial starts).
std::string check_number_option(const std::string& option, const std::string& value);
// The same as a CLI11 validator (a value out of range is a usage error: exit 2).
CLI::Validator number_option(const std::string& option);

// --- Output directories -----------------------------------------------------------------------
// The files and folders an earlier training run leaves in --out (train_common.cpp's list:
// checkpoints/ when it holds anything, metrics.jsonl, metrics.csv, curves.png, report.html, best.safetensors,
// attention/, test/), by name, those present. writer.lock, and a sweep's log.txt, pid and result.json,
// are not a run's files.
std::vector<std::string> earlier_run_files(const std::string& out);

// Takes --out for this process (slide::core::DirLock, "<out>/writer.lock", held until the lock
// is destroyed; the directory is created) and checks what is there: an earlier run's files
// (earlier_run_files) are refused unless `resume` (continue it) or `overwrite` (replace it:
// remove_earlier_run, called by the caller just before it first writes). Errors: kUnavailable
// (another process holds the lock: names the directory and its pid), kInvalidArgument (--resume
// with --overwrite; an earlier run without either, naming the directory and its files), those
// of creating the directory.
[[nodiscard]] slide::core::Result<std::unique_ptr<slide::core::DirLock>> claim_out_dir(const std::string& out,
                                                                                       bool resume, bool overwrite);

// slide-train evaluate --out: the same lock; an earlier evaluation's predictions.csv, slides.csv or
// metrics.json is refused unless `overwrite` (the new evaluation then replaces the files of the
// same names, each atomically, as it writes them). Errors: as claim_out_dir's.
[[nodiscard]] slide::core::Result<std::unique_ptr<slide::core::DirLock>> claim_eval_dir(const std::string& out,
                                                                                        bool overwrite);

// --overwrite: removes the earlier run's files from `out` (checkpoints/ whole, metrics.jsonl,
// metrics.csv, curves.png, report.html, best.safetensors, attention/; a MIL --attention-dir elsewhere is left
// alone: its files are replaced as they are written). Errors: kInternal / kPermissionDenied
// naming the path.
[[nodiscard]] slide::core::Status remove_earlier_run(const std::string& out);

// Before training: a warning for each class with nothing on one side of the split ("a class has no
// training <unit> after the split", likewise "validation", with the class and `seed`). The splits
// by slide or patient are not stratified: with few slides a class can land on one side only,
// never learnt or its recall undefined; the run goes on (a user may mean it). A side left empty
// (no validation set) says nothing. `label_of(i)`: the class index of position i of `train` and
// `val`; one outside [0, class_names.size()) counts for no class.
void warn_classes_missing_from_split(const std::vector<std::string>& class_names, const std::vector<size_t>& train,
                                     const std::vector<size_t>& val, const std::function<int32_t(size_t)>& label_of,
                                     const std::string& unit, uint64_t seed);

// The tile classifier `name` (small | resnet18 | resnet34 | resnet50; train/layers.h) with
// `classes` outputs, built and initialised (from `seed`; without one, for a model whose weights a
// checkpoint is about to overwrite, left zero: layers.h InitRng) on the host. `width`: the small
// CNN's first-stage channels. Errors: kInvalidArgument for another name.
[[nodiscard]] slide::core::Result<std::unique_ptr<slide::train::Sequential>> make_tile_model(
    const std::string& name, int64_t classes, int64_t width, std::optional<uint64_t> seed, double dropout = 0);

// --- Metric values -----------------------------------------------------------------------
// A metric that may be undefined (ROC AUC without both classes, a class's recall without samples;
// EpochStats marks them -1) as JSON: null when undefined, else the number.
nlohmann::json metric_or_null(double value);
nlohmann::json metrics_or_null(const std::vector<double>& values);
// A probability for a CSV: clamped to [0, 1] (a softmax's float rounding can exceed 1 by an ulp),
// in the shortest text that reads back to the same float (std::to_chars).
std::string probability_text(float p);
// A heatmap that could not be drawn, at the end of a run's per-slide outputs: kInvalidArgument
// (draw_tile_grid's refusal of a tile grid over 2^24 cells, from tiles spread over a huge span) is
// skipped with the warning `warning`, naming the slide and why, and OK is returned (the slide keeps
// its other files and its row); any other error (writing: a full disk) is returned, to end the run.
[[nodiscard]] slide::core::Status skip_undrawable_heatmap(const slide::core::Status& error, const std::string& slide_id,
                                                         const char* warning);

// --- Checkpoint records -----------------------------------------------------------------------
// Checks a checkpoint's state.json (already parsed; `file` names it in messages) against the
// record save_checkpoint writes, before any field is used: epoch, step_in_epoch,
// optimizer_steps integers >= 0; epochs an integer >= 1; model a string; classes an array of at
// least two strings; history an array of `epoch` objects whose epoch (integer >= 1), train_loss,
// train_accuracy, val_loss, val_accuracy, val_balanced_accuracy, val_roc_auc, lr and seconds are
// numbers (the val_ ones may be null: undefined or not finite); best_val_balanced_accuracy and best_score numbers, best_metric a string and
// best_epoch an integer >= 1 when present; config an object when present; tile models: width an
// integer >= 1 and dropout a number when present; "abmil": mil an object with in_features,
// hidden, attention integers >= 1 and dropout a number. Errors: kDataLoss naming `file` and the
// first field that is wrong ("state.json: field 'epoch' is "x", expected an integer >= 0").
[[nodiscard]] slide::core::Status validate_run_state(const std::string& file, const nlohmann::json& state);

// A checkpoint given to evaluate or predict (--checkpoint), with its model's description:
// `path` is a checkpoints/epoch-E-step-S directory (model.safetensors + state.json), a weights
// file inside one, or a run's best.safetensors (described by the newest complete checkpoint of
// the run's checkpoints/). The state.json is read and checked (validate_run_state). Used by
// evaluate, predict and --resume (tile and MIL runs).
struct CheckpointRecord {
  std::string weights, state_file;
  nlohmann::json state;
};
// Errors: kInvalidArgument (a weights file without a description next to it, saying what to
// give), the file's (kNotFound), kDataLoss (state.json not JSON, or not a checkpoint record).
[[nodiscard]] slide::core::Result<CheckpointRecord> open_checkpoint_record(const std::string& path);

// The parameters, then the buffers, as named tensors for safetensors (pointers into them).
std::vector<slide::train::NamedTensor> named(const std::vector<slide::train::Parameter*>& ps,
                                             const std::vector<slide::train::Buffer*>& bs);

// The complete checkpoint directories ("epoch-E-step-S", no ".partial") in `dir`, oldest first.
std::vector<std::filesystem::path> list_checkpoints(const std::string& dir);

// best.safetensors' rule, for tile and bag training: epoch `epoch` (1-based) is the new best when
// its validation `metric` (balanced_accuracy | accuracy | roc_auc | loss: the lowest loss, else
// the highest value) beats every earlier epoch's. Records best_score, best_metric ("val_" +
// metric) and best_epoch in `state` when it does, and best_val_balanced_accuracy (read by sweeps)
// always. Without a validation set (`validated` false: --val-fraction 0) every epoch is the new
// best, best_metric "last_epoch" and best_score 0, so that best.safetensors (and a --test-fraction
// evaluation) is the last epoch's, not the first's. Returns whether this epoch is the new best.
bool record_best_epoch(nlohmann::json* state, const slide::train::EpochStats& val, const std::string& metric,
                       long epoch, bool validated = true);

// --resume's check of the options that change the math of a run: `config` (this run's) against
// the "config" record of `saved` (the checkpoint's state.json). Errors: kInvalidArgument naming
// `checkpoint` and every difference ("--lr 0.1 -> 0.2;"), an option given now and not then or
// then and not now included ("(unset)"; --init, which only chose the first weights, may be left
// out). A checkpoint without the record (made before it existed) passes. Another `epochs` than saved["epochs"] is allowed, with a warning.
// Options recorded only since 2026-11-29 (`activations`, `sync_bn`) given now and absent from the
// record pass with a warning: the checkpoint may predate them.
[[nodiscard]] slide::core::Status check_resume_config(const std::string& checkpoint, const nlohmann::json& saved,
                                                      const nlohmann::json& config, long epochs);

// --resume's check of where the checkpoint's epoch stopped: an interrupt is taken before a step,
// so saved["step_in_epoch"] must be below `steps_per_epoch` (>= 1). Errors: kDataLoss naming
// `checkpoint`/state.json.
[[nodiscard]] slide::core::Status check_resume_step(const std::string& checkpoint, const nlohmann::json& saved,
                                                    int64_t steps_per_epoch);

// Which slides (or bags) a run trains, validates and tests on: `split` holds one (id, part) per
// slide, part "train", "val" or "test". Returns {"train": n, "val": n, "test": n, "sha256": the
// SHA-256 (hash.h) of the sorted lines "<part>\t<id>\n"}, which a run keeps in its state.json
// ("split"). Errors: sha256_bytes's.
[[nodiscard]] slide::core::Result<nlohmann::json> split_record(
    std::vector<std::pair<std::string, std::string>> split);

// --resume's check that the data split is the checkpoint's: `record` (split_record of this run)
// against saved["split"]. Stores, bags or labels added or removed, or another --val-fraction or
// --test-fraction would move slides between training and validation, and the resumed run would
// validate on slides it trained on. Errors: kInvalidArgument naming `checkpoint` and both splits'
// counts. A checkpoint without the record (made before it existed) passes, with a warning.
[[nodiscard]] slide::core::Status check_resume_split(const std::string& checkpoint, const nlohmann::json& saved,
                                                     const nlohmann::json& record);

// Which labels a run trains on: `counts` maps (slide id, class name) to how many of the slide's
// tiles (or bags: 1) carry that class. Returns {"sha256": the SHA-256 (hash.h) of the lines
// "<slide id>\t<class>\t<count>\n" in the map's order, "per_class": {class: count summed over
// slides}}, which a run keeps in its state.json ("labels"). The split record (split_record) names
// only the slides on each side; this one changes when a slide is relabelled in the labels CSV (or
// re-tiled with other annotations) under the same file names. Errors: sha256_bytes's.
[[nodiscard]] slide::core::Result<nlohmann::json> labels_record(
    const std::map<std::pair<std::string, std::string>, int64_t>& counts);

// --resume's check that the labels are the checkpoint's: `record` (labels_record of this run)
// against saved["labels"]. A labels CSV edited in place (or stores re-tiled with other labels) would
// go on training the checkpoint's weights towards other targets, its history and best epoch
// measured against the old ones. Errors: kInvalidArgument naming `checkpoint` and both records'
// counts per class. A checkpoint without the record (made before it existed) passes, with a warning.
[[nodiscard]] slide::core::Status check_resume_labels(const std::string& checkpoint, const nlohmann::json& saved,
                                                      const nlohmann::json& record);

// Writes <dir>/epoch-E-step-S (E, S: state["epoch"], state["step_in_epoch"]): model.safetensors
// (parameters and buffers), optimizer.safetensors (the optimizer's state, when it has any) and
// state.json, in a .partial directory renamed into place; keeps the newest `keep`. Errors: those
// of writing the files (kResourceExhausted for a full disk), with context naming the checkpoint and
// the newest complete one (the .partial directory is removed, giving its space back), and of the
// rename. Tensors on a device are downloaded through `device`
// (their backend; nullptr when all are host tensors).
[[nodiscard]] slide::core::Status save_checkpoint(const std::string& dir,
                                                  const std::vector<slide::train::Parameter*>& params,
                                                  const std::vector<slide::train::Buffer*>& buffers,
                                                  slide::train::Optimizer& opt, const nlohmann::json& state, int keep,
                                                  slide::train::Backend* device = nullptr);

// curves.png: the learning curves, 960 x 392, a title over two panels with axes, labelled ticks,
// axis labels and legends (drawn with cairo, slide/tile/figure.h): "Loss" (train blue, validation
// orange) and "Validation accuracy" on 0..1 (accuracy green, balanced accuracy red), epochs along
// x, a dot per epoch. A missing value (null) leaves a gap.
[[nodiscard]] slide::core::Status write_curves_png(const std::string& out, const nlohmann::json& history);

// metrics.jsonl and metrics.csv, rewritten whole (atomically) from the history (per epoch:
// epoch, train_loss, train_accuracy, val_loss, val_accuracy, val_balanced_accuracy,
// val_roc_auc, lr, seconds), then curves.png.
[[nodiscard]] slide::core::Status write_metrics(const std::string& out, const nlohmann::json& history);

// The per-class table (samples, recall, precision, predicted as it) and the confusion matrix
// (`m`: classes x classes, row-major, rows true classes; trainer.h confusion_matrix) as tables "classes"
// and "confusion" of `r`; nothing when m's size is not classes^2.
void add_confusion_tables(HtmlReport& r, const std::vector<std::string>& classes, const std::vector<int64_t>& m);

// `m` (classes x classes, row-major) as JSON rows, for metrics.json's "confusion"; [] when its size
// is not classes^2.
nlohmann::json confusion_rows(const std::vector<int64_t>& m, size_t classes);

// <out>/report.html of `slide-train evaluate`: `metrics` (metrics.json's scalars) and the tables of
// add_confusion_tables. Errors: writing the file.
[[nodiscard]] slide::core::Status write_eval_report(const std::string& out, const nlohmann::json& metrics,
                                                    const std::vector<std::string>& classes,
                                                    const std::vector<int64_t>& confusion);

// <out>/report.html (report.h), rewritten (atomically) after each epoch from the run's state (its
// state.json record: "model", "classes", "config", "history", "best_epoch", "memory"): the run's
// options, curves.png (written by write_metrics before), a row per epoch, the last validation's
// per-class recall and precision and its confusion matrix (history's "val_confusion": rows true
// classes, columns predicted), the memory plan, and `peak_bytes` of tensor memory so far on
// `device`. Errors: reading curves.png (kNotFound when missing), writing the file.
[[nodiscard]] slide::core::Status write_train_report(const std::string& out, const nlohmann::json& state,
                                                     size_t peak_bytes, const std::string& device);

}  // namespace slide::apps
