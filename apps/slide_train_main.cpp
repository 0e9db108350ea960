// slide-train: trains a CNN classifier on slide-tile stores (DESIGN.md, "The engine").
//
// Exit codes: 0 ok, 1 failed, 2 usage or bad input (before any work starts), 130 interrupted
// (Ctrl-C: the current step finishes, a checkpoint is written; --resume continues exactly).
//
// --out (and evaluate's --out) is locked for the whole run (<out>/writer.lock, train_common.h:
// another writer exits 1 at once, naming the holder's pid; with --dist only rank 0, the one rank
// that writes it, takes it). An --out holding an earlier run is refused (exit 2) unless --resume
// continues it or --overwrite replaces it. Out-of-range option values are usage errors (exit 2);
// NaN or inf in a loss, a gradient, a learning rate, loaded weights or a bag stops the run (exit 1)
// before anything non-finite is written.
#include <CLI/CLI.hpp>
#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli_checks.h"
#include "exit_codes.h"
#include "slide/core/csv.h"
#include "slide/core/file.h"
#include "slide/core/log.h"
#include "slide/core/progress.h"
#include "slide/tile/image.h"
#include "slide/train/checkpoint.h"
#include "slide/train/data_parallel.h"
#include "slide/train/device_select.h"
#include "slide/train/embed.h"
#include "slide/train/fine_tune.h"
#include "slide/train/stain.h"
#include "slide/train/trainer.h"
#include "backend_options.h"
#include "log_options.h"
#include "stain_options.h"
#include "train_common.h"
#include "slide_train_mil.h"
#include "slide_train_predict.h"
#include "launch.h"
#include "slide_train_dist.h"
#include "slide_train_memory.h"
#include "slide_train_sweep.h"

#include "interrupt.h"

namespace {

namespace fs = std::filesystem;
using slide::core::Status;
using namespace slide::train;

using slide::apps::kExitFailed;
using slide::apps::kExitInterrupted;
using slide::apps::kExitOk;
using slide::apps::kExitUsage;

std::atomic<bool>& g_cancel = slide::apps::interrupt_flag();
// The ranks (--dist); set once in main. With several, a failure on one rank takes the job down.
Communicator* g_comm = nullptr;

int fail(const Status& s) {
  slide::core::log_error(g_comm != nullptr && g_comm->world_size() > 1
                             ? "rank " + std::to_string(g_comm->rank()) + ": " + s.to_string()
                             : s.to_string());
  const int code = s.code() == slide::core::StatusCode::kInvalidArgument || s.code() == slide::core::StatusCode::kNotFound
                       ? kExitUsage
                       : kExitFailed;
  // The other ranks would otherwise wait in their next collective until --dist-timeout.
  if (g_comm != nullptr && g_comm->world_size() > 1) g_comm->abort_job(code);
  return code;
}

using slide::apps::make_tile_model;
using slide::apps::open_backend;

struct Run {
  std::unique_ptr<Sequential> model;
  std::unique_ptr<Optimizer> opt;
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
};

// Checkpoint files, metrics and curves: apps/train_common.h (shared with slide_train_mil.cpp).
using slide::apps::list_checkpoints;
using slide::apps::named;
using slide::apps::record_best_epoch;
using slide::apps::write_metrics;

Status save_checkpoint(const std::string& dir, Run& run, Backend& be, const nlohmann::json& state, int keep) {
  return slide::apps::save_checkpoint(dir, run.params, run.buffers, *run.opt, state, keep, &be);
}

}  // namespace

namespace {

int run_main(int argc, char** argv) {
  // From the start: a Ctrl-C during set-up then stops at the first step, with a checkpoint.
  slide::apps::install_interrupt_handlers("\ninterrupt: finishing the current step, then writing a checkpoint\n");
  CLI::App app{"slide-train: train a CNN tile classifier on slide-tile stores, on the CPU (oneDNN); resumable"};
  app.set_version_flag("--version", std::string("slide-train ") + SLIDE_VERSION);
  app.set_config("--config", "", "Read options from a TOML/INI file (keys are the long option names)");
  std::vector<std::string> data, val_data;
  std::string model_name = "small", out, optimizer = "sgd", schedule = "cosine", backend = "cpu", budget;
  std::string precision = "fp32";
  int epochs = 10, keep = 3, threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int64_t batch = 32, accumulate = 1, width = 16;
  int device = -1;  // --device: unset
  double lr = 0.1, momentum = 0.9, weight_decay = 1e-4, warmup_epochs = 0, smoothing = 0, val_fraction = 0.2;
  uint64_t seed = 0;
  bool nesterov = false, resume = false, no_augment = false;
  slide::apps::LogOptions log;
  app.require_subcommand(0, 1);
  app.add_option("--data", data, "Tile stores to train on (labelled: patch folders or a manifest with labels)")
      ->check(CLI::ExistingDirectory);
  std::string labels_csv;
  app.add_option("--labels", labels_csv,
                 "CSV with slide_id,label[,patient|case_id] columns: slide labels instead of the stores' (and the "
                 "split by patient); slide_id,patient alone: the stores' labels, split by patient")
      ->check(CLI::ExistingFile);
  std::vector<std::string> test_data;
  app.add_option("--test-data", test_data,
                 "Held-out test stores, never used for model choice: after the last epoch the model of "
                 "best.safetensors is evaluated on them into OUT/test/ (as slide-train evaluate)")
      ->check(CLI::ExistingDirectory);
  double test_fraction = 0;
  app.add_option("--test-fraction", test_fraction,
                 "Fraction of the patients (or slides) of --data held out as a test set before the validation split "
                 "(or the folds): never trained on nor used for model choice; evaluated with best.safetensors at "
                 "the end into OUT/test/")
      ->check(slide::apps::number_option("test-fraction"));
  app.add_option("--val-data", val_data, "Validation stores (default: --val-fraction of the slides, split by slide)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--out", out, "Output directory: checkpoints/, best.safetensors, metrics.jsonl, metrics.csv");
  auto* eval = app.add_subcommand("evaluate", "A checkpoint's metrics on stores, with per-tile and per-slide CSVs");
  std::string eval_ckpt, eval_out;
  std::vector<std::string> eval_data;
  eval->add_option("--checkpoint", eval_ckpt,
                   "A checkpoints/epoch-E-step-S directory, or a weights file: a run's best.safetensors or a "
                   "checkpoint's model.safetensors")
      ->required()->check(CLI::ExistingPath);
  eval->add_option("--data", eval_data, "Labelled tile stores")->required()->check(CLI::ExistingDirectory);
  eval->add_option("--out", eval_out, "Output directory: predictions.csv, slides.csv, metrics.json")->required();
  std::string eval_labels;
  eval->add_option("--labels", eval_labels, "CSV with slide_id,label columns")->check(CLI::ExistingFile);
  bool no_fused = false;
  bool eval_overwrite = false;
  eval->add_flag("--overwrite", eval_overwrite,
                 "Replace an earlier evaluation in --out (its predictions.csv, slides.csv, metrics.json and, with "
                 "--features, the attention files and heatmaps of the same names)");
  eval->add_flag("--no-fused", no_fused,
                 "Logits through the training engine's forward instead of the fused inference path "
                 "(batch norm folded, ReLU fused; the default on --backend cpu)");
  double eval_test_fraction = 0;
  uint64_t eval_seed = 0;
  eval->add_option("--test-fraction", eval_test_fraction,
                   "Only the test set a run with this --test-fraction and --seed held out of these stores")
      ->check(slide::apps::number_option("test-fraction"));
  eval->add_option("--seed", eval_seed, "The --seed of that run (with --test-fraction; default: the checkpoint's)");
  // The backend of evaluate (also accepted before `evaluate`, as an option of slide-train).
  slide::apps::add_backend_options(*eval, &backend, &device);
  slide::apps::add_precision_option(*eval, &precision);
  slide::apps::MilEvaluateOptions mil_eval;  // evaluate --features: an ABMIL checkpoint on bags
  slide::apps::add_mil_evaluate_options(*eval, &mil_eval);
  // slide-train predict: a tile classifier on stores with or without labels (slide_train_predict.h).
  slide::apps::TileInferenceOptions pred;
  auto* predict = app.add_subcommand(
      "predict", "A checkpoint's per-tile probabilities on new slides (no labels needed): CSVs, per-slide HDF5 and "
                 "heatmaps; with --features, an attention-MIL checkpoint's per-slide probabilities and attention; "
                 "metrics too when every slide has a label");
  predict->add_option("--checkpoint", pred.checkpoint,
                      "A checkpoints/epoch-E-step-S directory, or a weights file: a run's best.safetensors or a "
                      "checkpoint's model.safetensors")
      ->required()->check(CLI::ExistingPath);
  predict->add_option("--data", pred.data, "Tile stores, labelled or not")->required()->check(CLI::ExistingDirectory);
  predict->add_option("--out", pred.out,
                      "Output directory: predictions.csv, slides.csv, predictions/<slide>.h5, "
                      "heatmaps/<slide>.<class>.png (metrics.json when every slide has a label)")
      ->required();
  predict->add_option("--labels", pred.labels, "CSV with slide_id,label columns (optional: adds metrics)")
      ->check(CLI::ExistingFile);
  predict->add_option("--batch-size", pred.batch, "Tiles per forward pass")->capture_default_str()
      ->check(slide::apps::positive_number());
  predict->add_option("--decode-threads,--threads", pred.threads,
                      "Threads decoding the tiles (JPEG) one batch ahead of compute (--threads: the old name)")
      ->capture_default_str()->check(slide::apps::positive_number())->take_last();
  predict->add_flag("--overwrite", pred.overwrite,
                    "Replace an earlier prediction in --out (its CSVs, metrics.json, predictions/ and heatmaps/)");
  bool predict_no_fused = false, no_heatmaps = false;
  predict->add_flag("--no-fused", predict_no_fused,
                    "Logits through the training engine's forward instead of the fused inference path");
  predict->add_flag("--no-heatmaps", no_heatmaps, "Do not draw the per-class heatmaps");
  slide::apps::add_backend_options(*predict, &pred.backend, &pred.device);
  slide::apps::add_precision_option(*predict, &pred.precision);
  slide::apps::MilEvaluateOptions mil_pred;  // predict --features: an ABMIL checkpoint on bags of new slides
  slide::apps::add_mil_evaluate_options(*predict, &mil_pred);
  app.add_option("--model", model_name, "small | resnet18 | resnet34 | resnet50")->capture_default_str();
  app.add_option("--width", width, "Channels of the small CNN's first stage")->capture_default_str()->check(slide::apps::positive_number());
  app.add_option("--epochs", epochs, "Epochs")->capture_default_str()->check(slide::apps::positive_number());
  app.add_option("--batch-size", batch,
                 "Samples per optimizer step, or auto: the largest micro-batch that fits the memory budget")
      ->capture_default_str()
      ->transform([](const std::string& v) { return v == "auto" ? std::string("0") : v; })  // 0: auto
      ->check(slide::apps::non_negative_number());
  app.add_option("--accumulate", accumulate, "Micro-batches per step (gradient accumulation)")->capture_default_str()
      ->check(slide::apps::positive_number());
  using slide::apps::number_option;
  app.add_option("--lr", lr, "Peak learning rate (finite, >= 0)")->capture_default_str()->check(number_option("lr"));
  app.add_option("--optimizer", optimizer, "sgd | adamw")->capture_default_str();
  app.add_option("--momentum", momentum, "SGD momentum, in [0, 1)")->capture_default_str()
      ->check(number_option("momentum"));
  app.add_flag("--nesterov", nesterov, "Nesterov momentum");
  app.add_option("--weight-decay", weight_decay, "Weight decay (L2 for sgd, decoupled for adamw; finite, >= 0)")
      ->capture_default_str()->check(number_option("weight-decay"));
  app.add_option("--schedule", schedule, "cosine | step | constant")->capture_default_str();
  app.add_option("--warmup-epochs", warmup_epochs, "Linear warm-up, in epochs (finite, >= 0)")->capture_default_str()
      ->check(number_option("warmup-epochs"));
  app.add_option("--label-smoothing", smoothing, "Label smoothing in [0, 1)")->capture_default_str()
      ->check(number_option("label-smoothing"));
  std::string cache = "auto";
  app.add_option("--cache", cache,
                 "device: decode the dataset once and keep it on the backend's device, where batches are gathered, "
                 "augmented and normalised (a host backend: as ram); ram: keep it in host memory; none: stream from "
                 "the stores; auto: device, then ram, when it fits beside the training step in what is left of "
                 "the budget (or of the free memory)")
      ->capture_default_str();
  std::string class_weights = "none";
  app.add_option("--class-weights", class_weights,
                 "none | balanced (n / (classes x n_c) over the training tiles) | w1,w2,... (one per class)")
      ->capture_default_str();
  app.add_option("--val-fraction", val_fraction, "Fraction of slides held out for validation, in [0, 1)")
      ->capture_default_str()->check(number_option("val-fraction"));
  bool stratify = false;
  app.add_flag("--stratify", stratify,
               "Split within each class (the validation split, --test-fraction, --folds; MIL's too): every class "
               "with two slides (patients) or more on both sides, each side near its share of every class");
  app.add_option("--seed", seed, "Seed of initialisation, split and shuffling")->capture_default_str();
  int folds = 0, fold = -1;
  app.add_option("--folds", folds,
                 "K-fold cross-validation by patient (a labels CSV's patient or case_id column) or slide: alone, runs "
                 "the K folds as a sweep (one process each, OUT/trials/tNNN) and writes per-fold and mean +- sd "
                 "metrics to OUT/results.json; with --fold, trains that fold")
      ->check(CLI::Range(2, 1000));
  app.add_option("--fold", fold, "With --folds K: the fold (0..K-1) that is validation; the others train")
      ->check(slide::apps::non_negative_number());
  CLI::Option* decode_threads_opt =
      app.add_option("--decode-threads,--threads", threads,
                     "Threads decoding (JPEG) and augmenting the tiles of the next batches (--threads: the old name; "
                     "the last one given counts; default: the cores, divided among the ranks on one host)")
          ->capture_default_str()->check(slide::apps::positive_number())->take_last();
  int compute_threads = 0;
  app.add_option("--compute-threads", compute_threads,
                 "Compute threads of the cpu backend (oneDNN's OpenMP threads); 0: OMP_NUM_THREADS, else every core")
      ->capture_default_str()->check(CLI::Range(0, 4096));
  slide::apps::add_backend_options(app, &backend, &device);
  slide::apps::add_precision_option(app, &precision);
  std::string activations = "auto";
  app.add_option("--activations", activations,
                 "Storage of the activations and their gradients: auto (half precision where the backend keeps "
                 "them so: cuda under --precision fp16 / bf16, as torch.autocast; else f32) | f32 | f16 | bf16 "
                 "(on a backend with the half-precision training ops: cuda, or the reference backend, which "
                 "emulates them). Parameters, their gradients and the optimizer state stay f32; f16 needs "
                 "--precision fp16 (its dynamic loss scaling)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "f32", "f16", "bf16"}));
  std::string channels_last = "auto";
  app.add_option("--channels-last", channels_last,
                 "The CNN's activations channels last (PyTorch's channels_last memory format: cuDNN's "
                 "tensor-core convolutions then need no transposes): auto (on cuda with half-precision "
                 "activations) | on (also f32 activations, e.g. --precision tf32; on cuda, or "
                 "the reference backend, which emulates it) | off")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "on", "off"}));
  double loss_scale = 65536.0;
  auto* loss_scale_opt = app.add_option("--loss-scale", loss_scale,
                 "--precision fp16: the initial dynamic loss scale (PyTorch GradScaler's init_scale; halved on an "
                 "inf/NaN gradient, which skips that step, doubled after 2000 good steps)")
      ->capture_default_str();
  app.add_option("--memory-budget", budget,
                 "Memory budget for tensors on the backend's device, e.g. 8G (host memory on cpu; GPU memory on "
                 "cuda); exceeding it is an error, recovered by smaller micro-batches");
  app.add_option("--keep", keep, "Checkpoints to keep")->capture_default_str()->check(slide::apps::positive_number());
  app.add_flag("--resume", resume, "Continue from the newest checkpoint in --out");
  bool overwrite = false;
  app.add_flag("--overwrite", overwrite,
               "Replace the earlier run in --out: removes its checkpoints/, metrics.jsonl, metrics.csv, curves.png, "
               "best.safetensors, attention/ and test/ before training starts (without it or --resume, an --out holding "
               "a run is refused)");
  app.add_flag("--no-augment", no_augment, "No flips or rotations");
  slide::apps::StainOptions stain_options;
  slide::apps::add_stain_options(app, &stain_options,
                                 "before augmentation and the caches; the target is recorded in the checkpoints' "
                                 "state.json config and applied by evaluate and predict",
                                 "state.json's config.stain_normalization, a bag's stain_normalization attribute");
  slide::apps::MilOptions mil;  // --features: attention MIL on feature bags (slide_train_mil.cpp)
  slide::apps::add_mil_options(app, &mil);
  slide::apps::MemoryOptions memory;  // --dry-run, --checkpoint-activations, --global-batch (slide_train_memory.cpp)
  slide::apps::add_memory_options(app, &memory);
  slide::apps::SweepOptions sweep_options;  // slide-train sweep (slide_train_sweep.cpp)
  auto* sweep = slide::apps::add_sweep_command(app, &sweep_options);
  std::vector<float> color_jitter;
  app.add_option("--color-jitter", color_jitter,
                 "Colour jitter as torchvision's ColorJitter: brightness,contrast,saturation,hue (e.g. 0.2,0.2,0.2,0.05)")
      ->delimiter(',')->expected(4);
  float crop_min_scale = 1;
  app.add_option("--random-resized-crop", crop_min_scale,
                 "Smallest area fraction of torchvision's RandomResizedCrop, resized back to the tile size (1 = off)")
      ->capture_default_str()->check(number_option("random-resized-crop"));
  float stain_sigma = 0;
  app.add_option("--stain-augment", stain_sigma,
                 "Stain augmentation (HED jitter, Tellez et al. 2018): each of haematoxylin, eosin and DAB scaled "
                 "by U(1-s, 1+s) and shifted by U(-s, s) per tile (0 = off; 0.05 is mild)")
      ->capture_default_str()->check(number_option("stain-augment"));
  std::string best_metric = "balanced_accuracy";
  app.add_option("--best-metric", best_metric,
                 "Validation metric that picks best.safetensors: balanced_accuracy | accuracy | roc_auc | loss")
      ->capture_default_str()->check(CLI::IsMember({"balanced_accuracy", "accuracy", "roc_auc", "loss"}));
  // Fine-tuning (slide/train/fine_tune.h).
  std::string init_weights, freeze_until;
  double lr_backbone = -1;  // unset: the backbone at --lr
  app.add_option("--init", init_weights,
                 "Start from these weights (torchvision-named safetensors: ImageNet weights converted by "
                 "scripts/convert_torchvision_weights.py, a slidestream checkpoint or best.safetensors, a pathology "
                 "checkpoint); the classifier (fc) is replaced when its class count differs")
      ->check(CLI::ExistingFile);
  app.add_option("--freeze", freeze_until,
                 "Freeze the model's layers up to and including this one (torchvision names: conv1, bn1, layer1, "
                 "..., layer4; the small CNN's indices): their parameters are not updated");
  app.add_option("--lr-backbone", lr_backbone,
                 "Peak learning rate of every layer but the classifier (default: --lr), on the same schedule")
      ->check(number_option("lr-backbone"));
  double dropout = 0;
  app.add_option("--dropout", dropout, "Dropout probability before the classifier (0 = none)")->capture_default_str()
      ->check(number_option("dropout"));
  std::string dist = "auto";
  double dist_timeout = 300;
  bool sync_bn = false;
  app.add_option("--dist", dist,
                 "auto (socket in the ranks --gpus starts, nccl there with --backend cuda; mpi when launched by "
                 "mpirun or srun with several ranks; else local) | local | mpi | socket | nccl (GPU ranks, with "
                 "--backend cuda; built with NCCL)")
      ->capture_default_str();
  app.add_option("--dist-timeout", dist_timeout,
                 "Seconds a collective between ranks may take before the job stops with an error")
      ->capture_default_str()->check(number_option("dist-timeout"));
  app.add_flag("--sync-bn", sync_bn, "Batch norm statistics over all ranks' samples (default: per rank)");
  double bucket_mb = static_cast<double>(slide::train::kDefaultBucketBytes) / (1 << 20);
  bool no_overlap = false;
  app.add_option("--bucket-mb", bucket_mb,
                 "Gradient bucket size in MiB (as DDP's bucket_cap_mb): each bucket is all-reduced as soon as "
                 "backward has finished its gradients")
      ->capture_default_str()->check(CLI::Range(1.0 / (1 << 20), 1e6));
  app.add_flag("--no-overlap", no_overlap,
               "All-reduce the gradient buckets after backward instead of during it (to measure the overlap)");
  std::string dist_timeline;
  app.add_option("--dist-timeline", dist_timeline,
                 "Rank 0 writes every step's gradient all-reduce timeline to this CSV (step,t_ms,event,bucket,name: "
                 "when backward finished each layer's gradients, when each bucket's all-reduce started and was "
                 "seen complete), rewritten after each epoch, rank r > 0 to FILE.rank<r>; to see what the "
                 "overlap hides");
  int gpus = 0;
  app.add_option("--gpus", gpus,
                 "Start N ranks on this machine and supervise them, without MPI (as torchrun --nproc-per-node): "
                 "one per GPU with --backend cuda (NCCL), N CPU ranks on host backends")
      ->check(CLI::Range(1, 1024));
  slide::apps::add_log_options(app, &log, "the augmentation, cache and backend decisions, per-step details");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error is exit code 2 (CLI11 has its own numbers).
    return app.exit(e) == 0 ? kExitOk : kExitUsage;
  }
  slide::apps::apply_log_options(log);
  if (compute_threads > 0) omp_set_num_threads(compute_threads);
  auto launched = launched_rank();
  if (!launched.ok()) return fail(launched.status());
  if (gpus > 0 && launched->world_size == 0) {
    // The launcher (launch.h): N copies of this command without --gpus, supervised.
    if (sweep->parsed() || eval->parsed() || predict->parsed() || !mil.features.empty() || folds > 0)
      return fail(slide::core::invalid_argument(
          "--gpus starts the ranks of one training run (tile classifiers); not with evaluate, predict, sweep, "
          "--features or --folds"));
    if (launch_world_size() > 1)
      return fail(slide::core::invalid_argument(
          "--gpus starts its own ranks: under mpirun or srun leave it out (each rank there is one process)"));
    if (dist != "auto" && dist != "socket" && dist != "nccl")
      return fail(slide::core::invalid_argument("--gpus with --dist " + dist +
                                                ": the ranks it starts talk over sockets (host backends) or NCCL"));
    if (device >= 0)
      return fail(slide::core::invalid_argument("--device is for one process; with --gpus each rank takes GPU r"));
    slide::apps::LaunchOptions lo;
    lo.ranks = gpus;
    std::error_code ec;
    lo.exe = fs::read_symlink("/proc/self/exe", ec).string();
    lo.args = slide::apps::args_without_gpus(argc, argv);
    lo.stop_timeout_s = dist_timeout;
    if (compute_threads == 0)
      lo.threads_per_rank = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / gpus);
    return slide::apps::run_launcher(lo);
  }
  // Ranks started by --gpus on GPUs join over NCCL (its unique id over the launcher's sockets).
  if (launched->world_size > 0 && dist == "auto" && slide::train::resolve_backend_name(backend) == "cuda") dist = "nccl";
  if (sweep->parsed()) {
    std::error_code ec;
    return slide::apps::run_sweep(sweep_options, fs::read_symlink("/proc/self/exe", ec).string(), &g_cancel);
  }
  if (eval->parsed() && !mil_eval.features.empty())
    return slide::apps::run_mil_evaluate(eval_ckpt, mil_eval, eval_labels, eval_out, backend, eval_overwrite);
  if (eval->parsed()) {
    slide::apps::TileInferenceOptions ev;
    ev.checkpoint = eval_ckpt, ev.data = eval_data, ev.labels = eval_labels, ev.out = eval_out;
    ev.batch = batch, ev.threads = threads, ev.backend = backend, ev.device = device, ev.fused = !no_fused;
    ev.precision = precision;
    ev.overwrite = eval_overwrite;
    ev.test_fraction = eval_test_fraction, ev.seed = eval_seed, ev.seed_given = eval->count("--seed") > 0;
    return slide::apps::run_tile_inference(ev, /*predict=*/false);
  }
  if (predict->parsed() && !mil_pred.features.empty()) {
    if (!pred.data.empty()) return fail(slide::core::invalid_argument("predict takes --data (tile stores) or --features "
                                                                      "(feature bags), not both"));
    return slide::apps::run_mil_evaluate(pred.checkpoint, mil_pred, pred.labels, pred.out, pred.backend, pred.overwrite,
                                         /*predict=*/true);
  }
  if (predict->parsed()) {
    pred.fused = !predict_no_fused, pred.heatmaps = !no_heatmaps;
    return slide::apps::run_tile_inference(pred, /*predict=*/true);
  }
  if (!mil.features.empty()) return slide::apps::run_mil_training(app, mil, &g_cancel);
  if (fold >= 0 && folds == 0)
    return fail(slide::core::invalid_argument("--fold needs --folds K (the number of folds)"));
  if (folds > 0 && !val_data.empty())
    return fail(slide::core::invalid_argument("--folds splits --data into folds; --val-data is a fixed split"));
  if (stratify && !val_data.empty())
    return fail(slide::core::invalid_argument("--stratify splits --data; --val-data is a fixed split"));
  if (folds > 0 && fold >= folds)
    return fail(slide::core::invalid_argument("--fold " + std::to_string(fold) + " of --folds " + std::to_string(folds)));
  if (folds > 0 && fold < 0 && !memory.dry_run) {
    // The cross-validation driver: every other option goes to each fold's process.
    if (out.empty()) return fail(slide::core::invalid_argument("--folds needs --out (the cross-validation directory)"));
    slide::apps::CrossValidationOptions cv;
    cv.folds = folds;
    cv.out = out;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const auto eq = a.find('=');
      const std::string key = a.substr(0, eq);
      if (key == "--out" || key == "--folds") {
        if (eq == std::string::npos) ++i;  // and its value
        continue;
      }
      if (key == "--resume" || key == "--overwrite") continue;  // the sweep decides per fold
      cv.common.push_back(a);
    }
    std::error_code ec;
    return slide::apps::run_cross_validation(cv, fs::read_symlink("/proc/self/exe", ec).string(), &g_cancel);
  }
  if (data.empty() || (out.empty() && !memory.dry_run)) {  // a dry run writes nothing: --out optional
    std::fprintf(stderr, "slide-train: --data and --out are required (or use: slide-train evaluate ...)\n");
    return kExitUsage;
  }
  auto made_comm = make_communicator(dist, dist_timeout, device);
  if (!made_comm.ok()) return fail(made_comm.status());
  std::unique_ptr<Communicator> comm = std::move(*made_comm);
  g_comm = comm.get();
  const bool writer = comm->rank() == 0;  // only rank 0 writes checkpoints, metrics, plots and logs
  if (!writer) slide::core::set_log_level(slide::core::LogLevel::kWarn);
  // The backend first: one that cannot start (no GPU, a build without CUDA) is refused before
  // anything is written.
  auto be = open_backend(backend, device, precision);
  if (!be.ok()) return fail(be.status());
  if (!(loss_scale > 0) || !std::isfinite(loss_scale))  // GradScaler's own check, before anything is written
    return fail(slide::core::invalid_argument("--loss-scale " + std::to_string(loss_scale) + ": must be finite and > 0"));
  if (loss_scale_opt->count() > 0 && (*be)->math_precision() != slide::train::MathPrecision::kFp16)
    return fail(slide::core::invalid_argument("--loss-scale applies to --precision fp16 (the other precisions need no "
                                              "loss scaling), not to --precision " + precision));
  // --device names one GPU for one process; ranks take their node-local GPU (as NCCL does).
  if (device >= 0 && comm->world_size() > 1)
    return fail(slide::core::invalid_argument("--device is for one process; with " +
                                              std::to_string(comm->world_size()) +
                                              " ranks each takes its node-local GPU (the launcher's local rank)"));
  // One writer per --out, for the whole run: rank 0 (the only rank that writes it) takes the lock
  // and refuses an earlier run without --resume or --overwrite; its failure stops every rank.
  std::unique_ptr<slide::core::DirLock> out_lock;
  if (writer && !memory.dry_run) {  // a dry run writes nothing
    auto lock = slide::apps::claim_out_dir(out, resume, overwrite);
    if (!lock.ok()) return fail(lock.status());
    out_lock = std::move(*lock);
  }

  // Everything that can be wrong with the input is checked before training starts.
  if (!color_jitter.empty() &&
      (std::any_of(color_jitter.begin(), color_jitter.end(), [](float v) { return !std::isfinite(v) || v < 0; }) ||
       color_jitter[3] > 0.5f))
    return fail(slide::core::invalid_argument("--color-jitter: brightness, contrast and saturation must be >= 0 "
                                              "and hue in [0, 0.5] (torchvision's ColorJitter)"));
  auto budget_bytes = slide::apps::parse_memory_budget(budget);
  if (!budget_bytes.ok()) return fail(budget_bytes.status());
  (*be)->allocator().set_budget_bytes(*budget_bytes);
  auto stain = slide::train::stain_target_for_options(stain_options.method, stain_options.reference);
  if (!stain.ok()) return fail(stain.status());
  std::vector<std::string> all = data;
  all.insert(all.end(), val_data.begin(), val_data.end());
  auto ds = TileDataset::open(all, labels_csv);
  if (!ds.ok()) return fail(ds.status());
  if ((*ds)->unlabelled_tiles_skipped() > 0)
    slide::core::log_info("tiles without a label from the annotations left out",
                          {{"tiles", static_cast<int64_t>((*ds)->unlabelled_tiles_skipped())}});
  if (auto s = (*ds)->set_stain(*stain); !s.ok()) return fail(s);
  if (stain->method != slide::train::StainMethod::kNone)
    slide::core::log_info("stain normalisation", {{"reference", stain_options.reference},
                                                  {"target", slide::train::stain_target_to_json(*stain)}});
  std::vector<size_t> train, val, held_out;
  if (test_fraction > 0) {
    if (!val_data.empty() || !test_data.empty())
      return fail(slide::core::invalid_argument("--test-fraction holds out part of --data; not with --val-data or "
                                                "--test-data"));
    (*ds)->hold_out(test_fraction, seed, &held_out, stratify);
    if (held_out.empty()) return fail(slide::core::invalid_argument("--test-fraction holds out no slide"));
    slide::core::log_info("test set held out", {{"tiles", static_cast<int64_t>(held_out.size())}});
  }
  if (folds > 0) {
    if (auto s = (*ds)->split_fold(folds, std::max(fold, 0), seed, &train, &val, stratify); !s.ok()) return fail(s);
  } else if (val_data.empty()) {
    (*ds)->split_by_slide(val_fraction, seed, &train, &val, stratify);
  } else {
    for (size_t i = 0; i < (*ds)->tiles().size(); ++i)
      ((*ds)->tiles()[i].store < data.size() ? train : val).push_back(i);
  }
  if (train.empty()) return fail(slide::core::invalid_argument("no training tiles after the split"));
  const auto classes = static_cast<int64_t>((*ds)->class_names().size());
  if (classes < 2) return fail(slide::core::invalid_argument("the stores hold fewer than two classes"));
  // A class with no tile on one side of the split: said before the first epoch rather than found in
  // the metrics.
  slide::apps::warn_classes_missing_from_split((*ds)->class_names(), train, val,
                                               [&](size_t i) { return (*ds)->tiles()[i].label; }, "tile", seed);

  Run run;
  auto model = make_tile_model(model_name, classes, width, seed, dropout);
  if (!model.ok()) return fail(model.status());
  run.model = std::move(*model);
  if (!init_weights.empty()) {  // on the host, before the move to the device
    std::vector<Parameter*> host_params;
    std::vector<Buffer*> host_buffers;
    run.model->collect("", &host_params, &host_buffers);
    auto report = load_initial_weights(init_weights, host_params, host_buffers, "fc");
    if (!report.ok()) return fail(report.status());
    slide::core::log_info("initial weights", {{"file", init_weights}, {"loaded", static_cast<int64_t>(report->loaded.size())},
                                              {"ignored", static_cast<int64_t>(report->ignored.size())}});
    if (!report->kept.empty())
      slide::core::log_info("classifier replaced: the file's has another class count; trained from a fresh "
                            "initialisation",
                            {{"classes", classes}, {"tensors", static_cast<int64_t>(report->kept.size())}});
  }
  // Built and initialised on the host, then moved to the backend's device once.
  if (auto s = move_to_device(**be, *run.model); !s.ok()) return fail(s.with_context("model to " + backend));
  // Training on half-precision storage where the backend keeps its activations in half precision
  // (cuda under --precision fp16 / bf16; backend.h activation_dtype): torch.autocast's casts at the
  // model's two ends, f32 master weights, gradients and optimizer state (layers.h).
  const DType act = activations == "auto"   ? (*be)->activation_dtype()
                    : activations == "f16"  ? DType::kF16
                    : activations == "bf16" ? DType::kBF16
                                            : DType::kF32;
  if (act != DType::kF32 && (*be)->name() == "cpu")
    return fail(slide::core::invalid_argument("--activations " + activations + ": the cpu backend keeps f32 activations "
                                              "(its bf16 runs oneDNN's f32-in, bf16-compute kernels); half-precision "
                                              "activations are for --backend cuda"));
  if (act == DType::kF16 && (*be)->math_precision() != slide::train::MathPrecision::kFp16)
    return fail(slide::core::invalid_argument("--activations f16 needs --precision fp16, whose dynamic loss scaling keeps "
                                              "small gradients within f16's range (bf16 needs none)"));
  // Channels last between the casts (backend.h, "Channels last in training"); cpu keeps its own
  // blocked layouts.
  if (channels_last == "on" && (*be)->name() == "cpu")
    return fail(slide::core::invalid_argument("--channels-last on: the cpu backend keeps oneDNN's blocked layouts "
                                              "(nChw8c / nChw16c); channels last is for --backend cuda"));
  const bool nhwc = slide::apps::channels_last_activations(channels_last, act, **be);
  if (act != DType::kF32) {
    if (auto s = enable_half_activations(*run.model, act, nhwc ? Layout::kNhwc : Layout::kPlain); !s.ok())
      return fail(s);
    slide::core::log_info("half-precision activations for training",
                          {{"activations", slide::train::dtype_name(act)}, {"master weights", "f32"},
                           {"layout", nhwc ? "channels last" : "nchw"}});
  } else if (nhwc) {
    if (auto s = enable_channels_last(*run.model); !s.ok()) return fail(s);
    slide::core::log_info("channels-last activations for training", {{"activations", "f32"}});
  }
  run.model->collect("", &run.params, &run.buffers);
  OptimizerConfig oc;
  oc.name = optimizer;
  oc.momentum = momentum;
  oc.nesterov = nesterov;
  oc.weight_decay = weight_decay;
  if (lr_backbone >= 0 && !(lr > 0))
    return fail(slide::core::invalid_argument("--lr-backbone is a rate relative to --lr's schedule: give --lr > 0"));
  auto param_options = fine_tune_options(*run.model, run.params, freeze_until, "fc",
                                         lr_backbone >= 0 ? lr_backbone / lr : 1.0);
  if (!param_options.ok()) return fail(param_options.status());
  if (!freeze_until.empty())
    slide::core::log_info("frozen", {{"through", freeze_until},
                                     {"parameters", static_cast<int64_t>(std::count_if(
                                                        param_options->begin(), param_options->end(),
                                                        [](const ParameterOptions& p) { return p.frozen; }))}});
  auto opt = Optimizer::make(oc, run.params, (*be)->allocator(), *param_options);
  if (!opt.ok()) return fail(opt.status());
  run.opt = std::move(*opt);
  // Memory: activation checkpointing, --batch-size auto, the plan (slide_train_memory.cpp).
  if (batch == 0 && comm->world_size() > 1)  // each rank would find its own size
    return fail(slide::core::invalid_argument("--batch-size auto is for one rank: run it alone, then give the size"));
  // --resume: the newest complete checkpoint, read (and validated, validate_run_state) once, here,
  // by rank 0, the rank that writes them; its weights and state are loaded below.
  const std::string ckpt_dir = out + "/checkpoints";
  std::string resume_from;
  nlohmann::json resumed_state;
  // A resumed run fits its steps as the run it continues did (its state.json's "memory"), not by
  // timing again: micro-batches change batch norm's statistics, so a different split would not
  // resume exactly. prepare_memory gives rank 0's decision to every rank.
  std::optional<slide::apps::MemoryDecision> recorded_memory;
  if (resume && writer && !memory.dry_run) {
    const std::vector<fs::path> checkpoints = list_checkpoints(ckpt_dir);
    if (checkpoints.empty()) return fail(slide::core::not_found("--resume: no complete checkpoint in " + ckpt_dir));
    resume_from = checkpoints.back().string();
    auto record = slide::apps::open_checkpoint_record(resume_from);
    if (!record.ok()) return fail(record.status().with_context("--resume"));
    resumed_state = std::move(record->state);
    if (resumed_state.contains("memory")) {
      const nlohmann::json& m = resumed_state["memory"];
      slide::apps::MemoryDecision d;
      d.strategy = m["strategy"].get<std::string>();
      d.segments = m["segments"].get<std::string>();
      d.accumulate = m["accumulate"].get<int64_t>();
      d.ranks = m["ranks"].get<int64_t>();
      // On another world size the split is the user's to give (ranks x micro-batches).
      if (d.ranks == comm->world_size()) recorded_memory = d;
    }
    // --batch-size auto: the resumed run's batch, not a new timing (another free memory would give
    // another micro-batch, and so other batch statistics and another --batch-size than recorded).
    // (With --global-batch, prepare_memory takes the recorded split instead.)
    if (batch == 0 && memory.global_batch == 0 && recorded_memory && resumed_state.contains("config") && resumed_state["config"].is_object() &&
        resumed_state["config"].contains("batch_size") && resumed_state["config"]["batch_size"].is_number_integer() &&
        resumed_state["config"]["batch_size"].get<int64_t>() >= 1) {
      batch = resumed_state["config"]["batch_size"].get<int64_t>();
      slide::core::log_info("--batch-size auto: the resumed run's",
                            {{"batch_size", batch}, {"accumulate", recorded_memory->accumulate}});
    }
  }
  auto memory_plan = slide::apps::prepare_memory(memory, **be, *run.model, (*ds)->tile_size_px(), classes, optimizer,
                                                 momentum, backend, static_cast<int64_t>(train.size()), &batch,
                                                 &accumulate, comm.get(),
                                                 recorded_memory ? &*recorded_memory : nullptr);
  if (!memory_plan.ok()) return fail(memory_plan.status());
  if (memory.dry_run) return kExitOk;
  const int64_t steps_per_epoch = (static_cast<int64_t>(train.size()) + batch - 1) / batch;
  Schedule sched;
  sched.kind = schedule;
  sched.base_lr = lr;
  sched.warmup_steps = static_cast<int64_t>(warmup_epochs * static_cast<double>(steps_per_epoch));
  sched.total_steps = steps_per_epoch * epochs;
  sched.step_size = std::max<int64_t>(1, sched.total_steps / 3);
  if (schedule != "cosine" && schedule != "step" && schedule != "constant")
    return fail(slide::core::invalid_argument("schedule '" + schedule + "' is not one of cosine, step, constant"));

  if (cache != "auto" && cache != "device" && cache != "ram" && cache != "none")
    return fail(slide::core::invalid_argument("--cache '" + cache + "' is not one of auto, device, ram, none"));
  // The ranks on this host share its cores and RAM (a collective: every rank asks).
  auto host_ranks = slide::train::ranks_on_this_host(*comm);
  if (!host_ranks.ok()) return fail(host_ranks.status());
  if (decode_threads_opt->count() == 0 && *host_ranks > 1)
    threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / *host_ranks);
  slide::core::ThreadPool pool(static_cast<size_t>(std::max(1, threads)));
  const bool device_backend = (*be)->device() != Device::kCpu;
  if (cache == "device" && !device_backend) {
    slide::core::log_info("--cache device on a host backend: the RAM cache is its device cache", {{"backend", backend}});
    cache = "ram";
  }
  bool on_device = false;
  if (device_backend && (cache == "device" || cache == "auto")) {
    // The device's budget left (or its free memory), as --cache auto weighs RAM below.
    Allocator& dev = (*be)->allocator();
    auto free_bytes = (*be)->available_memory_bytes();
    if (!free_bytes.ok()) return fail(free_bytes.status());
    const size_t left = dev.budget_bytes() == Allocator::kUnlimited
                            ? *free_bytes
                            : std::min(*free_bytes, dev.budget_bytes() - std::min(dev.budget_bytes(), dev.current_bytes()));
    if (cache == "device" || slide::apps::dataset_fits((*ds)->decoded_bytes(), left, *memory_plan, "on the device")) {
      if (auto s = (*ds)->cache_on_device(**be, &pool); !s.ok()) {
        if (cache == "device") return fail(s.with_context("--cache device"));
        slide::core::log_warn("dataset not cached on the device", {{"why", s.to_string()}});
      } else {
        on_device = true;
        slide::core::log_info("dataset cached on the device: batches are gathered, augmented and normalised there",
                              {{"bytes", static_cast<int64_t>((*ds)->decoded_bytes())}, {"device", device_name((*be)->device())}});
      }
    }
  }
  // Each rank weighs --cache auto against its share of the host's free RAM.
  if (cache != "none" && !on_device) {
    const size_t budget_left =
        cpu_allocator().budget_bytes() == Allocator::kUnlimited
            ? static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE)) /
                  static_cast<size_t>(*host_ranks)
            : cpu_allocator().budget_bytes() - cpu_allocator().current_bytes();
    if (*host_ranks > 1 && cache == "auto")
      slide::core::log_info("--cache auto: the host's free RAM is shared by its ranks",
                            {{"ranks_on_host", *host_ranks}, {"share_bytes", static_cast<int64_t>(budget_left)}});
    if (cache == "ram" || slide::apps::dataset_fits((*ds)->decoded_bytes(), budget_left, *memory_plan, "in RAM")) {
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

  if (auto s = writer && overwrite ? slide::apps::remove_earlier_run(out) : slide::core::ok_status(); !s.ok())
    return fail(s);
  if (auto s = writer ? slide::core::make_dirs(ckpt_dir) : slide::core::ok_status(); !s.ok()) return fail(s);
  nlohmann::json state = {{"epoch", 0}, {"step_in_epoch", 0}, {"optimizer_steps", 0}, {"model", model_name},
                          {"width", width}, {"dropout", dropout}, {"epochs", epochs},
                          {"classes", (*ds)->class_names()}, {"history", nlohmann::json::array()},
                          {"best_val_balanced_accuracy", -1.0},
                          // The tiles the model was trained on: evaluate and predict warn on others.
                          {"tile_size_px", (*ds)->tile_size_px()},
                          {"tile_mpp_um", (*ds)->slide_record((*ds)->tiles()[train.front()].slide).tile_mpp_um},
                          // How the steps fit the memory budget (--memory-strategy): --resume does the same.
                          {"memory", {{"strategy", memory_plan->strategy}, {"segments", memory_plan->segments},
                                      {"accumulate", memory_plan->accumulate},
                                      {"ranks", comm->world_size()}}}};
  // What changes the math of a run: --resume refuses a run whose options differ (epochs aside).
  nlohmann::json config = {{"model", model_name}, {"width", width}, {"dropout", dropout}, {"optimizer", optimizer},
                     {"lr", lr}, {"momentum", momentum}, {"nesterov", nesterov}, {"weight_decay", weight_decay},
                     {"schedule", schedule}, {"warmup_epochs", warmup_epochs}, {"label_smoothing", smoothing},
                     {"batch_size", batch}, {"seed", seed}, {"class_weights", class_weights},
                     {"val_fraction", val_fraction}, {"labels", labels_csv}, {"augment", !no_augment},
                     {"color_jitter", color_jitter}, {"random_resized_crop", crop_min_scale},
                     {"best_metric", best_metric}};
  // Fine-tuning options, recorded when given (a run without them keeps its config as before).
  if (!init_weights.empty()) config["init"] = init_weights;
  if (!freeze_until.empty()) config["freeze"] = freeze_until;
  if (folds > 0) config["folds"] = folds, config["fold"] = std::max(fold, 0);
  if (stain_sigma > 0) config["stain_augment"] = stain_sigma;
  if (test_fraction > 0) config["test_fraction"] = test_fraction;
  if (stratify) config["stratify"] = true;  // the split, and evaluate's test set
  if (lr_backbone >= 0) config["lr_backbone"] = lr_backbone;
  // The products' math precision, recorded when not fp32: a resume at another precision is refused.
  const bool fp16 = (*be)->math_precision() == slide::train::MathPrecision::kFp16;
  if ((*be)->math_precision() != slide::train::MathPrecision::kFp32)
    config["precision"] = slide::train::math_precision_name((*be)->math_precision());
  if (fp16) config["loss_scale"] = loss_scale;
  // The activations' storage and synchronised batch norm change the math too; recorded when given
  // (--activations auto follows the backend: a GPU run's checkpoint still resumes on the CPU).
  if (activations != "auto") config["activations"] = slide::train::dtype_name(act);
  if (sync_bn) config["sync_bn"] = true;
  // The fitted stain target (stain.h's JSON as an object): evaluate and predict apply it.
  if (stain->method != slide::train::StainMethod::kNone)
    config["stain_normalization"] = nlohmann::json::parse(slide::train::stain_target_to_json(*stain));
  state["config"] = config;
  // The slides on each side of the split (held out, validation, training), which --resume must find
  // again.
  std::map<uint32_t, std::string> slide_part;
  for (size_t i : held_out) slide_part[(*ds)->tiles()[i].slide] = "test";
  for (size_t i : val) slide_part.emplace((*ds)->tiles()[i].slide, "val");
  for (size_t i : train) slide_part.emplace((*ds)->tiles()[i].slide, "train");
  std::vector<std::pair<std::string, std::string>> parts;
  for (const auto& [slide, part] : slide_part) parts.emplace_back((*ds)->slide_ids()[slide], part);
  auto split_rec = slide::apps::split_record(std::move(parts));
  if (!split_rec.ok()) return fail(split_rec.status());
  state["split"] = *split_rec;
  // Every tile's (slide, class), counted: --resume refuses other labels under the same slides.
  std::map<std::pair<std::string, std::string>, int64_t> label_counts;
  for (const auto& t : (*ds)->tiles()) ++label_counts[{(*ds)->slide_ids()[t.slide], (*ds)->class_names()[t.label]}];
  auto labels_rec = slide::apps::labels_record(label_counts);
  if (!labels_rec.ok()) return fail(labels_rec.status());
  state["labels"] = *labels_rec;
  if (resume && writer) {  // read above (not a dry run: that has returned)
    const std::string& latest = resume_from;
    const nlohmann::json& saved = resumed_state;
    if (saved["model"] != model_name || saved["classes"] != state["classes"])
      return fail(slide::core::invalid_argument(latest + ": made with another model or class list"));
    if (auto s = slide::apps::check_resume_config(latest, saved, config, epochs); !s.ok()) return fail(s);
    if (auto s = slide::apps::check_resume_split(latest, saved, *split_rec); !s.ok()) return fail(s);
    if (auto s = slide::apps::check_resume_labels(latest, saved, *labels_rec); !s.ok()) return fail(s);
    if (auto s = slide::apps::check_resume_step(latest, saved, (static_cast<int64_t>(train.size()) + batch - 1) / batch);
        !s.ok())
      return fail(s);
    if (auto s = load_safetensors(latest + "/model.safetensors", named(run.params, run.buffers), be->get()); !s.ok())
      return fail(s);
    std::vector<NamedTensor> opt_state;
    for (auto* b : run.opt->state()) opt_state.push_back({b->name, &b->value});
    if (!opt_state.empty())
      if (auto s = load_safetensors(latest + "/optimizer.safetensors", opt_state, be->get()); !s.ok()) return fail(s);
    state = saved;
    state["epochs"] = epochs;
    state["config"] = config;
    state["split"] = *split_rec;
    state["labels"] = *labels_rec;
    run.opt->set_steps(state["optimizer_steps"].get<int64_t>());
    slide::core::log_info("resumed", {{"checkpoint", latest}});
  }

  // Every rank starts from rank 0's parameters, buffers, optimizer state and run state.
  if (auto s = slide::apps::broadcast_run(*comm, run.params, run.buffers, run.opt->state(), &state, be->get()); !s.ok())
    return fail(s);
  run.opt->set_steps(state["optimizer_steps"].get<int64_t>());
  // --precision fp16: dynamic loss scaling (loss_scaler.h), its state from rank 0's checkpoint when
  // resumed (validated with the rest of state.json), so a resumed run continues exactly.
  std::optional<slide::train::LossScaler> scaler;
  if (fp16) {
    slide::train::LossScalerOptions lo;
    lo.init_scale = loss_scale;
    auto made = slide::train::LossScaler::make(lo);
    if (!made.ok()) return fail(slide::core::invalid_argument("--loss-scale: " + made.status().message()));
    scaler = *made;
    if (state.contains("loss_scaler"))
      scaler->restore(state["loss_scaler"]["scale"].get<double>(), state["loss_scaler"]["growth_tracker"].get<int64_t>());
  }
  if (sync_bn && comm->world_size() > 1) run.model->set_batch_norm_sync(comm.get());
  slide::core::log_info("training", {{"ranks", comm->world_size()}, {"dist", comm->name()}, {"model", model_name}, {"train_tiles", static_cast<int64_t>(train.size())},
                                     {"val_tiles", static_cast<int64_t>(val.size())}, {"classes", classes},
                                     {"steps_per_epoch", steps_per_epoch}, {"backend", (*be)->name()},
                                     {"precision", slide::train::math_precision_name((*be)->math_precision())},
                                     {"decode_threads", threads}, {"compute_threads", omp_get_max_threads()}});
  std::string timeline_csv = "step,t_ms,event,bucket,name\n";  // --dist-timeline's rows so far
  if (!dist_timeline.empty() && comm->world_size() == 1)
    slide::core::log_warn("--dist-timeline: one rank, no gradient all-reduce to record");
  for (long epoch = state["epoch"].get<long>(); epoch < epochs; ++epoch) {
    TrainOptions to;
    to.batch_size = batch;
    to.accumulate = accumulate;
    to.label_smoothing = smoothing;
    to.class_weights = weights;
    to.augment.flips_rotations = !no_augment;
    if (!color_jitter.empty())
      to.augment.brightness = color_jitter[0], to.augment.contrast = color_jitter[1],
      to.augment.saturation = color_jitter[2], to.augment.hue = color_jitter[3];
    to.augment.crop_min_scale = crop_min_scale;
    to.augment.stain_sigma = stain_sigma;
    to.start_step = state["step_in_epoch"].get<int64_t>();
    to.cancel = &g_cancel;
    to.refit_on_oom = memory_plan->refit;
    to.loss_scaler = scaler ? &*scaler : nullptr;
    if (comm->world_size() > 1) to.comm = comm.get(), to.sync_batch_norm = sync_bn;
    to.bucket_bytes = static_cast<size_t>(bucket_mb * (1 << 20));
    to.overlap_all_reduce = !no_overlap;
    if (!dist_timeline.empty() && to.comm != nullptr)
      to.on_all_reduce_timeline = [&](int64_t step, const std::vector<slide::train::AllReduceEvent>& events) {
        for (const auto& e : events) {
          char row[96];
          std::snprintf(row, sizeof row, "%lld,%.3f,%s,", static_cast<long long>(step), e.t_s * 1e3,
                        slide::train::GradientBuckets::timeline_kind_name(e.kind));
          timeline_csv += row;
          if (e.bucket >= 0) timeline_csv += std::to_string(e.bucket + 1);
          timeline_csv += "," + e.name + "\n";
        }
      };
    // Progress on rank 0: images/s, steps/s and the epoch's running training loss.
    slide::core::Progress progress("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(epochs),
                                   static_cast<int64_t>(train.size()) - to.start_step * batch, "img/s",
                                   writer && !log.quiet);
    const auto epoch_t0 = std::chrono::steady_clock::now();
    int64_t steps_done = 0;
    to.on_step = [&](int64_t samples, double mean_loss) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_t0).count();
      char detail[96];
      std::snprintf(detail, sizeof detail, "%.2f steps/s, loss %.4f", ++steps_done / std::max(secs, 1e-9), mean_loss);
      progress.set_detail(detail);
      progress.add(samples);
    };
    const double lr_now = sched.at(run.opt->steps());
    auto st = train_epoch(**be, *run.model, *run.opt, sched, **ds, train, to, seed * 7919 + static_cast<uint64_t>(epoch),
                          &pool);
    progress.finish();
    if (!st.ok()) return fail(st.status().with_context("epoch " + std::to_string(epoch)));
    if (to.on_all_reduce_timeline)  // rank 0 to FILE, rank r to FILE.rank<r> (a straggler shows there)
      if (auto w = slide::core::write_file_atomic(
              writer ? dist_timeline : dist_timeline + ".rank" + std::to_string(comm->rank()), timeline_csv);
          !w.ok())
        return fail(w.with_context("--dist-timeline"));
    accumulate = std::max(accumulate, st->accumulate);  // after out-of-memory recovery: the finer split
    if (state.contains("memory"))
      state["memory"]["accumulate"] = accumulate, state["memory"]["ranks"] = comm->world_size();
    state["optimizer_steps"] = run.opt->steps();
    if (scaler)
      state["loss_scaler"] = {{"scale", scaler->scale()}, {"growth_tracker", scaler->growth_tracker()}};
    if (!st->completed) {
      state["epoch"] = epoch;
      state["step_in_epoch"] = to.start_step + st->steps;
      if (auto s = writer ? save_checkpoint(ckpt_dir, run, **be, state, keep) : slide::core::ok_status(); !s.ok())
        return fail(s);
      // Ranks leave together, after rank 0's checkpoint: a launcher that ends the job when the
      // first rank exits must not cut the write short.
      if (auto s = comm->barrier("barrier after the interrupt's checkpoint"); !s.ok()) return fail(s);
      if (writer)
        slide::core::log_warn("interrupted; checkpoint written, continue with --resume",
                              {{"epoch", epoch}, {"step", state["step_in_epoch"].get<int64_t>()}});
      return kExitInterrupted;
    }
    EpochStats v;
    if (!val.empty()) {
      // Per-rank batch norm: every rank evaluates rank 0's running statistics (the checkpoint's).
      if (auto s = slide::apps::broadcast_buffers(*comm, run.buffers, be->get()); !s.ok()) return fail(s);
      auto ev = evaluate_data_parallel(**be, *run.model, **ds, val, (batch + accumulate - 1) / accumulate, &pool, *comm);
      if (!ev.ok()) return fail(ev.status().with_context("validation"));
      v = *ev;
    }
    // A resumed epoch's train figures cover only the steps run after the resume.
    state["history"].push_back({{"epoch", epoch + 1}, {"train_loss", st->loss}, {"train_accuracy", st->accuracy},
                                {"val_loss", v.loss}, {"val_accuracy", v.accuracy},
                                {"val_balanced_accuracy", v.balanced_accuracy},
                                {"val_roc_auc", slide::apps::metric_or_null(v.roc_auc)},
                                {"val_recall", slide::apps::metrics_or_null(v.recall)}, {"lr", lr_now},
                                {"seconds", st->seconds + v.seconds}, {"images_per_s", st->samples / st->seconds},
                                {"val_confusion", v.confusion}});
    if (scaler) {
      state["history"].back()["loss_scale"] = scaler->scale();
      state["history"].back()["skipped_steps"] = st->skipped_steps;
    }
    state["epoch"] = epoch + 1;
    state["step_in_epoch"] = 0;
    if (auto s = writer ? write_metrics(out, state["history"]) : slide::core::ok_status(); !s.ok()) return fail(s);
    if (record_best_epoch(&state, v, best_metric, epoch + 1, !val.empty())) {
      if (auto s = writer ? save_safetensors(out + "/best.safetensors", named(run.params, run.buffers), {{"format", "pt"}},
                                             be->get())
                         : slide::core::ok_status();
          !s.ok())
        return fail(s);
    }
    if (auto s = writer ? save_checkpoint(ckpt_dir, run, **be, state, keep) : slide::core::ok_status(); !s.ok())
      return fail(s);
    // The report last: it shows the best epoch as just recorded.
    if (auto s = writer ? slide::apps::write_train_report(out, state, (*be)->allocator().peak_bytes(),
                                                          device_name((*be)->device()))
                        : slide::core::ok_status();
        !s.ok())
      return fail(s);
    slide::core::log_info("epoch", {{"epoch", epoch + 1}, {"train_loss", st->loss}, {"train_accuracy", st->accuracy},
                                    {"val_accuracy", v.accuracy}, {"val_balanced_accuracy", v.balanced_accuracy},
                                    {"val_roc_auc", v.roc_auc},
                                    {"images_per_s", st->samples / st->seconds},
                                    {"all_reduce_s", st->all_reduce_seconds}});
  }
  // Training is over: the ranks part here, together, before rank 0 evaluates the test set alone
  // (a rank finalising NCCL would otherwise wait for rank 0 through the whole evaluation, and
  // past --dist-timeout abort the job). The model's synchronised batch norms point at comm: none
  // runs after this.
  g_comm = nullptr;
  comm.reset();
  if (writer && (!test_data.empty() || test_fraction > 0)) {
    // The held-out test set, once, with the weights validation chose (else the last checkpoint's).
    slide::apps::TileInferenceOptions test;
    std::error_code ec;
    test.checkpoint = fs::exists(out + "/best.safetensors", ec) ? out + "/best.safetensors"
                                                                 : list_checkpoints(ckpt_dir).back().string();
    test.data = test_fraction > 0 ? data : test_data, test.labels = labels_csv, test.out = out + "/test";
    test.test_fraction = test_fraction, test.seed = seed;
    test.batch = (batch + accumulate - 1) / accumulate, test.threads = threads;
    test.backend = backend, test.device = device, test.overwrite = true, test.precision = precision;
    slide::core::log_info("test set", {{"weights", test.checkpoint}, {"out", test.out}});
    if (const int code = slide::apps::run_tile_inference(test, /*predict=*/false); code != kExitOk) return code;
  }
  if (writer && slide::core::log_json())
    slide::core::log_info("peak tensor memory", {{"bytes", (*be)->allocator().peak_bytes()},
                                                 {"device", device_name((*be)->device())}});
  else if (writer)
    std::fprintf(stderr, "peak tensor memory: %zu bytes (%s)\n", (*be)->allocator().peak_bytes(),
                 device_name((*be)->device()));
  return kExitOk;
}

}  // namespace

// The last line of defence only: every error is meant to come back as a Status. An exception that
// escapes anyway (a library's, or a bug) ends the run with one line and exit 1, not an abort;
// what was committed stays (outputs are written atomically).
int main(int argc, char** argv) {
  try {
    return run_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", "slide-train", e.what());
  } catch (...) {
    std::fprintf(stderr, "%s: internal error: an unknown exception\n", "slide-train");
  }
  return 1;
}
