// slide-embed: per-tile features of slide-tile stores into HDF5 feature bags (one per slide), for
// slide-level multiple-instance learning. CLI parsing, signals and exit codes; the work is
// slide::train::embed_stores (libtrain/include/slide/train/embed.h).
#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdio>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "exit_codes.h"
#include "backend_options.h"
#include "log_options.h"
#include "stain_options.h"
#include "slide/cache/bag.h"
#include "slide/core/csv.h"
#include "slide/core/dir_lock.h"
#include "slide/core/file.h"
#include "slide/core/hash.h"
#include "slide/core/log.h"
#include "slide/train/embed.h"
#include "slide/train/model_registry.h"
#include "slide/train/stain.h"
#include "slide/train/vit.h"

#include "embed_report.h"
#include "interrupt.h"

namespace {

using slide::apps::kExitFailed;
using slide::apps::kExitInterrupted;
using slide::apps::kExitOk;
using slide::apps::kExitSomeFailed;
using slide::apps::kExitUsage;

// A second Ctrl-C stops at once: only a .partial bag can be left, which never looks complete.
std::atomic<bool>& g_cancel = slide::apps::interrupt_flag();

// Slide ids from a file: one per line, or a CSV whose header has a `slide_id` column (a slide-tile
// manifest, a labels CSV). Blank and '#' lines are skipped.
slide::core::Result<std::vector<std::string>> read_slide_ids(const std::string& path) {
  auto text = slide::core::read_file(path);
  if (!text.ok()) return text.status().with_context("--slides-file");
  std::vector<std::string> ids;
  std::istringstream in(*text);
  std::string line;
  int column = -1;
  bool first = true;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (slide::core::csv_line_is_blank(line)) continue;
    auto fields = slide::core::split_csv_line(line);
    if (first) {
      first = false;
      for (size_t i = 0; i < fields.size(); ++i) {
        if (fields[i] == "slide_id") column = static_cast<int>(i);
      }
      if (column >= 0) continue;  // a header
      if (fields.size() > 1) {
        return slide::core::invalid_argument("--slides-file " + path +
                                             ": several columns but no slide_id header (or one id per line)");
      }
    }
    const size_t c = column >= 0 ? static_cast<size_t>(column) : 0;
    if (c < fields.size() && !fields[c].empty()) ids.push_back(fields[c]);
  }
  if (ids.empty()) return slide::core::invalid_argument("--slides-file " + path + ": no slide ids");
  return ids;
}

int fail(const slide::core::Status& s) {
  slide::core::log_error(s.to_string());
  const auto c = s.code();
  return c == slide::core::StatusCode::kInvalidArgument || c == slide::core::StatusCode::kNotFound ? kExitUsage
                                                                                                   : kExitFailed;
}

}  // namespace

namespace {

int run_main(int argc, char** argv) {
  CLI::App app{"slide-embed: features of every tile of slide-tile stores, from a CNN cut at a layer, into one HDF5 "
               "feature bag per slide (/features N x D, /coords N x 2 level-0 x, y; CLAM/TRIDENT layout). "
               "Resumable: complete bags are skipped, so rerun the same command after a crash or Ctrl-C."};
  app.set_version_flag("--version", std::string("slide-embed ") + SLIDE_VERSION);
  app.set_config("--config", "", "Read options from a TOML/INI file (keys are the long option names)");

  slide::train::EmbedOptions opt;
  std::string weights, model, layer, dtype = "float32", compression = "none";
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int decode_threads = 1;
  slide::apps::LogOptions log;

  app.add_option("stores", opt.stores, "Tile stores (slide-tile output directories)")->required();
  app.add_option("-o,--out", opt.out_dir,
                 "Output directory for the bags (<slide file stem>.h5: the slide id, made safe as a file name), "
                 "bags.csv and writer.lock (created; one slide-embed writes it at a time)")
      ->required();
  app.add_option("--layout", opt.layout,
                 "flat: bags and bags.csv in --out, /coords in TRIDENT's convention; clam: CLAM's DATA_DIR layout, "
                 "bags in OUT/h5_files/ with /coords in CLAM's convention (patch_level, patch_size at that level) "
                 "and OUT/dataset.csv (case_id,slide_id,label)")
      ->capture_default_str()->check(CLI::IsMember({"flat", "clam"}));
  app.add_option("--weights", weights,
                 "A slide-train checkpoint directory (checkpoints/epoch-E-step-S), or a safetensors file with "
                 "torchvision names (scripts/convert_torchvision_weights.py makes one from a .pth)")
      ->required();
  app.add_option("--model", model,
                 "Architecture of a safetensors --weights file: " + slide::train::cnn_family_names() +
                     " (a checkpoint names its "
                 "own); or a Vision Transformer with timm's names, one of " + slide::train::vit_preset_list() +
                     " (vit: any, the architecture read from the weights; uni: UNI, ViT-L/16; uni2-h: UNI2-h, "
                     "ViT-g/14; virchow2: Virchow2, ViT-H/14, class token + mean; gigapath: Prov-GigaPath's tile "
                     "encoder, ViT-g/16; hoptimus0: H-optimus-0, ViT-g/14, its own mean/std; conch-vit-b: CONCH's vision "
                     "tower, ViT-B/16 at 448 px with its attentional pooler, 512-d, OpenAI CLIP mean/std, open_clip "
                     "names visual.trunk.*). Tiles of another size "
                     "than the encoder's input are resized to it (bicubic, antialiased, as PIL)");
  int vit_heads = 0, vit_image_size = 0;
  std::string vit_pool, backend = "cpu", precision = "fp32";
  int device = -1;
  slide::apps::add_backend_options(app, &backend, &device,
                                   " (CNNs: the fused oneDNN path on cpu, the training engine's inference forward on "
                                   "the others)");
  slide::apps::add_precision_option(app, &precision);
  app.add_option("--heads", vit_heads, "ViT: attention heads (default: as timm's ViTs of the width: 16 for 1280 (ViT-H) and 1664 (ViT-G), "
                 "else width / 64)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--image-size", vit_image_size,
                 "ViT: run the encoder at this many px (a multiple of its patch size), its positional embedding "
                 "resampled from the weights' grid as timm does (bicubic, antialiased); tiles are resized to it "
                 "(default: the weights' size)")
      ->check(CLI::Range(1, 65536));
  app.add_option("--pool", vit_pool,
                 "ViT: features from the class token (token, the default), the mean of the patch tokens (mean), both "
                 "concatenated (token+mean, Virchow's), or CoCa's attentional pooler in the weights (attention, "
                 "conch-vit-b's)")
      ->check(CLI::IsMember({"token", "mean", "token+mean", "attention"}));
  app.add_option("--layer", layer, "Cut the model after this layer, then global average pooling (default: layer3 for "
                                   "resnet50, CLAM's 1024-d features; avgpool, the penultimate features, otherwise)");
  std::string slides_file;
  app.add_option("--slides", opt.slide_ids, "Embed only these slide ids (repeatable or comma-separated)")->delimiter(',');
  app.add_option("--slides-file", slides_file, "Embed only the slide ids in this file (one per line, or a CSV with a "
                                               "slide_id column)");
  app.add_option("--batch-size", opt.batch, "Tiles per forward pass")->capture_default_str()->check(CLI::Range(1, 4096));
  app.add_option("--micro-batch", opt.micro_batch,
                 "Tiles per forward pass on the backend, at most --batch-size (default: --batch-size); halved "
                 "whenever a forward pass runs out of memory (the log says so), for the rest of the run")
      ->check(CLI::Range(1, 4096));
  std::string budget;
  app.add_option("--memory-budget", budget,
                 "Memory budget for tensors on the backend's device, e.g. 8G (GPU memory on cuda, the weights "
                 "included; host tensors on cpu); a forward pass that exceeds it runs again in smaller "
                 "micro-batches");
  app.add_option("--dtype", dtype, "Stored feature type: float32 or float16")
      ->capture_default_str()
      ->check(CLI::IsMember({"float32", "float16"}));
  app.add_option("--compression", compression, "HDF5 compression of the bags: none, gzip (deflate with shuffle) or lzf "
                                                "(h5py's LZF filter: faster, a little larger)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "gzip", "lzf"}));
  app.add_option("--chunk-rows", opt.bag.chunk_rows, "Rows per HDF5 chunk (the writer buffers one chunk)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--compute-threads,--threads", threads,
                 "Compute threads (oneDNN's OpenMP threads; --threads: the old name, the last one given counts)")
      ->capture_default_str()->check(CLI::Range(1, 1024))->take_last();
  app.add_option("--decode-threads", decode_threads, "JPEG decode threads, running one batch ahead of compute")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  slide::apps::StainOptions stain_options;
  slide::apps::add_stain_options(app, &stain_options,
                                 "before any resize; each bag records the fitted target (attribute stain_normalization)",
                                 "a bag's stain_normalization attribute");
  slide::apps::add_log_options(app, &log, "one per bag written");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  slide::apps::install_interrupt_handlers(
      "\ninterrupt: discarding the current bag, writing bags.csv (Ctrl-C again to stop now)\n");
  slide::apps::apply_log_options(log);
  omp_set_num_threads(threads);

  auto dt = slide::cache::parse_feature_dtype(dtype);
  auto comp = slide::cache::parse_compression(compression);
  if (!dt.ok()) return fail(dt.status());
  if (!comp.ok()) return fail(comp.status());
  opt.bag.dtype = *dt;
  opt.bag.compression = *comp;
  if (!slide::cache::compression_available(*comp)) {
    return fail(slide::core::invalid_argument(std::string("--compression ") + compression +
                                              ": the HDF5 filter is not available here (gzip always is)"));
  }
  if (!slides_file.empty()) {
    auto ids = read_slide_ids(slides_file);
    if (!ids.ok()) return fail(ids.status());
    opt.slide_ids.insert(opt.slide_ids.end(), ids->begin(), ids->end());
  }
  {
    auto stain = slide::apps::stain_target_of(stain_options, "stain normalisation");
    if (!stain.ok()) return fail(stain.status());
    opt.stain = *stain;
  }
  opt.decode_threads = decode_threads;
  opt.progress = !log.quiet;
  opt.cancel = &g_cancel;
  opt.tool_version = std::string("slide-embed ") + SLIDE_VERSION;

  // One writer per output directory, for the whole run (readers of finished bags need no lock).
  // The backend before anything is written: one that cannot start (no GPU, a build without CUDA)
  // is a usage error.
  auto budget_bytes = slide::apps::parse_memory_budget(budget);
  if (!budget_bytes.ok()) return fail(budget_bytes.status());
  auto opened = slide::apps::open_backend(backend, device, precision);
  if (!opened.ok()) return fail(opened.status());
  std::unique_ptr<slide::train::Backend> be = std::move(*opened);
  // The backend's allocator (the GPU's on cuda): its peak while embedding goes into the summary.
  // It lives as long as the backend, which the encoder keeps.
  slide::train::Allocator& backend_alloc = be->allocator();
  backend_alloc.set_budget_bytes(*budget_bytes);
  auto out_lock = slide::core::DirLock::acquire(opt.out_dir, "output directory");
  if (!out_lock.ok()) return fail(out_lock.status());

  std::unique_ptr<slide::train::TileEncoder> encoder;
  slide::train::EmbedModel loaded;
  if (slide::train::is_vit_preset(model)) {
    if (!layer.empty()) return fail(slide::core::invalid_argument("--layer applies to CNNs; a ViT takes --pool"));
    auto vit = slide::train::VitEncoder::load(weights, model, vit_heads, vit_pool, std::move(be), vit_image_size);
    if (!vit.ok()) return fail(vit.status());
    auto sha = slide::core::sha256_file(weights);
    if (!sha.ok()) return fail(sha.status());
    const auto& c = (*vit)->config();
    slide::core::log_info("ViT", {{"width", static_cast<int64_t>(c.width)},
                                  {"depth", static_cast<int64_t>(c.depth)},
                                  {"heads", static_cast<int64_t>(c.heads)},
                                  {"patch", static_cast<int64_t>(c.patch_size)},
                                  {"image", static_cast<int64_t>(c.image_size)},
                                  {"weights_image", static_cast<int64_t>(c.source_image_size > 0 ? c.source_image_size
                                                                                                 : c.image_size)},
                                  {"register_tokens", static_cast<int64_t>(c.reg_tokens)},
                                  {"layer_scale", c.layer_scale ? "yes" : "no"}});
    loaded.model = model;
    loaded.layer = (*vit)->layer();
    loaded.weights_path = weights;
    loaded.weights_sha256 = *sha;
    loaded.attention_heads = static_cast<int32_t>(c.heads);
    encoder = std::move(*vit);
  } else {
    if (vit_heads > 0 || !vit_pool.empty() || vit_image_size > 0)
      return fail(slide::core::invalid_argument("--heads, --pool and --image-size apply to ViTs (--model " +
                                                slide::train::vit_preset_list() + ")"));
    auto cnn = slide::train::load_embed_model(weights, model, layer);
    if (!cnn.ok()) return fail(cnn.status());
    loaded = std::move(*cnn);
    // The inference graph (batch norm folded, ReLU and residual adds fused) on the chosen backend.
    auto extractor = slide::train::FeatureExtractor::create(*loaded.net, loaded.layer, std::move(be));
    if (!extractor.ok()) return fail(extractor.status().with_context("--backend " + backend));
    loaded.net.reset();  // the extractor holds folded copies of the weights
    slide::train::cpu_allocator().trim_cache();  // and the model's blocks go back to the system
    encoder = std::move(*extractor);
  }
  loaded.precision = *slide::train::parse_math_precision(precision);  // checked by open_backend
  backend_alloc.reset_peak();  // from here: the weights the encoder keeps, and the forward passes
  slide::core::log_info("model", {{"model", loaded.model},
                                  {"layer", loaded.layer},
                                  {"precision", slide::train::math_precision_name(loaded.precision)},
                                  {"feature_dim", encoder->feature_dim()},
                                  {"weights_sha256", loaded.weights_sha256},
                                  {"threads", threads}});

  auto summary = slide::train::embed_stores(*encoder, loaded, opt);
  if (!summary.ok()) return fail(summary.status());
  const auto counts = summary->counts();
  const double rate = summary->seconds > 0 ? static_cast<double>(summary->tiles_embedded) / summary->seconds : 0.0;
  slide::core::log_info("summary", {{"bags_written", counts.written},
                                    {"bags_skipped_complete", counts.skipped},
                                    {"slides_without_tiles", counts.empty},
                                    {"slides_failed", summary->failed()},
                                    {"tiles", summary->tiles_embedded},
                                    {"seconds", std::to_string(summary->seconds)},
                                    {"tiles_per_s", std::to_string(rate)},
                                    {"micro_batch", summary->micro_batch},
                                    {"memory_peak_bytes", static_cast<int64_t>(backend_alloc.peak_bytes())}});
  if (summary->oom_reruns > 0)
    slide::core::log_warn("forward passes ran out of memory and were rerun in smaller micro-batches: set "
                          "--micro-batch to this to skip the failed attempts next time",
                          {{"micro_batch", summary->micro_batch}, {"reruns", summary->oom_reruns}});
  for (const auto& s : summary->slides) {
    if (!s.status.ok() && s.status.code() != slide::core::StatusCode::kCancelled) {
      slide::core::log_warn("slide failed", {{"slide", s.slide_id}, {"store", s.store}, {"error", s.status.message()}});
    }
  }
  // report.html beside the bags; its failure is the run's (exit 1) unless interrupted.
  if (auto s = slide::apps::write_embed_report(opt.out_dir, slide::train::bag_directory(opt), loaded, encoder->feature_dim(), *summary); !s.ok()) {
    const int code = fail(s.with_context("report.html"));
    if (!summary->interrupted) return code;
  }
  if (summary->interrupted) return kExitInterrupted;
  if (summary->failed() > 0) return kExitSomeFailed;
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
    std::fprintf(stderr, "%s: internal error: %s\n", "slide-embed", e.what());
  } catch (...) {
    std::fprintf(stderr, "%s: internal error: an unknown exception\n", "slide-embed");
  }
  return 1;
}
