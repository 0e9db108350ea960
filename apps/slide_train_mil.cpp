// slide-train --features BAGS...: attention MIL on feature bags. Outputs in --out, as tile
// training's: checkpoints/epoch-E-step-S/{model,optimizer}.safetensors,state.json, metrics.jsonl,
// metrics.csv, curves.png, best.safetensors; and, after the last epoch, the attention of every bag:
// <attention-dir>/<stem>.h5 (HDF5: /attention, /coords, the full slide id as an attribute),
// <attention-dir>/<stem>.png (heatmap) and predictions.csv (full slide ids, RFC 4180 quoted), where
// <stem> is slide::core::slide_file_stem(slide id) (cache::bag_file_name's rule).
#include "cli_checks.h"
#include "exit_codes.h"
#include "slide_train_mil.h"

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <map>
#include <sstream>

#include "slide/cache/bag.h"
#include "slide/core/csv.h"
#include "slide/core/file.h"
#include "slide/core/log.h"
#include "slide/tile/store.h"
#include "slide/train/checkpoint.h"
#include "slide/train/heatmap.h"
#include "slide/train/mil.h"
#include "backend_options.h"
#include "train_common.h"

namespace slide::apps {

namespace {

namespace fs = std::filesystem;
using slide::core::Status;
using namespace slide::train;


int fail(const Status& s) {
  slide::core::log_error(s.to_string());
  return s.code() == slide::core::StatusCode::kInvalidArgument || s.code() == slide::core::StatusCode::kNotFound
             ? kExitUsage
             : kExitFailed;
}

Result<Tensor> parse_class_weights(const std::string& text, const BagDataset& ds, const std::vector<size_t>& train) {
  const auto classes = static_cast<int64_t>(ds.class_names().size());
  if (text == "none") return Tensor();
  if (text == "balanced") return balanced_bag_weights(ds, train, cpu_allocator());
  SLIDE_ASSIGN_OR_RETURN(Tensor w, Tensor::empty({classes}, DType::kF32, cpu_allocator(), "class weights"));
  std::stringstream in(text);
  std::string item;
  int64_t i = 0;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    // Finite, >= 0 and within float (inf or 1e39 made every step's weight share inf / inf = NaN).
    if (i >= classes || end == item.c_str() || *end != '\0' || !(v >= 0) || !(v <= 3.0e38)) break;
    w.data<float>()[i++] = static_cast<float>(v);
  }
  double sum = 0;
  for (int64_t c = 0; c < i; ++c) sum += w.data<float>()[c];
  if (i != classes || std::count(text.begin(), text.end(), ',') + 1 != classes || !(sum > 0))
    return slide::core::invalid_argument("--class-weights '" + text + "': give " + std::to_string(classes) +
                                         " finite non-negative numbers, not all 0 (classes: " +
                                         nlohmann::json(ds.class_names()).dump() + "), or balanced, or none");
  return w;
}

// The attention files are named as the bags are (bag_file_name): an output directory that is one
// of the --features directories would replace the bags with them. kInvalidArgument naming both.
Status refuse_features_dir(const std::string& dir, const std::vector<std::string>& features, const char* option) {
  std::error_code ec;
  const std::filesystem::path out = std::filesystem::weakly_canonical(dir, ec);
  for (const std::string& f : features) {
    std::error_code ec2;
    if (!ec && std::filesystem::weakly_canonical(f, ec2) == out && !ec2)
      return slide::core::invalid_argument(std::string(option) + " " + dir + " is the --features directory " + f +
                                           ": its attention files would replace the bags (same names); choose "
                                           "another directory");
  }
  return slide::core::ok_status();
}

// A checkpoint's record of the encoder its bags came from (state.json "encoder": model, layer,
// weights_sha256, validate_run_state); null when the bags did not say.
nlohmann::json encoder_json(const BagEncoder& e) {
  if (!e.known()) return nullptr;
  return {{"model", e.model}, {"layer", e.layer}, {"weights_sha256", e.weights_sha256}};
}

// The bags of `ds` against the encoder a checkpoint's model was trained on (`state`, read from
// `state_file`): kInvalidArgument naming both when they differ; nothing to check when either side
// does not say (a checkpoint from before the record, bags written by other tools).
Status check_bag_encoder(const std::string& state_file, const nlohmann::json& state, const BagDataset& ds) {
  if (!state.contains("encoder") || !ds.encoder().known()) return slide::core::ok_status();
  const nlohmann::json& e = state["encoder"];
  const BagEncoder trained{e["model"].get<std::string>(), e["layer"].get<std::string>(),
                           e["weights_sha256"].get<std::string>()};
  if (trained == ds.encoder()) return slide::core::ok_status();
  return slide::core::invalid_argument(state_file + ": the model was trained on features of " + trained.describe() +
                                       "; the bags given hold features of " + ds.encoder().describe() +
                                       " (embed the slides with the checkpoint's encoder)");
}

// slide id -> slide file, from the slide records of tile stores (the stores the bags came from).
Result<std::map<std::string, std::string>> slide_paths(const std::vector<std::string>& stores) {
  std::map<std::string, std::string> out;
  for (const std::string& dir : stores) {
    SLIDE_ASSIGN_OR_RETURN(auto reader, slide::tile::StoreReader::open(dir));
    for (const auto& rec : reader->slides()) out.emplace(rec.slide_id, rec.path);
  }
  return out;
}

// The heatmap of one bag: over its slide's thumbnail when the slide file is known and opens
// (1024 px on the longer side, or about 8 thumbnail px per tile when that is finer, at most 4096
// px), else over the tile grid; titled with the slide id, with a colour bar stating the scale.
// `grid_fallbacks` counts the known slides that could not be drawn (e.g. patch images).
Status write_heatmap(const std::string& png, const std::vector<float>& attention, const std::vector<int32_t>& coords,
                     const slide::cache::BagAttributes& bag, const std::string& slide_path, int64_t* grid_fallbacks) {
  const std::string title = "attention: " + bag.slide_id;
  const int64_t tile_l0_px = bag.tile_size_l0_px;
  if (!slide_path.empty()) {
    // The slide the bag's tiles were cut from: its level-0 size is the bag's record.
    auto canvas = slide::train::heatmap_canvas(slide_path, tile_l0_px, 1024, bag.level0_width, bag.level0_height);
    if (canvas.ok())
      return write_attention_overlay(png, attention, coords, tile_l0_px, canvas->thumbnail, canvas->downsample_x,
                                     canvas->downsample_y, title);
    slide::core::log_debug("heatmap over the tile grid", {{"why", canvas.status().to_string()}});
    ++*grid_fallbacks;
  }
  return write_attention_heatmap(png, attention, coords, tile_l0_px, 8, title);
}

// The final model over every bag: per-bag attention file and heatmap, written as each bag is scored
// (one bag's attention held at a time, whatever the cohort), and predictions.csv at the end.
Result<EpochStats> write_attention_outputs(Backend& be, Abmil& model, const BagDataset& ds,
                                           const std::vector<std::string>& split, const std::string& dir, int prefetch,
                                           const std::vector<std::string>& slide_stores) {
  SLIDE_ASSIGN_OR_RETURN(const auto paths, slide_paths(slide_stores));
  int64_t grid_fallbacks = 0;
  SLIDE_RETURN_IF_ERROR(slide::core::make_dirs(dir));
  std::vector<size_t> all(ds.bags().size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  const auto& classes = ds.class_names();
  const size_t k = classes.size();
  std::string csv = "slide_id,split,label,tiles";
  for (const auto& c : classes) csv += "," + slide::core::csv_quote("p_" + c);
  csv += ",predicted,attention_file,heatmap\n";
  auto write_bag = [&](size_t i, const float* p, const std::vector<float>& attention) -> Status {
    const BagRef& bag = ds.bags()[i];
    const auto pred = static_cast<size_t>(std::max_element(p, p + k) - p);
    // One open of the bag for its coordinates and its attributes (the heatmap's slide size).
    SLIDE_ASSIGN_OR_RETURN(auto reader, slide::cache::BagReader::open(bag.path));
    std::vector<int32_t> coords(static_cast<size_t>(reader->num_tiles()) * 2);
    SLIDE_RETURN_IF_ERROR(reader->read_coords(0, reader->num_tiles(), coords));
    const std::string h5 = slide::cache::bag_file_name(bag.slide_id);
    const std::string png = fs::path(h5).stem().string() + ".png";
    const std::string label = bag.label == kNoLabel ? "" : classes[static_cast<size_t>(bag.label)];
    SLIDE_RETURN_IF_ERROR(write_attention_h5(dir + "/" + h5, bag.slide_id, label, classes[pred],
                                             std::vector<double>(p, p + k), attention, coords));
    const auto path = paths.find(bag.slide_id);
    std::string heatmap = png;
    if (Status s = write_heatmap(dir + "/" + png, attention, coords, reader->info().attributes,
                                 path == paths.end() ? "" : path->second, &grid_fallbacks);
        !s.ok()) {
      SLIDE_RETURN_IF_ERROR(slide::apps::skip_undrawable_heatmap(s, bag.slide_id, "no heatmap for this slide"));
      heatmap.clear();  // its row's heatmap column stays empty
    }
    // The full slide id and the class names (quoted as RFC 4180 where needed: a class may hold a comma);
    // file names follow slide_file_stem.
    std::string line =
        slide::core::csv_quote(bag.slide_id) + "," + split[i] + "," + slide::core::csv_quote(label) + "," +
        std::to_string(bag.tiles);
    for (size_t c = 0; c < k; ++c) line += "," + slide::apps::probability_text(p[c]);
    csv += line + "," + slide::core::csv_quote(classes[pred]) + "," + slide::core::csv_quote(h5) + "," +
           slide::core::csv_quote(heatmap) + "\n";
    return slide::core::ok_status();
  };
  SLIDE_ASSIGN_OR_RETURN(EpochStats st, evaluate_mil(be, model, ds, all, prefetch, nullptr, write_bag));
  SLIDE_RETURN_IF_ERROR(slide::core::write_file_atomic(dir + "/predictions.csv", csv));
  if (grid_fallbacks > 0)
    slide::core::log_warn("some slides could not be opened for their thumbnail: heatmaps over the tile grid instead "
                          "(their ids at debug level)",
                          {{"slides", grid_fallbacks}});
  return st;
}


}  // namespace

void add_mil_options(CLI::App& app, MilOptions* o) {
  app.add_option("--features", o->features,
                 "Feature-bag directories (slide-embed output: <slide>.h5 and bags.csv): train attention MIL "
                 "(ABMIL, gated) on slide labels instead of a tile CNN")
      ->check(CLI::ExistingDirectory);
  app.add_option("--mil-hidden", o->hidden, "ABMIL: width of the first fully connected layer")->capture_default_str()
      ->check(slide::apps::positive_number());
  app.add_option("--mil-attention", o->attention, "ABMIL: width of the gated attention")->capture_default_str()
      ->check(slide::apps::positive_number());
  app.add_option("--mil-dropout", o->dropout, "ABMIL: dropout after the first layer in training (CLAM uses 0.25)")
      ->capture_default_str()->check(number_option("mil-dropout"));
  app.add_option("--prefetch", o->prefetch, "MIL: bags read ahead of the one in compute when streaming")
      ->capture_default_str()->check(slide::apps::non_negative_number());
  app.add_option("--attention-dir", o->attention_dir,
                 "MIL: where the per-slide attention (.h5) and heatmaps (.png) go (default: OUT/attention)");
  app.add_flag("--no-attention", o->no_attention, "MIL: do not write attention files and heatmaps at the end");
  app.add_option("--slide-stores", o->slide_stores,
                 "MIL: the tile stores the bags were embedded from: heatmaps are drawn over each slide's thumbnail "
                 "(else over the tile grid)")
      ->check(CLI::ExistingDirectory);
}

int run_mil_training(const CLI::App& app, MilOptions o, const std::atomic<bool>* cancel) {
  for (const char* tile_only : {"--data", "--val-data", "--model", "--width", "--accumulate", "--no-augment", "--color-jitter",
                                "--random-resized-crop", "--stain-augment", "--dist", "--sync-bn", "--bucket-mb",
                                "--no-overlap", "--dist-timeline", "--checkpoint-activations",
                                "--offload-activations", "--dry-run",
                                "--global-batch",
                                // Tile training's split, precision and fine-tuning options: not built for bags.
                                "--folds", "--fold", "--test-fraction", "--test-data", "--precision", "--activations",
                                "--channels-last", "--init", "--freeze", "--lr-backbone", "--stain-normalize"}) {
    const CLI::Option* opt = app.get_option_no_throw(tile_only);
    if (opt != nullptr && opt->count() > 0) {
      std::fprintf(stderr, "slide-train: %s does not apply to --features (attention MIL on bags)\n", tile_only);
      return kExitUsage;
    }
  }
  auto take = [&](const char* name, auto* value) {
    const CLI::Option* opt = app.get_option_no_throw(name);
    if (opt != nullptr && opt->count() > 0) *value = opt->as<std::decay_t<decltype(*value)>>();
  };
  take("--best-metric", &o.best_metric);
  take("--labels", &o.labels_csv), take("--out", &o.out), take("--optimizer", &o.optimizer);
  take("--schedule", &o.schedule), take("--backend", &o.backend), take("--memory-budget", &o.budget);
  take("--cache", &o.cache), take("--class-weights", &o.class_weights), take("--epochs", &o.epochs);
  take("--keep", &o.keep), take("--batch-size", &o.batch), take("--lr", &o.lr), take("--momentum", &o.momentum);
  take("--weight-decay", &o.weight_decay), take("--warmup-epochs", &o.warmup_epochs);
  take("--label-smoothing", &o.label_smoothing), take("--val-fraction", &o.val_fraction), take("--seed", &o.seed);
  take("--nesterov", &o.nesterov), take("--resume", &o.resume), take("--overwrite", &o.overwrite);
  take("--stratify", &o.stratify);
  int device = -1;  // --device (a sweep's --devices gives each trial one)
  take("--device", &device);
  if (const CLI::Option* mil_dropout = app.get_option_no_throw("--mil-dropout");
      mil_dropout == nullptr || mil_dropout->count() == 0)
    take("--dropout", &o.dropout);  // tile training's --dropout means the same here
  if (o.out.empty()) {
    std::fprintf(stderr, "slide-train: --out is required\n");
    return kExitUsage;
  }
  // --batch-size auto (0) sizes tile batches by the memory budget; a MIL step is bags, counted.
  if (o.batch < 1)
    return fail(slide::core::invalid_argument("--batch-size " + std::to_string(o.batch) +
                                              " with --features: give a number of bags per step (auto is for tiles)"));
  // One writer per --out for the whole run; an earlier run there needs --resume or --overwrite.
  auto out_lock = claim_out_dir(o.out, o.resume, o.overwrite);
  if (!out_lock.ok()) return fail(out_lock.status());
  // Any backend, as the other tools open it (backend_options.h); on a device the model is moved
  // there and the bags are uploaded one at a time (mil.h).
  if (!o.no_attention)
    if (auto s = refuse_features_dir(o.attention_dir.empty() ? o.out + "/attention" : o.attention_dir, o.features,
                                     "--attention-dir");
        !s.ok())
      return fail(s);
  auto be = open_backend(o.backend, device);
  if (!be.ok()) return fail(be.status());
  Allocator& alloc = (*be)->allocator();  // the host's on cpu and reference, the device's on cuda
  auto budget_bytes = slide::apps::parse_memory_budget(o.budget);
  if (!budget_bytes.ok()) return fail(budget_bytes.status());
  alloc.set_budget_bytes(*budget_bytes);
  auto ds = BagDataset::open(o.features, o.labels_csv);
  if (!ds.ok()) return fail(ds.status().with_context("--features"));
  std::vector<size_t> train, val;
  (*ds)->split(o.val_fraction, o.seed, &train, &val, o.stratify);
  if (train.empty()) return fail(slide::core::invalid_argument("no training bags after the split"));
  const auto classes = static_cast<int64_t>((*ds)->class_names().size());
  // As tile training's: a class with no bag on one side of the split by slide or patient.
  slide::apps::warn_classes_missing_from_split((*ds)->class_names(), train, val,
                                               [&](size_t i) { return (*ds)->bags()[i].label; }, "bag", o.seed);

  AbmilConfig mc;
  mc.in_features = (*ds)->feature_dim();
  mc.hidden = o.hidden;
  mc.attention = o.attention;
  mc.classes = classes;
  mc.dropout = o.dropout;
  auto model = Abmil::make(cpu_allocator(), DType::kF32, mc, o.seed);
  if (!model.ok()) return fail(model.status());
  if (auto s = move_to_device(**be, **model); !s.ok()) return fail(s);
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*model)->collect("", &params, &buffers);
  OptimizerConfig oc;
  oc.name = o.optimizer;
  oc.momentum = o.momentum;
  oc.nesterov = o.nesterov;
  oc.weight_decay = o.weight_decay;
  auto opt = Optimizer::make(oc, params, alloc);
  if (!opt.ok()) return fail(opt.status());
  const int64_t steps_per_epoch = (static_cast<int64_t>(train.size()) + o.batch - 1) / o.batch;
  Schedule sched;
  sched.kind = o.schedule;
  sched.base_lr = o.lr;
  sched.warmup_steps = static_cast<int64_t>(o.warmup_epochs * static_cast<double>(steps_per_epoch));
  sched.total_steps = steps_per_epoch * o.epochs;
  sched.step_size = std::max<int64_t>(1, sched.total_steps / 3);
  if (o.schedule != "cosine" && o.schedule != "step" && o.schedule != "constant")
    return fail(slide::core::invalid_argument("schedule '" + o.schedule + "' is not one of cosine, step, constant"));
  if (o.cache != "auto" && o.cache != "ram" && o.cache != "none")
    return fail(slide::core::invalid_argument("--cache '" + o.cache + "' is not one of auto, ram, none"));
  auto weights = parse_class_weights(o.class_weights, **ds, train);
  if (!weights.ok()) return fail(weights.status());
  // A step's loss is divided by the sum of its bags' weights (PyTorch's mean reduction): with one
  // bag a step, that is the bag's own weight, and the weights cancel (but for label smoothing's term,
  // which weighs each class by its own weight).
  if (weights->defined() && o.batch == 1 && o.label_smoothing == 0)
    slide::core::log_warn("--class-weights change nothing with --batch-size 1: a step's loss is divided by the sum of "
                          "its bags' weights, its one bag's (PyTorch's mean reduction); give --batch-size 2 or more",
                          {{"class_weights", o.class_weights}});

  // The allocator keeps freed blocks by size for reuse; bags of different sizes would fill that
  // cache with blocks of sizes never seen again, so it is bounded by two bags' worth of
  // activations (features, hidden, gates, gradients: about D + 4 L + 6 A floats per tile).
  {
    const size_t per_tile = static_cast<size_t>(mc.in_features + 4 * mc.hidden + 6 * mc.attention) * sizeof(float);
    const size_t bag_bytes = per_tile * static_cast<size_t>((*ds)->max_tiles());
    cpu_allocator().set_cache_limit_bytes(std::max<size_t>(size_t{16} << 20, 2 * bag_bytes));
  }
  // Bags in RAM when they fit in half of the budget left (or of the available memory): the
  // dataset-pinning idea; otherwise streamed from HDF5 with a bounded prefetch.
  if (o.cache != "none") {
    const size_t budget_left =
        cpu_allocator().budget_bytes() == Allocator::kUnlimited
            ? static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE))
            : cpu_allocator().budget_bytes() - std::min(cpu_allocator().budget_bytes(), cpu_allocator().current_bytes());
    if (o.cache == "ram" || (*ds)->feature_bytes() <= budget_left / 2) {
      if (auto s = (*ds)->cache_in_ram(cpu_allocator()); !s.ok()) {
        // Only a cache that does not fit falls back to streaming; a bad bag is an error either way.
        if (o.cache == "ram" || s.code() != slide::core::StatusCode::kResourceExhausted)
          return fail(s.with_context("--cache " + o.cache));
        slide::core::log_warn("bags not cached in RAM", {{"why", s.to_string()}});
      } else {
        slide::core::log_info("bags cached in RAM", {{"bytes", static_cast<int64_t>((*ds)->feature_bytes())}});
      }
    }
  }

  const std::string ckpt_dir = o.out + "/checkpoints";
  if (auto s = o.overwrite ? remove_earlier_run(o.out) : slide::core::ok_status(); !s.ok()) return fail(s);
  if (auto s = slide::core::make_dirs(ckpt_dir); !s.ok()) return fail(s);
  const nlohmann::json mil = {{"in_features", mc.in_features}, {"hidden", mc.hidden}, {"attention", mc.attention}, {"dropout", mc.dropout}};
  nlohmann::json state = {{"epoch", 0}, {"step_in_epoch", 0}, {"optimizer_steps", 0}, {"model", "abmil"},
                          {"mil", mil}, {"classes", (*ds)->class_names()}, {"history", nlohmann::json::array()},
                          {"best_val_balanced_accuracy", -1.0}, {"epochs", o.epochs}};
  // What changes the math of a run (the model's sizes are "mil"): --resume refuses other values.
  nlohmann::json config = {{"optimizer", o.optimizer}, {"lr", o.lr}, {"momentum", o.momentum},
                                 {"nesterov", o.nesterov}, {"weight_decay", o.weight_decay}, {"schedule", o.schedule},
                                 {"warmup_epochs", o.warmup_epochs}, {"label_smoothing", o.label_smoothing},
                                 {"batch_size", o.batch}, {"seed", o.seed}, {"class_weights", o.class_weights},
                                 {"val_fraction", o.val_fraction}, {"labels", o.labels_csv},
                                 {"best_metric", o.best_metric}};
  if (o.stratify) config["stratify"] = true;  // recorded when given: an earlier run's config stays as it was
  state["config"] = config;
  // The encoder of the bags' features: evaluate, predict and --resume refuse bags of another.
  const nlohmann::json encoder = encoder_json((*ds)->encoder());
  if (!encoder.is_null()) state["encoder"] = encoder;
  // The bags on each side of the split, which --resume must find again.
  std::vector<std::pair<std::string, std::string>> parts;
  for (size_t i : train) parts.emplace_back((*ds)->bags()[i].slide_id, "train");
  for (size_t i : val) parts.emplace_back((*ds)->bags()[i].slide_id, "val");
  auto split_rec = slide::apps::split_record(std::move(parts));
  if (!split_rec.ok()) return fail(split_rec.status());
  state["split"] = *split_rec;
  // Every bag's (slide, class): --resume refuses other labels under the same slides.
  std::map<std::pair<std::string, std::string>, int64_t> label_counts;
  for (const auto& b : (*ds)->bags()) ++label_counts[{b.slide_id, (*ds)->class_names()[b.label]}];
  auto labels_rec = slide::apps::labels_record(label_counts);
  if (!labels_rec.ok()) return fail(labels_rec.status());
  state["labels"] = *labels_rec;
  if (o.resume) {
    const std::vector<fs::path> checkpoints = list_checkpoints(ckpt_dir);
    if (checkpoints.empty()) return fail(slide::core::not_found("--resume: no complete checkpoint in " + ckpt_dir));
    const std::string latest = checkpoints.back().string();
    auto record = open_checkpoint_record(latest);
    if (!record.ok()) return fail(record.status().with_context("--resume"));
    const nlohmann::json& saved = record->state;
    if (saved["model"] != "abmil" || saved["classes"] != state["classes"] || saved["mil"] != mil)
      return fail(slide::core::invalid_argument(latest + ": made with another model, size or class list"));
    if (auto s = check_bag_encoder(latest + "/state.json", saved, **ds); !s.ok()) return fail(s);
    if (auto s = check_resume_config(latest, saved, config, o.epochs); !s.ok()) return fail(s);
    if (auto s = slide::apps::check_resume_split(latest, saved, *split_rec); !s.ok()) return fail(s);
    if (auto s = slide::apps::check_resume_labels(latest, saved, *labels_rec); !s.ok()) return fail(s);
    if (auto s = slide::apps::check_resume_step(latest, saved, steps_per_epoch); !s.ok()) return fail(s);
    if (auto s = load_safetensors(latest + "/model.safetensors", named(params, buffers), be->get()); !s.ok())
      return fail(s);
    std::vector<NamedTensor> opt_state;
    for (auto* b : (*opt)->state()) opt_state.push_back({b->name, &b->value});
    if (!opt_state.empty())
      if (auto s = load_safetensors(latest + "/optimizer.safetensors", opt_state, be->get()); !s.ok()) return fail(s);
    state = saved;
    state["epochs"] = o.epochs;
    state["config"] = config;
    state["split"] = *split_rec;
    state["labels"] = *labels_rec;
    if (!encoder.is_null()) state["encoder"] = encoder;  // a checkpoint from before the record
    (*opt)->set_steps(state["optimizer_steps"].get<int64_t>());
    slide::core::log_info("resumed", {{"checkpoint", latest}});
  }

  slide::core::log_info("training MIL", {{"model", "abmil"}, {"train_bags", static_cast<int64_t>(train.size())},
                                         {"val_bags", static_cast<int64_t>(val.size())}, {"classes", classes},
                                         {"feature_dim", mc.in_features}, {"steps_per_epoch", steps_per_epoch},
                                         {"cached", (*ds)->cached()}, {"backend", o.backend}});
  for (long epoch = state["epoch"].get<long>(); epoch < o.epochs; ++epoch) {
    MilTrainOptions to;
    to.batch_size = o.batch;
    to.prefetch = o.prefetch;
    to.label_smoothing = o.label_smoothing;
    to.class_weights = *weights;
    to.start_step = state["step_in_epoch"].get<int64_t>();
    to.cancel = cancel;
    const double lr_now = sched.at((*opt)->steps());
    auto st = train_mil_epoch(**be, **model, **opt, sched, **ds, train, to, o.seed * 7919 + static_cast<uint64_t>(epoch));
    if (!st.ok()) return fail(st.status().with_context("epoch " + std::to_string(epoch)));
    state["optimizer_steps"] = (*opt)->steps();
    if (!st->completed) {
      state["epoch"] = epoch;
      state["step_in_epoch"] = to.start_step + st->steps;
      if (auto s = save_checkpoint(ckpt_dir, params, buffers, **opt, state, o.keep, be->get()); !s.ok())
        return fail(s);
      slide::core::log_warn("interrupted; checkpoint written, continue with --resume",
                            {{"epoch", epoch}, {"step", state["step_in_epoch"].get<int64_t>()}});
      return kExitInterrupted;
    }
    EpochStats v;
    if (!val.empty()) {
      auto ev = evaluate_mil(**be, **model, **ds, val, o.prefetch);
      if (!ev.ok()) return fail(ev.status().with_context("validation"));
      v = *ev;
    }
    // A resumed epoch's train figures cover only the steps run after the resume.
    state["history"].push_back({{"epoch", epoch + 1}, {"train_loss", st->loss}, {"train_accuracy", st->accuracy},
                                {"val_loss", v.loss}, {"val_accuracy", v.accuracy},
                                {"val_balanced_accuracy", v.balanced_accuracy},
                                {"val_roc_auc", slide::apps::metric_or_null(v.roc_auc)},
                                {"val_recall", slide::apps::metrics_or_null(v.recall)}, {"lr", lr_now}, {"seconds", st->seconds + v.seconds},
                                {"bags_per_s", st->seconds > 0 ? static_cast<double>(st->samples) / st->seconds : 0.0},
                                {"val_confusion", v.confusion}});
    state["epoch"] = epoch + 1;
    state["step_in_epoch"] = 0;
    if (auto s = write_metrics(o.out, state["history"]); !s.ok()) return fail(s);
    if (record_best_epoch(&state, v, o.best_metric, epoch + 1, !val.empty())) {
      if (auto s = save_safetensors(o.out + "/best.safetensors", named(params, buffers), {{"format", "pt"}}, be->get());
          !s.ok())
        return fail(s);
    }
    if (auto s = save_checkpoint(ckpt_dir, params, buffers, **opt, state, o.keep, be->get()); !s.ok()) return fail(s);
    if (auto s = write_train_report(o.out, state, alloc.peak_bytes(), device_name((*be)->device())); !s.ok())
      return fail(s);
    slide::core::log_info("epoch", {{"epoch", epoch + 1}, {"train_loss", st->loss}, {"train_accuracy", st->accuracy},
                                    {"val_loss", v.loss}, {"val_accuracy", v.accuracy},
                                    {"val_balanced_accuracy", v.balanced_accuracy}, {"val_roc_auc", v.roc_auc}});
  }
  if (!o.no_attention) {
    std::vector<std::string> split((*ds)->bags().size(), "train");
    for (size_t i : val) split[i] = "val";
    const std::string dir = o.attention_dir.empty() ? o.out + "/attention" : o.attention_dir;
    if (auto s = write_attention_outputs(**be, **model, **ds, split, dir, o.prefetch, o.slide_stores); !s.ok())
      return fail(s.status().with_context("attention outputs"));
    slide::core::log_info("attention written", {{"dir", dir}, {"bags", static_cast<int64_t>(split.size())}});
  }
  if (slide::core::log_json())
    slide::core::log_info("peak tensor memory",
                          {{"bytes", alloc.peak_bytes()}, {"device", device_name((*be)->device())}});
  else
    std::fprintf(stderr, "peak tensor memory: %zu bytes\n", alloc.peak_bytes());
  return kExitOk;
}

void add_mil_evaluate_options(CLI::App& evaluate, MilEvaluateOptions* o) {
  evaluate.add_option("--features", o->features,
                      "Feature-bag directories: run an attention-MIL checkpoint (slide-train --features) on them")
      ->check(CLI::ExistingDirectory);
  evaluate.add_option("--slide-stores", o->slide_stores,
                      "With --features: tile stores locating the slides, for heatmaps over their thumbnails")
      ->check(CLI::ExistingDirectory);
  // --data (tile stores) is required only without --features.
  if (CLI::Option* data = evaluate.get_option_no_throw("--data"); data != nullptr) data->required(false);
}

int run_mil_evaluate(const std::string& checkpoint, const MilEvaluateOptions& o, const std::string& labels_csv,
                     const std::string& out, const std::string& backend, bool overwrite, bool predict) {
  auto ck = open_checkpoint_record(checkpoint);
  if (!ck.ok()) return fail(ck.status());
  const nlohmann::json& state = ck->state;
  if (state["model"] != "abmil")
    return fail(slide::core::invalid_argument(ck->state_file + ": not a slide-train --features (ABMIL) checkpoint"));
  if (auto s = refuse_features_dir(out, o.features, "--out"); !s.ok()) return fail(s);
  auto out_lock = claim_eval_dir(out, overwrite);
  if (!out_lock.ok()) return fail(out_lock.status());
  const auto classes = state["classes"].get<std::vector<std::string>>();
  auto be = open_backend(backend, -1);
  if (!be.ok()) return fail(be.status());
  auto ds = BagDataset::open(o.features, labels_csv, classes, /*allow_unlabelled=*/predict);
  if (!ds.ok()) return fail(ds.status().with_context("--features"));
  AbmilConfig mc;
  mc.in_features = state["mil"]["in_features"].get<int64_t>();
  mc.hidden = state["mil"]["hidden"].get<int64_t>();
  mc.attention = state["mil"]["attention"].get<int64_t>();
  mc.classes = static_cast<int64_t>(classes.size());
  if ((*ds)->feature_dim() != mc.in_features)
    return fail(slide::core::invalid_argument("the bags have " + std::to_string((*ds)->feature_dim()) +
                                              " features per tile, the checkpoint's model takes " +
                                              std::to_string(mc.in_features)));
  if (auto s = check_bag_encoder(ck->state_file, state, **ds); !s.ok()) return fail(s);
  auto model = Abmil::make(cpu_allocator(), DType::kF32, mc, 0);
  if (!model.ok()) return fail(model.status());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*model)->collect("", &params, &buffers);
  if (auto s = load_safetensors(ck->weights, named(params, buffers)); !s.ok()) return fail(s);
  if (auto s = move_to_device(**be, **model); !s.ok()) return fail(s);
  const std::vector<std::string> split((*ds)->bags().size(), predict ? "predict" : "eval");
  auto st = write_attention_outputs(**be, **model, **ds, split, out, o.prefetch, o.slide_stores);
  if (!st.ok()) return fail(st.status());
  if (!(*ds)->labelled()) {  // predict on new slides: probabilities and attention, no metrics
    slide::core::log_info("predicted", {{"bags", static_cast<int64_t>((*ds)->bags().size())}, {"out", out}});
    return kExitOk;
  }
  const nlohmann::json metrics = {{"bags", st->samples}, {"loss", st->loss}, {"accuracy", st->accuracy},
                                  {"balanced_accuracy", st->balanced_accuracy},
                                  {"roc_auc", slide::apps::metric_or_null(st->roc_auc)},
                                  {"recall", slide::apps::metrics_or_null(st->recall)}, {"classes", classes}, {"checkpoint", ck->weights},
                                  {"confusion", slide::apps::confusion_rows(st->confusion, classes.size())}};
  if (auto s = slide::core::write_file_atomic(out + "/metrics.json", metrics.dump(2) + "\n"); !s.ok()) return fail(s);
  if (auto s = slide::apps::write_eval_report(out, metrics, classes, st->confusion); !s.ok()) return fail(s);
  slide::core::log_info("evaluated", {{"bags", st->samples}, {"accuracy", st->accuracy},
                                      {"balanced_accuracy", st->balanced_accuracy}, {"roc_auc", st->roc_auc}});
  return kExitOk;
}

}  // namespace slide::apps
