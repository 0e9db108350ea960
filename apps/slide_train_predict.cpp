// slide-train evaluate and predict for tile classifiers (slide_train_predict.h).
#include "slide_train_predict.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "slide/core/csv.h"
#include "slide/core/file.h"
#include "slide/core/file_name.h"
#include "slide/core/log.h"
#include "slide/core/thread_pool.h"
#include "slide/tile/store.h"
#include "slide/train/checkpoint.h"
#include "slide/train/embed.h"
#include "slide/train/heatmap.h"
#include "slide/train/predict.h"
#include "slide/train/stain.h"
#include "slide/train/trainer.h"
#include "backend_options.h"
#include "train_common.h"

namespace slide::apps {

namespace {

namespace fs = std::filesystem;
using slide::core::Status;
using namespace slide::train;

int fail(const Status& s) {
  slide::core::log_error(s.to_string());
  return s.code() == slide::core::StatusCode::kInvalidArgument || s.code() == slide::core::StatusCode::kNotFound ? 2
                                                                                                                : 1;
}

// A checkpoint as given: its weights file and the state.json that describes its model.
// A model meets tiles of another size or resolution than it was trained on (state.json's
// tile_size_px and tile_mpp_um, recorded since this version): the predictions are still made,
// with a warning, since a CNN takes any size but its features are tied to the scale it learned.
void warn_on_other_tiles(const nlohmann::json& state, const TileDataset& ds) {
  if (state.contains("tile_size_px") && state["tile_size_px"].is_number_integer() &&
      state["tile_size_px"].get<int64_t>() != ds.tile_size_px())
    slide::core::log_warn("the model was trained on tiles of another size: predictions may be poor",
                          {{"trained_px", state["tile_size_px"].get<int64_t>()}, {"these_px", ds.tile_size_px()}});
  if (!state.contains("tile_mpp_um") || !state["tile_mpp_um"].is_number()) return;
  const double trained = state["tile_mpp_um"].get<double>();
  for (uint32_t s = 0; s < ds.slide_ids().size() && trained > 0; ++s) {
    const double mpp = ds.slide_record(s).tile_mpp_um;
    if (mpp > 0 && std::abs(mpp - trained) > 0.01 * trained) {
      slide::core::log_warn("the model was trained on tiles of another resolution: predictions may be poor",
                            {{"trained_um_per_px", trained}, {"slide", ds.slide_ids()[s]}, {"um_per_px", mpp}});
      return;  // once
    }
  }
}

}  // namespace

int run_tile_inference(const TileInferenceOptions& o, bool predict) {
  const char* mode = predict ? "predict" : "evaluate";
  auto ck = open_checkpoint_record(o.checkpoint);
  if (!ck.ok()) return fail(ck.status());
  const nlohmann::json& state = ck->state;
  if (state["model"] == "abmil")
    return fail(slide::core::invalid_argument("--checkpoint " + o.checkpoint +
                                              " is an attention-MIL model: give its feature bags with --features"));
  auto be = open_backend(o.backend, o.device, o.precision);  // before the output directory is touched
  if (!be.ok()) return fail(be.status());
  auto lock = claim_eval_dir(o.out, o.overwrite);
  if (!lock.ok()) return fail(lock.status());
  const auto classes = state["classes"].get<std::vector<std::string>>();
  auto ds = TileDataset::open(o.data, o.labels, /*allow_unlabelled=*/predict);
  if (!ds.ok()) return fail(ds.status());
  if ((*ds)->unlabelled_tiles_skipped() > 0)
    slide::core::log_info("tiles without a label from the annotations left out",
                          {{"tiles", static_cast<int64_t>((*ds)->unlabelled_tiles_skipped())}});
  // The stores may list the classes in another order, or only some of them: labels are matched by name.
  if (auto s = (*ds)->remap_classes(classes); !s.ok())
    return fail(s.with_context("--data against the checkpoint's classes " + state["classes"].dump()));
  // The training run's stain normalisation (state.json config.stain_normalization), applied to
  // these tiles as it was to the training tiles.
  if (state.contains("config") && state["config"].is_object() && state["config"].contains("stain_normalization")) {
    auto stain = slide::train::stain_target_from_json(state["config"]["stain_normalization"].dump());
    if (!stain.ok())
      return fail(slide::core::data_loss("--checkpoint " + o.checkpoint + ": state.json config.stain_normalization: " +
                                         stain.status().message()));
    if (auto s = (*ds)->set_stain(*stain); !s.ok()) return fail(s);
    slide::core::log_info("stain normalisation from the checkpoint",
                          {{"method", slide::train::stain_method_name(stain->method)}});
  }
  warn_on_other_tiles(state, **ds);
  // Without an initialisation: load_safetensors below overwrites every parameter and buffer (it
  // fails on a missing one).
  auto model = make_tile_model(state["model"].get<std::string>(), static_cast<int64_t>(classes.size()),
                               state.value("width", int64_t{16}), std::nullopt);
  if (!model.ok()) return fail(model.status());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*model)->collect("", &params, &buffers);
  if (auto s = load_safetensors(ck->weights, named(params, buffers)); !s.ok()) return fail(s);
  // The fused path (cpu and cuda): the model's inference graph cut at "fc" (inference_graph.h:
  // batch norm folded into the convolutions, the residual adds and ReLUs fused), built from the
  // host weights and prepared on the backend once; else (--no-fused, the reference backends, or a
  // model the graph does not support) the engine's forward in inference mode.
  std::optional<InferenceGraph> graph;
  if (o.fused && ((*be)->name() == "cpu" || (*be)->name() == "cuda")) {
    auto cut = find_cut(**model, "fc");
    if (!cut.ok()) return fail(cut.status());
    auto g = InferenceGraph::build(**model, *cut);
    if (g.ok()) {
      if (auto s = g->prepare(**be); !s.ok()) return fail(s.with_context("fused inference on " + o.backend));
      graph.emplace(std::move(*g));
    } else if (g.status().code() == slide::core::StatusCode::kUnimplemented) {
      slide::core::log_debug("fused inference does not support this model; using the engine's forward",
                             {{"reason", g.status().to_string()}});
    } else {
      return fail(g.status());
    }
  }
  if (auto s = move_to_device(**be, **model); !s.ok()) return fail(s.with_context("model to " + o.backend));
  std::vector<size_t> all((*ds)->tiles().size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  // The training run's held-out test set, found again with its fraction, seed and stratification
  // (state.json's config); a metric over every tile of stores that a run split would mix in its training slides.
  const nlohmann::json run_config = state.contains("config") && state["config"].is_object() ? state["config"]
                                                                                           : nlohmann::json::object();
  const double run_test_fraction = run_config.value("test_fraction", 0.0);
  if (!predict && o.test_fraction <= 0 && run_test_fraction > 0)
    slide::core::log_warn("the checkpoint's run held out a test set of its stores; without --test-fraction these "
                          "metrics cover every tile given, its training and validation tiles too where these are "
                          "its stores",
                          {{"run_test_fraction", run_test_fraction}});
  if (o.test_fraction > 0) {
    uint64_t seed = o.seed;
    if (!o.seed_given && run_config.contains("seed") && run_config["seed"].is_number_unsigned())
      seed = run_config["seed"].get<uint64_t>();
    if (run_test_fraction > 0 && run_test_fraction != o.test_fraction)
      slide::core::log_warn("--test-fraction is not the run's: these tiles are not the test set it held out",
                            {{"test_fraction", o.test_fraction}, {"run_test_fraction", run_test_fraction}});
    if (run_config.contains("seed") && run_config["seed"] != nlohmann::json(seed))
      slide::core::log_warn("--seed is not the run's: these tiles are not the test set it held out",
                            {{"seed", seed}, {"run_seed", run_config["seed"].dump()}});
    (*ds)->hold_out(o.test_fraction, seed, &all, run_config.value("stratify", false));
    if (all.empty()) return fail(slide::core::invalid_argument("--test-fraction " + std::to_string(o.test_fraction) +
                                                              " holds out no slide of these stores"));
  }
  slide::core::ThreadPool pool(static_cast<size_t>(std::max(1, o.threads)));
  std::vector<float> probs;
  const LogitsFn logits = [&](const Tensor& images) -> Result<Tensor> {
    if (graph.has_value()) return graph->run(**be, images);
    return (*model)->forward(**be, images, false);
  };
  // Metrics when every tile has a label (evaluate refuses a slide without one); probabilities
  // only otherwise. Both give the same probabilities for the same batch size.
  const bool labelled = (*ds)->labelled();
  auto st = labelled ? evaluate(**be, logits, **ds, all, o.batch, &pool, &probs)
                     : slide::train::predict(**be, logits, **ds, all, o.batch, &pool, &probs);
  if (!st.ok()) return fail(st.status());
  if (auto s = slide::core::make_dirs(o.out); !s.ok()) return fail(s);
  // An earlier prediction's files, all of them before anything is written: its per-slide files
  // (slides that are gone must not stay), and its tables and metrics, which this run may not write
  // (an unlabelled run writes no metrics.json or report.html) or, interrupted, may not reach.
  if (o.overwrite)
    for (const char* d : {"predictions", "heatmaps", "predictions.csv", "slides.csv", "metrics.json", "report.html"}) {
      std::error_code ec;
      fs::remove_all(o.out + "/" + d, ec);
      if (ec) return fail(slide::core::errno_status(ec.value(), "--overwrite: remove " + o.out + "/" + d));
    }
  if (predict)  // the per-slide files' directories, once
    for (const char* d : {"predictions", "heatmaps"}) {
      if (!o.heatmaps && std::string(d) == "heatmaps") continue;
      if (auto s = slide::core::make_dirs(o.out + "/" + d); !s.ok()) return fail(s);
    }

  const size_t k = classes.size();
  const int64_t S = (*ds)->tile_size_px();
  std::string tiles_csv = "slide_id,x_l0,y_l0,label", slides_csv = "slide_id,label,tiles";
  for (const auto& c : classes)  // class names as RFC 4180 fields: a class may hold a comma or a quote
    tiles_csv += "," + slide::core::csv_quote("p_" + c), slides_csv += "," + slide::core::csv_quote("mean_p_" + c);
  tiles_csv += ",predicted\n";
  slides_csv += predict ? ",predicted_by_mean,predicted_by_majority,predictions_file,heatmaps\n"
                        : ",predicted_by_mean,predicted_by_majority\n";
  struct SlideAgg {
    int32_t label = kNoLabel;
    std::vector<size_t> tiles;  // positions, in tile order
    std::vector<double> sum;
    std::vector<int64_t> votes;
  };
  auto class_name = [&](int32_t label) { return label == kNoLabel ? std::string() : classes[static_cast<size_t>(label)]; };
  std::vector<SlideAgg> slides((*ds)->slide_ids().size());
  std::vector<int32_t> xy(2 * all.size());
  for (size_t i = 0; i < all.size(); ++i) {  // row i of probs is tile all[i]
    const TileRef& ref = (*ds)->tiles()[all[i]];
    slide::tile::TileHeader h;
    if (auto s = (*ds)->tile_header(all[i], &h); !s.ok()) return fail(s);
    xy[2 * i] = static_cast<int32_t>(h.x_l0), xy[2 * i + 1] = static_cast<int32_t>(h.y_l0);
    const float* p = probs.data() + i * k;
    const auto pred = static_cast<size_t>(std::max_element(p, p + k) - p);
    std::string line = slide::core::csv_quote((*ds)->slide_ids()[ref.slide]) + "," + std::to_string(h.x_l0) + "," +
                       std::to_string(h.y_l0) + "," + slide::core::csv_quote(class_name(ref.label));
    for (size_t c = 0; c < k; ++c) line += "," + probability_text(p[c]);
    tiles_csv += line + "," + slide::core::csv_quote(classes[pred]) + "\n";
    SlideAgg& a = slides[ref.slide];
    // The slide's label: its tiles' when they all have the same one (a slide label, or a store
    // whose tiles are labelled from annotations with one class); none when they differ.
    if (a.sum.empty()) a.sum.assign(k, 0.0), a.votes.assign(k, 0), a.label = ref.label;
    else if (a.label != ref.label) a.label = kNoLabel;
    a.tiles.push_back(i);
    for (size_t c = 0; c < k; ++c) a.sum[c] += p[c];
    ++a.votes[pred];
  }
  int64_t grid_fallbacks = 0;
  std::set<std::string> used_stems;  // the per-slide files' stems written so far
  for (uint32_t s = 0; s < slides.size(); ++s) {
    const SlideAgg& a = slides[s];
    if (a.tiles.empty()) continue;
    std::string line = slide::core::csv_quote((*ds)->slide_ids()[s]) + "," + slide::core::csv_quote(class_name(a.label)) +
                       "," + std::to_string(a.tiles.size());
    for (size_t c = 0; c < k; ++c) line += "," + std::to_string(a.sum[c] / static_cast<double>(a.tiles.size()));
    const auto by_mean = static_cast<size_t>(std::max_element(a.sum.begin(), a.sum.end()) - a.sum.begin());
    const auto by_vote = static_cast<size_t>(std::max_element(a.votes.begin(), a.votes.end()) - a.votes.begin());
    line += "," + slide::core::csv_quote(classes[by_mean]) + "," + slide::core::csv_quote(classes[by_vote]);
    if (predict) {
      // The slide's own files: its tiles' probabilities and coordinates, and a heatmap per class.
      const slide::tile::SlideRecord& rec = (*ds)->slide_record(s);
      SlidePredictions sp;
      sp.slide_id = rec.slide_id;
      sp.label = class_name(a.label);
      sp.classes = classes;
      sp.checkpoint = ck->weights;
      sp.tile_size_px = static_cast<int32_t>(S);
      sp.tile_size_l0_px = slide::tile::tile_size_level0_px(rec, S);
      sp.mpp_um = rec.tile_mpp_um;
      for (size_t i : a.tiles) {
        sp.probs.insert(sp.probs.end(), probs.begin() + static_cast<long>(i * k), probs.begin() + static_cast<long>((i + 1) * k));
        sp.coords.push_back(xy[2 * i]), sp.coords.push_back(xy[2 * i + 1]);
      }
      // Slides of different stores may share an id: the second store's files get its index.
      const uint32_t store = (*ds)->slide_store(s);
      const std::string base =
          slide::core::slide_file_stem(rec.slide_id) + (store > 0 ? "@" + std::to_string(store) : "");
      // Ids can still meet ("a@1" in the first store, "a" in the second): a stem already written
      // gets "#<slide index>", so that no slide's files replace another's.
      std::string stem = base;
      for (int k = 0; !used_stems.insert(stem).second; ++k)
        stem = base + "#" + std::to_string(s) + (k > 0 ? "." + std::to_string(k) : "");
      const std::string h5 = "predictions/" + stem + ".h5";
      if (auto st2 = write_predictions_h5(o.out + "/" + h5, sp); !st2.ok()) return fail(st2);
      std::string maps;
      if (o.heatmaps) {
        auto canvas = rec.vendor == "patch" ? Result<HeatmapCanvas>(slide::core::invalid_argument("a patch image"))
                                            : heatmap_canvas(rec.path, sp.tile_size_l0_px, 1024, rec.width_l0, rec.height_l0);
        if (!canvas.ok()) {
          slide::core::log_debug("heatmap over the tile grid", {{"slide", rec.slide_id}, {"why", canvas.status().to_string()}});
          ++grid_fallbacks;
        }
        auto files = write_class_heatmaps(o.out + "/heatmaps/" + stem, sp, canvas.ok() ? &*canvas : nullptr);
        if (files.ok()) {
          for (const auto& f : *files) maps += (maps.empty() ? "" : ";") + ("heatmaps/" + f);
        } else if (auto s = slide::apps::skip_undrawable_heatmap(files.status(), rec.slide_id,
                                                                 "no heatmaps for this slide");
                   !s.ok()) {
          return fail(s);
        }
      }
      line += "," + slide::core::csv_quote(h5) + "," + slide::core::csv_quote(maps);
    }
    slides_csv += line + "\n";
  }
  if (grid_fallbacks > 0)
    slide::core::log_info("heatmaps over the tile grid for slides whose file could not be opened (patch images, "
                          "moved slides; their ids at debug level)",
                          {{"slides", grid_fallbacks}});
  nlohmann::json metrics = {{"tiles", st->samples}, {"classes", classes}, {"checkpoint", ck->weights},
                            {"inference", graph.has_value() ? "fused" : "engine"},
                            {"seconds", st->seconds}, {"tiles_per_s", st->samples / std::max(1e-9, st->seconds)}};
  if (labelled) {
    metrics["loss"] = st->loss, metrics["accuracy"] = st->accuracy;
    metrics["balanced_accuracy"] = st->balanced_accuracy, metrics["recall"] = metrics_or_null(st->recall);
    metrics["roc_auc"] = metric_or_null(st->roc_auc);
    metrics["confusion"] = slide::apps::confusion_rows(st->confusion, classes.size());
  }
  std::vector<std::pair<std::string, std::string>> files = {{"/predictions.csv", tiles_csv}, {"/slides.csv", slides_csv}};
  if (labelled) files.push_back({"/metrics.json", metrics.dump(2) + "\n"});
  for (const auto& [name, body] : files)
    if (auto s = slide::core::write_file_atomic(o.out + name, body); !s.ok()) return fail(s);
  if (labelled)
    if (auto s = slide::apps::write_eval_report(o.out, metrics, classes, st->confusion); !s.ok()) return fail(s);
  if (labelled)
    slide::core::log_info(mode, {{"tiles", st->samples}, {"accuracy", st->accuracy},
                                 {"balanced_accuracy", st->balanced_accuracy}, {"roc_auc", st->roc_auc},
                                 {"inference", graph.has_value() ? "fused" : "engine"},
                                 {"tiles_per_s", st->samples / std::max(1e-9, st->seconds)}});
  else
    slide::core::log_info(mode, {{"tiles", st->samples}, {"slides", static_cast<int64_t>(slides.size())},
                                 {"labels", "none: no metrics"},
                                 {"inference", graph.has_value() ? "fused" : "engine"},
                                 {"tiles_per_s", st->samples / std::max(1e-9, st->seconds)}});
  return 0;
}

}  // namespace slide::apps
